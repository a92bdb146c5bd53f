/*
 * cpu_runtime.h -- the bottom layer of the CPU kernels' .so (cpu_runtime.c): the ISA tiers and
 * their run-time detection, the one thread pool every kernel shares, the activation dtype codes
 * and the library-wide limits.  Everything else includes this downward; cpu_runtime.c includes
 * nothing of the kernels, so no kernel file is both above and below another.
 *
 *   cpu_runtime      <- cpu_gemv (fp32/bf16), cpu_qgemv*, cpu_qgemv_k (block formats), cpu_attention,
 *                       cpu_argmax (greedy tokens)
 *   cpu_formats      <- the format table: one row per block format (cpu_formats.h)
 *   cpu_dispatch     <- pg_linear_w / pq_linear_w: a weight descriptor to its kernel
 *   cpu_layer        <- the fused decoder layer (linears through cpu_dispatch, cpu_attention)
 */
#ifndef PRESCIENT_CPU_RUNTIME_H
#define PRESCIENT_CPU_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

/* ISA tiers, ordered so that "tier >= X" means "X's instructions may be used".  The tier in use
 * is pg_isa(): the best the CPU and OS support, capped by pg_set_isa_cap (PRESCIENT_ISA in
 * kernels/cpu_linear.py), so an AVX-512 machine can run and test the AVX2 paths. */
enum {
    ISA_PORTABLE = 0,    /* plain C the compiler vectorises (any CPU; aarch64 adds NEON there) */
    ISA_AVX2 = 1,        /* AVX2 + FMA + F16C (Haswell, Zen 1-3) */
    ISA_AVX512 = 2,      /* AVX-512 F/BW/VL/DQ (Skylake-X; bf16 by widening) */
    ISA_AVX512_VNNI = 3, /* + AVX512_VNNI (vpdpbusd: the int8 rows; Cascade Lake, Ice Lake) */
    ISA_AVX512_BF16 = 4, /* + AVX512_BF16 (vdpbf16ps; Zen 4, Sapphire Rapids: all have VNNI) */
    ISA_COUNT
};

/* Rows of x one small-M kernel call takes (decode batches, verify trees, short chunks: up to
 * the fused layer's PL_MAX_T), each weight tile read once for all of them; the rows are worked
 * 4 at a time in registers, so a row's bits do not depend on M.  More rows: a GEMM. */
#define PG_MAX_M 64

/* Pool chunks per thread of one GEMV call (cpu_gemv.c's float weights, cpu_dispatch.c's block
 * formats; each chunk >= 16 KB of weights, 16-row aligned).  Each chunk starts a new weight
 * stream, whose first kilobytes wait on DRAM before the prefetchers run ahead, and a call ends
 * with the last chunk; fewer, longer streams read faster.  On the 2-core Zen 3 (tier avx2,
 * 2026-12-05), 8 -> 2: a decode step's GEMVs 5.75 -> 5.15 ms (181 calls, 92 MiB of Q4_1/Q8_0,
 * 1 chunk a thread 4.99 ms), the engine's greedy decode 1.11-1.12x on Q4_1 and 1.08x on bf16
 * weights, n-gram 1.06x (interleaved).  Two still lets the caller take a late worker's share.
 * -D to override. */
#ifndef PG_CHUNKS_PER_THREAD
#define PG_CHUNKS_PER_THREAD 2
#endif

/* Activation (and float weight) dtypes.  Codes >= DT_Q_FIRST are the block formats of
 * cpu_formats.h. */
enum { DT_F32 = 0, DT_BF16 = 1, DT_Q_FIRST = 16 };

/* AVX-VNNI's VEX vpdpbusd (tier avx2's rows, cpu_qgemv_cl.c) is inline assembly, which needs an
 * assembler from 2021 (binutils 2.36): on by default with GCC >= 11 / clang >= 12, which usually
 * come with one; kernels/cpu_linear.py retries the build with -DPQ_AVXVNNI=0 where not. */
#if !defined(PQ_AVXVNNI) && (defined(__x86_64__) || defined(__i386__)) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define PQ_AVXVNNI 1
#endif
#ifndef PQ_AVXVNNI
#define PQ_AVXVNNI 0
#endif
/* AMX intrinsics (cpu_gemv_amx.c): x86-64 only, GCC 11, clang 12; the fallback build sets -DPG_AMX=0. */
#if !defined(PG_AMX) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define PG_AMX 1
#endif
#ifndef PG_AMX
#define PG_AMX 0
#endif

/* The tier in use (0 .. ISA_COUNT - 1). */
int pg_isa(void);
/* 1 where tier avx2's int8 rows take AVX-VNNI's vpdpbusd (cpu_qgemv_cl.c): the CPU has it and
 * pg_set_avx_vnni has not turned it off; by default on only where avx2 is the CPU's best tier
 * (Intel's client cores since Alder Lake), so capping an AVX-512 CPU to avx2 still runs plain AVX2. */
