/*
 * cpu_qgemv.c -- small-M linear (y = x @ W^T + b, M <= 16) over GGUF block-format weights,
 * streamed in their blocks: the entry point pq_linear_w (reached from pg_linear_w for
 * wdt >= DT_Q_FIRST), the pool split, and the 32-element formats Q8_0 / Q4_0 / Q4_1.  The
 * K-quants (Q4_K / Q5_K / Q6_K) live in cpu_qgemv_k.c behind pq_format_k (cpu_qgemv.h).
 * Also pq_dequantize_rows / pq_dequantize_ids: rows of W to fp32, for the prefill path
 * (kernels/quant_linear.py multiplies them tile by tile) and quantized embedding lookups.
 *
 * Block layouts (GGUF / ggml), 32 weights per block, a row of W = K / 32 blocks:
 *   Q8_0  34 B: fp16 d, int8 q[32]                 w_i = d * q_i
 *   Q4_0  18 B: fp16 d, u8 qs[16]                  w_i = d * (q_i - 8)
 *   Q4_1  20 B: fp16 d, fp16 m, u8 qs[16]          w_i = d * q_i + m
 *   (Q4: q_i = qs[i] & 15 for i < 16, q_{i+16} = qs[i] >> 4)
 *
 * Two ways to run a format, both on every x86 tier (cpu_isa.h):
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
 *   (portable, fp32 only: 7.2 / 3.8 / 4.0 at M = 1).  K = 576 costs ~20% more per block (its
 *   last 2 blocks run as a pair).  One core streams ~20-25 GB/s from DRAM, so at M = 1 two
 *   cores are about at the DRAM limit with int8 and well below it with float.
 *
 * Row tiles: 4 weight rows x (all M in blocks of up to 4 inputs), each dequantized/transposed
 * weight tile reused for all M input rows from L1; fp32 accumulation; bias; y fp32 or bf16
 * (round to nearest even).  Work is split over the pool of cpu_gemv.c (pg_parallel_for) in
 * row chunks sized as cpu_gemv.c does; matrices under 48 KB run on the caller alone.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "cpu_bf16.h"
#include "cpu_qgemv.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PQ_X86 1
#define PQ_KEEP(v) __asm__("" : "+v"(v))
#endif

int pg_num_threads(void); /* cpu_gemv.c */

#define QK 32                 /* elements per block */
#define PQ_NR 4               /* weight rows per tile */
#define PQ_KC 256             /* fp32 dequantization chunk (elements per row) */
#define PQ_CHUNKS_PER_THREAD 8
#define PQ_SOLO_BYTES (48 * 1024)
#ifndef PQ_PF_BYTES
#define PQ_PF_BYTES 8192      /* software prefetch distance, as cpu_gemv.c (4 KB pages) */
#endif

enum { PATH_FLOAT = 0, PATH_INT8 = 1 };

/* 0: each tier's default (g_auto_int8), 1: float everywhere, 2: int8 wherever it exists. */
static int g_mode = 0;

/* Default path per tier and format (Q8_0, Q4_0, Q4_1): 1 = int8 activations.  Measured on the
 * 2-core Zen 5 (every tier run there by capping; the table in the header): int8 is faster at
 * every M on every SIMD tier, 1.2-2.2x. */
static const signed char g_auto_int8[4][3] = {
    {0, 0, 0}, /* portable: no int8 kernels */
    {1, 1, 1}, /* avx2 */
    {1, 1, 1}, /* avx512 (BW) */
    {1, 1, 1}, /* avx512_bf16 (VNNI) */
};

static inline int fidx(int wdt) { return wdt - DT_Q8_0; }
static inline int is_mine(int wdt) { return wdt == DT_Q8_0 || wdt == DT_Q4_0 || wdt == DT_Q4_1; }

static int path_for(int wdt, int isa)
{
    if (isa < ISA_AVX2 || g_mode == 1)
        return PATH_FLOAT;
    if (g_mode == 2)
        return PATH_INT8;
    return g_auto_int8[isa > ISA_AVX512_BF16 ? ISA_AVX512_BF16 : isa][fidx(wdt)] ? PATH_INT8 : PATH_FLOAT;
}

/* ------------------------------------------------------------------------- */
/* Shared helpers                                                             */
/* ------------------------------------------------------------------------- */

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

static inline int fmt_bb(int wdt) { return wdt == DT_Q8_0 ? 34 : wdt == DT_Q4_0 ? 18 : 20; }
static inline int fmt_qoff(int wdt) { return wdt == DT_Q4_1 ? 4 : 2; }

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
    int pad_;
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
static size_t plan_mstride(int nb, int V)
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

