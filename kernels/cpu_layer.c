/*
 * cpu_layer.c -- one decoder layer of a Llama-family model (Llama, SmolLM2, Qwen2) in one
 * native call, for any forward of up to PL_MAX_T tokens: decode steps, verify trees, prefill
 * chunks.
 *
 * Role: the CPU twin of the layer loop of runtime/model.py (LlamaModel.forward), called by
 * kernels/cpu_layer.py.  There a decode step makes ~30 torch ops per layer; at batch 1 each
 * costs microseconds of dispatch while the GEMVs stream weights at DRAM speed, so the
 * dispatch was ~40% of a step.  Here the small ops are plain loops, the matrix products go to
 * pg_linear_w (cpu_dispatch.c: any weight format that has a pg_weight_t) and the
 * attention to pa_tree_attention (cpu_attention.c) -- the very kernels the torch path calls,
 * so the two paths share their numerics and only the glue between them is new.
 *
 * One layer, in place on h [T, hidden]:
 *   x = rms_norm(h) * attn_norm; qkv = x @ Wqkv^T (+ bias); rope(q, k); cache[slot] = k, v;
 *   a = tree_attention(q, cache); h += a @ Wo^T;
 *   x = rms_norm(h) * mlp_norm; [g | u] = x @ Wgu^T; h += (silu(g) * u) @ Wdown^T.
 * Wo and Wdown may come as two column groups (o_b / down_b from input column o_cut /
 * down_cut: the shards of TP=2): each group's product in fp32, the two added once and
 * rounded, as the all-reduce of two shards does -- so TP=1 and TP=2 get the same bits.
 * Entry points: pl_layer (one layer: tensor parallelism would all-reduce between calls),
 * pl_layers (every layer in one call), pl_final_norm (the model's last RMSNorm, of the rows
 * whose logits are wanted), pl_forward (token ids to logits: the embedding, RoPE rows, every
 * layer, the final norm and the LM head in one call), pl_profile (section timers for
 * latency_bench/step_profile.py).
 *
 * Numerics mirror the torch forward op by op: every torch op's output is rounded to the model
 * dtype (bf16: round to nearest even) at the same point, with the op computed in fp32 as
 * torch's CPU kernels do for bf16 (a bf16 x bf16 product is exact in fp32, so one rounding of
 * it is what torch does too); the RMSNorm's fp32 sum of squares is summed in torch's own order
 * (torch_row_sum) and RoPE's addcmul is a fused multiply-add as in torch.  The one fp32
 * function computed differently is exp() in SiLU: torch's vectorised expf is good to about an
 * ulp, here exp is evaluated in double and rounded (the correctly rounded value); the torch
 * loop calls this file's SiLU (pl_silu_mul) on CPU, so the two paths agree bit for bit.
 *
 * Threads: the linears and the attention use the shared pool (pg_parallel_for); so does the
 * elementwise work of a step of PL_PAR_T rows or more (prefill chunks), split by rows
 * (pl_rows: rows are independent, so the split changes no bits), and a decode step's, a few
 * microseconds, runs on the caller.  No state: scratch space is the
 * caller's (pl_scratch_bytes), so calls on different scratch may run concurrently.
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <pthread.h>

#include "cpu_bf16.h"
#include "cpu_dispatch.h"
#include "cpu_runtime.h"
#include "cpu_attention.h"

#define PL_VERSION 6

/* Most tokens of one call (a sanity bound: the scratch the caller passes is sized for the T it
 * calls with, pl_scratch_bytes).  The linears run PG_MAX_M rows at a time (the GEMV kernels' M
 * bound): every kernel on this path gives a row the same bits whatever the call's T, so a
 * row computes alike alone, in a batch of decodes, beside a verify tree or in a prefill chunk
 * (batch invariance).  Prefill chunks are at most 512 + 64 tokens by default (the scheduler's
 * prefill_chunk; an EAGLE head's feature collection uses ~1024). */
#define PL_MAX_T 2048

/* Keep in step with _Step in cpu_layer.py.  What one forward shares across its layers:
 * shapes, the tokens' RoPE rows and KV slots, the attention's batch metadata, h and the
 * scratch buffer.  Addresses are int64 (the Python side fills them from data_ptr()). */
typedef struct {
    int64_t T, hidden, num_heads, num_kv_heads, head_dim, inter, dtype;
    int64_t h;             /* [T, hidden] model dtype, updated in place */
    int64_t cos, sin;      /* [T, head_dim] model dtype: the tokens' RoPE rows */
    int64_t slot_mapping;  /* [T] int64, negative = do not store */
    int64_t block_tables, context_lens, cu_seqlens_q, mask_bits;  /* tree_attention's */
    int64_t num_seqs, max_blocks, num_words, num_blocks, block_size;
    int64_t attn_flags;    /* pa_args_t.flags (PA_SOLO) */
    int64_t sum_lanes;     /* torch's Vectorized<float> width in its row sums (torch_row_sum) */
    int64_t scratch;       /* pl_scratch_bytes(...) bytes, 64-byte aligned */
    double eps, scale;     /* RMSNorm epsilon (as torch: rounded to fp32), attention scale */
} pl_step_t;

/* Keep in step with _LayerArgs in cpu_layer.py: one layer's weights and KV cache, built once,
 * and the step it runs in (one argument per call: through ctypes each costs ~70 ns). */
typedef struct {
    const pl_step_t *step;
    const pg_weight_t *qkv, *o, *gate_up, *down;
    /* TP-invariant sums (runtime/linear.ColumnGroups): when o_b / down_b is set, o / down hold
     * the input columns [0, cut) and o_b / down_b the columns [cut, K); the two fp32 partials
     * are added once and rounded, as a TP=2 all-reduce of the two ranks' halves adds them. */
    const pg_weight_t *o_b, *down_b;
    int64_t o_cut, down_cut;
    const void *attn_norm, *mlp_norm;  /* [hidden] model dtype */
    const void *qkv_bias;              /* [qkv_out] model dtype or NULL: added after the
                                          linear's rounding, as runtime/linear.py does */
    void *k_cache, *v_cache;           /* [num_blocks, block_size, num_kv_heads, head_dim]:
                                          the model dtype, or int8 with... */
    float *k_scale, *v_scale;          /* ...these [num_blocks, block_size, num_kv_heads]
                                          scales (--kv-dtype int8); NULL for a float cache */
} pl_layer_args;

/* pa_args_t, pa_store_args_t and the attention entry points: cpu_attention.h. */
#define PL_PA_VERSION PA_VERSION

/* Errors of this file are positive; the attention kernel's are negative and passed on. */
enum { PL_EARGS = 1, PL_ESLOT = 2, PL_ELINEAR = 3, PL_ENOMEM = 4, PL_EIDS = 5 };

/* ------------------------------------------------------------------------- */
/* Scratch layout                                                             */
/* ------------------------------------------------------------------------- */

typedef struct {
    char *x;     /* [T, hidden] normed input of a linear */
    char *qkv;   /* [T, (H + 2 KVH) D] q, k roped in place */
    char *attn;  /* [T, H D] attention output */
    char *y;     /* [T, hidden] o / down output */
    char *gu;    /* [T, 2 I] gate | up */
    char *act;   /* [T, I] silu(gate) * up */
    char *sq;    /* [hidden] fp32: one row's squares (RMSNorm), or x * cos (fp32 RoPE) */
    char *gx;    /* [T, max(H D, I)] fp32: a split linear's input, its column groups one after the other */
    char *gy;    /* [2, T, hidden] fp32: the split linear's two partial outputs */
    char *hw;    /* pl_forward's: [T, hidden] model dtype, h */
    char *cs;    /* [2, T, head_dim] model dtype: the tokens' cos rows, then their sin rows */
    char *e32;   /* [T, hidden] fp32: a block-format embedding's rows; the LM head's input */
    char *xn;    /* [T, hidden] model dtype: the final norm of the logits rows */
} pl_bufs_t;

static size_t pad64(size_t n) { return (n + 63) & ~(size_t)63; }

