/*
 * cpu_qgemv_avx2.c -- the 32-element family's AVX2 + FMA + F16C kernels (tier avx2): float and
 * int8 (vpmaddubsw + vpmaddwd) row kernels and the dequantizer.  The algorithms, layouts and
 * measurements are in cpu_qgemv.c's header; the shared structures in cpu_qgemv.h.  Uses
 * nothing of the other kernel files (only cpu_qgemv.h's inline helpers).
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "cpu_qgemv.h"

#ifdef PQ_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
/* The activation quantizer of prep (cpu_qgemv.c) at tier avx2. */
void q32_quant_block_avx2(const float *x, int8_t *q, float *dx, int *sum)
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

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,sse4.1")

#define Y_MR 2 /* float path: inputs per register block, 16 ymm registers (8 accumulators) */

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
    const int bb = Q32_L(FMT).bb;
    for (int b = 0; b < nblk; b++, src += bb, dst += QK) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(src)));
        if (!Q32_L(FMT).nib) {
            for (int i = 0; i < 4; i++) {
                __m128i q8 = _mm_loadl_epi64((const __m128i *)(src + 2 + 8 * i));
                _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d));
            }
        } else {
            const __m256 off = !Q32_L(FMT).has_m ? _mm256_mul_ps(d, _mm256_set1_ps(-(float)Q32_L(FMT).zero))
                                              : _mm256_set1_ps(_cvtsh_ss(rd16(src + 2)));
            const __m256i m4 = _mm256_set1_epi32(15);
            for (int i = 0; i < 2; i++) {
                const __m128i q8 = _mm_loadl_epi64((const __m128i *)(src + Q32_L(FMT).qoff + 8 * i));
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
    const int K = j->K, M = j->M, bb = Q32_L(FMT).bb;
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
    const int bb = Q32_L(FMT).bb, qoff = Q32_L(FMT).qoff;
    if (KIND == KIND_T) {
        /* Each block's first dword (its scales) in lane i: 16-byte loads at offset 0 and the
         * first third of a 4x4 transpose.  Not vpgatherdd: on Zen 3 the gather was ~30% of
         * the M = 1 kernel's samples (perf), these loads hit the lines the nibbles use anyway. */
        __m256i sc;
        {
            __m256i z[4];
            y_gather16(g, bb, 0, nv, FULL, z);
            sc = _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(z[0], z[1]), _mm256_unpacklo_epi32(z[2], z[3]));
        }
        /* low halves (d) and high halves (Q4_1's m) to 8 fp16 each */
        const __m256i lo16 = _mm256_and_si256(sc, _mm256_set1_epi32(0xffff));
        __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo16, lo16), 0x08);
        t->dp[r] = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
        if (Q32_L(FMT).has_m) {
            const __m256i hi16 = _mm256_srli_epi32(sc, 16);
            pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi16, hi16), 0x08);
            t->mp[r] = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
        }
    } else {
        t->dp[r] = _mm256_set1_ps(_cvtsh_ss(rd16(g)));
        if (Q32_L(FMT).has_m)
            t->mp[r] = _mm256_set1_ps(_cvtsh_ss(rd16(g + 2)));
    }
    const __m256i m4 = _mm256_set1_epi8(15);
    if (!Q32_L(FMT).nib) {
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

/* A pair's block dot products (int32, 8 blocks) scaled into its accumulator: dot * (d_w * d_x)
 * (+ m_w * s_x for Q4_1).  The one float sequence every pair runs, whatever its neighbours. */
static inline __attribute__((always_inline))
void y_ifinish(const ytile_t *t, int r, const uint8_t *xr, __m256i dot, __m256 *acc, const int FMT, const int S)
{
    const size_t dxo = (size_t)S * 32, auxo = (size_t)(S + 1) * 32;
    const __m256 dx = _mm256_load_ps((const float *)(xr + dxo));
    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(t->dp[r], dx), *acc);
    if (Q32_L(FMT).has_m)
        a = _mm256_fmadd_ps(t->mp[r], _mm256_load_ps((const float *)(xr + auxo)), a);
    *acc = a;
}

/* One (input row m, weight row r) pair over a group: its int8 dot products summed over the S
 * steps (Q4: in int16, then widened; Q8_0: in int32; exact either way), scaled and added to acc. Pairs one at a time, so a few registers
 * are live: with the 2x4 pairs of a register block at once, GCC computed all 64 products first
 * and spilled them (M=8 ran 27% slower). A pair's operations do not depend on M: a row's bits
 * are the same alone or in a batch. */
static inline __attribute__((always_inline))
void y_iblock_row(const ytile_t *t, int r, const uint8_t *xr, __m256 *acc, const int FMT, const int S)
{
    const size_t auxo = (size_t)(S + 1) * 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i dot;
    if (Q32_L(FMT).nib) {
        __m256i h = _mm256_setzero_si256();
        for (int s = 0; s < S; s++)
            h = _mm256_add_epi16(h, _mm256_maddubs_epi16(t->w[r][s], _mm256_load_si256((const __m256i *)(xr + (size_t)s * 32))));
        dot = _mm256_madd_epi16(h, ones);
        if (!Q32_L(FMT).has_m)
            dot = _mm256_add_epi32(dot, _mm256_load_si256((const __m256i *)(xr + auxo)));
    } else {
        dot = _mm256_setzero_si256();
        for (int s = 0; s < S; s++) {
            const __m256i xs = _mm256_sign_epi8(_mm256_load_si256((const __m256i *)(xr + (size_t)s * 32)), t->s[r][s]);
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(t->w[r][s], xs), ones));
        }
    }
    y_ifinish(t, r, xr, dot, acc, FMT, S);
}

