/*
 * cpu_qgemv_k.c -- the K-quant formats (cpu_formats.h, cpu_qgemv_k.h): small-M linear (y = x @ W^T + b,
 * M <= PG_MAX_M) over GGUF Q4_K / Q5_K / Q6_K weights kept in their 256-element super-blocks, and a
 * row dequantizer to fp32 for the prefill path (M > PG_MAX_M, a GEMM in torch).  The reference is
 * kernels/quant_reference_k.py; tests/kernels/test_qgemv_k.py checks every tier against it.
 *
 * Formats (ggml's; little-endian; d/dmin fp16, sc/m the per-sub-block scales and mins):
 *   Q4_K, 144 B: d, dmin, 12 B of 6-bit sc[8] and m[8], qs[128] nibbles.  Sub-block j (32
 *         values) = low (j even) or high (j odd) nibbles of qs[32*(j/2) ...];
 *         value = d*sc_j*q - dmin*m_j.
 *   Q5_K, 176 B: as Q4_K, plus qh[32] (bytes 16..47, qs after it): bit j of qh[l] is bit 4 of
 *         value l of sub-block j.
 *   Q6_K, 210 B: ql[128], qh[64], int8 sc[16], d.  Value i = 128h + 32g + l (h < 2, g < 4,
 *         l < 32) has low 4 bits from ql[64h + 32(g&1) + l] (low nibble for g < 2, high for
 *         g >= 2), bits 4-5 from bits 2g..2g+1 of qh[32h + l]; value = d*sc_{i/16}*(q - 32).
 *
 * How it runs.  The portable tier dequantizes a super-block to fp32 in L1 and takes fp32 dot
 * products with x (except on aarch64 with SDOT, below).  The SIMD tiers quantize x once per call
 * (prep, on the calling thread) to
 * int8 per 256 values with one fp32 scale (absmax / 127, round to nearest even; llama.cpp's
 * Q8_K) plus per-16 sums of the int8 values, then multiply the unsigned weight codes by the
 * int8 activations (vpmaddubsw: u8 x s8 pairs -> s16, no saturation: 2 * 63 * 127 < 2^15),
 * apply the integer sub-block scales with vpmaddwd + vpaddd (AVX2, AVX-512) or vpdpwssd
 * (AVX-512 VNNI, tiers avx512_vnni and up) into int32, and scale each super-block's integer sum by
 * d * dx in fp32.  (vpdpbusd would need the sub-block scales applied afterwards, a vpmulld per
 * vector; vpdpwssd folds them into the s16 step.)  The min term (Q4_K / Q5_K: dmin*m_j * sum
 * of x over sub-block j) and Q6_K's -32 offset come from the sums of the quantized x, so the
 * kernel computes exactly sum_k w_k * xhat_k (xhat = int8 * dx) up to fp32 rounding.  Each
 * weight super-block is unpacked once per 4 input rows (8 on AVX-512) and used for them from
 * registers; software prefetch runs ahead in the weight stream.
 *
 * Float vs int8, measured at M = 1, one thread, on the 2-core AMD EPYC host (AVX-512 BF16 +
 * VNNI; its CPUID also lists avx512_vp2intersect, a Zen 5 feature), N x K = 576 x 1536, weight
 * GB/s int8 / fp32-dequantize: Q4_K avx2 29 / 5.6, avx512 36 / 7.2, avx512_bf16 37 / 7.2;
 * Q5_K 30 / 5.5, 35 / 8.1, 36 / 8.2; Q6_K 39 / 5.8, 52 / 9.7, 53 / 9.7 (portable fp32: 5.2 /
 * 5.2 / 3.2).  So every SIMD tier runs int8; pqk_set_mode(1) selects the fp32 path.
 * Accuracy cost of int8 activations: each one moves by at most dx/2 = absmax_256 / 254, so
 * |y - W x| <= sum_k |w_k| * dx_k / 2 (+ fp32 rounding).  Measured ||y_int8 - y_fp32|| /
 * ||y_fp32|| (K = 1536, Gaussian weights): 0.7% for Gaussian activations, 2.7% when 1% of the
 * channels are 20x larger (an outlier coarsens its whole 256-block) -- against a weight
 * quantization error of 7.8% / 3.8% / 1.9% for round-to-nearest Q4_K / Q5_K / Q6_K, so only
 * Q6_K with outlier-heavy inputs sees the activation rounding as the larger error.
 *
 * Exports: the table's entry points (qk_*, cpu_qgemv_k.h, pointed at by cpu_formats.c),
 * pqk_dequantize_rows (prefill), pqk_set_mode; for tests and measurements pqk_linear_entry,
 * pqk_prep_entry, pqk_int8_activations.  Uses cpu_runtime.c only (pg_isa, pg_parallel_for).
 *
 * aarch64 with the dot-product extension (pg_neon_dot, the portable tier there): x quantized as
 * above (the same int8 values), each super-block unpacked to 16 registers of signed codes (Q6_K's
 * minus 32) for up to 4 inputs, SDOT per 16 values, the sub-blocks' sums reduced pairwise to a
 * lane each and multiplied by their integer scales, the super-block's exact integer sum and the
 * min term's (sum_j m_j * sums of x) scaled by d * dx, dmin * dx in fp32 (the same integers as
 * x86's kernels, the fp32 steps in another order: not x86's bits).  tests/kernels/qgemv_k_driver.c
 * checks it under qemu; its speed on an Arm core is not measured (none here).
 *
 * ISA tiers (cpu_runtime.h, j->isa): per-function #pragma GCC target regions so the generic build
 * holds every tier; tier avx2 sums its int16 products with AVX-VNNI's vpdpwssd where the CPU has
 * it (pg_avx_vnni: the same bits, 1.04-1.17x at M >= 4 on the Xeon).  Dequantization
 * (pqk_dequantize_rows and the portable path) is compiled with fp-contract=off: it rounds d*sc,
 * d*sc*q and dmin*m as the reference does, bit for bit.
 */
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>

#include "cpu_bf16.h"
#include "cpu_qgemv_k.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PQK_X86 1
#endif
#if PG_NEON_DOT  /* aarch64 (cpu_runtime.h): the SDOT kernels below */
#include <arm_neon.h>
#include <math.h>
#define PQK_NEON 1
#else
#define PQK_NEON 0
#endif

#define QK 256                     /* values per super-block */
#define Q4K_BYTES ((int)sizeof(block_q4_k))
#define Q5K_BYTES ((int)sizeof(block_q5_k))
#define Q6K_BYTES ((int)sizeof(block_q6_k))
/* Software prefetch distance into the weight stream (the hardware prefetcher stops at 4 KB
 * pages).  Measured streaming 6 x 4096x4096 Q4_K from DRAM on one thread of the 2-core host:
 * none 31-32, 4 KB 26-36, 8 KB 39-40, 16 KB 37-40 GB/s. */
#ifndef PQK_PF_BYTES
#define PQK_PF_BYTES 8192
#endif

static inline uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* IEEE fp16 -> fp32, exact for every input (subnormals, inf, NaN). */
static inline float h2f_c(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0) {
        float f = (float)m * 0x1p-24f;   /* zero or subnormal: m * 2^-24 exactly */
        return sign ? -f : f;
    }
    u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Q4_K / Q5_K scales: 12 bytes -> sc[0..7] and m[0..7] (6 bits each) as 8 bytes each.  Bytes
 * 0-3 hold sc[0..3] in their low 6 bits and bits 4-5 of sc[4..7] in their top 2; bytes 4-7 the
 * same for the mins; bytes 8-11 the low 4 bits of sc[4..7] (low nibble) and m[4..7] (high). */
static inline void k4_scales(const uint8_t *s, uint64_t *sc, uint64_t *mn)
{
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t sh = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
    const uint32_t mh = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
    *sc = (uint64_t)(a & 0x3f3f3f3fu) | (uint64_t)sh << 32;
    *mn = (uint64_t)(b & 0x3f3f3f3fu) | (uint64_t)mh << 32;
}

/* y[m, n] = v (+ bias[n]) in y's dtype. */
static inline void store_y(const pq_job_t *j, int m, int n, float v)
{
    if (j->bias)
        v += j->bias[n];
    const size_t off = (size_t)m * j->N + n;
    if (j->ydt == DT_F32)
        ((float *)j->y)[off] = v;
    else
        ((uint16_t *)j->y)[off] = f32_to_bf16(v);
}

/* ------------------------------------------------------------------------- */
/* Prepared activations (the SIMD tiers): per input row m and super-block b,  */
/* q[m][256 b ..] int8, d[m][b] = absmax / 127, bs[m][b][16] the sums of each */
/* 16 int8 values, fs[m][b][8] = d * (sum of each 32).  64-byte aligned.      */
/* ------------------------------------------------------------------------- */

typedef struct {
    int8_t *q;     /* [M, K] */
    float *d;      /* [M, K/256] */
    int16_t *bs;   /* [M, K/256, 16] */
    float *fs;     /* [M, K/256, 8] */
} xa_t;

static inline size_t al64(size_t n) { return (n + 63) & ~(size_t)63; }