/* The largest prepared-activation buffer any tier uses for M x K (64-byte aligned). */
static size_t xa_bytes_32(int M, int K)
{
    const int nb = K / QK;
    size_t a = plan_mstride(nb, 16), b = plan_mstride(nb, 8);
    return XA_HDR + (size_t)M * (a > b ? a : b) + 64;
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

#ifdef PQ_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,f16c")
static void quant_block_avx512(const float *x, int8_t *q, float *dx, int *sum)
{
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vid = _mm512_set1_ps(id);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    qa = _mm512_min_epi32(_mm512_max_epi32(qa, lo), hi);
    qb = _mm512_min_epi32(_mm512_max_epi32(qb, lo), hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    *dx = amax / 127.f;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static void quant_block_avx2(const float *x, int8_t *q, float *dx, int *sum)
{
    const __m256 sgn = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sgn, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i qi[4];
    for (int i = 0; i < 4; i++) {
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
        qi[i] = _mm256_min_epi32(_mm256_max_epi32(qi[i], _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
    }
    /* packs within 128-bit lanes: [0a 1a 0b 1b | 2a 3a 2b 3b] order, fixed by a permute */
    __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m256i b8 = _mm256_packs_epi16(p01, p23);
    b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, b8);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *sum = _mm_cvtsi128_si32(t);
    *dx = amax / 127.f;
}
#pragma GCC pop_options
#endif

/* Fill xa (header + records) from x [M, K] fp32 for format wdt on tier isa. */
static void prep_32(const float *x, int M, int K, void *xa, int isa, int wdt)
{
    xa_hdr_t *h = (xa_hdr_t *)xa;
    memset(h, 0, sizeof(*h));
    h->path = path_for(wdt, isa);
    h->wdt = wdt;
    h->nb = K / QK;
    if (h->path == PATH_FLOAT)
        return;
    const int V = isa >= ISA_AVX512 ? 16 : 8;
    h->V = V;
    h->vnni = isa >= ISA_AVX512_BF16;
    h->mstride = plan_mstride(h->nb, V);
    /* Correction C: Q4_0's nibbles are unsigned (q - 8 folded out: -8 * sum q), VNNI's Q8_0
     * weights are made unsigned by w ^ 0x80 (= w + 128: -128 * sum q); Q4_1 gets dx * sum q. */
    const int C = wdt == DT_Q4_0 ? 8 : (wdt == DT_Q8_0 && h->vnni) ? 128 : 0;
    const plan_t p = plan_of(h->nb, V);
    void (*qb)(const float *, int8_t *, float *, int *) = quant_block_scalar;
#ifdef PQ_X86
    qb = isa >= ISA_AVX512 ? quant_block_avx512 : quant_block_avx2;
#endif
    uint8_t *out = (uint8_t *)xa + XA_HDR;
    for (int m = 0; m < M; m++) {
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
                if (wdt == DT_Q4_1) {
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
    if (wdt == DT_Q8_0) {
        const int8_t *s = (const int8_t *)(b + 2);
        for (int i = 0; i < QK; i++)
            o[i] = d * (float)s[i];
        return;
    }
    const uint8_t *qs = b + fmt_qoff(wdt);
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 15;
        q[i + 16] = qs[i] >> 4;
    }
    if (wdt == DT_Q4_0) {
        for (int i = 0; i < QK; i++)
            o[i] = d * (float)(q[i] - 8);
    } else {
        const float m = half_to_f32(rd16(b + 2));
        for (int i = 0; i < QK; i++)
            o[i] = fmaf(d, (float)q[i], m);
    }
}

static void rows_portable(const pq_job_t *j, int n0, int n1, int wdt)
{
    const int K = j->K, M = j->M, nb = K / QK, bb = fmt_bb(wdt);
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

static void dequant_rows_portable(int wdt, const uint8_t *w, size_t row_bytes, int K, int n0, int n1,
                                  float *out)
{
    const int nb = K / QK, bb = fmt_bb(wdt);
    for (int n = n0; n < n1; n++)
        for (int b = 0; b < nb; b++)
            dec_block_portable(wdt, w + (size_t)n * row_bytes + (size_t)b * bb,
                               out + (size_t)(n - n0) * K + (size_t)b * QK);
}

#ifdef PQ_X86
/* ========================================================================= */
/* AVX-512 (F/BW/VL/DQ; + VNNI in the int8 kernels at tier avx512_bf16)       */
/* ========================================================================= */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,f16c,sse4.1")

static inline __attribute__((always_inline)) __m256 z_fold256(__m512 a)
{
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* The four horizontal sums of a, b, c, d as one __m128. */
static inline __attribute__((always_inline)) __m128 z_hsum4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    __m256 ab = _mm256_hadd_ps(z_fold256(a), z_fold256(b));
    __m256 cd = _mm256_hadd_ps(z_fold256(c), z_fold256(d));
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* y[m, n..n+3] = s (+ bias). */
static inline __attribute__((always_inline)) void z_store_row4(const pq_job_t *j, int m, int n, __m128 s)
{
    if (j->bias)
        s = _mm_add_ps(s, _mm_loadu_ps(j->bias + n));
    size_t off = (size_t)m * j->N + n;
    if (j->ydt == DT_F32)
        _mm_storeu_ps((float *)j->y + off, s);
    else
        _mm_storel_epi64((__m128i *)((uint16_t *)j->y + off), bf16x4_rne(s));
}

static inline __attribute__((always_inline)) void z_prefetch(const uint8_t *p, size_t bytes)
{
    if (PQ_PF_BYTES)
        for (size_t o = 0; o < bytes; o += 64)
            _mm_prefetch((const char *)p + o + PQ_PF_BYTES, _MM_HINT_T0);
}

/* Store acc[m][r] (r < NR) for rows n.. of all M inputs. */
static inline __attribute__((always_inline))
void z_emit(const pq_job_t *j, __m512 (*acc)[PQ_NR], int n, const int NR)
{
    for (int m = 0; m < j->M; m++) {
        if (NR == 4)
            z_store_row4(j, m, n, z_hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        else
            /* z_hsum4's order for a lone row too: a row sums alike in a tile or in the tail */
            store1(j, m, n, _mm_cvtss_f32(z_hsum4(acc[m][0], _mm512_setzero_ps(), _mm512_setzero_ps(),
                                                  _mm512_setzero_ps())));
    }
}

/* ---- float path ---- */

/* nblk blocks (stride bb) -> fp32.  Q4 uses a 16-entry table of the block's values
 * (vpermps reads the low 4 bits of each index: the nibble). */
static inline __attribute__((always_inline))
void z_dec_f32(const int FMT, const uint8_t *src, int nblk, float *dst)
{
    const int bb = fmt_bb(FMT);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 iota8 = _mm512_sub_ps(iota, _mm512_set1_ps(8.f));
    for (int b = 0; b < nblk; b++, src += bb, dst += QK) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(src)));
        if (FMT == DT_Q8_0) {
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 2))));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 18))));
            _mm512_storeu_ps(dst, _mm512_mul_ps(lo, d));
            _mm512_storeu_ps(dst + 16, _mm512_mul_ps(hi, d));
        } else {
            const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + fmt_qoff(FMT))));
            __m512 lut;
            if (FMT == DT_Q4_0)
                lut = _mm512_mul_ps(iota8, d);
            else
                lut = _mm512_fmadd_ps(iota, d, _mm512_set1_ps(_cvtsh_ss(rd16(src + 2))));
            _mm512_storeu_ps(dst, _mm512_permutexvar_ps(raw, lut));
            _mm512_storeu_ps(dst + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), lut));
        }
    }
}

