/*
 * cpu_bf16.h -- bf16 <-> fp32 conversions shared by the CPU kernels (cpu_gemv.c,
 * cpu_attention.c), which build into one .so (kernels/cpu_linear.py hashes this header with
 * the sources, so a change here rebuilds the library).
 */
#ifndef PRESCIENT_CPU_BF16_H
#define PRESCIENT_CPU_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round-to-nearest-even, NaN kept quiet: torch's .to(bf16).  Branch-free so that loops over
 * it vectorise. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

#endif
