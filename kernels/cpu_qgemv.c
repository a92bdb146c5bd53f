/*
 * cpu_qgemv.c -- small-M linear (y = x @ W^T + b, M <= PG_MAX_M) over the 32-element GGUF block
 * formats Q8_0 / Q4_0 / Q4_1, streamed in their blocks: the family's generic reference (the
 * portable row kernel and the exact dequantizer every SIMD tier must match), the activation
 * prep and the float / int8 path choice.  The SIMD tiers are cpu_qgemv_avx2.c and
 * cpu_qgemv_avx512.c; what the three share is cpu_qgemv.h.  The table rows pointing at all of
 * it are in cpu_formats.c; the entry points (pq_linear_w, pq_dequantize_rows/_ids) in
 * cpu_dispatch.c.  The K-quants (Q4_K / Q5_K / Q6_K) are cpu_qgemv_k.c.
 *
 * Block layouts (GGUF / ggml), 32 weights per block, a row of W = K / 32 blocks:
 *   Q8_0  34 B: fp16 d, int8 q[32]                 w_i = d * q_i
 *   Q4_0  18 B: fp16 d, u8 qs[16]                  w_i = d * (q_i - 8)
 *   Q4_1  20 B: fp16 d, fp16 m, u8 qs[16]          w_i = d * q_i + m
 *   (Q4: q_i = qs[i] & 15 for i < 16, q_{i+16} = qs[i] >> 4)
 *
 * Two ways to run a format, both on every x86 tier (cpu_runtime.h) and on aarch64 with SDOT:
 *   float: dequantize a tile of weight rows to fp32 in an L1 buffer (exactly: d * q is exact
 *     in fp32, and Q4_1's d * q + m is one fused rounding, as the reference's mul-then-add),
 *     then FMA it against every input row.  Numerically the fp32 GEMV of the dequantized W.
 *   int8: x is quantized once per call to int8 blocks of 32 with an fp32 scale each
 *     (dx = amax / 127, q = round-to-nearest-even(x / dx)), as llama.cpp's Q8 activations; the
 *     dot products run on integers (AVX-512 VNNI vpdpbusd; vpmaddubsw + vpmaddwd on AVX-512BW
 *     and AVX2), one float multiply-add per block.  The result is exactly sum_i w_i * x^_i with
 *     x^ = dx * q (integer sums are exact; the fp32 steps after them round as usual), so the
 *     error against fp32 activations is bounded by sum over blocks of (dx / 2) * sum |w_i|.
 *     Measured (1536 x 576, Gaussian weights; ||y_int8 - y_fp32|| / ||y_fp32||): 0.53% with
 *     Gaussian activations, 1.1% when 1% of the channels are 20x larger (LLM residual streams
 *     have such outliers; a block holding one loses resolution on its other 31 values), 0.85%
 *     with Student-t(3) activations.  The weight quantization itself costs 8.6% (Q4_0), 7.8%
 *     (Q4_1) and 0.53% (Q8_0) on the same data: negligible next to Q4, comparable for Q8_0.
 *   The int8 layout puts one block in each 32-bit lane (16 blocks a zmm, 8 a ymm), so the 8
 *   dot-product steps of a block accumulate in its own lane and one convert + one FMA scale 16
 *   blocks at once; the weight blocks are transposed to that layout in registers (once per
 *   tile, for every input row), the activations by the prep step.  A row's last K/32 mod 16
 *   blocks, when few, run as pairs in a plain layout instead (fewer dead lanes).
 *   Default per tier: int8 on every SIMD tier (g_auto_int8; pq_set_mode overrides).  Measured
 *   on the 2-core Zen 5 host (one thread, CPU time, weights L2-resident, Python call included;
 *   ns per 32-weight block, float / int8 path, 512 x 1536):
 *                     M = 1                      M = 8
 *                     Q8_0      Q4_0      Q4_1      Q8_0      Q4_0      Q4_1
 *     avx2            2.3/1.7   2.5/1.0   2.5/1.1   7.6/4.7   7.9/3.5   7.8/3.7
 *     avx512 (BW)     1.5/1.0   1.4/0.7   1.5/0.7   3.8/2.8   3.7/1.9   3.8/1.9
 *     avx512_bf16     1.5/0.9   1.4/0.6   1.5/0.7   3.8/1.8   3.7/1.5   3.9/1.7
 *   (portable, fp32 only: 7.2 / 3.8 / 4.0 at M = 1; but aarch64 with the dot-product extension,
 *   whose portable tier runs int8 too: cpu_qgemv_neon.c's SDOT rows on the column-lane copy, the
 *   bits of the x86 int8 rows on it, not yet timed on an Arm core).  On a 2-core Zen 3 EPYC (avx2, one thread,
 *   8192 x 576 Q4_1 L3-resident, Python call included) int8 runs 1.57 ns a block at M = 1 and
 *   4.6 at M = 8, after the AVX2 kernel stopped gathering its scales (vpgatherdd: 1.78 / 4.9).
 *   K = 576 costs ~20% more per block (its
 *   last 2 blocks run as a pair).  One core streams ~20-25 GB/s from DRAM, so at M = 1 two
 *   cores are about at the DRAM limit with int8 and well below it with float.
 *
 * The AVX-512 int8 rows read a regrouped copy of W when the caller made one (pq_repack,
 * q32_repack below, layout PQ_RP_GROUPS: each full 16-block group as the transposes would leave
 * it): the same registers, so the same bits, without the per-row shuffles (an M = 1 row's
 * largest cost once the weights sit in cache: batch-1 decode 1.06x on the Xeon, avx512_bf16).
 * With VNNI the caller makes the column-lane copy instead (PQ_RP_CL, cpu_qgemv.h): the rows of
 * cpu_qgemv_cl.c, 16 output columns in a vector's lanes and one epilogue chain per output --
 * bits of their own (the same at every M), a decode step ~25% and an 8-token verify ~23% faster
 * on the Xeon.  The AVX2 rows read that copy too (vpmaddubsw; the same integer sums and
 * epilogue, so the same bits): an AVX2 decode step ~18% faster, an 8-token verify ~14%.  A
 * weight keeps the copy it got at load, so its order never changes.
 *
 * Row tiles: 4 weight rows x (all M in blocks of up to 4 inputs), each dequantized/transposed
 * weight tile reused for all M input rows from L1; fp32 accumulation; bias; y fp32 or bf16
 * (round to nearest even).  An output's lanes are summed in one fixed order however it is
 * stored (AVX-512: 4 inputs x 4 rows reduced together, a lone input or row apart; the same
 * pairs of additions), so a row's bits do not depend on M or on its tile.  Work is split over
 * the pool of cpu_runtime.c (pg_parallel_for, by cpu_dispatch.c) in row chunks sized as
 * cpu_gemv.c does; matrices under 48 KB run on the caller alone.
 */
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "cpu_qgemv.h"