/* acc[m][r] += W_tile[r, 0:len] . x[m, 0:len] for MR inputs (weights from the L1 buffer). */
static inline __attribute__((always_inline))
void z_fblock(const float (*wb)[PQ_KC], const float *x, int K, int len, __m512 (*acc)[PQ_NR],
              const int MR, const int NR)
{
    __m512 a[4][PQ_NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++)
            a[m][r] = acc[m][r];
    for (int k = 0; k < len; k += 16) {
        __m512 wv[PQ_NR];
        for (int r = 0; r < NR; r++) {
            wv[r] = _mm512_load_ps(wb[r] + k);
            PQ_KEEP(wv[r]);
        }
        for (int m = 0; m < MR; m++) {
            const __m512 xv = _mm512_loadu_ps(x + (size_t)m * K + k);
            for (int r = 0; r < NR; r++)
                a[m][r] = _mm512_fmadd_ps(wv[r], xv, a[m][r]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = a[m][r];
}

static inline __attribute__((always_inline))
void z_ftile(const pq_job_t *j, int n, const int FMT, const int NR, float (*wb)[PQ_KC], __m512 (*acc)[PQ_NR])
{
    const int K = j->K, M = j->M, bb = fmt_bb(FMT);
    for (int m = 0; m < M; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = _mm512_setzero_ps();
    for (int kc = 0; kc < K; kc += PQ_KC) {
        const int len = K - kc < PQ_KC ? K - kc : PQ_KC, nblk = len / QK;
        for (int r = 0; r < NR; r++) {
            const uint8_t *src = j->w + (size_t)(n + r) * j->row_bytes + (size_t)(kc / QK) * bb;
            z_prefetch(src, (size_t)nblk * bb);
            z_dec_f32(FMT, src, nblk, wb[r]);
        }
        const float *x = j->x + kc;
        for (int m0 = 0; m0 < M; m0 += 4) {
            switch (M - m0) {
            case 1: z_fblock((const float (*)[PQ_KC])wb, x + (size_t)m0 * K, K, len, acc + m0, 1, NR); break;
            case 2: z_fblock((const float (*)[PQ_KC])wb, x + (size_t)m0 * K, K, len, acc + m0, 2, NR); break;
            case 3: z_fblock((const float (*)[PQ_KC])wb, x + (size_t)m0 * K, K, len, acc + m0, 3, NR); break;
            default: z_fblock((const float (*)[PQ_KC])wb, x + (size_t)m0 * K, K, len, acc + m0, 4, NR); break;
            }
        }
    }
    z_emit(j, acc, n, NR);
}

static inline __attribute__((always_inline)) void z_frows(const pq_job_t *j, int n0, int n1, const int FMT)
{
    _Alignas(64) float wb[PQ_NR][PQ_KC];
    _Alignas(64) __m512 acc[PG_MAX_M][PQ_NR];
    int n = n0;
    for (; n + PQ_NR <= n1; n += PQ_NR)
        z_ftile(j, n, FMT, PQ_NR, wb, acc);
    for (; n < n1; n++)
        z_ftile(j, n, FMT, 1, wb, acc);
}

static void z_frows_q8_0(const pq_job_t *j, int n0, int n1) { z_frows(j, n0, n1, DT_Q8_0); }
static void z_frows_q4_0(const pq_job_t *j, int n0, int n1) { z_frows(j, n0, n1, DT_Q4_0); }
static void z_frows_q4_1(const pq_job_t *j, int n0, int n1) { z_frows(j, n0, n1, DT_Q4_1); }

static void z_dequant_rows(int wdt, const uint8_t *w, size_t row_bytes, int K, int n0, int n1, float *out)
{
    const int nb = K / QK;
    for (int n = n0; n < n1; n++) {
        const uint8_t *src = w + (size_t)n * row_bytes;
        float *dst = out + (size_t)(n - n0) * K;
        if (wdt == DT_Q8_0) z_dec_f32(DT_Q8_0, src, nb, dst);
        else if (wdt == DT_Q4_0) z_dec_f32(DT_Q4_0, src, nb, dst);
        else z_dec_f32(DT_Q4_1, src, nb, dst);
    }
}

/* ---- int8 path ---- */

/* One row's decoded group: S step vectors (the unsigned operand of the dot product: Q4
 * nibbles, VNNI Q8_0 w ^ 0x80, BW Q8_0 |w| with the signs as masks), the block scales d in
 * the lanes' pattern, and Q4_1's offsets m. */
typedef struct {
    __m512i w[PQ_NR][8];
    __mmask64 sm[PQ_NR][8];
    __m512 dp[PQ_NR], mp[PQ_NR];
} ztile_t;

/* 4x4 transpose of dwords within each 128-bit lane: z[i] lane L = dwords 0..3 of block
 * 4L + i  ->  r[t] lane 4L + i = dword t of that block. */
static inline __attribute__((always_inline)) void z_tr4(const __m512i z[4], __m512i r[4])
{
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    r[0] = _mm512_unpacklo_epi64(t0, t2);
    r[1] = _mm512_unpackhi_epi64(t0, t2);
    r[2] = _mm512_unpacklo_epi64(t1, t3);
    r[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 16 bytes at p + off of blocks 4L + i (L = 0..3) of the group, missing blocks zero. */
static inline __attribute__((always_inline))
void z_gather16(const uint8_t *g, int bb, int off, int nv, const int FULL, __m512i z[4])
{
    for (int i = 0; i < 4; i++) {
        if (FULL) {
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(g + i * bb + off)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(g + (4 + i) * bb + off)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(g + (8 + i) * bb + off)), 2);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(g + (12 + i) * bb + off)), 3);
            z[i] = v;
        } else {
            __m512i v = _mm512_setzero_si512();
            for (int L = 0; L < 4; L++)
                if (4 * L + i < nv)
                    v = _mm512_inserti32x4(
                        v, _mm_loadu_si128((const __m128i *)(g + (4 * L + i) * bb + off)), L);
            z[i] = v;
        }
    }
}

/* Q4_0 / Q4_1, a T group (16 blocks) from wide loads: window a (blocks 4a..4a+3, 4 * bb
 * bytes) is one zmm plus a partial one, from which one vpermt2w (word permute of two tables;
 * every field of these blocks is word-aligned) picks P_a: 128-bit lane t = qs dword t of the
 * four blocks.  A 4x4 transpose of 128-bit lanes across P_0..P_3 gives R_t (lane l = qs dword t
 * of block l), and two more vpermt2w the 16 scales (and Q4_1's offsets) from the same loads:
 * 15 shuffles per group against ~32 for 16 inserts, an 8-unpack transpose and the scales'
 * assembly (5% faster at M = 1 on Zen 5, where the decode is most of the work). */
static inline __attribute__((always_inline))
void z_q4_group(const int FMT, const int FULL, const uint8_t *g, int nv, __m512i R[4], __m512 *dp, __m512 *mp)
{
    const int bb = fmt_bb(FMT), wb = bb / 2, qw = fmt_qoff(FMT) / 2; /* words per block, qs start */
    __m512i lo[4], hi[4];
    for (int a = 0; a < 4; a++) {
        const uint8_t *p = g + (size_t)a * 4 * bb;
        const int vb = FULL ? 4 * bb : (nv - 4 * a <= 0 ? 0 : nv - 4 * a >= 4 ? 4 * bb : (nv - 4 * a) * bb);
        if (FULL) {
            lo[a] = _mm512_loadu_si512((const void *)p);
            hi[a] = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (4 * bb - 64)) - 1), p + 64);
        } else {
            lo[a] = _mm512_maskz_loadu_epi8(vb >= 64 ? ~0ull : (1ull << vb) - 1, p);
            hi[a] = _mm512_maskz_loadu_epi8(vb > 64 ? (1ull << (vb - 64)) - 1 : 0, p + 64);
        }
    }
    /* P index: word w -> lane t = w / 8, block L = (w / 2) % 4, half w % 2 */
    _Alignas(64) int16_t pi[32], di[32];
    for (int w = 0; w < 32; w++) {
        pi[w] = (int16_t)(wb * ((w >> 1) & 3) + qw + 2 * (w >> 3) + (w & 1));
        /* scales: words 0..7 d of blocks 0..7 of the two windows (table 2 = +32), 8..15 m */
        const int l = w & 7;
        di[w] = (int16_t)((l >> 2) * 32 + wb * (l & 3) + (w >= 8 ? 1 : 0));
    }
    const __m512i pidx = _mm512_load_si512((const void *)pi), didx = _mm512_load_si512((const void *)di);
    __m512i P[4];
    for (int a = 0; a < 4; a++)
        P[a] = _mm512_permutex2var_epi16(lo[a], pidx, hi[a]);
    const __m512i A0 = _mm512_shuffle_i32x4(P[0], P[1], 0x44), A1 = _mm512_shuffle_i32x4(P[0], P[1], 0xEE);
    const __m512i A2 = _mm512_shuffle_i32x4(P[2], P[3], 0x44), A3 = _mm512_shuffle_i32x4(P[2], P[3], 0xEE);
    R[0] = _mm512_shuffle_i32x4(A0, A2, 0x88);
    R[1] = _mm512_shuffle_i32x4(A0, A2, 0xDD);
    R[2] = _mm512_shuffle_i32x4(A1, A3, 0x88);
    R[3] = _mm512_shuffle_i32x4(A1, A3, 0xDD);
    const __m512i s01 = _mm512_permutex2var_epi16(lo[0], didx, lo[1]);
    const __m512i s23 = _mm512_permutex2var_epi16(lo[2], didx, lo[3]);
    /* d: words 0..7 of s01 then of s23; m: words 8..15 of each */
    const __m256i d16 = _mm256_inserti128_si256(_mm512_castsi512_si256(s01), _mm512_castsi512_si128(s23), 1);
    *dp = _mm512_cvtph_ps(d16);
    if (FMT == DT_Q4_1) {
        const __m256i m16 = _mm256_permute2x128_si256(_mm512_castsi512_si256(s01),
                                                      _mm512_castsi512_si256(s23), 0x31);
        *mp = _mm512_cvtph_ps(m16);
    }
}

static inline __attribute__((always_inline))
void z_idec(const int FMT, const int VNNI, const int KIND, const int FULL, const uint8_t *g, int nv,
            ztile_t *t, int r)
{
    const int bb = fmt_bb(FMT), qoff = fmt_qoff(FMT);
    if (FMT != DT_Q8_0 && KIND == KIND_T) {
        __m512i raw[4];
        z_q4_group(FMT, FULL, g, nv, raw, &t->dp[r], &t->mp[r]);
        const __m512i m4 = _mm512_set1_epi8(15);
        for (int k = 0; k < 4; k++) {
            t->w[r][k] = _mm512_and_si512(raw[k], m4);
            t->w[r][k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw[k], 4), m4);
        }
        return;
    }
    /* scales */
    if (KIND == KIND_T) {
        /* Q8_0's scales (Q4's come from z_q4_group): scalar loads into a stack array, one
         * vector load.  Of three ways measured at M = 1 (Zen 5) this was fastest -- gcc packs
         * the loads with a few shuffles of its own -- ahead of vpgatherdd (+12%) and forced
         * scalar stores (store-forwarding stalls, +35%). */
        _Alignas(64) uint32_t dm[16];
        for (int l = 0; l < 16; l++) {
            uint32_t v = 0;
            if (FULL || l < nv)
                memcpy(&v, g + l * bb, 4);
            dm[l] = v;
        }
        const __m512i sc = _mm512_load_si512((const void *)dm);
        t->dp[r] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sc));
        if (FMT == DT_Q4_1)
            t->mp[r] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sc, 16)));
    } else {
        const float d0 = _cvtsh_ss(rd16(g)), d1 = nv > 1 ? _cvtsh_ss(rd16(g + bb)) : 0.f;
        t->dp[r] = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
        if (FMT == DT_Q4_1) {
            const float m0 = _cvtsh_ss(rd16(g + 2)), m1 = nv > 1 ? _cvtsh_ss(rd16(g + bb + 2)) : 0.f;
            t->mp[r] = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(m0), _mm512_set1_ps(m1));
        }
    }
    /* quants */
    const __m512i m4 = _mm512_set1_epi8(15);
    if (FMT == DT_Q8_0) {
        __m512i s[8];
        if (KIND == KIND_T) {
            __m512i z[4];
            z_gather16(g, bb, 2, nv, FULL, z);
            z_tr4(z, s);
            z_gather16(g, bb, 18, nv, FULL, z);
            z_tr4(z, s + 4);
        } else {
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(g + 2)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(g + 18)), 2);
            if (nv > 1) {
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(g + bb + 2)), 1);
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(g + bb + 18)), 3);
            }
            s[0] = v;
        }
        const int S = KIND == KIND_T ? 8 : 1;
        for (int k = 0; k < S; k++) {
            if (VNNI) {
                t->w[r][k] = _mm512_xor_si512(s[k], _mm512_set1_epi8((char)0x80));
            } else {
                t->sm[r][k] = _mm512_movepi8_mask(s[k]);
                t->w[r][k] = _mm512_abs_epi8(s[k]);
            }
        }
    } else {
        if (KIND == KIND_T) {
            __m512i z[4], raw[4];
            z_gather16(g, bb, qoff, nv, FULL, z);
            z_tr4(z, raw);
            for (int k = 0; k < 4; k++) {
                t->w[r][k] = _mm512_and_si512(raw[k], m4);
                t->w[r][k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw[k], 4), m4);
            }
        } else {
            __m256i raw = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(g + qoff)));
            if (nv > 1)
                raw = _mm256_inserti128_si256(raw, _mm_loadu_si128((const __m128i *)(g + bb + qoff)), 1);
            const __m256i m4y = _mm256_set1_epi8(15);
            const __m256i lo = _mm256_and_si256(raw, m4y);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4y);
            t->w[r][0] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
    }
}

