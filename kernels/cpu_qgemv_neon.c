/*
 * cpu_qgemv_neon.c -- the 32-element family's int8 rows on aarch64 with the dot-product
 * extension (SDOT, Armv8.2 FEAT_DotProd: pg_neon_dot), on the column-lane copy of W that the
 * x86 VNNI and AVX2 rows read (PQ_RP_CL, cpu_qgemv.h).  The same sums in the same order, so the
 * same bits as those rows (tests/kernels/qgemv_cl_driver.c checks both against one scalar
 * model):
 *
 *   for each (input row m, output column n):
 *       acc = 0
 *       for block b in order:
 *           dot = aux_int[m][b] (Q4_0: -8 sum q, Q8_0: 0; Q4_1: 0)  +  sum_i w_q[n][b][i] * x_q[m][b][i]
 *           acc = fma(float(dot), d_w[n][b] * d_x[m][b], acc)        -- one rounding
 *           Q4_1: acc = fma(m_w[n][b], d_x[m][b] * sum_i x_q[m][b][i], acc)
 *       y[m][n] = acc (+ bias[n]), fp32 or bf16 (nearest even)
 *
 * Layout of a pass: one 16-column tile (a cell per block: four q registers of 4 columns x 4
 * bytes a step) for up to two input rows; a step s is one SDOT by element per 4 columns, the
 * activations' 4 bytes of step s taken from lane s & 3 of a register holding 16 of them.
 * Q4 nibbles are 0..15 (signed bytes as they are); Q8_0's copy holds q + 128, made signed
 * again by ^ 0x80 (so aux is 0, as tier avx2's).  Without the extension (or with the copy
 * missing) the portable rows run, in fp32 (cpu_qgemv.c's rows_portable).
 *
 * Speed on real Arm cores is not measured yet (no Arm machine here); qemu checks the bits.
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "cpu_qgemv.h"

#if PQ_NEON_DOT

#include <arm_neon.h>

/* A target without the extension (a generic aarch64 build) gets it for this file only; a target
 * with it (-march=native on such a core) keeps its own tuning: an `arch=` override there stopped
 * GCC 12 inlining store1 into the tiles.  (clang builds this only in the second case: cpu_runtime.h.) */
#if !defined(__ARM_FEATURE_DOTPROD)
#define PQ_NEON_PRAGMA 1
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#define PQ_NEON_TARGET __attribute__((target("arch=armv8.2-a+dotprod")))
#else
#define PQ_NEON_PRAGMA 0
#define PQ_NEON_TARGET
#endif

/* Columns 4 c .. 4 c + 3 of step s of a cell, as 4 x 4 signed bytes. */
static inline __attribute__((always_inline)) int8x16_t n_wstep(const int FMT, const uint8_t *cell, int s, int c)
{
    if (!Q32_L(FMT).nib)
        return vreinterpretq_s8_u8(veorq_u8(vld1q_u8(cell + 64 * s + 16 * c), vdupq_n_u8(0x80)));
    const uint8x16_t v = vld1q_u8(cell + 64 * (s & 3) + 16 * c);
    return vreinterpretq_s8_u8(s < 4 ? vandq_u8(v, vdupq_n_u8(15)) : vshrq_n_u8(v, 4));
}

/* The fp16 vector at p (4 of them) widened exactly. */
static inline __attribute__((always_inline)) float32x4_t n_half4(const uint8_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)));
}

/* Rows m0 .. m0 + MR - 1 (MR 1 or 2) x the 16 columns of tile t, every block; columns in
 * [n0, n1) stored. */