/* 0: each tier's default (q32_layouts[].auto_int8), 1: float everywhere, 2: int8 wherever it
 * exists. */
static int g_mode = 0;

static int path_for(int wdt, int isa)
{
    if (g_mode == 1)
        return PATH_FLOAT;
    if (isa < ISA_AVX2)  /* the portable tier: int8 only with aarch64's SDOT (cpu_qgemv_neon.c) */
        return PQ_NEON_DOT && pg_neon_dot() ? PATH_INT8 : PATH_FLOAT;
    if (g_mode == 2)
        return PATH_INT8;
    const int t = isa > ISA_AVX512_BF16 ? ISA_AVX512_BF16 : isa;
    return (Q32_L(wdt).auto_int8 >> t) & 1u ? PATH_INT8 : PATH_FLOAT;
}

/* The column-lane layout (cpu_qgemv.h): a cell per (16-column tile, block), zero past N. */
static int repack_cl(int wdt, const uint8_t *w, uint8_t *out, int N, int K)
{
    const int bb = Q32_L(wdt).bb, qoff = Q32_L(wdt).qoff, has_m = Q32_L(wdt).has_m;
    const int nib = Q32_L(wdt).nib, QV = nib ? 4 : 8, nb = K / QK, nt = (N + 15) / 16;
    const size_t row_bytes = (size_t)nb * bb, cb = (size_t)16 * bb;
    memset(out, 0, (size_t)nt * nb * cb);
    for (int n = 0; n < N; n++) {
        const int t = n / 16, c = n % 16;
        for (int b = 0; b < nb; b++) {
            const uint8_t *src = w + (size_t)n * row_bytes + (size_t)b * bb;
            uint8_t *cell = out + ((size_t)t * nb + b) * cb;
            for (int k = 0; k < QV; k++)
                for (int i = 0; i < 4; i++)
                    cell[64 * k + 4 * c + i] = (uint8_t)(src[qoff + 4 * k + i] ^ (nib ? 0 : 0x80));
            memcpy(cell + 64 * QV + 2 * c, src, 2);
            if (has_m)
                memcpy(cell + 64 * QV + 32 + 2 * c, src + 2, 2);
        }
    }
    return 0;
}