/* *acc += vpdpbusd(u8 w, s8 x).  Inline asm, so that one body serves both int8 variants:
 * they are compiled for AVX-512BW (a VNNI target could let gcc emit VNNI instructions in the BW
 * variant too, which an AVX-512 CPU without VNNI cannot run) and this is reached only at tier
 * avx512_bf16.  It is also faster: a build with the intrinsic in a separate VNNI target region
 * spilled more around it (0.46 against 0.34 ns per block for the dot products, M = 1, Zen 5). */
static inline __attribute__((always_inline)) void z_dpbusd(__m512i *acc, __m512i w, __m512i x)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(w), "v"(x));
}

/* acc[m][r] += this group's contribution, for MR inputs whose records start at xr (stride ms). */
static inline __attribute__((always_inline))
void z_iblock(const ztile_t *t, const uint8_t *xr, size_t ms, __m512 (*acc)[PQ_NR],
              const int FMT, const int VNNI, const int S, const int MR, const int NR)
{
    const size_t dxo = (size_t)S * 64, auxo = (size_t)(S + 1) * 64;
    __m512i dot[4][PQ_NR];
    if (VNNI) {
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++)
                dot[m][r] = FMT == DT_Q4_1 ? _mm512_setzero_si512()
                                           : _mm512_load_si512((const void *)(xr + m * ms + auxo));
        for (int s = 0; s < S; s++) {
            __m512i wv[PQ_NR];
            for (int r = 0; r < NR; r++) {
                wv[r] = t->w[r][s];
                PQ_KEEP(wv[r]);
            }
            for (int m = 0; m < MR; m++) {
                const __m512i xv = _mm512_load_si512((const void *)(xr + m * ms + (size_t)s * 64));
                for (int r = 0; r < NR; r++)
                    z_dpbusd(&dot[m][r], wv[r], xv);
            }
        }
    } else if (FMT != DT_Q8_0) {
        /* vpmaddubsw pairs fit int16 over all 8 steps: 8 * 2 * 15 * 127 = 30480 */
        const __m512i ones = _mm512_set1_epi16(1);
        __m512i h[4][PQ_NR];
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++)
                h[m][r] = _mm512_setzero_si512();
        for (int s = 0; s < S; s++) {
            for (int m = 0; m < MR; m++) {
                const __m512i xv = _mm512_load_si512((const void *)(xr + m * ms + (size_t)s * 64));
                for (int r = 0; r < NR; r++)
                    h[m][r] = _mm512_add_epi16(h[m][r], _mm512_maddubs_epi16(t->w[r][s], xv));
            }
        }
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++) {
                dot[m][r] = _mm512_madd_epi16(h[m][r], ones);
                if (FMT == DT_Q4_0)
                    dot[m][r] = _mm512_add_epi32(dot[m][r],
                                                 _mm512_load_si512((const void *)(xr + m * ms + auxo)));
            }
    } else {
        /* |w| * (x with w's sign): pairs <= 2 * 128 * 127, one step per int16 pass */
        const __m512i ones = _mm512_set1_epi16(1), z = _mm512_setzero_si512();
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++)
                dot[m][r] = z;
        for (int s = 0; s < S; s++) {
            for (int m = 0; m < MR; m++) {
                const __m512i xv = _mm512_load_si512((const void *)(xr + m * ms + (size_t)s * 64));
                for (int r = 0; r < NR; r++) {
                    const __m512i xs = _mm512_mask_sub_epi8(xv, t->sm[r][s], z, xv);
                    const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(t->w[r][s], xs), ones);
                    dot[m][r] = _mm512_add_epi32(dot[m][r], p);
                }
            }
        }
    }
    for (int m = 0; m < MR; m++) {
        const __m512 dx = _mm512_load_ps((const float *)(xr + m * ms + dxo));
        for (int r = 0; r < NR; r++) {
            __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][r]), _mm512_mul_ps(t->dp[r], dx), acc[m][r]);
            if (FMT == DT_Q4_1)
                a = _mm512_fmadd_ps(t->mp[r], _mm512_load_ps((const float *)(xr + m * ms + auxo)), a);
            acc[m][r] = a;
        }
    }
}

static inline __attribute__((always_inline))
void z_igroup(const pq_job_t *j, int n, const int FMT, const int VNNI, const int KIND, const int FULL,
              int b0, int nv, const uint8_t *xg, size_t ms, const int NR, ztile_t *t, __m512 (*acc)[PQ_NR])
{
    const int bb = fmt_bb(FMT), M = j->M, S = KIND == KIND_T ? 8 : 1;
    for (int r = 0; r < NR; r++) {
        const uint8_t *g = j->w + (size_t)(n + r) * j->row_bytes + (size_t)b0 * bb;
        z_prefetch(g, (size_t)nv * bb);
        z_idec(FMT, VNNI, KIND, FULL, g, nv, t, r);
    }
    for (int m0 = 0; m0 < M; m0 += 4) {
        const uint8_t *xr = xg + (size_t)m0 * ms;
        switch (M - m0) {
        case 1: z_iblock(t, xr, ms, acc + m0, FMT, VNNI, S, 1, NR); break;
        case 2: z_iblock(t, xr, ms, acc + m0, FMT, VNNI, S, 2, NR); break;
        case 3: z_iblock(t, xr, ms, acc + m0, FMT, VNNI, S, 3, NR); break;
        default: z_iblock(t, xr, ms, acc + m0, FMT, VNNI, S, 4, NR); break;
        }
    }
}

