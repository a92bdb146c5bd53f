/*
 * cpu_qgemv_cl.c -- the 32-element family's column-lane int8 rows (the VNNI tiers and avx2), on a copy
 * of W in the CL layout (cpu_qgemv.h; built by pq_repack at load): 16 output columns in the
 * lanes of a vector.  Per (input row, column, block) one exact int32 dot product (8 vpdpbusd,
 * each with a dword of x broadcast to the 16 columns), then per block in order
 * acc = fma(float(dot), d_w * d_x, acc) (Q4_1: then acc = fma(m_w, d_x * sum q, acc)).  Each
 * column's sum is one chain over its blocks, whatever the tile: a row's bits do not depend on M
 * (tests/kernels/test_quant_linear.py).
 *
 * Against the block-lane kernel of cpu_qgemv_avx512.c (16 blocks of one (row, column) in a
 * vector's lanes): the same vpdpbusd and epilogue counts, but no horizontal sums (45 ops per 16
 * outputs there), no tail groups (a K of 576 = 16 + 2 blocks pays a second, mostly empty group
 * there), and the weight vectors are shared by every input row from L1 with x broadcast from
 * memory, so up to 4 input rows x 2 column tiles (or 1-2 rows x 2 tiles x 2 blocks) keep up to 8
 * independent chains; where pg_one_stream, up to 8 rows x 1 tile (or 1-2 rows x 2 blocks, Q4's;
 * Q8_0's one block), and 9-16 rows in two passes over that tile.
 * Measured in docs/CPU_PERFORMANCE.md (eleventh and seventeenth sessions).
 *
 * Tier avx2 reads the same copy 8 columns a vector (vpmaddubsw pair sums, the same exact block
 * sums and epilogue: the same bits), or, on a CPU with AVX-VNNI (pg_avx_vnni), vpdpbusd on ymm
 * (fourteenth session).
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "cpu_qgemv.h"

#ifdef PQ_X86

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,f16c")

/* *acc += vpdpbusd(u8 w, the s8 dword at x broadcast to every lane) */
static inline __attribute__((always_inline)) void c_dpbusd(__m512i *acc, __m512i w, const uint8_t *x)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*acc) : "v"(w), "m"(*(const uint32_t *)x));
}

/* How far ahead the VNNI rows prefetch the copy (read in order, a column tile's cells one after
 * the other), for a pass of mr input rows: PQ_PF_BYTES, except where pg_one_stream() (AMD's
 * default): none at 1-2 rows, whose loop issues little else, and PQ_PF_CL_NEAR from 3.  With the
 * copy on huge pages (kernels/huge_pages.py) the hardware prefetchers run on across the stream
 * and a far software prefetch only costs issue slots.  Zen 4 EPYC, SmolLM2's forwards at 256
 * cached tokens, distances alternated in one process (ms; docs/CPU_PERFORMANCE.md, twenty-second
 * session): 1 token 4.51 none / 4.82 2 KiB / 4.86 4 KiB, 4 tokens 5.14 / 5.03 / 5.16, 8 tokens
 * 8.30 / 7.70 / 7.78; 8 KiB was the slowest at 1-6 tokens.  On 4 KiB pages (PRESCIENT_HUGEPAGES=0)
 * none was no worse at 1 token than 8 KiB (5.08 / 5.77 against 5.61 / 5.58, two runs), nor 1-2 KiB
 * at 8 tokens (8.39 at 2 KiB against 8.48; 7.66 at 1 KiB against 8.41). */
#define PQ_PF_CL_NEAR 2048
static int cl_prefetch(int mr, int one_stream)
{
    if (!PQ_PF_BYTES || !one_stream)
        return PQ_PF_BYTES;  /* (-DPQ_PF_BYTES=0 turns every prefetch off) */
    return mr <= 2 ? 0 : PQ_PF_CL_NEAR;
}

static inline __attribute__((always_inline)) void z_prefetch_cl(const uint8_t *p, size_t bytes, int pf)
{
    if (pf)
        for (size_t o = 0; o < bytes; o += 64)
            _mm_prefetch((const char *)p + o + pf, _MM_HINT_T0);
}