size_t q32_repack_bytes(int wdt, int N, int K, int layout)
{
    if (wdt != DT_Q8_0 && wdt != DT_Q4_0 && wdt != DT_Q4_1)
        return 0;
    const size_t row_bytes = (size_t)(K / QK) * Q32_L(wdt).bb;
    return row_bytes * (layout == PQ_RP_CL ? (size_t)(N + 15) / 16 * 16 : (size_t)N);
}

/* The regrouped layout (pq_repack): the AVX-512 int8 rows' full 16-block groups (T groups, V =
 * 16) stored as their registers come out of the in-register transposes, so the kernel loads them
 * instead (no vpermt2w / vshufi32x4 / gathers per weight row and group, the most of an M = 1
 * row's work once the weights sit in cache).  A group of 16 blocks of bb bytes keeps its 16 * bb
 * bytes: S = (quant bytes per block) / 4 vectors of 64 bytes, byte 64 k + 4 l + i = quant byte
 * 4 k + i of block l (Q4: the nibble pairs, split later; Q8_0: the int8 values), then the 16
 * fp16 d (and Q4_1's 16 fp16 m), block l at 2 l.  Everything else (tail blocks, short rows)
 * is copied as is, so a row keeps its offsets and the other groups read the same bytes. */
int q32_repack(int wdt, const uint8_t *w, uint8_t *out, int N, int K, int layout)
{
    if (wdt != DT_Q8_0 && wdt != DT_Q4_0 && wdt != DT_Q4_1)  /* the family (Q32_FORMATS) */
        return 1;
    if (layout == PQ_RP_CL)
        return repack_cl(wdt, w, out, N, K);
    if (layout != PQ_RP_GROUPS)
        return 1;
    const int bb = Q32_L(wdt).bb, qoff = Q32_L(wdt).qoff, has_m = Q32_L(wdt).has_m;
    const int S = (Q32_L(wdt).nib ? 16 : 32) / 4;  /* quant bytes per block / 4 */
    const int nb = K / QK, ng = nb / 16;
    const size_t row_bytes = (size_t)nb * bb;
    memcpy(out, w, row_bytes * (size_t)N);
    for (int n = 0; n < N; n++)
        for (int g = 0; g < ng; g++) {
            const uint8_t *src = w + (size_t)n * row_bytes + (size_t)g * 16 * bb;
            uint8_t *dst = out + (size_t)n * row_bytes + (size_t)g * 16 * bb;
            for (int k = 0; k < S; k++)
                for (int l = 0; l < 16; l++)
                    memcpy(dst + 64 * k + 4 * l, src + (size_t)l * bb + qoff + 4 * k, 4);
            for (int l = 0; l < 16; l++) {
                memcpy(dst + 64 * S + 2 * l, src + (size_t)l * bb, 2);
                if (has_m)
                    memcpy(dst + 64 * S + 32 + 2 * l, src + (size_t)l * bb + 2, 2);
            }
        }
    return 0;
}

/* The largest prepared-activation buffer any tier uses for M x K (64-byte aligned). */
size_t q32_xa_bytes(int M, int K)
{
    const int nb = K / QK;
    const size_t a = plan_mstride(nb, 16), b = plan_mstride(nb, 8);
    const size_t blk = (size_t)M * (a > b ? a : b), cl = (size_t)M * cl_mstride(K);
    return XA_HDR + (blk > cl ? blk : cl) + 64;
}