int pg_avx_vnni(void);
/* 1 where the int8 kernels take aarch64's SDOT -- the 32-element block formats' rows
 * (cpu_qgemv_neon.c) and the K-quants' (cpu_qgemv_k.c) --: the build has them (PG_NEON_DOT), the
 * CPU has the dot-product extension, the tier is the portable one (aarch64's only), and
 * pg_set_neon_dot has not turned it off.  Always 0 on x86. */
int pg_neon_dot(void);
/* Whether this build has those kernels: GCC builds them for any aarch64 target (a
 * target pragma there), clang only where the build's target has the extension already. */
#if defined(__aarch64__) && defined(__GNUC__) && (!defined(__clang__) || defined(__ARM_FEATURE_DOTPROD))
#define PG_NEON_DOT 1
#else
#define PG_NEON_DOT 0
#endif
/* 1 where tier avx512_bf16 computes vdpbf16ps's products (bf16 weights in cpu_gemv.c, bf16 K in
 * cpu_attention.c) as two fp32 FMAs on the widened values, odd element then even: the
 * instruction's own order and rounding, so the same bits (short of subnormals, which it flushes).
 * By default on Intel CPUs, whose cores issue vdpbf16ps at a quarter of their zmm FMAs' rate
 * (Emerald Rapids: 1.46 vs 5.82 G/s a core, 47 vs 93 multiply-adds a ns); AMD's issue both at one
 * rate, so the instruction's two products a lane win there. */
int pg_bf16_fma(void);
/* 1 where the small-M rows read one weight stream at a time: the AVX-512 VNNI rows on the
 * column-lane copy (cpu_qgemv_cl.c) one 16-column tile for up to 8 input rows at M <= 8 (else two
 * tiles for up to 4), and the AVX-512 fp32 / bf16 weight rows (cpu_gemv.c) one weight row at M <= 2 (else
 * four); and where tree attention's items (cpu_attention.c) read whole cache rows instead of one
 * kv head's or a few tokens' when the context's pieces give every thread two items anyway.  By
 * default on x86 CPUs but Intel's: Zen 4 read several streams 1.2-1.5x slower than one from
 * DRAM at M = 1; the Xeon was measured against more streams only, and keeps its tiles and plans
 * (so does aarch64, not measured).
 * The same bits either way (each output's chain is the same; items only schedule). */
int pg_one_stream(void);
/* 1 where tier avx512_bf16 multiplies bf16 weights that carry an AMX copy (cpu_gemv_amx.c), and a
 * bf16 cache's q.K where pa_set_amx asks (cpu_attention.c), on AMX tiles: the CPU and OS have
 * AMX-BF16, pg_set_bf16_amx has not turned it off (on by default) and Linux has not refused this
 * process the tile state. */
int pg_bf16_amx(void);
/* Linux's permission for this process to use the tile data: asked once, by the first AMX copy
 * (pg_amx_repack) or by pa_set_amx(1) (PRESCIENT_ATTN_AMX=1 at load), not otherwise at load: a
 * process holding it ran tests/runtime/test_pd_split.py's fp32 split engine (no AMX instruction
 * run) slower, and that file's speculation test failed in 2 of 7 runs (0 of 9 without), so only
 * processes that multiply bf16 on tiles ask. */
__attribute__((visibility("hidden")))
int pg_amx_granted(void);
/* Load an AMX tile configuration (palette 1) on this thread: tiles 0 .. n - 1 `rows` high, the
 * others 16, every one 64 bytes wide (cpu_gemv_amx.c; PG_AMX builds only, called only where
 * pg_bf16_amx()).  Each caller releases the tiles (_tile_release) when its task ends. */
__attribute__((visibility("hidden")))
void pg_amx_config(int n, int rows);
/* Threads per pool call, the caller included. */
int pg_num_threads(void);

typedef void (*pg_task_fn)(const void *ctx, int i0, int i1);
/* task(ctx, i0, i1) over items [0, n) in chunks of >= per_chunk items on the shared pool;
 * returns when all are done.  One call at a time uses the pool; a concurrent caller runs its
 * items on its own thread.  ctx must stay valid until return (it may live on the stack). */
__attribute__((visibility("hidden")))
void pg_parallel_for(pg_task_fn task, const void *ctx, int n, int per_chunk);
/* pg_parallel_for after pre(ctx, i, i + 1) for i in [0, npre) (more than 256: on the caller first), on the same pool
 * call: the task's first chunk starts once every pre item is done (one hand-off for both
 * phases: the pre items are spread over the threads, then the task's chunks). */
__attribute__((visibility("hidden")))
void pg_parallel_for_pre(pg_task_fn pre, int npre, pg_task_fn task, const void *ctx, int n, int per_chunk);

#endif