/* Step s (elements 4s..4s+3 of each column's block) of a cell, as 16 x 4 unsigned bytes. */
static inline __attribute__((always_inline)) __m512i c_wstep(const int FMT, const uint8_t *cell, int s)
{
    if (!Q32_L(FMT).nib)
        return _mm512_loadu_si512((const void *)(cell + 64 * s));
    const __m512i v = _mm512_loadu_si512((const void *)(cell + 64 * (s & 3)));
    const __m512i m4 = _mm512_set1_epi8(15);
    return s < 4 ? _mm512_and_si512(v, m4) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
}

/* The fp32 step of block b for one (input row, 16 columns). */
static inline __attribute__((always_inline))
__m512 c_epi(const int FMT, __m512i dot, const uint8_t *cell, const uint8_t *xrec, size_t kq, size_t nb16, int b,
             __m512 acc)
{
    const int QV = Q32_L(FMT).nib ? 4 : 8;
    const float *dx = (const float *)(xrec + kq);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cell + 64 * QV)));
    __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(dx[b])), acc);
    if (Q32_L(FMT).has_m) {
        const float *aux = (const float *)(xrec + kq + 4 * nb16);
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cell + 64 * QV + 32)));
        a = _mm512_fmadd_ps(mw, _mm512_set1_ps(aux[b]), a);
    }
    return a;
}

/* The integer start of a block's dot product: Q4_0's -8 sum q, Q8_0's -128 sum q (its weights
 * are stored + 128), Q4_1's 0 (its offset is in the epilogue). */
static inline __attribute__((always_inline))
__m512i c_dot0(const int FMT, const uint8_t *xrec, size_t kq, size_t nb16, int b)
{
    if (Q32_L(FMT).has_m)
        return _mm512_setzero_si512();
    return _mm512_set1_epi32(((const int32_t *)(xrec + kq + 4 * nb16))[b]);
}

/* y[m, n .. n + 15] = acc (+ bias), columns in [n0, n1) only (a chunk's first tile may start
 * below n0 when the pool's chunks are not 16-aligned; its columns there are another chunk's). */
static inline __attribute__((always_inline)) void c_store(const pq_job_t *j, int m, int n, int n0, int n1, __m512 v)
{
    const unsigned hi = n1 - n >= 16 ? 0xFFFFu : (1u << (n1 - n)) - 1, lo = n0 > n ? (1u << (n0 - n)) - 1 : 0u;
    const __mmask16 k = (__mmask16)(hi & ~lo);
    if (j->bias)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, j->bias + n));
    const size_t off = (size_t)m * j->N + n;
    if (j->ydt == DT_F32)
        _mm512_mask_storeu_ps((float *)j->y + off, k, v);
    else
        _mm256_mask_storeu_epi16((uint16_t *)j->y + off, k, bf16x16_rne(v));
}

/* ---- vpdpbusd: MR input rows x NC column tiles, NBU blocks at a time ---------------------- */

static inline __attribute__((always_inline))
void c_vblocks(const pq_job_t *j, const int FMT, const int MR, const int NC, const int NBU, const uint8_t *cell,
               size_t tstride, const uint8_t *xr, size_t ms, int b, __m512 (*acc)[2])
{
    const size_t cb = (size_t)16 * Q32_L(FMT).bb, kq = cl_kq(j->K), nb16 = cl_nb16(j->K / QK);
    __m512i dot[2][8][2];  /* [block][input][column tile] */
    for (int u = 0; u < NBU; u++)
        for (int m = 0; m < MR; m++)
            for (int c = 0; c < NC; c++)
                dot[u][m][c] = c_dot0(FMT, xr + m * ms, kq, nb16, b + u);
    for (int s = 0; s < 8; s++) {
        __m512i w[2][2];
        for (int u = 0; u < NBU; u++)
            for (int c = 0; c < NC; c++)
                w[u][c] = c_wstep(FMT, cell + c * tstride + u * cb, s);
        for (int u = 0; u < NBU; u++)
            for (int m = 0; m < MR; m++) {
                const uint8_t *xp = xr + m * ms + (size_t)QK * (b + u) + 4 * s;
                for (int c = 0; c < NC; c++)
                    c_dpbusd(&dot[u][m][c], w[u][c], xp);
            }
    }
    for (int u = 0; u < NBU; u++)
        for (int m = 0; m < MR; m++)
            for (int c = 0; c < NC; c++)
                acc[m][c] = c_epi(FMT, dot[u][m][c], cell + c * tstride + u * cb, xr + m * ms, kq, nb16, b + u,
                                  acc[m][c]);
}