static size_t layout(const pl_step_t *s, int64_t T, char *base, pl_bufs_t *b)
{
    const size_t esz = s->dtype == DT_F32 ? 4 : 2;
    const size_t qkv = (size_t)(s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
    const size_t sizes[13] = {
        (size_t)T * s->hidden * esz, (size_t)T * qkv * esz,
        (size_t)T * s->num_heads * s->head_dim * esz, (size_t)T * s->hidden * esz,
        (size_t)T * 2 * s->inter * esz, (size_t)T * s->inter * esz,
        (size_t)(s->hidden > s->head_dim ? s->hidden : s->head_dim) * 4,
        (size_t)T * (size_t)(s->num_heads * s->head_dim > s->inter ? s->num_heads * s->head_dim : s->inter) * 4,
        (size_t)2 * T * s->hidden * 4, (size_t)T * s->hidden * esz, (size_t)2 * T * s->head_dim * esz,
        (size_t)T * s->hidden * 4, (size_t)T * s->hidden * esz};
    char **slot[13] = {&b->x, &b->qkv, &b->attn, &b->y, &b->gu, &b->act, &b->sq, &b->gx, &b->gy,
                       &b->hw, &b->cs, &b->e32, &b->xn};
    size_t off = 0;
    for (int i = 0; i < 13; i++) {
        *slot[i] = base ? base + off : NULL;
        off += pad64(sizes[i]);
    }
    return off;
}

/* Bytes of scratch a step of up to max_tokens tokens needs (the step's T is ignored). */
int64_t pl_scratch_bytes(const pl_step_t *s, int64_t max_tokens)
{
    pl_bufs_t b;
    return (int64_t)layout(s, max_tokens, NULL, &b);
}

/* ------------------------------------------------------------------------- */
/* Elementwise pieces, one loop per dtype (plain loops: -O3 vectorises them)  */
/* ------------------------------------------------------------------------- */

#define PL_MAX_LANES 16

/* sum(x[0 .. n)) in the order of torch's CPU sum of a contiguous fp32 row (SumKernel.cpp:
 * cascade_sum -> vectorized_inner_sum, Vectorized<float> of L lanes): the row is read as
 * vectors, vector i added into accumulator i % 4 ("ilp"), accumulators cascaded into three
 * more levels every 16 rows of 4 vectors (multi_row_sum), the 4 folded in order, then the
 * scalar tail and the L lanes added in order to 0.  L = 1 is torch's scalar path (rows shorter
 * than a vector).  The same fp32 sum bit for bit is what keeps the bf16 RMSNorm, and with it
 * greedy decoding, identical to the torch path (cpu_layer.py checks L against torch once). */
static inline __attribute__((always_inline)) float row_sum_lanes(const float *x, int n, const int L)
{
    const int nv = n / L, rows = nv / 4;
    float acc[4][4][PL_MAX_LANES];  /* [level][ilp][lane] */
    memset(acc, 0, sizeof(acc));
    const int ceil_log2 = rows <= 2 ? 1 : 64 - __builtin_clzll((unsigned long long)rows - 1);
    const int power = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4;
    const int step = 1 << power;
    int i = 0;
    while (i + step <= rows) {
        for (int j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < L; l++)
                    acc[0][k][l] += x[(size_t)(i * 4 + k) * L + l];
        for (int lv = 1; lv < 4; lv++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < L; l++) {
                    acc[lv][k][l] += acc[lv - 1][k][l];
                    acc[lv - 1][k][l] = 0.f;
                }
            if (i & ((step - 1) << (lv * power)))
                break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < L; l++)
                acc[0][k][l] += x[(size_t)(i * 4 + k) * L + l];
    for (int lv = 1; lv < 4; lv++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < L; l++)
                acc[0][k][l] += acc[lv][k][l];
    for (int v = rows * 4; v < nv; v++)
        for (int l = 0; l < L; l++)
            acc[0][0][l] += x[(size_t)v * L + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < L; l++)
            acc[0][0][l] += acc[0][k][l];
    float s = 0.f;
    for (int e = nv * L; e < n; e++)
        s += x[e];
    for (int l = 0; l < L; l++)
        s += acc[0][0][l];
    return s;
}

/* Compiled for L = 8 and 16 (the vectors' width a constant: whole registers), any L else. */
static float torch_row_sum(const float *x, int n, int L)
{
    if (n < L)
        return row_sum_lanes(x, n, 1);
    if (L == 8)
        return row_sum_lanes(x, n, 8);
    if (L == 16)
        return row_sum_lanes(x, n, 16);
    return row_sum_lanes(x, n, L);
}

/* mean(x^2) of a row as torch's x.pow(2).mean(-1): the squares rounded to fp32 first (pow
 * materialises them; written to sq so that no multiply-add contracts them into the sum), the
 * sum in torch's order, then divided by n. */
static float mean_sq(const void *x, int dt, int n, float *sq, int lanes)
{
    if (dt == DT_F32) {
        const float *xf = (const float *)x;
        for (int i = 0; i < n; i++)
            sq[i] = xf[i] * xf[i];
    } else {
        const uint16_t *xb = (const uint16_t *)x;
        for (int i = 0; i < n; i++) {
            const float v = bf16_to_f32(xb[i]);
            sq[i] = v * v;
        }
    }
    return torch_row_sum(sq, n, lanes) / (float)n;
}

/* For cpu_layer.py's check of the lane count against torch: mean(x[0..n)^2) as rms_norm
 * takes it. */
float pl_mean_sq(const float *x, int n, int lanes, float *sq)
{
    return mean_sq(x, DT_F32, n, sq, lanes < 1 ? 1 : lanes > PL_MAX_LANES ? PL_MAX_LANES : lanes);
}

/* out = rms_norm(h) * w, row by row, r = 1 / sqrt(mean(x^2) + eps) in fp32 (torch's rsqrt:
 * a correctly rounded sqrt, then the division).  fp32: F.rms_norm, (x * r) * w.  bf16 (the
 * model's _rms_norm): x * r rounded to bf16, then w times that, rounded. */
static void rms_norm(const pl_step_t *s, const void *h, const void *w, void *out, int T, float *sq)
{
    const int n = (int)s->hidden, L = (int)s->sum_lanes;
    const float eps = (float)s->eps;
    for (int t = 0; t < T; t++) {
        if (s->dtype == DT_F32) {
            const float *x = (const float *)h + (size_t)t * n;
            const float *wf = (const float *)w;
            float *o = (float *)out + (size_t)t * n;
            const float r = 1.f / sqrtf(mean_sq(x, DT_F32, n, sq, L) + eps);
            for (int i = 0; i < n; i++)
                o[i] = x[i] * r * wf[i];
        } else {
            const uint16_t *x = (const uint16_t *)h + (size_t)t * n;
            const uint16_t *wb = (const uint16_t *)w;
            uint16_t *o = (uint16_t *)out + (size_t)t * n;
            const float r = 1.f / sqrtf(mean_sq(x, DT_BF16, n, sq, L) + eps);
            for (int i = 0; i < n; i++) {
                const float xn = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * r));
                o[i] = f32_to_bf16(bf16_to_f32(wb[i]) * xn);
            }
        }
    }
}

/* y += b over [T, n] (bias after the linear's own rounding, then rounded again). */
static void add_rows(int dt, void *y, const void *b, int T, int n, int bstride)
{
    for (int t = 0; t < T; t++) {
        if (dt == DT_F32) {
            float *yr = (float *)y + (size_t)t * n;
            const float *br = (const float *)b + (size_t)t * bstride;
            for (int i = 0; i < n; i++)
                yr[i] = yr[i] + br[i];
        } else {
            uint16_t *yr = (uint16_t *)y + (size_t)t * n;
            const uint16_t *br = (const uint16_t *)b + (size_t)t * bstride;
            for (int i = 0; i < n; i++)
                yr[i] = f32_to_bf16(bf16_to_f32(yr[i]) + bf16_to_f32(br[i]));
        }
    }
}

/* Rope.apply on the q and k heads of every token, in place in the qkv rows (rotate-half
 * layout): y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].  As torch does it:
 * x * cos rounded to the dtype, then addcmul in fp32 (one fused multiply-add; for bf16 the
 * product is exact anyway), rounded once. */
