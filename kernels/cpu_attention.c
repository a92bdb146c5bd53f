/*
 * cpu_attention.c -- paged-KV tree attention on CPU: decode tokens, draft trees and short
 * prefill chunks of every sequence of a batch in one call.
 *
 * Role: the CPU twin of triton_tree_attention.py, with the semantics of
 * reference.tree_attention (docs/CONTRACTS.md).  The torch reference loops over sequences
 * in Python, gathers and upcasts K/V and runs two matmuls; here a work item (a sequence,
 * a block of its query tokens, its kv heads -- all of them unless the accumulators would
 * outgrow L1/L2 --, a piece of its context) streams its K/V rows straight out of the paged
 * cache once: each K/V row is loaded once and used by the kv head's whole GQA group of
 * query heads for all the item's query tokens.
 *
 * Numerics: flash-attention style online softmax in fp32 (running max m, running sum l,
 * unnormalised fp32 accumulator), so no [q, ctx] score matrix exists.  Scores are taken
 * in the base-2 domain (q.k * scale * log2 e, then 2^x), which is the same softmax; m moves
 * only when a score passes it by more than PA_LAZY (so weights stay below 2^8).  For
 * bf16, q.k runs on AMX tiles where asked (pa_set_amx) and the CPU has AMX-BF16 (the tile unit's
 * own summation, the same on every path), else uses vdpbf16ps where the CPU has it (bf16 products
 * are exact in fp32, the sums are fp32; or its two FMAs, the same bits: pg_bf16_fma) and fp32
 * FMAs on the widened values otherwise.  P.V on a bf16 cache at tier avx512_bf16 rounds P to bf16
 * (as the GPU kernel's P @ V in the cache dtype; the row sums add the rounded P) and adds the
 * positions in pairs by vdpbf16ps or its two FMAs (bf16_rest): half the multiply-adds' issue
 * slots of fp32 P.  A weight moves by up to 2^-8 of itself (bf16's 8 significant bits), the output
 * by up to ~2^-7 of sum_j P_j |V_j| / l with the renormalisation (random data: ~2^-9).  Unlike the
 * Triton kernel, whose row sums add the unrounded P, the sums here add the rounded weights.  Every
 * other P.V is fp32.  A bf16 output is rounded once, to nearest even.
 *
 * Layout of one step (AVX-512 and portable; AVX2 takes q.K from the rows, see its section):
 * 16 consecutive context positions (a "chunk"; they may straddle KV
 * blocks) of one kv head are transposed into [head_dim / 2][16] bf16 pairs (or
 * [head_dim][16] fp32) so that one zmm of 16 scores per query row comes out of
 * broadcast-q x K-column products with no horizontal sums; the softmax update runs on that
 * zmm, and P.V reads V rows in place with the accumulators in registers.  A bf16 V row is
 * widened in registers as its even and odd elements (a shift and a mask per 32 values), so
 * the accumulators hold each 32-wide block of head_dim as [even | odd] halves, put back in
 * order once, when the output row is stored; vdpbf16ps' P.V (pv_chunk_dp) holds them in
 * vpunpck{l,h}wd's lanes instead (pa_job_t's perm).
 *
 * Memory: an item walks all the kv heads of its positions together (heads are adjacent in
 * a cache row), so each 16-position block of the cache streams in as one contiguous piece,
 * and the next chunk's rows are prefetched into L2 (PA_PF) while the current one computes: K/V
 * of all the layers do not fit in cache, and waiting for them was the largest cost without this.
 *
 * Pieces and threads: a row's context is cut into pieces at fixed positions (PA_PIECE:
 * [0, 256), [256, 512), ...); each piece runs its own online softmax from scratch, and the
 * pieces' partial (m, l, acc) are folded in order by one function (fold_piece).  Work items
 * run on cpu_runtime.c's pool (pg_parallel_for; both files build into one .so).  An item is
 * a run of consecutive pieces of one row block; when there are few row blocks (one
 * sequence decoding or verifying a tree) they are first made more (one per kv head, then
 * shorter token blocks, never past a row block's size; where pg_one_stream, only when the
 * pieces alone would leave a thread without two items), then their pieces are spread over
 * several items (flash-decoding) and the caller folds the later items' pieces after the first
 * item's.  That is scheduling only: the pieces and the fold are the same however the items
 * fall.
 *
 * Batch invariance: a query row's output is bitwise the same whatever else is in the call
 * -- other sequences, its place in the batch, the rows sharing its item, being a lone
 * decode step (q_len 1, causal) or a draft-tree node / prefill token (mask_bits, or causal
 * with q_len > 1) -- and whatever the thread count, for a given ISA tier and dtype.  And a
 * draft-tree node, on any branch, gets the bits of the decode step that follows its
 * ancestors once accepted (their K/V moved to prefix, prefix + 1, ...), which a speculative
 * decoder needs to reproduce non-speculative output exactly: in a chunk that holds a tree's
 * new positions, a token whose visible new positions are not 0, 1, ..., k runs alone
 * (tree_chunk), reading them in depth order, so the other branches' positions are no holes
 * in its lanes, chunks or pieces; a chain's tokens are laid out so already.  (A
 * node laid out after another branch's nodes used to see them as holes, which moved its
 * positions to other lanes and chunks: the last bits changed and greedy outputs with
 * branched trees could leave plain decoding's.)  Why it holds: (1) the pieces are fixed positions and
 * their fold a left fold in piece order, so how a call is split never shows; (2) a piece a
 * row sees nothing of (past its last visible position: other rows of its tree need it)
 * folds as nothing, and a position it does not see in a piece it does see adds exact zeros
 * (P = 0 after the mask: l + 0, acc + 0 * V, V being finite); (3) the chunk grid is anchored at position 0
 * in every piece; (4) each row's arithmetic is the same whatever its tile: the q.k kernels
 * keep a fixed number of accumulator chains per row (PA_NA; on AVX2 one chain per score)
 * for any number of rows per tile, an int8 K widened in registers or first into kt is summed in the same
 * order, and the softmax, P.V and store are per row.  The cost: a softmax restart and a
 * fold per 256 positions.  Restarting the running max per piece made it move more often
 * (~10% more time for the rows of long prefill chunks); lazy rescaling (PA_LAZY) takes that
 * back, and more: single-threaded, decode and draft trees run 0-10% faster than the old
 * shape-dependent split, a 64-token chunk at 2k context within a few percent of it.
 *
 * KV dtypes: fp32 and bf16 caches have q's dtype; an int8 cache (any q dtype) holds
 * round(x / s) with one fp32 scale s = amax / 127 per (position, kv head), written by
 * pa_store_kv_i8.  Its values are widened to fp32 in registers (exact), q.k is summed over
 * the raw int8 values and the K scale applied once to the 16 scores of a chunk; the V scale
 * multiplies the softmax weight P (the row sums l keep the unscaled P), so neither scale
 * costs a multiply per element.
 *
 * ISA: per-function target attributes and the run-time ISA of cpu_runtime.c (pg_isa, tiers in
 * cpu_runtime.h), so the same source builds everywhere: ISA_AVX2 runs the AVX2 + FMA step (two
 * ymm of scores per query row, each score a dot product from K's cache row), ISA_AVX512 and up the
 * AVX-512 step, vdpbf16ps (or its FMAs; or AMX tiles, pa_set_amx) for bf16 K from
 * ISA_AVX512_BF16; the portable path is plain C.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <pthread.h>
#include <math.h>

#include "cpu_bf16.h"
#include "cpu_runtime.h"
#include "cpu_attention.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PA_X86 1
#endif

/* One compiled body for every caller of a head step (run_item, tree_chunk): GCC's noipa also
 * rules out a clone specialised for one call site's constants, whose floating-point
 * contractions could differ; other compilers get noinline. */
#if defined(__GNUC__) && !defined(__clang__)
#define PA_ONE_BODY __attribute__((noipa))
#else
#define PA_ONE_BODY __attribute__((noinline))
#endif

#define PA_CHUNK 16       /* context positions per step: one zmm of scores per query row */
#define PA_MAX_ROWS 64    /* query rows per kv head (tokens x group) per item, at head_dim 64 */
#define PA_ACC_FLOATS 16384  /* accumulators of an item (rows x head_dim over its kv heads) */
/* Context positions of one piece: pieces are [p * PA_PIECE, (p + 1) * PA_PIECE), the same
 * for every call (batch invariance; a multiple of PA_CHUNK, so the chunk grid stays anchored
 * at position 0).  Changing it changes results in the last bits. */
#ifndef PA_PIECE
#define PA_PIECE 256
#endif
/* When a call has fewer row blocks than this many per pool thread, their pieces are spread
 * over about that many work items (4 each, so uneven items or a worker that wakes late cost
 * little).  Scheduling only: the numbers do not depend on it. */
#ifndef PA_ITEMS_PER_THREAD
#define PA_ITEMS_PER_THREAD 4
#endif
/* The shortest token block a few-row-block call is cut into (each block reads the context). */
#define PA_MIN_TOKENS 2
/* Software prefetches of cache lines (PA_PF) ask for L2 (locality 2: prefetcht1 on x86), not
 * L1: on the 2-core Zen 4 EPYC, prefetcht0 of the next chunk's K/V lines left a one-token decode
 * at 4k positions reading the cache at ~10 GB/s, prefetcht1 of the same lines at the same
 * distance at ~18-20, and 8 sequences at 900 positions twice as fast (docs/CPU_PERFORMANCE.md,
 * twenty-seventh session).  The lines reach L1 on their demand load, an L2 hit away.  Intel
 * hosts take it too, unmeasured (none here since); other architectures keep the compiler's
 * default (3: pldl1keep on aarch64), not measured there.  -DPA_PF_LOCALITY=3 builds the old way. */
#ifndef PA_PF_LOCALITY
#if defined(__x86_64__) || defined(__i386__)
#define PA_PF_LOCALITY 2
#else
#define PA_PF_LOCALITY 3
#endif
#endif
#define PA_PF(p) __builtin_prefetch((const void *)(p), 0, PA_PF_LOCALITY)
/* How far (context positions) the software prefetch runs ahead of the compute. */
#ifndef PA_PF_POS
#define PA_PF_POS 16
#endif
/* Lazy rescaling: a row's running max m moves only when a score exceeds it by more than this
 * (base 2), so weights 2^(s - m) stay below 2^PA_LAZY -- far from overflowing fp32 -- and the
 * max moves about once per piece instead of at every new record (each move is a horizontal
 * max, an exp2f and a mispredicted branch). */
#define PA_LAZY 8.f
/* AVX-512 q.k tiles: at most PA_MR query rows, PA_NA accumulator chains per row. */
#define PA_MR 6
#define PA_NA 4

enum { PA_EDIMS = 1, PA_ECU = 2, PA_ECTX = 3, PA_EBLOCK = 4, PA_EMASK = 5, PA_ENOMEM = 6,
       PA_ECUEND = 7 };
/* pa_store_kv_i8's (same -(code + 8 * index) form, index a token). */
enum { PS_EDIMS = 1, PS_ESLOT = 2 };

/* PA_KV_I8 (cpu_attention.h): an int8 cache with per-(position, kv head) scales. */

/* Below this much work (query rows x context positions, summed over items) the caller runs
 * alone: handing items to the pool costs about a microsecond. */
static int g_solo_work = 2048;
static int g_attn_amx = 0;  /* pa_set_amx */

/* ------------------------------------------------------------------------- */
/* Call arguments and work items                                              */
/* ------------------------------------------------------------------------- */

/* pa_args_t (cpu_attention.h): the call's arguments, packed by the Python wrapper into one
 * buffer.  Keep in step with _ARGS in cpu_attention.py. */

/* Work item: query tokens [t0, t0 + nt) of sequence seq against kv heads [h0, h0 + nh)
 * (with their G query heads each) over pieces [p0, p1) of the row block's context
 * [0, end).  A row block is one item (all its pieces, part0 = -1: it writes the output) or
 * several, whose partial results go to slots part0 + p and the caller folds them. */
typedef struct {
    int32_t seq, h0, nh, t0, nt;
    int32_t p0, p1, end;
    int32_t part0;     /* the row block's first partial slot, or -1 */
    int64_t cost;      /* rows x positions, for scheduling */
} pa_item_t;

/* A row block split over several items: slot part0 holds the fold of pieces [0, first)
 * (the first item's), slots part0 + p for p in [first, npieces) one piece each. */
typedef struct {
    int32_t seq, h0, nh, t0, nt;
    int32_t part0, first, npieces;
} pa_merge_t;

typedef struct {
    const char *q, *k, *v;
    const int32_t *bt, *cl, *cu, *mask;
    char *out;
    int64_t qs_tok, qs_head;
    const float *ks, *vs;    /* int8 caches: scales [NB * BS][KVH] */
    int T, H, D, KVH, NB, BS, S, MB, W, G, isa;
    int dt, esz;             /* q and out: dtype, bytes per element */
    int kvdt, kesz;          /* the caches: DT_F32, DT_BF16 or PA_KV_I8; bytes per element */
    float scl;               /* scale * log2(e): scores in the base-2 domain */
    const pa_item_t *items;
    float *partials;         /* [nparts][part_stride]: acc [rows][D], m [rows], l [rows] */
    size_t part_stride;
    int perm;                /* accumulators per 32 of head_dim: 1 [even | odd] (bf16 V widened,
                              * AVX-512), 2 vpunpck{l,h}wd's lanes (pv_chunk_dp), 0 in order */
    int dp;                  /* bf16 q x bf16 K, and P (rounded to bf16) x bf16 V in position pairs,
                              * as vdpbf16ps computes them (tier avx512_bf16)... */
    int fma;                 /* ...by its two FMAs (pg_bf16_fma; fp32 q rows), not the instruction */
    int amx;                 /* ...or on AMX tiles (pa_set_amx; bf16 q rows in qb): other bits */
    _Atomic int err;         /* set by an item whose scratch allocation failed */
} pa_job_t;

/* ------------------------------------------------------------------------- */
/* Helpers                                                                    */
/* ------------------------------------------------------------------------- */

/* Per-thread scratch that follows its thread: two slots (0: a work item's buffers, 1: the
 * caller's plan), freed by a key destructor when a pool worker exits. */
typedef struct {
    void *p[2];
    size_t cap[2];
} pa_tls_t;

static pthread_key_t g_key;
static pthread_once_t g_key_once = PTHREAD_ONCE_INIT;

static void tls_free(void *arg)
{
    pa_tls_t *t = (pa_tls_t *)arg;
    free(t->p[0]);
    free(t->p[1]);
    free(t);
}

static void make_key(void) { pthread_key_create(&g_key, tls_free); }

static void *tls_scratch(int slot, size_t bytes)
{
    pthread_once(&g_key_once, make_key);
    pa_tls_t *t = (pa_tls_t *)pthread_getspecific(g_key);
    if (!t) {
        t = (pa_tls_t *)calloc(1, sizeof(*t));
        if (!t || pthread_setspecific(g_key, t) != 0) {
            free(t);
            return NULL;
        }
    }
    if (bytes > t->cap[slot]) {
        free(t->p[slot]);
        size_t cap = bytes < 65536 ? 65536 : bytes + bytes / 4;
        t->p[slot] = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        t->cap[slot] = t->p[slot] ? cap : 0;
    }
    return t->p[slot];
}

/* Bit j of a mask row (query token's view of the sequence's new token j). */
static inline uint32_t mask_bit(const int32_t *mrow, int j)
{
    return ((uint32_t)mrow[j >> 5] >> (j & 31)) & 1u;
}

/* Bit t of the result: query token `li` of the sequence (global row `tok`) sees context
 * position pos0 + t, for t < n.  Prefix positions are always visible; a new token j is
 * visible by its mask bit, or causally (j <= li) without a mask. */
static inline uint32_t visible_bits(const pa_job_t *J, int tok, int li, int prefix, int pos0, int n)
{
    uint32_t all = n >= 32 ? 0xffffffffu : (1u << n) - 1u;
    if (pos0 + n <= prefix)
        return all;
    const int32_t *mrow = J->mask ? J->mask + (size_t)tok * J->W : NULL;
    uint32_t bits = 0;
    for (int t = 0; t < n; t++) {
        int j = pos0 + t - prefix;
        uint32_t v = j < 0 ? 1u
                   : mrow ? mask_bit(mrow, j)
                   : (uint32_t)(j <= li);
        bits |= v << t;
    }
    return bits;
}