static inline __attribute__((always_inline))
void c_vtile(const pq_job_t *j, const int FMT, const int MR, const int NC, int m0, int t, int n0, int n1)
{
    const xa_hdr_t *h = (const xa_hdr_t *)j->xa;
    const int nb = j->K / QK;
    const size_t cb = (size_t)16 * Q32_L(FMT).bb, tstride = (size_t)nb * cb, ms = h->mstride;
    const uint8_t *cell0 = j->cl + (size_t)t * tstride, *xr = XA_DATA(h) + (size_t)m0 * ms;
    __m512 acc[8][2];
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NC; c++)
            acc[m][c] = _mm512_setzero_ps();
    int b = 0;
    const int one = pg_one_stream(), pf = cl_prefetch(MR, one);
    /* Two blocks' dot products at once: 2 MR NC independent vpdpbusd chains.  Not for Q8_0 where
     * pg_one_stream(): its two cells a pass (1 KiB, eight loads a step) read slower than one on
     * the Zen 4 EPYC, the LM head (49152 x 576) at M = 1 1259 -> 1001 us, 1536 x 576 43.2 -> 38.5
     * us, a decode step 4.17 -> 3.96 ms (twenty-second session); Q4_1 the same either way. */
    if (MR <= 2 && (Q32_L(FMT).nib || !one))
        for (; b + 2 <= nb; b += 2) {
            for (int c = 0; c < NC; c++)
                z_prefetch_cl(cell0 + c * tstride + (size_t)b * cb, 2 * cb, pf);
            c_vblocks(j, FMT, MR, NC, 2, cell0 + (size_t)b * cb, tstride, xr, ms, b, acc);
        }
    for (; b < nb; b++) {
        for (int c = 0; c < NC; c++)
            z_prefetch_cl(cell0 + c * tstride + (size_t)b * cb, cb, pf);
        c_vblocks(j, FMT, MR, NC, 1, cell0 + (size_t)b * cb, tstride, xr, ms, b, acc);
    }
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NC; c++)
            if (16 * (t + c) < n1)
                c_store(j, m0 + m, 16 * (t + c), n0, n1, acc[m][c]);
}

/* c_vtile with the pass's shape as compile-time constants: mr input rows (<= 8 with one tile, <= 4
 * with two) x nc column tiles. */
static inline __attribute__((always_inline))
void c_vpass(const pq_job_t *j, const int FMT, int mr, int nc, int m0, int t, int n0, int n1)
{
#define CL_PASS(MR, NC)                                                                     \
    case (MR) * 2 + (NC) - 1: c_vtile(j, FMT, MR, NC, m0, t, n0, n1); break;
    switch (mr * 2 + nc - 1) {
    CL_PASS(1, 1) CL_PASS(1, 2) CL_PASS(2, 1) CL_PASS(2, 2) CL_PASS(3, 1) CL_PASS(3, 2)
    CL_PASS(4, 1) CL_PASS(4, 2) CL_PASS(5, 1) CL_PASS(6, 1) CL_PASS(7, 1) CL_PASS(8, 1)
    default: __builtin_trap();  /* no caller asks for another shape */
    }
#undef CL_PASS
}

