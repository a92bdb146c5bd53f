/*
 * cpu_qgemv.h -- the 32-element block family (Q8_0, Q4_0, Q4_1): what its three files share.
 *
 *   cpu_qgemv.c          the generic reference (portable rows, exact dequantizer), the
 *                        activation prep and the path choice (float / int8)
 *   cpu_qgemv_avx2.c     AVX2 + FMA + F16C row kernels and dequantizer
 *   cpu_qgemv_avx512.c   AVX-512 (BW; + VNNI from tier avx512_vnni) row kernels and dequantizer
 *   cpu_qgemv_cl.c       the VNNI and AVX2 int8 rows on a column-lane copy of W (the same bits)
 *   cpu_qgemv_neon.c     aarch64's SDOT int8 rows on that copy (the same bits again)
 *
 * The kernels are written once for the family and specialised per format by a compile-time
 * code FMT; what they need of a format is its row of q32_layouts below (block bytes, where the
 * quants start, nibbles or bytes, an offset m, a zero point), never its identity.  The family's
 * formats are the X-macro Q32_FORMATS; each gets the entry points declared by Q32_DECLARE, which
 * the table (cpu_formats.c) points at.  Private to the family and the table: nothing here is
 * exported from the .so.
 */
#ifndef PRESCIENT_CPU_QGEMV_H
#define PRESCIENT_CPU_QGEMV_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "cpu_bf16.h"
#include "cpu_formats.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PQ_X86 1
#define PQ_KEEP(v) __asm__("" : "+v"(v))
#endif
/* aarch64: the int8 rows of cpu_qgemv_neon.c (SDOT, where pg_neon_dot() says the CPU has it) */
#define PQ_NEON_DOT PG_NEON_DOT

#define QK 32                 /* elements per block */
#define PQ_NR 4               /* weight rows per tile */
#define PQ_KC 256             /* fp32 dequantization chunk (elements per row) */
#ifndef PQ_PF_BYTES
#define PQ_PF_BYTES 8192      /* software prefetch distance, as cpu_gemv.c (4 KB pages) */
#endif

enum { PATH_FLOAT = 0, PATH_INT8 = 1 };

/* ---- the family's formats --------------------------------------------------------------- */

/* X(name, code) for every format of the family. */
#define Q32_FORMATS(X) X(q8_0, DT_Q8_0) X(q4_0, DT_Q4_0) X(q4_1, DT_Q4_1)

/* What the kernels read of a format (compile-time constants where FMT is). */
typedef struct {
    int bb;             /* block bytes */
    int qoff;           /* byte offset of the quants in a block (after d, and m) */
    int nib;            /* 1: 4-bit quants, 16 bytes of nibble pairs; 0: int8 quants */
    int has_m;          /* 1: an fp16 offset m follows d (w = d * q + m) */
    int zero;           /* zero point of unsigned quants without m (w = d * (q - zero)) */
    /* Tiers (bit per tier) whose default path is int8 activations.  Measured on the 2-core
     * Zen 5 (every tier run there by capping; the table in cpu_qgemv.c's header): int8 is
     * faster at every M on every SIMD tier, 1.2-2.2x. */
    unsigned auto_int8;
} q32_layout_t;

#define Q32_SIMD_TIERS ((1u << ISA_AVX2) | (1u << ISA_AVX512) | (1u << ISA_AVX512_VNNI) | (1u << ISA_AVX512_BF16))

static const q32_layout_t q32_layouts[PF_COUNT] = {
    [DT_Q8_0 - DT_Q_FIRST] = {.bb = sizeof(block_q8_0), .qoff = offsetof(block_q8_0, qs),
                              .nib = 0, .has_m = 0, .zero = 0, .auto_int8 = Q32_SIMD_TIERS},
    [DT_Q4_0 - DT_Q_FIRST] = {.bb = sizeof(block_q4_0), .qoff = offsetof(block_q4_0, qs),
                              .nib = 1, .has_m = 0, .zero = 8, .auto_int8 = Q32_SIMD_TIERS},
    [DT_Q4_1 - DT_Q_FIRST] = {.bb = sizeof(block_q4_1), .qoff = offsetof(block_q4_1, qs),
                              .nib = 1, .has_m = 1, .zero = 0, .auto_int8 = Q32_SIMD_TIERS},
};
#define Q32_L(FMT) (q32_layouts[(FMT) - DT_Q_FIRST])

