/*
 * cpu_attention.h -- the entry points of cpu_attention.c and their argument structs, shared by
 * cpu_layer.c (the fused layer calls them directly).  The Python wrappers mirror the structs
 * field for field (_ARGS, _STORE_ARGS in cpu_attention.py) and check PA_VERSION.
 */
#ifndef PRESCIENT_CPU_ATTENTION_H
#define PRESCIENT_CPU_ATTENTION_H

#include <stdint.h>

#define PA_VERSION 3

/* Cache dtype code of an int8 cache with per-(position, kv head) scales (fp32 and bf16 caches
 * use DT_F32 / DT_BF16 of cpu_runtime.h). */
#define PA_KV_I8 8

/* pa_args_t.flags: the caller knows the pool's cores are taken (torch's own OpenMP workers spin
 * there during multi-threaded forwards): sharing them would leave the caller waiting for workers
 * that get part of a core, or none.  The fused layer's elementwise ops honour it too. */
#define PA_SOLO 1

/* pa_tree_attention's arguments, one buffer (one ctypes argument instead of twenty: each costs
 * ~70 ns and the op runs once per layer). */
typedef struct {
    int64_t q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, mask_bits, out;
    int64_t q_stride_tok, q_stride_head;  /* elements; head_dim is contiguous */
    int64_t num_tokens, num_heads, head_dim, num_kv_heads, num_blocks, block_size;
    int64_t num_seqs, max_blocks, num_words, dtype;
    int64_t flags;                        /* PA_SOLO: run on the calling thread only */
    int64_t k_scale, v_scale;             /* [num_blocks, block_size, num_kv_heads] fp32, int8 only */
    int64_t kv_dtype;                     /* dtype (q's) or PA_KV_I8 */
    double scale;
} pa_args_t;

/* pa_store_kv_i8's arguments. */
typedef struct {
    int64_t k, v, k_cache, v_cache, k_scale, v_scale, slots;
    int64_t k_stride_tok, k_stride_head, v_stride_tok, v_stride_head;  /* elements */
    int64_t num_tokens, num_kv_heads, head_dim, num_slots, dtype;      /* dtype of k and v */
} pa_store_args_t;

/* out = tree attention of q over the paged K/V (docs/CONTRACTS.md); 0 or -(code + 8 * seq). */
int pa_tree_attention(const pa_args_t *a);
/* Quantize k, v rows into an int8 cache and its scales; 0 or -(code + 8 * token). */
int pa_store_kv_i8(const pa_store_args_t *a);
int pa_version(void);
/* A bf16 cache's q.K on AMX tiles (1) or not (0, the default; -1: unchanged); returns whether it
 * is in use now. */
int pa_set_amx(int on);

#endif