/* Column tiles 2 at a time (at M = 1 four, two blocks each, read K = 1536 rows 12% slower
 * than two: four weight streams; Xeon, L3-resident weights), each pair for every input row
 * while its cells sit in L1.  Or, where pg_one_stream() (by default but on Intel), one tile
 * at a time for up to 8 input rows: one weight stream.  On the Zen 4 EPYC that read the copy
 * 1.3-1.4x faster at M = 1 (two tiles' streams from DRAM ran at 17 GB/s, one at 23-25) and
 * 1.05-1.25x at M = 2-8 (docs/CPU_PERFORMANCE.md, seventeenth session).  From 9 to 16 rows
 * (larger verify trees) the same, in two passes over the tile while it sits in L1 (balanced: 9 =
 * 4 + 5): a fused forward 1.08-1.18x faster than two tiles of 4-row passes (twenty-fourth
 * session; from 20 rows no gain, so prefill's chunks keep two tiles).  Each column's chain
 * is the same either way, so are the bits. */
static inline __attribute__((always_inline)) void c_vrows(const pq_job_t *j, int n0, int n1, const int FMT)
{
    const int t0 = n0 / 16, t1 = (n1 + 15) / 16;
    if (j->M <= 16 && pg_one_stream()) {
        const int passes = (j->M + 7) / 8;
        for (int t = t0; t < t1; t++)
            for (int p = 0, m0 = 0; p < passes; p++) {
                const int mr = (j->M - m0) / (passes - p);
                c_vpass(j, FMT, mr, 1, m0, t, n0, n1);
                m0 += mr;
            }
        return;
    }
    for (int t = t0; t < t1; t += 2)
        for (int m0 = 0; m0 < j->M; m0 += 4)
            c_vpass(j, FMT, j->M - m0 < 4 ? j->M - m0 : 4, t + 1 < t1 ? 2 : 1, m0, t, n0, n1);
}

#pragma GCC pop_options

/* ---- AVX2: the same copy, the same integer sums and epilogue, 8 columns a vector ---------- *
 *
 * Without vpdpbusd a dword step is vpmaddubsw (u8 w x s8 x, adjacent pairs summed into int16)
 * and vpmaddwd by ones (the pairs into one int32 per column).  Q4's nibbles (<= 15) times
 * |x| <= 127 give pairs of at most 3810, so a block's 8 steps add up in int16 (<= 30480) and
 * widen once per block; Q8_0's copy holds q + 128, which vpmaddubsw would saturate, so its
 * bytes are made signed again (^ 0x80) and multiplied as |q| x sign(x, q) (pairs <= 32512),
 * widened every step, from an aux of 0 (prep's C is 128 only at the AVX-512 VNNI tiers).  Each
 * column's block sum is the same exact int32 as the VNNI rows', and the epilogue the same fp32
 * ops in the same order: tier avx2 gives tiers avx512_vnni's and avx512_bf16's bits on this copy
 * (tested); with AVX-VNNI its vpdpbusd takes the same operands (Q8_0: |q| and sign(x, q)). */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* Step s of half h (columns 8h .. 8h + 7) of a cell: 8 x 4 bytes (Q4: the nibbles; Q8_0: q, signed). */
