/*
 * cpu_gemv.c -- bandwidth-bound small-M linear (y = x @ W^T + b) for CPU decode.
 *
 * Role: batch-1 decode (M = 1) and speculative verification (M <= PG_MAX_M) on CPU are
 * streams of matrix-vector products whose speed is set by how fast the weights
 * stream out of DRAM.  torch's F.linear at M = 1 runs on one core at about a third
 * of DRAM bandwidth; this file streams each weight matrix exactly once per call,
 * split over a small persistent thread pool, and reuses every weight chunk for all
 * M input rows while it sits in registers.
 *
 * Plain C (no torch headers) so it compiles in about a second at first use; the
 * Python side (cpu_linear.py) compiles it with gcc, caches the .so and calls it
 * through ctypes with tensor data pointers.
 *
 * Layout: W is row-major [N, K] (the ordinary torch layout), fp32 or bf16.  Keeping
 * the torch layout means the M > PG_MAX_M fallback (a real GEMM in torch) can use the very
 * same tensor, so a packed model holds one copy of its weights, not two.  Row-major
 * costs a horizontal reduction per (row, input) pair, which is cheap next to the K/32
 * dot-product steps it ends.
 *
 * ISA tiers (cpu_runtime.h): AVX-512 (+BF16) and AVX2 + FMA kernels, each compiled in its
 * own `#pragma GCC target` region and chosen at run time (pg_isa(), cpu_runtime.c), so the
 * same source builds and runs without -march=native and on CPUs without AVX-512 or AVX2.  The
 * portable tier is plain C that gcc vectorises, or NEON intrinsics on aarch64.
 *
 * Threads: the row chunks of one call run on the shared pool of cpu_runtime.c
 * (pg_parallel_for); matrices under pg_set_solo_bytes run on the caller alone.
 *
 * Layering: this file uses cpu_runtime.c only; the weight-descriptor dispatcher (pg_linear_w,
 * cpu_dispatch.c) calls pg_linear here for the float dtypes.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "cpu_bf16.h"
#include "cpu_gemv.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PG_X86 1
/* Pin a loaded vector in a register: without it gcc re-reads the weight chunk from
 * memory for every FMA that uses it (a load per FMA), and the tiles become load-bound. */
#define PG_KEEP(v) __asm__("" : "+v"(v))
#endif

/* Software prefetch distance into the weight stream.  Measured on the 2-core Zen target
 * streaming 3072x576 matrices from DRAM: none 35 / 4 KB 45 / 8 KB 45 GB/s for bf16, and
 * 47 / 44 / 51 for fp32 (the hardware prefetchers stop at 4 KB pages; this does not). */
#ifndef PG_PF_BYTES
#define PG_PF_BYTES 8192
#endif
/* Below this many weight bytes the caller runs alone: waking a worker and handing out
 * chunks costs ~1 us, about what 48 KB takes to stream on one core. */
static int g_solo_bytes = 48 * 1024;
/* A bf16 weight with a row-pair copy reads the copy (pg_linear_pairs) for g_pairs_min_m to
 * PG_PAIRS_MAX_M inputs.  SmolLM2's bf16 verify forwards at 256 cached tokens (2026-12-07, Zen 4,
 * both alternated in one process, ms): M = 4 14.4 as stored / 14.5 from the copy, 5 18.6 / 15.7,
 * 6 18.2 / 15.3, 7 22.5 / 15.6, 8 23.0 / 16.0, 12 26.1 / 20.9, 16 33.4 / 28.4, 20 36.1 / 33.3,
 * 24 34.4 / 37.3, 64 77.6 / 85.7: from 24 inputs the 4 x 4 tiles' fewer loads a multiply-add
 * win back more than the one stream gives. */
#define PG_PAIRS_MIN_M 5
#define PG_PAIRS_MAX_M 20
static int g_pairs_min_m = PG_PAIRS_MIN_M;  /* pg_set_pairs_min_m */


/* ------------------------------------------------------------------------- */
/* Job description                                                            */
/* ------------------------------------------------------------------------- */

typedef struct {
    const void *w;      /* [N, K] row-major, wdt */
    int wdt;
    const float *bias;  /* [N] fp32 or NULL */
    const void *xk;     /* [M, K] activations in the kernel's dtype (bf16 for bf16 W
                           on the BF16 ISA, else fp32) */
    void *y;            /* [M, N] row-major, ydt */
    int ydt;
    int M, N, K;
    int isa;
    int fma;            /* tier avx512_bf16's bf16 products as FMAs (pg_bf16_fma): xk is then
                           the bf16 x widened, each 32-block as 16 even then 16 odd elements */
    const uint16_t *wi; /* NULL, or a bf16 w's row-pair copy (pg_linear_pairs) */
} job_t;

/* y[m, n] = v (+ bias[n]), converted to y's dtype. */
static inline void store1(const job_t *j, int m, int n, float v)
{
    if (j->bias)
        v += j->bias[n];
    size_t off = (size_t)m * j->N + n;
    if (j->ydt == DT_F32)
        ((float *)j->y)[off] = v;
    else
        ((uint16_t *)j->y)[off] = f32_to_bf16(v);
}

#if defined(__aarch64__)
/* ------------------------------------------------------------------------- */
/* Portable tier on aarch64: NEON (in every aarch64 CPU).  32 q registers of  */
/* 4 floats: a tile is NR = 4 weight rows x MR <= 4 inputs, 8 columns (two q  */
/* vectors per row) per step, each weight vector loaded once and used for MR  */
/* inputs.  MR <= 2 keeps separate accumulators for the two halves of a step  */
/* (more FMA chains in flight); at MR = 4 the 16 accumulators suffice.  bf16  */
/* weights widen exactly by a 16-bit shift (vshll).  Columns past the last    */
/* multiple of 8 are summed in scalar code into the reduced totals.           */
/* ------------------------------------------------------------------------- */
#include <arm_neon.h>

#define PG_NEON_PF(ptr) __builtin_prefetch((const char *)(ptr) + PG_PF_BYTES)