static inline __attribute__((always_inline))
void z_itile(const pq_job_t *j, int n, const int FMT, const int VNNI, const int NR, ztile_t *t,
             __m512 (*acc)[PQ_NR])
{
    const xa_hdr_t *h = (const xa_hdr_t *)j->xa;
    const uint8_t *xd = XA_DATA(h);
    const size_t ms = h->mstride;
    for (int m = 0; m < j->M; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = _mm512_setzero_ps();
    const plan_t p = plan_of(h->nb, 16);
    size_t goff = 0;
    for (int g = 0; g < p.ng; g++) {
        int kind, b0, nv;
        plan_group(&p, 16, g, &kind, &b0, &nv);
        if (kind == KIND_T && nv == 16)
            z_igroup(j, n, FMT, VNNI, KIND_T, 1, b0, nv, xd + goff, ms, NR, t, acc);
        else if (kind == KIND_T)
            z_igroup(j, n, FMT, VNNI, KIND_T, 0, b0, nv, xd + goff, ms, NR, t, acc);
        else
            z_igroup(j, n, FMT, VNNI, KIND_P, 0, b0, nv, xd + goff, ms, NR, t, acc);
        goff += rec_bytes(16, kind);
    }
    z_emit(j, acc, n, NR);
}

/* Decode the 4-row tile at n, group (kind, b0, nv), into t. */
static inline __attribute__((always_inline))
void z_idec_tile(const pq_job_t *j, int n, const int FMT, const int VNNI, int kind, int b0, int nv, ztile_t *t)
{
    const int bb = fmt_bb(FMT);
    for (int r = 0; r < PQ_NR; r++) {
        const uint8_t *g = j->w + (size_t)(n + r) * j->row_bytes + (size_t)b0 * bb;
        z_prefetch(g, (size_t)nv * bb);
        if (kind == KIND_T && nv == 16)
            z_idec(FMT, VNNI, KIND_T, 1, g, nv, t, r);
        else if (kind == KIND_T)
            z_idec(FMT, VNNI, KIND_T, 0, g, nv, t, r);
        else
            z_idec(FMT, VNNI, KIND_P, 0, g, nv, t, r);
    }
}

/* The 4-row tiles of [n0, n1) as one software pipeline over (tile, group) units: the next
 * unit is decoded into the other buffer before the current one's dot products, so the
 * out-of-order core overlaps one unit's decode with the previous unit's dependent vpdpbusd
 * chain (one unit at a time ran at ~1 instruction per cycle). */
static inline __attribute__((always_inline))
void z_ipipe(const pq_job_t *j, int n0, int ntiles, const int FMT, const int VNNI, ztile_t t[2],
             __m512 (*acc)[PQ_NR])
{
    const xa_hdr_t *h = (const xa_hdr_t *)j->xa;
    const uint8_t *xd = XA_DATA(h);
    const size_t ms = h->mstride;
    const int M = j->M;
    const plan_t p = plan_of(h->nb, 16);
    const int ng = p.ng;
    const long units = (long)ntiles * ng;
    int kind, b0, nv;
    plan_group(&p, 16, 0, &kind, &b0, &nv);
    z_idec_tile(j, n0, FMT, VNNI, kind, b0, nv, &t[0]);
    int g = 0, n = n0;
    size_t goff = 0;
    for (long u = 0; u < units; u++) {
        if (g == 0)
            for (int m = 0; m < M; m++)
                for (int r = 0; r < PQ_NR; r++)
                    acc[m][r] = _mm512_setzero_ps();
        const int ckind = kind;
        if (u + 1 < units) {
            const int g1 = g + 1 == ng ? 0 : g + 1, n1 = g + 1 == ng ? n + PQ_NR : n;
            plan_group(&p, 16, g1, &kind, &b0, &nv);
            z_idec_tile(j, n1, FMT, VNNI, kind, b0, nv, &t[(u + 1) & 1]);
        }
        const ztile_t *tc = &t[u & 1];
        const uint8_t *xg = xd + goff;
        for (int m0 = 0; m0 < M; m0 += 4) {
            const uint8_t *xr = xg + (size_t)m0 * ms;
            if (ckind == KIND_T) {
                switch (M - m0) {
                case 1: z_iblock(tc, xr, ms, acc + m0, FMT, VNNI, 8, 1, PQ_NR); break;
                case 2: z_iblock(tc, xr, ms, acc + m0, FMT, VNNI, 8, 2, PQ_NR); break;
                case 3: z_iblock(tc, xr, ms, acc + m0, FMT, VNNI, 8, 3, PQ_NR); break;
                default: z_iblock(tc, xr, ms, acc + m0, FMT, VNNI, 8, 4, PQ_NR); break;
                }
            } else {
                switch (M - m0) {
                case 1: z_iblock(tc, xr, ms, acc + m0, FMT, VNNI, 1, 1, PQ_NR); break;
                case 2: z_iblock(tc, xr, ms, acc + m0, FMT, VNNI, 1, 2, PQ_NR); break;
                case 3: z_iblock(tc, xr, ms, acc + m0, FMT, VNNI, 1, 3, PQ_NR); break;
                default: z_iblock(tc, xr, ms, acc + m0, FMT, VNNI, 1, 4, PQ_NR); break;
                }
            }
        }
        goff += rec_bytes(16, ckind);
        if (++g == ng) {
            z_emit(j, acc, n, PQ_NR);
            g = 0;
            goff = 0;
            n += PQ_NR;
        }
    }
}

static inline __attribute__((always_inline))
void z_irows(const pq_job_t *j, int n0, int n1, const int FMT, const int VNNI)
{
    _Alignas(64) ztile_t t[2];
    _Alignas(64) __m512 acc[PG_MAX_M][PQ_NR];
    const int ntiles = (n1 - n0) / PQ_NR;
    /* The pipeline wins at small M (10-20% at M = 1, Zen 5), where the decode is most of the
     * work; from M = 4 it measured even to 10% slower (K = 1536, M = 8). */
    int n = n0;
    if (ntiles && j->M <= 3) {
        z_ipipe(j, n0, ntiles, FMT, VNNI, t, acc);
        n += ntiles * PQ_NR;
    } else {
        for (; n + PQ_NR <= n1; n += PQ_NR)
            z_itile(j, n, FMT, VNNI, PQ_NR, &t[0], acc);
    }
    for (; n < n1; n++)
        z_itile(j, n, FMT, VNNI, 1, &t[0], acc);
}

static void z_irows_bw_q8_0(const pq_job_t *j, int n0, int n1) { z_irows(j, n0, n1, DT_Q8_0, 0); }
static void z_irows_bw_q4_0(const pq_job_t *j, int n0, int n1) { z_irows(j, n0, n1, DT_Q4_0, 0); }
static void z_irows_bw_q4_1(const pq_job_t *j, int n0, int n1) { z_irows(j, n0, n1, DT_Q4_1, 0); }
static void z_irows_vnni_q8_0(const pq_job_t *j, int n0, int n1) { z_irows(j, n0, n1, DT_Q8_0, 1); }
static void z_irows_vnni_q4_0(const pq_job_t *j, int n0, int n1) { z_irows(j, n0, n1, DT_Q4_0, 1); }
static void z_irows_vnni_q4_1(const pq_job_t *j, int n0, int n1) { z_irows(j, n0, n1, DT_Q4_1, 1); }
#pragma GCC pop_options

/* ========================================================================= */
/* AVX2 + FMA + F16C                                                          */
/* ========================================================================= */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,sse4.1")

#define Y_MR 2 /* inputs per register block: 16 ymm registers (8 accumulators) */

static inline __attribute__((always_inline)) __m128 y_hsum4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* One row's sum in y_hsum4's order (a row sums alike in a 4-row tile or in the tail). */
static inline __attribute__((always_inline)) float y_hsum1(__m256 a)
{
    const __m256 z = _mm256_setzero_ps();
    return _mm_cvtss_f32(y_hsum4(a, z, z, z));
}

static inline __attribute__((always_inline)) void y_store_row4(const pq_job_t *j, int m, int n, __m128 s)
{
    if (j->bias)
        s = _mm_add_ps(s, _mm_loadu_ps(j->bias + n));
    size_t off = (size_t)m * j->N + n;
    if (j->ydt == DT_F32)
        _mm_storeu_ps((float *)j->y + off, s);
    else
        _mm_storel_epi64((__m128i *)((uint16_t *)j->y + off), bf16x4_rne(s));
}

static inline __attribute__((always_inline)) void y_prefetch(const uint8_t *p, size_t bytes)
{
    if (PQ_PF_BYTES)
        for (size_t o = 0; o < bytes; o += 64)
            _mm_prefetch((const char *)p + o + PQ_PF_BYTES, _MM_HINT_T0);
}

static inline __attribute__((always_inline))
void y_emit(const pq_job_t *j, __m256 (*acc)[PQ_NR], int n, const int NR)
{
    for (int m = 0; m < j->M; m++) {
        if (NR == 4)
            y_store_row4(j, m, n, y_hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        else
            store1(j, m, n, y_hsum1(acc[m][0]));
    }
}

/* ---- float path ---- */

static inline __attribute__((always_inline))
void y_dec_f32(const int FMT, const uint8_t *src, int nblk, float *dst)
{
    const int bb = fmt_bb(FMT);
    for (int b = 0; b < nblk; b++, src += bb, dst += QK) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(src)));
        if (FMT == DT_Q8_0) {
            for (int i = 0; i < 4; i++) {
                __m128i q8 = _mm_loadl_epi64((const __m128i *)(src + 2 + 8 * i));
                _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d));
            }
        } else {
            const __m256 off = FMT == DT_Q4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.f))
                                              : _mm256_set1_ps(_cvtsh_ss(rd16(src + 2)));
            const __m256i m4 = _mm256_set1_epi32(15);
            for (int i = 0; i < 2; i++) {
                const __m128i q8 = _mm_loadl_epi64((const __m128i *)(src + fmt_qoff(FMT) + 8 * i));
                __m256i raw = _mm256_cvtepu8_epi32(q8);
                __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(raw, m4));
                __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));
                /* d * q + off: exact for Q4_0 (d * (q - 8) with d * q and 8 d exact); one rounding
                 * for Q4_1, as the reference's d * q + m */
                _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(lo, d, off));
                _mm256_storeu_ps(dst + 16 + 8 * i, _mm256_fmadd_ps(hi, d, off));
            }
        }
    }
}