static size_t xa_size(int M, int K)
{
    const size_t rows = (size_t)M * (size_t)(K / QK);
    return 64 + (size_t)M * (size_t)K + al64(rows * 4) + rows * 64;
}

static inline int uses_int8(int isa);

/* pqk_set_mode: 0 = each tier's default (int8 activations on the SIMD tiers), 1 = the fp32
 * path everywhere (exact activations, ~5x slower; for accuracy comparisons). */
static _Atomic int g_mode = 0;

static inline xa_t xa_view(const void *xa, int M, int K)
{
    const size_t rows = (size_t)M * (size_t)(K / QK);
    uintptr_t p = ((uintptr_t)xa + 63) & ~(uintptr_t)63;
    xa_t v;
    v.q = (int8_t *)p;
    p += (size_t)M * K;
    v.d = (float *)p;
    p += al64(rows * 4);
    v.bs = (int16_t *)p;
    p += rows * 32;
    v.fs = (float *)p;
    return v;
}

/* fs from bs and d (shared by the per-tier preps). */
static inline void xa_finish(xa_t *v, size_t rows)  /* (inline: a build with no prep leaves it unused) */
{
    for (size_t r = 0; r < rows; r++)
        for (int i = 0; i < 8; i++)
            v->fs[r * 8 + i] = v->d[r] * (float)(v->bs[r * 16 + 2 * i] + v->bs[r * 16 + 2 * i + 1]);
}

/* The scale of one super-block of x: 127 / absmax, 0 for an all-zero block. */
static inline float x_iscale(float amax)
{
    return amax > 0.f ? 127.f / amax : 0.f;
}

/* ------------------------------------------------------------------------- */
/* Portable tier: super-block -> fp32 (exactly the reference's roundings),    */
/* then fp32 dot products with x.                                             */
/* ------------------------------------------------------------------------- */

typedef void (*deq_fn)(const uint8_t *blk, float *out);

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

static __attribute__((noinline)) void deq_q4k_c(const uint8_t *restrict blk, float *restrict out)
{
    const float d = h2f_c(rd16(blk)), dmin = h2f_c(rd16(blk + 2));
    uint64_t sc, mn;
    k4_scales(blk + 4, &sc, &mn);
    const uint8_t *qs = blk + 16;
    for (int c = 0; c < 4; c++) {
        const float d0 = d * (float)((sc >> (16 * c)) & 0xff), m0 = dmin * (float)((mn >> (16 * c)) & 0xff);
        const float d1 = d * (float)((sc >> (16 * c + 8)) & 0xff), m1 = dmin * (float)((mn >> (16 * c + 8)) & 0xff);
        for (int l = 0; l < 32; l++) {
            out[64 * c + l] = d0 * (float)(qs[32 * c + l] & 15) - m0;
            out[64 * c + 32 + l] = d1 * (float)(qs[32 * c + l] >> 4) - m1;
        }
    }
}

static __attribute__((noinline)) void deq_q5k_c(const uint8_t *restrict blk, float *restrict out)
{
    const float d = h2f_c(rd16(blk)), dmin = h2f_c(rd16(blk + 2));
    uint64_t sc, mn;
    k4_scales(blk + 4, &sc, &mn);
    const uint8_t *qh = blk + 16, *qs = blk + 48;
    for (int c = 0; c < 4; c++) {
        const float d0 = d * (float)((sc >> (16 * c)) & 0xff), m0 = dmin * (float)((mn >> (16 * c)) & 0xff);
        const float d1 = d * (float)((sc >> (16 * c + 8)) & 0xff), m1 = dmin * (float)((mn >> (16 * c + 8)) & 0xff);
        for (int l = 0; l < 32; l++) {
            const int q0 = (qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4);
            const int q1 = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
            out[64 * c + l] = d0 * (float)q0 - m0;
            out[64 * c + 32 + l] = d1 * (float)q1 - m1;
        }
    }
}

static __attribute__((noinline)) void deq_q6k_c(const uint8_t *restrict blk, float *restrict out)
{
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192);
    const float d = h2f_c(rd16(blk + 208));
    float ds[16];
    for (int i = 0; i < 16; i++)
        ds[i] = d * (float)sc[i];
    /* Codes first (byte loops), then one scale per 16: both shapes gcc vectorises.  Value
     * 128h + 32g + l: nibble g/2 of ql[64h + 32(g&1) + l], bits 2g, 2g+1 of qh[32h + l]. */
    int8_t q[QK];
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const int a = ql[64 * h + l], b = ql[64 * h + 32 + l], hb = qh[32 * h + l];
            q[128 * h + l] = (int8_t)(((a & 15) | ((hb & 3) << 4)) - 32);
            q[128 * h + 32 + l] = (int8_t)(((b & 15) | (((hb >> 2) & 3) << 4)) - 32);
            q[128 * h + 64 + l] = (int8_t)(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32);
            q[128 * h + 96 + l] = (int8_t)(((b >> 4) | (((hb >> 6) & 3) << 4)) - 32);
        }
    for (int s = 0; s < 16; s++)
        for (int l = 0; l < 16; l++)
            out[16 * s + l] = ds[s] * (float)q[16 * s + l];
}

#pragma GCC pop_options

/* y rows [n0, n1) from dequantized super-blocks; 16 independent lane sums per input row so
 * that gcc vectorises the dot products without -ffast-math. */
static void rows_float_c(const pq_job_t *j, int n0, int n1, deq_fn deq)
{
    const int K = j->K, M = j->M, nb = K / QK;
    float wf[QK] __attribute__((aligned(64)));
    float acc[PG_MAX_M][16] __attribute__((aligned(64)));
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = j->w + (size_t)n * j->row_bytes;
        memset(acc, 0, sizeof(float) * 16 * (size_t)M);
        for (int b = 0; b < nb; b++) {
            deq(row + (size_t)b * (j->row_bytes / (size_t)nb), wf);
            for (int m = 0; m < M; m++) {
                const float *x = j->x + (size_t)m * K + (size_t)b * QK;
                for (int k = 0; k < QK; k += 16)
                    for (int i = 0; i < 16; i++)
                        acc[m][i] += wf[k + i] * x[k + i];
            }
        }
        for (int m = 0; m < M; m++) {
            float s = 0.f;
            for (int i = 0; i < 16; i++)
                s += acc[m][i];
            store_y(j, m, n, s);
        }
    }
}

/* Rows [n0, n1), inputs in blocks of up to 4 (the later blocks re-read the row from L1). */
#define PQK_ROWS(NAME, TILE, ...)                                                        \
    static void NAME(const pq_job_t *j, int n0, int n1)                                  \
    {                                                                                    \
        const xa_t xv = xa_view(j->xa, j->M, j->K);                                      \
        for (int n = n0; n < n1; n++)                                                    \
            for (int m0 = 0; m0 < j->M; m0 += 4)                                         \
                switch (j->M - m0) {                                                     \
                case 1: TILE(j, &xv, n, m0, 1, ##__VA_ARGS__); break;                    \
                case 2: TILE(j, &xv, n, m0, 2, ##__VA_ARGS__); break;                    \
                case 3: TILE(j, &xv, n, m0, 3, ##__VA_ARGS__); break;                    \
                default: TILE(j, &xv, n, m0, 4, ##__VA_ARGS__); break;                   \
                }                                                                        \
    }

#ifdef PQK_X86
/* ------------------------------------------------------------------------- */
/* AVX2 + FMA + F16C tier (16 ymm registers)                                  */
/* ------------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline __attribute__((always_inline)) float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* acc + vpdpwssd(p, s) (AVX-VNNI, VEX: the int16 pair products summed into acc, as madd + add
 * do, exactly), or the two AVX2 ops; inline assembly as in cpu_qgemv_cl.c, so the plain AVX2
 * instances cannot use it, run only where pg_avx_vnni() says the CPU has it. */
static inline __attribute__((always_inline)) __m256i y_dpwssd(const int VNNI, __m256i acc, __m256i p, __m256i s)
{
#if PQ_AVXVNNI
    if (VNNI) {
        __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(p), "x"(s));
        return acc;
    }
#endif
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
}

static inline __attribute__((always_inline)) int hsum256i(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* k4_scales in vector registers: the 12 scale bytes at s (16 readable bytes) -> bytes
 * [sc0..sc7, m0..m7] of an xmm (about half the instructions of the scalar unpack, which
 * dominated the scalar side of the kernel loop). */
static inline __attribute__((always_inline)) __m128i k4_scales_v(const uint8_t *s)
{
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    /* A: the bytes holding each output's low bits; B: those holding its top 2 bits (or 0). */
    const __m128i A = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i B = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i a = _mm_and_si128(_mm_srlv_epi32(A, _mm_setr_epi32(0, 0, 0, 4)),
                                    _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    return _mm_or_si128(a, _mm_and_si128(_mm_srli_epi32(B, 2), _mm_set1_epi8(0x30)));
}

/* [d, dmin, 0, 0] from the first 4 bytes of a Q4_K / Q5_K block. */
static inline __attribute__((always_inline)) __m128 k4_dmin(const uint8_t *blk)
{
    uint32_t u;
    memcpy(&u, blk, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)u));
}

/* A ymm whose low 128-bit lane holds int16 `lo` and high lane `hi`, 8 times each. */
static inline __attribute__((always_inline)) __m256i lanes16(int lo, int hi)
{
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)lo)),
                                   _mm_set1_epi16((short)hi), 1);
}

