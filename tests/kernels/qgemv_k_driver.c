/*
 * qgemv_k_driver.c -- the K-quant formats' int8 kernels (Q4_K, Q5_K, Q6_K; kernels/cpu_qgemv_k.c)
 * against a model of what they compute, on any ISA that has them:
 *
 *   x quantized per 256 values: dx = amax / 127, q = clamp(nearest-even(x * (127 / amax)), +-127),
 *     bs = the sums of each 16 q                                   -- checked exactly (prep)
 *   y[m, n] = sum_k w_k * q_k * dx_k  (w the exactly dequantized weight)
 *                                    -- within fp32 rounding of the exact sum (double)
 *
 * The activation rounding (dx / 2 a value) is far outside that tolerance, and so is any wrong
 * code, scale or min.  Every row of an M-row call must equal the same row called alone, bit for
 * bit (batch invariance), on the calling thread and over the pool; a bf16 y is the fp32 y rounded;
 * the bias adds in fp32; pg_linear_w, the path a model's linears take (through the format table),
 * gives the entry's bits.  Where the int8 kernels must not run (aarch64 with SDOT switched off,
 * x86's portable tier) the fp32 path must: y within fp32 rounding of the exact sum over the
 * unquantized x.  Built natively on x86 by tests/kernels/test_qgemv_k_bits.py it checks every
 * SIMD tier the host runs; cross-compiled and run under qemu-aarch64, the SDOT kernels.
 * Prints one line per failure, then "qgemv_k_driver: <which>, N cases, F failed".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "driver_common.h"
#include "cpu_dispatch.h"
#include "cpu_formats.h"

int pg_set_num_threads(int n);
int pg_set_isa_cap(int cap);
int pg_isa(void);
int pqk_linear_entry(int wdt, const uint8_t *w, const float *bias, int N, int K, const float *x, int M, void *y,
                     int ydt, int flags);
int pqk_prep_entry(int wdt, const float *x, int M, int K, int8_t *q, float *d, int16_t *bs);
int pqk_int8_activations(int isa);

#if defined(__GNUC__) && !defined(__clang__)
#define MODEL_FN __attribute__((optimize("no-tree-vectorize")))
#else
#define MODEL_FN
#endif

#define QK 256

static double from_half(uint16_t h)
{
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double v = e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return (h & 0x8000) ? -v : v;
}

enum { F_Q4K, F_Q5K, F_Q6K };
static const int g_wdt[3] = {DT_Q4_K, DT_Q5_K, DT_Q6_K};
static const int g_bb[3] = {144, 176, 210};
static const char *g_name[3] = {"q4_k", "q5_k", "q6_k"};

/* The 256 weights of a block, exactly (in double), from ggml's layout (cpu_formats.h) written
 * out value by value. */
MODEL_FN static void dequant(int f, const uint8_t *blk, double *w)
{
    if (f == F_Q6K) {
        const double d = from_half((uint16_t)(blk[208] | blk[209] << 8));
        for (int i = 0; i < QK; i++) {
            const int h = i / 128, g = (i % 128) / 32, l = i % 32;
            const int lb = blk[64 * h + 32 * (g & 1) + l];
            const int lo = g < 2 ? lb & 15 : lb >> 4;
            const int hi = (blk[128 + 32 * h + l] >> (2 * g)) & 3;
            w[i] = d * (double)(int8_t)blk[192 + i / 16] * (double)((lo | hi << 4) - 32);
        }
        return;
    }
    const double d = from_half((uint16_t)(blk[0] | blk[1] << 8)), dmin = from_half((uint16_t)(blk[2] | blk[3] << 8));
    const uint8_t *s = blk + 4, *qh = blk + 16, *qs = blk + (f == F_Q5K ? 48 : 16);
    for (int i = 0; i < QK; i++) {
        const int j = i / 32, l = i % 32;
        /* 6-bit scale and min of sub-block j (ggml's get_scale_min_k4) */
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        int q = (j & 1) ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
        if (f == F_Q5K)
            q |= ((qh[l] >> j) & 1) << 4;
        w[i] = d * sc * q - dmin * mn;
    }
}

/* |d sc q| + |dmin m| of every weight: what the kernel's fp32 terms can reach before they cancel */
MODEL_FN static void magnitude(int f, const uint8_t *blk, const double *w, double *a)
{
    if (f == F_Q6K) {
        for (int i = 0; i < QK; i++)
            a[i] = fabs(w[i]);
        return;
    }
    const double dmin = fabs(from_half((uint16_t)(blk[2] | blk[3] << 8)));
    for (int i = 0; i < QK; i++)
        a[i] = fabs(w[i]) + 2 * dmin * 63;
}