static inline __attribute__((always_inline))
void y_fblock(const float (*wb)[PQ_KC], const float *x, int K, int len, __m256 (*acc)[PQ_NR],
              const int MR, const int NR)
{
    __m256 a[Y_MR][PQ_NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++)
            a[m][r] = acc[m][r];
    for (int k = 0; k < len; k += 8) {
        __m256 wv[PQ_NR];
        for (int r = 0; r < NR; r++) {
            wv[r] = _mm256_load_ps(wb[r] + k);
            PQ_KEEP(wv[r]);
        }
        for (int m = 0; m < MR; m++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)m * K + k);
            for (int r = 0; r < NR; r++)
                a[m][r] = _mm256_fmadd_ps(wv[r], xv, a[m][r]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = a[m][r];
}

static inline __attribute__((always_inline))
void y_ftile(const pq_job_t *j, int n, const int FMT, const int NR, float (*wb)[PQ_KC], __m256 (*acc)[PQ_NR])
{
    const int K = j->K, M = j->M, bb = fmt_bb(FMT);
    for (int m = 0; m < M; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = _mm256_setzero_ps();
    for (int kc = 0; kc < K; kc += PQ_KC) {
        const int len = K - kc < PQ_KC ? K - kc : PQ_KC, nblk = len / QK;
        for (int r = 0; r < NR; r++) {
            const uint8_t *src = j->w + (size_t)(n + r) * j->row_bytes + (size_t)(kc / QK) * bb;
            y_prefetch(src, (size_t)nblk * bb);
            y_dec_f32(FMT, src, nblk, wb[r]);
        }
        const float *x = j->x + kc;
        for (int m0 = 0; m0 < M; m0 += Y_MR) {
            if (M - m0 == 1)
                y_fblock((const float (*)[PQ_KC])wb, x + (size_t)m0 * K, K, len, acc + m0, 1, NR);
            else
                y_fblock((const float (*)[PQ_KC])wb, x + (size_t)m0 * K, K, len, acc + m0, 2, NR);
        }
    }
    y_emit(j, acc, n, NR);
}

static inline __attribute__((always_inline)) void y_frows(const pq_job_t *j, int n0, int n1, const int FMT)
{
    _Alignas(64) float wb[PQ_NR][PQ_KC];
    _Alignas(64) __m256 acc[PG_MAX_M][PQ_NR];
    int n = n0;
    for (; n + PQ_NR <= n1; n += PQ_NR)
        y_ftile(j, n, FMT, PQ_NR, wb, acc);
    for (; n < n1; n++)
        y_ftile(j, n, FMT, 1, wb, acc);
}

static void y_frows_q8_0(const pq_job_t *j, int n0, int n1) { y_frows(j, n0, n1, DT_Q8_0); }
static void y_frows_q4_0(const pq_job_t *j, int n0, int n1) { y_frows(j, n0, n1, DT_Q4_0); }
static void y_frows_q4_1(const pq_job_t *j, int n0, int n1) { y_frows(j, n0, n1, DT_Q4_1); }

static void y_dequant_rows(int wdt, const uint8_t *w, size_t row_bytes, int K, int n0, int n1, float *out)
{
    const int nb = K / QK;
    for (int n = n0; n < n1; n++) {
        const uint8_t *src = w + (size_t)n * row_bytes;
        float *dst = out + (size_t)(n - n0) * K;
        if (wdt == DT_Q8_0) y_dec_f32(DT_Q8_0, src, nb, dst);
        else if (wdt == DT_Q4_0) y_dec_f32(DT_Q4_0, src, nb, dst);
        else y_dec_f32(DT_Q4_1, src, nb, dst);
    }
}

/* ---- int8 path (vpmaddubsw + vpmaddwd) ---- */

typedef struct {
    __m256i w[PQ_NR][8];  /* unsigned operand: Q4 nibbles, Q8_0 |w| */
    __m256i s[PQ_NR][8];  /* Q8_0: w itself, whose signs vpsignb gives to x */
    __m256 dp[PQ_NR], mp[PQ_NR];
} ytile_t;

static inline __attribute__((always_inline)) void y_tr4(const __m256i z[4], __m256i r[4])
{
    const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    r[0] = _mm256_unpacklo_epi64(t0, t2);
    r[1] = _mm256_unpackhi_epi64(t0, t2);
    r[2] = _mm256_unpacklo_epi64(t1, t3);
    r[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* 16 bytes at off of blocks 4L + i (L = 0, 1), missing blocks zero. */
static inline __attribute__((always_inline))
void y_gather16(const uint8_t *g, int bb, int off, int nv, const int FULL, __m256i z[4])
{
    for (int i = 0; i < 4; i++) {
        const __m128i z0 = _mm_setzero_si128();
        __m128i lo = (FULL || i < nv) ? _mm_loadu_si128((const __m128i *)(g + i * bb + off)) : z0;
        __m128i hi = (FULL || 4 + i < nv) ? _mm_loadu_si128((const __m128i *)(g + (4 + i) * bb + off)) : z0;
        z[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
}

static inline __attribute__((always_inline))
void y_idec(const int FMT, const int KIND, const int FULL, const uint8_t *g, int nv, ytile_t *t, int r)
{
    const int bb = fmt_bb(FMT), qoff = fmt_qoff(FMT);
    if (KIND == KIND_T) {
        /* an 8-lane gather: on Zen 5 10% faster for Q4 than scalar loads into a stack array
         * (the AVX-512 kernel's choice), 5% slower for Q8_0; unmeasured on AVX2-only CPUs */
        const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                               _mm256_set1_epi32(bb));
        __m256i sc;
        if (FULL) {
            sc = _mm256_i32gather_epi32((const int *)g, idx, 1);
        } else {
            const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i msk = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), lanes);
            sc = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)g, idx, msk, 1);
        }
        /* low halves (d) and high halves (Q4_1's m) to 8 fp16 each */
        const __m256i lo16 = _mm256_and_si256(sc, _mm256_set1_epi32(0xffff));
        __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo16, lo16), 0x08);
        t->dp[r] = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
        if (FMT == DT_Q4_1) {
            const __m256i hi16 = _mm256_srli_epi32(sc, 16);
            pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi16, hi16), 0x08);
            t->mp[r] = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
        }
    } else {
        t->dp[r] = _mm256_set1_ps(_cvtsh_ss(rd16(g)));
        if (FMT == DT_Q4_1)
            t->mp[r] = _mm256_set1_ps(_cvtsh_ss(rd16(g + 2)));
    }
    const __m256i m4 = _mm256_set1_epi8(15);
    if (FMT == DT_Q8_0) {
        __m256i s[8];
        if (KIND == KIND_T) {
            __m256i z[4];
            y_gather16(g, bb, 2, nv, FULL, z);
            y_tr4(z, s);
            y_gather16(g, bb, 18, nv, FULL, z);
            y_tr4(z, s + 4);
        } else {
            s[0] = _mm256_loadu_si256((const __m256i *)(g + 2));
        }
        const int S = KIND == KIND_T ? 8 : 1;
        for (int k = 0; k < S; k++) {
            t->s[r][k] = s[k];
            t->w[r][k] = _mm256_abs_epi8(s[k]);
        }
    } else {
        if (KIND == KIND_T) {
            __m256i z[4], raw[4];
            y_gather16(g, bb, qoff, nv, FULL, z);
            y_tr4(z, raw);
            for (int k = 0; k < 4; k++) {
                t->w[r][k] = _mm256_and_si256(raw[k], m4);
                t->w[r][k + 4] = _mm256_and_si256(_mm256_srli_epi16(raw[k], 4), m4);
            }
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(g + qoff)), m4x = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(raw, m4x), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4x);
            t->w[r][0] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        }
    }
}

