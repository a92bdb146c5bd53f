/*
 * driver_common.h -- what the C test drivers (qgemv_cl_driver.c, qgemv_k_driver.c) share: a
 * deterministic generator (xorshift64*, the same numbers on every host and ISA) and the fp16
 * bits of a test scale.  Header-only; each driver includes it once.
 */
#ifndef PRESCIENT_DRIVER_COMMON_H
#define PRESCIENT_DRIVER_COMMON_H

#include <stdint.h>
#include <string.h>

/* The unused-function warning off: a driver may not call every helper. */
#define DRIVER_FN static __attribute__((unused))

static uint64_t g_rng = 0x2545f4914f6cdd1dull;

/* Uniform 32 bits. */
DRIVER_FN uint32_t rnd(void)
{
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 0x2545f4914f6cdd1dull) >> 32);
}

/* Uniform in [-1, 1). */
DRIVER_FN float frand(void) { return (float)((double)rnd() / 4294967296.0 * 2.0 - 1.0); }

/* float -> IEEE half bits, truncated, flushing what fp16 cannot hold as a normal to a signed zero
 * (for making test scales: any fp16 value will do). */
DRIVER_FN uint16_t to_half(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const int e = (int)((u >> 23) & 0xff) - 127 + 15;
    if (e <= 0)
        return (uint16_t)sign;
    return (uint16_t)(sign | (uint32_t)e << 10 | ((u >> 13) & 0x3ffu));
}

#endif