/* The int8 activations of one row: q, dx per 256, bs per 16. */
MODEL_FN static void quant_x(const float *x, int K, int8_t *q, float *dx, int16_t *bs)
{
    for (int b = 0; b < K / QK; b++) {
        float amax = 0.f;
        for (int i = 0; i < QK; i++)
            amax = fmaxf(amax, fabsf(x[QK * b + i]));
        const float is = amax > 0.f ? 127.f / amax : 0.f;
        dx[b] = amax / 127.f;
        for (int i = 0; i < QK; i++) {
            const float p = x[QK * b + i] * is;
            long v = lrintf(p);
            q[QK * b + i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int i = 0; i < 16; i++)
                t += q[QK * b + 16 * s + i];
            bs[16 * b + s] = (int16_t)t;
        }
    }
}

static int g_cases, g_failed;

static void fail(const char *what, int f, int N, int K, int M, int m, int n, double got, double want, double tol)
{
    if (g_failed < 40)
        printf("FAIL %s %s N=%d K=%d M=%d m=%d n=%d: got %.9g want %.9g tol %.3g\n", what, g_name[f], N, K, M, m, n, got,
               want, tol);
    g_failed++;
}

/* One (format, shape, M) case at the current tier; int8 says which path must run. */
static void check(int f, int N, int K, int M, int int8)
{
    const int nb = K / QK;
    const size_t rowb = (size_t)nb * g_bb[f];
    uint8_t *w = malloc((size_t)N * rowb);
    float *x = malloc(sizeof(float) * M * K), *bias = malloc(sizeof(float) * N);
    float *y = malloc(sizeof(float) * M * N), *yp = malloc(sizeof(float) * M * N), *yb = malloc(sizeof(float) * M * N);
    float *y1 = malloc(sizeof(float) * N), *yw = malloc(sizeof(float) * M * N);
    uint16_t *yh = malloc(2 * (size_t)M * N);
    double *wd = malloc(sizeof(double) * QK), *wa = malloc(sizeof(double) * QK);
    int8_t *q = malloc((size_t)M * K), *pq = malloc((size_t)M * K);
    float *dx = malloc(sizeof(float) * M * nb), *pd = malloc(sizeof(float) * M * nb);
    int16_t *bs = malloc(2 * (size_t)M * nb * 16), *pbs = malloc(2 * (size_t)M * nb * 16);
    for (size_t i = 0; i < (size_t)N * rowb; i++)
        w[i] = (uint8_t)rnd();
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {  /* sane fp16 scales: d, dmin (Q4_K/Q5_K) or d (Q6_K) */
            uint8_t *blk = w + n * rowb + (size_t)b * g_bb[f];
            const uint16_t d = to_half(0.001f + 0.01f * (frand() + 1.f)), dm = to_half(0.002f * (frand() + 1.f));
            if (f == F_Q6K) {
                memcpy(blk + 208, &d, 2);
            } else {
                memcpy(blk, &d, 2);
                memcpy(blk + 2, &dm, 2);
            }
        }
    for (int i = 0; i < M * K; i++)  /* a few large channels coarsen their block, as real x does */
        x[i] = frand() * (rnd() % 61 == 0 ? 20.f : 1.f);
    for (int n = 0; n < N; n++)
        bias[n] = frand();
    for (int m = 0; m < M; m++)
        quant_x(x + (size_t)m * K, K, q + (size_t)m * K, dx + (size_t)m * nb, bs + (size_t)m * nb * 16);

    const pg_weight_t desc = {w, NULL, g_wdt[f], N, K, NULL, 0};
    g_cases++;
    const int prc = pqk_prep_entry(g_wdt[f], x, M, K, pq, pd, pbs);
    if (int8 != (prc == 0) || int8 != pqk_int8_activations(pg_isa())) {
        printf("FAIL prep %s: returned %d, int8 path expected %d\n", g_name[f], prc, int8);
        g_failed++;
    }
    if (int8 && prc == 0 && (memcmp(q, pq, (size_t)M * K) || memcmp(dx, pd, sizeof(float) * M * nb) ||
                             memcmp(bs, pbs, 2 * (size_t)M * nb * 16))) {
        printf("FAIL prep %s K=%d M=%d: the int8 activations differ from the model\n", g_name[f], K, M);
        g_failed++;
    }
    if (pqk_linear_entry(g_wdt[f], w, NULL, N, K, x, M, y, DT_F32, 0) ||
        pqk_linear_entry(g_wdt[f], w, NULL, N, K, x, M, yp, DT_F32, 2) ||
        pqk_linear_entry(g_wdt[f], w, bias, N, K, x, M, yb, DT_F32, 0) ||
        pqk_linear_entry(g_wdt[f], w, NULL, N, K, x, M, yh, DT_BF16, 2) ||
        pg_linear_w(&desc, x, yw, M, DT_F32)) {
        printf("FAIL %s: pqk_linear_entry refused N=%d K=%d M=%d\n", g_name[f], N, K, M);
        g_failed++;
        goto out;
    }
    for (int n = 0; n < N; n++)
        for (int m = 0; m < M; m++) {
            double want = 0, bound = 0;
            for (int b = 0; b < nb; b++) {
                dequant(f, w + n * rowb + (size_t)b * g_bb[f], wd);
                magnitude(f, w + n * rowb + (size_t)b * g_bb[f], wd, wa);
                const float *xr = x + (size_t)m * K + (size_t)b * QK;
                const int8_t *qr = q + (size_t)m * K + (size_t)b * QK;
                for (int i = 0; i < QK; i++) {
                    const double xv = int8 ? (double)qr[i] * dx[m * nb + b] : (double)xr[i];
                    want += wd[i] * xv;
                    bound += wa[i] * fabs(xv);
                }
            }
            /* fp32: a few roundings a block (scale product, integer sum, fma, the min term) */
            const double tol = (4.0 * nb + 8.0) * 0x1p-24 * bound + 1e-30;
            const float got = y[(size_t)m * N + n];
            if (!(fabs(got - want) <= tol))
                fail("value", f, N, K, M, m, n, got, want, tol);
            if (memcmp(&yp[(size_t)m * N + n], &got, 4))
                fail("pool != caller", f, N, K, M, m, n, yp[(size_t)m * N + n], got, 0);
            if (memcmp(&yw[(size_t)m * N + n], &got, 4))
                fail("pg_linear_w != entry", f, N, K, M, m, n, yw[(size_t)m * N + n], got, 0);
            const float wb = got + bias[n];
            if (memcmp(&yb[(size_t)m * N + n], &wb, 4))
                fail("bias", f, N, K, M, m, n, yb[(size_t)m * N + n], wb, 0);
            if (yh[(size_t)m * N + n] != f32_to_bf16(got))
                fail("bf16", f, N, K, M, m, n, bf16_to_f32(yh[(size_t)m * N + n]), got, 0);
        }
    for (int m = 0; m < M && M > 1; m++) {  /* batch invariance: each row as if alone */
        if (pqk_linear_entry(g_wdt[f], w, NULL, N, K, x + (size_t)m * K, 1, y1, DT_F32, 0)) {
            g_failed++;
            break;
        }
        for (int n = 0; n < N; n++)
            if (memcmp(&y1[n], &y[(size_t)m * N + n], 4))
                fail("M rows != one row", f, N, K, M, m, n, y[(size_t)m * N + n], y1[n], 0);
    }
out:
    free(w); free(x); free(bias); free(y); free(yp); free(yb); free(y1); free(yw); free(yh); free(wd); free(wa);
    free(q); free(pq); free(dx); free(pd); free(bs); free(pbs);
}

