/*
 * cpu_gemv_amx.c -- bf16 weights on AMX tiles: y = x @ W^T (+ b) for M <= PG_MAX_M rows, at tier
 * avx512_bf16 on a CPU with AMX-BF16 whose OS grants the tile state (pg_bf16_amx, cpu_runtime.c).
 *
 * Why: a decode step reads each weight once, so M = 1 is bound by the weights' read; a verify or a
 * decode batch multiplies each weight by M rows, and on FMAs (cpu_gemv.c) an 8-row product costs
 * 1.4x a 1-row one (Emerald Rapids, 2 cores).  One tdpbf16ps multiplies 16 rows by 16 columns by
 * 32 elements, so up to 16 rows cost what one does: the weights' read again.
 *
 * Layout (pg_amx_repack, once at load, beside the row-major weight that prefill's GEMM reads):
 * per 16-column tile t and 32-element block b, 1 KB holding row i (elements k = 32b + 2i, 2i + 1)
 * as the 16 columns' pairs (W[n][k], W[n][k + 1]): the B operand of tdpbf16ps in one tile load.
 * N is padded to 16 and K to 32 with zeros.
 *
 * Numerics: x is rounded to bf16 (as the vdpbf16ps path does) and each (row, column) sums its
 * blocks in order in one fp32 tile accumulator, with the tile unit's own rounding (which matches
 * none of the FMA orders tried: other bits than the vdpbf16ps path's).  A row's products do not
 * depend on the other rows of its tile (zero rows pad it to 16), and every M runs the same
 * blocks in the same order, so a row's bits do not depend on M (batch invariance).
 *
 *     for each column tile t:            C[g] = 0 for the row groups g (16 rows each, <= 4)
 *         for each block b in order:     B = tile(t, b); C[g] += A[g][:, 32b:32b+32] . B
 *         y[16g + r][16t + c] = C[g][r][c] (+ bias), rows < M, columns < N
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_gemv.h"

size_t pg_amx_repack_bytes(int N, int K)
{
    return (size_t)((N + 15) / 16) * ((K + 31) / 32) * 1024;
}

int pg_amx_repack(const uint16_t *w, int N, int K, uint16_t *out)
{
    if (N < 1 || K < 1)
        return -1;
    if (!pg_amx_granted())  /* the first copy asks Linux for the tile state; no copy without it */
        return -2;
    const int NT = (N + 15) / 16, KB = (K + 31) / 32;
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < KB; b++) {
            uint16_t *o = out + ((size_t)t * KB + b) * 512;
            for (int i = 0; i < 16; i++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++) {
                        const int n = 16 * t + c, k = 32 * b + 2 * i + e;
                        o[32 * i + 2 * c + e] = n < N && k < K ? w[(size_t)n * K + k] : 0;
                    }
        }
    return 0;
}

#if PG_AMX

#include <immintrin.h>

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_cfg_t;

typedef struct {
    const uint16_t *rp;  /* the repacked W */
    const float *bias;   /* [N] fp32 or NULL */
    const uint16_t *xp;  /* [16 G][32 KB] bf16: x rounded, zero-padded rows and tail */
    void *y;             /* [M, N], ydt */
    int ydt, M, N, KB, G;
} amx_job_t;

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

void pg_amx_config(int n, int rows)
{
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < n ? rows : 16;
        c.colsb[t] = 64;
    }
    /* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes: without this, the stores
     * above can be dropped (a generic build's were) and ldtilecfg faults on the garbage */
    __asm__ volatile("" : : "m"(c));
    _tile_loadconfig(&c);
}

/* x's and the results' tiles (0-4) `rows` high (M below 16, else 16), the weights' 16.  Loaded at
 * each task's start and released at its end: other code on the thread (oneDNN's AMX GEMMs in
 * torch) sets its own. */
static void amx_config(int rows) { pg_amx_config(5, rows); }

