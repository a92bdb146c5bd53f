/*
 * cpu_qgemv.h -- the contract between cpu_qgemv.c (the entry point pq_linear_w, the pool
 * split, Q8_0 / Q4_0 / Q4_1) and cpu_qgemv_k.c (the K-quant formats Q4_K / Q5_K / Q6_K).
 *
 * A format is a table: how its blocks are laid out, how the activations are prepared once per
 * call (e.g. quantized to int8 blocks for integer dot products, or per-block sums), and a row
 * kernel that computes y[m, n] for n in [n0, n1) and every m, choosing its code path from
 * j->isa (cpu_isa.h).  Weights are [N, K / block_elems] blocks, row-major: row n starts at
 * w + n * row_bytes.
 */
#ifndef PRESCIENT_CPU_QGEMV_H
#define PRESCIENT_CPU_QGEMV_H

#include <stddef.h>
#include <stdint.h>
#include "cpu_gemv.h"
#include "cpu_isa.h"

typedef struct {
    const uint8_t *w;   /* [N, row_bytes] blocks */
    size_t row_bytes;
    const float *bias;  /* [N] or NULL */
    const float *x;     /* [M, K] fp32 activations */
    const void *xa;     /* the format's prepared activations (prep below), or NULL */
    void *y;            /* [M, N], ydt */
    int ydt;            /* DT_F32 or DT_BF16 */
    int M, N, K;
    int isa;
} pq_job_t;

typedef struct {
    int wdt;            /* DT_Q* */
    int block_elems;    /* 32 or 256 */
    int block_bytes;
    /* Bytes of prepared activations for M x K (0: the row kernel reads j->x only). */
    size_t (*xa_bytes)(int M, int K);
    /* Fill xa from x [M, K] (fp32), once per call, on the calling thread. */
    void (*prep)(const float *x, int M, int K, void *xa, int isa);
    /* y[m, n] (+ bias[n]) for n0 <= n < n1, all m < M. */
    void (*rows)(const pq_job_t *j, int n0, int n1);
} pq_format_t;

/* cpu_qgemv.c's exports besides pq_linear_w (cpu_gemv.h): exact dequantizers for the prefill
 * path (rows n0..n1-1 / the rows ids[0..n-1], fp32, row-major; the 32-element formats only),
 * the path override for tests (0 default, 1 float, 2 int8), whether wdt has kernels, and the
 * activation block of wdt's int8 path at the tier in use (0 = fp32 activations). */
int pq_dequantize_rows(const pg_weight_t *d, int n0, int n1, float *out);
int pq_dequantize_ids(const pg_weight_t *d, const int64_t *ids, int n, float *out);
int pq_set_mode(int mode);
int pq_supported(int wdt);
int pq_act_block(int wdt);
/* cpu_qgemv_k.c's: the K-quants' row dequantizer and fp32-path override (1). */
int pqk_dequantize_rows(int wdt, const uint8_t *w, int K, int n0, int n1, float *out);
int pqk_set_mode(int mode);

/* The format table of cpu_qgemv_k.c for wdt (Q4_K, Q5_K, Q6_K), or NULL. */
__attribute__((visibility("hidden")))
const pq_format_t *pq_format_k(int wdt);

#endif