static inline __attribute__((always_inline))
void tile_neon(const job_t *j, const void *wp, const float *x, int n, int m0,
               const int MR, const int NR, const int BF16)
{
    const int K = j->K;
    const float *w32 = (const float *)wp;
    const uint16_t *w16 = (const uint16_t *)wp;
    const int H = MR <= 2 ? MR : 0;      /* accumulator offset of the second half */
    float32x4_t acc[4][4];
    for (int m = 0; m < MR + H; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = vdupq_n_f32(0.f);
    /* One prefetch per 64-byte line of each row: every 2nd (fp32) or 4th (bf16) step. */
    const int line_mask = BF16 ? 31 : 15;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        float32x4_t wl[4], wh[4];
        if ((k & line_mask) == 0)
            for (int r = 0; r < NR; r++)
                PG_NEON_PF(BF16 ? (const void *)(w16 + (size_t)r * K + k)
                                : (const void *)(w32 + (size_t)r * K + k));
        for (int r = 0; r < NR; r++) {
            if (BF16) {
                const uint16x8_t h = vld1q_u16(w16 + (size_t)r * K + k);
                wl[r] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
                wh[r] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
            } else {
                wl[r] = vld1q_f32(w32 + (size_t)r * K + k);
                wh[r] = vld1q_f32(w32 + (size_t)r * K + k + 4);
            }
        }
        for (int m = 0; m < MR; m++) {
            const float32x4_t xl = vld1q_f32(x + (size_t)m * K + k);
            const float32x4_t xh = vld1q_f32(x + (size_t)m * K + k + 4);
            for (int r = 0; r < NR; r++) {
                acc[m][r] = vfmaq_f32(acc[m][r], wl[r], xl);
                acc[m + H][r] = vfmaq_f32(acc[m + H][r], wh[r], xh);
            }
        }
    }
    for (int m = 0; m < MR; m++) {
        float s[4];
        if (H)
            for (int r = 0; r < NR; r++)
                acc[m][r] = vaddq_f32(acc[m][r], acc[m + H][r]);
        if (NR == 4) {
            const float32x4_t t = vpaddq_f32(vpaddq_f32(acc[m][0], acc[m][1]),
                                             vpaddq_f32(acc[m][2], acc[m][3]));
            vst1q_f32(s, t);
        } else {
            for (int r = 0; r < NR; r++)
                s[r] = vaddvq_f32(acc[m][r]);
        }
        for (int r = 0; r < NR; r++) {
            for (int kk = k; kk < K; kk++) {
                const float wv = BF16 ? bf16_to_f32(w16[(size_t)r * K + kk]) : w32[(size_t)r * K + kk];
                s[r] += wv * x[(size_t)m * K + kk];
            }
            store1(j, m0 + m, n + r, s[r]);
        }
    }
}

#define PG_NEON_MR(MR, NR, BF16, ...)                                                    \
    switch (MR) {                                                                        \
    case 1: tile_neon(__VA_ARGS__, 1, NR, BF16); break;                                  \
    case 2: tile_neon(__VA_ARGS__, 2, NR, BF16); break;                                  \
    case 3: tile_neon(__VA_ARGS__, 3, NR, BF16); break;                                  \
    default: tile_neon(__VA_ARGS__, 4, NR, BF16); break;                                 \
    }

/* Rows [n0, n1) x all M: 4-row tiles, inputs in blocks of 4 (the later blocks re-read the
 * tile from L1; DRAM sees each weight byte once), then the leftover rows one at a time. */
static inline __attribute__((always_inline)) void rows_neon(const job_t *j, int n0, int n1, const int BF16)
{
    const int K = j->K, M = j->M;
    const size_t es = BF16 ? 2 : 4;
    const char *W = (const char *)j->w;
    const float *X = (const float *)j->xk;
    int n = n0;
    for (; n + 4 <= n1; n += 4)
        for (int m0 = 0; m0 < M; m0 += 4)
            PG_NEON_MR(M - m0, 4, BF16, j, W + (size_t)n * K * es, X + (size_t)m0 * K, n, m0)
    for (; n < n1; n++)
        for (int m0 = 0; m0 < M; m0 += 4)
            PG_NEON_MR(M - m0, 1, BF16, j, W + (size_t)n * K * es, X + (size_t)m0 * K, n, m0)
}

static void rows_portable(const job_t *j, int n0, int n1)
{
    if (j->wdt == DT_F32)
        rows_neon(j, n0, n1, 0);
    else
        rows_neon(j, n0, n1, 1);
}

#else /* !__aarch64__ */

/* ------------------------------------------------------------------------- */
/* Portable path (x86 without AVX2, other non-arm64 CPUs).  16 independent  */
/* lane sums per dot product: gcc vectorises that without -ffast-math (a    */
/* single scalar sum is an order-dependent reduction it must keep serial).  */
/* ------------------------------------------------------------------------- */

#define PG_LANES 16

static float dot_f32(const float *w, const float *x, int K)
{
    float acc[PG_LANES] = {0};
    int k = 0;
    for (; k + PG_LANES <= K; k += PG_LANES)
        for (int i = 0; i < PG_LANES; i++)
            acc[i] += w[k + i] * x[k + i];
    float s = 0.f;
    for (; k < K; k++)
        s += w[k] * x[k];
    for (int i = 0; i < PG_LANES; i++)
        s += acc[i];
    return s;
}

static float dot_bf16w(const uint16_t *w, const float *x, int K)
{
    float acc[PG_LANES] = {0};
    int k = 0;
    for (; k + PG_LANES <= K; k += PG_LANES)
        for (int i = 0; i < PG_LANES; i++)
            acc[i] += bf16_to_f32(w[k + i]) * x[k + i];
    float s = 0.f;
    for (; k < K; k++)
        s += bf16_to_f32(w[k]) * x[k];
    for (int i = 0; i < PG_LANES; i++)
        s += acc[i];
    return s;
}

static void rows_portable(const job_t *j, int n0, int n1)
{
    const int K = j->K, M = j->M;
    const float *x = (const float *)j->xk;
    for (int n = n0; n < n1; n++) {
        for (int m = 0; m < M; m++) {
            const float *xr = x + (size_t)m * K;
            float v = j->wdt == DT_F32 ? dot_f32((const float *)j->w + (size_t)n * K, xr, K)
                                       : dot_bf16w((const uint16_t *)j->w + (size_t)n * K, xr, K);
            store1(j, m, n, v);
        }
    }
}
#endif /* __aarch64__ */

#ifdef PG_X86
/* ------------------------------------------------------------------------- */
/* Epilogue stores shared by the AVX2 and AVX-512 tiles: 128-bit SSE4.1 only, */
/* so that they inline into both (gcc inlines only into callers whose ISA     */
/* is a superset of the callee's).                                            */
/* ------------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC target("sse4.1")

/* y[m, n..n+3] = s (+ bias[n..n+3]). */
static inline __attribute__((always_inline)) void store_row4(const job_t *j, int m, int n, __m128 s)
{
    if (j->bias)
        s = _mm_add_ps(s, _mm_loadu_ps(j->bias + n));
    size_t off = (size_t)m * j->N + n;
    if (j->ydt == DT_F32)
        _mm_storeu_ps((float *)j->y + off, s);
    else
        _mm_storel_epi64((__m128i *)((uint16_t *)j->y + off), bf16x4_rne(s));
}

/* y[m0 + i, n] = s[i] (+ bias[n]) for i < mr: one weight row, up to four inputs. */
static inline __attribute__((always_inline)) void store_col4(const job_t *j, int m0, int mr, int n, __m128 s)
{
    float v[4];
    if (j->bias)
        s = _mm_add_ps(s, _mm_set1_ps(j->bias[n]));
    _mm_storeu_ps(v, s);
    for (int i = 0; i < mr; i++) {
        size_t off = (size_t)(m0 + i) * j->N + n;
        if (j->ydt == DT_F32)
            ((float *)j->y)[off] = v[i];
        else
            ((uint16_t *)j->y)[off] = f32_to_bf16(v[i]);
    }
}