/* x [M, K] -> int8 per 256 (see xa_t). */
static void prep_avx2(const float *x, int M, int K, void *xa)
{
    const int nb = K / QK;
    xa_t v = xa_view(xa, M, K);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)m * K + (size_t)b * QK;
            const size_t r = (size_t)m * nb + b;
            __m256 mx = _mm256_setzero_ps();
            for (int i = 0; i < QK; i += 8)
                mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + i), absm));
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            t = _mm_max_ss(t, _mm_movehdup_ps(t));
            const float amax = _mm_cvtss_f32(t);
            const __m256 is = _mm256_set1_ps(x_iscale(amax));
            v.d[r] = amax / 127.f;
            for (int i = 0; i < QK; i += 32) {
                __m256i q[4];
                for (int u = 0; u < 4; u++) {
                    q[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * u), is));
                    q[u] = _mm256_min_epi32(_mm256_max_epi32(q[u], lo), hi);
                }
                v.bs[r * 16 + i / 16] = (int16_t)hsum256i(_mm256_add_epi32(q[0], q[1]));
                v.bs[r * 16 + i / 16 + 1] = (int16_t)hsum256i(_mm256_add_epi32(q[2], q[3]));
                /* packs interleave the 128-bit lanes: a0-3 b0-3 c0-3 d0-3 | a4-7 ...; undo. */
                __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
                _mm256_storeu_si256((__m256i *)(v.q + (size_t)m * K + (size_t)b * QK + i),
                                    _mm256_permutevar8x32_epi32(p, perm));
            }
        }
    xa_finish(&v, (size_t)M * nb);
}

/* One weight row, MR <= 4 inputs, Q4_K (q5 = 0) or Q5_K (q5 = 1).  Sub-block by sub-block
 * (16 registers do not hold a whole unpacked super-block): codes W (32 x u8), scale S
 * (16 x int16), then for every input acc += madd(maddubs(W, x), S). */
static inline __attribute__((always_inline))
void tile_q45k_avx2(const pq_job_t *j, const xa_t *xv, int n, int m0, const int MR, const int q5, const int VNNI)
{
    const int K = j->K, nb = K / QK;
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m16 = _mm256_set1_epi8(0x10);
    __m256 accf[4];
    for (int m = 0; m < MR; m++)
        accf[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * (q5 ? Q5K_BYTES : Q4K_BYTES);
        if (PQK_PF_BYTES && m0 == 0)
            for (int o = 0; o < 192; o += 64)
                _mm_prefetch((const char *)blk + PQK_PF_BYTES + o, _MM_HINT_T0);
        const float d = _cvtsh_ss(rd16(blk)), dmin = _cvtsh_ss(rd16(blk + 2));
        uint64_t sc, mn;
        k4_scales(blk + 4, &sc, &mn);
        const __m256i sb = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        const __m256 cvec = _mm256_mul_ps(_mm256_set1_ps(dmin),
                                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
        const uint8_t *qs = blk + (q5 ? 48 : 16);
        __m256i hq = _mm256_setzero_si256();
        if (q5)
            hq = _mm256_loadu_si256((const __m256i *)(blk + 16));
        __m256i acc[4];
        for (int m = 0; m < MR; m++)
            acc[m] = _mm256_setzero_si256();
        for (int sj = 0; sj < 8; sj++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (sj / 2)));
            __m256i w = _mm256_and_si256((sj & 1) ? _mm256_srli_epi16(v, 4) : v, m4);
            if (q5) /* bit sj of each qh byte -> bit 4 (shifts stay inside each byte) */
                w = _mm256_or_si256(w, _mm256_and_si256(sj <= 4 ? _mm256_slli_epi16(hq, 4 - sj)
                                                                : _mm256_srli_epi16(hq, sj - 4), m16));
            const __m256i s = _mm256_shuffle_epi8(sb, lanes16(0x0101 * 2 * sj + 0x0100, 0x0101 * 2 * sj + 0x0100));
            for (int m = 0; m < MR; m++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(xv->q + (size_t)(m0 + m) * K + (size_t)b * QK + 32 * sj));
                acc[m] = y_dpwssd(VNNI, acc[m], _mm256_maddubs_epi16(w, xq), s);
            }
        }
        for (int m = 0; m < MR; m++) {
            const size_t r = (size_t)(m0 + m) * nb + b;
            accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(d * xv->d[r]), accf[m]);
            accf[m] = _mm256_fnmadd_ps(cvec, _mm256_loadu_ps(xv->fs + r * 8), accf[m]);
        }
    }
    for (int m = 0; m < MR; m++)
        store_y(j, m0 + m, n, hsum256(accf[m]));
}

/* Q6_K: per half h, four 32-value vectors g (values 128h + 32g ..), two sub-blocks each. */
static inline __attribute__((always_inline))
void tile_q6k_avx2(const pq_job_t *j, const xa_t *xv, int n, int m0, const int MR, const int VNNI)
{
    const int K = j->K, nb = K / QK;
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    __m256 accf[4];
    for (int m = 0; m < MR; m++)
        accf[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * Q6K_BYTES;
        if (PQK_PF_BYTES && m0 == 0)
            for (int o = 0; o < 256; o += 64)
                _mm_prefetch((const char *)blk + PQK_PF_BYTES + o, _MM_HINT_T0);
        const float d = _cvtsh_ss(rd16(blk + 208));
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i ns16 = _mm256_mullo_epi16(s16, _mm256_set1_epi16(-32));
        __m256i acc[4];
        for (int m = 0; m < MR; m++) /* the -32 offset: -32 * sum_i sc_i * (sum of x in sub-block i) */
            acc[m] = _mm256_madd_epi16(ns16, _mm256_loadu_si256((const __m256i *)(xv->bs + ((size_t)(m0 + m) * nb + b) * 16)));
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i hq = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m256i sh = _mm256_permute2x128_si256(s16, s16, h ? 0x11 : 0x00);
            for (int g = 0; g < 4; g++) {
                const __m256i lo4 = _mm256_and_si256(g < 2 ? (g ? c : a) : _mm256_srli_epi16(g == 2 ? a : c, 4), m4);
                const __m256i hi2 = _mm256_and_si256(g == 0 ? _mm256_slli_epi16(hq, 4) : g == 1 ? _mm256_slli_epi16(hq, 2)
                                                     : g == 2 ? hq : _mm256_srli_epi16(hq, 2), m30);
                const __m256i w = _mm256_or_si256(lo4, hi2);
                const __m256i s = _mm256_shuffle_epi8(sh, lanes16(0x0101 * 4 * g + 0x0100, 0x0101 * (4 * g + 2) + 0x0100));
                for (int m = 0; m < MR; m++) {
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(xv->q + (size_t)(m0 + m) * K + (size_t)b * QK + 128 * h + 32 * g));
                    acc[m] = y_dpwssd(VNNI, acc[m], _mm256_maddubs_epi16(w, xq), s);
                }
            }
        }
        for (int m = 0; m < MR; m++)
            accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]),
                                      _mm256_set1_ps(d * xv->d[(size_t)(m0 + m) * nb + b]), accf[m]);
    }
    for (int m = 0; m < MR; m++)
        store_y(j, m0 + m, n, hsum256(accf[m]));
}

/* The same in blocks of up to 8 (AVX-512: 32 registers hold an unpacked super-block and 8
 * inputs' accumulators, so it is unpacked half as often). */