/* Scratch of one work item, carved from the thread's slot-0 buffer.  RT = rows over all the
 * item's kv heads: row hi * RH + ti * G + g is query head (h0 + hi) * G + g of token ti. */
typedef struct {
    float *kt;       /* [D][16] transposed K chunk of one head (bf16 pairs: first D/2 rows) */
    float *vf;       /* [16][D] V chunk of one head widened to fp32 (bf16, many rows) */
    float *sp;       /* [RT + 16][16] scores, then probabilities (an AMX tile stores up to 16
                      * rows from any of them) */
    float *acc;      /* [RT][D] unnormalised outputs of the current piece */
    float *fa;       /* [RT][D] fold of the item's finished pieces (fm, fl: its max, sum) */
    float *fm, *fl;  /* [RT] */
    float *qf;       /* [RT][D] q rows in fp32 (paths that do not multiply bf16 directly; on
                      * AVX2 with a bf16 cache each 16 permuted to its even, then odd elements) */
    float *m, *l, *corr;  /* [RT] running max (base 2), running sum, this chunk's rescale */
    float *lv;       /* [RT][16] running sums per lane (summed into l at the end) */
    uint32_t *vis;   /* [nt] visibility bits of the chunk per query token */
    const void **qrow;    /* [RT] q row pointers */
    uint16_t *qb;    /* [RT + 16][D] bf16 q rows for the AMX q.K, zero rows past RT */
    float *sp2;      /* AMX: a second sp, and ... */
    uint32_t *vis2;  /* ... vis: the next chunk's scores while this one's finish (run_item) */
    int tile_rows;   /* AMX: rows of the q and score tiles, min(16, the item's rows per kv head) */
    float *ksc, *vsc;     /* [16] int8 caches: K scale * scl and V scale of the chunk's
                           * positions for the current head (0 past the chunk's end) */
} pa_ws_t;

/* The chunk PA_PF_POS positions ahead: its K/V row addresses, prefetched line by line as
 * the current chunk loads the same lines (AVX2's q.K: a tile's few positions at a time; a
 * burst of a chunk's ~200 lines at once would fill the miss queues and stall the compute). */
typedef struct {
    int n;
    const char *k[PA_CHUNK], *v[PA_CHUNK];
} pa_pf_t;

static pa_ws_t *ws_get(const pa_job_t *J, int RT, int nt)
{
    const size_t D = (size_t)J->D;
    /* the header, then eighteen regions, each padded to a cache line */
    const size_t sizes[18] = {
        sizeof(pa_ws_t), 16 * D * 4, 16 * D * 4, (size_t)(RT + 16) * 16 * 4, (size_t)RT * D * 4,
        (size_t)RT * D * 4, (size_t)RT * 4, (size_t)RT * 4, (size_t)RT * 4,
        (size_t)nt * 4 + (size_t)RT * sizeof(void *), (size_t)RT * 16 * 4, 32 * 4,
        (size_t)RT * D * 4, (size_t)RT * 4, (size_t)RT * 4,
        J->amx ? (size_t)(RT + 16) * D * 2 : 0, J->amx ? (size_t)(RT + 16) * 16 * 4 : 0,
        J->amx ? (size_t)nt * 4 : 0};
    size_t bytes = 0;
    for (int i = 0; i < 18; i++)
        bytes += (sizes[i] + 63) & ~(size_t)63;
    char *p = (char *)tls_scratch(0, bytes);
    if (!p)
        return NULL;
    pa_ws_t *w = (pa_ws_t *)p;
    void *region[18];
    for (int i = 0; i < 18; i++) {
        region[i] = p;
        p += (sizes[i] + 63) & ~(size_t)63;
    }
    w->kt = (float *)region[1];
    w->vf = (float *)region[2];
    w->sp = (float *)region[3];
    w->acc = (float *)region[4];
    w->qf = (float *)region[5];
    w->m = (float *)region[6];
    w->l = (float *)region[7];
    w->corr = (float *)region[8];
    w->qrow = (const void **)region[9];
    w->lv = (float *)region[10];
    w->ksc = (float *)region[11];
    w->vsc = w->ksc + 16;
    w->fa = (float *)region[12];
    w->fm = (float *)region[13];
    w->fl = (float *)region[14];
    w->qb = (uint16_t *)region[15];
    w->sp2 = (float *)region[16];
    w->vis2 = (uint32_t *)region[17];
    w->vis = (uint32_t *)(w->qrow + RT);
    return w;
}

/* ------------------------------------------------------------------------- */
/* Portable chunk step (no AVX-512, another architecture, or head_dim % 32).  */
/* ------------------------------------------------------------------------- */

/* PA_VL floats as one value, in GCC/Clang's generic vector extension: the compiler lowers
 * it to the target's SIMD (AVX2, SSE, NEON ...) or to scalar code.  The width is what the
 * target holds in one register: gcc keeps wider generic vectors in memory, which made this
 * path several times slower than scalar code.  A chunk's 16 lanes are PA_NV vectors; pvu
 * is the vector with 4-byte alignment, for cache rows. */
#if defined(__AVX__)
#define PA_VL 8
#else
#define PA_VL 4
#endif
#define PA_NV (PA_CHUNK / PA_VL)
typedef float pvf __attribute__((vector_size(PA_VL * 4)));
typedef int32_t pvi __attribute__((vector_size(PA_VL * 4)));
typedef float pvu __attribute__((vector_size(PA_VL * 4), aligned(4), may_alias));

#define PA_VINLINE static inline __attribute__((always_inline))
PA_VINLINE pvf pv_load(const float *p) { return *(const pvu *)p; }
PA_VINLINE void pv_store(float *p, pvf v) { *(pvu *)p = v; }

/* 2^x for x <= PA_LAZY, as exp2_ps: x clamped at -126 (what should underflow to 0 gives ~1e-38
 * instead; next to the row's largest weight, 1, that is nothing, and masked lanes are zeroed
 * by the caller), rounding by the 1.5 * 2^23 trick, 2^n built in the exponent bits. */
PA_VINLINE pvf exp2_pv(pvf x)
{
    const pvi low = x < -126.f;
    x = (pvf)(((pvi)x & ~low) | ((pvi)(x - x - 126.f) & low));
    const pvf n = (x + 12582912.f) - 12582912.f;
    const pvf f = x - n;
    pvf p = f * 1.5252733804059840e-05f + 1.5403530393381608e-04f;
    p = p * f + 1.3333558146428443e-03f;
    p = p * f + 9.6181291076284772e-03f;
    p = p * f + 5.5504108664821580e-02f;
    p = p * f + 2.4022650695910071e-01f;
    p = p * f + 6.9314718055994531e-01f;
    p = p * f + 1.0f;
    const pvi e = (__builtin_convertvector(n, pvi) + 127) << 23;
    return p * (pvf)e;
}

/* One head's RH rows (from row r0) against n positions, on generic vectors in the shape of
 * the AVX-512 path: K is transposed into kt[D][16] so a row's 16 scores are FMAs over d
 * with no horizontal sums, and P.V keeps 4 vectors of columns in registers across the
 * positions.  PA_ONE_BODY (as the SIMD head_* steps): one compiled body for run_item and
 * tree_chunk, so the compiler's contraction choices cannot differ between the two callers. */
static PA_ONE_BODY void head_portable(const pa_job_t *J, pa_ws_t *w, int r0, int RH, int n,
                          const char *const krow[PA_CHUNK], const char *const vrow[PA_CHUNK],
                          size_t hoff)
{
    const int D = J->D, G = J->G;
    float *kt = w->kt;
    const float *vr[PA_CHUNK];
    for (int t = 0; t < PA_CHUNK; t++) {
        if (t >= n) {
            for (int d = 0; d < D; d++)
                kt[d * PA_CHUNK + t] = 0.f;
            continue;
        }
        if (J->kvdt == DT_F32) {
            const float *ks = (const float *)(krow[t] + hoff);
            for (int d = 0; d < D; d++)
                kt[d * PA_CHUNK + t] = ks[d];
            vr[t] = (const float *)(vrow[t] + hoff);
        } else if (J->kvdt == PA_KV_I8) {
            /* raw int8 values: the scales go on the scores and on P below */
            const int8_t *ks = (const int8_t *)(krow[t] + hoff);
            const int8_t *vs = (const int8_t *)(vrow[t] + hoff);
            float *vd = w->vf + (size_t)t * D;
            for (int d = 0; d < D; d++) {
                kt[d * PA_CHUNK + t] = (float)ks[d];
                vd[d] = (float)vs[d];
            }
            vr[t] = vd;
        } else {
            const uint16_t *ks = (const uint16_t *)(krow[t] + hoff);
            const uint16_t *vs = (const uint16_t *)(vrow[t] + hoff);
            float *vd = w->vf + (size_t)t * D;
            for (int d = 0; d < D; d++) {
                kt[d * PA_CHUNK + t] = bf16_to_f32(ks[d]);
                vd[d] = bf16_to_f32(vs[d]);
            }
            vr[t] = vd;
        }
    }
    pvi lane_bit[PA_NV];  /* bit t of the visibility word, lane by lane */
    for (int j = 0; j < PA_NV; j++)
        for (int i = 0; i < PA_VL; i++)
            lane_bit[j][i] = 1 << (j * PA_VL + i);
    /* Per-lane score scale (scl, times the K scale of an int8 cache) and P scale (V's). */
    const int i8 = J->kvdt == PA_KV_I8;
    pvf sscl[PA_NV], pscl[PA_NV];
    for (int j = 0; j < PA_NV; j++) {
        sscl[j] = i8 ? pv_load(w->ksc + j * PA_VL) : (pvf){0} + J->scl;
        pscl[j] = i8 ? pv_load(w->vsc + j * PA_VL) : (pvf){0} + 1.f;
    }
    /* Scores, 4 rows at a time: 4 x PA_NV independent FMA chains, each K load used 4 times
     * (one row alone would be a single chain of D dependent FMAs per vector). */
    for (int r = r0; r < r0 + RH; r += 4) {
        const int mr = r0 + RH - r < 4 ? r0 + RH - r : 4;
        const float *q[4];
        for (int m = 0; m < 4; m++)
            q[m] = (const float *)w->qrow[r + (m < mr ? m : 0)];
        pvf sv[4][PA_NV];
        for (int m = 0; m < 4; m++)
            for (int j = 0; j < PA_NV; j++)
                sv[m][j] = (pvf){0};
        for (int d = 0; d < D; d++)
            for (int j = 0; j < PA_NV; j++) {
                const pvf k = pv_load(kt + (size_t)d * PA_CHUNK + j * PA_VL);
                for (int m = 0; m < 4; m++)
                    sv[m][j] += q[m][d] * k;
            }
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < PA_NV; j++)
                pv_store(w->sp + (size_t)(r + m) * PA_CHUNK + j * PA_VL, sv[m][j] * sscl[j]);
    }
    for (int r = r0; r < r0 + RH; r++) {
        const uint32_t vis = w->vis[(r - r0) / G];
        float *s = w->sp + (size_t)r * PA_CHUNK;
        pvf sv[PA_NV];
        for (int j = 0; j < PA_NV; j++)
            sv[j] = pv_load(s + j * PA_VL);
        float cm = -INFINITY;
        for (int t = 0; t < n; t++)
            if ((vis >> t & 1u) && s[t] > cm)
                cm = s[t];
        const float mo = w->m[r], mn = cm > mo + PA_LAZY ? cm : mo;
        if (mn == -INFINITY)
            continue;  /* nothing visible yet: acc and l stay 0 */
        const float c = mn == mo ? 1.f : mo == -INFINITY ? 0.f : exp2f(mo - mn);
        float *lv = w->lv + (size_t)r * PA_CHUNK;
        for (int j = 0; j < PA_NV; j++) {
            const pvf p = (pvf)((pvi)exp2_pv(sv[j] - mn) & ((lane_bit[j] & (int32_t)vis) != 0));
            pv_store(lv + j * PA_VL, pv_load(lv + j * PA_VL) * c + p);
            pv_store(s + j * PA_VL, p * pscl[j]);
        }
        w->m[r] = mn;
        float *a = w->acc + (size_t)r * D;
        int d0 = 0;
        for (; d0 + 4 * PA_VL <= D; d0 += 4 * PA_VL) {
            pvf b0 = pv_load(a + d0) * c, b1 = pv_load(a + d0 + PA_VL) * c;
            pvf b2 = pv_load(a + d0 + 2 * PA_VL) * c, b3 = pv_load(a + d0 + 3 * PA_VL) * c;
            for (int t = 0; t < n; t++) {
                const float p = s[t];
                const float *v = vr[t] + d0;
                b0 += p * pv_load(v);
                b1 += p * pv_load(v + PA_VL);
                b2 += p * pv_load(v + 2 * PA_VL);
                b3 += p * pv_load(v + 3 * PA_VL);
            }
            pv_store(a + d0, b0);
            pv_store(a + d0 + PA_VL, b1);
            pv_store(a + d0 + 2 * PA_VL, b2);
            pv_store(a + d0 + 3 * PA_VL, b3);
        }
        for (; d0 + PA_VL <= D; d0 += PA_VL) {
            pvf b = pv_load(a + d0) * c;
            for (int t = 0; t < n; t++)
                b += s[t] * pv_load(vr[t] + d0);
            pv_store(a + d0, b);
        }
        for (int d = d0; d < D; d++) {
            float x = a[d] * c;
            for (int t = 0; t < n; t++)
                x += s[t] * vr[t][d];
            a[d] = x;
        }
    }
}

#ifdef PA_X86
/* ------------------------------------------------------------------------- */
/* AVX-512 chunk step                                                         */
/* ------------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")

/* 2^x for x <= PA_LAZY (lanes of -inf give 2^-150 = 0): 2^n * p(f), n = round(x), f in
 * [-1/2, 1/2], p the degree-7 Taylor polynomial of e^(f ln 2) (error < 1e-8 relative). */
