/*
 * cpu_formats.h -- the weight block formats (GGUF / ggml layouts) and their traits table.
 *
 * One code, one block struct (its size checked against ggml's at compile time) and one row of
 * the table in cpu_formats.c per format.  A row says what the rest of the library needs to run
 * a format: block_elems / block_bytes, the exact portable dequantizer (dequant_ref), how the
 * activations are prepared once per call (xa_bytes, prep), and per ISA tier the row kernel
 * (rows[ISA_COUNT]) and a faster dequantizer (dequant[ISA_COUNT]).  A tier's NULL entry falls
 * back to the next lower tier's, down to the reference (rows[ISA_PORTABLE] / dequant_ref), so a
 * format can start as a reference implementation and gain SIMD tiers one file at a time.
 *
 * The codes, names and block sizes are exported to Python (pf_count, pf_name, pf_code,
 * pf_block_elems, pf_block_bytes in cpu_formats.c): kernels/quant_reference.py reads them from
 * the library instead of writing them a second time.
 *
 * Layering: this header is the contract between the format files below the table
 * (cpu_qgemv*.c, cpu_qgemv_k.c: they include it for the structs and pq_job_t) and the
 * dispatcher above it (cpu_dispatch.c: it reads the table through pq_format_of).
 */
#ifndef PRESCIENT_CPU_FORMATS_H
#define PRESCIENT_CPU_FORMATS_H

#include <stddef.h>
#include <stdint.h>
#include "cpu_runtime.h"

/* Weight dtype codes of the block formats (after DT_F32 / DT_BF16 of cpu_runtime.h).  Weights
 * are [N, K / block_elems] blocks, row-major: row n starts at w + n * (K / block_elems) *
 * block_bytes.  The values are ABI (a pg_weight_t's wdt): append, never renumber. */
enum {
    DT_Q8_0 = DT_Q_FIRST, DT_Q4_0, DT_Q4_1, DT_Q4_K, DT_Q5_K, DT_Q6_K,
    DT_Q_END              /* one past the last format */
};
#define PF_COUNT (DT_Q_END - DT_Q_FIRST)

/* ---- block structs (little-endian; pf_half = IEEE fp16 bits) ---------------------------- */

typedef uint16_t pf_half;

/* 32 weights: w_i = d * q_i. */
typedef struct { pf_half d; int8_t qs[32]; } block_q8_0;
/* 32 weights: w_i = d * (q_i - 8), q_i = qs[i] & 15 (i < 16), qs[i - 16] >> 4 (i >= 16). */
typedef struct { pf_half d; uint8_t qs[16]; } block_q4_0;
/* 32 weights: w_i = d * q_i + m, nibbles as Q4_0. */
typedef struct { pf_half d, m; uint8_t qs[16]; } block_q4_1;
/* 256 weights in 8 sub-blocks of 32: 6-bit scales and mins packed in 12 bytes, nibbles. */
typedef struct { pf_half d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_k;
/* As Q4_K plus the fifth bit of every value. */
typedef struct { pf_half d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_k;
/* 256 weights in 16 sub-blocks of 16: low 4 bits, high 2 bits, int8 scales, fp16 d. */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; pf_half d; } block_q6_k;

/* ggml's block sizes (GGML_QUANT_SIZES): a struct that does not match is a build error. */
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes");
_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1 must be 20 bytes");
_Static_assert(sizeof(block_q4_k) == 144, "block_q4_k must be 144 bytes");
_Static_assert(sizeof(block_q5_k) == 176, "block_q5_k must be 176 bytes");
_Static_assert(sizeof(block_q6_k) == 210, "block_q6_k must be 210 bytes");

/* ---- the row-kernel contract ------------------------------------------------------------ */

/* Layouts of a weight's kernel copy (pg_weight_t.rpl; q32_repack): the block-lane groups of
 * the AVX-512 int8 rows, or the column-lane cells of the VNNI and AVX2 rows (cpu_qgemv.h). */
enum { PQ_RP_GROUPS = 0, PQ_RP_CL = 1 };

typedef struct {
    const uint8_t *w;   /* [N, row_bytes] blocks */
    const uint8_t *rp;  /* NULL, or w regrouped (q32_repack): what the AVX-512 int8 rows read */
    const uint8_t *cl;  /* NULL, or w in the column-lane layout: what the VNNI / AVX2 int8 rows read */
    size_t row_bytes;
    const float *bias;  /* [N] or NULL */
    const float *x;     /* [M, K] fp32 activations */
    const void *xa;     /* the format's prepared activations (prep below), or NULL */
    void *y;            /* [M, N], ydt */
    int ydt;            /* DT_F32 or DT_BF16 */
    int M, N, K;
    int isa;            /* the tier in use (pg_isa()), the one prep ran at */
} pq_job_t;

/* y[m, n] (+ bias[n]) for n0 <= n < n1, all m < M. */
typedef void (*pq_rows_fn)(const pq_job_t *j, int n0, int n1);
/* nblk consecutive blocks at blk -> nblk * block_elems fp32 values, exactly. */
typedef void (*pq_dequant_fn)(const uint8_t *blk, int nblk, float *out);

typedef struct {
    const char *name;     /* the Python name (kernels/quant_reference.py): "q4_0", ... */
    int wdt;              /* DT_Q* */
    int block_elems;      /* weights per block */
    int block_bytes;      /* sizeof(the block struct) */
    pq_dequant_fn dequant_ref;            /* portable C, exact */
    pq_dequant_fn dequant[ISA_COUNT];     /* per tier (NULL: the next lower tier's / dequant_ref) */
    /* Bytes of prepared activations for M x K at the tier in use (0: rows read j->x only,
     * prep is not called and j->xa is NULL). */
    size_t (*xa_bytes)(int M, int K);
    /* Fill xa from x [M, K] fp32, once per call, on the calling thread; cl: for rows that read
     * a column-lane copy (cpu_qgemv.h). */
    void (*prep)(const float *x, int M, int K, void *xa, int isa, int cl);
    /* prep's records of rows [m0, m1) only (and the header where m0 == 0), so that the rows
     * of one call can be prepared by several threads; NULL: prep alone. */
    void (*prep_rows)(const float *x, int M, int K, void *xa, int isa, int cl, int m0, int m1);
    pq_rows_fn rows[ISA_COUNT];           /* per tier (NULL: the next lower tier's) */
    /* How tier isa multiplies the activations: 0 as fp32, n > 0 int8 with one scale per (at
     * most) n elements. */
    int (*act_block)(int isa);
} pq_format_t;

/* The table row of wdt, or NULL (cpu_formats.c). */
__attribute__((visibility("hidden")))
const pq_format_t *pq_format_of(int wdt);

/* A row's entries at tier isa, falling back tier by tier (never NULL for a table row). */
static inline pq_rows_fn pq_rows_at(const pq_format_t *f, int isa)
{
    for (int t = isa < ISA_COUNT ? isa : ISA_COUNT - 1; t > 0; t--)
        if (f->rows[t])
            return f->rows[t];
    return f->rows[ISA_PORTABLE];
}

static inline pq_dequant_fn pq_dequant_at(const pq_format_t *f, int isa)
{
    for (int t = isa < ISA_COUNT ? isa : ISA_COUNT - 1; t >= 0; t--)
        if (f->dequant[t])
            return f->dequant[t];
    return f->dequant_ref;
}

#endif
