/*
 * neon_driver.c -- checks the aarch64 NEON kernels of kernels/cpu_gemv.c against a scalar
 * double-precision reference.  Cross-compiled with cpu_gemv.c and cpu_runtime.c and run under
 * qemu-aarch64 by tests/kernels/test_cpu_linear.py (test_neon_kernels_under_qemu); it also
 * builds and runs natively, where it checks whichever tier the host CPU runs.
 *
 * The reference multiplies the operands the kernel multiplies: the weights as stored (bf16
 * widened exactly) and x as given (fp32, or bf16 widened: the NEON path keeps activations in
 * fp32; only the x86 AVX512_BF16 tier rounds them to bf16).  Tolerance as in test_cpu_linear.py: fp32 accumulation gives |err| <= K * 2^-24 *
 * sum_k |x_k w_k|, plus 2^-8 |y| when y is rounded to bf16.  Prints one line per failure
 * and a summary; exit status 0 only if every case passed.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_gemv.h"

int pg_linear(const void *w, int wdt, const float *bias, const void *x, int xdt, void *y,
              int M, int N, int K);
int pg_isa(void);
int pg_set_num_threads(int n);
void pg_set_solo_bytes(int b);

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

/* Uniform in [-1, 1): xorshift64*, deterministic across hosts. */
static float frand(void)
{
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    uint64_t r = g_rng * 0x2545f4914f6cdd1dull;
    return (float)((double)(r >> 40) / (double)(1ull << 23) - 1.0);
}

static double val(const void *p, int dt, size_t i)
{
    return dt == 0 ? (double)((const float *)p)[i] : (double)bf16_to_f32(((const uint16_t *)p)[i]);
}

static void *make(int dt, size_t n, float scale)
{
    void *p = malloc(n * (dt == 0 ? 4 : 2) + 16);
    for (size_t i = 0; i < n; i++) {
        float f = frand() * scale;
        if (dt == 0)
            ((float *)p)[i] = f;
        else
            ((uint16_t *)p)[i] = f32_to_bf16(f);
    }
    return p;
}

/* One case: returns the number of outputs out of tolerance (printing the first). */
static int check(int N, int K, int M, int wdt, int xdt, int with_bias)
{
    void *w = make(wdt, (size_t)N * K, 1.f);
    void *x = make(xdt, (size_t)M * K, 2.f);
    float *bias = with_bias ? (float *)make(0, (size_t)N, 1.f) : NULL;
    void *y = malloc((size_t)M * N * 4);
    if (pg_linear(w, wdt, bias, x, xdt, y, M, N, K) != 0) {
        printf("FAIL N=%d K=%d M=%d wdt=%d xdt=%d: pg_linear returned an error\n", N, K, M, wdt, xdt);
        return 1;
    }
    /* On a native x86 run the AVX512_BF16 tier multiplies bf16 weights by x rounded to
     * bf16 (cpu_linear.py's numerics); NEON and the other tiers keep x in fp32. */
    const int xround = wdt == 1 && pg_isa() == ISA_AVX512_BF16;
    int bad = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double ref = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                double xv = val(x, xdt, (size_t)m * K + k);
                if (xround)
                    xv = bf16_to_f32(f32_to_bf16((float)xv));
                double p = val(w, wdt, (size_t)n * K + k) * xv;
                ref += p;
                mag += fabs(p);
            }
            if (bias) {
                ref += bias[n];
                mag += fabs(bias[n]);
            }
            double tol = K * ldexp(1.0, -24) * mag + 1e-30;
            if (xdt == 1)  /* y has x's dtype: rounded to bf16 */
                tol += ldexp(1.0, -8) * fabs(ref);
            double got = val(y, xdt, (size_t)m * N + n);
            if (!(fabs(got - ref) <= tol)) {
                if (!bad)
                    printf("FAIL N=%d K=%d M=%d wdt=%d xdt=%d bias=%d: y[%d,%d] = %.9g, ref %.9g, "
                           "tol %.3g\n", N, K, M, wdt, xdt, with_bias, m, n, got, ref, tol);
                bad++;
            }
        }
    free(w); free(x); free(bias); free(y);
    return bad;
}

/* The pool splits rows over threads; each output is still one thread's fixed-order sum, so
 * results must be bitwise equal to the single-threaded ones. */
static int check_threads(int wdt)
{
    const int N = 4099, K = 577, M = 5;
    void *w = make(wdt, (size_t)N * K, 1.f);
    void *x = make(0, (size_t)M * K, 1.f);
    float *y1 = malloc((size_t)M * N * 4), *y2 = malloc((size_t)M * N * 4);
    pg_set_num_threads(1);
    int rc = pg_linear(w, wdt, NULL, x, 0, y1, M, N, K);
    pg_set_num_threads(2);
    pg_set_solo_bytes(0);
    rc |= pg_linear(w, wdt, NULL, x, 0, y2, M, N, K);
    int bad = rc != 0 || memcmp(y1, y2, (size_t)M * N * 4) != 0;
    if (bad)
        printf("FAIL threads wdt=%d: 1- and 2-thread results differ (rc %d)\n", wdt, rc);
    free(w); free(x); free(y1); free(y2);
    return bad;
}

int main(void)
{
    static const int shapes[][2] = {  /* N, K: odd sizes, K % 8 != 0, tiny, real */
        {577, 33}, {64, 1000}, {3, 17}, {130, 577}, {1, 1}, {33, 8}, {5, 7}, {257, 576},
        {6, 1536},
    };
    static const int Ms[] = {1, 2, 3, 4, 5, 7, 8, 13, 16};
    int cases = 0, failed = 0;
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        for (size_t mi = 0; mi < sizeof(Ms) / sizeof(Ms[0]); mi++)
            for (int wdt = 0; wdt < 2; wdt++)
                for (int xdt = 0; xdt < 2; xdt++) {
                    int with_bias = (int)((s + mi + (size_t)wdt) & 1);
                    failed += check(shapes[s][0], shapes[s][1], Ms[mi], wdt, xdt, with_bias) != 0;
                    cases++;
                }
    for (int wdt = 0; wdt < 2; wdt++) {
        failed += check_threads(wdt);
        cases++;
    }
    printf("neon_driver: isa %d, %d cases, %d failed\n", pg_isa(), cases, failed);
    return failed ? 1 : 0;
}