static inline __attribute__((always_inline)) __m512 exp2_ps(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The even and odd bf16 elements of 32 packed in x, widened to fp32 exactly. */
static inline __attribute__((always_inline)) __m512 bf16_even(__m512i x)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

static inline __attribute__((always_inline)) __m512 bf16_odd(__m512i x)
{
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* In-register transpose of a 16 x 16 block of 32-bit words: r[i] lane j -> r[j] lane i.
 * Unpack 32-bit then 64-bit pairs (4 x 4 blocks inside each 128-bit lane), then move
 * 128-bit lanes twice. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + j]: per 128-bit lane L, column 4L + j of rows 4g .. 4g + 3. */
    for (int g = 0; g < 4; g++) {
        const __m512i *tt = t + 4 * g;
        u[4 * g + 0] = _mm512_unpacklo_epi64(tt[0], tt[2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(tt[0], tt[2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(tt[1], tt[3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(tt[1], tt[3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        r[j] = _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + j] = _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + j] = _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + j] = _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* kt[c][t] = 32-bit word c of row t + hoff (rows t >= n read as zeros): nw words per row,
 * bf16 pairs (d = 2c, 2c + 1), fp32 values or 4 int8 values (d = 4c .. 4c + 3).  nw % 8 == 0
 * (a last block of 8 words is read with a mask: nothing past the row).  Each 64-byte line
 * loaded here has its twin in the prefetch chunk (pf rows, pn of them) requested now. */
static void transpose_chunk(const char *const rows[PA_CHUNK], size_t hoff, int n, int nw,
                            uint32_t *kt, const pa_pf_t *pf)
{
    for (int c = 0; c < nw; c += 16) {
        const int nj = nw - c >= 16 ? 16 : nw - c;
        const __mmask16 lm = (__mmask16)((1u << nj) - 1u);
        __m512i r[16];
        for (int t = 0; t < pf->n; t++)
            PA_PF(pf->k[t] + hoff + (size_t)c * 4);
        if (nj == 16 && n == 16) {
            /* The usual case in straight-line code: plain loads (masked ones), one test per
             * row, and the stores of a variable count (which gcc turned into a spill and a `rep
             * movs`) cost Emerald Rapids about half of this step. */
            for (int t = 0; t < 16; t++)
                r[t] = _mm512_loadu_si512((const void *)((const uint32_t *)(rows[t] + hoff) + c));
            transpose16(r);
            for (int j = 0; j < 16; j++)
                _mm512_store_si512((void *)(kt + (size_t)(c + j) * 16), r[j]);
            continue;
        }
        for (int t = 0; t < 16; t++)
            r[t] = t < n ? _mm512_maskz_loadu_epi32(lm, (const uint32_t *)(rows[t] + hoff) + c)
                         : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < nj; j++)
            _mm512_store_si512((void *)(kt + (size_t)(c + j) * 16), r[j]);
    }
}

/* Byte b (0..3) of each 32-bit lane as a signed value, in fp32 (exact). */
#define PA_I8_BYTE(x, b) _mm512_cvtepi32_ps(_mm512_srai_epi32( \
    (b) == 3 ? (x) : _mm512_slli_epi32((x), 24 - 8 * (b)), 24))

/* The int8 K words of transpose_chunk (kw[c][t]: d = 4c .. 4c + 3) widened once into
 * kt[d][t] = K[t][d] as fp32 (no scale: it goes on the scores), for more rows than qk_i8
 * takes in one block (it widens in registers, once per block of 8 rows). */
static void widen_i8_words(const uint32_t *kw, int D, float *kt)
{
    for (int c = 0; c < D / 4; c++) {
        const __m512i x = _mm512_load_si512((const void *)(kw + (size_t)c * 16));
        float *dst = kt + (size_t)c * 4 * 16;
        _mm512_store_ps(dst, PA_I8_BYTE(x, 0));
        _mm512_store_ps(dst + 16, PA_I8_BYTE(x, 1));
        _mm512_store_ps(dst + 32, PA_I8_BYTE(x, 2));
        _mm512_store_ps(dst + 48, PA_I8_BYTE(x, 3));
    }
}

/* s[m] = the sum of row m's PA_NA chains, in chain order (every q.K row kernel ends so). */
static inline __attribute__((always_inline)) void qk_store_rows(__m512 (*acc)[PA_NA], float *s, const int MR)
{
    for (int m = 0; m < MR; m++) {
        __m512 v = acc[m][0];
        for (int a = 1; a < PA_NA; a++)
            v = _mm512_add_ps(v, acc[m][a]);
        _mm512_store_ps(s + m * 16, v);
    }
}

/* Scores of MR <= 6 query rows against the chunk: s[m] = sum_d q[m][d] * kt[d][:], fp32 q
 * and K.  PA_NA chains per row, the same for every MR (batch invariance: a row's sum must
 * not depend on how many rows share its tile); 4 x 6 accumulators fit the 32 zmm. */
static inline __attribute__((always_inline))
void qk_f32_rows(const float *kt, int D, const void *const *qv, float *s, const int MR)
{
    const int NA = PA_NA;
    const float *q[PA_MR];
    __m512 acc[PA_MR][PA_NA];
    for (int m = 0; m < MR; m++) {
        q[m] = (const float *)qv[m];
        for (int a = 0; a < NA; a++)
            acc[m][a] = _mm512_setzero_ps();
    }
    /* D % 32 == 0 on this path: no remainder loop.  Chain a sums d = a (mod 4) in order,
     * as qk_i8_rows does, so an int8 K widened first (widen_i8_words) gives the same bits. */
    for (int d = 0; d < D; d += NA)
        for (int a = 0; a < NA; a++) {
            const __m512 kv = _mm512_load_ps(kt + (size_t)(d + a) * 16);
            for (int m = 0; m < MR; m++)
                acc[m][a] = _mm512_fmadd_ps(kv, _mm512_set1_ps(q[m][d + a]), acc[m][a]);
        }
    qk_store_rows(acc, s, MR);
}

/* The same for bf16 K without vdpbf16ps: each 32-bit word of kt holds the pair
 * (K[2c], K[2c + 1]), widened exactly by a shift / a mask; q rows are fp32. */
static inline __attribute__((always_inline))
void qk_bf16w_rows(const uint32_t *kt, int D, const void *const *qv, float *s, const int MR)
{
    const float *q[PA_MR];
    __m512 acc[PA_MR][2];
    for (int m = 0; m < MR; m++) {
        q[m] = (const float *)qv[m];
        acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    }
    for (int c = 0; c < D / 2; c++) {
        const __m512i kw = _mm512_load_si512((const void *)(kt + (size_t)c * 16));
        const __m512 ke = bf16_even(kw), ko = bf16_odd(kw);
        for (int m = 0; m < MR; m++) {
            acc[m][0] = _mm512_fmadd_ps(ke, _mm512_set1_ps(q[m][2 * c]), acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(ko, _mm512_set1_ps(q[m][2 * c + 1]), acc[m][1]);
        }
    }
    for (int m = 0; m < MR; m++)
        _mm512_store_ps(s + m * 16, _mm512_add_ps(acc[m][0], acc[m][1]));
}

/* Scores of MR <= 6 fp32 q rows against int8 K words (kw[c][t], d = 4c .. 4c + 3), each
 * word widened in registers once for all MR rows: 4 values, 4 FMAs per row into PA_NA = 4
 * chains (chain b sums d = b (mod 4), as qk_f32_rows: the same bits either way). */
static inline __attribute__((always_inline))
void qk_i8_rows(const uint32_t *kw, int D, const void *const *qv, float *s, const int MR)
{
    const int NA = PA_NA;
    const float *q[PA_MR];
    __m512 acc[PA_MR][PA_NA];
    for (int m = 0; m < MR; m++) {
        q[m] = (const float *)qv[m];
        for (int a = 0; a < NA; a++)
            acc[m][a] = _mm512_setzero_ps();
    }
    for (int c = 0; c < D / 4; c++) {
        const __m512i x = _mm512_load_si512((const void *)(kw + (size_t)c * 16));
        const __m512 k[4] = {PA_I8_BYTE(x, 0), PA_I8_BYTE(x, 1), PA_I8_BYTE(x, 2), PA_I8_BYTE(x, 3)};
        for (int b = 0; b < 4; b++)
            for (int m = 0; m < MR; m++)
                acc[m][b % NA] = _mm512_fmadd_ps(k[b], _mm512_set1_ps(q[m][4 * c + b]), acc[m][b % NA]);
    }
    qk_store_rows(acc, s, MR);
}

#define PA_ROWS_SWITCH(FN, n, ...)                    \
    switch (n) {                                      \
    case 1: FN(__VA_ARGS__, 1); break;                \
    case 2: FN(__VA_ARGS__, 2); break;                \
    case 3: FN(__VA_ARGS__, 3); break;                \
    case 4: FN(__VA_ARGS__, 4); break;                \
    case 5: FN(__VA_ARGS__, 5); break;                \
    default: FN(__VA_ARGS__, 6); break;               \
    }

static void qk_f32(const float *kt, int D, const void *const *q, float *s, int R)
{
    for (int r = 0; r < R; r += PA_MR)
        PA_ROWS_SWITCH(qk_f32_rows, R - r, kt, D, q + r, s + (size_t)r * 16)
}

static void qk_bf16w(const uint32_t *kt, int D, const void *const *q, float *s, int R)
{
    for (int r = 0; r < R; r += PA_MR)
        PA_ROWS_SWITCH(qk_bf16w_rows, R - r, kt, D, q + r, s + (size_t)r * 16)
}

static void qk_bf16dp(const uint32_t *kt, int D, const void *const *q, float *s, int R);
static void qk_amx(const uint32_t *kt, int D, const uint16_t *qb, float *s, int R, int TR);

/* vdpbf16ps's products as two FMAs (pg_bf16_fma): qk_dp_rows' chains and order, each pair's
 * odd product added before its even one, each rounded once, as the instruction does (products of
 * bf16 values are exact in fp32): the same bits from fp32 q rows (widened exactly), at twice
 * the multiply-adds a cycle where vdpbf16ps issues every other cycle (Emerald Rapids). */
static inline __attribute__((always_inline))
void qk_dpfma_rows(const uint32_t *kt, int D, const void *const *qv, float *s, const int MR)
{
    const int NA = PA_NA;
    const int nw = D / 2;  /* a multiple of 16 */
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const float *q[PA_MR];
    __m512 acc[PA_MR][PA_NA];
    for (int m = 0; m < MR; m++) {
        q[m] = (const float *)qv[m];
        for (int a = 0; a < NA; a++)
            acc[m][a] = _mm512_setzero_ps();
    }
    for (int c = 0; c < nw; c += NA)
        for (int a = 0; a < NA; a++) {
            const __m512i kw = _mm512_load_si512((const void *)(kt + (size_t)(c + a) * 16));
            const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(kw, 16));
            const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(kw, hi));
            for (int m = 0; m < MR; m++)
                acc[m][a] = _mm512_fmadd_ps(ke, _mm512_set1_ps(q[m][2 * (c + a)]),
                                            _mm512_fmadd_ps(ko, _mm512_set1_ps(q[m][2 * (c + a) + 1]), acc[m][a]));
        }
    qk_store_rows(acc, s, MR);
}

static void qk_bf16dpfma(const uint32_t *kt, int D, const void *const *q, float *s, int R)
{
    for (int r = 0; r < R; r += PA_MR)
        PA_ROWS_SWITCH(qk_dpfma_rows, R - r, kt, D, q + r, s + (size_t)r * 16)
}

static void qk_i8(const uint32_t *kw, int D, const void *const *q, float *s, int R)
{
    for (int r = 0; r < R; r += PA_MR)
        PA_ROWS_SWITCH(qk_i8_rows, R - r, kw, D, q + r, s + (size_t)r * 16)
}

/* Online-softmax update of rows [r0, r0 + RH) from their chunk scores (in place: scores
 * -> P); row r0 + ti * G + g belongs to query token ti.  Row sums stay 16-lane vectors
 * (lv, reduced once at the end of the item), and the horizontal max is taken only when
 * some visible score exceeds the running max: after the first chunks it rarely does.
 * i8: the scores are scaled per lane by w->ksc (K scale * scl) instead of scl, and the P
 * stored for P.V is multiplied by the V scales w->vsc (l sums the unscaled P). */
/* pb (tier avx512_bf16, bf16 V): P is rounded to bf16 (nearest even) for P.V, as the GPU kernel's
 * P @ V runs in the cache dtype, and the row sums add the rounded values (the GPU kernel's add the
 * unrounded ones), so the weights a row's output is divided by are the ones P.V used.  pb 1 stores the rounded P as fp32 (pv_tile),
 * pb 2 as 16 bf16, a position pair a dword (pv_chunk_dp's vdpbf16ps operand). */
static void softmax_chunk(pa_ws_t *w, int r0, int RH, int G, float scl, int i8, int pb)
{
    const __m512 vscl = i8 ? _mm512_load_ps(w->ksc) : _mm512_set1_ps(scl);
    const __m512 vpsc = i8 ? _mm512_load_ps(w->vsc) : _mm512_set1_ps(1.f);
    for (int r = r0, ti = 0; r < r0 + RH; ti++) {
        const __mmask16 vm = (__mmask16)w->vis[ti];
        for (int g = 0; g < G; g++, r++) {
            float *sp = w->sp + (size_t)r * 16;
            const __m512 s = _mm512_mul_ps(_mm512_load_ps(sp), vscl);
            const float mo = w->m[r];
            float mn = mo, c = 1.f;
            if (_mm512_mask_cmp_ps_mask(vm, s, _mm512_set1_ps(mo + PA_LAZY), _CMP_GT_OQ)) {
                mn = _mm512_mask_reduce_max_ps(vm, s);
                /* 0 for the first visible scores of a piece (exp2f(-inf), without the call) */
                c = mo == -INFINITY ? 0.f : exp2f(mo - mn);
            }
            w->corr[r] = c;
            if (mn == -INFINITY) {  /* nothing visible yet: P = 0, acc and l stay 0 */
                _mm512_store_ps(sp, _mm512_setzero_ps());
                continue;
            }
            __m512 p = _mm512_maskz_mov_ps(vm, exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(mn))));
            if (pb) {
                const __m256i h = bf16x16_rne(p);
                p = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                if (pb == 2)
                    _mm256_store_si256((__m256i *)sp, h);
                else
                    _mm512_store_ps(sp, p);
            } else {
                _mm512_store_ps(sp, i8 ? _mm512_mul_ps(p, vpsc) : p);
            }
            float *lv = w->lv + (size_t)r * 16;
            _mm512_store_ps(lv, _mm512_fmadd_ps(_mm512_load_ps(lv), _mm512_set1_ps(c), p));
            w->m[r] = mn;
        }
    }
}

/* How P.V reads V rows: fp32 as they are, bf16 widened as [even | odd] per 32 elements,
 * int8 widened in order (sign extension, then an exact conversion). */
enum { PA_V_F32 = 0, PA_V_BF16 = 1, PA_V_I8 = 2 };

/* A P.V tile's accumulators: acc[m][cb .. cb + 16 NV) of MR rows, rescaled by corr[m] (the
 * chunk's softmax correction), and stored back. */
static inline __attribute__((always_inline))
void pv_acc_load(__m512 (*a)[4], const float *acc, int D, int cb, const float *corr, const int MR, const int NV)
{
    for (int m = 0; m < MR; m++) {
        const __m512 c = _mm512_set1_ps(corr[m]);
        for (int v = 0; v < NV; v++)
            a[m][v] = _mm512_mul_ps(_mm512_load_ps(acc + (size_t)m * D + cb + v * 16), c);
    }
}

static inline __attribute__((always_inline))
void pv_acc_store(__m512 (*a)[4], float *acc, int D, int cb, const int MR, const int NV)
{
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++)
            _mm512_store_ps(acc + (size_t)m * D + cb + v * 16, a[m][v]);
}

/* acc[m][cb .. cb + 16 NV) = acc * corr[m] + sum_t P[m][t] V[t][cb ...] for MR rows; the V
 * vectors of a position are loaded once and used by all MR rows.  VM (PA_V_*): the dtype of
 * the V rows vr (byte addresses of the head's rows in the cache, or fp32 rows in scratch). */
static inline __attribute__((always_inline))
void pv_tile(const float *P, int n, const void *const *vr, int cb, float *acc, int D,
             const float *corr, const char *const *pfv, int pn, size_t pfoff,
             const int VM, const int MR, const int NV, const int PB)
{
    __m512 a[6][4];
    pv_acc_load(a, acc, D, cb, corr, MR, NV);
    for (int t = 0; t < n; t++) {
        __m512 vv[4];
        /* The same lines of the prefetch chunk's V row (first row block only); an int8
         * row block of <= 64 values starting at cb (a multiple of 64) is one line. */
        if (t < pn) {
            if (VM == PA_V_I8)
                PA_PF(pfv[t] + pfoff + (size_t)cb);
            else
                for (int v = 0; v < NV; v += (VM == PA_V_BF16 ? 2 : 1))
                    PA_PF(pfv[t] + pfoff + (size_t)(cb + v * 16) * (VM == PA_V_BF16 ? 2 : 4));
        }
        /* PB: the positions of a pair in vdpbf16ps' order, the second's product first (n even) */
        const int u = PB ? t ^ 1 : t;
        if (VM == PA_V_BF16) {
            for (int v = 0; v < NV; v += 2) {
                const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)vr[u] + cb + v * 16));
                vv[v] = bf16_even(x);
                vv[v + 1] = bf16_odd(x);
            }
        } else if (VM == PA_V_I8) {
            for (int v = 0; v < NV; v++)
                vv[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)((const int8_t *)vr[u] + cb + v * 16))));
        } else {
            for (int v = 0; v < NV; v++)
                vv[v] = _mm512_loadu_ps((const float *)vr[u] + cb + v * 16);
        }
        for (int m = 0; m < MR; m++) {
            const __m512 p = _mm512_set1_ps(P[m * 16 + u]);
            for (int v = 0; v < NV; v++)
                a[m][v] = _mm512_fmadd_ps(vv[v], p, a[m][v]);
        }
    }
    pv_acc_store(a, acc, D, cb, MR, NV);
}