/* One block of x -> int8 q[32] (nearest even), its scale and the sum of q. */
static void quant_block_scalar(const float *x, int8_t *q, float *dx, int *sum)
{
    float amax = 0.f;
    for (int i = 0; i < QK; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int s = 0;
    for (int i = 0; i < QK; i++) {
        int v = (int)lrintf(x[i] * id);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[i] = (int8_t)v;
        s += v;
    }
    *dx = amax / 127.f;
    *sum = s;
}

/* Fill xa's records of rows [m0, m1) from x [M, K] fp32 for format wdt on tier isa, and its
 * header where m0 == 0 (the header does not depend on the rows: each row's record is its own,
 * so row ranges may be filled by different threads); cl: column-lane records (cpu_qgemv.h), at
 * the VNNI and AVX2 tiers and aarch64's SDOT (the portable tier: int8 only with the copy). */
static void prep_32(const float *x, int M, int K, void *xa, int isa, int wdt, int cl, int m0, int m1)
{
    (void)M;
    xa_hdr_t hdr, *h = &hdr;  /* built here, stored by the range that starts at row 0 */
    memset(h, 0, sizeof(*h));
    h->path = path_for(wdt, isa);
    if (isa < ISA_AVX2 && !cl)
        h->path = PATH_FLOAT;  /* SDOT's rows read only the CL copy: without one, the fp32 rows */
    h->wdt = wdt;
    h->nb = K / QK;
    if (h->path != PATH_FLOAT) {
        h->V = isa >= ISA_AVX512 ? 16 : 8;
        h->vnni = isa >= ISA_AVX512_VNNI;
        /* the rows that read a CL copy: the VNNI tiers', avx2's and (portable) aarch64 SDOT's */
        h->cl = cl && (h->vnni || isa == ISA_AVX2 || isa == ISA_PORTABLE);
        h->mstride = h->cl ? cl_mstride(K) : plan_mstride(h->nb, h->V);
    }
    if (m0 == 0)
        memcpy(xa, h, sizeof(*h));
    if (h->path == PATH_FLOAT)
        return;
    const int V = h->V;
    /* Correction C: Q4_0's nibbles are unsigned (q - 8 folded out: -8 * sum q), VNNI's Q8_0
     * weights are made unsigned by w ^ 0x80 (= w + 128: -128 * sum q); Q4_1 gets dx * sum q. */
    const int C = Q32_L(wdt).zero ? Q32_L(wdt).zero : (!Q32_L(wdt).nib && h->vnni) ? 128 : 0;
    const plan_t p = plan_of(h->nb, V);
    void (*qb)(const float *, int8_t *, float *, int *) = quant_block_scalar;
#ifdef PQ_X86
    qb = isa >= ISA_AVX512 ? q32_quant_block_avx512 : q32_quant_block_avx2;
#endif
    uint8_t *out = (uint8_t *)xa + XA_HDR;
    if (h->cl) {
        const size_t kq = cl_kq(K), nb16 = cl_nb16(h->nb);
        for (int m = m0; m < m1; m++) {
            uint8_t *rec = out + (size_t)m * h->mstride;
            float *dxp = (float *)(rec + kq);
            int32_t *aux = (int32_t *)(rec + kq + 4 * nb16);
            memset(rec, 0, h->mstride);
            for (int b = 0; b < h->nb; b++) {
                float dx;
                int sum;
                qb(x + (size_t)m * K + (size_t)b * QK, (int8_t *)rec + (size_t)b * QK, &dx, &sum);
                dxp[b] = dx;
                if (Q32_L(wdt).has_m) {
                    const float s = dx * (float)sum;
                    memcpy(&aux[b], &s, 4);
                } else {
                    aux[b] = -C * sum;
                }
            }
        }
        return;
    }
    for (int m = m0; m < m1; m++) {
        const float *xr = x + (size_t)m * K;
        uint8_t *rec = out + (size_t)m * h->mstride;
        for (int g = 0; g < p.ng; g++) {
            int kind, b0, nv;
            plan_group(&p, V, g, &kind, &b0, &nv);
            const int S = kind == KIND_T ? 8 : 1;
            const size_t rb = rec_bytes(V, kind);
            memset(rec, 0, rb);
            float *dxp = (float *)(rec + (size_t)S * 4 * V);
            int32_t *aux = (int32_t *)(rec + (size_t)(S + 1) * 4 * V);
            for (int i = 0; i < nv; i++) {
                int8_t q[QK];
                float dx;
                int sum;
                qb(xr + (size_t)(b0 + i) * QK, q, &dx, &sum);
                int lane0; /* the lane that carries the block's aux value */
                if (kind == KIND_T) {
                    for (int s = 0; s < 8; s++)
                        memcpy(rec + (size_t)s * 4 * V + 4 * i, q + 4 * s, 4);
                    dxp[i] = dx;
                    lane0 = i;
                } else if (V == 16) {
                    memcpy(rec + 16 * i, q, 16);
                    memcpy(rec + 32 + 16 * i, q + 16, 16);
                    for (int l = 0; l < 4; l++)
                        dxp[4 * i + l] = dxp[8 + 4 * i + l] = dx;
                    lane0 = 4 * i;
                } else {
                    memcpy(rec, q, 32);
                    for (int l = 0; l < 8; l++)
                        dxp[l] = dx;
                    lane0 = 0;
                }
                if (Q32_L(wdt).has_m) {
                    float s = dx * (float)sum;
                    memcpy(&aux[lane0], &s, 4);
                } else {
                    aux[lane0] = -C * sum;
                }
            }
            rec += rb;
        }
    }
}

/* ------------------------------------------------------------------------- */
/* Portable path: one weight row at a time, each block dequantized to 32      */
/* floats once and used for every input row (32 lane sums: vectorisable     */
/* without -ffast-math).                                                     */
/* ------------------------------------------------------------------------- */

static inline void dec_block_portable(int wdt, const uint8_t *b, float *o)
{
    /* codes to int32 first, then one multiply(-add) loop: both simple enough for gcc to
     * vectorise (a fused loop over nibbles and floats was not) */
    const float d = half_to_f32(rd16(b));
    int32_t q[QK];
    if (!Q32_L(wdt).nib) {
        const int8_t *s = (const int8_t *)(b + 2);
        for (int i = 0; i < QK; i++)
            o[i] = d * (float)s[i];
        return;
    }
    const uint8_t *qs = b + Q32_L(wdt).qoff;
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 15;
        q[i + 16] = qs[i] >> 4;
    }
    if (!Q32_L(wdt).has_m) {
        const int z = Q32_L(wdt).zero;
        for (int i = 0; i < QK; i++)
            o[i] = d * (float)(q[i] - z);
    } else {
        const float m = half_to_f32(rd16(b + 2));
        for (int i = 0; i < QK; i++)
            o[i] = fmaf(d, (float)q[i], m);
    }
}

