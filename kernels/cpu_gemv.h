/*
 * cpu_gemv.h -- what the kernels of the one .so share: weight dtype codes, the weight
 * descriptor built once per matrix (kernels/cpu_linear.py mirrors it), the small-M linear
 * entry points and the thread pool (pg_parallel_for, defined in cpu_gemv.c).
 */
#ifndef PRESCIENT_CPU_GEMV_H
#define PRESCIENT_CPU_GEMV_H

#include <stdint.h>

#define PG_MAX_M 16        /* rows of x handled in registers; more -> caller uses GEMM */

/* Weight (and activation) dtypes.  Codes >= DT_Q_FIRST are GGUF block formats, kept in
 * their blocks ([N, K / block_elems] blocks, row-major) and run by cpu_qgemv.c. */
enum {
    DT_F32 = 0, DT_BF16 = 1,
    DT_Q_FIRST = 16,
    DT_Q8_0 = 16, DT_Q4_0 = 17, DT_Q4_1 = 18, DT_Q4_K = 19, DT_Q5_K = 20, DT_Q6_K = 21,
};

/* A weight's fixed call arguments, built once per weight: through ctypes every argument
 * costs ~70 ns, and a decode step makes ~200 calls. */
typedef struct {
    const void *w;
    const float *bias;   /* [N] fp32 or NULL */
    int32_t wdt, N, K;
} pg_weight_t;

/* y[M, N] = x[M, K] @ W^T (+ bias); x, y fp32 or bf16 (xdt; y has x's dtype); M <= PG_MAX_M.
 * 0 on success, -1 bad arguments, -2 allocation failure. */
int pg_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt);
/* The block-format weights of pg_linear_w (cpu_qgemv.c). */
int pq_linear_w(const pg_weight_t *d, const void *x, void *y, int M, int xdt);

typedef void (*pg_task_fn)(const void *ctx, int i0, int i1);
/* task(ctx, i0, i1) over items [0, n) in chunks of >= per_chunk items on the shared pool;
 * returns when all are done. */
__attribute__((visibility("hidden")))
void pg_parallel_for(pg_task_fn task, const void *ctx, int n, int per_chunk);

#endif