/* Rows of one 16 x 16 fp32 result (row group g, column tile t) into y, rows < M, columns < N. */
static void amx_emit(const amx_job_t *j, const float *c, int g, int t)
{
    const int n0 = 16 * t, nn = j->N - n0 < 16 ? j->N - n0 : 16;
    const __mmask16 k = (__mmask16)((1u << nn) - 1u);
    const __m512 b = j->bias ? _mm512_maskz_loadu_ps(k, j->bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < 16 && 16 * g + r < j->M; r++) {
        __m512 v = _mm512_load_ps(c + 16 * r);
        if (j->bias)
            v = _mm512_add_ps(v, b);
        const size_t off = (size_t)(16 * g + r) * j->N + n0;
        if (j->ydt == DT_F32)
            _mm512_mask_storeu_ps((float *)j->y + off, k, v);
        else
            _mm256_mask_storeu_epi16((uint16_t *)j->y + off, k, bf16x16_rne(v));
    }
}

/* The next tiles' weights toward L1 while these multiply. */
#define AMX_PF(p) do {                                                              \
        for (int l = 0; l < 1024; l += 64)                                          \
            _mm_prefetch((const char *)(p) + l + AMX_PF_BYTES, _MM_HINT_T0);        \
    } while (0)
#ifndef AMX_PF_BYTES
#define AMX_PF_BYTES 4096
#endif

/* Tile ids are instruction immediates, so each shape is its own code: C tiles 0-3, A 4, B 5-7.
 * Each accumulator is one chain of dependent tile products (a product waits for the last), so
 * a task keeps 4 chains going: 1 row group takes 4 column tiles at once, 2 take 2, 3-4 one. */
#define AMX_A(g, b) _tile_loadd(4, (const char *)j->xp + (size_t)(g) * 16 * xs + (size_t)(b) * 64, xs)