static void rope(const pl_step_t *s, char *qkv, int T, float *xc)
{
    const int D = (int)s->head_dim, half = D / 2;
    const int nh = (int)(s->num_heads + s->num_kv_heads);
    const size_t row = (size_t)(s->num_heads + 2 * s->num_kv_heads) * D;
    for (int t = 0; t < T; t++) {
        if (s->dtype == DT_F32) {
            const float *c = (const float *)(intptr_t)s->cos + (size_t)t * D;
            const float *sn = (const float *)(intptr_t)s->sin + (size_t)t * D;
            for (int hh = 0; hh < nh; hh++) {
                float *x = (float *)qkv + t * row + (size_t)hh * D;
                /* x * cos is its own torch op (rounded, and stored so that nothing fuses it
                 * into the next line); torch's fp32 addcmul is one fused multiply-add */
                for (int d = 0; d < D; d++)
                    xc[d] = x[d] * c[d];
                for (int d = 0; d < half; d++) {
                    const float x1 = x[d], x2 = x[d + half];
                    x[d] = fmaf(-x2, sn[d], xc[d]);
                    x[d + half] = fmaf(x1, sn[d + half], xc[d + half]);
                }
            }
        } else {
            const uint16_t *c = (const uint16_t *)(intptr_t)s->cos + (size_t)t * D;
            const uint16_t *sn = (const uint16_t *)(intptr_t)s->sin + (size_t)t * D;
            for (int hh = 0; hh < nh; hh++) {
                uint16_t *x = (uint16_t *)qkv + t * row + (size_t)hh * D;
                uint16_t y[512];
                for (int d = 0; d < half; d++) {
                    const float x1 = bf16_to_f32(x[d]), x2 = bf16_to_f32(x[d + half]);
                    /* bf16 x bf16 products are exact in fp32: no fused-multiply-add question */
                    const float a1 = bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(c[d])));
                    const float a2 = bf16_to_f32(f32_to_bf16(x2 * bf16_to_f32(c[d + half])));
                    y[d] = f32_to_bf16(a1 + -x2 * bf16_to_f32(sn[d]));
                    y[d + half] = f32_to_bf16(a2 + x1 * bf16_to_f32(sn[d + half]));
                }
                memcpy(x, y, (size_t)D * 2);
            }
        }
    }
}

/* k and v rows of every token into the paged cache (cache row = slot, [KVH, D] per row). */
static int store_kv(const pl_step_t *s, const pl_layer_args *a, const char *qkv, int T)
{
    const size_t esz = s->dtype == DT_F32 ? 4 : 2;
    const size_t D = (size_t)s->head_dim, kv = (size_t)s->num_kv_heads * D;
    const size_t row = (size_t)(s->num_heads + 2 * s->num_kv_heads) * D;
    const int64_t *slots = (const int64_t *)(intptr_t)s->slot_mapping;
    const int64_t nslots = s->num_blocks * s->block_size;
    if (a->k_scale) {  /* int8 cache: quantized per (token, kv head) as ops.store_kv does */
        const pa_store_args_t st = {
            .k = (int64_t)(intptr_t)(qkv + (size_t)s->num_heads * D * esz),
            .v = (int64_t)(intptr_t)(qkv + ((size_t)s->num_heads * D + kv) * esz),
            .k_cache = (int64_t)(intptr_t)a->k_cache, .v_cache = (int64_t)(intptr_t)a->v_cache,
            .k_scale = (int64_t)(intptr_t)a->k_scale, .v_scale = (int64_t)(intptr_t)a->v_scale,
            .slots = s->slot_mapping, .k_stride_tok = (int64_t)row, .k_stride_head = (int64_t)D,
            .v_stride_tok = (int64_t)row, .v_stride_head = (int64_t)D, .num_tokens = T,
            .num_kv_heads = s->num_kv_heads, .head_dim = s->head_dim, .num_slots = nslots,
            .dtype = s->dtype};
        const int rc = pa_store_kv_i8(&st);
        return rc == 0 ? 0 : (-rc) % 8 == 2 ? PL_ESLOT : PL_EARGS;
    }
    for (int t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0)
            continue;
        if (slot >= nslots)
            return PL_ESLOT;
        const char *k = qkv + (t * row + (size_t)s->num_heads * D) * esz;
        memcpy((char *)a->k_cache + (size_t)slot * kv * esz, k, kv * esz);
        memcpy((char *)a->v_cache + (size_t)slot * kv * esz, k + kv * esz, kv * esz);
    }
    return 0;
}

/* Trapping-math semantics (the default) keep gcc from turning the clamp below into a blend, so
 * the SiLU loop would stay scalar; nothing here reads the floating-point exception flags. */
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

/* e^x rounded to fp32, evaluated in double: the correctly rounded value bar ~1 input in 10^8
 * (measured over every float; torch's own expf agrees with it on 99% of inputs).  x is clamped
 * where fp32 e^x is 0 or inf anyway; in double one reduction step r = x - n ln2 loses nothing
 * a float result could see, and Taylor to r^10 on |r| <= ln2 / 2 is good to 1e-13.
 * Branch-free so that the SiLU loop vectorises. */
static inline float exp_f32(float xf)
{
    xf = xf < -104.f ? -104.f : xf;
    xf = xf > 89.f ? 89.f : xf;
    const double x = xf;
    const double shift = 6755399441055744.0;  /* 1.5 * 2^52: adding it rounds to an integer */
    const double kd = x * 1.4426950408889634 + shift;
    const double n = kd - shift;
    const double r = x - n * 0.6931471805599453;
    double p = 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    int64_t kb;
    memcpy(&kb, &kd, 8);
    const int64_t e = (kb - 0x4338000000000000LL + 1023) << 52;  /* 2^n */
    double scale;
    memcpy(&scale, &e, 8);
    return (float)(p * scale);
}

/* x = silu(x) = x / (1 + e^-x) in fp32, torch's formula. */
static void silu_scalar(float *x, int n)
{
    for (int i = 0; i < n; i++)
        x[i] = x[i] / (1.f + exp_f32(-x[i]));
}

#pragma GCC pop_options

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PL_SILU_V 32  /* floats per step of the SIMD SiLUs: 8 (AVX2) or 4 (AVX-512) double chains */

/* exp_f32's Taylor coefficients after the first, 1/9! down to 1 (Horner from 1/10!), for the
 * SIMD steps. */
static const double PL_EXP_C[10] = {1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0,
                                    1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};

/* exp_f32's arithmetic with its multiply-adds fused (as gcc contracts them where FMA exists),
 * 32 floats a step: the same bits as the scalar loop, contracted or not (checked over all 2^32
 * inputs: the double-precision exp absorbs the difference).  The scalar loop ran ~2.7 ns an
 * element on Zen 3: each element's 11-deep chain of dependent double FMAs left the pipes idle;
 * 8 chains side by side keep them busy (~1.4 ns an element through pl_silu_mul). */
__attribute__((target("avx2,fma"))) static void silu_avx2_step(float *x)
{
    const __m256d shift = _mm256_set1_pd(6755399441055744.0), l2e = _mm256_set1_pd(1.4426950408889634);
    const __m256d ln2 = _mm256_set1_pd(0.6931471805599453);
    const __m256i bias = _mm256_set1_epi64x(1023 - 0x4338000000000000LL);
    __m128 v[8];
    __m256d kd[8], r[8], p[8];
    for (int q = 0; q < 8; q++) {
        v[q] = _mm_loadu_ps(x + 4 * q);
        __m128 a = _mm_xor_ps(v[q], _mm_set1_ps(-0.f));
        a = _mm_min_ps(_mm_max_ps(a, _mm_set1_ps(-104.f)), _mm_set1_ps(89.f));
        const __m256d xd = _mm256_cvtps_pd(a);
        kd[q] = _mm256_fmadd_pd(xd, l2e, shift);
        r[q] = _mm256_fnmadd_pd(_mm256_sub_pd(kd[q], shift), ln2, xd);
        p[q] = _mm256_set1_pd(1.0 / 3628800.0);
    }
    for (int i = 0; i < 10; i++)
        for (int q = 0; q < 8; q++)
            p[q] = _mm256_fmadd_pd(p[q], r[q], _mm256_set1_pd(PL_EXP_C[i]));
    for (int q = 0; q < 8; q++) {
        const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(_mm256_castpd_si256(kd[q]), bias), 52);
        const __m128 ex = _mm256_cvtpd_ps(_mm256_mul_pd(p[q], _mm256_castsi256_pd(e)));
        _mm_storeu_ps(x + 4 * q, _mm_div_ps(v[q], _mm_add_ps(_mm_set1_ps(1.f), ex)));
    }
}

/* silu_avx2_step's arithmetic on 8-lane double vectors: 4 chains of 8 instead of 8 of 4, half
 * the instructions an element (the same operations per element, so the same bits). */