#define PA_PV_ROWS(VB, NV, PB, mr, ...)                          \
    switch (mr) {                                                \
    case 1: pv_tile(__VA_ARGS__, VB, 1, NV, PB); break;          \
    case 2: pv_tile(__VA_ARGS__, VB, 2, NV, PB); break;          \
    case 3: pv_tile(__VA_ARGS__, VB, 3, NV, PB); break;          \
    case 4: pv_tile(__VA_ARGS__, VB, 4, NV, PB); break;          \
    case 5: pv_tile(__VA_ARGS__, VB, 5, NV, PB); break;          \
    default: pv_tile(__VA_ARGS__, VB, 6, NV, PB); break;         \
    }

/* Rows in blocks of 6 and head_dim in blocks of 64 (a last block of 32 when D % 64 == 32):
 * at most 24 accumulators + 4 V vectors.  vr: the cache's rows (vm: PA_V_*, prefetching
 * the pf chunk's twins, pfoff into their rows) or, pf NULL, fp32 rows widened in scratch. */
static void pv_chunk(pa_ws_t *w, int r0, int RH, int n, const void *const *vr, int D, int vm,
                     const pa_pf_t *pf, size_t pfoff, int pb)
{
    for (int cb = 0; cb < D; cb += 64) {
        const int full = D - cb >= 64;
        for (int r = r0; r < r0 + RH; r += 6) {
            const int mr = r0 + RH - r;
            const float *P = w->sp + (size_t)r * 16;
            float *acc = w->acc + (size_t)r * D;
            const float *corr = w->corr + r;
            const int pn = pf && r == r0 ? pf->n : 0;
            const char *const *pfv = pf ? pf->v : NULL;
            if (vm == PA_V_BF16 && pb) {
                if (full) { PA_PV_ROWS(PA_V_BF16, 4, 1, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
                else { PA_PV_ROWS(PA_V_BF16, 2, 1, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
            } else if (vm == PA_V_BF16) {
                if (full) { PA_PV_ROWS(PA_V_BF16, 4, 0, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
                else { PA_PV_ROWS(PA_V_BF16, 2, 0, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
            } else if (vm == PA_V_I8) {
                if (full) { PA_PV_ROWS(PA_V_I8, 4, 0, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
                else { PA_PV_ROWS(PA_V_I8, 2, 0, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
            } else if (pb) {
                if (full) { PA_PV_ROWS(0, 4, 1, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
                else { PA_PV_ROWS(0, 2, 1, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
            } else {
                if (full) { PA_PV_ROWS(0, 4, 0, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
                else { PA_PV_ROWS(0, 2, 0, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
            }
        }
    }
}

/* A bf16 cache's step in two halves, so that the AMX path can run a chunk's q.K (its tile
 * products' latency) one chunk ahead of its softmax and P.V (run_item); head_avx512 calls both,
 * one body each whichever caller.  bf16_qk: the chunk's K transposed into kt and the rows' scores
 * into sp. */
static PA_ONE_BODY void bf16_qk(const pa_job_t *J, pa_ws_t *w, int r0, int RH, int n,
                                const char *const krow[PA_CHUNK], size_t hoff, const pa_pf_t *pf)
{
    const int D = J->D;
    transpose_chunk(krow, hoff, n, D / 2, (uint32_t *)w->kt, pf);
    if (J->amx)
        qk_amx((const uint32_t *)w->kt, D, w->qb + (size_t)r0 * D, w->sp + (size_t)r0 * 16, RH, w->tile_rows);
    else if (J->fma)
        qk_bf16dpfma((const uint32_t *)w->kt, D, w->qrow + r0, w->sp + (size_t)r0 * 16, RH);
    else if (J->dp)
        qk_bf16dp((const uint32_t *)w->kt, D, w->qrow + r0, w->sp + (size_t)r0 * 16, RH);
    else
        qk_bf16w((const uint32_t *)w->kt, D, w->qrow + r0, w->sp + (size_t)r0 * 16, RH);
}

static void pv_chunk_dp(pa_ws_t *w, int r0, int RH, int n, const char *const vrow[PA_CHUNK], size_t hoff,
                        int D, const pa_pf_t *pf);

/* bf16_rest: softmax of the scores in sp, then P.V from the chunk's V rows.  Tier avx512_bf16
 * rounds P to bf16 and adds each pair of positions as vdpbf16ps does (the second's product, then
 * the first's): by the instruction (pv_chunk_dp), or by its two FMAs (J->fma, pv_tile's PB: the
 * same bits).  An odd chunk's last pair repeats its last V row with P = 0 (exact zeros). */
static PA_ONE_BODY void bf16_rest(const pa_job_t *J, pa_ws_t *w, int r0, int RH, int n,
                                  const char *const vrow[PA_CHUNK], size_t hoff, const pa_pf_t *pf)
{
    const int D = J->D;
    if (J->dp && !J->fma) {
        softmax_chunk(w, r0, RH, J->G, J->scl, 0, 2);
        pv_chunk_dp(w, r0, RH, n, vrow, hoff, D, pf);
        return;
    }
    const int pb = J->dp;  /* here J->fma: vdpbf16ps' FMAs on the rounded P */
    const void *vr[PA_CHUNK + 1];
    const pa_pf_t *vpf = pf;
    if (RH <= 6) {
        /* One row block: widen V in registers as it is used. */
        for (int t = 0; t < n; t++)
            vr[t] = vrow[t] + hoff;
    } else {
        /* Several row blocks would each widen it again: widen the chunk once, in the
         * same [even | odd] order. */
        vpf = NULL;
        for (int t = 0; t < n; t++) {
            const uint16_t *src = (const uint16_t *)(vrow[t] + hoff);
            float *dst = w->vf + (size_t)t * D;
            if (t < pf->n)
                for (int d = 0; d < D; d += 32)
                    PA_PF(pf->v[t] + hoff + (size_t)d * 2);
            for (int d = 0; d < D; d += 32) {
                const __m512i x = _mm512_loadu_si512((const void *)(src + d));
                _mm512_store_ps(dst + d, bf16_even(x));
                _mm512_store_ps(dst + d + 16, bf16_odd(x));
            }
            vr[t] = dst;
        }
    }
    const int np = pb ? n + (n & 1) : n;
    if (np > n)
        vr[n] = vr[n - 1];
    softmax_chunk(w, r0, RH, J->G, J->scl, 0, pb);
    pv_chunk(w, r0, RH, np, vr, D, RH <= 6 ? PA_V_BF16 : PA_V_F32, vpf, hoff, pb);
}

/* One kv head (rows [r0, r0 + RH)) against the n positions of the chunk; pf: the chunk
 * to prefetch meanwhile. */
static PA_ONE_BODY void head_avx512(const pa_job_t *J, pa_ws_t *w, int r0, int RH, int n,
                        const char *const krow[PA_CHUNK], const char *const vrow[PA_CHUNK],
                        size_t hoff, const pa_pf_t *pf)
{
    const int D = J->D;
    const void *vr[PA_CHUNK];
    int vm = PA_V_F32;
    const pa_pf_t *vpf = pf;  /* V prefetches: in P.V, or in the widening loops below */
    if (J->kvdt == DT_F32) {
        transpose_chunk(krow, hoff, n, D, (uint32_t *)w->kt, pf);
        qk_f32(w->kt, D, w->qrow + r0, w->sp + (size_t)r0 * 16, RH);
        for (int t = 0; t < n; t++)
            vr[t] = vrow[t] + hoff;
    } else if (J->kvdt == PA_KV_I8) {
        /* Up to 8 rows widen K in registers; more widen it once into kt (after the words,
         * which take its first D / 4 rows: vf is free until V is widened below). */
        uint32_t *kw = (uint32_t *)w->vf;
        transpose_chunk(krow, hoff, n, D / 4, kw, pf);
        if (RH <= 8) {
            qk_i8(kw, D, w->qrow + r0, w->sp + (size_t)r0 * 16, RH);
        } else {
            widen_i8_words(kw, D, w->kt);
            qk_f32(w->kt, D, w->qrow + r0, w->sp + (size_t)r0 * 16, RH);
        }
        if (RH <= 6) {
            for (int t = 0; t < n; t++)
                vr[t] = vrow[t] + hoff;
            vm = PA_V_I8;
        } else {
            /* Several row blocks: widen the chunk's V once (in order). */
            vpf = NULL;
            for (int t = 0; t < n; t++) {
                const int8_t *src = (const int8_t *)(vrow[t] + hoff);
                float *dst = w->vf + (size_t)t * D;
                if (t < pf->n)
                    for (int d = 0; d < D; d += 64)
                        PA_PF(pf->v[t] + hoff + (size_t)d);
                for (int d = 0; d < D; d += 16)
                    _mm512_store_ps(dst + d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(src + d)))));
                vr[t] = dst;
            }
        }
    } else {
        bf16_qk(J, w, r0, RH, n, krow, hoff, pf);
        bf16_rest(J, w, r0, RH, n, vrow, hoff, pf);
        return;
    }
    softmax_chunk(w, r0, RH, J->G, J->scl, J->kvdt == PA_KV_I8, 0);
    pv_chunk(w, r0, RH, n, vr, D, vm, vpf, hoff, 0);
}

/* A bf16 q row as fp32, in order (D % 16 == 0): what the FMA paths multiply. */
static void widen_q_avx512(const uint16_t *src, int D, float *dst)
{
    for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d))), 16)));
}

/* out row = acc * inv in the output dtype (D % 32 == 0 here); perm (pa_job_t): the order acc
 * holds each 32-wide block in, put back. */
static void store_row_avx512(void *out, const float *acc, float inv, int D, int dt, int perm)
{
    const __m512 s = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512i ulo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i uhi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int d = 0; d < D; d += 32) {
        __m512 x0 = _mm512_mul_ps(_mm512_load_ps(acc + d), s);
        __m512 x1 = _mm512_mul_ps(_mm512_load_ps(acc + d + 16), s);
        if (perm == 1) {
            const __m512 e = x0;
            x0 = _mm512_permutex2var_ps(e, lo, x1);
            x1 = _mm512_permutex2var_ps(e, hi, x1);
        } else if (perm == 2) {  /* lanes 4 L + i: dims 8 L + i (x0), 8 L + 4 + i (x1) */
            const __m512 e = x0;
            x0 = _mm512_permutex2var_ps(e, ulo, x1);
            x1 = _mm512_permutex2var_ps(e, uhi, x1);
        }
        if (dt == DT_F32) {
            _mm512_storeu_ps((float *)out + d, x0);
            _mm512_storeu_ps((float *)out + d + 16, x1);
        } else {
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + d), bf16x16_rne(x0));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + d + 16), bf16x16_rne(x1));
        }
    }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")

/* acc += k . {q pair}: vdpbf16ps with the q pair as an embedded 32-bit broadcast from
 * memory (gcc 12 does not fold _mm512_set1_epi32 into it: one extra uop per product). */
static inline __attribute__((always_inline)) __m512 dp_bcast(__m512 acc, __m512bh k, const uint32_t *q)
{
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*q));
    return acc;
}

/* bf16 q x bf16 K with vdpbf16ps: lane t of s[m] += q[2c] K[t][2c] + q[2c+1] K[t][2c+1],
 * the q pair broadcast as one 32-bit word.  PA_NA chains per row whatever MR (<= 6). */
static inline __attribute__((always_inline))
void qk_dp_rows(const uint32_t *kt, int D, const void *const *q, float *s, const int MR)
{
    const int NA = PA_NA;
    const int nw = D / 2;  /* a multiple of 16 */
    __m512 acc[PA_MR][PA_NA];
    const uint32_t *qw[PA_MR];
    for (int m = 0; m < MR; m++) {
        qw[m] = (const uint32_t *)q[m];
        for (int a = 0; a < NA; a++)
            acc[m][a] = _mm512_setzero_ps();
    }
    for (int c = 0; c < nw; c += NA)
        for (int a = 0; a < NA; a++) {
            const __m512bh kv = (__m512bh)_mm512_load_si512((const void *)(kt + (size_t)(c + a) * 16));
            for (int m = 0; m < MR; m++)
                acc[m][a] = dp_bcast(acc[m][a], kv, qw[m] + c + a);
        }
    qk_store_rows(acc, s, MR);
}

static void qk_bf16dp(const uint32_t *kt, int D, const void *const *q, float *s, int R)
{
    for (int r = 0; r < R; r += PA_MR)
        PA_ROWS_SWITCH(qk_dp_rows, R - r, kt, D, q + r, s + (size_t)r * 16)
}

/* P.V by vdpbf16ps: acc[m][cb .. cb + 16 NV) = acc * corr[m] + for each pair p of positions
 * vdpbf16ps(V[2p], V[2p+1] interleaved, P[m][2p], P[m][2p+1]) for MR rows.  The interleave is
 * vpunpck{l,h}wd of the two V rows' 32 values, so the accumulators hold each 32 of head_dim in
 * those lanes (perm 2, put back by store_row_avx512).  SRC 0: V from the rows vr (2 np of them,
 * interleaved here, prefetching the pf chunk's twins); 1: already interleaved in vi, D / 16
 * vectors a pair.  P: the rows' bf16 pairs, a dword each (softmax_chunk's pb 2). */
static inline __attribute__((always_inline))
void pvdp_tile(const uint32_t *P, int np, const void *const *vr, const __m512i *vi, int cb, float *acc, int D,
               const float *corr, const char *const *pfv, int pn, size_t pfoff, const int MR, const int NV,
               const int SRC)
{
    __m512 a[6][4];
    pv_acc_load(a, acc, D, cb, corr, MR, NV);
    for (int p = 0; p < np; p++) {
        __m512i vv[4];
        if (SRC == 0) {
            for (int t = 2 * p; t < 2 * p + 2; t++)
                if (t < pn)
                    for (int v = 0; v < NV; v += 2)
                        PA_PF(pfv[t] + pfoff + (size_t)(cb + v * 16) * 2);
            for (int v = 0; v < NV; v += 2) {
                const __m512i x0 = _mm512_loadu_si512((const void *)((const uint16_t *)vr[2 * p] + cb + v * 16));
                const __m512i x1 = _mm512_loadu_si512((const void *)((const uint16_t *)vr[2 * p + 1] + cb + v * 16));
                vv[v] = _mm512_unpacklo_epi16(x0, x1);
                vv[v + 1] = _mm512_unpackhi_epi16(x0, x1);
            }
        } else {
            for (int v = 0; v < NV; v++)
                vv[v] = _mm512_load_si512((const void *)(vi + (size_t)p * (D / 16) + cb / 16 + v));
        }
        for (int m = 0; m < MR; m++)
            for (int v = 0; v < NV; v++)
                a[m][v] = dp_bcast(a[m][v], (__m512bh)vv[v], P + m * 16 + p);
    }
    pv_acc_store(a, acc, D, cb, MR, NV);
}

#define PA_PVDP_ROWS(NV, SRC, mr, ...)                            \
    switch (mr) {                                                \
    case 1: pvdp_tile(__VA_ARGS__, 1, NV, SRC); break;           \
    case 2: pvdp_tile(__VA_ARGS__, 2, NV, SRC); break;           \
    case 3: pvdp_tile(__VA_ARGS__, 3, NV, SRC); break;           \
    case 4: pvdp_tile(__VA_ARGS__, 4, NV, SRC); break;           \
    case 5: pvdp_tile(__VA_ARGS__, 5, NV, SRC); break;           \
    default: pvdp_tile(__VA_ARGS__, 6, NV, SRC); break;          \
    }

/* pv_chunk for bf16 V by vdpbf16ps (bf16_rest, tier avx512_bf16 without pg_bf16_fma): rows in
 * blocks of 6, head_dim in blocks of 64 (a last 32).  One row block interleaves V in registers;
 * several interleave the chunk once into vf.  An odd n's last pair repeats row n - 1 (P = 0). */
static void pv_chunk_dp(pa_ws_t *w, int r0, int RH, int n, const char *const vrow[PA_CHUNK], size_t hoff,
                        int D, const pa_pf_t *pf)
{
    const void *vr[PA_CHUNK + 1];
    for (int t = 0; t < n; t++)
        vr[t] = vrow[t] + hoff;
    if (n & 1)
        vr[n] = vr[n - 1];
    const int np = (n + 1) / 2, pfn = pf ? pf->n : 0;
    const char *const *pfv = pf ? pf->v : NULL;
    const __m512i *vi = NULL;
    if (RH > 6) {
        __m512i *dst = (__m512i *)w->vf;
        for (int p = 0; p < np; p++) {
            for (int t = 2 * p; t < 2 * p + 2 && t < pfn; t++)
                for (int d = 0; d < D; d += 32)
                    PA_PF(pfv[t] + hoff + (size_t)d * 2);
            for (int d = 0; d < D; d += 32) {
                const __m512i x0 = _mm512_loadu_si512((const void *)((const uint16_t *)vr[2 * p] + d));
                const __m512i x1 = _mm512_loadu_si512((const void *)((const uint16_t *)vr[2 * p + 1] + d));
                _mm512_store_si512((void *)dst++, _mm512_unpacklo_epi16(x0, x1));
                _mm512_store_si512((void *)dst++, _mm512_unpackhi_epi16(x0, x1));
            }
        }
        vi = (const __m512i *)w->vf;
    }
    for (int cb = 0; cb < D; cb += 64) {
        const int full = D - cb >= 64;
        for (int r = r0; r < r0 + RH; r += 6) {
            const int mr = r0 + RH - r;
            const uint32_t *P = (const uint32_t *)(w->sp + (size_t)r * 16);
            float *acc = w->acc + (size_t)r * D;
            const float *corr = w->corr + r;
            const int pn = !vi && r == r0 ? pfn : 0;
            if (vi) {
                if (full) { PA_PVDP_ROWS(4, 1, mr, P, np, vr, vi, cb, acc, D, corr, pfv, pn, hoff) }
                else { PA_PVDP_ROWS(2, 1, mr, P, np, vr, vi, cb, acc, D, corr, pfv, pn, hoff) }
            } else {
                if (full) { PA_PVDP_ROWS(4, 0, mr, P, np, vr, vi, cb, acc, D, corr, pfv, pn, hoff) }
                else { PA_PVDP_ROWS(2, 0, mr, P, np, vr, vi, cb, acc, D, corr, pfv, pn, hoff) }
            }
        }
    }
}

#pragma GCC pop_options

/* ------------------------------------------------------------------------- */
/* AMX q.K (tier avx512_bf16 with AMX-BF16, when pa_set_amx asks for it)       */
/* ------------------------------------------------------------------------- */

/* kt's bf16 pairs, [D / 2][16] 32-bit words, are tdpbf16ps' B operand as they stand: word c of
 * row t is the pair (K[t][2c], K[t][2c + 1]), so kt's rows 16 j .. 16 j + 15 are one B tile for
 * head_dim [32 j, 32 j + 32).  q rows in bf16 (qb, D elements a row) are the A tiles, and one
 * fp32 tile C of TR rows x 16 positions is the rows' scores as softmax_chunk reads them (TR: the
 * item's rows per kv head, at most 16; a tile issues faster with fewer rows):
 *
 *     for each TR rows r:  C = 0;  for j < D / 32:  C += qb[r:r+TR, 32 j:32 j+32] . B_j
 *                          sp[r:r+TR] = C
 *
 * Rows past the call's are written too (ws_get pads qb and sp by 16 rows): they belong to a later
 * kv head or token of the chunk, whose own q.K rewrites them before its softmax reads them -- the
 * callers run heads and tokens in ascending order, which this relies on.
 *
 * A row's sums do not depend on the other rows of its tile, and every path (decode rows, tree
 * nodes alone, prefill chunks) runs these tiles in this order: batch invariance holds, with the
 * tile unit's own bits (other than vdpbf16ps' or its FMAs', as for bf16 weights on AMX). */
#if PG_AMX && defined(PA_X86)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")

/* C 0 and A 2-3 `rows` high (the item's rows per kv head, at most 16: tree_chunk's lone tokens
 * take as many, the extra rows being scratch), B 4-7 16 (head_dim <= 128).  Set once per work item
 * and released at its end (~80 ns a pair here: once per chunk would cost a decode step more than
 * its products); other code on the thread (oneDNN, cpu_gemv_amx.c's tasks) sets its own. */
static void amx_begin(int rows) { pg_amx_config(4, rows); }

static void amx_end(void) { _tile_release(); }

static void qk_amx(const uint32_t *kt, int D, const uint16_t *qb, float *s, int R, int TR)
{
    const int nk = D / 32;
    const long qs = (long)D * 2;  /* bytes per q row */
    /* kt's and qb's stores come first: the tile loads are asm without a memory operand */
    __asm__ volatile("" ::: "memory");
    _tile_loadd(4, kt, 64);
    if (nk > 1)
        _tile_loadd(5, kt + 256, 64);
    if (nk > 2)
        _tile_loadd(6, kt + 512, 64);
    if (nk > 3)
        _tile_loadd(7, kt + 768, 64);
    for (int r = 0; r < R; r += TR) {
        const char *a = (const char *)(qb + (size_t)r * D);
        _tile_zero(0);
        _tile_loadd(2, a, qs);
        _tile_dpbf16ps(0, 2, 4);
        if (nk > 1) {
            _tile_loadd(3, a + 64, qs);
            _tile_dpbf16ps(0, 3, 5);
        }
        if (nk > 2) {
            _tile_loadd(2, a + 128, qs);
            _tile_dpbf16ps(0, 2, 6);
        }
        if (nk > 3) {
            _tile_loadd(3, a + 192, qs);
            _tile_dpbf16ps(0, 3, 7);
        }
        _tile_stored(0, s + (size_t)r * 16, 64);
    }
    __asm__ volatile("" ::: "memory");
}

#pragma GCC pop_options

/* The tiles can run: AMX-BF16 granted and pg_bf16_amx's switch on (PRESCIENT_BF16_DOT=dp|fma
 * turns the tiles off for bf16 weights and this alike). */
static int pa_amx_on(void) { return pg_bf16_amx() && pg_amx_granted(); }

#else  /* no AMX in this build: pa_amx_on() is 0, so nothing calls these */

static void amx_begin(int rows) { (void)rows; }
static void amx_end(void) {}
static void qk_amx(const uint32_t *kt, int D, const uint16_t *qb, float *s, int R, int TR)
{
    (void)kt, (void)D, (void)qb, (void)s, (void)R, (void)TR;
}
static int pa_amx_on(void) { return 0; }

#endif

/* ------------------------------------------------------------------------- */
/* AVX2 + FMA chunk step (ISA_AVX2: Haswell, Zen 1-3)                         */
/* ------------------------------------------------------------------------- */

/* On 8-lane ymm: a row's 16 scores are two ymm (lanes 0-7, 8-15 of the chunk) for the
 * softmax, but q.K is not the AVX-512 step's broadcast-q x transposed-K product: each score is
 * a dot product straight from the cache row, one 8-lane chain over head_dim, then a fixed
 * horizontal sum (qk_chunk_avx2).  The transpose and the broadcasts were ~40% of the
 * operations of a decode step's q.K (measured on Zen 3: 30 layers at 1k context, 2.30 ->
 * 1.89 ms with the P.V tiling below).  P.V widens V rows in registers (or once into vf when
 * several 6-row blocks would each widen them), in order (bf16: zero-extend and shift; int8:
 * sign-extend and convert), so the accumulators need no permutation. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#define PA_AI static inline __attribute__((always_inline))

/* 2^x for x <= PA_LAZY on 8 lanes: x clamped at -127 (2^-127 and below come out as 0: the
 * exponent field is 0), n = round(x), f = x - n in [-1/2, 1/2], the polynomial of exp2_ps,
 * then 2^n put into the exponent bits. */
PA_AI __m256 exp2_ps8(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5252733804059840e-05f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381608e-04f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* softmax_chunk on two ymm per row: visibility bits become lane masks (bit t of vis against
 * 1 << t), the horizontal max is taken only when a visible score exceeds the running max. */
static void softmax_avx2(pa_ws_t *w, int r0, int RH, int G, float scl, int i8)
{
    const __m256i bit0 = _mm256_set_epi32(128, 64, 32, 16, 8, 4, 2, 1);
    const __m256i bit1 = _mm256_slli_epi32(bit0, 8);
    const __m256 sc0 = i8 ? _mm256_load_ps(w->ksc) : _mm256_set1_ps(scl);
    const __m256 sc1 = i8 ? _mm256_load_ps(w->ksc + 8) : _mm256_set1_ps(scl);
    const __m256 ps0 = i8 ? _mm256_load_ps(w->vsc) : _mm256_set1_ps(1.f);
    const __m256 ps1 = i8 ? _mm256_load_ps(w->vsc + 8) : _mm256_set1_ps(1.f);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int r = r0, ti = 0; r < r0 + RH; ti++) {
        const uint32_t vis = w->vis[ti];
        const __m256i vb = _mm256_set1_epi32((int)vis);
        const __m256 m0 = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(vb, bit0), bit0));
        const __m256 m1 = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(vb, bit1), bit1));
        for (int g = 0; g < G; g++, r++) {
            float *sp = w->sp + (size_t)r * 16;
            const __m256 s0 = _mm256_mul_ps(_mm256_load_ps(sp), sc0);
            const __m256 s1 = _mm256_mul_ps(_mm256_load_ps(sp + 8), sc1);
            const float mo = w->m[r];
            const __m256 vmo = _mm256_set1_ps(mo + PA_LAZY);
            float mn = mo, c = 1.f;
            const int gt = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(s0, vmo, _CMP_GT_OQ), m0)) |
                           _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(s1, vmo, _CMP_GT_OQ), m1));
            if (gt) {
                __m256 x = _mm256_max_ps(_mm256_blendv_ps(ninf, s0, m0), _mm256_blendv_ps(ninf, s1, m1));
                __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
                y = _mm_max_ps(y, _mm_movehl_ps(y, y));
                y = _mm_max_ss(y, _mm_movehdup_ps(y));
                mn = _mm_cvtss_f32(y);
                /* 0 for the first visible scores of a piece (exp2f(-inf), without the call) */
                c = mo == -INFINITY ? 0.f : exp2f(mo - mn);
            }
            w->corr[r] = c;
            if (mn == -INFINITY) {  /* nothing visible yet: P = 0, acc and l stay 0 */
                _mm256_store_ps(sp, _mm256_setzero_ps());
                _mm256_store_ps(sp + 8, _mm256_setzero_ps());
                continue;
            }
            const __m256 vmn = _mm256_set1_ps(mn);
            const __m256 p0 = _mm256_and_ps(exp2_ps8(_mm256_sub_ps(s0, vmn)), m0);
            const __m256 p1 = _mm256_and_ps(exp2_ps8(_mm256_sub_ps(s1, vmn)), m1);
            float *lv = w->lv + (size_t)r * 16;
            const __m256 vc = _mm256_set1_ps(c);
            _mm256_store_ps(lv, _mm256_fmadd_ps(_mm256_load_ps(lv), vc, p0));
            _mm256_store_ps(lv + 8, _mm256_fmadd_ps(_mm256_load_ps(lv + 8), vc, p1));
            _mm256_store_ps(sp, _mm256_mul_ps(p0, ps0));
            _mm256_store_ps(sp + 8, _mm256_mul_ps(p1, ps1));
            w->m[r] = mn;
        }
    }
}