#define PQK_ROWS8(NAME, TILE, ...)                                                       \
    static void NAME(const pq_job_t *j, int n0, int n1)                                  \
    {                                                                                    \
        const xa_t xv = xa_view(j->xa, j->M, j->K);                                      \
        for (int n = n0; n < n1; n++)                                                    \
            for (int m0 = 0; m0 < j->M; m0 += 8)                                         \
                switch (j->M - m0) {                                                     \
                case 1: TILE(j, &xv, n, m0, 1, ##__VA_ARGS__); break;                    \
                case 2: TILE(j, &xv, n, m0, 2, ##__VA_ARGS__); break;                    \
                case 3: TILE(j, &xv, n, m0, 3, ##__VA_ARGS__); break;                    \
                case 4: TILE(j, &xv, n, m0, 4, ##__VA_ARGS__); break;                    \
                case 5: TILE(j, &xv, n, m0, 5, ##__VA_ARGS__); break;                    \
                case 6: TILE(j, &xv, n, m0, 6, ##__VA_ARGS__); break;                    \
                case 7: TILE(j, &xv, n, m0, 7, ##__VA_ARGS__); break;                    \
                default: TILE(j, &xv, n, m0, 8, ##__VA_ARGS__); break;                   \
                }                                                                        \
    }

PQK_ROWS(rows_q4k_plain, tile_q45k_avx2, 0, 0)
PQK_ROWS(rows_q5k_plain, tile_q45k_avx2, 1, 0)
PQK_ROWS(rows_q6k_plain, tile_q6k_avx2, 0)
PQK_ROWS(rows_q4k_avxvnni, tile_q45k_avx2, 0, 1)
PQK_ROWS(rows_q5k_avxvnni, tile_q45k_avx2, 1, 1)
PQK_ROWS(rows_q6k_avxvnni, tile_q6k_avx2, 1)
/* tier avx2's rows: with AVX-VNNI's vpdpwssd where the CPU has it (the same bits; a build
 * without the instruction, PQ_AVXVNNI 0, never takes that branch) */
#define PQK_AVX2_ROWS(q)                                                                 \
    static void rows_##q##_avx2(const pq_job_t *j, int n0, int n1)                       \
    {                                                                                    \
        if (PQ_AVXVNNI && pg_avx_vnni())                                                 \
            rows_##q##_avxvnni(j, n0, n1);                                               \
        else                                                                             \
            rows_##q##_plain(j, n0, n1);                                                 \
    }
PQK_AVX2_ROWS(q4k)
PQK_AVX2_ROWS(q5k)
PQK_AVX2_ROWS(q6k)

#pragma GCC optimize("fp-contract=off")

/* Dequantization, 8 values per step (pmovzxbd from 8 bytes). */
static __attribute__((noinline)) void deq_q4k_avx2(const uint8_t *blk, float *out)
{
    const float d = _cvtsh_ss(rd16(blk)), dmin = _cvtsh_ss(rd16(blk + 2));
    uint64_t sc, mn;
    k4_scales(blk + 4, &sc, &mn);
    const __m256i m4 = _mm256_set1_epi32(15);
    for (int c = 0; c < 4; c++) {
        const __m256 d0 = _mm256_set1_ps(d * (float)((sc >> (16 * c)) & 0xff));
        const __m256 d1 = _mm256_set1_ps(d * (float)((sc >> (16 * c + 8)) & 0xff));
        const __m256 o0 = _mm256_set1_ps(dmin * (float)((mn >> (16 * c)) & 0xff));
        const __m256 o1 = _mm256_set1_ps(dmin * (float)((mn >> (16 * c + 8)) & 0xff));
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 16 + 32 * c + 8 * g)));
            _mm256_storeu_ps(out + 64 * c + 8 * g,
                             _mm256_sub_ps(_mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_and_si256(v, m4))), o0));
            _mm256_storeu_ps(out + 64 * c + 32 + 8 * g,
                             _mm256_sub_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))), o1));
        }
    }
}

static __attribute__((noinline)) void deq_q5k_avx2(const uint8_t *blk, float *out)
{
    const float d = _cvtsh_ss(rd16(blk)), dmin = _cvtsh_ss(rd16(blk + 2));
    uint64_t sc, mn;
    k4_scales(blk + 4, &sc, &mn);
    const __m256i m4 = _mm256_set1_epi32(15), m16 = _mm256_set1_epi32(16);
    for (int c = 0; c < 4; c++) {
        const __m256 d0 = _mm256_set1_ps(d * (float)((sc >> (16 * c)) & 0xff));
        const __m256 d1 = _mm256_set1_ps(d * (float)((sc >> (16 * c + 8)) & 0xff));
        const __m256 o0 = _mm256_set1_ps(dmin * (float)((mn >> (16 * c)) & 0xff));
        const __m256 o1 = _mm256_set1_ps(dmin * (float)((mn >> (16 * c + 8)) & 0xff));
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 48 + 32 * c + 8 * g)));
            const __m256i h = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * g))), 4);
            const __m256i q0 = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi32(h, 2 * c), m16));
            const __m256i q1 = _mm256_or_si256(_mm256_srli_epi32(v, 4), _mm256_and_si256(_mm256_srli_epi32(h, 2 * c + 1), m16));
            _mm256_storeu_ps(out + 64 * c + 8 * g, _mm256_sub_ps(_mm256_mul_ps(d0, _mm256_cvtepi32_ps(q0)), o0));
            _mm256_storeu_ps(out + 64 * c + 32 + 8 * g, _mm256_sub_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(q1)), o1));
        }
    }
}

static __attribute__((noinline)) void deq_q6k_avx2(const uint8_t *blk, float *out)
{
    const float d = _cvtsh_ss(rd16(blk + 208));
    const int8_t *sc = (const int8_t *)(blk + 192);
    const __m256i m4 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), o32 = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 4; g++) {
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 64 * h + 8 * g)));
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 64 * h + 32 + 8 * g)));
            const __m256i hq = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 128 + 32 * h + 8 * g)));
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi32(_mm256_and_si256(hq, m3), 4)),
                _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hq, 2), m3), 4)),
                _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hq, 4), m3), 4)),
                _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(hq, 6), 4)),
            };
            for (int u = 0; u < 4; u++) {
                const int i = 128 * h + 32 * u + 8 * g;
                const __m256 s = _mm256_set1_ps(d * (float)sc[i / 16]);
                _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[u], o32))));
            }
        }
}

#pragma GCC pop_options

/* ------------------------------------------------------------------------- */
/* AVX-512 tiers.  A super-block's codes and scales are unpacked once (8    */
/* zmm) and used for MR <= 8 inputs; 64 values per vpmaddubsw.              */
/* ------------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

/* A zmm whose low 256 bits hold int16 `lo` (16 times) and high 256 bits `hi`. */
static inline __attribute__((always_inline)) __m512i halves16(int lo, int hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)lo)), _mm256_set1_epi16((short)hi), 1);
}

static inline __attribute__((always_inline)) __m512i halves8(int lo, int hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8((char)lo)), _mm256_set1_epi8((char)hi), 1);
}

static inline __attribute__((always_inline)) float hsum512_256(__m512 a, __m256 sub)
{
    __m256 s = _mm256_sub_ps(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)), sub);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}

/* reorder: store each 128 values as sub-blocks (of 32) 0, 2, 1, 3 (x_reordered). */
static void prep_avx512(const float *x, int M, int K, void *xa, int reorder)
{
    const int nb = K / QK;
    xa_t v = xa_view(xa, M, K);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)m * K + (size_t)b * QK;
            const size_t r = (size_t)m * nb + b;
            __m512 mx = _mm512_setzero_ps();
            for (int i = 0; i < QK; i += 16)
                mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
            const float amax = _mm512_reduce_max_ps(mx);
            const __m512 is = _mm512_set1_ps(x_iscale(amax));
            v.d[r] = amax / 127.f;
            for (int i = 0; i < QK; i += 16) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), is));
                q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
                v.bs[r * 16 + i / 16] = (int16_t)_mm512_reduce_add_epi32(q);
                const int p = i & 127, sub = p >> 5, slot = reorder ? ((sub & 1) << 1) | (sub >> 1) : sub;
                _mm_storeu_si128((__m128i *)(v.q + (size_t)m * K + (size_t)b * QK + (i & ~127) + 32 * slot + (p & 31)),
                                 _mm512_cvtepi32_epi8(q));
            }
        }
    xa_finish(&v, (size_t)M * nb);
}

/* The int8 kernels, instantiated for AVX-512 (DOT = vpmaddubsw, vpmaddwd, vpaddd) and for
 * AVX-512 VNNI (vpmaddubsw, vpdpwssd): acc += sum over int16 pairs of maddubs(w, x) * s. */
#define DOT_MADD(acc, w, x, s) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), s))
#define DOT_VNNI(acc, w, x, s) _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(w, x), s)
#define DOT0(w, x, s) _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), s)  /* acc = 0 */

/* Q4_K / Q5_K: zmm t (t = 2c + p, c < 2, p < 2) = nibble p of qs[64c .. 64c+63], i.e.
 * sub-blocks 4c+p (low 256 bits) and 4c+2+p (high 256 bits).  prep stored x in that order
 * (per 128 values: sub-blocks 0, 2, 1, 3; x_reordered), so x loads stay contiguous.  Its scale
 * vector holds the two sub-blocks' sc in the low / high 16 int16 lanes.  The min term is one
 * fp32 FMA per input on the 8 per-32 sums of xhat (fs). */
