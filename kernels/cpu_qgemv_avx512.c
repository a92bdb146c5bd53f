/*
 * cpu_qgemv_avx512.c -- the 32-element family's AVX-512 kernels (tiers avx512, avx512_vnni and avx512_bf16):
 * F/BW/VL/DQ everywhere, + VNNI (vpdpbusd) in the int8 row kernels of tiers avx512_vnni and up.  The
 * algorithms, layouts and measurements are in cpu_qgemv.c's header; the shared structures in
 * cpu_qgemv.h.  Uses nothing of the other kernel files (only cpu_qgemv.h's inline helpers).
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "cpu_qgemv.h"

#ifdef PQ_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,f16c")
/* The activation quantizer of prep (cpu_qgemv.c) at the AVX-512 tiers. */
void q32_quant_block_avx512(const float *x, int8_t *q, float *dx, int *sum)
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

/* z_hsum4's sums of 16 accumulators at once, in its order of additions (so the same bits):
 * per accumulator X, f_i = X_i + X_(i+8), then (f0 + f1) + (f2 + f3) and (f4 + f5) + (f6 + f7),
 * then their sum.  a[m][r] for 4 inputs m and 4 rows r; lane 4m + r of the result is a[m][r]'s
 * sum.  45 shuffles and adds for 16 sums against 76 for four z_hsum4. */
static inline __attribute__((always_inline)) __m512 z_hsum16(__m512 (*a)[PQ_NR])
{
    /* X[x] with x = 8 (m / 2) + 2 r + m % 2: the lane order the stages below leave */
    __m512 X[16], Z[8], W[4], V[2];
    for (int m = 0; m < 4; m++)
        for (int r = 0; r < 4; r++)
            X[8 * (m >> 1) + 2 * r + (m & 1)] = a[m][r];
    for (int k = 0; k < 8; k++)  /* Z_k: f of X[2k] in lanes 0-7, of X[2k+1] in lanes 8-15 */
        Z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(X[2 * k], X[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(X[2 * k], X[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++)  /* adjacent pairs within 128-bit lanes, as vhaddps */
        W[k] = _mm512_add_ps(_mm512_shuffle_ps(Z[2 * k], Z[2 * k + 1], 0x88),
                             _mm512_shuffle_ps(Z[2 * k], Z[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++)
        V[k] = _mm512_add_ps(_mm512_shuffle_ps(W[2 * k], W[2 * k + 1], 0x88),
                             _mm512_shuffle_ps(W[2 * k], W[2 * k + 1], 0xDD));
    /* V lanes 0-3 / 4-7 / 8-11 / 12-15: the low halves' sums of four accumulators, their high
     * halves', then the same for four others */
    return _mm512_add_ps(_mm512_shuffle_f32x4(V[0], V[1], 0x88), _mm512_shuffle_f32x4(V[0], V[1], 0xDD));
}

/* y[m0 + i, n..n+3] = lanes 4i..4i+3 of s (+ bias), i < 4. */
static inline __attribute__((always_inline)) void z_store_4x4(const pq_job_t *j, int m0, int n, __m512 s)
{
    if (j->bias)
        s = _mm512_add_ps(s, _mm512_broadcast_f32x4(_mm_loadu_ps(j->bias + n)));
    const size_t off = (size_t)m0 * j->N + n;
    if (j->ydt == DT_F32) {
        float *y = (float *)j->y + off;
        for (int i = 0; i < 4; i++)
            _mm_storeu_ps(y + (size_t)i * j->N, _mm512_extractf32x4_ps(s, i));
    } else {
        uint16_t *y = (uint16_t *)j->y + off;
        const __m256i b = bf16x16_rne(s);  /* cpu_bf16.h */
        _mm_storel_epi64((__m128i *)y, _mm256_castsi256_si128(b));
        _mm_storel_epi64((__m128i *)(y + j->N), _mm_unpackhi_epi64(_mm256_castsi256_si128(b), _mm256_castsi256_si128(b)));
        const __m128i h = _mm256_extracti128_si256(b, 1);
        _mm_storel_epi64((__m128i *)(y + 2 * (size_t)j->N), h);
        _mm_storel_epi64((__m128i *)(y + 3 * (size_t)j->N), _mm_unpackhi_epi64(h, h));
    }
}

/* Store acc[m][r] (r < NR) for rows n.. of all M inputs. */
static inline __attribute__((always_inline))
void z_emit(const pq_job_t *j, __m512 (*acc)[PQ_NR], int n, const int NR)
{
    int m = 0;
    if (NR == 4)
        for (; m + 4 <= j->M; m += 4)
            z_store_4x4(j, m, n, z_hsum16(acc + m));
    for (; m < j->M; m++) {
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
    const int bb = Q32_L(FMT).bb;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 iotaz = _mm512_sub_ps(iota, _mm512_set1_ps((float)Q32_L(FMT).zero));
    for (int b = 0; b < nblk; b++, src += bb, dst += QK) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(src)));
        if (!Q32_L(FMT).nib) {
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 2))));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 18))));
            _mm512_storeu_ps(dst, _mm512_mul_ps(lo, d));
            _mm512_storeu_ps(dst + 16, _mm512_mul_ps(hi, d));
        } else {
            const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + Q32_L(FMT).qoff)));
            __m512 lut;
            if (!Q32_L(FMT).has_m)
                lut = _mm512_mul_ps(iotaz, d);
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
    const int K = j->K, M = j->M, bb = Q32_L(FMT).bb;
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
    const int bb = Q32_L(FMT).bb, wb = bb / 2, qw = Q32_L(FMT).qoff / 2; /* words per block, qs start */
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
    if (wb % 2 == 0 && qw % 2 == 0) {
        /* every qs dword of these blocks is dword-aligned (Q4_1: 20-byte blocks, qs at 4): the
         * same picks as dwords, one vpermt2d (1 uop) instead of a vpermt2w (2 on the Xeon) */
        _Alignas(64) int32_t pd[16];
        for (int d = 0; d < 16; d++)
            pd[d] = (wb * (d & 3) + qw) / 2 + (d >> 2);
        const __m512i pdx = _mm512_load_si512((const void *)pd);
        for (int a = 0; a < 4; a++)
            P[a] = _mm512_permutex2var_epi32(lo[a], pdx, hi[a]);
    } else {
        for (int a = 0; a < 4; a++)
            P[a] = _mm512_permutex2var_epi16(lo[a], pidx, hi[a]);
    }
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
    if (Q32_L(FMT).has_m) {
        const __m256i m16 = _mm256_permute2x128_si256(_mm512_castsi512_si256(s01),
                                                      _mm512_castsi512_si256(s23), 0x31);
        *mp = _mm512_cvtph_ps(m16);
    }
}