/* acc[m][cb .. cb + 16) = acc * corr[m] + sum_t P[m][t] V[t][cb ...] for MR <= 6 rows: 12
 * accumulators, 2 V vectors and a broadcast fit the 16 ymm registers, each V vector loaded
 * (and widened) once for all MR rows.  (3 rows x 32 columns took 17: GCC kept one
 * accumulator on the stack, a store-to-load chain per position, 2.5x slower.)  An element's
 * arithmetic (acc * corr, then one FMA per position in order) is the same in any tile.
 * VM: PA_V_* of the rows vr; the pf chunk's twin lines are prefetched meanwhile (first row
 * block only). */
PA_AI void pv_tile_avx2(const float *P, int n, const void *const *vr, int cb, float *acc, int D,
                        const float *corr, const char *const *pfv, int pn, size_t pfoff,
                        const int VM, const int MR)
{
    __m256 a[6][2];
    for (int m = 0; m < MR; m++) {
        const __m256 c = _mm256_set1_ps(corr[m]);
        for (int v = 0; v < 2; v++)
            a[m][v] = _mm256_mul_ps(_mm256_load_ps(acc + (size_t)m * D + cb + v * 8), c);
    }
    for (int t = 0; t < n; t++) {
        if (t < pn) {
            if (VM == PA_V_F32)
                PA_PF(pfv[t] + pfoff + (size_t)cb * 4);
            else if (VM == PA_V_BF16 ? (cb & 31) == 0 : (cb & 63) == 0)
                PA_PF(pfv[t] + pfoff + (size_t)cb * (VM == PA_V_BF16 ? 2 : 1));
        }
        __m256 vv[2];
        for (int v = 0; v < 2; v++) {
            if (VM == PA_V_F32)
                vv[v] = _mm256_loadu_ps((const float *)vr[t] + cb + v * 8);
            else if (VM == PA_V_BF16)
                vv[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)((const uint16_t *)vr[t] + cb + v * 8))), 16));
            else
                vv[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)((const int8_t *)vr[t] + cb + v * 8))));
        }
        for (int m = 0; m < MR; m++) {
            const __m256 p = _mm256_broadcast_ss(P + m * 16 + t);
            for (int v = 0; v < 2; v++)
                a[m][v] = _mm256_fmadd_ps(vv[v], p, a[m][v]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++)
            _mm256_store_ps(acc + (size_t)m * D + cb + v * 8, a[m][v]);
}

#define PA_PV2_ROWS(VM, mr, ...)                             \
    switch (mr) {                                            \
    case 1: pv_tile_avx2(__VA_ARGS__, VM, 1); break;         \
    case 2: pv_tile_avx2(__VA_ARGS__, VM, 2); break;         \
    case 3: pv_tile_avx2(__VA_ARGS__, VM, 3); break;         \
    case 4: pv_tile_avx2(__VA_ARGS__, VM, 4); break;         \
    case 5: pv_tile_avx2(__VA_ARGS__, VM, 5); break;         \
    default: pv_tile_avx2(__VA_ARGS__, VM, 6); break;        \
    }