/* y[m, n..n+1] = s[0..1] and y[m + 1, n..n+1] = s[2..3] (second row only if m2). */
static inline __attribute__((always_inline)) void store_2x2(const job_t *j, int m, int n, __m128 s, int m2)
{
    if (j->bias) {
        __m128 b = _mm_castpd_ps(_mm_load1_pd((const double *)(j->bias + n)));
        s = _mm_add_ps(s, b);
    }
    size_t off = (size_t)m * j->N + n;
    if (j->ydt == DT_F32) {
        _mm_storel_pi((__m64 *)((float *)j->y + off), s);
        if (m2)
            _mm_storeh_pi((__m64 *)((float *)j->y + off + j->N), s);
    } else {
        __m128i h = bf16x4_rne(s);
        uint32_t lo = (uint32_t)_mm_cvtsi128_si32(h), hi = (uint32_t)_mm_extract_epi32(h, 1);
        memcpy((uint16_t *)j->y + off, &lo, 4);
        if (m2)
            memcpy((uint16_t *)j->y + off + j->N, &hi, 4);
    }
}

#pragma GCC pop_options

/* ------------------------------------------------------------------------- */
/* AVX-512 kernels                                                            */
/*                                                                            */
/* Tile: NR weight rows x MR input rows, MR * NR <= 16 zmm accumulators (see */
/* PG_ROWS_DRIVER for the shapes).  Each 64-byte weight chunk is loaded once  */
/* and used MR times; the x chunks come from L1/L2 (x is at most 64 x K). Four */
/* rows give four independent accumulator chains at M = 1.  The epilogue     */
/* reduces four accumulators at a time into one __m128 (for NR = 4 that is    */
/* y[m, n..n+3], four contiguous outputs stored in one go).                   */
/* ------------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,sse4.1")

/* Reduce four 16-lane vectors to their four horizontal sums (one __m128). */
static inline __attribute__((always_inline)) __m256 fold256(__m512 a)
{
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

static inline __attribute__((always_inline)) __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d)
{
    __m256 ab = _mm256_hadd_ps(fold256(a), fold256(b)); /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    __m256 cd = _mm256_hadd_ps(fold256(c), fold256(d));
    __m256 abcd = _mm256_hadd_ps(ab, cd);               /* a0-3 b0-3 c0-3 d0-3 | a4-7 ...   */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* Epilogue: reduce acc[m][r] (sums for y[m0 + m, n + r]) four at a time and store.
 * NR == 4: one contiguous y[m, n..n+3] per input row; NR == 2: 2x2 blocks; NR == 1:
 * four inputs of one row. */
static inline __attribute__((always_inline))
void emit_tile(const job_t *j, __m512 acc[8][4], int n, int m0, const int MR, const int NR)
{
    const __m512 z = _mm512_setzero_ps();
    if (NR == 4) {
        for (int m = 0; m < MR; m++)
            store_row4(j, m0 + m, n, hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    } else if (NR == 2) {
        for (int m = 0; m < MR; m += 2) {
            const int two = m + 1 < MR;
            store_2x2(j, m0 + m, n, hsum4(acc[m][0], acc[m][1], two ? acc[m + 1][0] : z,
                                          two ? acc[m + 1][1] : z), two);
        }
    } else {
        for (int m = 0; m < MR; m += 4)
            store_col4(j, m0 + m, MR - m < 4 ? MR - m : 4, n,
                       hsum4(acc[m][0], m + 1 < MR ? acc[m + 1][0] : z,
                             m + 2 < MR ? acc[m + 2][0] : z, m + 3 < MR ? acc[m + 3][0] : z));
    }
}

/* Software prefetch PG_PF_BYTES ahead in the weight stream.  A tile's NR rows are
 * contiguous, so "row r, column k, plus PF bytes" walks the next tiles' lines once each.
 * With B = ceil(M/4) input blocks over the same tile, block b prefetches on the steps
 * s = b (mod B): every line is still prefetched once, and the prefetches are spread over
 * the whole time spent on the tile (all in the first block would leave DRAM idle for the
 * rest).  `pf` is the counter: prefetch when it hits 0, then reload it with B. */
#define PG_PF_STEP(pf, B, ...)                                                          \
    do {                                                                                \
        if (PG_PF_BYTES && (B) > 0 && (pf)-- == 0) {                                    \
            __VA_ARGS__;                                                                \
            (pf) = (B) - 1;                                                             \
        }                                                                               \
    } while (0)
#define PG_PREFETCH(ptr) _mm_prefetch((const char *)(ptr) + PG_PF_BYTES, _MM_HINT_T0)

/* fp32 weights, fp32 x: 16 floats (one cache line) per step. */
static inline __attribute__((always_inline))
void tile_f32(const job_t *j, const float *w, const float *x, int n, int m0,
              const int MR, const int NR, int pf, int pfB)
{
    const int K = j->K;
    __m512 acc[8][4];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[4];
        PG_PF_STEP(pf, pfB, for (int r = 0; r < NR; r++) PG_PREFETCH(w + (size_t)r * K + k));
        for (int r = 0; r < NR; r++) {
            wv[r] = _mm512_loadu_ps(w + (size_t)r * K + k);
            PG_KEEP(wv[r]);
        }
        for (int m = 0; m < MR; m++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)m * K + k);
            if (NR > 1) PG_KEEP(xv);
            for (int r = 0; r < NR; r++)
                acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    if (k < K) {
        __mmask16 mk = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[4];
        for (int r = 0; r < NR; r++)
            wv[r] = _mm512_maskz_loadu_ps(mk, w + (size_t)r * K + k);
        for (int m = 0; m < MR; m++) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x + (size_t)m * K + k);
            for (int r = 0; r < NR; r++)
                acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    emit_tile(j, acc, n, m0, MR, NR);
}

/* bf16 weights, fp32 x, no AVX512_BF16: widen bf16 -> fp32 by a 16-bit shift.  An all-ones
 * mask is a plain load. */
static inline __attribute__((always_inline)) __m512 bf16x16_to_f32(const uint16_t *p, __mmask16 mk)
{
    __m256i h = mk == (__mmask16)0xffff ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(mk, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline))
void tile_bf16w(const job_t *j, const uint16_t *w, const float *x, int n, int m0,
                const int MR, const int NR, int pf, int pfB)
{
    const int K = j->K;
    __m512 acc[8][4];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = _mm512_setzero_ps();
    /* Full 16-wide steps with plain loads, then one masked step: masked loads in the main loop
     * cost Emerald Rapids a third of the tile's speed (M = 8 on one core 164 -> 118 us a
     * 1536 x 576 matrix; M = 1 46 -> 34 us, L2-resident).  The same lanes, the same order. */
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[4];
        if (k & 16)  /* one prefetch per 64-byte line: every other 32-byte step */
            PG_PF_STEP(pf, pfB, for (int r = 0; r < NR; r++) PG_PREFETCH(w + (size_t)r * K + k));
        for (int r = 0; r < NR; r++) {
            wv[r] = bf16x16_to_f32(w + (size_t)r * K + k, (__mmask16)0xffff);
            PG_KEEP(wv[r]);
        }
        for (int m = 0; m < MR; m++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)m * K + k);
            if (NR > 1) PG_KEEP(xv);
            for (int r = 0; r < NR; r++)
                acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    if (k < K) {
        const __mmask16 mk = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[4];
        for (int r = 0; r < NR; r++)
            wv[r] = bf16x16_to_f32(w + (size_t)r * K + k, mk);
        for (int m = 0; m < MR; m++) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x + (size_t)m * K + k);
            for (int r = 0; r < NR; r++)
                acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    emit_tile(j, acc, n, m0, MR, NR);
}

