/*
 * cpu_qgemv_k.h -- the K-quant family (Q4_K, Q5_K, Q6_K; cpu_qgemv_k.c): the entry points the
 * format table (cpu_formats.c) points at.  QK_FORMATS lists the family; QK_DECLARE is what
 * each of its formats provides.  Private to the family and the table (hidden symbols).
 */
#ifndef PRESCIENT_CPU_QGEMV_K_H
#define PRESCIENT_CPU_QGEMV_K_H

#include <stddef.h>
#include <stdint.h>
#include "cpu_formats.h"

/* X(name, code) for every format of the family. */
#define QK_FORMATS(X) X(q4_k, DT_Q4_K) X(q5_k, DT_Q5_K) X(q6_k, DT_Q6_K)

/* rows_float: the fp32-dequantize path at the tier in use (the portable tier's kernel);
 * rows_simd: the int8 kernels of the SIMD tiers when x was prepared, else rows_float;
 * dequant_ref: the portable exact dequantizer; dequant_simd: the tier in use's. */
#define QK_DECLARE(name, code)                                                            \
    void qk_prep_##name(const float *x, int M, int K, void *xa, int isa, int cl);               \
    void qk_rows_float_##name(const pq_job_t *j, int n0, int n1);                         \
    void qk_rows_simd_##name(const pq_job_t *j, int n0, int n1);                          \
    void qk_dequant_ref_##name(const uint8_t *blk, int nblk, float *out);                 \
    void qk_dequant_simd_##name(const uint8_t *blk, int nblk, float *out);

#pragma GCC visibility push(hidden)
QK_FORMATS(QK_DECLARE)
size_t qk_xa_bytes(int M, int K);
int qk_act_block(int isa);
#pragma GCC visibility pop

#endif