/* Rows in blocks of 6, head_dim in blocks of 16 (D % 32 == 0). */
static void pv_chunk_avx2(pa_ws_t *w, int r0, int RH, int n, const void *const *vr, int D, int vm,
                          const pa_pf_t *pf, size_t pfoff)
{
    for (int cb = 0; cb < D; cb += 16)
        for (int r = r0; r < r0 + RH; r += 6) {
            const int mr = r0 + RH - r;
            const float *P = w->sp + (size_t)r * 16;
            float *acc = w->acc + (size_t)r * D;
            const float *corr = w->corr + r;
            const int pn = pf && r == r0 ? pf->n : 0;
            const char *const *pfv = pf ? pf->v : NULL;
            if (vm == PA_V_BF16) { PA_PV2_ROWS(PA_V_BF16, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
            else if (vm == PA_V_I8) { PA_PV2_ROWS(PA_V_I8, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
            else { PA_PV2_ROWS(PA_V_F32, mr, P, n, vr, cb, acc, D, corr, pfv, pn, pfoff) }
        }
}

/* [a, b, c, d] with a = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), and so for b, c, d:
 * one order for every score, whatever its neighbours. */
PA_AI __m128 hsum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d)
{
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* s[m][t0 + p] = q_m . K_{t0 + p} for MR rows x NT positions: one 8-lane fp32 chain per
 * (row, position) over head_dim, K widened in registers (bf16: the even and odd elements of
 * each 16, against q rows permuted to match by run_item; int8: sign-extended; fp32 as is),
 * then hsum4_avx2.  A score's operations are the same in any tile shape. */
PA_AI void qk_tile_avx2(const char *const *kr, int D, const void *const *qv, float *s, int t0,
                        const int KV, const int MR, const int NT)
{
    const float *q[6];
    __m256 acc[6][4];
    for (int m = 0; m < MR; m++) {
        q[m] = (const float *)qv[m];
        for (int p = 0; p < NT; p++)
            acc[m][p] = _mm256_setzero_ps();
    }
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    if (KV == DT_BF16) {
        for (int d = 0; d < D; d += 16)
            for (int p = 0; p < NT; p++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(kr[p] + (size_t)d * 2));
                const __m256 ke = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
                const __m256 ko = _mm256_castsi256_ps(_mm256_and_si256(x, hi16));
                for (int m = 0; m < MR; m++) {
                    acc[m][p] = _mm256_fmadd_ps(ke, _mm256_load_ps(q[m] + d), acc[m][p]);
                    acc[m][p] = _mm256_fmadd_ps(ko, _mm256_load_ps(q[m] + d + 8), acc[m][p]);
                }
            }
    } else {
        for (int d = 0; d < D; d += 8)
            for (int p = 0; p < NT; p++) {
                const __m256 k = KV == DT_F32
                    ? _mm256_loadu_ps((const float *)kr[p] + d)
                    : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                          _mm_loadl_epi64((const __m128i *)(kr[p] + d))));
                for (int m = 0; m < MR; m++)
                    acc[m][p] = _mm256_fmadd_ps(k, _mm256_loadu_ps(q[m] + d), acc[m][p]);
            }
    }
    if (NT == 4) {
        for (int m = 0; m < MR; m++)
            _mm_storeu_ps(s + (size_t)m * 16 + t0, hsum4_avx2(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    } else {
        /* Two rows' two scores per hsum4 (a lane's sum does not depend on the others): half
         * the horizontal adds of one row per call, which were ~20% of a tree's q.K samples. */
        for (int m = 0; m < MR; m += 2) {
            const int m1 = m + 1 < MR ? m + 1 : m;
            const __m128 h = hsum4_avx2(acc[m][0], acc[m][1], acc[m1][0], acc[m1][1]);
            _mm_storel_pi((__m64 *)(s + (size_t)m * 16 + t0), h);
            if (m1 != m)
                _mm_storeh_pi((__m64 *)(s + (size_t)m1 * 16 + t0), h);
        }
    }
}

#define PA_QK2_TILE(KV, ...)                                                             \
    switch (mr) {                                                                        \
    case 1: qk_tile_avx2(__VA_ARGS__, KV, 1, 4); break;                                  \
    case 2: qk_tile_avx2(__VA_ARGS__, KV, 2, 4); break;                                  \
    case 3: qk_tile_avx2(__VA_ARGS__, KV, 3, 4); break;                                  \
    case 4: qk_tile_avx2(__VA_ARGS__, KV, 4, 2); break;                                  \
    case 5: qk_tile_avx2(__VA_ARGS__, KV, 5, 2); break;                                  \
    default: qk_tile_avx2(__VA_ARGS__, KV, 6, 2); break;                                 \
    }

/* The scores of rows [r0, r0 + RH) over the chunk's positions, straight from the cache rows
 * (no transposed copy of K): rows in blocks of 6 (the rest last), positions in 4s for a
 * block of up to 3 rows, in 2s for 4-6; positions past n repeat row 0 (their scores are masked).  The first
 * row block prefetches the pf chunk's K lines of this head, a few positions per tile. */
static void qk_chunk_avx2(const char *const krow[PA_CHUNK], size_t hoff, int n, int D, int kvdt,
                          const void *const *qv, float *s, int RH, const pa_pf_t *pf)
{
    const char *kr[PA_CHUNK];
    for (int t = 0; t < PA_CHUNK; t++)
        kr[t] = krow[t < n ? t : 0] + hoff;
    const size_t hb = (size_t)D * (kvdt == DT_F32 ? 4 : kvdt == DT_BF16 ? 2 : 1);
    for (int r = 0; r < RH;) {
        const int mr = RH - r >= 6 ? 6 : RH - r;
        const int NT = mr <= 3 ? 4 : 2;
        for (int t0 = 0; t0 < PA_CHUNK; t0 += NT) {
            if (r == 0)
                for (int t = t0; t < t0 + NT && t < pf->n; t++)
                    for (size_t o = 0; o < hb; o += 64)
                        PA_PF(pf->k[t] + hoff + o);
            const void *const *q = qv + r;
            float *sr = s + (size_t)r * 16;
            if (kvdt == DT_BF16) { PA_QK2_TILE(DT_BF16, kr + t0, D, q, sr, t0) }
            else if (kvdt == DT_F32) { PA_QK2_TILE(DT_F32, kr + t0, D, q, sr, t0) }
            else { PA_QK2_TILE(PA_KV_I8, kr + t0, D, q, sr, t0) }
        }
        r += mr;
    }
}

/* A q row of D (% 16 == 0) values, bf16 or fp32, widened to fp32 with each 16 reordered as its
 * even then its odd elements, as qk_tile_avx2 widens a bf16 K row (run_item's scalar loop did
 * this element by element: ~7% of an 8-token tree's attention samples). */
static void perm_q_avx2(const void *src, int dt, int D, float *dst)
{
    for (int d = 0; d < D; d += 16) {
        __m256 ev, od;
        if (dt == DT_BF16) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + d));
            ev = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
            od = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
        } else {
            const __m256 a = _mm256_loadu_ps((const float *)src + d);
            const __m256 b = _mm256_loadu_ps((const float *)src + d + 8);
            /* [a0 a2 b0 b2 | a4 a6 b4 b6] -> [a0 a2 a4 a6 b0 b2 b4 b6], and so the odd ones */
            ev = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
            od = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
        }
        _mm256_storeu_ps(dst + d, ev);
        _mm256_storeu_ps(dst + d + 8, od);
    }
}

/* One kv head (rows [r0, r0 + RH)) against the chunk's n positions, AVX2; pf: the chunk to
 * prefetch meanwhile. */
static PA_ONE_BODY void head_avx2(const pa_job_t *J, pa_ws_t *w, int r0, int RH, int n,
                      const char *const krow[PA_CHUNK], const char *const vrow[PA_CHUNK],
                      size_t hoff, const pa_pf_t *pf)
{
    const int D = J->D, kvdt = J->kvdt;
    const void *vr[PA_CHUNK];
    int vm = kvdt == DT_F32 ? PA_V_F32 : kvdt == DT_BF16 ? PA_V_BF16 : PA_V_I8;
    const pa_pf_t *vpf = pf;
    qk_chunk_avx2(krow, hoff, n, D, kvdt, w->qrow + r0, w->sp + (size_t)r0 * 16, RH, pf);
    softmax_avx2(w, r0, RH, J->G, J->scl, kvdt == PA_KV_I8);
    if (vm == PA_V_F32 || RH <= 6) {
        for (int t = 0; t < n; t++)
            vr[t] = vrow[t] + hoff;
    } else {
        /* Several row blocks would each widen V again: widen the chunk once. */
        for (int t = 0; t < n; t++) {
            const char *src = vrow[t] + hoff;
            float *dst = w->vf + (size_t)t * D;
            if (t < pf->n)
                for (int d = 0; d < D * J->kesz; d += 64)
                    PA_PF(pf->v[t] + hoff + (size_t)d);
            for (int d = 0; d < D; d += 8)
                _mm256_store_ps(dst + d, vm == PA_V_BF16
                    ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                          _mm_loadu_si128((const __m128i *)((const uint16_t *)src + d))), 16))
                    : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                          _mm_loadl_epi64((const __m128i *)((const int8_t *)src + d)))));
            vr[t] = dst;
        }
        vm = PA_V_F32;
        vpf = NULL;
    }
    pv_chunk_avx2(w, r0, RH, n, vr, D, vm, vpf, hoff);
}

#pragma GCC pop_options

#endif /* PA_X86 */

#ifndef PA_X86
/* No AMX off x86 either: pa_amx_on() is 0, so the work items never call these.  (They once sat
 * only inside the x86 section: an aarch64 build left them undefined and its .so did not load.) */
static void amx_begin(int rows) { (void)rows; }
static void amx_end(void) {}
static int pa_amx_on(void) { return 0; }
#endif

/* ------------------------------------------------------------------------- */
/* One work item                                                              */
/* ------------------------------------------------------------------------- */

static void store_row(const pa_job_t *J, void *out, const float *acc, float inv)
{
#ifdef PA_X86
    if (J->isa >= ISA_AVX512) {
        store_row_avx512(out, acc, inv, J->D, J->dt, J->perm);
        return;
    }
#endif
    if (J->dt == DT_F32)
        for (int d = 0; d < J->D; d++)
            ((float *)out)[d] = acc[d] * inv;
    else
        for (int d = 0; d < J->D; d++)
            ((uint16_t *)out)[d] = f32_to_bf16(acc[d] * inv);
}

/* Output row of item-row r (rows per head RH = nt * G). */
static inline char *out_row(const pa_job_t *J, int tok0, int h0, int RH, int r)
{
    const int hi = r / RH, ri = r % RH;
    return J->out + ((size_t)(tok0 + ri / J->G) * J->H + (size_t)(h0 + hi) * J->G + ri % J->G) *
                    J->D * J->esz;
}

/* K and V row addresses (for kv head 0) and cache slots of the next min(left, 16)
 * positions, from block `*blk`, offset `*off` on (advanced past them); returns how many. */
static inline int chunk_rows(const int32_t *bt, int bs, const char *kbase, const char *vbase,
                             size_t row_stride, int left, int *blk, int *off,
                             const char **krow, const char **vrow, size_t *slots)
{
    const int n = left < PA_CHUNK ? (left > 0 ? left : 0) : PA_CHUNK;
    int b = *blk, o = *off;
    if (n == PA_CHUNK && o + PA_CHUNK <= bs) {
        /* The whole chunk in one block (every full chunk when bs is a multiple of 16): one
         * table lookup, and a fill the compiler vectorises -- the general loop below cost a
         * decode at 4k positions ~4% of its attention (one thread, K/V in cache). */
        const size_t slot0 = (size_t)bt[b] * bs + o;
        const char *k0 = kbase + slot0 * row_stride, *v0 = vbase + slot0 * row_stride;
        for (int t = 0; t < PA_CHUNK; t++) {
            slots[t] = slot0 + t;
            krow[t] = k0 + t * row_stride;
            vrow[t] = v0 + t * row_stride;
        }
        if ((o += PA_CHUNK) == bs) {
            o = 0;
            b++;
        }
        *blk = b;
        *off = o;
        return n;
    }
    for (int t = 0; t < n; t++) {
        const size_t slot = (size_t)bt[b] * bs + o;
        slots[t] = slot;
        krow[t] = kbase + slot * row_stride;
        vrow[t] = vbase + slot * row_stride;
        if (++o == bs) {
            o = 0;
            b++;
        }
    }
    *blk = b;
    *off = o;
    return n;
}

/* Prefetch the K and V bytes [0, span) of the next min(left, 16) positions (advancing the
 * cursor like chunk_rows); returns how many positions. */
static inline int prefetch_rows(const int32_t *bt, int bs, const char *kbase, const char *vbase,
                                size_t row_stride, size_t span, int left, int *blk, int *off)
{
    const int n = left < PA_CHUNK ? left : PA_CHUNK;
    int b = *blk, o = *off;
    for (int t = 0; t < n; t++) {
        const size_t at = ((size_t)bt[b] * bs + o) * row_stride;
        for (size_t x = 0; x < span; x += 64) {
            PA_PF(kbase + at + x);
            PA_PF(vbase + at + x);
        }
        if (++o == bs) {
            o = 0;
            b++;
        }
    }
    *blk = b;
    *off = o;
    return n;
}

/* Fold one piece's partial result of a row (max m, sum l, unnormalised a[D]) into the
 * running (M, L, F).  This is the only way pieces are combined, in an item and in the
 * caller, and always in piece order, so a row's bits do not depend on which items its
 * pieces ran in.  A piece that saw nothing (m = -inf) changes nothing -- so pieces past a
 * row's last visible position, which other rows of a draft tree may need, leave it as a
 * lone decode step gets it; the first piece that saw something is copied (what the general
 * formula gives, with factors 0 and 1, but without relying on it).  Not inlined: one
 * compiled body for both callers. */
static __attribute__((noinline)) void fold_piece(float *M, float *L, float *F, float m, float l,
                                                 const float *a, int D)
{
    if (m == -INFINITY)
        return;
    if (*M == -INFINITY) {
        *M = m;
        *L = l;
        memcpy(F, a, (size_t)D * sizeof(float));
        return;
    }
    /* The factor of the larger max is 2^0 = 1: one exp2f. */
    float cf = 1.f, ca = 1.f;
    if (m > *M)
        cf = exp2f(*M - m);
    else
        ca = exp2f(m - *M);
    for (int d = 0; d < D; d++)
        F[d] = F[d] * cf + a[d] * ca;
    *L = *L * cf + l * ca;
    *M = m > *M ? m : *M;
}

/* Whether row tok's visible new positions (its mask row's set bits below q_len) are exactly
 * 0, 1, ..., k: then its chunks hold them where its decode step has them. */
static int contiguous_row(const pa_job_t *J, int tok, int qlen)
{
    const int32_t *mrow = J->mask + (size_t)tok * J->W;
    int ended = 0;
    for (int j = 0; j < qlen; j++) {
        const int bit = mask_bit(mrow, j);
        if (bit && ended)
            return 0;
        ended |= !bit;
    }
    return 1;
}

/* The chunk at pos0 (< c1, the piece's end) for the draft-tree tokens in the bit set `tokens`
 * (of the item's), each in the layout a lone decode step of it has: its visible new
 * positions (its ancestors and itself, the set bits of its mask row, ascending: depth order,
 * parents come first) moved down to prefix, prefix + 1, ... (its depth + 1 of them), the
 * prefix positions as they are.  So a
 * node gets the bits of the decode step that would have produced it after its ancestors were
 * accepted -- whichever branch it is on -- not only a node of the tree's first chain: a node
 * laid out after another branch's nodes would otherwise see them as holes (other lanes of
 * its chunks, another chunk, another piece), which change the sums in the last bits.  These
 * tokens run alone here (their G rows per kv head each), after the chunk's shared pass in
 * which they saw nothing; a chain's tokens and every chunk of only prefix positions take
 * the shared pass alone.  Tokens see virtual positions < prefix + popcount(mask row); the
 * item's pieces cover them (the actual positions of the ancestors are no lower). */
static void tree_chunk(const pa_job_t *J, pa_ws_t *w, const pa_item_t *it, int tok0, int prefix,
                       int pos0, int c1, int RH, size_t head_bytes, const char *kbase,
                       const char *vbase, size_t row_stride, uint64_t tokens)
{
    const int G = J->G, qlen = J->cu[it->seq + 1] - J->cu[it->seq];
    const int32_t *bt = J->bt + (size_t)it->seq * J->MB;
    const char *krow[PA_CHUNK], *vrow[PA_CHUNK];
    size_t slots[PA_CHUNK];
    const pa_pf_t none = {0};
    (void)none;  /* (only the x86 steps take a prefetch chunk) */
    for (int i = 0; i < it->nt; i++) {
        if (!(tokens >> i & 1))
            continue;
        const int32_t *mrow = J->mask + (size_t)(tok0 + i) * J->W;
        /* this token's last virtual position + 1, capped by the piece */
        int vend = prefix;
        for (int j = 0; j < qlen; j++)
            vend += mask_bit(mrow, j);
        int n = (vend < c1 ? vend : c1) - pos0;
        n = n < PA_CHUNK ? n : PA_CHUNK;
        if (n <= 0)
            continue;  /* sees nothing here: as a lone step, whose context ends before */
        int rank = prefix, j = 0;  /* virtual position of the next set bit at or after j */
        for (int t = 0; t < n; t++) {
            const int vp = pos0 + t;
            int ap = vp;  /* a prefix position is itself */
            if (vp >= prefix) {
                while (!mask_bit(mrow, j) || rank < vp) {
                    rank += mask_bit(mrow, j);
                    j++;
                }
                ap = prefix + j;
            }
            const size_t slot = (size_t)bt[ap / J->BS] * J->BS + ap % J->BS;
            slots[t] = slot;
            krow[t] = kbase + slot * row_stride;
            vrow[t] = vbase + slot * row_stride;
        }
        w->vis[0] = (1u << n) - 1u;
        for (int hi = 0; hi < it->nh; hi++) {
            if (J->kvdt == PA_KV_I8) {
                const int h = it->h0 + hi;
                for (int t = 0; t < PA_CHUNK; t++) {
                    w->ksc[t] = t < n ? J->ks[slots[t] * J->KVH + h] * J->scl : 0.f;
                    w->vsc[t] = t < n ? J->vs[slots[t] * J->KVH + h] : 0.f;
                }
            }
            const int r0 = hi * RH + i * G;
#ifdef PA_X86
            if (J->isa >= ISA_AVX512) {
                head_avx512(J, w, r0, G, n, krow, vrow, hi * head_bytes, &none);
                continue;
            }
            if (J->isa == ISA_AVX2) {
                head_avx2(J, w, r0, G, n, krow, vrow, hi * head_bytes, &none);
                continue;
            }
#endif
            head_portable(J, w, r0, G, n, krow, vrow, hi * head_bytes);
        }
    }
}