/* An empty asm that takes v in a register and gives it back changed, as far as GCC knows: it
 * cannot sum a pair's products as a tree across steps (it computed all of a register block's
 * products first and spilled them; see y_iblock_row), so each accumulator stays in a register. */
#define Y_KEEP(v) __asm__("" : "+x"(v))

/* Q8_0: two input rows (m, m + 1) against the tile's NR weight rows, each weight vector (and its
 * signs) loaded once for both rows, each input vector once for all NR.  Every pair's operations
 * are y_iblock_row's (int32 sums, exact in any order, then y_ifinish), so a row's bits do not
 * depend on its partner.  1.1-1.25x on the Q8_0 LM head at M = 2..64 (avx2, Zen 3); not used
 * for the Q4 formats, where the same blocking measured 0.9-1.0x: their kernel is not bound by
 * these loads. */
static inline __attribute__((always_inline))
void y_iblock_rows2(const ytile_t *t, const uint8_t *x0, const uint8_t *x1, __m256 *acc0, __m256 *acc1,
                    const int FMT, const int S, const int NR)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i d0[PQ_NR], d1[PQ_NR];
    for (int r = 0; r < NR; r++)
        d0[r] = d1[r] = _mm256_setzero_si256();
    for (int s = 0; s < S; s++) {
        const __m256i a = _mm256_load_si256((const __m256i *)(x0 + (size_t)s * 32));
        const __m256i b = _mm256_load_si256((const __m256i *)(x1 + (size_t)s * 32));
        for (int r = 0; r < NR; r++) {
            const __m256i w = t->w[r][s], sg = t->s[r][s];
            d0[r] = _mm256_add_epi32(d0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(a, sg)), ones));
            d1[r] = _mm256_add_epi32(d1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(b, sg)), ones));
            Y_KEEP(d0[r]);
            Y_KEEP(d1[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        y_ifinish(t, r, x0, d0[r], &acc0[r], FMT, S);
        y_ifinish(t, r, x1, d1[r], &acc1[r], FMT, S);
    }
}

static inline __attribute__((always_inline))
void y_igroup(const pq_job_t *j, int n, const int FMT, const int KIND, const int FULL, int b0, int nv,
              const uint8_t *xg, size_t ms, const int NR, ytile_t *t, __m256 (*acc)[PQ_NR])
{
    const int bb = Q32_L(FMT).bb, M = j->M, S = KIND == KIND_T ? 8 : 1;
    /* The tile's NR rows are adjacent: prefetch them as one stream, this group's share of the
     * tile's bytes in address order (the lines a per-row prefetch would take, NR streams a
     * row apart; one stream read DRAM faster on Zen 3), while the rows after the first fit in
     * the prefetch distance (see cpu_gemv.c PG_PREFETCH_TILE); longer rows: one per row. */
    const int one_stream = (size_t)(NR - 1) * j->row_bytes <= PQ_PF_BYTES + PQ_PF_BYTES / 4;
    if (one_stream)
        y_prefetch(j->w + (size_t)n * j->row_bytes + (size_t)b0 * bb * NR, (size_t)nv * bb * NR);
    if (M == 1) {  /* each row's products right after its decode: its vectors stay in registers */
        for (int r = 0; r < NR; r++) {
            const uint8_t *g = j->w + (size_t)(n + r) * j->row_bytes + (size_t)b0 * bb;
            if (!one_stream)
                y_prefetch(g, (size_t)nv * bb);
            y_idec(FMT, KIND, FULL, g, nv, t, r);
            y_iblock_row(t, r, xg, &acc[0][r], FMT, S);
        }
        return;
    }
    for (int r = 0; r < NR; r++) {
        const uint8_t *g = j->w + (size_t)(n + r) * j->row_bytes + (size_t)b0 * bb;
        if (!one_stream)
            y_prefetch(g, (size_t)nv * bb);
        y_idec(FMT, KIND, FULL, g, nv, t, r);
    }
    int m = 0;
    if (!Q32_L(FMT).nib)
        for (; m + 2 <= M; m += 2)
            y_iblock_rows2(t, xg + (size_t)m * ms, xg + (size_t)(m + 1) * ms, acc[m], acc[m + 1], FMT, S, NR);
    for (; m < M; m++)
        for (int r = 0; r < NR; r++)
            y_iblock_row(t, r, xg + (size_t)m * ms, &acc[m][r], FMT, S);
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

/* One format's entry points at tier avx2: the int8 kernels when prep quantized x (its header
 * says so), else the float path; the dequantizer of the prefill path. */
#define Q32_INSTANCE_AVX2(name, code)                                                     \
    static void y_frows_##name(const pq_job_t *j, int n0, int n1) { y_frows(j, n0, n1, code); } \
    static void y_irows_##name(const pq_job_t *j, int n0, int n1) { y_irows(j, n0, n1, code); } \
    void q32_rows_avx2_##name(const pq_job_t *j, int n0, int n1)                         \
    {                                                                                    \
        if (((const xa_hdr_t *)j->xa)->path == PATH_INT8 && ((const xa_hdr_t *)j->xa)->cl) \
            q32_rows_cl_avx2_##name(j, n0, n1); /* cpu_qgemv_cl.c */                     \
        else if (((const xa_hdr_t *)j->xa)->path == PATH_INT8)                           \
            y_irows_##name(j, n0, n1);                                                   \
        else                                                                             \
            y_frows_##name(j, n0, n1);                                                   \
    }                                                                                    \
    void q32_dequant_avx2_##name(const uint8_t *blk, int nblk, float *out)               \
    {                                                                                    \
        y_dec_f32(code, blk, nblk, out);                                                 \
    }

Q32_FORMATS(Q32_INSTANCE_AVX2)

#pragma GCC pop_options
#endif /* PQ_X86 */
