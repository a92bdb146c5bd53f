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


/* Per-thread scratch: x widened to fp32, and the prepared activations (slots 0, 1); a second
 * product of the same call (pq_linear_w2) takes slots 2, 3. */
static __thread void *tl_buf[4];
static __thread size_t tl_cap[4];

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

/* The column-lane copy the tier's int8 rows read (cpu_qgemv_cl.c: the VNNI tiers and avx2;
 * cpu_qgemv_neon.c: aarch64's SDOT -- the same bits at all), or NULL (the other tiers read the
 * blocks or a block-group copy). */
static const uint8_t *cl_copy(const pg_weight_t *d, int isa)
{
    const int reads = isa >= ISA_AVX512_VNNI || isa == ISA_AVX2 || (isa == ISA_PORTABLE && pg_neon_dot());
    return reads && d->rpl == PQ_RP_CL ? (const uint8_t *)d->rp : NULL;
}

static void pq_task(const void *ctx, int i0, int i1)
{
    const pq_task_t *t = (const pq_task_t *)ctx;
    t->rows(&t->job, i0, i1);
}

/* Rows from which a call's activations are prepared by the pool's threads, each a range of the
 * rows, before its weight rows run (one hand-off, pg_parallel_for_pre): on the caller alone, an
 * 8-row verify's preparation (bf16 widened, quantized to int8 blocks) was ~0.5 ms of its ~7 ms
 * (perf, Zen 4), the other thread waiting.  Pooled, SmolLM2's 4-16-token verify forwards took
 * 0.1-0.7 ms less (alternated in one process); at 2-3 rows no gain was seen. */
#define PQ_PAR_PREP_M 4
static int g_par_prep = 1;

/* Turn the pooled activation prep on (1) or off (0; tests compare the bits, benchmarks the
 * time); returns the previous setting. */
int pq_set_par_prep(int on)
{
    const int old = g_par_prep;
    g_par_prep = on != 0;
    return old;
}

/* pq_task with the activation prep as the pool call's first phase. */
typedef struct {
    pq_task_t t;              /* first: pq_task reads the context as this */
    const pq_format_t *f;
    const uint16_t *xb;       /* the bf16 x to widen into job.x, or NULL (x is fp32) */
    int npre, cl;
} pq_prep_task_t;

/* Pre item c: rows [c M / npre, (c + 1) M / npre) widened and prepared (the header with row 0);
 * with npre = 1, all of them, on the caller (a format without prep_rows: only so). */