/* The AMX pipeline's buffers change places: the chunk just scored becomes the one to finish. */
static inline void amx_swap(pa_ws_t *w)
{
    float *sp = w->sp;
    uint32_t *vis = w->vis;
    w->sp = w->sp2;
    w->vis = w->vis2;
    w->sp2 = sp;
    w->vis2 = vis;
}

static void run_item(const pa_job_t *J, const pa_item_t *it)
{
    const int D = J->D, G = J->G, esz = J->esz;
    const int RH = it->nt * G, RT = it->nh * RH;
    const int qlen = J->cu[it->seq + 1] - J->cu[it->seq];
    const int prefix = J->cl[it->seq] - qlen;
    const int tok0 = J->cu[it->seq] + it->t0;  /* global row of the item's first token */
    pa_ws_t *w = ws_get(J, RT, it->nt);
    if (!w) {
        atomic_store((_Atomic int *)&J->err, 1);  /* the one field items write */
        return;
    }
    /* Only vdpbf16ps itself (bf16 q x bf16 K) and the AMX tiles (a copy in qb) multiply bf16 q
     * as is; every other path, vdpbf16ps' FMAs included, wants fp32 q rows. */
    const int widen_q = J->dt == DT_BF16 && !(J->dp && !J->fma) && !J->amx;
    /* AVX2 widens a bf16 K row as the even, then the odd elements of each 16: q to match. */
    const int perm_q = J->isa == ISA_AVX2 && J->kvdt == DT_BF16;
    for (int r = 0; r < RT; r++) {
        const int hi = r / RH, ri = r % RH;
        const char *src = J->q + ((size_t)(tok0 + ri / G) * J->qs_tok +
                                  (size_t)((it->h0 + hi) * G + ri % G) * J->qs_head) * esz;
#ifdef PA_X86
        if (perm_q && D % 16 == 0) {
            perm_q_avx2(src, J->dt, D, w->qf + (size_t)r * D);
            w->qrow[r] = w->qf + (size_t)r * D;
        } else if (widen_q && J->isa >= ISA_AVX512 && D % 16 == 0) {
            widen_q_avx512((const uint16_t *)src, D, w->qf + (size_t)r * D);
            w->qrow[r] = w->qf + (size_t)r * D;
        } else
#endif
        if (widen_q || perm_q) {
            float *dst = w->qf + (size_t)r * D;
            for (int d = 0; d < D; d++) {
                const float v = J->dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)src)[d])
                                                 : ((const float *)src)[d];
                dst[perm_q ? (d & ~15) + (d & 1) * 8 + ((d & 15) >> 1) : d] = v;
            }
            w->qrow[r] = dst;
        } else {
            w->qrow[r] = src;
        }
        if (J->amx)
            memcpy(w->qb + (size_t)r * D, src, (size_t)D * 2);
        w->fm[r] = -INFINITY;
        w->fl[r] = 0.f;
    }
    if (J->amx) {
        /* a tile of 16 rows from any row of the item reads up to 15 past its last */
        memset(w->qb + (size_t)RT * D, 0, (size_t)16 * D * 2);
        w->tile_rows = RH < 16 ? RH : 16;
        amx_begin(w->tile_rows);
    }
    /* The fold of this item's pieces: kept when it writes the output or is its row block's
     * first item; a later item of a split row block writes each piece to its own slot. */
    const int folds = it->part0 < 0 || it->p0 == 0;
    if (folds)
        memset(w->fa, 0, (size_t)RT * D * sizeof(float));

    const int32_t *bt = J->bt + (size_t)it->seq * J->MB;
    const size_t row_stride = (size_t)J->KVH * D * J->kesz;  /* bytes between positions */
    const size_t head_bytes = (size_t)D * J->kesz;
    const size_t span = (size_t)it->nh * head_bytes;        /* the item's heads, per position */
    const char *kbase = J->k + (size_t)it->h0 * head_bytes;
    const char *vbase = J->v + (size_t)it->h0 * head_bytes;
    const int cs = it->p0 * PA_PIECE;
    const int ce = (int64_t)it->p1 * PA_PIECE < it->end ? it->p1 * PA_PIECE : it->end;
    /* A prefetch cursor runs PA_PF_POS positions ahead of the compute, across the item's
     * pieces: its first PA_PF_POS positions are requested at once, later chunks line by line
     * (pa_pf_t). */
    const char *krow[PA_CHUNK], *vrow[PA_CHUNK];
    size_t slots[PA_CHUNK], pf_slots[PA_CHUNK];
    const int i8 = J->kvdt == PA_KV_I8;
    pa_pf_t pf;
    /* the item's tokens whose visible new positions are not 0, 1, ..., k (bit i: token t0 + i) */
    uint64_t item_gapped = 0;
    if (J->mask)
        for (int i = 0; i < it->nt; i++)
            item_gapped |= (uint64_t)!contiguous_row(J, tok0 + i, qlen) << i;
    int blk = cs / J->BS, off = cs % J->BS;
    int pf_blk = blk, pf_off = off, pf_pos = cs;
    for (int ahead = 0; ahead < PA_PF_POS && pf_pos < ce; ahead += PA_CHUNK)
        pf_pos += prefetch_rows(bt, J->BS, kbase, vbase, row_stride, span, ce - pf_pos,
                                &pf_blk, &pf_off);
    for (int piece = it->p0; piece < it->p1; piece++) {
        const int c0 = piece * PA_PIECE;
        const int c1 = (int64_t)c0 + PA_PIECE < it->end ? c0 + PA_PIECE : it->end;
        /* Each piece starts afresh: its (m, l, acc) are then the same whatever item, call or
         * neighbours it has. */
        for (int r = 0; r < RT; r++)
            w->m[r] = -INFINITY;
        memset(w->acc, 0, (size_t)RT * D * sizeof(float));
        memset(w->lv, 0, (size_t)RT * 16 * sizeof(float));
        /* AMX without tree gaps: each chunk's q.K is issued before the last chunk's softmax and
         * P.V, which then hide its tile products' latency (sp / vis and sp2 / vis2 alternate;
         * the same arithmetic, in the same order per row, as one chunk at a time).  An item with
         * a gapped token (a branched tree) runs one chunk at a time, where the tiles are slower
         * than the FMAs (docs/CPU_PERFORMANCE.md, sixteenth session). */
#ifdef PA_X86
        const int ahead = J->amx && !item_gapped;
        int prev_n = 0;
        const char *prev_v[PA_CHUNK];
#endif
        for (int pos0 = c0; pos0 < c1; pos0 += PA_CHUNK) {
            const int n = chunk_rows(bt, J->BS, kbase, vbase, row_stride, c1 - pos0, &blk, &off,
                                     krow, vrow, slots);
#ifdef PA_X86
            if (ahead) {
                pf.n = chunk_rows(bt, J->BS, kbase, vbase, row_stride, ce - pf_pos, &pf_blk, &pf_off,
                                  pf.k, pf.v, pf_slots);
                pf_pos += pf.n;
                for (int i = 0; i < it->nt; i++)
                    w->vis[i] = visible_bits(J, tok0 + i, it->t0 + i, prefix, pos0, n);
                for (int hi = 0; hi < it->nh; hi++)
                    bf16_qk(J, w, hi * RH, RH, n, krow, hi * head_bytes, &pf);
                amx_swap(w);
                for (int hi = 0; hi < it->nh && prev_n; hi++)
                    bf16_rest(J, w, hi * RH, RH, prev_n, prev_v, hi * head_bytes, &pf);
                prev_n = n;
                memcpy(prev_v, vrow, sizeof vrow);
                continue;
            }
#endif
            pf.n = chunk_rows(bt, J->BS, kbase, vbase, row_stride, ce - pf_pos, &pf_blk, &pf_off,
                              pf.k, pf.v, pf_slots);
            pf_pos += pf.n;
            if (i8) {
                /* The prefetch chunk's scales: a line holds 64 / (4 KVH) positions' worth. */
                uintptr_t last = 0;
                for (int t = 0; t < pf.n; t++) {
                    const float *ka = J->ks + pf_slots[t] * J->KVH + it->h0;
                    if (((uintptr_t)ka >> 6) != last) {
                        last = (uintptr_t)ka >> 6;
                        PA_PF(ka);
                        PA_PF(J->vs + pf_slots[t] * J->KVH + it->h0);
                    }
                }
            }
            /* In a chunk holding new (tree) positions, a token whose visible new positions are
             * not 0, 1, ..., k (a node after another branch's nodes) sees nothing in the shared
             * pass and runs alone in its own layout after it (tree_chunk); a chain's tokens --
             * the common tree -- are already laid out as their decode steps are. */
            const uint64_t gapped = pos0 + PA_CHUNK > prefix ? item_gapped : 0;
            for (int i = 0; i < it->nt; i++)
                w->vis[i] = gapped >> i & 1 ? 0u : visible_bits(J, tok0 + i, it->t0 + i, prefix, pos0, n);
            for (int hi = 0; hi < it->nh; hi++) {
                if (i8) {
                    /* This head's scales of the chunk's positions; lanes past n are masked. */
                    const int h = it->h0 + hi;
                    for (int t = 0; t < PA_CHUNK; t++) {
                        w->ksc[t] = t < n ? J->ks[slots[t] * J->KVH + h] * J->scl : 0.f;
                        w->vsc[t] = t < n ? J->vs[slots[t] * J->KVH + h] : 0.f;
                    }
                }
#ifdef PA_X86
                if (J->isa >= ISA_AVX512) {
                    head_avx512(J, w, hi * RH, RH, n, krow, vrow, hi * head_bytes, &pf);
                    continue;
                }
                if (J->isa == ISA_AVX2) {
                    head_avx2(J, w, hi * RH, RH, n, krow, vrow, hi * head_bytes, &pf);
                    continue;
                }
#endif
                head_portable(J, w, hi * RH, RH, n, krow, vrow, hi * head_bytes);
            }
            if (gapped)
                tree_chunk(J, w, it, tok0, prefix, pos0, c1, RH, head_bytes, kbase, vbase, row_stride,
                           gapped);
        }
#ifdef PA_X86
        if (prev_n) {
            const pa_pf_t none = {0};
            amx_swap(w);
            for (int hi = 0; hi < it->nh; hi++)
                bf16_rest(J, w, hi * RH, RH, prev_n, prev_v, hi * head_bytes, &none);
        }
#endif
        for (int r = 0; r < RT; r++) {
            float sum = 0.f;
            for (int i = 0; i < 16; i++)
                sum += w->lv[(size_t)r * 16 + i];
            w->l[r] = sum;
        }
        if (folds) {
            for (int r = 0; r < RT; r++)
                fold_piece(w->fm + r, w->fl + r, w->fa + (size_t)r * D, w->m[r], w->l[r],
                           w->acc + (size_t)r * D, D);
        } else {
            float *p = J->partials + (size_t)(it->part0 + piece) * J->part_stride;
            memcpy(p, w->acc, (size_t)RT * D * sizeof(float));
            memcpy(p + (size_t)RT * D, w->m, (size_t)RT * sizeof(float));
            memcpy(p + (size_t)RT * D + RT, w->l, (size_t)RT * sizeof(float));
        }
    }

    if (it->part0 < 0) {
        for (int r = 0; r < RT; r++)
            /* A row that saw no position at all (only possible with a mask row that has no
             * bits and an empty prefix) gets zeros rather than 0/0. */
            store_row(J, out_row(J, tok0, it->h0, RH, r), w->fa + (size_t)r * D,
                      w->fl[r] > 0.f ? 1.f / w->fl[r] : 0.f);
    } else if (it->p0 == 0) {
        float *p = J->partials + (size_t)it->part0 * J->part_stride;
        memcpy(p, w->fa, (size_t)RT * D * sizeof(float));
        memcpy(p + (size_t)RT * D, w->fm, (size_t)RT * sizeof(float));
        memcpy(p + (size_t)RT * D + RT, w->fl, (size_t)RT * sizeof(float));
    }
    if (J->amx)
        amx_end();
}

/* Row blocks of a plan with ngrp kv-head groups and token blocks of at most ntb tokens. */
static int64_t row_blocks(const pa_job_t *J, int ngrp, int ntb)
{
    int64_t n = 0;
    for (int s = 0; s < J->S; s++) {
        const int qlen = J->cu[s + 1] - J->cu[s];
        if (qlen > 0)
            n += (int64_t)ngrp * ((qlen + ntb - 1) / ntb);
    }
    return n;
}

static void run_items(const void *ctx, int i0, int i1)
{
    const pa_job_t *J = (const pa_job_t *)ctx;
    for (int i = i0; i < i1; i++)
        run_item(J, &J->items[i]);
}

/* Finish a row block split over items: continue its first item's fold (slot part0) with the
 * later pieces, one slot each, in order -- the very fold_piece calls an unsplit item makes. */
static void merge_parts(const pa_job_t *J, const pa_merge_t *g, float *tmp)
{
    const int D = J->D, RH = g->nt * J->G, RT = g->nh * RH;
    const int tok0 = J->cu[g->seq] + g->t0;
    const float *first = J->partials + (size_t)g->part0 * J->part_stride;
    for (int r = 0; r < RT; r++) {
        float M = first[(size_t)RT * D + r], L = first[(size_t)RT * D + RT + r];
        memcpy(tmp, first + (size_t)r * D, (size_t)D * sizeof(float));
        for (int p = g->first; p < g->npieces; p++) {
            const float *ps = J->partials + (size_t)(g->part0 + p) * J->part_stride;
            fold_piece(&M, &L, tmp, ps[(size_t)RT * D + r], ps[(size_t)RT * D + RT + r],
                       ps + (size_t)r * D, D);
        }
        store_row(J, out_row(J, tok0, g->h0, RH, r), tmp, L > 0.f ? 1.f / L : 0.f);
    }
}

/* ------------------------------------------------------------------------- */
/* Planning and the public entry point                                        */
/* ------------------------------------------------------------------------- */

/* Largest cost first, so that the last items handed out are small (ties: plan order). */
static int cmp_cost_desc(const void *a, const void *b)
{
    const pa_item_t *x = (const pa_item_t *)a, *y = (const pa_item_t *)b;
    if (x->cost != y->cost)
        return x->cost < y->cost ? 1 : -1;
    if (x->seq != y->seq)
        return x->seq < y->seq ? -1 : 1;
    if (x->t0 != y->t0)
        return x->t0 < y->t0 ? -1 : 1;
    if (x->h0 != y->h0)
        return x->h0 < y->h0 ? -1 : 1;
    return x->p0 < y->p0 ? -1 : (x->p0 > y->p0);
}

/* The last new token (0-based, -1 if none) that any query token of [t0, t1) of sequence s
 * may see: bounds the context its item has to read. */
static int last_visible(const pa_job_t *J, int s, int qlen, int t0, int t1)
{
    if (!J->mask)
        return t1 - 1;  /* causal */
    int hi = -1;
    for (int t = t0; t < t1; t++) {
        const int32_t *mrow = J->mask + (size_t)(J->cu[s] + t) * J->W;
        for (int wd = (qlen - 1) >> 5; wd >= 0 && wd * 32 + 31 > hi; wd--) {
            uint32_t bits = (uint32_t)mrow[wd];
            const int top = qlen - wd * 32;  /* bits of this word inside q_len */
            if (top < 32)
                bits &= (1u << top) - 1u;
            if (bits) {
                const int h = wd * 32 + 31 - __builtin_clz(bits);
                hi = h > hi ? h : hi;
                break;
            }
        }
    }
    return hi;
}

