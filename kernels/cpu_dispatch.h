/*
 * cpu_dispatch.h -- a weight descriptor to its kernel (cpu_dispatch.c): pg_linear_w routes the
 * float dtypes to cpu_gemv.c and the block formats through the table of cpu_formats.h.  The
 * fused layer (cpu_layer.c) and the Python wrappers (kernels/cpu_linear.py, quant_linear.py,
 * which mirror pg_weight_t) call these.
 */
#ifndef PRESCIENT_CPU_DISPATCH_H
#define PRESCIENT_CPU_DISPATCH_H

#include <stdint.h>
#include "cpu_runtime.h"

/* A weight's fixed call arguments, built once per weight: through ctypes every argument
 * costs ~70 ns, and a decode step makes ~200 calls. */
typedef struct {
    const void *w;
    const float *bias;   /* [N] fp32 or NULL */
    int32_t wdt, N, K;
    /* NULL, or a copy of w made by pq_repack for the AVX-512 block kernels, in layout rpl
     * (PQ_RP_*, cpu_formats.h; kernels/quant_linear.LAYOUTS mirrors the codes):
     * 0 full 16-block groups regrouped (as large as w; the AVX-512 int8 rows read it), 1
     * column-lane cells (N rounded up to 16; the VNNI and AVX2 int8 rows read it, cpu_qgemv_cl.c,
     * and aarch64's SDOT rows, cpu_qgemv_neon.c) */
    const void *rp;
    int32_t rpl;
} pg_weight_t;

/* y[M, N] = x[M, K] @ W^T (+ bias); x, y fp32 or bf16 (xdt; y has x's dtype); M <= PG_MAX_M.
 * 0 on success, -1 bad arguments, -2 allocation failure. */
int pg_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt);
/* A bf16 weight's AMX copy (pg_weight_t.rpl for a float dtype; cpu_gemv_amx.c): per 16-column
 * tile and 32-element block, the 16 columns' element pairs as tdpbf16ps' B operand. */
#define PG_RP_AMX 2
/* A bf16 weight's row-pair copy (pg_linear_pairs, cpu_gemv.h): each 32-element block of rows 2p
 * and 2p + 1 side by side, so the AVX-512 BF16 rows' 2-row tiles read one stream. */
#define PG_RP_PAIRS 3
/* The same for a block-format weight (d->wdt >= DT_Q_FIRST). */
int pq_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt);
/* Two of them in one pool call: y0 = x0 @ W0^T, y1 = x1 @ W1^T (M rows each), each row as
 * pq_linear_w gives it. */
int pq_linear_w2(const pg_weight_t *d0, const void *x0, void *y0, const pg_weight_t *d1,
                 const void *x1, void *y1, int M, int xdt);
/* The same for any T >= 1 rows (prefill chunks): the rows in kernel calls of at most PG_MAX_M
 * (the same bits), a block format's over the pool in two hand-offs for the whole call. */
int pg_linear_rows(const pg_weight_t *d, const void *x, void *y, int T, int xdt);
int pq_linear_rows(const pg_weight_t *d, const void *x, void *y, int T, int xdt);
/* Rows n0..n1-1 / the rows ids[0..n-1] of a block-format W as fp32, row-major, exactly the
 * reference dequantizer's values. */
int pq_dequantize_rows(const pg_weight_t *d, int n0, int n1, float *out);
int pq_dequantize_ids(const pg_weight_t *d, const int64_t *ids, int n, float *out);
/* Fill out (pq_repack_bytes(d, layout) bytes, the caller's memory) with W in a layout of the
 * SIMD kernels of the 32-element formats (q32_repack, cpu_qgemv.c): 0 each full 16-block
 * group in the order the block-lane registers take, the rest as is; 1 column-lane cells (the
 * VNNI and AVX2 int8 rows, cpu_qgemv_cl.c; aarch64's SDOT rows, cpu_qgemv_neon.c).  0 done (the caller then sets d->rp = out, d->rpl = layout), 1
 * no such layout for this format.  Portable C: the caller decides where it pays. */
int pq_repack(const pg_weight_t *d, void *out, int layout);
size_t pq_repack_bytes(const pg_weight_t *d, int layout);
/* 1 when wdt has kernels in this .so; the activation block of wdt at the tier in use. */
int pq_supported(int wdt);
int pq_act_block(int wdt);
/* The activation prep of a call of >= 4 rows on the pool (1, the default) or on the caller (0);
 * the same bits either way.  Returns the previous setting. */
int pq_set_par_prep(int on);

#endif