static void rows_portable(const pq_job_t *j, int n0, int n1, int wdt)
{
    const int K = j->K, M = j->M, nb = K / QK, bb = Q32_L(wdt).bb;
    float acc[PG_MAX_M][QK];
    float wf[QK];
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = j->w + (size_t)n * j->row_bytes;
        memset(acc, 0, sizeof(float) * QK * M);
        for (int b = 0; b < nb; b++) {
            dec_block_portable(wdt, row + (size_t)b * bb, wf);
            for (int m = 0; m < M; m++) {
                const float *xr = j->x + (size_t)m * K + (size_t)b * QK;
                for (int i = 0; i < QK; i++)
                    acc[m][i] += wf[i] * xr[i];
            }
        }
        for (int m = 0; m < M; m++) {
            float s = 0.f;
            for (int i = 0; i < QK; i++)
                s += acc[m][i];
            store1(j, m, n, s);
        }
    }
}

/* ------------------------------------------------------------------------- */
/* Entry points of one format (the table's, cpu_formats.c)                    */
/* ------------------------------------------------------------------------- */

/* The portable tier's rows: fp32 (rows_portable), or where the prepared x is int8 (aarch64 with
 * SDOT and the CL copy: prep_32), cpu_qgemv_neon.c's. */
#if PQ_NEON_DOT
#define Q32_ROWS_INT8(name, j, n0, n1) q32_rows_neon_##name(j, n0, n1)
#else
#define Q32_ROWS_INT8(name, j, n0, n1) __builtin_trap()  /* path_for never says int8 here */
#endif

#define Q32_INSTANCE_REF(name, code)                                                      \
    void q32_rows_ref_##name(const pq_job_t *j, int n0, int n1)                          \
    {                                                                                    \
        if (j->xa && j->cl && ((const xa_hdr_t *)j->xa)->path == PATH_INT8)              \
            Q32_ROWS_INT8(name, j, n0, n1);                                              \
        else                                                                             \
            rows_portable(j, n0, n1, code);                                              \
    }                                                                                    \
    void q32_dequant_ref_##name(const uint8_t *blk, int nblk, float *out)                \
    {                                                                                    \
        for (int b = 0; b < nblk; b++)                                                   \
            dec_block_portable(code, blk + (size_t)b * Q32_L(code).bb, out + (size_t)b * QK); \
    }                                                                                    \
    void q32_prep_##name(const float *x, int M, int K, void *xa, int isa, int cl)       \
    {                                                                                    \
        prep_32(x, M, K, xa, isa, code, cl, 0, M);                                       \
    }                                                                                    \
    void q32_prep_rows_##name(const float *x, int M, int K, void *xa, int isa, int cl,  \
                              int m0, int m1)                                            \
    {                                                                                    \
        prep_32(x, M, K, xa, isa, code, cl, m0, m1);                                     \
    }                                                                                    \
    int q32_act_block_##name(int isa) { return path_for(code, isa) == PATH_INT8 ? QK : 0; }

Q32_FORMATS(Q32_INSTANCE_REF)

/* Path override for tests and benchmarks: 0 each tier's default, 1 float, 2 int8 where the
 * tier has it.  Returns the previous mode. */
int pq_set_mode(int mode)
{
    int old = g_mode;
    g_mode = mode < 0 || mode > 2 ? 0 : mode;
    return old;
}
