/*
 * cpu_dispatch.c -- from a weight descriptor (pg_weight_t, cpu_dispatch.h) to its kernel:
 * pg_linear_w sends fp32 / bf16 weights to cpu_gemv.c's pg_linear and block formats to
 * pq_linear_w, which runs a format through its row of the table (cpu_formats.h): the x
 * conversion to fp32, the format's activation prep, and the rows over the pool.  Also the
 * prefill path's row dequantizers (pq_dequantize_rows / _ids) and the capability queries.
 * Nothing here knows a format by name: adding one changes the table, not this file.
 *
 * Layering: uses cpu_runtime.c (pool, tier), cpu_gemv.c (pg_linear) and cpu_formats.c
 * (pq_format_of); nothing below calls back up here.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_dispatch.h"
#include "cpu_formats.h"
#include "cpu_gemv.h"

#define PQ_SOLO_BYTES (48 * 1024)


/* Per-thread scratch: x widened to fp32, and the prepared activations. */
static __thread void *tl_buf[2];
static __thread size_t tl_cap[2];

static void *scratch(int which, size_t bytes)
{
    if (bytes > tl_cap[which]) {
        free(tl_buf[which]);
        size_t cap = bytes < 65536 ? 65536 : bytes;
        tl_buf[which] = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        tl_cap[which] = tl_buf[which] ? cap : 0;
    }
    return tl_buf[which];
}

typedef struct {
    pq_rows_fn rows;
    pq_job_t job;
} pq_task_t;

static void pq_task(const void *ctx, int i0, int i1)
{
    const pq_task_t *t = (const pq_task_t *)ctx;
    t->rows(&t->job, i0, i1);
}

/* Rows per pool chunk, as cpu_gemv.c: PG_CHUNKS_PER_THREAD (cpu_runtime.h) chunks per thread,
 * >= 16 KB of weights, rounded to 16 rows; 0 when the caller should run the matrix alone
 * (small, or one thread). */
static int chunk_rows(int N, size_t row_bytes)
{
    const int nth = pg_num_threads();
    if (nth <= 1 || (size_t)N * row_bytes < PQ_SOLO_BYTES || N < 32)
        return 0;
    int rows = (N + PG_CHUNKS_PER_THREAD * nth - 1) / (PG_CHUNKS_PER_THREAD * nth);
    int min_rows = (int)((16384 + row_bytes - 1) / row_bytes);
    if (rows < min_rows)
        rows = min_rows;
    return (rows + 15) & ~15;
}

/*
 * y[M, N] = x[M, K] @ W^T (+ bias) for a block-format W (d->wdt >= DT_Q_FIRST); x, y fp32 or
 * bf16 (xdt; y has x's dtype).  0 on success, -1 bad arguments or a format without kernels,
 * -2 allocation failure.
 */
int pq_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt)
{
    if (M < 1 || M > PG_MAX_M || d->N < 1 || d->K < 1 || (xdt != DT_F32 && xdt != DT_BF16))
        return -1;
    const pq_format_t *f = pq_format_of(d->wdt);
    if (!f || d->K % f->block_elems)
        return -1;
    const int K = d->K, N = d->N;
    const int isa = pg_isa();
    const float *x32 = (const float *)x;
    const size_t nx = (size_t)M * K;
    if (xdt == DT_BF16) {
        float *s = (float *)scratch(0, nx * 4);
        if (!s)
            return -2;
        const uint16_t *xs = (const uint16_t *)x;
        for (size_t i = 0; i < nx; i++)
            s[i] = bf16_to_f32(xs[i]);
        x32 = s;
    }
    void *xa = NULL;
    const size_t xab = f->xa_bytes ? f->xa_bytes(M, K) : 0;
    /* a column-lane copy is read at the VNNI tier only; a block-group copy from AVX-512 up */
    const uint8_t *cl = isa >= ISA_AVX512_BF16 && d->rpl == PQ_RP_CL ? (const uint8_t *)d->rp : NULL;
    const uint8_t *rp = isa >= ISA_AVX512 && d->rpl == PQ_RP_GROUPS ? (const uint8_t *)d->rp : NULL;
    if (xab) {
        xa = scratch(1, xab);
        if (!xa)
            return -2;
        f->prep(x32, M, K, xa, isa, cl != NULL);
    }
    pq_task_t t;
    t.rows = pq_rows_at(f, isa);
    t.job.w = (const uint8_t *)d->w;
    t.job.rp = rp;
    t.job.cl = cl;
    t.job.row_bytes = (size_t)(K / f->block_elems) * f->block_bytes;
    t.job.bias = d->bias;
    t.job.x = x32;
    t.job.xa = xa;
    t.job.y = y;
    t.job.ydt = xdt;
    t.job.M = M;
    t.job.N = N;
    t.job.K = K;
    t.job.isa = isa;
    const int rows = chunk_rows(N, t.job.row_bytes);
    if (!rows)
        t.rows(&t.job, 0, N);
    else
        pg_parallel_for(pq_task, &t, N, rows);
    return 0;
}

