/*
 * cpu_isa.h -- the ISA tiers of the CPU kernels (cpu_gemv.c, cpu_attention.c, cpu_qgemv.c),
 * ordered so that "tier >= X" means "X's instructions may be used".  The tier in use is
 * pg_isa(): the best the CPU and OS support, capped by pg_set_isa_cap (PRESCIENT_ISA in
 * kernels/cpu_linear.py), so an AVX-512 machine can run and test the AVX2 paths.
 */
#ifndef PRESCIENT_CPU_ISA_H
#define PRESCIENT_CPU_ISA_H

enum {
    ISA_PORTABLE = 0,    /* plain C the compiler vectorises (any CPU; aarch64 adds NEON there) */
    ISA_AVX2 = 1,        /* AVX2 + FMA + F16C (Haswell, Zen 1-3) */
    ISA_AVX512 = 2,      /* AVX-512 F/BW/VL/DQ (Skylake-X; bf16 by widening) */
    ISA_AVX512_BF16 = 3, /* + AVX512_BF16 (vdpbf16ps) and VNNI (Zen 4, Sapphire Rapids) */
};

int pg_isa(void);

#endif
