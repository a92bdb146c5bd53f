/*
 * cpu_argmax.c -- the index of each fp32 row's maximum: greedy decoding's token and the greedy
 * verify's target token at every draft-tree node.
 *
 * Role: torch.argmax(x, -1) on [rows, n] fp32 (the logits), with its answer: the first index
 * of the largest value, and where a row holds a NaN, the first NaN's index (NaN counts as the
 * largest).  torch's CPU kernel took ~57 us a row of 49152 on a 2-core Zen 3, 1 ms for a
 * 16-node tree (its reduction is scalar); the reference is torch itself
 * (tests/kernels/test_cpu_argmax.py checks every tier the CPU runs against it).
 *
 * Layering: uses only cpu_runtime.c (pg_isa); called from Python (kernels/cpu_argmax.py), no
 * other C file calls it, so it has no header.  Threads: runs on the caller (a row is ~10 us).
 *
 *   for each row: best = x[0], at = 0
 *                 for i in 1 .. n-1: if x[i] > best: best = x[i], at = i   (first maximum)
 *                 if any x[i] is NaN: at = the first such i
 *
 * AVX2: 32 lanes each keep the first maximum of their own elements (a strict >), then the
 * lanes' largest value wins and among lanes holding it the smallest index: the row's first
 * maximum.  NaNs are only detected in the loop (an unordered compare); a row with one takes
 * the scalar pass.  -0.0 and 0.0 compare equal in both, as in torch.
 */
#include <stdint.h>
#include <stddef.h>
#include <limits.h>

#include "cpu_runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PX_X86 1
#endif

static int64_t argmax_scalar(const float *x, int64_t n)
{
    int64_t at = 0;
    float best = x[0];
    for (int64_t i = 0; i < n; i++) {
        if (x[i] != x[i])
            return i;  /* the first NaN */
        if (x[i] > best) {
            best = x[i];
            at = i;
        }
    }
    return at;
}

#ifdef PX_X86
#pragma GCC push_options
#pragma GCC target("avx2")
/* n >= 32: four sets of eight lanes (a compare-and-blend chain per set: one set waited on its
 * 4-cycle chain every 8 elements) */
static int64_t argmax_avx2(const float *x, int64_t n)
{
    __m256 best[4], nan = _mm256_setzero_ps();
    __m256i at[4], idx[4];
    const __m256i step = _mm256_set1_epi32(32);
    for (int s = 0; s < 4; s++) {
        best[s] = _mm256_loadu_ps(x + 8 * s);
        at[s] = idx[s] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * s));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(best[s], best[s], _CMP_UNORD_Q));
    }
    int64_t i = 32;
    for (; i + 32 <= n; i += 32)
        for (int s = 0; s < 4; s++) {
            idx[s] = _mm256_add_epi32(idx[s], step);
            const __m256 v = _mm256_loadu_ps(x + i + 8 * s);
            const __m256 gt = _mm256_cmp_ps(v, best[s], _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best[s] = _mm256_blendv_ps(best[s], v, gt);
            at[s] = _mm256_blendv_epi8(at[s], idx[s], _mm256_castps_si256(gt));
        }
    if (_mm256_movemask_ps(nan))
        return argmax_scalar(x, n);
    /* each lane holds the first maximum of its elements: the largest value, then the smallest
     * index among the lanes that hold it, is the first maximum of them all */
    float bv[32];
    int32_t bi[32];
    for (int s = 0; s < 4; s++) {
        _mm256_storeu_ps(bv + 8 * s, best[s]);
        _mm256_storeu_si256((__m256i *)(bi + 8 * s), at[s]);
    }
    float top = bv[0];
    int64_t where = bi[0];
    for (int l = 1; l < 32; l++)
        if (bv[l] > top || (bv[l] == top && bi[l] < where)) {
            top = bv[l];
            where = bi[l];
        }
    for (; i < n; i++) {  /* the tail, after every lane's elements (larger indices) */
        if (x[i] != x[i])
            return argmax_scalar(x, n);
        if (x[i] > top) {
            top = x[i];
            where = i;
        }
    }
    return where;
}
#pragma GCC pop_options
#endif

/* out[r] = argmax of row r of x [rows, n] (row stride `ld` floats); 0 on success, -1 for a bad
 * shape (n < 1, or n past int32: the lanes' indices). */
int px_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out)
{
    if (n < 1 || n > INT32_MAX || ld < n || rows < 0)
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
#ifdef PX_X86
        if (pg_isa() >= ISA_AVX2 && n >= 32) {
            out[r] = argmax_avx2(row, n);
            continue;
        }
#endif
        out[r] = argmax_scalar(row, n);
    }
    return 0;
}
