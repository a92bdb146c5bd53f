/*
 * cpu_gemv.h -- the dense (fp32 / bf16 weight) small-M linear of cpu_gemv.c.  The block
 * formats are cpu_formats.h's; the descriptor entry point that routes a weight to either is
 * pg_linear_w (cpu_dispatch.h).
 */
#ifndef PRESCIENT_CPU_GEMV_H
#define PRESCIENT_CPU_GEMV_H

#include "cpu_runtime.h"

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]); w fp32 or bf16 (wdt), x and y fp32 or bf16 (xdt;
 * y has x's dtype); M <= PG_MAX_M.  0 on success, -1 bad arguments, -2 allocation failure. */
int pg_linear(const void *w, int wdt, const float *bias, const void *x, int xdt,
              void *y, int M, int N, int K);
/* pg_linear for a bf16 w [N, K] with its row-pair copy `pairs` ([N / 2][K / 32][2][32]: each
 * 32-element block of rows 2p and 2p + 1 side by side; K % 32 == 0), which tier avx512_bf16's
 * vdpbf16ps rows read for pg_set_pairs_min_m to 20 inputs (one weight stream a tile); the same
 * bits as pg_linear, which every other tier and M runs. */
int pg_linear_pairs(const uint16_t *w, const uint16_t *pairs, const float *bias, const void *x, int xdt,
                    void *y, int M, int N, int K);
int pg_set_pairs_min_m(int m);
/* The calling thread's scratch of at least `bytes` (NULL if it cannot grow), which pg_linear and
 * pg_linear_amx use for their converted x; fp32 -> bf16 with round-to-nearest-even (AVX512_BF16's
 * vcvtneps2bf16 on x86: only where the tier has it). */
__attribute__((visibility("hidden")))
void *pg_scratch(size_t bytes);
__attribute__((visibility("hidden")))
void pg_round_bf16(const float *src, uint16_t *dst, size_t n);

/* bf16 weights on AMX tiles (cpu_gemv_amx.c): the copy pg_amx_repack makes of w [N, K] (its
 * size pg_amx_repack_bytes; the pair layout of tdpbf16ps' B operand), then pg_linear's product
 * from it.  pg_linear_amx: -1 bad arguments or a build without AMX, -2 allocation failure. */
size_t pg_amx_repack_bytes(int N, int K);
int pg_amx_repack(const uint16_t *w, int N, int K, uint16_t *out);
int pg_linear_amx(const uint16_t *rp, const float *bias, const void *x, int xdt, void *y, int M, int N, int K);

#endif
