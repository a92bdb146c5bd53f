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

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* fp32 -> bf16 round-to-nearest-even for 4 lanes, NaNs kept quiet (matches f32_to_bf16);
 * integer ops only, so it needs no AVX512_BF16. Result in the low 64 bits.  For the SIMD
 * kernels' epilogues (cpu_gemv.c, cpu_qgemv.c), inlined into their wider target regions. */
static inline __attribute__((always_inline, target("sse4.1"))) __m128i bf16x4_rne(__m128 v)
{
    __m128i u = _mm_castps_si128(v);
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7fff), lsb));
    __m128i q = _mm_or_si128(u, _mm_set1_epi32(0x400000));
    r = _mm_castps_si128(_mm_blendv_ps(_mm_castsi128_ps(r), _mm_castsi128_ps(q), _mm_cmpunord_ps(v, v)));
    r = _mm_srli_epi32(r, 16);
    return _mm_packus_epi32(r, r);
}

/* The same for 16 lanes (AVX-512F; cpu_attention.c's bf16 output rows, cpu_qgemv_avx512.c's
 * 4 x 4 output tiles). */
static inline __attribute__((always_inline, target("avx512f"))) __m256i bf16x16_rne(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#endif

#endif