static inline __attribute__((always_inline))
void n_tile(const pq_job_t *j, const int FMT, const int MR, int m0, int t, int n0, int n1)
{
    const xa_hdr_t *h = (const xa_hdr_t *)j->xa;
    const int nb = j->K / QK, QV = Q32_L(FMT).nib ? 4 : 8;
    const size_t cb = (size_t)16 * Q32_L(FMT).bb, ms = h->mstride;
    const size_t kq = cl_kq(j->K), nb16 = cl_nb16(nb);
    const uint8_t *cell = j->cl + (size_t)t * nb * cb;
    const uint8_t *xr[2];
    for (int m = 0; m < MR; m++)
        xr[m] = XA_DATA(h) + (size_t)(m0 + m) * ms;
    float32x4_t acc[2][4];
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < 4; c++)
            acc[m][c] = vdupq_n_f32(0.f);
    for (int b = 0; b < nb; b++, cell += cb) {
        int32x4_t dot[2][4];
        int8x16_t xlo[2], xhi[2];
        for (int m = 0; m < MR; m++) {
            const int32_t a0 = Q32_L(FMT).has_m ? 0 : ((const int32_t *)(xr[m] + kq + 4 * nb16))[b];
            for (int c = 0; c < 4; c++)
                dot[m][c] = vdupq_n_s32(a0);
            xlo[m] = vld1q_s8((const int8_t *)xr[m] + (size_t)QK * b);
            xhi[m] = vld1q_s8((const int8_t *)xr[m] + (size_t)QK * b + 16);
        }
        /* the lane of an SDOT by element must be a constant: the eight steps written out */
#define N_STEP(s, xv, lane)                                                               \
        for (int c = 0; c < 4; c++) {                                                     \
            const int8x16_t w = n_wstep(FMT, cell, s, c);                                 \
            for (int m = 0; m < MR; m++)                                                  \
                dot[m][c] = vdotq_laneq_s32(dot[m][c], w, xv[m], lane);                   \
        }
        N_STEP(0, xlo, 0) N_STEP(1, xlo, 1) N_STEP(2, xlo, 2) N_STEP(3, xlo, 3)
        N_STEP(4, xhi, 0) N_STEP(5, xhi, 1) N_STEP(6, xhi, 2) N_STEP(7, xhi, 3)
#undef N_STEP
        for (int c = 0; c < 4; c++) {
            const float32x4_t dw = n_half4(cell + 64 * QV + 8 * c);
            for (int m = 0; m < MR; m++) {
                const float dx = ((const float *)(xr[m] + kq))[b];
                acc[m][c] = vfmaq_f32(acc[m][c], vcvtq_f32_s32(dot[m][c]), vmulq_n_f32(dw, dx));
            }
            if (Q32_L(FMT).has_m) {
                const float32x4_t mw = n_half4(cell + 64 * QV + 32 + 8 * c);
                for (int m = 0; m < MR; m++) {
                    const float s = ((const float *)(xr[m] + kq + 4 * nb16))[b];
                    acc[m][c] = vfmaq_f32(acc[m][c], mw, vdupq_n_f32(s));
                }
            }
        }
    }
    for (int m = 0; m < MR; m++) {
        float v[16];
        for (int c = 0; c < 4; c++)
            vst1q_f32(v + 4 * c, acc[m][c]);
        for (int i = 0; i < 16; i++) {
            const int n = 16 * t + i;
            if (n >= n0 && n < n1)
                store1(j, m0 + m, n, v[i]);
        }
    }
}

static inline __attribute__((always_inline)) void n_rows(const pq_job_t *j, int n0, int n1, const int FMT)
{
    for (int t = n0 / 16; 16 * t < n1; t++)
        for (int m0 = 0; m0 < j->M; m0 += 2) {
            if (j->M - m0 >= 2)
                n_tile(j, FMT, 2, m0, t, n0, n1);
            else
                n_tile(j, FMT, 1, m0, t, n0, n1);
        }
}

#if PQ_NEON_PRAGMA
#pragma GCC pop_options
#endif

/* ---- entry points (from q32_rows_ref_*, cpu_qgemv.c, where the prepared x says int8) ------- */

#define Q32_INSTANCE_NEON(name, code)                                                      \
    PQ_NEON_TARGET                                                                         \
    void q32_rows_neon_##name(const pq_job_t *j, int n0, int n1) { n_rows(j, n0, n1, code); }

Q32_FORMATS(Q32_INSTANCE_NEON)

#endif /* PQ_NEON_DOT */