/* One weight row x all M inputs in one pass (M accumulators, each weight chunk used M times)
 * up to this M where pg_one_stream(): Zen 4 reads one stream per thread from DRAM much faster
 * than a tile's 4 interleaved rows.  SmolLM2's 211 GEMVs (270 MB bf16, 2 threads, the two
 * drivers alternated, median ms): bf16 x bf16 (vdpbf16ps) M = 3 13.8 -> 9.4, M = 4 15.0 ->
 * 10.0, M = 5 15.7 -> 12.1, M = 6 16.5 -> 13.6, M = 7 16.6 -> 15.4, M = 8 17.0 -> 17.1; fp32
 * M = 3 23.0 -> 16.0, M = 6 27.2 -> 22.6, M = 8 27.9 -> 33.7 (bf16 at M = 1: 10.2).  Past 6
 * a row's one x load per multiply-add makes it load-bound (L2-resident M = 8: 7.4 ms as tiles,
 * 11.0 as rows), and the tiles' software prefetch pays (it did not for the rows at M <= 6). */
#define PG_ONE_ROW_MAX_M 6

/* Run the tile kernel `TILE` over rows [n0, n1) for all M.  Each weight chunk is loaded
 * once per tile and used for MR input rows while in a register, with at most 16 accumulators
 * (MR x NR): where pg_one_stream() one weight row x M for M <= PG_ONE_ROW_MAX_M (above);
 * otherwise 4 weight rows x M for M <= 4; with PAIRS, 2 rows x M in one pass for M <= 8;
 * otherwise 4 rows with the inputs in blocks of 4, the later blocks re-reading the tile from
 * L1 (DRAM still sees each weight byte once).  Measured from DRAM on 1 thread: pairs take
 * fp32 M = 8 from 17 to 28 GB/s; vdpbf16ps does better with blocks; pairs in blocks of 8
 * for M > 8 and one-row tiles x 16 inputs were both slower than blocks of 4. */

#define PG_ROWS_DRIVER(NAME, TILE, WT, XT, PAIRS)                                        \
    static void NAME(const job_t *j, int n0, int n1)                                     \
    {                                                                                    \
        const int K = j->K, M = j->M;                                                    \
        const WT *W = (const WT *)j->w;                                                  \
        const XT *X = (const XT *)j->xk;                                                 \
        int n = n0;                                                                      \
        if (M <= PG_ONE_ROW_MAX_M && pg_one_stream()) {                                  \
            /* One weight row at a time: one stream (pg_one_stream; the rows' bits are  \
             * the same as in the 4-row tiles below, each output one chain). */          \
            for (; n < n1; n++) {                                                        \
                const WT *w = W + (size_t)n * K;                                         \
                switch (M) {                                                             \
                case 1: TILE(j, w, X, n, 0, 1, 1, 0, 0); break;                          \
                case 2: TILE(j, w, X, n, 0, 2, 1, 0, 0); break;                          \
                case 3: TILE(j, w, X, n, 0, 3, 1, 0, 0); break;                          \
                case 4: TILE(j, w, X, n, 0, 4, 1, 0, 0); break;                          \
                case 5: TILE(j, w, X, n, 0, 5, 1, 0, 0); break;                          \
                default: TILE(j, w, X, n, 0, 6, 1, 0, 0); break;                         \
                }                                                                        \
            }                                                                            \
        } else if (!(PAIRS) || M <= 4 || M > 8) {                                        \
            const int B = (M + 3) / 4; /* input blocks per tile: prefetch spread */      \
            for (; n + 4 <= n1; n += 4) {                                                \
                const WT *w = W + (size_t)n * K;                                         \
                for (int m0 = 0; m0 < M; m0 += 4) {                                      \
                    const XT *x = X + (size_t)m0 * K;                                    \
                    const int pf = m0 / 4;                                               \
                    switch (M - m0) {                                                    \
                    case 1: TILE(j, w, x, n, m0, 1, 4, pf, B); break;                    \
                    case 2: TILE(j, w, x, n, m0, 2, 4, pf, B); break;                    \
                    case 3: TILE(j, w, x, n, m0, 3, 4, pf, B); break;                    \
                    default: TILE(j, w, x, n, m0, 4, 4, pf, B); break;                   \
                    }                                                                    \
                }                                                                        \
            }                                                                            \
        } else {                                                                         \
            for (; n + 2 <= n1; n += 2) {                                                \
                const WT *w = W + (size_t)n * K;                                         \
                switch (M) {                                                             \
                case 5: TILE(j, w, X, n, 0, 5, 2, 0, 1); break;                          \
                case 6: TILE(j, w, X, n, 0, 6, 2, 0, 1); break;                          \
                case 7: TILE(j, w, X, n, 0, 7, 2, 0, 1); break;                          \
                default: TILE(j, w, X, n, 0, 8, 2, 0, 1); break;                         \
                }                                                                        \
            }                                                                            \
        }                                                                                \
        /* Rows left over by the wider tiles: one weight row, inputs in blocks of 4. */  \
        for (; n < n1; n++) {                                                            \
            const WT *w = W + (size_t)n * K;                                             \
            for (int m0 = 0; m0 < M; m0 += 4) {                                          \
                const XT *x = X + (size_t)m0 * K;                                        \
                switch (M - m0) {                                                        \
                case 1: TILE(j, w, x, n, m0, 1, 1, 0, 0); break;                         \
                case 2: TILE(j, w, x, n, m0, 2, 1, 0, 0); break;                         \
                case 3: TILE(j, w, x, n, m0, 3, 1, 0, 0); break;                         \
                default: TILE(j, w, x, n, m0, 4, 1, 0, 0); break;                        \
                }                                                                        \
            }                                                                            \
        }                                                                                \
    }

PG_ROWS_DRIVER(rows_avx512_f32, tile_f32, float, float, 1)
PG_ROWS_DRIVER(rows_avx512_bf16w, tile_bf16w, uint16_t, float, 1)

#pragma GCC pop_options

/* AVX512_BF16: bf16 weights x bf16 activations, vdpbf16ps (2 products per fp32 lane,
 * fp32 accumulation).  32 bf16 = one 64-byte cache line of weights per instruction. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2,sse4.1")

static inline __attribute__((always_inline))
void tile_bf16(const job_t *j, const uint16_t *w, const uint16_t *x, int n, int m0,
               const int MR, const int NR, int pf, int pfB)
{
    const int K = j->K;
    __m512 acc[8][4];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[4];
        PG_PF_STEP(pf, pfB, for (int r = 0; r < NR; r++) PG_PREFETCH(w + (size_t)r * K + k));
        for (int r = 0; r < NR; r++) {
            wv[r] = (__m512bh)_mm512_loadu_si512((const void *)(w + (size_t)r * K + k));
            PG_KEEP(wv[r]);
        }
        for (int m = 0; m < MR; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (size_t)m * K + k));
            if (NR > 1) PG_KEEP(xv);
            for (int r = 0; r < NR; r++)
                acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
    }
    if (k < K) {
        /* Masked tail: the zeroed lanes contribute 0 * 0 to the last fp32 lanes. */
        __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1ull);
        __m512bh wv[4];
        for (int r = 0; r < NR; r++)
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mk, (const void *)(w + (size_t)r * K + k));
        for (int m = 0; m < MR; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, (const void *)(x + (size_t)m * K + k));
            for (int r = 0; r < NR; r++)
                acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
    }
    emit_tile(j, acc, n, m0, MR, NR);
}