static inline int pa_err(int code, int64_t index) { return -(int)(code + 8 * index); }

int pa_version(void) { return PA_VERSION; }
void pa_set_solo_work(int w) { g_solo_work = w < 0 ? 0 : w; }

/* A bf16 cache's q.K on AMX tiles (1) or not (0, the default; -1 leaves it); returns whether it
 * is in use now (also needs the tier, the CPU, the OS and pg_bf16_amx's switch).  Off by default: it makes an
 * 8-token verify's attention ~15% cheaper but a batch of decode rows up to ~14% dearer, and the load
 * benchmark's goodput fell with it (docs/CPU_PERFORMANCE.md, sixteenth session). */
int pa_set_amx(int on)
{
    if (on >= 0)
        g_attn_amx = on != 0;
    return g_attn_amx && pa_amx_on();
}

/*
 * out[T, H, D] = tree attention (docs/CONTRACTS.md) of q over the paged K/V of every
 * sequence.  Returns 0, or -(code + 8 * index) with code PA_E* and index the offending
 * sequence, before any output is written.
 */
int pa_tree_attention(const pa_args_t *a)
{
    const int64_t T = a->num_tokens, H = a->num_heads, D = a->head_dim, KVH = a->num_kv_heads;
    const int64_t NB = a->num_blocks, BS = a->block_size, S = a->num_seqs, MB = a->max_blocks;
    const int64_t W = a->mask_bits ? a->num_words : 0;
    if (T < 0 || H < 1 || D < 1 || KVH < 1 || H % KVH || NB < 0 || BS < 1 || S < 0 || MB < 0 ||
        (a->dtype != DT_F32 && a->dtype != DT_BF16) || (a->mask_bits && W < 1) ||
        (a->kv_dtype != a->dtype && a->kv_dtype != PA_KV_I8) ||
        (a->kv_dtype == PA_KV_I8 && (!a->k_scale || !a->v_scale)) ||
        T > INT32_MAX / 2 || H * D > INT32_MAX / 2 || D > 65536 || MB * BS > INT32_MAX / 2)
        return pa_err(PA_EDIMS, 0);
    if (T == 0)
        return 0;

    pa_job_t J;
    memset(&J, 0, sizeof(J));
    J.q = (const char *)(intptr_t)a->q;
    J.k = (const char *)(intptr_t)a->k_cache;
    J.v = (const char *)(intptr_t)a->v_cache;
    J.bt = (const int32_t *)(intptr_t)a->block_tables;
    J.cl = (const int32_t *)(intptr_t)a->context_lens;
    J.cu = (const int32_t *)(intptr_t)a->cu_seqlens_q;
    J.mask = (const int32_t *)(intptr_t)a->mask_bits;
    J.out = (char *)(intptr_t)a->out;
    J.qs_tok = a->q_stride_tok;
    J.qs_head = a->q_stride_head;
    J.T = (int)T; J.H = (int)H; J.D = (int)D; J.KVH = (int)KVH; J.NB = (int)NB; J.BS = (int)BS;
    J.S = (int)S; J.MB = (int)MB; J.W = (int)W; J.dt = (int)a->dtype;
    J.G = (int)(H / KVH);
    J.esz = J.dt == DT_F32 ? 4 : 2;
    J.kvdt = (int)a->kv_dtype;
    J.kesz = J.kvdt == DT_F32 ? 4 : J.kvdt == DT_BF16 ? 2 : 1;
    J.ks = (const float *)(intptr_t)a->k_scale;
    J.vs = (const float *)(intptr_t)a->v_scale;
    J.scl = (float)(a->scale * 1.4426950408889634);
    J.isa = pg_isa();
    if (D % 32)
        J.isa = ISA_PORTABLE;  /* the vector paths work in 32-wide blocks of head_dim */
    J.dp = J.isa >= ISA_AVX512_BF16 && J.kvdt == DT_BF16;
    J.fma = J.dp && pg_bf16_fma();
    J.perm = J.dp && !J.fma ? 2 : J.isa >= ISA_AVX512 && J.kvdt == DT_BF16;
    J.amx = g_attn_amx && J.dp && J.dt == DT_BF16 && D <= 128 && pa_amx_on();

    /* Validate everything the items will index with, before any work starts. */
    if (J.cu[0] != 0 || J.cu[S] != T)
        return pa_err(PA_ECUEND, 0);
    for (int s = 0; s < S; s++) {
        const int64_t qlen = (int64_t)J.cu[s + 1] - J.cu[s];
        const int64_t ctx = J.cl[s];
        if (qlen < 0)
            return pa_err(PA_ECU, s);
        if (qlen == 0)
            continue;
        if (ctx < qlen || ctx > MB * BS)
            return pa_err(PA_ECTX, s);
        if (J.mask && qlen > W * 32)
            return pa_err(PA_EMASK, s);
        const int32_t *bt = J.bt + (size_t)s * MB;
        for (int64_t b = 0; b < (ctx + BS - 1) / BS; b++)
            if (bt[b] < 0 || bt[b] >= NB)
                return pa_err(PA_EBLOCK, s);
    }

    /* Item shape: tokens in blocks of at most ntmax (PA_MAX_ROWS rows per kv head at
     * head_dim 64, fewer for wider heads), and as many kv heads as fit PA_ACC_FLOATS
     * accumulators, in even groups. */
    const int G = J.G;
    const int row_cap = (int)(PA_MAX_ROWS * 64 / (D > 64 ? D : 64));
    const int ntmax = row_cap / G > 0 ? row_cap / G : 1;
    int nh = (int)(PA_ACC_FLOATS / ((int64_t)ntmax * G * D));
    nh = nh < 1 ? 1 : nh > KVH ? (int)KVH : nh;
    int ngrp = (int)((KVH + nh - 1) / nh);
    int64_t maxq = 0, fullp = -1;  /* the longest q, and the fewest full pieces of a sequence with q */
    for (int s = 0; s < S; s++) {
        const int64_t qlen = J.cu[s + 1] - J.cu[s];
        if (qlen == 0)
            continue;
        maxq = qlen > maxq ? qlen : maxq;
        const int64_t fp = (J.cl[s] - qlen + 1) / PA_PIECE;
        fullp = fullp < 0 || fp < fullp ? fp : fullp;
    }
    /* Few row blocks (one sequence decoding or verifying a draft tree): more of them, first
     * one per kv head (no extra reads: the heads are independent), then shorter token blocks
     * (each reads the context again), so that every pool thread gets a full-length item; the
     * pieces alone cannot do it when the context is one long piece and a short one (a tree at
     * 256 cached tokens ran on one thread).  Neither, where pg_one_stream(), when the row blocks'
     * full pieces already give each thread two items: those spread instead (below), and an item reads whole cache
     * rows (all the kv heads of a position, one stream) once per row block -- on Zen 4, 120
     * layers' bf16 caches from DRAM, a decode at 1k cached tokens 13% faster, at 4k 20%, an
     * 8-token verify at 1k 13% (it had transposed each K chunk twice).  Scheduling only, like
     * the piece split below: a row's arithmetic does not depend on its item's heads or tokens
     * (batch invariance (4)). */
    const int nth = pg_num_threads();
    const int target = PA_ITEMS_PER_THREAD * (nth > 2 ? nth : 2);
    int ntb = ntmax;
    int64_t nbase = row_blocks(&J, ngrp, ntb);
    const int one = pg_one_stream();  /* measured on Zen 4; Intel keeps the splits it was tuned with */
    if (nbase < target && ngrp < KVH && !(one && nbase * fullp >= 2 * nth)) {
        ngrp = (int)KVH;
        nbase = row_blocks(&J, ngrp, ntb);
    }
    if (nbase < 2 * nth && maxq > 1 && nbase > 0 && !(one && nbase * fullp >= 2 * nth)) {
        const int64_t split = (2 * nth + nbase - 1) / nbase;
        const int64_t t = (maxq + split - 1) / split;
        /* at least PA_MIN_TOKENS, at most ntmax (the partial slots are sized for ntmax rows) */
        ntb = (int)(t < PA_MIN_TOKENS ? PA_MIN_TOKENS : t);
        ntb = ntb < ntmax ? ntb : ntmax;
        nbase = row_blocks(&J, ngrp, ntb);
    }
    nh = (int)((KVH + ngrp - 1) / ngrp);  /* the widest group */
    if (nbase > INT32_MAX / 64)
        return pa_err(PA_EDIMS, 0);
    /* Still few row blocks: spread each one's pieces over several items (flash-decoding).
     * This only schedules; the pieces and their fold are the same either way. */
    const int want = nbase < target ? (int)((target + nbase - 1) / nbase) : 1;

    /* Pass 1 counts items and partial slots, pass 2 fills them in. */
    pa_item_t *items = NULL;
    pa_merge_t *groups = NULL;
    int nitems = 0, ngroups = 0, nparts = 0;
    int64_t total = 0;
    for (int pass = 0; pass < 2; pass++) {
        nitems = ngroups = nparts = 0;
        total = 0;
        for (int s = 0; s < S; s++) {
            const int qlen = J.cu[s + 1] - J.cu[s];
            if (qlen == 0)
                continue;
            const int prefix = J.cl[s] - qlen;
            const int nblk = (qlen + ntb - 1) / ntb;
            for (int b = 0; b < nblk; b++) {
                /* Even token blocks: 64 tokens as 22 + 21 + 21, not 21 + 21 + 21 + 1. */
                const int t0 = (int)((int64_t)qlen * b / nblk);
                const int t1 = (int)((int64_t)qlen * (b + 1) / nblk);
                const int end = prefix + last_visible(&J, s, qlen, t0, t1) + 1;
                const int npieces = end > 0 ? (end + PA_PIECE - 1) / PA_PIECE : 1;
                const int nsplit = want < npieces ? want : npieces;
                for (int gi = 0; gi < ngrp; gi++) {
                    const int h0 = (int)(KVH * gi / ngrp), h1 = (int)(KVH * (gi + 1) / ngrp);
                    const int rows = (t1 - t0) * G * (h1 - h0);
                    if (nsplit > 1 && pass == 1)
                        groups[ngroups] = (pa_merge_t){s, h0, h1 - h0, t0, t1 - t0, nparts,
                                                       npieces / nsplit, npieces};
                    for (int k = 0; k < nsplit; k++) {
                        /* Even runs of pieces (32 over 8 items: 4 each). */
                        const int p0 = (int)((int64_t)npieces * k / nsplit);
                        const int p1 = (int)((int64_t)npieces * (k + 1) / nsplit);
                        const int c0 = p0 * PA_PIECE;
                        const int c1 = (int64_t)p1 * PA_PIECE < end ? p1 * PA_PIECE : end;
                        if (pass == 1)
                            items[nitems] = (pa_item_t){s, h0, h1 - h0, t0, t1 - t0, p0, p1, end,
                                                        nsplit > 1 ? nparts : -1,
                                                        (int64_t)(c1 - c0 + PA_CHUNK) * rows};
                        nitems++;
                        total += (int64_t)(c1 - c0) * rows;
                    }
                    if (nsplit > 1) {
                        nparts += npieces;
                        ngroups++;
                    }
                }
            }
        }
        if (pass == 0) {
            J.part_stride = ((size_t)ntmax * G * nh * (D + 2) + 15) & ~(size_t)15;
            const size_t head = (size_t)nitems * sizeof(pa_item_t) + (size_t)ngroups * sizeof(pa_merge_t);
            const size_t bytes = ((head + 63) & ~(size_t)63) +
                                 ((size_t)nparts * J.part_stride + D) * sizeof(float);
            char *base = (char *)tls_scratch(1, bytes);
            if (!base)
                return pa_err(PA_ENOMEM, 0);
            items = (pa_item_t *)base;
            groups = (pa_merge_t *)(base + (size_t)nitems * sizeof(pa_item_t));
            J.partials = (float *)(base + ((head + 63) & ~(size_t)63));
        }
    }
    float *merge_tmp = J.partials + (size_t)nparts * J.part_stride;
    qsort(items, (size_t)nitems, sizeof(pa_item_t), cmp_cost_desc);
    J.items = items;

    if (total < g_solo_work || (a->flags & PA_SOLO))
        run_items(&J, 0, nitems);
    else
        pg_parallel_for(run_items, &J, nitems, 1);
    if (atomic_load(&J.err))
        return pa_err(PA_ENOMEM, 0);
    for (int g = 0; g < ngroups; g++)
        merge_parts(&J, &groups[g], merge_tmp);
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Writing new K/V rows into an int8 cache                                    */
/* ------------------------------------------------------------------------- */

/* pa_store_args_t (cpu_attention.h): pa_store_kv_i8's arguments, one buffer as for
 * pa_tree_attention (_STORE_ARGS in cpu_attention.py). */

/* One head's row: scale = amax / 127, dst = round(x / scale) (to nearest even, as torch.round)
 * clamped to [-127, 127]; an all-zero row gets scale 0 and zeros.  Written like
 * reference.quantize_kv, operation for operation (a true division, not a multiply by
 * 1 / scale), so the two agree bit for bit.  Two passes over the source, both in L1. */
static void quantize_row(const void *src, int dt, int D, int8_t *dst, float *scale)
{
    float amax = 0.f;
    if (dt == DT_F32) {
        const float *x = (const float *)src;
        for (int d = 0; d < D; d++) {
            const float a = fabsf(x[d]);
            amax = a > amax ? a : amax;
        }
    } else {
        const uint16_t *x = (const uint16_t *)src;
        for (int d = 0; d < D; d++) {
            const float a = fabsf(bf16_to_f32(x[d]));
            amax = a > amax ? a : amax;
        }
    }
    const float s = amax / 127.f;
    *scale = s;
    for (int d = 0; d < D; d++) {
        const float x = dt == DT_F32 ? ((const float *)src)[d] : bf16_to_f32(((const uint16_t *)src)[d]);
        float y = s > 0.f ? rintf(x / s) : 0.f;
        y = y > 127.f ? 127.f : y < -127.f ? -127.f : y;
        dst[d] = (int8_t)(y == y ? y : 0.f);  /* NaN input: 0 rather than undefined */
    }
}

/* k_cache/v_cache slot s (int8 [num_slots][KVH][D]) and k_scale/v_scale slot s (fp32
 * [num_slots][KVH]) = the quantized rows of token i, for s = slots[i] >= 0 (negative: skip).
 * k, v: [num_tokens][KVH][D] fp32 or bf16 through their token / head strides.  Returns 0, or
 * -(PS_ESLOT + 8 * i) for the first token i whose slot is >= num_slots (nothing written), or
 * -PS_EDIMS. */
int pa_store_kv_i8(const pa_store_args_t *a)
{
    const int64_t T = a->num_tokens, KVH = a->num_kv_heads, D = a->head_dim, NS = a->num_slots;
    if (T < 0 || KVH < 1 || D < 1 || NS < 0 || (a->dtype != DT_F32 && a->dtype != DT_BF16) ||
        T > INT32_MAX / 8)
        return pa_err(PS_EDIMS, 0);
    const int64_t *slots = (const int64_t *)(intptr_t)a->slots;
    for (int64_t i = 0; i < T; i++)
        if (slots[i] >= NS)
            return pa_err(PS_ESLOT, i);
    const int dt = (int)a->dtype;
    const size_t esz = dt == DT_F32 ? 4 : 2;
    const char *k = (const char *)(intptr_t)a->k, *v = (const char *)(intptr_t)a->v;
    int8_t *kc = (int8_t *)(intptr_t)a->k_cache, *vc = (int8_t *)(intptr_t)a->v_cache;
    float *ks = (float *)(intptr_t)a->k_scale, *vs = (float *)(intptr_t)a->v_scale;
    for (int64_t i = 0; i < T; i++) {
        if (slots[i] < 0)
            continue;
        for (int64_t h = 0; h < KVH; h++) {
            const size_t at = (size_t)slots[i] * KVH + h;
            quantize_row(k + (size_t)(i * a->k_stride_tok + h * a->k_stride_head) * esz, dt, (int)D,
                         kc + at * D, ks + at);
            quantize_row(v + (size_t)(i * a->v_stride_tok + h * a->v_stride_head) * esz, dt, (int)D,
                         vc + at * D, vs + at);
        }
    }
    return 0;
}