typedef struct {
    pq_dequant_fn deq;  /* the tier's dequantizer of the format */
    const uint8_t *w;   /* row n0 */
    size_t row_bytes;
    int nb, K;
    float *out;         /* row n0 */
} deq_task_t;

static void deq_task(const void *ctx, int i0, int i1)
{
    const deq_task_t *t = (const deq_task_t *)ctx;
    for (int i = i0; i < i1; i++)
        t->deq(t->w + (size_t)i * t->row_bytes, t->nb, t->out + (size_t)i * t->K);
}

/*
 * out[(n1 - n0), K] (fp32) = rows n0..n1-1 of W dequantized, exactly the values the reference
 * dequantizer gives.  Split over the pool when large.  0 on success, -1 bad arguments or a
 * format without a table row.
 */
int pq_dequantize_rows(const pg_weight_t *d, int n0, int n1, float *out)
{
    const pq_format_t *f = pq_format_of(d->wdt);
    if (!f || d->K < 1 || d->K % f->block_elems || n0 < 0 || n1 > d->N || n0 > n1)
        return -1;
    const int nb = d->K / f->block_elems;
    const size_t rb = (size_t)nb * f->block_bytes;
    deq_task_t t = {pq_dequant_at(f, pg_isa()), (const uint8_t *)d->w + (size_t)n0 * rb, rb, nb, d->K, out};
    const int n = n1 - n0;
    const size_t bytes = (size_t)n * d->K * 4;
    if (n >= 32 && bytes >= (256u << 10) && pg_num_threads() > 1)
        pg_parallel_for(deq_task, &t, n, 16);
    else
        deq_task(&t, 0, n);
    return 0;
}

/* out[i, :] = row ids[i] of W dequantized (a quantized embedding table's lookups); ids must
 * lie in [0, N).  0 on success, -1 as pq_dequantize_rows or for an id out of range. */
int pq_dequantize_ids(const pg_weight_t *d, const int64_t *ids, int n, float *out)
{
    const pq_format_t *f = pq_format_of(d->wdt);
    if (!f || d->K < 1 || d->K % f->block_elems || n < 0)
        return -1;
    const int nb = d->K / f->block_elems;
    const size_t rb = (size_t)nb * f->block_bytes;
    const pq_dequant_fn deq = pq_dequant_at(f, pg_isa());
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= d->N)
            return -1;
        deq((const uint8_t *)d->w + (size_t)ids[i] * rb, nb, out + (size_t)i * d->K);
    }
    return 0;
}

__attribute__((visibility("hidden"))) int q32_repack(int wdt, const uint8_t *w, uint8_t *out, int N, int K,
                                                     int layout);
__attribute__((visibility("hidden"))) size_t q32_repack_bytes(int wdt, int N, int K, int layout);

int pq_repack(const pg_weight_t *d, void *out, int layout)
{
    if (!d || !out || d->N < 1 || d->K < 1 || d->K % 32)
        return 1;
    return q32_repack(d->wdt, (const uint8_t *)d->w, (uint8_t *)out, d->N, d->K, layout);
}

size_t pq_repack_bytes(const pg_weight_t *d, int layout)
{
    if (!d || d->N < 1 || d->K < 1 || d->K % 32)
        return 0;
    return q32_repack_bytes(d->wdt, d->N, d->K, layout);
}

/* 1 when wdt has row kernels in this .so (a row of the table), else 0. */
int pq_supported(int wdt)
{
    return pq_format_of(wdt) != NULL;
}

/* How the activations of wdt are multiplied at the tier in use: 0 as fp32, else the number of
 * elements that share one int8 scale (a bound for the K-quants); -1 when wdt has no kernels. */
int pq_act_block(int wdt)
{
    const pq_format_t *f = pq_format_of(wdt);
    return f ? f->act_block(pg_isa()) : -1;
}

/* The weight descriptor's entry point: fp32 / bf16 weights to cpu_gemv.c, block formats to
 * pq_linear_w. */
int pg_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt)
{
    if (d->wdt >= DT_Q_FIRST)
        return pq_linear_w(d, x, y, M, xdt);
    return pg_linear(d->w, d->wdt, d->bias, x, xdt, y, M, d->N, d->K);
}