#define PQK_DEF_Q45K(SFX, DOT)                                                              \
static inline __attribute__((always_inline))                                                      \
void tile_q45k_##SFX(const pq_job_t *j, const xa_t *xv, int n, int m0, const int MR, const int q5) \
{                                                                                                 \
    const int K = j->K, nb = K / QK, bb = q5 ? Q5K_BYTES : Q4K_BYTES;                             \
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;                                         \
    const __m512i m4 = _mm512_set1_epi8(0x0f), m16 = _mm512_set1_epi8(0x10);                      \
    __m512 accf[8];                                                                               \
    __m256 macc[8];                                                                               \
    for (int m = 0; m < MR; m++) {                                                                \
        accf[m] = _mm512_setzero_ps();                                                            \
        macc[m] = _mm256_setzero_ps();                                                            \
    }                                                                                             \
    for (int b = 0; b < nb; b++) {                                                                \
        const uint8_t *blk = row + (size_t)b * bb;                                                \
        if (PQK_PF_BYTES && m0 == 0)                                                              \
            for (int o = 0; o < 192; o += 64)                                                     \
                _mm_prefetch((const char *)blk + PQK_PF_BYTES + o, _MM_HINT_T0);                  \
        const __m128 dd = k4_dmin(blk);                                                           \
        const __m512 dv = _mm512_broadcastss_ps(dd);                                              \
        const __m128i scm = k4_scales_v(blk + 4);                                                 \
        const __m512i sb = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(scm));                        \
        const __m256 cvec = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)),             \
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(scm, scm))));              \
        const uint8_t *qs = blk + (q5 ? 48 : 16);                                                 \
        __m512i hq = _mm512_setzero_si512();                                                      \
        if (q5)                                                                                   \
            hq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));         \
        __m512i W[4], S[4];                                                                       \
        for (int c = 0; c < 2; c++) {                                                             \
            const __m512i v = _mm512_loadu_si512(qs + 64 * c);                                    \
            W[2 * c] = _mm512_and_si512(v, m4);                                                   \
            W[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);                         \
            for (int p = 0; p < 2; p++) {                                                         \
                const int lo = 4 * c + p, hi = 4 * c + 2 + p; /* the two sub-blocks */            \
                if (q5)                                                                           \
                    W[2 * c + p] = _mm512_mask_add_epi8(W[2 * c + p],                             \
                        _mm512_test_epi8_mask(hq, halves8(1 << lo, 1 << hi)), W[2 * c + p], m16); \
                S[2 * c + p] = _mm512_shuffle_epi8(sb, halves16(0x0202 * lo + 0x0100, 0x0202 * hi + 0x0100)); \
            }                                                                                     \
        }                                                                                         \
        for (int m = 0; m < MR; m++) {                                                            \
            const size_t r = (size_t)(m0 + m) * nb + b;                                           \
            const int8_t *xq = xv->q + (size_t)(m0 + m) * K + (size_t)b * QK;                     \
            __m512i acc = DOT0(W[0], _mm512_loadu_si512(xq), S[0]);                               \
            acc = DOT(acc, W[1], _mm512_loadu_si512(xq + 64), S[1]);                              \
            acc = DOT(acc, W[2], _mm512_loadu_si512(xq + 128), S[2]);                             \
            acc = DOT(acc, W[3], _mm512_loadu_si512(xq + 192), S[3]);                             \
            accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dv, _mm512_set1_ps(xv->d[r])), accf[m]); \
            macc[m] = _mm256_fmadd_ps(cvec, _mm256_loadu_ps(xv->fs + r * 8), macc[m]);            \
        }                                                                                         \
    }                                                                                             \
    for (int m = 0; m < MR; m++)                                                                  \
        store_y(j, m0 + m, n, hsum512_256(accf[m], macc[m]));                                     \
}                                                                                                 \
PQK_ROWS8(rows_q4k_##SFX, tile_q45k_##SFX, 0)                                                     \
PQK_ROWS8(rows_q5k_##SFX, tile_q45k_##SFX, 1)

/* Q6_K: per half h, zmm 2h = low nibbles of ql[64h ..] (values 128h + 0..63) and zmm 2h+1 =
 * high nibbles (128h + 64..127), bits 4-5 from qh[32h ..] shifted per 256-bit half; each
 * 128-bit lane is one sub-block of 16, so its scale vector is sc[4t + lane] (vpermw).  The
 * -32 offset starts the int32 sum: -32 * sum_i sc_i * bs_i. */
#define PQK_DEF_Q6K(SFX, DOT)                                                                     \
static inline __attribute__((always_inline))                                                      \
void tile_q6k_##SFX(const pq_job_t *j, const xa_t *xv, int n, int m0, const int MR)               \
{                                                                                                 \
    const int K = j->K, nb = K / QK;                                                              \
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;                                         \
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);                      \
    const __m512i lane_of = _mm512_set_epi64(0x0003000300030003ll, 0x0003000300030003ll,          \
        0x0002000200020002ll, 0x0002000200020002ll, 0x0001000100010001ll, 0x0001000100010001ll, 0, 0); \
    __m512 accf[8];                                                                               \
    for (int m = 0; m < MR; m++)                                                                  \
        accf[m] = _mm512_setzero_ps();                                                            \
    for (int b = 0; b < nb; b++) {                                                                \
        const uint8_t *blk = row + (size_t)b * Q6K_BYTES;                                         \
        if (PQK_PF_BYTES && m0 == 0)                                                              \
            for (int o = 0; o < 256; o += 64)                                                     \
                _mm_prefetch((const char *)blk + PQK_PF_BYTES + o, _MM_HINT_T0);                  \
        const float d = _cvtsh_ss(rd16(blk + 208));                                               \
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));  \
        const __m256i ns16 = _mm256_mullo_epi16(s16, _mm256_set1_epi16(-32));                     \
        const __m512i s512 = _mm512_castsi256_si512(s16);                                         \
        __m512i W[4], S[4];                                                                       \
        for (int h = 0; h < 2; h++) {                                                             \
            const __m512i lv = _mm512_loadu_si512(blk + 64 * h);                                  \
            const __m512i hv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h))); \
            const __m512i t0 = _mm512_and_si512(_mm512_sllv_epi16(hv, halves16(4, 2)), m30);     \
            const __m512i t1 = _mm512_and_si512(_mm512_srlv_epi16(hv, halves16(0, 2)), m30);     \
            W[2 * h] = _mm512_ternarylogic_epi32(lv, t0, m4, 0xe4);                              \
            W[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(lv, 4), t1, m4, 0xe4);    \
            S[2 * h] = _mm512_permutexvar_epi16(_mm512_add_epi16(lane_of, _mm512_set1_epi16((short)(8 * h))), s512); \
            S[2 * h + 1] = _mm512_permutexvar_epi16(_mm512_add_epi16(lane_of, _mm512_set1_epi16((short)(8 * h + 4))), s512); \
        }                                                                                         \
        for (int m = 0; m < MR; m++) {                                                            \
            const size_t r = (size_t)(m0 + m) * nb + b;                                           \
            const int8_t *xq = xv->q + (size_t)(m0 + m) * K + (size_t)b * QK;                     \
            __m512i acc = _mm512_zextsi256_si512(                                                 \
                _mm256_madd_epi16(ns16, _mm256_loadu_si256((const __m256i *)(xv->bs + r * 16)))); \
            acc = DOT(acc, W[0], _mm512_loadu_si512(xq), S[0]);                                   \
            acc = DOT(acc, W[1], _mm512_loadu_si512(xq + 64), S[1]);                              \
            acc = DOT(acc, W[2], _mm512_loadu_si512(xq + 128), S[2]);                             \
            acc = DOT(acc, W[3], _mm512_loadu_si512(xq + 192), S[3]);                             \
            accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(d * xv->d[r]), accf[m]); \
        }                                                                                         \
    }                                                                                             \
    for (int m = 0; m < MR; m++)                                                                  \
        store_y(j, m0 + m, n, hsum512_256(accf[m], _mm256_setzero_ps()));                         \
}                                                                                                 \
PQK_ROWS8(rows_q6k_##SFX, tile_q6k_##SFX)

PQK_DEF_Q45K(avx512, DOT_MADD)
PQK_DEF_Q6K(avx512, DOT_MADD)

#pragma GCC optimize("fp-contract=off")

/* Dequantization, 16 values per step (pmovzxbd from 16 bytes). */
static __attribute__((noinline)) void deq_q4k_avx512(const uint8_t *blk, float *out)
{
    const float d = _cvtsh_ss(rd16(blk)), dmin = _cvtsh_ss(rd16(blk + 2));
    uint64_t sc, mn;
    k4_scales(blk + 4, &sc, &mn);
    const __m512i m4 = _mm512_set1_epi32(15);
    for (int c = 0; c < 4; c++) {
        const __m512 d0 = _mm512_set1_ps(d * (float)((sc >> (16 * c)) & 0xff));
        const __m512 d1 = _mm512_set1_ps(d * (float)((sc >> (16 * c + 8)) & 0xff));
        const __m512 o0 = _mm512_set1_ps(dmin * (float)((mn >> (16 * c)) & 0xff));
        const __m512 o1 = _mm512_set1_ps(dmin * (float)((mn >> (16 * c + 8)) & 0xff));
        for (int g = 0; g < 2; g++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 + 32 * c + 16 * g)));
            _mm512_storeu_ps(out + 64 * c + 16 * g,
                             _mm512_sub_ps(_mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(v, m4))), o0));
            _mm512_storeu_ps(out + 64 * c + 32 + 16 * g,
                             _mm512_sub_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))), o1));
        }
    }
}