static inline __attribute__((always_inline))
void y_iblock(const ytile_t *t, const uint8_t *xr, size_t ms, __m256 (*acc)[PQ_NR],
              const int FMT, const int S, const int MR, const int NR)
{
    const size_t dxo = (size_t)S * 32, auxo = (size_t)(S + 1) * 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i dot[Y_MR][PQ_NR];
    if (FMT != DT_Q8_0) {
        __m256i h[Y_MR][PQ_NR];
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++)
                h[m][r] = _mm256_setzero_si256();
        for (int s = 0; s < S; s++)
            for (int m = 0; m < MR; m++) {
                const __m256i xv = _mm256_load_si256((const __m256i *)(xr + m * ms + (size_t)s * 32));
                for (int r = 0; r < NR; r++)
                    h[m][r] = _mm256_add_epi16(h[m][r], _mm256_maddubs_epi16(t->w[r][s], xv));
            }
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++) {
                dot[m][r] = _mm256_madd_epi16(h[m][r], ones);
                if (FMT == DT_Q4_0)
                    dot[m][r] = _mm256_add_epi32(dot[m][r],
                                                 _mm256_load_si256((const __m256i *)(xr + m * ms + auxo)));
            }
    } else {
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++)
                dot[m][r] = _mm256_setzero_si256();
        for (int s = 0; s < S; s++)
            for (int m = 0; m < MR; m++) {
                const __m256i xv = _mm256_load_si256((const __m256i *)(xr + m * ms + (size_t)s * 32));
                for (int r = 0; r < NR; r++) {
                    const __m256i xs = _mm256_sign_epi8(xv, t->s[r][s]);
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(t->w[r][s], xs), ones);
                    dot[m][r] = _mm256_add_epi32(dot[m][r], p);
                }
            }
    }
    for (int m = 0; m < MR; m++) {
        const __m256 dx = _mm256_load_ps((const float *)(xr + m * ms + dxo));
        for (int r = 0; r < NR; r++) {
            __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][r]), _mm256_mul_ps(t->dp[r], dx), acc[m][r]);
            if (FMT == DT_Q4_1)
                a = _mm256_fmadd_ps(t->mp[r], _mm256_load_ps((const float *)(xr + m * ms + auxo)), a);
            acc[m][r] = a;
        }
    }
}

static inline __attribute__((always_inline))
void y_igroup(const pq_job_t *j, int n, const int FMT, const int KIND, const int FULL, int b0, int nv,
              const uint8_t *xg, size_t ms, const int NR, ytile_t *t, __m256 (*acc)[PQ_NR])
{
    const int bb = fmt_bb(FMT), M = j->M, S = KIND == KIND_T ? 8 : 1;
    for (int r = 0; r < NR; r++) {
        const uint8_t *g = j->w + (size_t)(n + r) * j->row_bytes + (size_t)b0 * bb;
        y_prefetch(g, (size_t)nv * bb);
        y_idec(FMT, KIND, FULL, g, nv, t, r);
    }
    for (int m0 = 0; m0 < M; m0 += Y_MR) {
        const uint8_t *xr = xg + (size_t)m0 * ms;
        if (M - m0 == 1)
            y_iblock(t, xr, ms, acc + m0, FMT, S, 1, NR);
        else
            y_iblock(t, xr, ms, acc + m0, FMT, S, 2, NR);
    }
}

static inline __attribute__((always_inline))
void y_itile(const pq_job_t *j, int n, const int FMT, const int NR, ytile_t *t, __m256 (*acc)[PQ_NR])
{
    const xa_hdr_t *h = (const xa_hdr_t *)j->xa;
    const uint8_t *xd = XA_DATA(h);
    const size_t ms = h->mstride;
    for (int m = 0; m < j->M; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = _mm256_setzero_ps();
    const plan_t p = plan_of(h->nb, 8);
    size_t goff = 0;
    for (int g = 0; g < p.ng; g++) {
        int kind, b0, nv;
        plan_group(&p, 8, g, &kind, &b0, &nv);
        if (kind == KIND_T && nv == 8)
            y_igroup(j, n, FMT, KIND_T, 1, b0, nv, xd + goff, ms, NR, t, acc);
        else if (kind == KIND_T)
            y_igroup(j, n, FMT, KIND_T, 0, b0, nv, xd + goff, ms, NR, t, acc);
        else
            y_igroup(j, n, FMT, KIND_P, 0, b0, nv, xd + goff, ms, NR, t, acc);
        goff += rec_bytes(8, kind);
    }
    y_emit(j, acc, n, NR);
}

static inline __attribute__((always_inline)) void y_irows(const pq_job_t *j, int n0, int n1, const int FMT)
{
    _Alignas(64) ytile_t t;
    _Alignas(64) __m256 acc[PG_MAX_M][PQ_NR];
    int n = n0;
    for (; n + PQ_NR <= n1; n += PQ_NR)
        y_itile(j, n, FMT, PQ_NR, &t, acc);
    for (; n < n1; n++)
        y_itile(j, n, FMT, 1, &t, acc);
}

static void y_irows_q8_0(const pq_job_t *j, int n0, int n1) { y_irows(j, n0, n1, DT_Q8_0); }
static void y_irows_q4_0(const pq_job_t *j, int n0, int n1) { y_irows(j, n0, n1, DT_Q4_0); }
static void y_irows_q4_1(const pq_job_t *j, int n0, int n1) { y_irows(j, n0, n1, DT_Q4_1); }

#pragma GCC pop_options
#endif /* PQ_X86 */

/* ------------------------------------------------------------------------- */
/* Format tables                                                              */
/* ------------------------------------------------------------------------- */

typedef void (*rows_fn)(const pq_job_t *, int, int);

static void rows_32(const pq_job_t *j, int n0, int n1, int wdt)
{
    const xa_hdr_t *h = (const xa_hdr_t *)j->xa;
    const int f = fidx(wdt);
#ifdef PQ_X86
    static const rows_fn zf[3] = {z_frows_q8_0, z_frows_q4_0, z_frows_q4_1};
    static const rows_fn yf[3] = {y_frows_q8_0, y_frows_q4_0, y_frows_q4_1};
    static const rows_fn zv[3] = {z_irows_vnni_q8_0, z_irows_vnni_q4_0, z_irows_vnni_q4_1};
    static const rows_fn zb[3] = {z_irows_bw_q8_0, z_irows_bw_q4_0, z_irows_bw_q4_1};
    static const rows_fn yi[3] = {y_irows_q8_0, y_irows_q4_0, y_irows_q4_1};
    if (h->path == PATH_INT8) {
        if (h->V == 16)
            (h->vnni ? zv : zb)[f](j, n0, n1);
        else
            yi[f](j, n0, n1);
        return;
    }
    if (j->isa >= ISA_AVX512) {
        zf[f](j, n0, n1);
        return;
    }
    if (j->isa >= ISA_AVX2) {
        yf[f](j, n0, n1);
        return;
    }
#endif
    (void)h; (void)f;
    rows_portable(j, n0, n1, wdt);
}

static void rows_q8_0(const pq_job_t *j, int n0, int n1) { rows_32(j, n0, n1, DT_Q8_0); }
static void rows_q4_0(const pq_job_t *j, int n0, int n1) { rows_32(j, n0, n1, DT_Q4_0); }
static void rows_q4_1(const pq_job_t *j, int n0, int n1) { rows_32(j, n0, n1, DT_Q4_1); }
static void prep_q8_0(const float *x, int M, int K, void *xa, int isa) { prep_32(x, M, K, xa, isa, DT_Q8_0); }
static void prep_q4_0(const float *x, int M, int K, void *xa, int isa) { prep_32(x, M, K, xa, isa, DT_Q4_0); }
static void prep_q4_1(const float *x, int M, int K, void *xa, int isa) { prep_32(x, M, K, xa, isa, DT_Q4_1); }

static const pq_format_t g_formats[3] = {
    {DT_Q8_0, QK, 34, xa_bytes_32, prep_q8_0, rows_q8_0},
    {DT_Q4_0, QK, 18, xa_bytes_32, prep_q4_0, rows_q4_0},
    {DT_Q4_1, QK, 20, xa_bytes_32, prep_q4_1, rows_q4_1},
};

static const pq_format_t *format_of(int wdt)
{
    if (is_mine(wdt))
        return &g_formats[fidx(wdt)];
    return pq_format_k(wdt);
}

/* ------------------------------------------------------------------------- */
/* Entry points                                                               */
/* ------------------------------------------------------------------------- */

/* Per-thread scratch: x widened to fp32, and the prepared activations. */
static __thread void *tl_buf[2];
static __thread size_t tl_cap[2];

static void *scratch(int which, size_t bytes)
{
    if (bytes > tl_cap[which]) {
        free(tl_buf[which]);
        size_t cap = bytes < 65536 ? 65536 : bytes;
        tl_buf[which] = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        tl_cap[which] = tl_buf[which] ? cap : 0;
    }
    return tl_buf[which];
}

typedef struct {
    const pq_format_t *f;
    pq_job_t job;
} pq_task_t;

static void pq_task(const void *ctx, int i0, int i1)
{
    const pq_task_t *t = (const pq_task_t *)ctx;
    t->f->rows(&t->job, i0, i1);
}

/* Rows per pool chunk, as cpu_gemv.c: ~8 chunks per thread, >= 16 KB of weights, rounded to
 * 16 rows; 0 when the caller should run the matrix alone (small, or one thread). */
static int chunk_rows(int N, size_t row_bytes)
{
    const int nth = pg_num_threads();
    if (nth <= 1 || (size_t)N * row_bytes < PQ_SOLO_BYTES || N < 32)
        return 0;
    int rows = (N + PQ_CHUNKS_PER_THREAD * nth - 1) / (PQ_CHUNKS_PER_THREAD * nth);
    int min_rows = (int)((16384 + row_bytes - 1) / row_bytes);
    if (rows < min_rows)
        rows = min_rows;
    return (rows + 15) & ~15;
}

/*
 * y[M, N] = x[M, K] @ W^T (+ bias) for a block-format W (d->wdt >= DT_Q_FIRST); x, y fp32 or
 * bf16 (xdt; y has x's dtype).  0 on success, -1 bad arguments or a format without kernels,
 * -2 allocation failure.
 */
int pq_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt)
{
    if (M < 1 || M > PG_MAX_M || d->N < 1 || d->K < 1 || (xdt != DT_F32 && xdt != DT_BF16))
        return -1;
    const pq_format_t *f = format_of(d->wdt);
    if (!f || d->K % f->block_elems)
        return -1;
    const int K = d->K, N = d->N;
    const int isa = pg_isa();
    const float *x32 = (const float *)x;
    const size_t nx = (size_t)M * K;
    if (xdt == DT_BF16) {
        float *s = (float *)scratch(0, nx * 4);
        if (!s)
            return -2;
        const uint16_t *xs = (const uint16_t *)x;
        for (size_t i = 0; i < nx; i++)
            s[i] = bf16_to_f32(xs[i]);
        x32 = s;
    }
    void *xa = NULL;
    const size_t xab = f->xa_bytes ? f->xa_bytes(M, K) : 0;
    if (xab) {
        xa = scratch(1, xab);
        if (!xa)
            return -2;
        f->prep(x32, M, K, xa, isa);
    }
    pq_task_t t;
    t.f = f;
    t.job.w = (const uint8_t *)d->w;
    t.job.row_bytes = (size_t)(K / f->block_elems) * f->block_bytes;
    t.job.bias = d->bias;
    t.job.x = x32;
    t.job.xa = xa;
    t.job.y = y;
    t.job.ydt = xdt;
    t.job.M = M;
    t.job.N = N;
    t.job.K = K;
    t.job.isa = isa;
    const int rows = chunk_rows(N, t.job.row_bytes);
    if (!rows)
        f->rows(&t.job, 0, N);
    else
        pg_parallel_for(pq_task, &t, N, rows);
    return 0;
}