static void run_all(int int8)
{
    static const int shapes[][2] = {{16, 256}, {37, 512}, {64, 1536}, {3, 2304}};
    static const int ms[] = {1, 2, 3, 4, 5, 8, 9, 16, 64};
    for (int f = 0; f < 3; f++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++)
                if (shapes[s][0] * ms[i] <= 1024)
                    check(f, shapes[s][0], shapes[s][1], ms[i], int8);
}

int main(void)
{
    const char *which = "portable";
    pg_set_num_threads(2);
#if defined(__aarch64__)
    extern int pg_neon_dot(void);
    extern int pg_set_neon_dot(int on);
    which = "aarch64 sdot";
    if (!pg_neon_dot()) {
        printf("qgemv_k_driver: this CPU has no SDOT (pg_neon_dot() = 0), 0 cases, 1 failed\n");
        return 1;
    }
    run_all(1);
    pg_set_neon_dot(0);  /* switched off: the fp32 path */
    run_all(0);
    pg_set_neon_dot(-1);
#elif defined(__x86_64__)
    which = "x86";
    static const int tiers[] = {4, 3, 2, 1};  /* avx512_bf16, avx512_vnni, avx512, avx2 */
    for (int t = 0; t < 4; t++)
        if (pg_set_isa_cap(tiers[t]) == tiers[t])
            run_all(1);
    if (pg_set_isa_cap(0) == 0)
        run_all(0);
    pg_set_isa_cap(99);
#endif
    printf("qgemv_k_driver: %s, %d cases, %d failed\n", which, g_cases, g_failed);
    return g_failed != 0;
}
