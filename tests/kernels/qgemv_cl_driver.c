/*
 * qgemv_cl_driver.c -- the 32-element block formats' int8 rows on the column-lane copy (Q8_0,
 * Q4_0, Q4_1) against a scalar model of their arithmetic, bit for bit:
 *
 *   x quantized per 32-element block: dx = amax / 127, q = clamp(nearest-even(x * (127 / amax)))
 *   per (input row, output column): acc = 0; for each block in order:
 *       acc = fmaf(float(exact integer block sum), d_w * dx, acc)
 *       Q4_1: acc = fmaf(m_w, dx * sum q, acc)
 *   y = acc + bias (fp32), a bf16 y rounded to nearest even
 *
 * Built natively on x86 (tests/kernels/test_cl_rows_bits.py) it checks the VNNI and AVX2 rows of
 * cpu_qgemv_cl.c at every such tier the host runs; cross-compiled and run under qemu-aarch64,
 * the SDOT rows of cpu_qgemv_neon.c.  The same model for both: one set of bits on either ISA.
 * Every row is checked against the model on its own, so an M-row call giving a lone row's bits
 * (batch invariance) is checked too; M > 64 goes through pq_linear_rows (prefill's chunks).
 * Where the int8 rows must not run -- no copy, SDOT switched off (aarch64), the portable tier
 * (x86) -- the fp32 rows must: y within fp32 rounding of the exact sum over the dequantized
 * weights and unquantized x (the int8 model's activation rounding is far outside that).
 * The model's functions are built unvectorized (GCC 12 at -O3 -march=native once miscompiled an
 * earlier form of its weight decoding), and a known block is checked first.
 * Prints one line per failure, then "qgemv_cl_driver: <which rows>, N cases, F failed".
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

#if defined(__GNUC__) && !defined(__clang__)
#define MODEL_FN __attribute__((optimize("no-tree-vectorize")))
#else
#define MODEL_FN
#endif

static float from_half(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    }
    uint32_t u = sign | ((e + 112u) << 23) | (m << 13);
    memcpy(&f, &u, 4);
    return f;
}

enum { F_Q8_0, F_Q4_0, F_Q4_1 };
static const int g_wdt[3] = {DT_Q8_0, DT_Q4_0, DT_Q4_1};
static const int g_bb[3] = {34, 18, 20};
static const char *g_name[3] = {"q8_0", "q4_0", "q4_1"};

/* Block b of row n: weight i as an integer code (the model's integer side) and its scales. */
MODEL_FN static int wcode(int f, const uint8_t *blk, int i)
{
    if (f == F_Q8_0)
        return ((const int8_t *)(blk + 2))[i];
    const uint8_t *qs = blk + (f == F_Q4_1 ? 4 : 2);
    const int byte = qs[i & 15], v = i < 16 ? byte & 15 : byte >> 4;
    return f == F_Q4_0 ? v - 8 : v;
}

MODEL_FN static void quant_x(const float *x, int8_t *q, float *dx, int *sum)
{
    float amax = 0.f;
    for (int i = 0; i < 32; i++)
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int s = 0;
    for (int i = 0; i < 32; i++) {
        long v = lrintf(x[i] * id);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[i] = (int8_t)v;
        s += (int)v;
    }
    *dx = amax / 127.f;
    *sum = s;
}

/* The model's y[m, n] (fp32, before a bf16 store's rounding). */
MODEL_FN static float model(int f, const uint8_t *w, const float *x, const float *bias, int n, int K)
{
    const int nb = K / 32, bb = g_bb[f];
    float acc = 0.f;
    for (int b = 0; b < nb; b++) {
        int8_t q[32];
        float dx;
        int sum;
        quant_x(x + 32 * b, q, &dx, &sum);
        const uint8_t *blk = w + ((size_t)n * nb + b) * bb;
        int32_t dot = 0;
        for (int i = 0; i < 32; i++)
            dot += wcode(f, blk, i) * q[i];
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        const float dw = from_half(dh);
        acc = fmaf((float)dot, dw * dx, acc);
        if (f == F_Q4_1) {
            memcpy(&mh, blk + 2, 2);
            const float s = dx * (float)sum;
            acc = fmaf(from_half(mh), s, acc);
        }
    }
    return bias ? acc + bias[n] : acc;
}

/* The exact y[m, n] over the dequantized weights and x as given, and its fp32 rounding bound
 * (K * 2^-23 * sum |w x|). */