static __attribute__((noinline)) void deq_q5k_avx512(const uint8_t *blk, float *out)
{
    const float d = _cvtsh_ss(rd16(blk)), dmin = _cvtsh_ss(rd16(blk + 2));
    uint64_t sc, mn;
    k4_scales(blk + 4, &sc, &mn);
    const __m512i m4 = _mm512_set1_epi32(15), m16 = _mm512_set1_epi32(16);
    for (int c = 0; c < 4; c++) {
        const __m512 d0 = _mm512_set1_ps(d * (float)((sc >> (16 * c)) & 0xff));
        const __m512 d1 = _mm512_set1_ps(d * (float)((sc >> (16 * c + 8)) & 0xff));
        const __m512 o0 = _mm512_set1_ps(dmin * (float)((mn >> (16 * c)) & 0xff));
        const __m512 o1 = _mm512_set1_ps(dmin * (float)((mn >> (16 * c + 8)) & 0xff));
        for (int g = 0; g < 2; g++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 48 + 32 * c + 16 * g)));
            const __m512i h = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 + 16 * g))), 4);
            const __m512i q0 = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_srli_epi32(h, 2 * c), m16));
            const __m512i q1 = _mm512_or_si512(_mm512_srli_epi32(v, 4), _mm512_and_si512(_mm512_srli_epi32(h, 2 * c + 1), m16));
            _mm512_storeu_ps(out + 64 * c + 16 * g, _mm512_sub_ps(_mm512_mul_ps(d0, _mm512_cvtepi32_ps(q0)), o0));
            _mm512_storeu_ps(out + 64 * c + 32 + 16 * g, _mm512_sub_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(q1)), o1));
        }
    }
}

static __attribute__((noinline)) void deq_q6k_avx512(const uint8_t *blk, float *out)
{
    const float d = _cvtsh_ss(rd16(blk + 208));
    const int8_t *sc = (const int8_t *)(blk + 192);
    const __m512i m4 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3), o32 = _mm512_set1_epi32(32);
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 2; g++) {
            const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 * h + 16 * g)));
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 * h + 32 + 16 * g)));
            const __m512i hq = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 128 + 32 * h + 16 * g)));
            const __m512i q[4] = {
                _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_slli_epi32(_mm512_and_si512(hq, m3), 4)),
                _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hq, 2), m3), 4)),
                _mm512_or_si512(_mm512_srli_epi32(a, 4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hq, 4), m3), 4)),
                _mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_slli_epi32(_mm512_srli_epi32(hq, 6), 4)),
            };
            for (int u = 0; u < 4; u++) {
                const int i = 128 * h + 32 * u + 16 * g;
                const __m512 s = _mm512_set1_ps(d * (float)sc[i / 16]);
                _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_sub_epi32(q[u], o32))));
            }
        }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
PQK_DEF_Q45K(vnni, DOT_VNNI)
PQK_DEF_Q6K(vnni, DOT_VNNI)
#pragma GCC pop_options

#endif /* PQK_X86 */

#if PQK_NEON
/* ------------------------------------------------------------------------- */
/* aarch64 with the dot-product extension (SDOT, pg_neon_dot): the portable   */
/* tier's int8 kernels.  A super-block's codes are unpacked once (16 q        */
/* registers of 16 signed bytes) and used for MR <= 4 inputs; the sub-blocks' */
/* SDOT sums, reduced pairwise to a lane each, times their integer scales:   */
/* the super-block's integer sum is exact, as on x86.                         */
/* ------------------------------------------------------------------------- */

/* A target without the extension (a generic aarch64 build) gets it here only; one with it keeps
 * its own tuning (as cpu_qgemv_neon.c). */
#if !defined(__ARM_FEATURE_DOTPROD)
#define PQK_NEON_PRAGMA 1
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#else
#define PQK_NEON_PRAGMA 0
#endif

/* x [M, K] -> int8 per 256 (xa_t, the canonical order): the x86 preps' values for finite x
 * whose block absmax is a normal number (vcvtnq rounds to nearest even, as cvtps2dq does; a NaN,
 * which fmax keeps and maxps may drop, or an absmax whose 127 / amax overflows, can differ). */
static void prep_neon(const float *x, int M, int K, void *xa)
{
    const int nb = K / QK;
    xa_t v = xa_view(xa, M, K);
    const int32x4_t lo = vdupq_n_s32(-127), hi = vdupq_n_s32(127);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)m * K + (size_t)b * QK;
            const size_t r = (size_t)m * nb + b;
            float32x4_t mx = vdupq_n_f32(0.f);
            for (int i = 0; i < QK; i += 4)
                mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(xb + i)));
            const float amax = vmaxvq_f32(mx);
            const float32x4_t is = vdupq_n_f32(x_iscale(amax));
            v.d[r] = amax / 127.f;
            for (int i = 0; i < QK; i += 16) {
                int32x4_t q[4];
                for (int u = 0; u < 4; u++)
                    q[u] = vminq_s32(vmaxq_s32(vcvtnq_s32_f32(vmulq_f32(vld1q_f32(xb + i + 4 * u), is)), lo), hi);
                v.bs[r * 16 + i / 16] = (int16_t)vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
                const int16x8_t h0 = vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1]));
                const int16x8_t h1 = vcombine_s16(vmovn_s32(q[2]), vmovn_s32(q[3]));
                vst1q_s8(v.q + (size_t)m * K + (size_t)b * QK + i, vcombine_s8(vmovn_s16(h0), vmovn_s16(h1)));
            }
        }
    xa_finish(&v, (size_t)M * nb);
}

/* One weight row, MR <= 4 inputs.  Q4_K / Q5_K: W[2j], W[2j+1] = sub-block j's 32 codes (0..31);
 * per input the exact integer sum_j sc_j * sum_i q_i x_i, then in fp32
 * acc += (d dx) * isum - (dmin dx) * sum_j m_j * (sum of x over sub-block j). */
static inline __attribute__((always_inline))
void tile_q45k_neon(const pq_job_t *j, const xa_t *xv, int n, int m0, const int MR, const int q5)
{
    const int K = j->K, nb = K / QK, bb = q5 ? Q5K_BYTES : Q4K_BYTES;
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;
    const uint8x16_t m4 = vdupq_n_u8(15), m16 = vdupq_n_u8(16);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        if (PQK_PF_BYTES && m0 == 0)
            for (int o = 0; o < 192; o += 64)
                __builtin_prefetch(blk + PQK_PF_BYTES + o);
        uint32_t dm;
        memcpy(&dm, blk, 4);
        const float32x4_t ddm = vcvt_f32_f16(vreinterpret_f16_u32(vdup_n_u32(dm)));  /* d, dmin, .. */
        const float d = vgetq_lane_f32(ddm, 0), dmin = vgetq_lane_f32(ddm, 1);
        uint64_t scb, mnb;
        k4_scales(blk + 4, &scb, &mnb);
        const uint16x8_t sc16 = vmovl_u8(vcreate_u8(scb));
        const int32x4_t sc0 = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(sc16)));
        const int32x4_t sc1 = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(sc16)));
        const int16x8_t mn16 = vreinterpretq_s16_u16(vmovl_u8(vcreate_u8(mnb)));
        const uint8_t *qs = blk + (q5 ? 48 : 16);
        uint8x16_t hq[2] = {vdupq_n_u8(0), vdupq_n_u8(0)};
        if (q5) {
            hq[0] = vld1q_u8(blk + 16);
            hq[1] = vld1q_u8(blk + 32);
        }
        int8x16_t W[16];
        for (int c = 0; c < 4; c++)
            for (int u = 0; u < 2; u++) {
                const uint8x16_t v = vld1q_u8(qs + 32 * c + 16 * u);
                uint8x16_t w0 = vandq_u8(v, m4), w1 = vshrq_n_u8(v, 4);
                if (q5) { /* bit 2c (2c + 1) of qh[l] -> bit 4 of value l of sub-block 2c (2c + 1) */
                    w0 = vorrq_u8(w0, vandq_u8(vshlq_u8(hq[u], vdupq_n_s8((int8_t)(4 - 2 * c))), m16));
                    w1 = vorrq_u8(w1, vandq_u8(vshlq_u8(hq[u], vdupq_n_s8((int8_t)(3 - 2 * c))), m16));
                }
                W[4 * c + u] = vreinterpretq_s8_u8(w0);
                W[4 * c + 2 + u] = vreinterpretq_s8_u8(w1);
            }
        for (int m = 0; m < MR; m++) {
            const size_t r = (size_t)(m0 + m) * nb + b;
            const int8_t *xq = xv->q + (size_t)(m0 + m) * K + (size_t)b * QK;
            /* sub-block s's SDOT sums, reduced pairwise (addp) to one lane per sub-block, times
             * the scales: the exact integer sum in any order, and no chain of lane MLAs */
#define PQK_SB(s) vdotq_s32(vdotq_s32(vdupq_n_s32(0), W[2 * (s)], vld1q_s8(xq + 32 * (s))), \
                            W[2 * (s) + 1], vld1q_s8(xq + 32 * (s) + 16))
            const int32x4_t s03 = vpaddq_s32(vpaddq_s32(PQK_SB(0), PQK_SB(1)), vpaddq_s32(PQK_SB(2), PQK_SB(3)));
            const int32x4_t s47 = vpaddq_s32(vpaddq_s32(PQK_SB(4), PQK_SB(5)), vpaddq_s32(PQK_SB(6), PQK_SB(7)));