PG_ROWS_DRIVER(rows_avx512_bf16, tile_bf16, uint16_t, uint16_t, 0)

/* Row pairs (pg_linear_pairs): a bf16 w's copy in which each 32-element block of rows 2p and
 * 2p + 1 sits next to the other, [N / 2][K / 32][2][32], so a 2-row tile reads one stream.  Rows
 * as stored, the 4-row tiles read four streams 1-3 KB apart, and at 7-8 inputs Zen 4 ran them
 * at about the multiply-adds' time plus the read's, one after the other; one stream overlaps
 * them.  SmolLM2's 211 bf16 matrices from DRAM, 2 threads (session microbenchmark, 2026-12-07):
 * M = 8 17.3-19.7 ms as 4 x 4 tiles, 12.8-14.6 as row pairs x 8 inputs, against an M = 1 pass's
 * 9.8-11.0 (the M range that reads them: PG_PAIRS_MIN_M, at the top).  Each output is the same
 * one chain as in tile_bf16 (the blocks in order, one accumulator, the same reduction in
 * emit_tile): the bits of every other path.  K % 32 == 0. */
static inline __attribute__((always_inline))
void tile_bf16_pairs(const job_t *j, const uint16_t *c, const uint16_t *x, int n, int m0, const int MR, int pf)
{
    const int K = j->K;
    __m512 acc[8][4];
    for (int m = 0; m < MR; m++)
        acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        const uint16_t *b = c + (size_t)k * 2;  /* the pair's block: row 2p's 32, then 2p + 1's */
        if (pf) {
            PG_PREFETCH(b);
            PG_PREFETCH(b + 32);
        }
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)b);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(b + 32));
        PG_KEEP(w0);
        PG_KEEP(w1);
        for (int m = 0; m < MR; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (size_t)m * K + k));
            PG_KEEP(xv);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xv);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xv);
        }
    }
    emit_tile(j, acc, n, m0, MR, 2);
}

/* Rows [n0, n1) from the row pairs, inputs in blocks of 8 (the later blocks re-read the pair's
 * K * 4 bytes from L1; only the first prefetches); an odd row at either end from w as stored. */
static void rows_avx512_bf16_pairs(const job_t *j, int n0, int n1)
{
    const int K = j->K, M = j->M;
    const uint16_t *X = (const uint16_t *)j->xk;
    int n = n0;
    if (n & 1) {  /* pool chunks are 16-row aligned: only a caller's own odd range lands here */
        rows_avx512_bf16(j, n, n + 1);
        n++;
    }
    for (; n + 2 <= n1; n += 2) {
        const uint16_t *c = j->wi + (size_t)n * K;  /* pair n / 2: 2 K elements a pair */
        for (int m0 = 0; m0 < M; m0 += 8) {
            const uint16_t *x = X + (size_t)m0 * K;
            const int pf = m0 == 0;
            switch (M - m0) {
            case 1: tile_bf16_pairs(j, c, x, n, m0, 1, pf); break;
            case 2: tile_bf16_pairs(j, c, x, n, m0, 2, pf); break;
            case 3: tile_bf16_pairs(j, c, x, n, m0, 3, pf); break;
            case 4: tile_bf16_pairs(j, c, x, n, m0, 4, pf); break;
            case 5: tile_bf16_pairs(j, c, x, n, m0, 5, pf); break;
            case 6: tile_bf16_pairs(j, c, x, n, m0, 6, pf); break;
            case 7: tile_bf16_pairs(j, c, x, n, m0, 7, pf); break;
            default: tile_bf16_pairs(j, c, x, n, m0, 8, pf); break;
            }
        }
    }
    if (n < n1)
        rows_avx512_bf16(j, n, n1);
}

/* vdpbf16ps's products as FMAs (pg_bf16_fma): per 32-element step, lane i takes the pair
 * (2i, 2i + 1) of weights and x as the instruction does, and adds the odd product, then the even
 * one, each rounded once: its own order and rounding (products of bf16 values are exact in fp32),
 * so every (input, weight row) accumulator gets tile_bf16's bits, in half the time on a core
 * that issues two zmm FMAs a cycle and one vdpbf16ps every other (Emerald Rapids).  The weights
 * are split into even and odd lanes by a shift and a mask; x comes split already
 * (split_bf16_eo: each full 32-block as its 16 even then 16 odd elements widened, the tail's
 * t = K % 32 as its ceil(t / 2) even then floor(t / 2) odd ones), so an x row costs two loads a
 * step and no shuffles. */
static inline __attribute__((always_inline))
void tile_bf16fma(const job_t *j, const uint16_t *w, const float *x, int n, int m0,
                  const int MR, const int NR, int pf, int pfB)
{
    const int K = j->K;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[8][4];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++)
            acc[m][r] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 we[4], wo[4];
        PG_PF_STEP(pf, pfB, for (int r = 0; r < NR; r++) PG_PREFETCH(w + (size_t)r * K + k));
        for (int r = 0; r < NR; r++) {
            const __m512i v = _mm512_loadu_si512((const void *)(w + (size_t)r * K + k));
            we[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            wo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            PG_KEEP(we[r]);
            PG_KEEP(wo[r]);
        }
        for (int m = 0; m < MR; m++) {
            __m512 xe = _mm512_loadu_ps(x + (size_t)m * K + k);
            __m512 xo = _mm512_loadu_ps(x + (size_t)m * K + k + 16);
            if (NR > 1) { PG_KEEP(xe); PG_KEEP(xo); }
            for (int r = 0; r < NR; r++)
                acc[m][r] = _mm512_fmadd_ps(we[r], xe, _mm512_fmadd_ps(wo[r], xo, acc[m][r]));
        }
    }
    if (k < K) {
        /* The masked lanes are 0 in both operands: + 0 x 0, as the instruction's masked tail. */
        const int t = K - k, ne = (t + 1) / 2;
        const __mmask32 mk = (__mmask32)((1ull << t) - 1ull);
        const __mmask16 me = (__mmask16)((1u << ne) - 1u), mo = (__mmask16)((1u << (t / 2)) - 1u);
        __m512 we[4], wo[4];
        for (int r = 0; r < NR; r++) {
            const __m512i v = _mm512_maskz_loadu_epi16(mk, (const void *)(w + (size_t)r * K + k));
            we[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            wo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        }
        for (int m = 0; m < MR; m++) {
            const __m512 xe = _mm512_maskz_loadu_ps(me, x + (size_t)m * K + k);
            const __m512 xo = _mm512_maskz_loadu_ps(mo, x + (size_t)m * K + k + ne);
            for (int r = 0; r < NR; r++)
                acc[m][r] = _mm512_fmadd_ps(we[r], xe, _mm512_fmadd_ps(wo[r], xo, acc[m][r]));
        }
    }
    emit_tile(j, acc, n, m0, MR, NR);
}