/* The entry points of one format (defined by Q32_INSTANCE_* in the family's files). */
#define Q32_DECLARE(name, code)                                                          \
    void q32_rows_ref_##name(const pq_job_t *j, int n0, int n1);                         \
    void q32_dequant_ref_##name(const uint8_t *blk, int nblk, float *out);               \
    void q32_prep_##name(const float *x, int M, int K, void *xa, int isa, int cl);      \
    void q32_prep_rows_##name(const float *x, int M, int K, void *xa, int isa, int cl,  \
                              int m0, int m1);                                           \
    int q32_act_block_##name(int isa);                                                   \
    void q32_rows_avx2_##name(const pq_job_t *j, int n0, int n1);                        \
    void q32_dequant_avx2_##name(const uint8_t *blk, int nblk, float *out);              \
    void q32_rows_avx512_##name(const pq_job_t *j, int n0, int n1);                      \
    void q32_rows_vnni_##name(const pq_job_t *j, int n0, int n1);                        \
    void q32_rows_cl_##name(const pq_job_t *j, int n0, int n1);                          \
    void q32_rows_cl_avx2_##name(const pq_job_t *j, int n0, int n1);                     \
    void q32_rows_neon_##name(const pq_job_t *j, int n0, int n1);                        \
    void q32_dequant_avx512_##name(const uint8_t *blk, int nblk, float *out);

#pragma GCC visibility push(hidden)
Q32_FORMATS(Q32_DECLARE)
/* W [N, K] (wdt one of the family) -> out in layout PQ_RP_GROUPS (the same bytes with each full
 * 16-block group of a row regrouped) or PQ_RP_CL (the column-lane cells below), cpu_qgemv.c;
 * 0 done, 1 not a format of the family or no such layout.  q32_repack_bytes: out's size. */
int q32_repack(int wdt, const uint8_t *w, uint8_t *out, int N, int K, int layout);
size_t q32_repack_bytes(int wdt, int N, int K, int layout);
/* Bytes of prepared activations (cpu_qgemv.c), the same for every format of the family. */
size_t q32_xa_bytes(int M, int K);
/* One block of x -> int8 q[32] (nearest even), its scale and the sum of q, per tier. */
void q32_quant_block_avx2(const float *x, int8_t *q, float *dx, int *sum);
void q32_quant_block_avx512(const float *x, int8_t *q, float *dx, int *sum);
#pragma GCC visibility pop

/* ---- shared helpers --------------------------------------------------------------------- */

static inline uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* IEEE half -> float, exact (subnormals, inf, NaN). */
static inline float half_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f; /* zero or subnormal: exact */
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    } else {
        u = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &u, 4);
    return f;
}

/* y[m, n] = v (+ bias[n]) in y's dtype. */
static inline void store1(const pq_job_t *j, int m, int n, float v)
{
    if (j->bias)
        v += j->bias[n];
    size_t off = (size_t)m * j->N + n;
    if (j->ydt == DT_F32)
        ((float *)j->y)[off] = v;
    else
        ((uint16_t *)j->y)[off] = f32_to_bf16(v);
}

/* ------------------------------------------------------------------------- */
/* Prepared activations (the int8 path)                                       */
/*                                                                            */
/* A row of K/32 blocks is cut into groups; each group has a record per input */
/* row: S step vectors of int8 x (V dword lanes each), then a vector of fp32  */
/* x scales (dx of the lane's block), then an "aux" vector: the integer       */
/* correction -C * sum(q) of each block (C = 8 for Q4_0's unsigned nibbles,   */
/* 128 for Q8_0's w ^ 0x80 on VNNI, else 0), or for Q4_1 the fp32            */
/* dx * sum(q) that Q4_1's offset m multiplies -- in one lane of the block,  */
/* zero in its other lanes, so a lane-wise sum counts it once.                */
/*   T group (V blocks, S = 8): lane l = block b0 + l, step s = its elements  */
/*     4s..4s+3 (both the Q4 nibble split and the Q8 byte order reach that).  */
/*   P group, V = 16 (two blocks, S = 1): 128-bit lanes [b0 0-15 | b1 0-15 |  */
/*     b0 16-31 | b1 16-31];  V = 8 (one block): its 32 elements in order.    */
/* Tail rule: r = nblocks % V leftover blocks run as P groups when r <= TH    */
/* (a P group costs 4 ops per input and pair, a zero-padded T group 11), else */
/* as one padded T group.  prep and the row kernels walk the same plan.       */
/* ------------------------------------------------------------------------- */