static void pq_prep_task(const void *ctx, int c0, int c1)
{
    const pq_prep_task_t *p = (const pq_prep_task_t *)ctx;
    const pq_job_t *j = &p->t.job;
    for (int c = c0; c < c1; c++) {
        const int m0 = (int)((int64_t)c * j->M / p->npre), m1 = (int)((int64_t)(c + 1) * j->M / p->npre);
        if (p->xb) {
            float *x32 = (float *)j->x;
            for (size_t i = (size_t)m0 * j->K; i < (size_t)m1 * j->K; i++)
                x32[i] = bf16_to_f32(p->xb[i]);
        }
        if (!j->xa)
            continue;
        if (m0 == 0 && m1 == j->M)
            p->f->prep(j->x, j->M, j->K, (void *)j->xa, j->isa, p->cl);
        else
            p->f->prep_rows(j->x, j->M, j->K, (void *)j->xa, j->isa, p->cl, m0, m1);
    }
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

/* A block-format product's job and activation prep, as pq_linear_w runs them; slot: its first
 * scratch slot (0, or 2 for pq_linear_w2's second product).  *rows: pool rows a chunk (0: the
 * caller alone).  0, -1 or -2. */
static int pq_setup(const pg_weight_t *d, const void *x, void *y, int M, int xdt, int slot,
                    pq_prep_task_t *p, int *rows)
{
    if (M < 1 || M > PG_MAX_M || d->N < 1 || d->K < 1 || (xdt != DT_F32 && xdt != DT_BF16))
        return -1;
    const pq_format_t *f = pq_format_of(d->wdt);
    if (!f || d->K % f->block_elems)
        return -1;
    const int K = d->K, N = d->N;
    const int isa = pg_isa();
    const size_t row_bytes = (size_t)(K / f->block_elems) * f->block_bytes;
    *rows = chunk_rows(N, row_bytes);
    /* the activations prepared by the pool's threads, as the call's first phase, or here */
    const int par = *rows && M >= PQ_PAR_PREP_M && f->prep_rows && g_par_prep;
    const float *x32 = (const float *)x;  /* a bf16 x is widened into scratch by pq_prep_task */
    if (xdt == DT_BF16 && !(x32 = (const float *)scratch(slot, (size_t)M * K * 4)))
        return -2;
    void *xa = NULL;
    const size_t xab = f->xa_bytes ? f->xa_bytes(M, K) : 0;
    /* a column-lane copy is read at the VNNI and AVX2 tiers and by aarch64's SDOT rows; a
     * block-group copy from AVX-512 up */
    const uint8_t *cl = cl_copy(d, isa);
    const uint8_t *rp = isa >= ISA_AVX512 && d->rpl == PQ_RP_GROUPS ? (const uint8_t *)d->rp : NULL;
    if (xab && !(xa = scratch(slot + 1, xab)))
        return -2;
    pq_task_t *t = &p->t;
    t->rows = pq_rows_at(f, isa);
    t->job.w = (const uint8_t *)d->w;
    t->job.rp = rp;
    t->job.cl = cl;
    t->job.row_bytes = row_bytes;
    t->job.bias = d->bias;
    t->job.x = x32;
    t->job.xa = xa;
    t->job.y = y;
    t->job.ydt = xdt;
    t->job.M = M;
    t->job.N = N;
    t->job.K = K;
    t->job.isa = isa;
    /* pooled: one row an item, so a thread that wakes late or is descheduled holds up at most a
     * row (with a half of the rows an item, the caller waited for the other thread's half) */
    p->f = f;
    p->xb = xdt == DT_BF16 ? (const uint16_t *)x : NULL;
    p->npre = par ? M : 1;
    p->cl = cl != NULL;
    return 0;
}

/*
 * y[M, N] = x[M, K] @ W^T (+ bias) for a block-format W (d->wdt >= DT_Q_FIRST); x, y fp32 or
 * bf16 (xdt; y has x's dtype).  0 on success, -1 bad arguments or a format without kernels,
 * -2 allocation failure.
 */
int pq_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt)
{
    pq_prep_task_t p;
    int rows, rc;
    if ((rc = pq_setup(d, x, y, M, xdt, 0, &p, &rows)))
        return rc;
    if (p.npre > 1) {
        pg_parallel_for_pre(pq_prep_task, p.npre, pq_task, &p, d->N, rows);
        return 0;
    }
    pq_prep_task(&p, 0, 1);
    if (!rows)
        p.t.rows(&p.t.job, 0, d->N);
    else
        pg_parallel_for(pq_task, &p.t, d->N, rows);
    return 0;
}

/* pq_linear_w2's pool call: its two products' preps (pre items 0 and 1), then the rows of
 * both, the first product's N0 then the second's, as one range. */
typedef struct {
    pq_prep_task_t p[2];
    int N0;
} pq_pair_t;

static void pair_prep_task(const void *ctx, int c0, int c1)
{
    const pq_pair_t *pp = (const pq_pair_t *)ctx;
    for (int c = c0; c < c1; c++)
        pq_prep_task(&pp->p[c], 0, 1);
}

static void pair_task(const void *ctx, int i0, int i1)
{
    const pq_pair_t *pp = (const pq_pair_t *)ctx;
    const int N0 = pp->N0;
    if (i0 < N0)
        pp->p[0].t.rows(&pp->p[0].t.job, i0, i1 < N0 ? i1 : N0);
    if (i1 > N0)
        pp->p[1].t.rows(&pp->p[1].t.job, i0 > N0 ? i0 - N0 : 0, i1 - N0);
}

/*
 * Two block-format products in one pool call: y0 = x0 @ W0^T and y1 = x1 @ W1^T (M rows each;
 * a row-parallel linear's two column groups, cpu_layer.c's split_linear).  Each output row is
 * what pq_linear_w gives it (the same row kernels on the same prepared activations; how rows
 * are cut into chunks changes no bits), with one hand-off to the pool instead of two: at a
 * decode step's sizes a pool call costs a few microseconds besides its weights' stream
 * (docs/CPU_PERFORMANCE.md, twenty-eighth session).  0, -1 or -2.
 */