static inline __attribute__((always_inline))
void z_idec(const int FMT, const int VNNI, const int KIND, const int FULL, const uint8_t *g, int nv,
            ztile_t *t, int r, int rp)
{
    const int bb = Q32_L(FMT).bb, qoff = Q32_L(FMT).qoff;
    if (rp && KIND == KIND_T && FULL) {
        /* a regrouped group (q32_repack): the registers the transposes below would give */
        const int S = Q32_L(FMT).nib ? 4 : 8;
        t->dp[r] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 64 * S)));
        if (Q32_L(FMT).has_m)
            t->mp[r] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 64 * S + 32)));
        if (Q32_L(FMT).nib) {
            const __m512i m4 = _mm512_set1_epi8(15);
            for (int k = 0; k < 4; k++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(g + 64 * k));
                t->w[r][k] = _mm512_and_si512(raw, m4);
                t->w[r][k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            }
        } else {
            for (int k = 0; k < 8; k++) {
                const __m512i s = _mm512_loadu_si512((const void *)(g + 64 * k));
                if (VNNI) {
                    t->w[r][k] = _mm512_xor_si512(s, _mm512_set1_epi8((char)0x80));
                } else {
                    t->sm[r][k] = _mm512_movepi8_mask(s);
                    t->w[r][k] = _mm512_abs_epi8(s);
                }
            }
        }
        return;
    }
    if (Q32_L(FMT).nib && KIND == KIND_T) {
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
        if (Q32_L(FMT).has_m)
            t->mp[r] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sc, 16)));
    } else {
        const float d0 = _cvtsh_ss(rd16(g)), d1 = nv > 1 ? _cvtsh_ss(rd16(g + bb)) : 0.f;
        t->dp[r] = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
        if (Q32_L(FMT).has_m) {
            const float m0 = _cvtsh_ss(rd16(g + 2)), m1 = nv > 1 ? _cvtsh_ss(rd16(g + bb + 2)) : 0.f;
            t->mp[r] = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(m0), _mm512_set1_ps(m1));
        }
    }
    /* quants */
    const __m512i m4 = _mm512_set1_epi8(15);
    if (!Q32_L(FMT).nib) {
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
 * variant too, which an AVX-512 CPU without VNNI cannot run) and this is reached only at tiers
 * avx512_vnni and up.  It is also faster: a build with the intrinsic in a separate VNNI target region
 * spilled more around it (0.46 against 0.34 ns per block for the dot products, M = 1, Zen 5). */