typedef struct {
    int wdt, K, isa;
    const uint8_t *w;
    size_t row_bytes;
    int n0;
    float *out;
} deq_task_t;

static void deq_rows(int wdt, int isa, const uint8_t *w, size_t rb, int K, int n0, int n1, float *out)
{
#ifdef PQ_X86
    if (isa >= ISA_AVX512) {
        z_dequant_rows(wdt, w, rb, K, n0, n1, out);
        return;
    }
    if (isa >= ISA_AVX2) {
        y_dequant_rows(wdt, w, rb, K, n0, n1, out);
        return;
    }
#endif
    (void)isa;
    dequant_rows_portable(wdt, w, rb, K, n0, n1, out);
}

static void deq_task(const void *ctx, int i0, int i1)
{
    const deq_task_t *t = (const deq_task_t *)ctx;
    deq_rows(t->wdt, t->isa, t->w, t->row_bytes, t->K, t->n0 + i0, t->n0 + i1,
             t->out + (size_t)i0 * t->K);
}

/*
 * out[(n1 - n0), K] (fp32) = rows n0..n1-1 of W dequantized, exactly the values the reference
 * dequantizer gives.  Split over the pool when large.  0 on success, -1 bad arguments or a
 * format this file does not dequantize (the K-quants: their table has no dequantizer; the
 * caller falls back to its reference).
 */
int pq_dequantize_rows(const pg_weight_t *d, int n0, int n1, float *out)
{
    if (!is_mine(d->wdt) || d->K < 1 || d->K % QK || n0 < 0 || n1 > d->N || n0 > n1)
        return -1;
    deq_task_t t = {d->wdt, d->K, pg_isa(), (const uint8_t *)d->w,
                    (size_t)(d->K / QK) * fmt_bb(d->wdt), n0, out};
    const int n = n1 - n0;
    const size_t bytes = (size_t)n * d->K * 4;
    if (n >= 32 && bytes >= (256u << 10) && pg_num_threads() > 1)
        pg_parallel_for(deq_task, &t, n, 16);
    else
        deq_task(&t, 0, n);
    return 0;
}

/* out[i, :] = row ids[i] of W dequantized (a quantized embedding table's lookups); ids must
 * lie in [0, N).  0 on success, -1 as pq_dequantize_rows or for an id out of range. */
int pq_dequantize_ids(const pg_weight_t *d, const int64_t *ids, int n, float *out)
{
    if (!is_mine(d->wdt) || d->K < 1 || d->K % QK || n < 0)
        return -1;
    const size_t rb = (size_t)(d->K / QK) * fmt_bb(d->wdt);
    const int isa = pg_isa();
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= d->N)
            return -1;
        deq_rows(d->wdt, isa, (const uint8_t *)d->w + (size_t)ids[i] * rb, rb, d->K, 0, 1,
                 out + (size_t)i * d->K);
    }
    return 0;
}

/* Path override for tests and benchmarks: 0 each tier's default, 1 float, 2 int8 where the
 * tier has it.  Returns the previous mode. */
int pq_set_mode(int mode)
{
    int old = g_mode;
    g_mode = mode < 0 || mode > 2 ? 0 : mode;
    return old;
}

/* 1 when wdt has row kernels in this .so (mine, or cpu_qgemv_k.c's), else 0. */
int pq_supported(int wdt)
{
    return format_of(wdt) != NULL;
}

/* How the activations of wdt are multiplied at the tier in use: 0 as fp32, else the number of
 * elements that share one int8 scale (32 here).  The K-quant tables do not say: for them 0
 * when they prepare nothing, else 256 (a bound: their int8 blocks are at most a super-block);
 * -1 when wdt has no kernels. */
int pq_act_block(int wdt)
{
    if (is_mine(wdt))
        return path_for(wdt, pg_isa()) == PATH_INT8 ? QK : 0;
    const pq_format_t *f = pq_format_k(wdt);
    if (!f)
        return -1;
    return (f->xa_bytes && f->xa_bytes(1, f->block_elems) > 0) ? 256 : 0;
}