static void amx_task(const void *ctx, int u0, int u1)
{
    const amx_job_t *j = (const amx_job_t *)ctx;
    const int KB = j->KB, G = j->G;
    const size_t xs = (size_t)KB * 64, ts = (size_t)KB * 512;  /* bytes per x row; elements per tile */
    float c[16 * 16] __attribute__((aligned(64)));
    amx_config(j->M < 16 ? j->M : 16);
    int t = u0;
    if (G == 1) {
        for (; t + 4 <= u1; t += 4) {
            const uint16_t *B0 = j->rp + (size_t)t * ts, *B1 = B0 + ts, *B2 = B1 + ts, *B3 = B2 + ts;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int b = 0; b < KB; b++) {
                const size_t o = (size_t)b * 512;
                AMX_PF(B0 + o); AMX_PF(B1 + o); AMX_PF(B2 + o); AMX_PF(B3 + o);
                AMX_A(0, b);
                _tile_loadd(5, B0 + o, 64);
                _tile_loadd(6, B1 + o, 64);
                _tile_loadd(7, B2 + o, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, B3 + o, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, c, 64); amx_emit(j, c, 0, t);
            _tile_stored(1, c, 64); amx_emit(j, c, 0, t + 1);
            _tile_stored(2, c, 64); amx_emit(j, c, 0, t + 2);
            _tile_stored(3, c, 64); amx_emit(j, c, 0, t + 3);
        }
    }
    if (G <= 2) {
        for (; t + 2 <= u1; t += 2) {
            const uint16_t *B0 = j->rp + (size_t)t * ts, *B1 = B0 + ts;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int b = 0; b < KB; b++) {
                AMX_PF(B0 + (size_t)b * 512);
                AMX_PF(B1 + (size_t)b * 512);
                _tile_loadd(5, B0 + (size_t)b * 512, 64);
                _tile_loadd(6, B1 + (size_t)b * 512, 64);
                AMX_A(0, b);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                if (G == 2) {
                    AMX_A(1, b);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
            _tile_stored(0, c, 64); amx_emit(j, c, 0, t);
            _tile_stored(1, c, 64); amx_emit(j, c, 0, t + 1);
            if (G == 2) {
                _tile_stored(2, c, 64); amx_emit(j, c, 1, t);
                _tile_stored(3, c, 64); amx_emit(j, c, 1, t + 1);
            }
        }
    }
    for (; t < u1; t++) {  /* G = 3-4, or a last single column tile */
        const uint16_t *B = j->rp + (size_t)t * ts;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int b = 0; b < KB; b++) {
            AMX_PF(B + (size_t)b * 512);
            _tile_loadd(5, B + (size_t)b * 512, 64);
            AMX_A(0, b);
            _tile_dpbf16ps(0, 4, 5);
            if (G >= 2) { AMX_A(1, b); _tile_dpbf16ps(1, 4, 5); }
            if (G >= 3) { AMX_A(2, b); _tile_dpbf16ps(2, 4, 5); }
            if (G >= 4) { AMX_A(3, b); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, c, 64); amx_emit(j, c, 0, t);
        if (G >= 2) { _tile_stored(1, c, 64); amx_emit(j, c, 1, t); }
        if (G >= 3) { _tile_stored(2, c, 64); amx_emit(j, c, 2, t); }
        if (G >= 4) { _tile_stored(3, c, 64); amx_emit(j, c, 3, t); }
    }
    _tile_release();
}

#pragma GCC pop_options

int pg_linear_amx(const uint16_t *rp, const float *bias, const void *x, int xdt, void *y, int M, int N, int K)
{
    if (M < 1 || M > PG_MAX_M || N < 1 || K < 1 || !rp || (xdt != DT_F32 && xdt != DT_BF16))
        return -1;
    amx_job_t j;
    j.rp = rp; j.bias = bias; j.y = y; j.ydt = xdt;
    j.M = M; j.N = N; j.KB = (K + 31) / 32; j.G = (M + 15) / 16;
    const size_t xrow = (size_t)j.KB * 32, xbytes = (size_t)j.G * 16 * xrow * 2;
    uint16_t *xp = (uint16_t *)pg_scratch(xbytes);  /* x rounded as the vdpbf16ps path rounds it */
    if (!xp)
        return -2;
    /* rows past M are zeros where a group of 16 reads them (below 16 rows the tiles have M) */
    const int rows = M < 16 ? M : 16 * j.G;
    for (int m = 0; m < rows; m++) {
        uint16_t *dst = xp + (size_t)m * xrow;
        if (m >= M)
            memset(dst, 0, xrow * 2);
        else if (xdt == DT_BF16)
            memcpy(dst, (const uint16_t *)x + (size_t)m * K, (size_t)K * 2);
        else
            pg_round_bf16((const float *)x + (size_t)m * K, dst, (size_t)K);
        if (m < M && xrow > (size_t)K)
            memset(dst + K, 0, (xrow - K) * 2);  /* the last block's tail */
    }
    j.xp = xp;
    /* the tile loads read xp through an asm without a memory operand: the stores come first */
    __asm__ volatile("" ::: "memory");
    const int NT = (N + 15) / 16, nth = pg_num_threads();
    const size_t tile_bytes = (size_t)j.KB * 1024;
    if (nth <= 1 || (size_t)NT * tile_bytes < 48 * 1024 || NT < 4) {
        amx_task(&j, 0, NT);
        return 0;
    }
    /* PG_CHUNKS_PER_THREAD chunks a thread, a multiple of 4 column tiles each (the tasks' groups)
     * where that keeps them even (576 columns: 36 tiles in 4 chunks of 9, not 3 of 12). */
    int per = (NT + PG_CHUNKS_PER_THREAD * nth - 1) / (PG_CHUNKS_PER_THREAD * nth);
    if (per >= 16)
        per = (per + 3) & ~3;
    pg_parallel_for(amx_task, &j, NT, per);
    return 0;
}

#else  /* no AMX in this build: pg_bf16_amx() is 0, so nothing calls this */

int pg_linear_amx(const uint16_t *rp, const float *bias, const void *x, int xdt, void *y, int M, int N, int K)
{
    (void)rp, (void)bias, (void)x, (void)xdt, (void)y, (void)M, (void)N, (void)K;
    return -1;
}

#endif