static inline __attribute__((always_inline)) void z_dpbusd(__m512i *acc, __m512i w, __m512i x)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(w), "v"(x));
}

/* *p, loaded here and now: GCC would otherwise keep a tile's scales (dp, and Q4_1's mp: 8 zmm)
 * in registers across the next input tile's dot products, whose 16 accumulators then spill to
 * the stack (a store, a reload and a store-forwarding wait per vpdpbusd step: half the int8
 * kernel's speed at M >= 4 on the Xeon).  A volatile asm is neither hoisted nor merged. */
static inline __attribute__((always_inline)) __m512 z_reload(const __m512 *p)
{
    __m512 v;
    __asm__ volatile("vmovaps %1, %0" : "=v"(v) : "m"(*p));
    return v;
}

/* acc[m][r] += this group's contribution (acc[m][r] = it, if first), for MR inputs whose records
 * start at xr (stride ms). */
static inline __attribute__((always_inline))
void z_iblock(const ztile_t *t, const uint8_t *xr, size_t ms, __m512 (*acc)[PQ_NR], int first,
              const int FMT, const int VNNI, const int S, const int MR, const int NR)
{
    const size_t dxo = (size_t)S * 64, auxo = (size_t)(S + 1) * 64;
    __m512i dot[4][PQ_NR];
    if (VNNI) {
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < NR; r++)
                dot[m][r] = Q32_L(FMT).has_m ? _mm512_setzero_si512()
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
    } else if (Q32_L(FMT).nib) {
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
                if (!Q32_L(FMT).has_m)
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
            /* a row's first group starts from +0, as a zeroed acc would (no stores to zero it) */
            const __m512 prev = first ? _mm512_setzero_ps() : acc[m][r];
            __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][r]), _mm512_mul_ps(z_reload(&t->dp[r]), dx),
                                       prev);
            if (Q32_L(FMT).has_m)
                a = _mm512_fmadd_ps(z_reload(&t->mp[r]), _mm512_load_ps((const float *)(xr + m * ms + auxo)), a);
            acc[m][r] = a;
        }
    }
}