__attribute__((target("avx512f,avx512dq,avx2,fma"))) static void silu_avx512_step(float *x)
{
    const __m512d shift = _mm512_set1_pd(6755399441055744.0), l2e = _mm512_set1_pd(1.4426950408889634);
    const __m512d ln2 = _mm512_set1_pd(0.6931471805599453);
    const __m512i bias = _mm512_set1_epi64(1023 - 0x4338000000000000LL);
    __m256 v[4];
    __m512d kd[4], r[4], p[4];
    for (int q = 0; q < 4; q++) {
        v[q] = _mm256_loadu_ps(x + 8 * q);
        __m256 a = _mm256_xor_ps(v[q], _mm256_set1_ps(-0.f));
        a = _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(-104.f)), _mm256_set1_ps(89.f));
        const __m512d xd = _mm512_cvtps_pd(a);
        kd[q] = _mm512_fmadd_pd(xd, l2e, shift);
        r[q] = _mm512_fnmadd_pd(_mm512_sub_pd(kd[q], shift), ln2, xd);
        p[q] = _mm512_set1_pd(1.0 / 3628800.0);
    }
    for (int i = 0; i < 10; i++)
        for (int q = 0; q < 4; q++)
            p[q] = _mm512_fmadd_pd(p[q], r[q], _mm512_set1_pd(PL_EXP_C[i]));
    for (int q = 0; q < 4; q++) {
        const __m512i e = _mm512_slli_epi64(_mm512_add_epi64(_mm512_castpd_si512(kd[q]), bias), 52);
        const __m256 ex = _mm512_cvtpd_ps(_mm512_mul_pd(p[q], _mm512_castsi512_pd(e)));
        _mm256_storeu_ps(x + 8 * q, _mm256_div_ps(v[q], _mm256_add_ps(_mm256_set1_ps(1.f), ex)));
    }
}

/* Every element through step (a last partial step via a zero-padded copy), so an element's
 * bits do not depend on where n ends. */
static void silu_steps(float *x, int n, void (*step)(float *))
{
    int i = 0;
    for (; i + PL_SILU_V <= n; i += PL_SILU_V)
        step(x + i);
    if (i < n) {
        float t[PL_SILU_V] = {0};
        memcpy(t, x + i, (size_t)(n - i) * 4);
        step(t);
        memcpy(x + i, t, (size_t)(n - i) * 4);
    }
}
#endif

/* The tier's SiLU: AVX-512 from ISA_AVX512, AVX2 + FMA from ISA_AVX2, else the scalar loop
 * (the same bits). */
static void silu_f32(float *x, int n)
{
#if defined(__x86_64__) || defined(__i386__)
    if (pg_isa() >= ISA_AVX512) {
        silu_steps(x, n, silu_avx512_step);
        return;
    }
    if (pg_isa() >= ISA_AVX2) {
        silu_steps(x, n, silu_avx2_step);
        return;
    }
#endif
    silu_scalar(x, n);
}

/* bf16(silu_f32(g)) for every bf16 bit pattern g: a bf16 gate has only 65536 values, so its
 * rounded SiLU is looked up instead of computed (~1 ns an element through the double-precision
 * exp, a tenth of an 8-token verify's layer glue).  Built once, by silu_f32 itself: the same
 * bits as computing it, at every tier (silu_f32's bits do not depend on the tier). */
static uint16_t g_silu_bf16[65536];
static pthread_once_t g_silu_once = PTHREAD_ONCE_INIT;

static void build_silu_bf16(void)
{
    float buf[256];
    for (int i0 = 0; i0 < 65536; i0 += 256) {
        for (int i = 0; i < 256; i++)
            buf[i] = bf16_to_f32((uint16_t)(i0 + i));
        silu_f32(buf, 256);
        for (int i = 0; i < 256; i++)
            g_silu_bf16[i0 + i] = f32_to_bf16(buf[i]);
    }
}

/* act = silu(gate) * up, gu = [gate | up] per token; bf16: silu rounded (g_silu_bf16), then the
 * product rounded.  fp32: through a buffer, as the functions above are compiled with other
 * options and gcc inlines nothing across that line. */
static void silu_mul(const pl_step_t *s, const char *gu, char *act, int T)
{
    if (s->dtype != DT_F32)
        pthread_once(&g_silu_once, build_silu_bf16);
    const int I = (int)s->inter;
    float buf[256];
    for (int t = 0; t < T; t++) {
        for (int i0 = 0; i0 < I; i0 += 256) {
            const int n = I - i0 < 256 ? I - i0 : 256;
            if (s->dtype == DT_F32) {
                const float *g = (const float *)gu + (size_t)t * 2 * I + i0, *u = g + I;
                float *o = (float *)act + (size_t)t * I + i0;
                memcpy(buf, g, (size_t)n * 4);
                silu_f32(buf, n);
                for (int i = 0; i < n; i++)
                    o[i] = buf[i] * u[i];
            } else {
                const uint16_t *g = (const uint16_t *)gu + (size_t)t * 2 * I + i0, *u = g + I;
                uint16_t *o = (uint16_t *)act + (size_t)t * I + i0;
                uint16_t sg[256];
                for (int i = 0; i < n; i++)  /* the lookups apart: the product loop vectorises */
                    sg[i] = g_silu_bf16[g[i]];
                for (int i = 0; i < n; i++)
                    o[i] = f32_to_bf16(bf16_to_f32(sg[i]) * bf16_to_f32(u[i]));
            }
        }
    }
}

/* ------------------------------------------------------------------------- */
/* The elementwise ops over the pool                                          */
/* ------------------------------------------------------------------------- */

/* Rows from which a step's elementwise ops run on the pool: below it, a pool hand-off (~1-2 us)
 * costs about what the split saves. */
#define PL_PAR_T 16

enum { PR_NORM, PR_ADD, PR_ROPE, PR_SILU };

/* One elementwise op of a step over rows [0, T): out = op(x, w) as rms_norm / add_rows (out
 * += x, x's rows bstride apart) / rope (out = qkv, in place) / silu_mul (x = gu). */
typedef struct {
    int op;
    const pl_step_t *s;
    const void *x, *w;
    void *out;
    int n, bstride;  /* add_rows' */
} pl_rows_t;