static inline __attribute__((always_inline)) __m256i y_wstep(const int FMT, const uint8_t *cell, int h, int s)
{
    if (!Q32_L(FMT).nib)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(cell + 64 * s + 32 * h)),
                                _mm256_set1_epi8((char)0x80));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(cell + 64 * (s & 3) + 32 * h));
    const __m256i m4 = _mm256_set1_epi8(15);
    return s < 4 ? _mm256_and_si256(v, m4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

/* acc + vpdpbusd(u8 w, s8 x), VEX-encoded (AVX-VNNI), in inline assembly: no target attribute
 * (which would let the compiler use AVX-VNNI in the plain AVX2 instances too); its callers run
 * only where pg_avx_vnni() says the CPU has it. */
static inline __attribute__((always_inline)) __m256i y_dpbusd(__m256i acc, __m256i w, __m256i x)
{
#if PQ_AVXVNNI
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
#else
    (void)w, (void)x;
    __builtin_trap();
#endif
    return acc;
}

static inline __attribute__((always_inline)) __m256i y_bcast(const uint8_t *x)
{
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* One block for MR input rows x NC halves (from half h0): dot products, then the epilogue.
 * VNNI: the dword steps as vpdpbusd into int32, each sum split over SP chains (even / odd steps)
 * so that its 5-cycle latency does not bind, added at the block's end (exact, as the int16 path's
 * widening is). */
static inline __attribute__((always_inline))
void y_cblock(const int FMT, const int VNNI, const int MR, const int NC, int h0, const uint8_t *cell,
              const uint8_t *xr, size_t ms, int b, size_t kq, size_t nb16, __m256 (*acc)[2])
{
    const int nib = Q32_L(FMT).nib, QV = nib ? 4 : 8;
    /* 16 ymm: the MR x NC x SP sums, MR x NC accs, w / |w|, x and a sign temporary: at 2 x 2
     * a second chain would spill (Q8_0: ~18 live); 4 x 1 with two chains uses all 16 */
    const int SP = VNNI && !(MR == 2 && NC == 2) ? 2 : 1;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i d[4][2][2];
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NC; c++)
            for (int p = 0; p < SP; p++)
                d[m][c][p] = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
        __m256i w[2], a[2];
        for (int c = 0; c < NC; c++) {
            w[c] = y_wstep(FMT, cell, h0 + c, s);
            if (!nib)
                a[c] = _mm256_abs_epi8(w[c]);
        }
        for (int m = 0; m < MR; m++) {
            const __m256i xv = y_bcast(xr + m * ms + (size_t)QK * b + 4 * s);
            for (int c = 0; c < NC; c++) {
                __m256i *dp = &d[m][c][s % SP];
                if (VNNI)
                    *dp = nib ? y_dpbusd(*dp, w[c], xv) : y_dpbusd(*dp, a[c], _mm256_sign_epi8(xv, w[c]));
                else if (nib)
                    *dp = _mm256_add_epi16(*dp, _mm256_maddubs_epi16(w[c], xv));
                else
                    *dp = _mm256_add_epi32(*dp, _mm256_madd_epi16(
                        _mm256_maddubs_epi16(a[c], _mm256_sign_epi8(xv, w[c])), ones));
            }
        }
    }
    __m256 dw[2], mw[2];  /* the cell's scales, widened once for every input row */
    for (int c = 0; c < NC; c++) {
        dw[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + 64 * QV + 16 * (h0 + c))));
        if (Q32_L(FMT).has_m)
            mw[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + 64 * QV + 32 + 16 * (h0 + c))));
    }
    for (int m = 0; m < MR; m++) {
        const uint8_t *xm = xr + m * ms;
        const float dx = ((const float *)(xm + kq))[b];
        for (int c = 0; c < NC; c++) {
            __m256i dot = SP == 2 ? _mm256_add_epi32(d[m][c][0], d[m][c][1])
                        : (nib && !VNNI) ? _mm256_madd_epi16(d[m][c][0], ones) : d[m][c][0];
            if (!Q32_L(FMT).has_m)
                dot = _mm256_add_epi32(dot, _mm256_set1_epi32(((const int32_t *)(xm + kq + 4 * nb16))[b]));
            __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw[c], _mm256_set1_ps(dx)), acc[m][c]);
            if (Q32_L(FMT).has_m)
                v = _mm256_fmadd_ps(mw[c], _mm256_set1_ps(((const float *)(xm + kq + 4 * nb16))[b]), v);
            acc[m][c] = v;
        }
    }
}

/* y[m, n .. n + 7] = v (+ bias), columns in [n0, n1) only (as c_store). */
static inline __attribute__((always_inline)) void y_cstore(const pq_job_t *j, int m, int n, int n0, int n1, __m256 v)
{
    if (n >= n0 && n + 8 <= n1) {
        if (j->bias)
            v = _mm256_add_ps(v, _mm256_loadu_ps(j->bias + n));
        const size_t off = (size_t)m * j->N + n;
        if (j->ydt == DT_F32) {
            _mm256_storeu_ps((float *)j->y + off, v);
        } else {
            _mm_storel_epi64((__m128i *)((uint16_t *)j->y + off), bf16x4_rne(_mm256_castps256_ps128(v)));
            _mm_storel_epi64((__m128i *)((uint16_t *)j->y + off + 4), bf16x4_rne(_mm256_extractf128_ps(v, 1)));
        }
        return;
    }
    float t[8];
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < 8; i++)
        if (n + i >= n0 && n + i < n1)
            store1(j, m, n + i, t[i]);
}