PG_ROWS_DRIVER(rows_avx512_bf16fma, tile_bf16fma, uint16_t, float, 1)

/* bf16 x [M, K] -> the FMA path's split fp32 rows (tile_bf16fma), once per call. */
static void split_bf16_eo(const uint16_t *xb, float *dst, int M, int K)
{
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int m = 0; m < M; m++) {
        const uint16_t *src = xb + (size_t)m * K;
        float *d = dst + (size_t)m * K;
        int k = 0;
        for (; k + 32 <= K; k += 32) {
            const __m512i v = _mm512_loadu_si512((const void *)(src + k));
            _mm512_storeu_ps(d + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            _mm512_storeu_ps(d + k + 16, _mm512_castsi512_ps(_mm512_and_si512(v, hi)));
        }
        if (k < K) {
            const int t = K - k, ne = (t + 1) / 2;
            const __m512i v = _mm512_maskz_loadu_epi16((__mmask32)((1ull << t) - 1ull), (const void *)(src + k));
            _mm512_mask_storeu_ps(d + k, (__mmask16)((1u << ne) - 1u), _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            _mm512_mask_storeu_ps(d + k + ne, (__mmask16)((1u << (t / 2)) - 1u),
                                  _mm512_castsi512_ps(_mm512_and_si512(v, hi)));
        }
    }
}

/* fp32 -> bf16 (RNE) for the activations, once per call. */
static void cvt_f32_to_bf16_avx512bf16(const float *src, uint16_t *dst, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    for (; i < n; i++)
        dst[i] = f32_to_bf16(src[i]);
}

#pragma GCC pop_options

/* ------------------------------------------------------------------------- */
/* AVX2 + FMA kernels (ISA_AVX2: Haswell, Zen 1-3)                            */
/*                                                                            */
/* The AVX-512 tiles' scheme in 8-lane ymm registers, of which there are only */
/* 16: a tile keeps MR x NR accumulators, its NR weight vectors (each loaded  */
/* once and used for MR inputs) and one x vector live, so MR * NR + NR + 1   */
/* <= 16.  Shapes (see PG_ROWS_DRIVER_AVX2): 4 rows x 1-2 inputs, else 2 rows */
/* x up to 6 inputs per pass (15 registers), the inputs split into passes as */
/* evenly as possible; leftover rows 1 x up to 8.  x is loaded into a        */
/* register once per step (a memory-operand FMA per weight row made M >= 3    */
/* load-bound: 50 -> 63 GMAC/s on one core, of a 67 GMAC/s ymm FMA peak).     */
/* One software prefetch per 64-byte line of each weight row, as in the       */
/* AVX-512 tiles.  In a -march=native build on an AVX-512 CPU the region adds */
/* to the AVX-512 flags (gcc then may use EVEX encodings and ymm16-31); the   */
/* generic build (tested) is pure AVX2.                                       */
/* ------------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* The AVX2 tiles' software prefetch walks the tile's NR rows (adjacent in memory) as one
 * stream: at the step that has read k elements of each row, lines r = 0 .. NR-1 of the tile's
 * bytes k * NR * sizeof(*w) on (plus PG_PF_BYTES) -- the same lines as a prefetch per row at
 * its own position, in address order.  On Zen 3 (2 threads, weights from DRAM) the per-row
 * order, NR streams 1-2 KB apart, streamed a bf16 M = 1 GEMV at ~19 GB/s, the one stream at
 * ~25 (microbenchmark; the read probe ~27).  The one stream runs NR times as fast as a row is
 * read, so it stays ahead of every row only while the rows after the first fit in about the
 * prefetch distance: up to 1.25 times it (the last row's first lines then come late: 5 lines of
 * a 4 x 1536 bf16 tile, which still streamed as fast as or faster than per row); longer rows
 * keep one stream per row. */
#define PG_PREFETCH_TILE(w, k, r, NR, K)                                                  \
    PG_PREFETCH((size_t)((NR) - 1) * (K) * sizeof(*(w)) <= PG_PF_BYTES + PG_PF_BYTES / 4   \
                    ? (const char *)(w) + (size_t)(k) * sizeof(*(w)) * (NR) + (size_t)(r) * 64 \
                    : (const char *)((w) + (size_t)(r) * (K) + (k)))

/* The four horizontal sums of a, b, c, d (8 lanes each) as one __m128. */
static inline __attribute__((always_inline)) __m128 hsum4_ymm(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 ab = _mm256_hadd_ps(a, b);      /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    __m256 cd = _mm256_hadd_ps(c, d);
    __m256 abcd = _mm256_hadd_ps(ab, cd);  /* a0-3 b0-3 c0-3 d0-3 | a4-7 ...   */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* As emit_tile: reduce acc[m][r] (sums for y[m0 + m, n + r]) four at a time and store. */
static inline __attribute__((always_inline))
void emit_tile_ymm(const job_t *j, __m256 acc[8][4], int n, int m0, const int MR, const int NR)
{
    const __m256 z = _mm256_setzero_ps();
    if (NR == 4) {
        for (int m = 0; m < MR; m++)
            store_row4(j, m0 + m, n, hsum4_ymm(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    } else if (NR == 2) {
        for (int m = 0; m < MR; m += 2) {
            const int two = m + 1 < MR;
            store_2x2(j, m0 + m, n, hsum4_ymm(acc[m][0], acc[m][1], two ? acc[m + 1][0] : z,
                                              two ? acc[m + 1][1] : z), two);
        }
    } else {
        for (int m = 0; m < MR; m += 4)
            store_col4(j, m0 + m, MR - m < 4 ? MR - m : 4, n,
                       hsum4_ymm(acc[m][0], m + 1 < MR ? acc[m + 1][0] : z,
                                 m + 2 < MR ? acc[m + 2][0] : z, m + 3 < MR ? acc[m + 3][0] : z));
    }
}

/* Lane masks for the last K % 8 columns: g_lanes8 + 8 - r enables lanes [0, r). */
static const int32_t g_lanes8[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* One 8-column step of a tile: the NR weight vectors wv times MR x vectors, into
 * accumulator rows A..A+MR-1.  Every tile shape accumulates a row in the same order (one
 * chain per (input, weight row), 8-column steps in K order, one horizontal sum), so a row's
 * result is bit-identical whatever M and tile it runs in: batch invariance (a decode row alone,
 * in a batch or in a verify tree gets the same bits).  This gives up a second accumulator set
 * at M = 1 (4 FMA chains cap a cache-resident M = 1 at one FMA per cycle); DRAM-streamed
 * weights are bandwidth-bound well below that. */
#define PG_YMM_STEP(XLOAD, A)                                                            \
    do {                                                                                 \
        for (int r = 0; r < NR; r++)                                                     \
            PG_KEEP(wv[r]);                                                              \
        for (int m = 0; m < MR; m++) {                                                   \
            __m256 xv = XLOAD;                                                           \
            if (NR > 1) PG_KEEP(xv);                                                     \
            for (int r = 0; r < NR; r++)                                                 \
                acc[m + (A)][r] = _mm256_fmadd_ps(wv[r], xv, acc[m + (A)][r]);           \
        }                                                                                \
    } while (0)
#define PG_YMM_INIT                                                                      \
    for (int m = 0; m < MR; m++)                                                         \
        for (int r = 0; r < NR; r++)                                                     \
            acc[m][r] = _mm256_setzero_ps()

/* fp32 weights, fp32 x: a 64-byte line (16 floats, two steps) of each row per iteration. */
static inline __attribute__((always_inline))
void tile2_f32(const job_t *j, const float *w, const float *x, int n, int m0,
               const int MR, const int NR, int pf, int pfB)
{
    const int K = j->K;
    __m256 acc[8][4], wv[4];
    PG_YMM_INIT;
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        PG_PF_STEP(pf, pfB, for (int r = 0; r < NR; r++) PG_PREFETCH_TILE(w, k, r, NR, K));
        for (int h = 0; h < 16; h += 8) {
            for (int r = 0; r < NR; r++)
                wv[r] = _mm256_loadu_ps(w + (size_t)r * K + k + h);
            PG_YMM_STEP(_mm256_loadu_ps(x + (size_t)m * K + k + h), 0);
        }
    }
    if (k + 8 <= K) {
        for (int r = 0; r < NR; r++)
            wv[r] = _mm256_loadu_ps(w + (size_t)r * K + k);
        PG_YMM_STEP(_mm256_loadu_ps(x + (size_t)m * K + k), 0);
        k += 8;
    }
    if (k < K) {
        /* Masked lanes load as 0 in both operands (and never fault). */
        const __m256i mk = _mm256_loadu_si256((const __m256i *)(g_lanes8 + 8 - (K - k)));
        for (int r = 0; r < NR; r++)
            wv[r] = _mm256_maskload_ps(w + (size_t)r * K + k, mk);
        PG_YMM_STEP(_mm256_maskload_ps(x + (size_t)m * K + k, mk), 0);
    }
    emit_tile_ymm(j, acc, n, m0, MR, NR);
}

/* 8 bf16 -> 8 fp32: zero-extend to 32 bits, shift the bf16 into the high half (exact). */
static inline __attribute__((always_inline)) __m256 bf16x8_to_f32_ymm(const uint16_t *p)
{
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* bf16 weights, fp32 x: a 64-byte line (32 bf16, four steps) of each row per iteration. */
static inline __attribute__((always_inline))
void tile2_bf16w(const job_t *j, const uint16_t *w, const float *x, int n, int m0,
                 const int MR, const int NR, int pf, int pfB)
{
    const int K = j->K;
    __m256 acc[8][4], wv[4];
    PG_YMM_INIT;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        PG_PF_STEP(pf, pfB, for (int r = 0; r < NR; r++) PG_PREFETCH_TILE(w, k, r, NR, K));
        for (int h = 0; h < 32; h += 8) {
            for (int r = 0; r < NR; r++)
                wv[r] = bf16x8_to_f32_ymm(w + (size_t)r * K + k + h);
            PG_YMM_STEP(_mm256_loadu_ps(x + (size_t)m * K + k + h), 0);
        }
    }
    for (; k + 8 <= K; k += 8) {
        for (int r = 0; r < NR; r++)
            wv[r] = bf16x8_to_f32_ymm(w + (size_t)r * K + k);
        PG_YMM_STEP(_mm256_loadu_ps(x + (size_t)m * K + k), 0);
    }
    if (k < K) {
        /* No 16-bit masked load in AVX2: copy the < 8 last weights into a zeroed buffer
         * (once per tile); x's masked lanes load as 0. */
        const __m256i mk = _mm256_loadu_si256((const __m256i *)(g_lanes8 + 8 - (K - k)));
        for (int r = 0; r < NR; r++) {
            uint16_t t[8] = {0};
            memcpy(t, w + (size_t)r * K + k, (size_t)(K - k) * 2);
            wv[r] = bf16x8_to_f32_ymm(t);
        }
        PG_YMM_STEP(_mm256_maskload_ps(x + (size_t)m * K + k, mk), 0);
    }
    emit_tile_ymm(j, acc, n, m0, MR, NR);
}

/* Rows [n0, n1) for all M with the AVX2 tile `TILE`.  M <= 2: 4 rows x M (4 independent
 * FMA chains per input at M = 1).  M >= 3: 2 rows x up to 6 inputs, the M inputs in
 * B = ceil(M / 6) passes over the 2-row tile (later passes re-read it from L1; DRAM sees
 * each weight byte once), pass b prefetching the lines s = b (mod B).  Rows left over: one
 * row x up to 8 inputs. */
#define PG_TILE_MR6(TILE, MR, NR, ...)                                                   \
    switch (MR) {                                                                        \
    case 1: TILE(__VA_ARGS__, 1, NR, pfb, pfB); break;                                   \
    case 2: TILE(__VA_ARGS__, 2, NR, pfb, pfB); break;                                   \
    case 3: TILE(__VA_ARGS__, 3, NR, pfb, pfB); break;                                   \
    case 4: TILE(__VA_ARGS__, 4, NR, pfb, pfB); break;                                   \
    case 5: TILE(__VA_ARGS__, 5, NR, pfb, pfB); break;                                   \
    default: TILE(__VA_ARGS__, 6, NR, pfb, pfB); break;                                  \
    }
#define PG_TILE_MR8(TILE, MR, NR, ...)                                                   \
    switch (MR) {                                                                        \
    case 7: TILE(__VA_ARGS__, 7, NR, pfb, pfB); break;                                   \
    case 8: TILE(__VA_ARGS__, 8, NR, pfb, pfB); break;                                   \
    default: PG_TILE_MR6(TILE, MR, NR, __VA_ARGS__) break;                               \
    }

#define PG_ROWS_DRIVER_AVX2(NAME, TILE, WT)                                              \
    static void NAME(const job_t *j, int n0, int n1)                                     \
    {                                                                                    \
        const int K = j->K, M = j->M;                                                    \
        const WT *W = (const WT *)j->w;                                                  \
        const float *X = (const float *)j->xk;                                           \
        int n = n0, pfb = 0, pfB = 1;                                                    \
        if (M <= 2) {                                                                    \
            for (; n + 4 <= n1; n += 4) {                                                \
                if (M == 1) TILE(j, W + (size_t)n * K, X, n, 0, 1, 4, 0, 1);             \
                else TILE(j, W + (size_t)n * K, X, n, 0, 2, 4, 0, 1);                    \
            }                                                                            \
        } else {                                                                         \
            pfB = (M + 5) / 6;                                                           \
            for (; n + 2 <= n1; n += 2) {                                                \
                const WT *w = W + (size_t)n * K;                                         \
                int m0 = 0;                                                              \
                for (pfb = 0; pfb < pfB; pfb++) {                                        \
                    /* ceil(rest / passes left): <= 6 since pfB = ceil(M / 6) */         \
                    const int mr = (M - m0 + pfB - pfb - 1) / (pfB - pfb);               \
                    PG_TILE_MR6(TILE, mr, 2, j, w, X + (size_t)m0 * K, n, m0)            \
                    m0 += mr;                                                            \
                }                                                                        \
            }                                                                            \
        }                                                                                \
        pfb = 0; pfB = 0; /* leftover rows: too few to be worth prefetching */           \
        for (; n < n1; n++) {                                                            \
            const WT *w = W + (size_t)n * K;                                             \
            for (int m0 = 0; m0 < M; m0 += 8) {                                          \
                PG_TILE_MR8(TILE, M - m0 < 8 ? M - m0 : 8, 1, j, w, X + (size_t)m0 * K, n, m0) \
            }                                                                            \
        }                                                                                \
    }

PG_ROWS_DRIVER_AVX2(rows_avx2_f32, tile2_f32, float)
PG_ROWS_DRIVER_AVX2(rows_avx2_bf16w, tile2_bf16w, uint16_t)

#pragma GCC pop_options
#endif /* PG_X86 */

/* ------------------------------------------------------------------------- */
/* Row-range dispatch                                                         */
/* ------------------------------------------------------------------------- */

static void run_rows(const job_t *j, int n0, int n1)
{
#ifdef PG_X86
    if (j->isa >= ISA_AVX512) {
        if (j->wdt == DT_F32)
            rows_avx512_f32(j, n0, n1);
        else if (j->isa == ISA_AVX512_BF16 && j->fma)
            rows_avx512_bf16fma(j, n0, n1);
        else if (j->isa == ISA_AVX512_BF16 && j->wi && j->M >= g_pairs_min_m && j->M <= PG_PAIRS_MAX_M)
            rows_avx512_bf16_pairs(j, n0, n1);
        else if (j->isa == ISA_AVX512_BF16)
            rows_avx512_bf16(j, n0, n1);
        else
            rows_avx512_bf16w(j, n0, n1);
        return;
    }
    if (j->isa == ISA_AVX2) {
        if (j->wdt == DT_F32)
            rows_avx2_f32(j, n0, n1);
        else
            rows_avx2_bf16w(j, n0, n1);
        return;
    }
#endif
    rows_portable(j, n0, n1);
}

/* A pool chunk: rows [n0, n1) of the job. */
static void rows_task(const void *ctx, int n0, int n1)
{
    run_rows((const job_t *)ctx, n0, n1);
}

/* Per-thread scratch for converted activations (M*K elements, tiny); the AMX path's too. */
static __thread void *tl_scratch = NULL;
static __thread size_t tl_scratch_cap = 0;

void *pg_scratch(size_t bytes)
{
    if (bytes > tl_scratch_cap) {
        free(tl_scratch);
        size_t cap = bytes < 65536 ? 65536 : bytes;
        tl_scratch = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        tl_scratch_cap = tl_scratch ? cap : 0;
    }
    return tl_scratch;
}

void pg_round_bf16(const float *src, uint16_t *dst, size_t n)
{
#ifdef PG_X86
    cvt_f32_to_bf16_avx512bf16(src, dst, n);
#else
    for (size_t i = 0; i < n; i++)
        dst[i] = f32_to_bf16(src[i]);
#endif
}

/*
 * y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]).
 * w: fp32 or bf16 (wdt); x, y: fp32 or bf16 (xdt; y has the dtype of x).
 * All arrays contiguous.  Returns 0 on success, -1 for bad arguments (M > PG_MAX_M...),
 * -2 for allocation failure.  Safe to call from several threads: the pool serves one
 * caller at a time and any other caller runs single-threaded on its own thread.
 */
static int linear_job(const void *w, const uint16_t *wi, int wdt, const float *bias, const void *x, int xdt,
                      void *y, int M, int N, int K)
{
    if (M < 1 || M > PG_MAX_M || N < 1 || K < 1 || (wdt != DT_F32 && wdt != DT_BF16) ||
        (xdt != DT_F32 && xdt != DT_BF16) || (wi && (wdt != DT_BF16 || K % 32)))
        return -1;
    job_t j;
    j.w = w; j.wi = wi; j.wdt = wdt; j.bias = bias; j.y = y; j.ydt = xdt;
    j.M = M; j.N = N; j.K = K;
    j.isa = pg_isa();

    /* Activations into the kernel's dtype: bf16 for the dpbf16 path, else fp32. */
    const int kdt = (wdt == DT_BF16 && j.isa == ISA_AVX512_BF16) ? DT_BF16 : DT_F32;
    j.fma = kdt == DT_BF16 && pg_bf16_fma();
    const size_t nx = (size_t)M * K;
    const size_t nb16 = (nx * 2 + 63) & ~(size_t)63;  /* x in bf16, before the FMA path's split */
    void *s = NULL;
    if (kdt != xdt || j.fma) {
        s = pg_scratch(kdt == DT_F32 ? nx * 4 : nb16 + (j.fma ? nx * 4 : 0));
        if (!s)
            return -2;
    }
    if (kdt == xdt) {
        j.xk = x;
    } else {
        if (kdt == DT_F32) {
            const uint16_t *xs = (const uint16_t *)x;
            float *d = (float *)s;
            for (size_t i = 0; i < nx; i++)
                d[i] = bf16_to_f32(xs[i]);
        } else {
            pg_round_bf16((const float *)x, (uint16_t *)s, nx);
        }
        j.xk = s;
    }
#ifdef PG_X86
    if (j.fma) {
        split_bf16_eo((const uint16_t *)j.xk, (float *)((char *)s + nb16), M, K);
        j.xk = (char *)s + nb16;
    }
#endif

    const size_t wbytes = (size_t)N * K * (wdt == DT_F32 ? 4 : 2);
    const int nth = pg_num_threads();
    if (nth <= 1 || wbytes < (size_t)g_solo_bytes || N < 32) {
        run_rows(&j, 0, N);
        return 0;
    }
    /* PG_CHUNKS_PER_THREAD (cpu_runtime.h) chunks per thread, each >= 16 KB of weights so
     * that the hardware prefetcher ramps up. */
    const size_t row_bytes = (size_t)K * (wdt == DT_F32 ? 4 : 2);
    int rows = (N + PG_CHUNKS_PER_THREAD * nth - 1) / (PG_CHUNKS_PER_THREAD * nth);
    int min_rows = (int)((16384 + row_bytes - 1) / row_bytes);
    if (rows < min_rows) rows = min_rows;
    rows = (rows + 15) & ~15;
    pg_parallel_for(rows_task, &j, N, rows);
    return 0;
}

int pg_linear(const void *w, int wdt, const float *bias, const void *x, int xdt,
              void *y, int M, int N, int K)
{
    return linear_job(w, NULL, wdt, bias, x, xdt, y, M, N, K);
}

int pg_linear_pairs(const uint16_t *w, const uint16_t *pairs, const float *bias, const void *x, int xdt,
                    void *y, int M, int N, int K)
{
    return linear_job(w, pairs, DT_BF16, bias, x, xdt, y, M, N, K);
}

/* Testing/tuning hook: matrices under b weight bytes run on the calling thread only. */
void pg_set_solo_bytes(int b) { g_solo_bytes = b < 0 ? 0 : b; }

/* Testing/tuning hook: the fewest inputs that read a row-pair copy (pg_linear_pairs; at most
 * PG_PAIRS_MAX_M do); returns the value in force (m <= 0: the default, 5). */
int pg_set_pairs_min_m(int m)
{
    g_pairs_min_m = m <= 0 ? PG_PAIRS_MIN_M : m;
    return g_pairs_min_m;
}