typedef struct {
    int path;       /* PATH_FLOAT: x is read as is; PATH_INT8: records follow */
    int V;          /* dword lanes: 16 (AVX-512) or 8 (AVX2) */
    int vnni;
    int wdt;
    int nb;         /* blocks per row */
    int cl;         /* 1: column-lane records (below), for rows that read a CL copy */
    size_t mstride; /* bytes of records per input row */
} xa_hdr_t;
#define XA_HDR 64
#define XA_DATA(h) ((const uint8_t *)(h) + XA_HDR)

#define KIND_T 0
#define KIND_P 1
static inline int tail_th(int V) { return V == 16 ? 6 : 3; }
static inline size_t rec_bytes(int V, int kind) { return (size_t)((kind == KIND_T ? 8 : 1) + 2) * 4 * V; }

/* Group g of the plan: kind, first block, valid blocks. Returns 0 past the end. */
typedef struct { int nT, r, padded, ng; } plan_t;
static inline plan_t plan_of(int nb, int V)
{
    plan_t p;
    p.nT = nb / V;
    p.r = nb % V;
    p.padded = p.r > tail_th(V);
    p.ng = p.nT + (p.padded ? 1 : (V == 16 ? (p.r + 1) / 2 : p.r));
    return p;
}
static inline void plan_group(const plan_t *p, int V, int g, int *kind, int *b0, int *nv)
{
    if (g < p->nT) {
        *kind = KIND_T; *b0 = g * V; *nv = V;
    } else if (p->padded) {
        *kind = KIND_T; *b0 = p->nT * V; *nv = p->r;
    } else {
        const int per = V == 16 ? 2 : 1, i = g - p->nT;
        *kind = KIND_P;
        *b0 = p->nT * V + i * per;
        *nv = p->r - i * per < per ? p->r - i * per : per;
    }
}
static inline size_t plan_mstride(int nb, int V)
{
    plan_t p = plan_of(nb, V);
    size_t s = 0;
    for (int g = 0; g < p.ng; g++) {
        int kind, b0, nv;
        plan_group(&p, V, g, &kind, &b0, &nv);
        s += rec_bytes(V, kind);
    }
    return s;
}


/* ------------------------------------------------------------------------- */
/* The column-lane (CL) layout (cpu_qgemv_cl.c: the VNNI tiers, avx2; and aarch64's SDOT) */
/*                                                                            */
/* W: one cell of 16 * bb bytes per (16-column tile t, block b), at offset    */
/* (t * nb + b) * 16 * bb: QV = 4 (Q4) or 8 (Q8_0) vectors of 64 bytes, byte */
/* 64 k + 4 c + i = quant byte 4 k + i of column c's block (Q4: the nibble   */
/* byte, elements 4k+i low and 16+4k+i high, so vector k gives steps k and   */
/* k + 4; Q8_0: q + 128, unsigned), then the 16 fp16 d, then Q4_1's 16 fp16 */
/* m.  Columns past N are zero.                                              */
/* x: per input row (mstride bytes), its K int8 in order (padded to 64),     */
/* then nb fp32 dx, then nb aux (int32 -C * sum q as above, or Q4_1's fp32   */
/* dx * sum q), each padded to 16 entries.                                    */
/* ------------------------------------------------------------------------- */

static inline size_t cl_kq(int K) { return ((size_t)K + 63) & ~(size_t)63; }
static inline size_t cl_nb16(int nb) { return ((size_t)nb + 15) & ~(size_t)15; }
static inline size_t cl_mstride(int K) { return cl_kq(K) + 8 * cl_nb16(K / QK); }

#endif
