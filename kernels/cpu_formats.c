/*
 * cpu_formats.c -- the traits table of the block formats (cpu_formats.h): one designated-
 * initializer row per format, pointing at the functions of the format's own file(s).  Above
 * the format files (it takes their addresses), below the dispatcher (cpu_dispatch.c reads it
 * through pq_format_of).  Also the table's exports to Python (pf_*): kernels/quant_reference.py
 * reads the formats' names, codes and block sizes from here.
 *
 * A new format: its code and block struct in cpu_formats.h, its kernels in its own file (at
 * least the portable rows and dequant_ref; SIMD tiers when they exist), and one row below.
 */
#include <stddef.h>

#include "cpu_formats.h"
#include "cpu_qgemv.h"
#include "cpu_qgemv_k.h"

#ifdef PQ_X86
#define SIMD(f) f
#else
#define SIMD(f) NULL
#endif
/* The K-quants' portable-tier rows: aarch64 builds with SDOT take the int8 kernels where x was
 * prepared (cpu_qgemv_k.c's rows_k falls back to fp32 where it was not); elsewhere fp32. */
#if PG_NEON_DOT
#define QK_PORTABLE(name) qk_rows_simd_##name
#else
#define QK_PORTABLE(name) qk_rows_float_##name
#endif

static const pq_format_t g_formats[PF_COUNT] = {
    [DT_Q8_0 - DT_Q_FIRST] = {
        .name = "q8_0", .wdt = DT_Q8_0, .block_elems = 32, .block_bytes = sizeof(block_q8_0),
        .dequant_ref = q32_dequant_ref_q8_0,
        .dequant = {[ISA_AVX2] = SIMD(q32_dequant_avx2_q8_0), [ISA_AVX512] = SIMD(q32_dequant_avx512_q8_0)},
        .xa_bytes = q32_xa_bytes, .prep = q32_prep_q8_0, .prep_rows = q32_prep_rows_q8_0, .act_block = q32_act_block_q8_0,
        .rows = {q32_rows_ref_q8_0, SIMD(q32_rows_avx2_q8_0), SIMD(q32_rows_avx512_q8_0), [ISA_AVX512_VNNI] = SIMD(q32_rows_vnni_q8_0)},
    },
    [DT_Q4_0 - DT_Q_FIRST] = {
        .name = "q4_0", .wdt = DT_Q4_0, .block_elems = 32, .block_bytes = sizeof(block_q4_0),
        .dequant_ref = q32_dequant_ref_q4_0,
        .dequant = {[ISA_AVX2] = SIMD(q32_dequant_avx2_q4_0), [ISA_AVX512] = SIMD(q32_dequant_avx512_q4_0)},
        .xa_bytes = q32_xa_bytes, .prep = q32_prep_q4_0, .prep_rows = q32_prep_rows_q4_0, .act_block = q32_act_block_q4_0,
        .rows = {q32_rows_ref_q4_0, SIMD(q32_rows_avx2_q4_0), SIMD(q32_rows_avx512_q4_0), [ISA_AVX512_VNNI] = SIMD(q32_rows_vnni_q4_0)},
    },
    [DT_Q4_1 - DT_Q_FIRST] = {
        .name = "q4_1", .wdt = DT_Q4_1, .block_elems = 32, .block_bytes = sizeof(block_q4_1),
        .dequant_ref = q32_dequant_ref_q4_1,
        .dequant = {[ISA_AVX2] = SIMD(q32_dequant_avx2_q4_1), [ISA_AVX512] = SIMD(q32_dequant_avx512_q4_1)},
        .xa_bytes = q32_xa_bytes, .prep = q32_prep_q4_1, .prep_rows = q32_prep_rows_q4_1, .act_block = q32_act_block_q4_1,
        .rows = {q32_rows_ref_q4_1, SIMD(q32_rows_avx2_q4_1), SIMD(q32_rows_avx512_q4_1), [ISA_AVX512_VNNI] = SIMD(q32_rows_vnni_q4_1)},
    },
    /* The K-quants: one kernel per SIMD tier family entry (cpu_qgemv_k.c picks AVX2 / AVX-512 /
     * VNNI from j->isa), at the portable tier the fp32-dequantize kernel (aarch64 with SDOT: the
     * int8 one, QK_PORTABLE). */
    [DT_Q4_K - DT_Q_FIRST] = {
        .name = "q4_k", .wdt = DT_Q4_K, .block_elems = 256, .block_bytes = sizeof(block_q4_k),
        .dequant_ref = qk_dequant_ref_q4_k, .dequant = {[ISA_AVX2] = SIMD(qk_dequant_simd_q4_k)},
        .xa_bytes = qk_xa_bytes, .prep = qk_prep_q4_k, .act_block = qk_act_block,
        .rows = {QK_PORTABLE(q4_k), SIMD(qk_rows_simd_q4_k)},
    },
    [DT_Q5_K - DT_Q_FIRST] = {
        .name = "q5_k", .wdt = DT_Q5_K, .block_elems = 256, .block_bytes = sizeof(block_q5_k),
        .dequant_ref = qk_dequant_ref_q5_k, .dequant = {[ISA_AVX2] = SIMD(qk_dequant_simd_q5_k)},
        .xa_bytes = qk_xa_bytes, .prep = qk_prep_q5_k, .act_block = qk_act_block,
        .rows = {QK_PORTABLE(q5_k), SIMD(qk_rows_simd_q5_k)},
    },
    [DT_Q6_K - DT_Q_FIRST] = {
        .name = "q6_k", .wdt = DT_Q6_K, .block_elems = 256, .block_bytes = sizeof(block_q6_k),
        .dequant_ref = qk_dequant_ref_q6_k, .dequant = {[ISA_AVX2] = SIMD(qk_dequant_simd_q6_k)},
        .xa_bytes = qk_xa_bytes, .prep = qk_prep_q6_k, .act_block = qk_act_block,
        .rows = {QK_PORTABLE(q6_k), SIMD(qk_rows_simd_q6_k)},
    },
};

__attribute__((visibility("hidden")))
const pq_format_t *pq_format_of(int wdt)
{
    if (wdt < DT_Q_FIRST || wdt >= DT_Q_END)
        return NULL;
    const pq_format_t *f = &g_formats[wdt - DT_Q_FIRST];
    return f->rows[ISA_PORTABLE] ? f : NULL;
}

/* ---- exports to Python (kernels/quant_reference.py): row i of the table, 0 <= i < pf_count() */

int pf_count(void) { return PF_COUNT; }
const char *pf_name(int i) { return i >= 0 && i < PF_COUNT ? g_formats[i].name : NULL; }
int pf_code(int i) { return i >= 0 && i < PF_COUNT ? g_formats[i].wdt : -1; }
int pf_block_elems(int i) { return i >= 0 && i < PF_COUNT ? g_formats[i].block_elems : -1; }
int pf_block_bytes(int i) { return i >= 0 && i < PF_COUNT ? g_formats[i].block_bytes : -1; }