static inline __attribute__((always_inline))
void z_igroup(const pq_job_t *j, int n, const int FMT, const int VNNI, const int KIND, const int FULL,
              int b0, int nv, const uint8_t *xg, size_t ms, const int NR, ztile_t *t, __m512 (*acc)[PQ_NR],
              int first)
{
    const int bb = Q32_L(FMT).bb, M = j->M, S = KIND == KIND_T ? 8 : 1;
    const uint8_t *W = j->rp ? j->rp : j->w;  /* the regrouped copy has the same offsets */
    for (int r = 0; r < NR; r++) {
        const uint8_t *g = W + (size_t)(n + r) * j->row_bytes + (size_t)b0 * bb;
        z_prefetch(g, (size_t)nv * bb);
        z_idec(FMT, VNNI, KIND, FULL, g, nv, t, r, j->rp != NULL);
    }
    for (int m0 = 0; m0 < M; m0 += 4) {
        const uint8_t *xr = xg + (size_t)m0 * ms;
        switch (M - m0) {
        case 1: z_iblock(t, xr, ms, acc + m0, first, FMT, VNNI, S, 1, NR); break;
        case 2: z_iblock(t, xr, ms, acc + m0, first, FMT, VNNI, S, 2, NR); break;
        case 3: z_iblock(t, xr, ms, acc + m0, first, FMT, VNNI, S, 3, NR); break;
        default: z_iblock(t, xr, ms, acc + m0, first, FMT, VNNI, S, 4, NR); break;
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
    const plan_t p = plan_of(h->nb, 16);
    size_t goff = 0;
    for (int g = 0; g < p.ng; g++) {
        int kind, b0, nv;
        plan_group(&p, 16, g, &kind, &b0, &nv);
        if (kind == KIND_T && nv == 16)
            z_igroup(j, n, FMT, VNNI, KIND_T, 1, b0, nv, xd + goff, ms, NR, t, acc, g == 0);
        else if (kind == KIND_T)
            z_igroup(j, n, FMT, VNNI, KIND_T, 0, b0, nv, xd + goff, ms, NR, t, acc, g == 0);
        else
            z_igroup(j, n, FMT, VNNI, KIND_P, 0, b0, nv, xd + goff, ms, NR, t, acc, g == 0);
        goff += rec_bytes(16, kind);
    }
    z_emit(j, acc, n, NR);
}

/* Decode the 4-row tile at n, group (kind, b0, nv), into t. */
static inline __attribute__((always_inline))
void z_idec_tile(const pq_job_t *j, int n, const int FMT, const int VNNI, int kind, int b0, int nv, ztile_t *t)
{
    const int bb = Q32_L(FMT).bb;
    const uint8_t *W = j->rp ? j->rp : j->w;  /* the regrouped copy has the same offsets */
    const int rp = j->rp != NULL;
    for (int r = 0; r < PQ_NR; r++) {
        const uint8_t *g = W + (size_t)(n + r) * j->row_bytes + (size_t)b0 * bb;
        z_prefetch(g, (size_t)nv * bb);
        if (kind == KIND_T && nv == 16)
            z_idec(FMT, VNNI, KIND_T, 1, g, nv, t, r, rp);
        else if (kind == KIND_T)
            z_idec(FMT, VNNI, KIND_T, 0, g, nv, t, r, rp);
        else
            z_idec(FMT, VNNI, KIND_P, 0, g, nv, t, r, rp);
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
                case 1: z_iblock(tc, xr, ms, acc + m0, g == 0, FMT, VNNI, 8, 1, PQ_NR); break;
                case 2: z_iblock(tc, xr, ms, acc + m0, g == 0, FMT, VNNI, 8, 2, PQ_NR); break;
                case 3: z_iblock(tc, xr, ms, acc + m0, g == 0, FMT, VNNI, 8, 3, PQ_NR); break;
                default: z_iblock(tc, xr, ms, acc + m0, g == 0, FMT, VNNI, 8, 4, PQ_NR); break;
                }
            } else {
                switch (M - m0) {
                case 1: z_iblock(tc, xr, ms, acc + m0, g == 0, FMT, VNNI, 1, 1, PQ_NR); break;
                case 2: z_iblock(tc, xr, ms, acc + m0, g == 0, FMT, VNNI, 1, 2, PQ_NR); break;
                case 3: z_iblock(tc, xr, ms, acc + m0, g == 0, FMT, VNNI, 1, 3, PQ_NR); break;
                default: z_iblock(tc, xr, ms, acc + m0, g == 0, FMT, VNNI, 1, 4, PQ_NR); break;
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

/* One format's entry points at the AVX-512 tiers: the int8 kernels when prep quantized x (its
 * header says so), else the float path; the dequantizer of the prefill path. */
#define Q32_INSTANCE_AVX512(name, code)                                                   \
    static void z_frows_##name(const pq_job_t *j, int n0, int n1) { z_frows(j, n0, n1, code); } \
    static void z_irows_bw_##name(const pq_job_t *j, int n0, int n1) { z_irows(j, n0, n1, code, 0); } \
    static void z_irows_vnni_##name(const pq_job_t *j, int n0, int n1) { z_irows(j, n0, n1, code, 1); } \
    void q32_rows_avx512_##name(const pq_job_t *j, int n0, int n1)                       \
    {                                                                                    \
        if (((const xa_hdr_t *)j->xa)->path == PATH_INT8)                                \
            z_irows_bw_##name(j, n0, n1);                                                \
        else                                                                             \
            z_frows_##name(j, n0, n1);                                                   \
    }                                                                                    \
    void q32_rows_vnni_##name(const pq_job_t *j, int n0, int n1)                         \
    {                                                                                    \
        if (((const xa_hdr_t *)j->xa)->path == PATH_INT8 && ((const xa_hdr_t *)j->xa)->cl) \
            q32_rows_cl_##name(j, n0, n1); /* cpu_qgemv_cl.c */                          \
        else if (((const xa_hdr_t *)j->xa)->path == PATH_INT8)                           \
            z_irows_vnni_##name(j, n0, n1);                                              \
        else                                                                             \
            z_frows_##name(j, n0, n1);                                                   \
    }                                                                                    \
    void q32_dequant_avx512_##name(const uint8_t *blk, int nblk, float *out)             \
    {                                                                                    \
        z_dec_f32(code, blk, nblk, out);                                                 \
    }

Q32_FORMATS(Q32_INSTANCE_AVX512)

#pragma GCC pop_options
#endif /* PQ_X86 */
