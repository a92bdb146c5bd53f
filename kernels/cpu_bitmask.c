/*
 * cpu_bitmask.c -- a grammar's token bitmask applied to fp32 logits in place: every token the
 * grammar disallows gets -inf, the others keep their logit (kernels/ops.apply_token_bitmask's CPU
 * kernel; the reference is kernels/reference.apply_token_bitmask, the Triton kernel the GPU's).
 *
 *   for each selected row i (logits row indices[i], or i):
 *       for t < vocab = min(logits columns, 32 * words):
 *           if bit t % 32 of bitmask[i][t / 32] is clear: logits[row][t] = -inf
 *
 * xgrammar's layout (bit set = allowed); columns past the bitmask are left as they are.  The
 * reference's torch ops took ~80 us a 49152-token row hot on the 2-core Zen 4, several times that
 * right after a forward, about half a millisecond of a grammar+n-gram step's host work; this
 * writes only the banned lanes' -inf: a masked store per 16 logits (AVX-512), a blend per 8
 * (AVX2), a select per logit (portable; the compiler vectorizes it).  A banned NaN becomes -inf
 * as in the Triton kernel (the reference's min keeps it NaN).
 *
 * Layering: uses only cpu_runtime.c (pg_isa); called from Python (kernels/ops.py), no other C
 * file calls it, so it has no header.  Runs on the caller (a row is a few microseconds).
 * tests/kernels/test_cpu_bitmask.py checks every tier the CPU runs against the reference.
 */
#include <stdint.h>
#include <stddef.h>
#include <math.h>

#include "cpu_runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PB_X86 1
#endif

/* Columns [c0, c1) of one row (c0 a multiple of 32); w the row's bitmask words. */
static void row_portable(float *x, const uint32_t *w, int64_t c0, int64_t c1)
{
    for (int64_t t = c0; t < c1; t++)
        x[t] = (w[t >> 5] >> (t & 31)) & 1u ? x[t] : -INFINITY;
}

#ifdef PB_X86
#pragma GCC push_options
#pragma GCC target("avx2")
/* Whole words: each 8 bits -> a lane mask (bit l of the byte -> lane l), the banned lanes
 * blended to -inf.  Returns the first column it did not do. */
static int64_t row_avx2(float *x, const uint32_t *w, int64_t vocab)
{
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 32 <= vocab; t += 32) {
        const uint32_t word = w[t >> 5];
        if (word == 0xffffffffu)
            continue;
        for (int q = 0; q < 4; q++) {
            const __m256i bits = _mm256_and_si256(_mm256_set1_epi32((int)((word >> (8 * q)) & 0xffu)), sel);
            const __m256 banned = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, _mm256_setzero_si256()));
            _mm256_storeu_ps(x + t + 8 * q, _mm256_blendv_ps(_mm256_loadu_ps(x + t + 8 * q), ninf, banned));
        }
    }
    return t;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
/* Every column: the banned lanes of each 16 stored as -inf, the tail's lanes past vocab masked off. */
static void row_avx512(float *x, const uint32_t *w, int64_t vocab)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < vocab; t += 16) {
        __mmask16 banned = (__mmask16)~(w[t >> 5] >> (t & 16));
        if (vocab - t < 16)
            banned &= (__mmask16)((1u << (vocab - t)) - 1u);
        _mm512_mask_storeu_ps(x + t, banned, ninf);
    }
}
#pragma GCC pop_options
#endif

/* logits [rows, ld] fp32 (row r at logits + r * ld, cols valid columns); bitmask [nsel, words]
 * int32; indices NULL (bitmask row i -> logits row i) or [nsel] int64.  0 on success, -1 for a
 * bad shape or an index outside [0, rows) (nothing written then). */
int px_apply_bitmask(float *logits, int64_t rows, int64_t cols, int64_t ld, const int32_t *bitmask,
                     int64_t nsel, int64_t words, const int64_t *indices)
{
    if (rows < 0 || cols < 0 || ld < cols || nsel < 0 || words < 0 || (!indices && nsel > rows))
        return -1;
    for (int64_t i = 0; indices && i < nsel; i++)
        if (indices[i] < 0 || indices[i] >= rows)
            return -1;
    const int64_t vocab = cols < 32 * words ? cols : 32 * words;
    for (int64_t i = 0; i < nsel; i++) {
        float *x = logits + (indices ? indices[i] : i) * ld;
        const uint32_t *w = (const uint32_t *)bitmask + i * words;
#ifdef PB_X86
        if (pg_isa() >= ISA_AVX512) {
            row_avx512(x, w, vocab);
            continue;
        }
        if (pg_isa() >= ISA_AVX2) {
            row_portable(x, w, row_avx2(x, w, vocab), vocab);
            continue;
        }
#endif
        row_portable(x, w, 0, vocab);
    }
    return 0;
}