static inline __attribute__((always_inline))
void y_ctile(const pq_job_t *j, const int FMT, const int VNNI, const int MR, const int NC, int m0, int t, int h0,
             int n0, int n1)
{
    const xa_hdr_t *h = (const xa_hdr_t *)j->xa;
    const int nb = j->K / QK;
    const size_t cb = (size_t)16 * Q32_L(FMT).bb, kq = cl_kq(j->K), nb16 = cl_nb16(nb), ms = h->mstride;
    const uint8_t *cell = j->cl + (size_t)t * nb * cb, *xr = XA_DATA(h) + (size_t)m0 * ms;
    __m256 acc[4][2];
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NC; c++)
            acc[m][c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, cell += cb) {
        if (PQ_PF_BYTES)
            for (size_t o = 0; o < cb; o += 64)
                _mm_prefetch((const char *)cell + o + PQ_PF_BYTES, _MM_HINT_T0);
        y_cblock(FMT, VNNI, MR, NC, h0, cell, xr, ms, b, kq, nb16, acc);
    }
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NC; c++)
            if (16 * t + 8 * (h0 + c) < n1)
                y_cstore(j, m0 + m, 16 * t + 8 * (h0 + c), n0, n1, acc[m][c]);
}

/* Per 16-column tile: up to 2 inputs take both halves at once (one pass over the cells);
 * more take a half at a time, 4 inputs a pass (16 ymm: 2 x MR x NC accumulators). */
static inline __attribute__((always_inline)) void y_crows(const pq_job_t *j, int n0, int n1, const int FMT,
                                                          const int VNNI)
{
    const int t0 = n0 / 16, t1 = (n1 + 15) / 16;
    for (int t = t0; t < t1; t++) {
        if (j->M <= 2) {
            if (j->M == 1)
                y_ctile(j, FMT, VNNI, 1, 2, 0, t, 0, n0, n1);
            else
                y_ctile(j, FMT, VNNI, 2, 2, 0, t, 0, n0, n1);
            continue;
        }
        for (int hh = 0; hh < 2; hh++) {
            const int c0 = 16 * t + 8 * hh;
            if (c0 >= n1 || c0 + 8 <= n0)
                continue;
            for (int m0 = 0; m0 < j->M; m0 += 4)
                switch (j->M - m0 < 4 ? j->M - m0 : 4) {
                case 1: y_ctile(j, FMT, VNNI, 1, 1, m0, t, hh, n0, n1); break;
                case 2: y_ctile(j, FMT, VNNI, 2, 1, m0, t, hh, n0, n1); break;
                case 3: y_ctile(j, FMT, VNNI, 3, 1, m0, t, hh, n0, n1); break;
                default: y_ctile(j, FMT, VNNI, 4, 1, m0, t, hh, n0, n1); break;
                }
        }
    }
}

#pragma GCC pop_options

/* ---- entry points (from q32_rows_vnni_*, cpu_qgemv_avx512.c; q32_rows_avx2_*, cpu_qgemv_avx2.c) */

#define Q32_INSTANCE_CL(name, code)                                                         \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,f16c")))            \
    void q32_rows_cl_##name(const pq_job_t *j, int n0, int n1) { c_vrows(j, n0, n1, code); } \
    __attribute__((target("avx2,fma,f16c")))                                                \
    void q32_rows_cl_avx2_##name(const pq_job_t *j, int n0, int n1)                         \
    {                                                                                       \
        if (PQ_AVXVNNI && pg_avx_vnni())                                                    \
            y_crows(j, n0, n1, code, 1);                                                    \
        else                                                                                \
            y_crows(j, n0, n1, code, 0);                                                    \
    }

Q32_FORMATS(Q32_INSTANCE_CL)

#endif