#undef PQK_SB
            const int32x4_t is = vmlaq_s32(vmulq_s32(s03, sc0), s47, sc1);
            /* sum_j m_j * (bs[2j] + bs[2j + 1]): pairwise sums of the per-16 sums, times the mins */
            const int16_t *bs = xv->bs + r * 16;
            const int16x8_t s32 = vpaddq_s16(vld1q_s16(bs), vld1q_s16(bs + 8));
            const int32_t msum = vaddvq_s32(vmlal_s16(vmull_s16(vget_low_s16(s32), vget_low_s16(mn16)),
                                                      vget_high_s16(s32), vget_high_s16(mn16)));
            const float dx = xv->d[r];
            acc[m] = fmaf(d * dx, (float)vaddvq_s32(is), acc[m]);
            acc[m] = fmaf(-(dmin * dx), (float)msum, acc[m]);
        }
    }
    for (int m = 0; m < MR; m++)
        store_y(j, m0 + m, n, acc[m]);
}

/* Q6_K: W[v] = sub-block v's 16 codes minus 32 (-32..31), so no offset term; value
 * 128h + 32g + l is in W[8h + 2g + l / 16]. */
static inline __attribute__((always_inline))
void tile_q6k_neon(const pq_job_t *j, const xa_t *xv, int n, int m0, const int MR)
{
    const int K = j->K, nb = K / QK;
    const uint8_t *row = j->w + (size_t)n * j->row_bytes;
    const uint8x16_t m4 = vdupq_n_u8(15), m30 = vdupq_n_u8(0x30), o32 = vdupq_n_u8(32);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * Q6K_BYTES;
        if (PQK_PF_BYTES && m0 == 0)
            for (int o = 0; o < 256; o += 64)
                __builtin_prefetch(blk + PQK_PF_BYTES + o);
        const float d = vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(rd16(blk + 208)))), 0);
        const int16x8_t s16a = vmovl_s8(vld1_s8((const int8_t *)blk + 192));
        const int16x8_t s16b = vmovl_s8(vld1_s8((const int8_t *)blk + 200));
        const int32x4_t S[4] = {vmovl_s16(vget_low_s16(s16a)), vmovl_s16(vget_high_s16(s16a)),
                                vmovl_s16(vget_low_s16(s16b)), vmovl_s16(vget_high_s16(s16b))};
        int8x16_t W[16];
        for (int h = 0; h < 2; h++)
            for (int u = 0; u < 2; u++) {
                const uint8x16_t a = vld1q_u8(blk + 64 * h + 16 * u), c = vld1q_u8(blk + 64 * h + 32 + 16 * u);
                const uint8x16_t hb = vld1q_u8(blk + 128 + 32 * h + 16 * u);
                const uint8x16_t lo4[4] = {vandq_u8(a, m4), vandq_u8(c, m4), vshrq_n_u8(a, 4), vshrq_n_u8(c, 4)};
                const uint8x16_t hi2[4] = {vandq_u8(vshlq_n_u8(hb, 4), m30), vandq_u8(vshlq_n_u8(hb, 2), m30),
                                           vandq_u8(hb, m30), vandq_u8(vshrq_n_u8(hb, 2), m30)};
                for (int g = 0; g < 4; g++)
                    W[8 * h + 2 * g + u] = vreinterpretq_s8_u8(vsubq_u8(vorrq_u8(lo4[g], hi2[g]), o32));
            }
        for (int m = 0; m < MR; m++) {
            const size_t r = (size_t)(m0 + m) * nb + b;
            const int8_t *xq = xv->q + (size_t)(m0 + m) * K + (size_t)b * QK;
#define PQK_SB6(s) vdotq_s32(vdupq_n_s32(0), W[s], vld1q_s8(xq + 16 * (s)))
#define PQK_SB6X4(s) vpaddq_s32(vpaddq_s32(PQK_SB6(s), PQK_SB6((s) + 1)), vpaddq_s32(PQK_SB6((s) + 2), PQK_SB6((s) + 3)))
            int32x4_t is = vmulq_s32(PQK_SB6X4(0), S[0]);
            is = vmlaq_s32(is, PQK_SB6X4(4), S[1]);
            is = vmlaq_s32(is, PQK_SB6X4(8), S[2]);
            is = vmlaq_s32(is, PQK_SB6X4(12), S[3]);
#undef PQK_SB6X4
#undef PQK_SB6
            acc[m] = fmaf(d * xv->d[r], (float)vaddvq_s32(is), acc[m]);
        }
    }
    for (int m = 0; m < MR; m++)
        store_y(j, m0 + m, n, acc[m]);
}

PQK_ROWS(rows_q4k_neon, tile_q45k_neon, 0)
PQK_ROWS(rows_q5k_neon, tile_q45k_neon, 1)
PQK_ROWS(rows_q6k_neon, tile_q6k_neon)

#if PQK_NEON_PRAGMA
#pragma GCC pop_options
#endif
#endif /* PQK_NEON */

/* ------------------------------------------------------------------------- */
/* Dispatch                                                                   */
/* ------------------------------------------------------------------------- */

/* Does tier `isa` run the int8 kernels (and so need prep)? */
static inline int uses_int8(int isa)
{
#ifdef PQK_X86
    return isa >= ISA_AVX2;
#else  /* aarch64's portable tier with SDOT (pg_neon_dot: the CPU has it, not switched off) */
    return PQK_NEON && isa == ISA_PORTABLE && pg_neon_dot();
#endif
}

#ifdef PQK_X86
#define PQK_SIMD(f) f
#else
#define PQK_SIMD(f) NULL
#endif
#if PQK_NEON
#define PQK_SDOT(f) f
#else
#define PQK_SDOT(f) NULL
#endif

/* The family's own view of its formats (one designated-initializer row each, indexed by
 * wdt - DT_Q4_K): block bytes, the per-block dequantizer of each tier (NULL: the next lower
 * tier's), the int8 row kernels of the SIMD tiers, and whether the AVX-512 kernels read x in
 * the reordered Q4_K / Q5_K order. */
typedef void (*rows_fn)(const pq_job_t *, int, int);
typedef struct {
    int bb;
    deq_fn deq[ISA_COUNT];
    rows_fn int8_rows[ISA_COUNT];
    int reorder;
} qk_fmt_t;

static const qk_fmt_t g_qk[DT_Q6_K - DT_Q4_K + 1] = {
    [DT_Q4_K - DT_Q4_K] = {
        .bb = Q4K_BYTES, .reorder = 1,
        .deq = {deq_q4k_c, PQK_SIMD(deq_q4k_avx2), PQK_SIMD(deq_q4k_avx512)},
        .int8_rows = {PQK_SDOT(rows_q4k_neon), PQK_SIMD(rows_q4k_avx2), PQK_SIMD(rows_q4k_avx512), [ISA_AVX512_VNNI] = PQK_SIMD(rows_q4k_vnni)},
    },
    [DT_Q5_K - DT_Q4_K] = {
        .bb = Q5K_BYTES, .reorder = 1,
        .deq = {deq_q5k_c, PQK_SIMD(deq_q5k_avx2), PQK_SIMD(deq_q5k_avx512)},
        .int8_rows = {PQK_SDOT(rows_q5k_neon), PQK_SIMD(rows_q5k_avx2), PQK_SIMD(rows_q5k_avx512), [ISA_AVX512_VNNI] = PQK_SIMD(rows_q5k_vnni)},
    },
    [DT_Q6_K - DT_Q4_K] = {
        .bb = Q6K_BYTES, .reorder = 0,
        .deq = {deq_q6k_c, PQK_SIMD(deq_q6k_avx2), PQK_SIMD(deq_q6k_avx512)},
        .int8_rows = {PQK_SDOT(rows_q6k_neon), PQK_SIMD(rows_q6k_avx2), PQK_SIMD(rows_q6k_avx512), [ISA_AVX512_VNNI] = PQK_SIMD(rows_q6k_vnni)},
    },
};

static inline const qk_fmt_t *qk_of(int wdt)
{
    return (wdt >= DT_Q4_K && wdt <= DT_Q6_K) ? &g_qk[wdt - DT_Q4_K] : NULL;
}

static deq_fn deq_for(int wdt, int isa)
{
    const qk_fmt_t *q = qk_of(wdt);
    for (int t = isa < ISA_COUNT ? isa : ISA_COUNT - 1; t > 0; t--)
        if (q->deq[t])
            return q->deq[t];
    return q->deq[ISA_PORTABLE];
}

/* Does format wdt's kernel at tier isa read x in the Q4_K / Q5_K AVX-512 order? */
static inline int x_reordered(int wdt, int isa)
{
    return qk_of(wdt)->reorder && isa >= ISA_AVX512;
}