static double exact(int f, const uint8_t *w, const float *x, const float *bias, int n, int K, double *bound)
{
    const int nb = K / 32, bb = g_bb[f];
    double y = bias ? bias[n] : 0.0, mag = bias ? fabs(bias[n]) : 0.0;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + ((size_t)n * nb + b) * bb;
        uint16_t dh, mh = 0;
        memcpy(&dh, blk, 2);
        if (f == F_Q4_1)
            memcpy(&mh, blk + 2, 2);
        for (int i = 0; i < 32; i++) {
            const double wi = (double)from_half(dh) * wcode(f, blk, i) + (f == F_Q4_1 ? from_half(mh) : 0.0);
            y += wi * x[32 * b + i];
            mag += fabs(wi * x[32 * b + i]);
        }
    }
    *bound = K * 0x1p-23 * mag + 1e-30;
    return y;
}

static int g_cases, g_failed;

/* One case: rows = 1 the int8 rows on the copy (bit for bit against the model), 0 the fp32 rows
 * (within rounding of the exact sum); copy = 0 no column-lane copy given. */
static void check(int f, int N, int K, int M, int xdt, int with_bias, int rows, int copy)
{
    const int nb = K / 32, bb = g_bb[f];
    uint8_t *w = malloc((size_t)N * nb * bb);
    for (size_t i = 0; i < (size_t)N * nb * bb; i++)
        w[i] = (uint8_t)rnd();
    for (int r = 0; r < N * nb; r++) {  /* sane scales: |d| ~ 2^-6 .. 2^-4, m ~ -8 d */
        const float d = ldexpf(1.f + frand() * 0.5f, -5 - (int)(rnd() % 2));
        const uint16_t dh = to_half(frand() < 0 ? -d : d), mh = to_half(-8.f * d * (1.f + 0.2f * frand()));
        memcpy(w + (size_t)r * bb, &dh, 2);
        if (f == F_Q4_1)
            memcpy(w + (size_t)r * bb + 2, &mh, 2);
    }
    float *bias = NULL;
    if (with_bias) {
        bias = malloc(sizeof(float) * N);
        for (int n = 0; n < N; n++)
            bias[n] = frand();
    }
    float *x = malloc(sizeof(float) * M * K);
    uint16_t *xb = malloc(2 * (size_t)M * K);
    for (int i = 0; i < M * K; i++) {
        x[i] = frand() * (i % 97 == 0 ? 8.f : 1.f);
        xb[i] = f32_to_bf16(x[i]);
        if (xdt == DT_BF16)
            x[i] = bf16_to_f32(xb[i]);  /* the kernel widens bf16 x exactly: the model reads that */
    }
    pg_weight_t d = {w, bias, g_wdt[f], N, K, NULL, 0};
    const size_t rpb = pq_repack_bytes(&d, PQ_RP_CL);
    void *rp = rpb ? aligned_alloc(64, (rpb + 63) & ~(size_t)63) : NULL;
    if (!rp || pq_repack(&d, rp, PQ_RP_CL) != 0) {
        printf("FAIL %s N=%d K=%d: no column-lane copy\n", g_name[f], N, K);
        g_failed++;
        return;
    }
    if (copy) {
        d.rp = rp;
        d.rpl = PQ_RP_CL;
    }
    void *y = malloc((size_t)M * N * 4);
    const void *xin = xdt == DT_F32 ? (const void *)x : (const void *)xb;
    const int rc = M <= 64 ? pq_linear_w(&d, xin, y, M, xdt) : pq_linear_rows(&d, xin, y, M, xdt);
    g_cases++;
    int bad = 0;
    for (int m = 0; m < M && !bad; m++)
        for (int n = 0; n < N; n++) {
            if (!rows) {  /* the fp32 rows */
                double bound;
                const double want = exact(f, w, x + (size_t)m * K, bias, n, K, &bound);
                const double got = xdt == DT_F32 ? ((float *)y)[(size_t)m * N + n]
                                                 : bf16_to_f32(((uint16_t *)y)[(size_t)m * N + n]);
                if (rc != 0 || fabs(got - want) > bound + (xdt == DT_F32 ? 0.0 : 0x1p-8 * fabs(want))) {
                    printf("FAIL fp32 rows %s N=%d K=%d M=%d xdt=%d copy=%d: rc %d, y[%d,%d] %.9g, exact %.9g\n",
                           g_name[f], N, K, M, xdt, copy, rc, m, n, got, want);
                    bad = 1;
                    break;
                }
                continue;
            }
            const float want = model(f, w, x + (size_t)m * K, bias, n, K);
            uint32_t got_bits, want_bits;
            if (xdt == DT_F32) {
                memcpy(&got_bits, (float *)y + (size_t)m * N + n, 4);
                memcpy(&want_bits, &want, 4);
            } else {
                got_bits = ((uint16_t *)y)[(size_t)m * N + n];
                want_bits = f32_to_bf16(want);
            }
            if (rc != 0 || got_bits != want_bits) {
                printf("FAIL %s N=%d K=%d M=%d xdt=%d bias=%d: rc %d, y[%d,%d] bits %08x, model %08x (%g)\n",
                       g_name[f], N, K, M, xdt, with_bias, rc, m, n, got_bits, want_bits, (double)want);
                bad = 1;
                break;
            }
        }
    g_failed += bad;
    free(y);
    free(rp);
    free(x);
    free(xb);
    free(bias);
    free(w);
}