/* Rows [t0, t1) of the op: its pointers moved to row t0, its own scratch row. */
static void rows_task(const void *ctx, int t0, int t1)
{
    const pl_rows_t *c = (const pl_rows_t *)ctx;
    const pl_step_t *s = c->s;
    const size_t esz = s->dtype == DT_F32 ? 4 : 2;
    const int T = t1 - t0;
    switch (c->op) {
    case PR_NORM: {
        float sq[s->hidden];  /* one row's squares (the step's b.sq is one row: not shared here) */
        rms_norm(s, (const char *)c->x + (size_t)t0 * s->hidden * esz, c->w,
                 (char *)c->out + (size_t)t0 * s->hidden * esz, T, sq);
        break;
    }
    case PR_ADD:
        add_rows((int)s->dtype, (char *)c->out + (size_t)t0 * c->n * esz,
                 (const char *)c->x + (size_t)t0 * c->bstride * esz, T, c->n, c->bstride);
        break;
    case PR_ROPE: {
        pl_step_t r = *s;  /* cos and sin rows from t0 */
        r.cos += (int64_t)((size_t)t0 * s->head_dim * esz);
        r.sin += (int64_t)((size_t)t0 * s->head_dim * esz);
        const size_t row = (size_t)(s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
        float xc[s->head_dim];  /* x * cos of one head */
        rope(&r, (char *)c->out + (size_t)t0 * row * esz, T, xc);
        break;
    }
    default:
        silu_mul(s, (const char *)c->x + (size_t)t0 * 2 * s->inter * esz,
                 (char *)c->out + (size_t)t0 * s->inter * esz, T);
    }
}

/* The op over rows [0, T): split over the pool from PL_PAR_T rows, on the caller below that or
 * when the step says so (PA_SOLO: torch's own threads hold the cores, see cpu_attention.py). */
static void pl_rows(const pl_rows_t *c, int T)
{
    const int nth = pg_num_threads();
    if (T < PL_PAR_T || nth < 2 || (c->s->attn_flags & PA_SOLO)) {
        rows_task(c, 0, T);
        return;
    }
    int per = (T + 2 * nth - 1) / (2 * nth);
    pg_parallel_for(rows_task, c, T, per < 4 ? 4 : per);
}

/* ------------------------------------------------------------------------- */
/* Linears                                                                    */
/* ------------------------------------------------------------------------- */

/* A cpu_dispatch.c code (0, -1, -2) as this file's: 0, PL_ELINEAR or PL_ENOMEM. */
static inline int linear_rc(int rc)
{
    return rc == 0 ? 0 : rc == -2 ? PL_ENOMEM : PL_ELINEAR;
}

/* y[T, N] = x[T, K] @ W^T, x and y of dtype dt (pg_linear_rows: kernel calls of at most
 * PG_MAX_M rows, whose rows are independent, so how they are cut changes no bits).  0, or
 * PL_ENOMEM / PL_ELINEAR. */
static int run_linear(const pg_weight_t *w, const char *x, char *y, int T, int dt)
{
    return linear_rc(pg_linear_rows(w, x, y, T, dt));
}

/* split_linear's elementwise parts over rows [t0, t1): widen x's rows into the two groups'
 * fp32 inputs (phase 0), or round the sum of the two partials into y (phase 1). */
typedef struct {
    int phase, dt;
    int64_t K, cut, N;
    const char *x;
    char *y;
    float *xa, *xb, *ya, *yb;
} pl_split_t;

static void split_task(const void *ctx, int t0, int t1)
{
    const pl_split_t *c = (const pl_split_t *)ctx;
    const int64_t K = c->K, cut = c->cut, K1 = K - cut, N = c->N;
    for (int t = t0; t < t1; t++) {
        if (c->phase == 0) {
            float *xa = c->xa + (size_t)t * cut, *xb = c->xb + (size_t)t * K1;
            if (c->dt == DT_F32) {
                const float *xr = (const float *)c->x + (size_t)t * K;
                memcpy(xa, xr, (size_t)cut * 4);
                memcpy(xb, xr + cut, (size_t)K1 * 4);
            } else {
                const uint16_t *xr = (const uint16_t *)c->x + (size_t)t * K;
                for (int64_t i = 0; i < cut; i++)
                    xa[i] = bf16_to_f32(xr[i]);
                for (int64_t i = 0; i < K1; i++)
                    xb[i] = bf16_to_f32(xr[cut + i]);
            }
        } else {
            const float *ya = c->ya + (size_t)t * N, *yb = c->yb + (size_t)t * N;
            if (c->dt == DT_F32) {
                float *yr = (float *)c->y + (size_t)t * N;
                for (int64_t i = 0; i < N; i++)
                    yr[i] = ya[i] + yb[i];
            } else {
                uint16_t *yr = (uint16_t *)c->y + (size_t)t * N;
                for (int64_t i = 0; i < N; i++)
                    yr[i] = f32_to_bf16(ya[i] + yb[i]);
            }
        }
    }
}

/* split_task over rows [0, T): on the pool from PL_PAR_T rows, as pl_rows. */
static void split_rows(const pl_split_t *c, const pl_step_t *s, int T)
{
    const int nth = pg_num_threads();
    if (T < PL_PAR_T || nth < 2 || (s->attn_flags & PA_SOLO)) {
        split_task(c, 0, T);
        return;
    }
    const int per = (T + 2 * nth - 1) / (2 * nth);
    pg_parallel_for(split_task, c, T, per < 4 ? 4 : per);
}

/* The row-parallel linears (o, down) as two column groups: y = round(x[:, :cut] @ W0^T +
 * x[:, cut:] @ W1^T), each partial fp32 (its input widened to fp32, exact), the two added once.
 * A TP=2 step computes the same two partials on its two ranks and all-reduces them (a sum of
 * two terms: the same bits in either order), so TP=1 and TP=2 round the same value.  w1 NULL:
 * one linear, as before. */
static int split_linear(const pl_step_t *s, const pl_bufs_t *b, const pg_weight_t *w0,
                        const pg_weight_t *w1, int64_t cut, const char *x, char *y, int T)
{
    const int dt = (int)s->dtype;
    if (!w1)
        return run_linear(w0, x, y, T, dt);
    const int64_t K = w0->K + w1->K, N = w0->N;
    if (cut != w0->K || w1->N != N)
        return PL_EARGS;
    float *xa = (float *)b->gx, *ya = (float *)b->gy;
    pl_split_t c = {0, dt, K, cut, N, x, y, xa, xa + (size_t)T * cut, ya, ya + (size_t)T * N};
    split_rows(&c, s, T);
    int rc;
    if (T <= PG_MAX_M && w0->wdt >= DT_Q_FIRST && w1->wdt >= DT_Q_FIRST)
        /* a decode step's or a verify's rows: both groups in one pool call */
        rc = linear_rc(pq_linear_w2(w0, c.xa, c.ya, w1, c.xb, c.yb, T, DT_F32));
    else if (!(rc = run_linear(w0, (const char *)c.xa, (char *)c.ya, T, DT_F32)))
        rc = run_linear(w1, (const char *)c.xb, (char *)c.yb, T, DT_F32);
    if (rc)
        return rc;
    c.phase = 1;
    split_rows(&c, s, T);
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Public entry points                                                        */
/* ------------------------------------------------------------------------- */

/* Step profile (latency_bench/step_profile.py): nanoseconds spent in the GEMVs, the attention
 * and the glue between them, summed over calls while on.  Plain globals: a profiling run makes
 * one forward at a time. */
enum { PL_GEMV = 0, PL_ATTN = 1, PL_GLUE = 2, PL_NPROF = 3 };
static int g_prof = 0;
static int64_t g_prof_ns[PL_NPROF];

static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The time since the last lap goes to section `what` (when profiling). */
#define PL_LAP(what) \
    do { \
        if (prof) { \
            const int64_t t1 = now_ns(); \
            g_prof_ns[(what)] += t1 - t; \
            t = t1; \
        } \
    } while (0)

/* Turn the profile on (1) or off (0); out[0..3) gets the totals so far (gemv, attention, glue
 * ns), which are then reset. */
void pl_profile(int on, int64_t *out)
{
    for (int i = 0; i < PL_NPROF; i++) {
        if (out)
            out[i] = g_prof_ns[i];
        g_prof_ns[i] = 0;
    }
    g_prof = on;
}

int pl_version(void) { return PL_VERSION; }

int pl_max_tokens(void) { return PL_MAX_T; }

/* sizeof(pl_step_t) (0) and sizeof(pl_layer_args) (1): cpu_layer.py checks its mirrors. */
int64_t pl_struct_bytes(int which) { return which ? (int64_t)sizeof(pl_layer_args) : (int64_t)sizeof(pl_step_t); }

/* The pa_args_t version this file was written against (cpu_layer.py compares it with
 * pa_version() before it runs anything). */
int pl_pa_version(void) { return PL_PA_VERSION; }

/*
 * One decoder layer on the step's h, in place.  0 on success; PL_E* (> 0) for bad shapes, a
 * slot outside the cache or a failed linear; pa_tree_attention's negative code
 * (-(code + 8 * sequence)) for bad attention metadata.  On error h may be partly updated.
 */
int pl_layer(const pl_layer_args *a)
{
    const pl_step_t *s = a->step;
    const int T = (int)s->T, dt = (int)s->dtype;
    if (T < 1 || T > PL_MAX_T || (dt != DT_F32 && dt != DT_BF16) || s->head_dim % 2 ||
        s->head_dim > 512 || s->hidden < 1 || s->inter < 1 || s->num_kv_heads < 1 ||
        s->num_heads % s->num_kv_heads || !s->scratch || s->sum_lanes < 1 ||
        s->sum_lanes > PL_MAX_LANES)
        return PL_EARGS;
    const int64_t D = s->head_dim, H = s->num_heads, KVH = s->num_kv_heads;
    const int64_t nqkv = (H + 2 * KVH) * D;
    const int64_t o_k = a->o->K + (a->o_b ? a->o_b->K : 0);
    const int64_t down_k = a->down->K + (a->down_b ? a->down_b->K : 0);
    if (a->qkv->N != nqkv || a->qkv->K != s->hidden || a->o->N != s->hidden ||
        o_k != H * D || a->gate_up->N != 2 * s->inter || a->gate_up->K != s->hidden ||
        a->down->N != s->hidden || down_k != s->inter)
        return PL_EARGS;
    pl_bufs_t b;
    layout(s, T, (char *)(intptr_t)s->scratch, &b);
    char *h = (char *)(intptr_t)s->h;
    const int prof = g_prof;
    int64_t t = prof ? now_ns() : 0;
    int rc;
#define PL_LINEAR(w, w1, cut, x, y) \
    do { \
        PL_LAP(PL_GLUE); \
        if ((rc = split_linear(s, &b, (w), (w1), (cut), (x), (y), T))) \
            return rc; \
        PL_LAP(PL_GEMV); \
    } while (0)

    const pl_rows_t norm1 = {PR_NORM, s, h, a->attn_norm, b.x, 0, 0};
    pl_rows(&norm1, T);
    PL_LINEAR(a->qkv, NULL, 0, b.x, b.qkv);
    if (a->qkv_bias) {
        const pl_rows_t bias = {PR_ADD, s, a->qkv_bias, NULL, b.qkv, (int)nqkv, 0};
        pl_rows(&bias, T);
    }
    const pl_rows_t roped = {PR_ROPE, s, NULL, NULL, b.qkv, 0, 0};
    pl_rows(&roped, T);
    if ((rc = store_kv(s, a, b.qkv, T)))
        return rc;
    const pa_args_t pa = {
        .q = (int64_t)(intptr_t)b.qkv, .k_cache = (int64_t)(intptr_t)a->k_cache,
        .v_cache = (int64_t)(intptr_t)a->v_cache, .block_tables = s->block_tables,
        .context_lens = s->context_lens, .cu_seqlens_q = s->cu_seqlens_q,
        .mask_bits = s->mask_bits, .out = (int64_t)(intptr_t)b.attn,
        .q_stride_tok = nqkv, .q_stride_head = D,
        .num_tokens = T, .num_heads = H, .head_dim = D, .num_kv_heads = KVH,
        .num_blocks = s->num_blocks, .block_size = s->block_size, .num_seqs = s->num_seqs,
        .max_blocks = s->max_blocks, .num_words = s->num_words, .dtype = dt,
        .flags = s->attn_flags, .k_scale = (int64_t)(intptr_t)a->k_scale,
        .v_scale = (int64_t)(intptr_t)a->v_scale, .kv_dtype = a->k_scale ? PA_KV_I8 : dt,
        .scale = s->scale};
    PL_LAP(PL_GLUE);
    if ((rc = pa_tree_attention(&pa)))
        return rc;
    PL_LAP(PL_ATTN);
    PL_LINEAR(a->o, a->o_b, a->o_cut, b.attn, b.y);
    const pl_rows_t residual = {PR_ADD, s, b.y, NULL, h, (int)s->hidden, (int)s->hidden};
    pl_rows(&residual, T);

    const pl_rows_t norm2 = {PR_NORM, s, h, a->mlp_norm, b.x, 0, 0};
    pl_rows(&norm2, T);
    PL_LINEAR(a->gate_up, NULL, 0, b.x, b.gu);
    const pl_rows_t act = {PR_SILU, s, b.gu, NULL, b.act, 0, 0};
    pl_rows(&act, T);
    PL_LINEAR(a->down, a->down_b, a->down_cut, b.act, b.y);
    pl_rows(&residual, T);
    PL_LAP(PL_GLUE);
    return 0;
#undef PL_LINEAR
}

/* out[i] = rms_norm(h[rows[i]]) * w for i < n: the model's final norm of the rows whose logits
 * are wanted, as the torch path's _rms_norm(h[logits_indices], norm) (the same rounding
 * points).  0, or PL_EARGS for a row outside [0, T). */
int pl_final_norm(const pl_step_t *s, const void *w, const int64_t *rows, int n, void *out)
{
    if (n < 0 || s->T < 1 || s->T > PL_MAX_T || !s->scratch || s->sum_lanes < 1 ||
        s->sum_lanes > PL_MAX_LANES || (s->dtype != DT_F32 && s->dtype != DT_BF16))
        return PL_EARGS;
    pl_bufs_t b;
    layout(s, s->T, (char *)(intptr_t)s->scratch, &b);
    const size_t row = (size_t)s->hidden * (s->dtype == DT_F32 ? 4 : 2);
    for (int i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= s->T)
            return PL_EARGS;
        rms_norm(s, (const char *)(intptr_t)s->h + (size_t)rows[i] * row, w, (char *)out + i * row, 1,
                 (float *)b.sq);
    }
    return 0;
}

/* act[T, I] = silu(gate) * up of gu[T, 2 I] = [gate | up] rows, in dtype dt: the fused layer's
 * own SiLU for the torch layer loop (runtime/model.py), so that the loop (prefill, and tensor-
 * parallel ranks) and the fused layer give the same bits in fp32 too.  0, or PL_EARGS. */
int pl_silu_mul(const void *gu, void *act, int64_t T, int64_t I, int dt)
{
    if (T < 0 || I < 1 || (dt != DT_F32 && dt != DT_BF16))
        return PL_EARGS;
    pl_step_t s;
    memset(&s, 0, sizeof(s));
    s.inter = I;
    s.dtype = dt;
    silu_mul(&s, (const char *)gu, (char *)act, (int)T);
    return 0;
}

/* Layers a[0 .. n) in order (one call per step instead of n).  0, or the first error. */
int pl_layers(const pl_layer_args *a, int n)
{
    for (int i = 0; i < n; i++) {
        const int rc = pl_layer(&a[i]);
        if (rc)
            return rc;
    }
    return 0;
}

/* ------------------------------------------------------------------------- */
/* A whole forward: token ids to logits                                       */
/* ------------------------------------------------------------------------- */

/* Keep in step with _ForwardArgs in cpu_layer.py.  What runtime/model.CpuForward.forward
 * composes around pl_layers, in one call:
 *   h = embed(ids): a block-format table's rows dequantized to fp32 and rounded to the model
 *       dtype (embed_tokens: dequantize_rows(ids).to(dtype)), or a model-dtype table's rows;
 *   the step's cos / sin = the RoPE tables' rows at the positions (Rope.tables);
 *   h = layers(h); x = rms_norm(h[rows]) * norm (pl_final_norm);
 *   logits = fp32(x) @ W_head^T (LlamaModel._logits: a native head gets fp32 rows).
 * The same kernels and rounding points as those calls, so the same bits; after the layers
 * have streamed every weight through the caches, each of the ~40 torch and ctypes calls it
 * replaces costs several times its warm time (0.3-0.4 ms a decode step in all, Zen 4).  h, the
 * RoPE rows and the norm's output live in the step's scratch. */
typedef struct {
    pl_step_t *step;                    /* the layers' step: T and the attention's metadata set */
    const pl_layer_args *layers;        /* [num_layers], each with this step */
    int64_t num_layers;
    const int64_t *ids, *positions;     /* [T] */
    const pg_weight_t *embed_q;         /* a block-format embedding table [vocab, hidden], or NULL: */
    const void *embed;                  /* ... a [vocab, hidden] model-dtype table */
    int64_t vocab;                      /* the table's rows */
    const void *cos_table, *sin_table;  /* [max_pos, head_dim] model dtype */
    int64_t max_pos;
    const void *norm;                   /* [hidden] model dtype */
    const int64_t *rows;                /* [num_rows] rows of h whose logits are wanted */
    int64_t num_rows;
    const pg_weight_t *head;            /* [N, hidden] */
    float *logits;                      /* [num_rows, N] */
} pl_forward_args;

/* 0; PL_EARGS for bad shapes, PL_EIDS for a token id or position outside its table, or the
 * first error of the layers, the final norm (a row outside [0, T)) or the head's linear. */
int pl_forward(const pl_forward_args *f)
{
    pl_step_t *s = f->step;
    if (!s || !f->layers || f->num_layers < 1 || !s->scratch || s->T < 1 || s->T > PL_MAX_T ||
        (s->dtype != DT_F32 && s->dtype != DT_BF16) || f->num_rows < 0 || f->num_rows > s->T || !f->head ||
        f->head->K != s->hidden || !f->cos_table || !f->sin_table || !f->norm ||
        (f->embed_q ? f->embed_q->K != s->hidden || f->embed_q->N != f->vocab : !f->embed))
        return PL_EARGS;
    for (int64_t i = 0; i < f->num_layers; i++)
        if (f->layers[i].step != s)
            return PL_EARGS;
    const int T = (int)s->T, dt = (int)s->dtype;
    const int64_t H = s->hidden, D = s->head_dim;
    const size_t esz = dt == DT_F32 ? 4 : 2, hrow = (size_t)H * esz, drow = (size_t)D * esz;
    const int prof = g_prof;  /* the head's GEMV and this glue in pl_profile's sections too */
    int64_t t = prof ? now_ns() : 0;
    for (int i = 0; i < T; i++)
        if (f->ids[i] < 0 || f->ids[i] >= f->vocab || f->positions[i] < 0 || f->positions[i] >= f->max_pos)
            return PL_EIDS;
    pl_bufs_t b;
    layout(s, T, (char *)(intptr_t)s->scratch, &b);
    if (f->embed_q) {
        float *e = (float *)b.e32;
        if (pq_dequantize_ids(f->embed_q, f->ids, T, e))
            return PL_EARGS;
        if (dt == DT_F32)
            memcpy(b.hw, e, (size_t)T * H * 4);
        else
            for (size_t i = 0; i < (size_t)T * H; i++)
                ((uint16_t *)b.hw)[i] = f32_to_bf16(e[i]);
    } else {
        for (int i = 0; i < T; i++)
            memcpy(b.hw + i * hrow, (const char *)f->embed + (size_t)f->ids[i] * hrow, hrow);
    }
    for (int i = 0; i < T; i++) {
        memcpy(b.cs + i * drow, (const char *)f->cos_table + (size_t)f->positions[i] * drow, drow);
        memcpy(b.cs + (T + i) * drow, (const char *)f->sin_table + (size_t)f->positions[i] * drow, drow);
    }
    s->h = (int64_t)(intptr_t)b.hw;
    s->cos = (int64_t)(intptr_t)b.cs;
    s->sin = (int64_t)(intptr_t)(b.cs + T * drow);
    PL_LAP(PL_GLUE);
    int rc = pl_layers(f->layers, (int)f->num_layers);  /* (its own sections) */
    const int n = (int)f->num_rows;
    if (rc || n == 0)
        return rc;
    if (prof)
        t = now_ns();
    if ((rc = pl_final_norm(s, f->norm, f->rows, n, b.xn)))
        return rc;
    const char *x = b.xn;
    if (dt == DT_BF16) {
        for (size_t i = 0; i < (size_t)n * H; i++)
            ((float *)b.e32)[i] = bf16_to_f32(((const uint16_t *)b.xn)[i]);
        x = b.e32;
    }
    PL_LAP(PL_GLUE);
    rc = run_linear(f->head, x, (char *)f->logits, n, DT_F32);
    PL_LAP(PL_GEMV);
    return rc;
}

int64_t pl_forward_args_bytes(void) { return (int64_t)sizeof(pl_forward_args); }

/* ------------------------------------------------------------------------- */
/* The EAGLE head's step (speculative/eagle_head.py, HeadRunner.step_at)      */
/* ------------------------------------------------------------------------- */

/* Keep in step with _HeadArgs in kernels/cpu_head.py.  One call of the draft head over n rows:
 *   x = fc([embed | feature]); qkv = x @ Wqkv^T; rope(q, k); K/V rows -> k_buf/v_buf[start..);
 *   a = attention over rows [0, free) (all) and [free, start + n) (as `attend` marks them);
 *   h = x + a @ Wo^T; h += down(silu(gate) * up) of rms_norm(h) * mlp_norm;
 *   logits = lm_head(h[logit_rows]).
 * fp32 throughout (the head drafts; its numbers need not match anything bit for bit, and the
 * tests compare it with the torch arithmetic of HeadRunner.step).  The step's T is n, its
 * dtype fp32, its cos/sin unused (the rows are gathered here from the tables by position). */
typedef struct {
    const pl_step_t *step;
    const pg_weight_t *fc, *qkv, *o, *gate_up, *down, *lm_head;
    const float *mlp_norm;            /* [hidden] */
    const float *embeds, *feats;      /* [n, hidden] each */
    const float *cos_table, *sin_table;  /* [max_pos, head_dim] */
    const int64_t *positions;         /* [n] */
    float *k_buf;                     /* [KVH D, cap]: K transposed (a position a column) */
    float *v_buf;                     /* [cap, KVH D] */
    int64_t cap, start, free_rows;
    const uint8_t *attend;            /* [n, start + n - free_rows] or NULL: causal over the
                                         new rows, every earlier row */
    const int64_t *logit_rows;        /* [num_logit_rows] rows of h in [0, n) */
    int64_t num_logit_rows, max_pos;  /* num_logit_rows < 0: every row, in order */
    float *h;                         /* [n, hidden] out: f^ */
    float *logits;                    /* [num_logit_rows, draft vocab] out */
} pl_head_args;

/* Query rows (of one kv head) per block: each K^T row loaded once for all of them. */
#define PH_QB 8

/* Bytes of scratch a head step of up to n rows over up to `rows` K/V rows needs: the layer's
 * buffers (fp32), the [n, 2 hidden] input, the gathered RoPE rows and a query block's scores. */
int64_t pl_head_scratch_bytes(const pl_step_t *s, int64_t n, int64_t rows)
{
    pl_bufs_t b;
    return (int64_t)(layout(s, n, NULL, &b) + pad64((size_t)n * 2 * s->hidden * 4) +
                     2 * pad64((size_t)n * s->head_dim * 4) + pad64((size_t)PH_QB * rows * 4));
}

/* e^x in fp32 for the head's softmax (x <= 0 there): Cody-Waite reduction and a degree-6
 * polynomial, ~2 ulp; branch-free so that the loops calling it vectorise.  The head drafts, so
 * its softmax need not match torch's bits (the tests allow 1e-5). */
static inline __attribute__((always_inline)) float head_exp(float x)
{
    x = x < -87.f ? -87.f : x;
    /* round to nearest by adding 1.5 * 2^23 (no libm call: the loops stay vectorised) */
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    static const float c[6] = {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};  /* Horner from 1/6! */
    float p = 1.f / 720.f;
    for (int i = 0; i < 6; i++)
        p = p * r + c[i];
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}


/* The head attention's two products in one shape: c_j[x] = sum over k < K of a_j[k] b[k ldb + x]
 * for NQ rows j and x < X, 16 x at a time, the 16 sums one vector per row over k (NQ a constant,
 * so gcc unrolls the row loop; each b segment loaded once for the NQ rows). The scores are
 * a = q, b = K^T (x a position); P.V is a = the weights, b = V (x a column). */
static inline __attribute__((always_inline)) void head_axb(const float *const *a, const float *b, int64_t ldb,
                                                           int64_t K, int64_t X, float *const *c, const int NQ)
{
    int64_t x0 = 0;
    for (; x0 + 16 <= X; x0 += 16) {
        float acc[PH_QB][16] = {{0}};
        for (int64_t k = 0; k < K; k++) {
            const float *br = b + k * ldb + x0;
            for (int j = 0; j < NQ; j++) {
                const float ak = a[j][k];
                for (int l = 0; l < 16; l++)
                    acc[j][l] += ak * br[l];
            }
        }
        for (int j = 0; j < NQ; j++)
            memcpy(c[j] + x0, acc[j], 64);
    }
    for (int j = 0; j < NQ; j++)  /* the last x, fewer than 16 */
        for (int64_t x = x0; x < X; x++) {
            float v = 0.f;
            for (int64_t k = 0; k < K; k++)
                v += a[j][k] * b[k * ldb + x];
            c[j][x] = v;
        }
}

#define PH_NQ_CASES(F) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8)

/* out[t, head] = softmax(q . K^T * scale over the rows row t may see) @ V.  K is kept
 * transposed (k_buf [KVH D, cap]: a position's keys down a column), so a block of queries'
 * scores grow 16 positions a vector with one broadcast q element a step and no horizontal
 * sums; V rows are [cap, KVH D].  The queries of one kv head go PH_QB at a time (its heads'
 * rows of up to PH_QB / rep tokens).  sc: [PH_QB, end] scores.  The body is compiled once per
 * tier (the wrappers below), its fixed-size loops vectorised by gcc for that tier's registers. */
typedef void (*ph_axb_fn)(const float *const *, const float *, int64_t, int64_t, int64_t, float *const *, const int);

static inline __attribute__((always_inline)) void head_attention_body(const pl_step_t *s, const pl_head_args *a,
                                                                      const float *qkv, float *out, float *sc,
                                                                      ph_axb_fn axb)
{
    const int64_t n = s->T, D = s->head_dim, H = s->num_heads, KVH = s->num_kv_heads, rep = H / KVH;
    const int64_t kv = KVH * D, row = (H + 2 * KVH) * D, cap = a->cap;
    const int64_t start = a->start, free = a->free_rows, end = start + n, wid = end - free;
    const float scale = (float)s->scale;
    for (int64_t g = 0; g < KVH; g++) {
        for (int64_t j0 = 0; j0 < n * rep; j0 += PH_QB) {
            const int nq = n * rep - j0 < PH_QB ? (int)(n * rep - j0) : PH_QB;
            const float *q[PH_QB];
            float *o[PH_QB], *srow[PH_QB];
            int64_t tok[PH_QB];
            for (int j = 0; j < nq; j++) {  /* query j0 + j: token (j0 + j) / rep, head g rep + r */
                const int64_t head = g * rep + (j0 + j) % rep;
                tok[j] = (j0 + j) / rep;
                q[j] = qkv + tok[j] * row + head * D;
                o[j] = out + tok[j] * H * D + head * D;
                srow[j] = sc + j * end;
            }
            const float *kt = a->k_buf + g * D * cap;
            switch (nq) {  /* scores: q [nq, D] @ K^T [D, end] */
#define PH_CASE(NQ) case NQ: axb(q, kt, cap, D, end, srow, NQ); break;
                PH_NQ_CASES(PH_CASE)
#undef PH_CASE
            }
            for (int j = 0; j < nq; j++) {
                float *sj = sc + j * end;
                const int64_t t = tok[j];
                const uint8_t *m = a->attend ? a->attend + t * wid : NULL;
                for (int64_t p = 0; p < free; p++)
                    sj[p] *= scale;
                for (int64_t p = free; p < end; p++) {
                    const int see = m ? m[p - free] != 0 : (p < start || p <= start + t);
                    sj[p] = see ? sj[p] * scale : -INFINITY;
                }
                float mx = -INFINITY;
                for (int64_t p = 0; p < end; p++)
                    mx = sj[p] > mx ? sj[p] : mx;
                float sum = 0.f;
                for (int64_t p = 0; p < end; p++) {
                    const float e = head_exp(sj[p] - mx);
                    sj[p] = sj[p] == -INFINITY ? 0.f : e;
                    sum += sj[p];
                }
                const float inv = 1.f / sum;
                for (int64_t p = 0; p < end; p++)
                    sj[p] *= inv;
            }
            const float *v = a->v_buf + g * D;
            switch (nq) {  /* weights [nq, end] @ V [end, D] */
#define PH_CASE(NQ) case NQ: axb((const float *const *)srow, v, kv, end, D, o, NQ); break;
                PH_NQ_CASES(PH_CASE)
#undef PH_CASE
            }
        }
    }
}

#if defined(__x86_64__) || defined(__i386__)
/* head_axb in AVX-512 (16 x a vector) and AVX2 (8), the NQ accumulators in registers: gcc's own
 * vectorisation of the plain loops spilled them to the stack. */
#define PH_SIMD(NAME, TGT, VT, W, ZERO, LOAD, STORE, SET1, FMA) \
TGT static inline __attribute__((always_inline)) void NAME(const float *const *a, const float *b, int64_t ldb, \
        int64_t K, int64_t X, float *const *c, const int NQ) \
{ \
    int64_t x0 = 0; \
    for (; x0 + W <= X; x0 += W) { \
        VT acc[PH_QB]; \
        for (int j = 0; j < NQ; j++) \
            acc[j] = ZERO; \
        for (int64_t k = 0; k < K; k++) { \
            const VT br = LOAD(b + k * ldb + x0); \
            for (int j = 0; j < NQ; j++) \
                acc[j] = FMA(SET1(a[j][k]), br, acc[j]); \
        } \
        for (int j = 0; j < NQ; j++) \
            STORE(c[j] + x0, acc[j]); \
    } \
    for (int j = 0; j < NQ; j++) \
        for (int64_t x = x0; x < X; x++) { \
            float v = 0.f; \
            for (int64_t k = 0; k < K; k++) \
                v += a[j][k] * b[k * ldb + x]; \
            c[j][x] = v; \
        } \
}

PH_SIMD(ph512_axb, __attribute__((target("avx512f,avx512dq,avx2,fma"))), __m512, 16, _mm512_setzero_ps(),
        _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps)
PH_SIMD(ph256_axb, __attribute__((target("avx2,fma"))), __m256, 8, _mm256_setzero_ps(),
        _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps)
#undef PH_SIMD

__attribute__((target("avx512f,avx512dq,avx2,fma"))) static void head_attention_avx512(
    const pl_step_t *s, const pl_head_args *a, const float *qkv, float *out, float *sc)
{
    head_attention_body(s, a, qkv, out, sc, ph512_axb);
}

__attribute__((target("avx2,fma"))) static void head_attention_avx2(
    const pl_step_t *s, const pl_head_args *a, const float *qkv, float *out, float *sc)
{
    head_attention_body(s, a, qkv, out, sc, ph256_axb);
}
#endif

static void head_attention(const pl_step_t *s, const pl_head_args *a, const float *qkv, float *out, float *sc)
{
#if defined(__x86_64__) || defined(__i386__)
    if (pg_isa() >= ISA_AVX512) {
        head_attention_avx512(s, a, qkv, out, sc);
        return;
    }
    if (pg_isa() >= ISA_AVX2) {
        head_attention_avx2(s, a, qkv, out, sc);
        return;
    }
#endif
    head_attention_body(s, a, qkv, out, sc, head_axb);
}

/* The head's step (see pl_head_args).  0, PL_EARGS for bad shapes or rows past the buffers, or
 * a linear's error. */
int pl_head_step(const pl_head_args *a)
{
    const pl_step_t *s = a->step;
    const int64_t n = s->T, hid = s->hidden, D = s->head_dim, H = s->num_heads, KVH = s->num_kv_heads;
    const int64_t kv = KVH * D, row = (H + 2 * KVH) * D, end = a->start + n;
    const int rows_given = a->num_logit_rows >= 0;
    const int64_t nl = rows_given ? a->num_logit_rows : n;
    if (n < 1 || n > PL_MAX_T || s->dtype != DT_F32 || D % 2 || D > 512 || KVH < 1 || H % KVH || !s->scratch ||
        s->sum_lanes < 1 || s->sum_lanes > PL_MAX_LANES || a->free_rows < 0 || a->free_rows > a->start ||
        end > a->cap || a->fc->N != hid || a->fc->K != 2 * hid || a->qkv->N != row || a->qkv->K != hid ||
        a->o->N != hid || a->o->K != H * D || a->gate_up->N != 2 * s->inter || a->gate_up->K != hid ||
        a->down->N != hid || a->down->K != s->inter || a->lm_head->K != hid || nl < 0 || nl > n)
        return PL_EARGS;
    for (int64_t i = 0; i < n; i++)
        if (a->positions[i] < 0 || a->positions[i] >= a->max_pos)
            return PL_EARGS;
    for (int64_t i = 0; rows_given && i < nl; i++)
        if (a->logit_rows[i] < 0 || a->logit_rows[i] >= n)
            return PL_EARGS;
    pl_bufs_t b;
    char *base = (char *)(intptr_t)s->scratch;
    const size_t used = layout(s, n, base, &b);
    float *ef = (float *)(base + used);
    float *cs = (float *)((char *)ef + pad64((size_t)n * 2 * hid * 4));
    float *sn = (float *)((char *)cs + pad64((size_t)n * D * 4));
    float *sc = (float *)((char *)sn + pad64((size_t)n * D * 4));
    pl_step_t st = *s;  /* this step's RoPE rows */
    st.cos = (int64_t)(intptr_t)cs;
    st.sin = (int64_t)(intptr_t)sn;
    for (int64_t i = 0; i < n; i++) {
        memcpy(ef + i * 2 * hid, a->embeds + i * hid, (size_t)hid * 4);
        memcpy(ef + i * 2 * hid + hid, a->feats + i * hid, (size_t)hid * 4);
        memcpy(cs + i * D, a->cos_table + a->positions[i] * D, (size_t)D * 4);
        memcpy(sn + i * D, a->sin_table + a->positions[i] * D, (size_t)D * 4);
    }
    float *h = a->h;
    int rc;
    if ((rc = run_linear(a->fc, (const char *)ef, (char *)h, (int)n, DT_F32)) ||
        (rc = run_linear(a->qkv, (const char *)h, b.qkv, (int)n, DT_F32)))
        return rc;
    rope(&st, b.qkv, (int)n, (float *)b.sq);
    const float *qkv = (const float *)b.qkv;
    for (int64_t i = 0; i < n; i++) {  /* K down column start + i, V as row start + i */
        for (int64_t c = 0; c < kv; c++)
            a->k_buf[c * a->cap + a->start + i] = qkv[i * row + H * D + c];
        memcpy(a->v_buf + (a->start + i) * kv, qkv + i * row + H * D + kv, (size_t)kv * 4);
    }
    head_attention(&st, a, qkv, (float *)b.attn, sc);
    if ((rc = run_linear(a->o, b.attn, b.y, (int)n, DT_F32)))
        return rc;
    add_rows(DT_F32, h, b.y, (int)n, (int)hid, (int)hid);
    rms_norm(&st, h, a->mlp_norm, b.x, (int)n, (float *)b.sq);
    if ((rc = run_linear(a->gate_up, b.x, b.gu, (int)n, DT_F32)))
        return rc;
    silu_mul(&st, b.gu, b.act, (int)n);
    if ((rc = run_linear(a->down, b.act, b.y, (int)n, DT_F32)))
        return rc;
    add_rows(DT_F32, h, b.y, (int)n, (int)hid, (int)hid);
    const float *src = h;
    if (rows_given) {  /* the wanted rows, contiguous */
        for (int64_t i = 0; i < nl; i++)
            memcpy((float *)b.x + i * hid, h + a->logit_rows[i] * hid, (size_t)hid * 4);
        src = (const float *)b.x;
    }
    return nl ? run_linear(a->lm_head, (const char *)src, (char *)a->logits, (int)nl, DT_F32) : 0;
}