static void prep_k(const float *x, int M, int K, void *xa, int isa, int wdt)
{
#ifdef PQK_X86
    if (isa >= ISA_AVX512)
        prep_avx512(x, M, K, xa, x_reordered(wdt, isa));
    else if (isa >= ISA_AVX2)
        prep_avx2(x, M, K, xa);
#elif PQK_NEON
    /* whenever asked: the caller got xa's size from qk_xa_bytes, which said int8 then (SDOT
     * switched off since, the rows would read an unprepared buffer otherwise) */
    (void)isa; (void)wdt;
    prep_neon(x, M, K, xa);
#else
    (void)x; (void)M; (void)K; (void)xa; (void)isa; (void)wdt;
#endif
}

/* rows of format wdt: the int8 kernels when x was prepared (j->xa: qk_xa_bytes said int8 for
 * this call, so prep ran; not re-read here, where a setter flipped since would leave the buffer
 * and the rows disagreeing), else the fp32-dequantize path (the portable tier; at any tier the
 * accuracy baseline and the float side of the float-vs-int8 measurement, force_float). */
static void rows_k(const pq_job_t *j, int n0, int n1, int wdt, int force_float)
{
    const qk_fmt_t *q = qk_of(wdt);
    int t = j->isa < ISA_COUNT ? j->isa : ISA_COUNT - 1;
    while (t > 0 && !q->int8_rows[t])  /* a tier without its own: the next lower tier's */
        t--;
    if (!force_float && j->xa && q->int8_rows[t]) {
        q->int8_rows[t](j, n0, n1);
        return;
    }
    rows_float_c(j, n0, n1, deq_for(wdt, j->isa));
}

/* ---- the table's entry points (cpu_formats.c; cpu_qgemv_k.h) ---------------------------- */

/* The table's xa_bytes: 0 where the activations stay fp32 (the portable tier, or mode 1), so
 * that the caller skips prep, the rows see xa == NULL, and act_block reports fp32. */
size_t qk_xa_bytes(int M, int K)
{
    return (g_mode != 1 && uses_int8(pg_isa())) ? xa_size(M, K) : 0;
}

/* 0 when the activations stay fp32 at tier isa, else 256: a bound, the int8 blocks are at most
 * a super-block. */
int qk_act_block(int isa)
{
    (void)isa;  /* the tier in use: qk_xa_bytes reads pg_isa() */
    return qk_xa_bytes(1, QK) > 0 ? 256 : 0;
}

#define QK_INSTANCE(name, code)                                                           \
    void qk_prep_##name(const float *x, int M, int K, void *xa, int isa, int cl) { (void)cl; prep_k(x, M, K, xa, isa, code); } \
    void qk_rows_float_##name(const pq_job_t *j, int n0, int n1) { rows_k(j, n0, n1, code, 1); } \
    void qk_rows_simd_##name(const pq_job_t *j, int n0, int n1) { rows_k(j, n0, n1, code, 0); } \
    void qk_dequant_ref_##name(const uint8_t *blk, int nblk, float *out)                 \
    {                                                                                    \
        const deq_fn deq = g_qk[(code) - DT_Q4_K].deq[ISA_PORTABLE];                     \
        for (int b = 0; b < nblk; b++)                                                   \
            deq(blk + (size_t)b * g_qk[(code) - DT_Q4_K].bb, out + (size_t)b * QK);      \
    }                                                                                    \
    void qk_dequant_simd_##name(const uint8_t *blk, int nblk, float *out)                \
    {                                                                                    \
        const deq_fn deq = deq_for(code, pg_isa());                                      \
        for (int b = 0; b < nblk; b++)                                                   \
            deq(blk + (size_t)b * g_qk[(code) - DT_Q4_K].bb, out + (size_t)b * QK);      \
    }

QK_FORMATS(QK_INSTANCE)

/* ------------------------------------------------------------------------- */
/* Row dequantizer for the prefill path                                       */
/* ------------------------------------------------------------------------- */

typedef struct {
    deq_fn deq;
    const uint8_t *w;     /* row n0 */
    size_t row_bytes;
    int nb, bb, K;
    float *out;           /* row n0 */
} deq_job_t;

static void deq_task(const void *ctx, int i0, int i1)
{
    const deq_job_t *d = (const deq_job_t *)ctx;
    for (int i = i0; i < i1; i++)
        for (int b = 0; b < d->nb; b++)
            d->deq(d->w + (size_t)i * d->row_bytes + (size_t)b * d->bb,
                   d->out + (size_t)i * d->K + (size_t)b * QK);
}

/* out[(n - n0) * K + k] = W[n, k] in fp32 for n0 <= n < n1: the weight rows [n0, n1) of a
 * [N, K] K-quant matrix w (row n at w + n * (K / 256) * block_bytes), split over the pool.
 * 0 on success, -1 for bad arguments (K not a multiple of 256, n1 < n0, unknown wdt). */
int pqk_dequantize_rows(int wdt, const uint8_t *w, int K, int n0, int n1, float *out)
{
    const qk_fmt_t *q = qk_of(wdt);
    if (!q || K <= 0 || K % QK || n0 < 0 || n1 < n0)
        return -1;
    deq_job_t d;
    d.deq = deq_for(wdt, pg_isa());
    d.nb = K / QK;
    d.bb = q->bb;
    d.K = K;
    d.row_bytes = (size_t)d.nb * q->bb;
    d.w = w + (size_t)n0 * d.row_bytes;
    d.out = out;
    /* >= 64 KB of fp32 output per chunk: the pool hand-off (~1 us) stays small. */
    const int per = (int)((65536 + (size_t)K * 4 - 1) / ((size_t)K * 4));
    pg_parallel_for(deq_task, &d, n1 - n0, per);
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Entry points for tests and measurements (ctypes)                           */
/* ------------------------------------------------------------------------- */

typedef struct {
    const pq_job_t *j;
    int wdt, force_float;
} entry_ctx_t;

static void entry_task(const void *ctx, int n0, int n1)
{
    const entry_ctx_t *c = (const entry_ctx_t *)ctx;
    rows_k(c->j, n0, n1, c->wdt, c->force_float);
}

/* y[M, N] (ydt) = x[M, K] @ W^T (+ bias) at the current tier (pg_isa()), through this file
 * alone: prep, then rows over [0, N).  flags: bit 0 = the fp32-dequantize path, bit 1 = split
 * the rows over the pool (else the calling thread).  0 on success, -1 bad arguments, -2 no
 * memory. */
int pqk_linear_entry(int wdt, const uint8_t *w, const float *bias, int N, int K,
                     const float *x, int M, void *y, int ydt, int flags)
{
    const qk_fmt_t *fmt = qk_of(wdt);
    if (!fmt || N < 1 || K < QK || K % QK || M < 1 || M > PG_MAX_M || (ydt != DT_F32 && ydt != DT_BF16))
        return -1;
    pq_job_t j;
    j.w = w;
    j.rp = NULL;
    j.cl = NULL;
    j.row_bytes = (size_t)(K / QK) * fmt->bb;
    j.bias = bias;
    j.x = x;
    j.y = y;
    j.ydt = ydt;
    j.M = M;
    j.N = N;
    j.K = K;
    j.isa = pg_isa();
    const int force_float = flags & 1;
    void *xa = NULL;
    if (!force_float && uses_int8(j.isa)) {
        xa = malloc(xa_size(M, K));
        if (!xa)
            return -2;
        prep_k(x, M, K, xa, j.isa, wdt);
    }
    j.xa = xa;
    entry_ctx_t c = {&j, wdt, force_float};
    if (flags & 2)
        pg_parallel_for(entry_task, &c, N, 16);
    else
        entry_task(&c, 0, N);
    free(xa);
    return 0;
}

/* Format wdt's activation quantization at the current tier, in canonical order: q [M, K]
 * int8, d [M, K/256], bs [M, K/16].  -1 where the tier runs fp32 activations (portable) or for
 * bad arguments. */
int pqk_prep_entry(int wdt, const float *x, int M, int K, int8_t *q, float *d, int16_t *bs)
{
    const int isa = pg_isa();
    if (!qk_of(wdt) || !uses_int8(isa) || M < 1 || K < QK || K % QK)
        return -1;
    void *xa = malloc(xa_size(M, K));
    if (!xa)
        return -2;
    prep_k(x, M, K, xa, isa, wdt);
    const xa_t v = xa_view(xa, M, K);
    const size_t rows = (size_t)M * (K / QK);
    for (size_t i = 0; i < (size_t)M * K; i += 32) {  /* undo x_reordered */
        const size_t p = i & 127, sub = p >> 5;
        const size_t src = x_reordered(wdt, isa) ? (i & ~(size_t)127) + 32 * (((sub & 1) << 1) | (sub >> 1)) : i;
        memcpy(q + i, v.q + src, 32);
    }
    memcpy(d, v.d, rows * sizeof(float));
    memcpy(bs, v.bs, rows * 16 * sizeof(int16_t));
    free(xa);
    return 0;
}

/* 1 when tier `isa` multiplies int8-quantized activations (see the file header). */
int pqk_int8_activations(int isa)
{
    return uses_int8(isa);
}

/* The K-quant path mode (see g_mode); returns the previous one.  Out-of-range -> 0. */
int pqk_set_mode(int mode)
{
    return atomic_exchange(&g_mode, (mode == 1) ? 1 : 0);
}