static void run_fp32(int copy)
{
    for (int f = 0; f < 3; f++)
        for (int M = 1; M <= 8; M += 7)
            check(f, 37, 64, M, M == 1 ? DT_F32 : DT_BF16, f == 1, 0, copy);
}

/* The model on one known block, written out: Q4_0, d = 1, every nibble 9 (w = 1), x = 1 .. 32, so
 * q_i = nearest(x_i * 127 / 32), dx = 32 / 127 and y = fma(float(sum q), dx, 0). */
static int model_known(void)
{
    uint8_t blk[18];
    const uint16_t one = 0x3c00;
    memcpy(blk, &one, 2);
    memset(blk + 2, 0x99, 16);
    float x[32];
    int sum = 0;
    for (int i = 0; i < 32; i++) {
        x[i] = (float)(i + 1);
        sum += (int)lrintf((float)(i + 1) * (127.f / 32.f));
    }
    const float want = fmaf((float)sum, 1.f * (32.f / 127.f), 0.f);
    return model(F_Q4_0, blk, x, NULL, 0, 32) == want;
}

static void run_all(void)
{
    static const int shapes[][2] = {{16, 32}, {37, 64}, {64, 576}, {100, 160}, {1536, 576}, {576, 1536}};
    static const int ms[] = {1, 2, 3, 5, 8, 9, 13, 16, 64, 100};  /* 9-16: two passes over a tile */
    for (int f = 0; f < 3; f++)
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
            for (size_t i = 0; i < sizeof(ms) / sizeof(ms[0]); i++) {
                const int N = shapes[s][0], K = shapes[s][1], M = ms[i];
                if ((size_t)N * K * M > (size_t)20000000)  /* qemu's time: the big shapes at small M */
                    continue;
                check(f, N, K, M, (s + i) % 2 ? DT_BF16 : DT_F32, (int)((s + i + f) % 3 == 0), 1, 1);
            }
}

int main(void)
{
    const char *which = "none";
    if (!model_known()) {
        printf("qgemv_cl_driver: the model itself is wrong on a known block, 0 cases, 1 failed\n");
        return 1;
    }
    for (int threads = 1; threads <= 2; threads++) {
        pg_set_num_threads(threads);
#if defined(__aarch64__)
        extern int pg_neon_dot(void);
        if (!pg_neon_dot()) {
            printf("qgemv_cl_driver: this CPU has no SDOT (pg_neon_dot() = 0), 0 cases, 1 failed\n");
            return 1;
        }
        which = "aarch64 sdot";
        run_all();
        run_fp32(0);  /* no copy: the fp32 rows */
        extern int pg_set_neon_dot(int on);
        pg_set_neon_dot(0);  /* switched off: the fp32 rows, the copy unread */
        run_fp32(1);
        pg_set_neon_dot(-1);
#elif defined(__x86_64__)
        /* the tiers whose int8 rows read the column-lane copy: avx2 (1), avx512_vnni (3), avx512_bf16 (4) */
        which = "x86";
        static const int tiers[] = {4, 3, 1};
        for (int t = 0; t < 3; t++)
            if (pg_set_isa_cap(tiers[t]) == tiers[t]) {
                printf("tier %d, %d thread(s)\n", tiers[t], threads);
                run_all();
            }
        if (pg_set_isa_cap(0) == 0)  /* the portable tier: the fp32 rows, the copy unread */
            run_fp32(1);
        pg_set_isa_cap(99);
#endif
    }
    printf("qgemv_cl_driver: %s, %d cases, %d failed\n", which, g_cases, g_failed);
    return g_failed != 0;
}