int pq_linear_w2(const pg_weight_t *d0, const void *x0, void *y0, const pg_weight_t *d1,
                 const void *x1, void *y1, int M, int xdt)
{
    pq_pair_t pp;
    int r0, r1, rc;
    if ((rc = pq_setup(d0, x0, y0, M, xdt, 0, &pp.p[0], &r0)) ||
        (rc = pq_setup(d1, x1, y1, M, xdt, 2, &pp.p[1], &r1)))
        return rc;
    const int N0 = d0->N, N = d0->N + d1->N;
    if (!r0 || !r1 || N0 % 16) {
        /* one of them small enough for the caller alone (or a cut off the 16-row grid) */
        if ((rc = pq_linear_w(d0, x0, y0, M, xdt)))
            return rc;
        return pq_linear_w(d1, x1, y1, M, xdt);
    }
    pp.N0 = N0;
    /* the two products' chunks as pq_linear_w cuts one matrix: PG_CHUNKS_PER_THREAD a thread */
    const int nth = pg_num_threads();
    const int rows = ((N + PG_CHUNKS_PER_THREAD * nth - 1) / (PG_CHUNKS_PER_THREAD * nth) + 15) & ~15;
    const int par = pp.p[0].npre > 1 || pp.p[1].npre > 1;
    pp.p[0].npre = pp.p[1].npre = 1;  /* each prep item prepares all of its product's rows */
    if (par) {
        /* the preps on the pool too (a verify's rows), one pre item each */
        pg_parallel_for_pre(pair_prep_task, 2, pair_task, &pp, N, rows);
        return 0;
    }
    pair_prep_task(&pp, 0, 2);
    pg_parallel_for(pair_task, &pp, N, rows);
    return 0;
}

/* pq_linear_rows' work: the row chunks' jobs (rows [64 c, 64 c + 64) of the call each, as
 * pq_linear_w would make them), and the column split shared by all of them. */
typedef struct {
    const pq_format_t *f;
    pq_rows_fn rows;
    pq_job_t *jobs;        /* [nc] */
    const uint16_t *xb;    /* the call's bf16 x, or NULL (x is fp32 already) */
    float *x32;            /* [T, K] fp32 x (written from xb in the prep phase) */
    int nc, ncol, col_rows, N;
} pq_rows_call_t;

/* Chunks [c0, c1): x widened to fp32 and the format's activation prep (each row's own blocks:
 * independent of the other rows, so the split changes nothing). */
static void rows_prep_task(const void *ctx, int c0, int c1)
{
    const pq_rows_call_t *t = (const pq_rows_call_t *)ctx;
    for (int c = c0; c < c1; c++) {
        const pq_job_t *j = &t->jobs[c];
        if (t->xb) {
            const size_t off = (size_t)c * PG_MAX_M * j->K, n = (size_t)j->M * j->K;
            for (size_t i = 0; i < n; i++)
                t->x32[off + i] = bf16_to_f32(t->xb[off + i]);
        }
        if (j->xa)
            t->f->prep(j->x, j->M, j->K, (void *)j->xa, j->isa, j->cl != NULL);
    }
}

/* Units [u0, u1) of (row chunk, column range), row chunk major. */
static void rows_unit_task(const void *ctx, int u0, int u1)
{
    const pq_rows_call_t *t = (const pq_rows_call_t *)ctx;
    for (int u = u0; u < u1; u++) {
        const int c = u / t->ncol, k = u % t->ncol;
        const int n0 = k * t->col_rows, n1 = n0 + t->col_rows < t->N ? n0 + t->col_rows : t->N;
        t->rows(&t->jobs[c], n0, n1);
    }
}

/* y[T, N] = x @ W^T as calls of at most PG_MAX_M rows, one after the other (any weight). */
static int linear_by_calls(const pg_weight_t *d, const void *x, void *y, int T, int xdt)
{
    const size_t esz = xdt == DT_F32 ? 4 : 2;
    for (int r0 = 0; r0 < T; r0 += PG_MAX_M) {
        const int m = T - r0 < PG_MAX_M ? T - r0 : PG_MAX_M;
        const int rc = pg_linear_w(d, (const char *)x + (size_t)r0 * d->K * esz,
                                   (char *)y + (size_t)r0 * d->N * esz, m, xdt);
        if (rc)
            return rc;
    }
    return 0;
}

/* Most row chunks pq_linear_rows takes in one hand-off (a 4096-row call); more go in turns. */
#define PQ_ROWS_MAX_CHUNKS 64

/*
 * y[T, N] = x[T, K] @ W^T (+ bias) for any T: a prefill chunk's linear.  The rows run in
 * kernel calls of at most PG_MAX_M, each row's bits the kernels' whatever its call (batch
 * invariance), but with two pool hand-offs for the whole call instead of one per 64 rows with
 * its x prepared on the caller meanwhile: the activations of every chunk are prepared in
 * parallel, then (row chunk, column range) units are spread over the pool, so a thread waits
 * at most a unit (not a quarter of a 64-row call) for the other.  T <= PG_MAX_M is
 * pq_linear_w.  0, -1 or -2 as pq_linear_w.
 */
int pq_linear_rows(const pg_weight_t *d, const void *x, void *y, int T, int xdt)
{
    if (T <= PG_MAX_M || pg_num_threads() <= 1)
        return linear_by_calls(d, x, y, T, xdt);
    const pq_format_t *f = pq_format_of(d->wdt);
    if (!f || d->K < 1 || d->N < 1 || d->K % f->block_elems || (xdt != DT_F32 && xdt != DT_BF16))
        return -1;
    const int K = d->K, N = d->N, isa = pg_isa();
    const size_t esz = xdt == DT_F32 ? 4 : 2;
    for (int r0 = 0; r0 < T; r0 += PQ_ROWS_MAX_CHUNKS * PG_MAX_M) {
        const int rows_here = T - r0 < PQ_ROWS_MAX_CHUNKS * PG_MAX_M ? T - r0 : PQ_ROWS_MAX_CHUNKS * PG_MAX_M;
        const int nc = (rows_here + PG_MAX_M - 1) / PG_MAX_M;
        /* the prepared activations of chunk c at c * xab (a full chunk's size, 64-byte padded) */
        const size_t xab = f->xa_bytes ? (f->xa_bytes(PG_MAX_M, K) + 63) & ~(size_t)63 : 0;
        const size_t x32b = xdt == DT_BF16 ? ((size_t)rows_here * K * 4 + 63) & ~(size_t)63 : 0;
        char *buf = (char *)scratch(1, x32b + (size_t)nc * xab);
        if (!buf)
            return -2;
        const char *xr = (const char *)x + (size_t)r0 * K * esz;
        char *yr = (char *)y + (size_t)r0 * N * esz;
        pq_job_t jobs[PQ_ROWS_MAX_CHUNKS];
        pq_rows_call_t t = {f, pq_rows_at(f, isa), jobs, xdt == DT_BF16 ? (const uint16_t *)xr : NULL,
                            (float *)buf, nc, 1, N, N};
        const float *x32 = xdt == DT_BF16 ? (const float *)buf : (const float *)xr;
        const uint8_t *cl = cl_copy(d, isa);
        const uint8_t *rp = isa >= ISA_AVX512 && d->rpl == PQ_RP_GROUPS ? (const uint8_t *)d->rp : NULL;
        const size_t row_bytes = (size_t)(K / f->block_elems) * f->block_bytes;
        for (int c = 0; c < nc; c++) {
            const int m = rows_here - c * PG_MAX_M < PG_MAX_M ? rows_here - c * PG_MAX_M : PG_MAX_M;
            jobs[c] = (pq_job_t){(const uint8_t *)d->w, rp, cl, row_bytes, d->bias,
                                 x32 + (size_t)c * PG_MAX_M * K, xab ? buf + x32b + (size_t)c * xab : NULL,
                                 yr + (size_t)c * PG_MAX_M * N * esz, xdt, m, N, K, isa};
        }
        pg_parallel_for(rows_prep_task, &t, nc, 1);
        /* each chunk's columns in pieces as pq_linear_w splits them (16-column multiples) */
        const int split = chunk_rows(N, row_bytes);
        if (split) {
            t.col_rows = split;
            t.ncol = (N + split - 1) / split;
        }
        pg_parallel_for(rows_unit_task, &t, nc * t.ncol, 1);
    }
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

/* y[T, N] = x[T, K] @ W^T for any T >= 1 (a prefill chunk): block formats through
 * pq_linear_rows, float weights as calls of at most PG_MAX_M rows.  0, -1 or -2. */
int pg_linear_rows(const pg_weight_t *d, const void *x, void *y, int T, int xdt)
{
    if (T < 1)
        return -1;
    if (d->wdt >= DT_Q_FIRST)
        return pq_linear_rows(d, x, y, T, xdt);
    return linear_by_calls(d, x, y, T, xdt);
}

/* The weight descriptor's entry point: fp32 / bf16 weights to cpu_gemv.c (a bf16 weight with an
 * AMX copy to cpu_gemv_amx.c where the tiles are on; with a row-pair copy, pg_linear_pairs),
 * block formats to pq_linear_w. */
int pg_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt)
{
    if (d->wdt >= DT_Q_FIRST)
        return pq_linear_w(d, x, y, M, xdt);
    if (d->wdt == DT_BF16 && d->rp && d->rpl == PG_RP_AMX && pg_bf16_amx())
        return pg_linear_amx((const uint16_t *)d->rp, d->bias, x, xdt, y, M, d->N, d->K);
    if (d->wdt == DT_BF16 && d->rp && d->rpl == PG_RP_PAIRS && d->K % 32 == 0)
        return pg_linear_pairs((const uint16_t *)d->w, (const uint16_t *)d->rp, d->bias, x, xdt, y, M, d->N, d->K);
    return pg_linear(d->w, d->wdt, d->bias, x, xdt, y, M, d->N, d->K);
}
