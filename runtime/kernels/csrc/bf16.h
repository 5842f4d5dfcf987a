/* bfloat16 <-> float32 for the C core's files (cpu_native.c, quant.c, lora.c), written once: widening is exact;
 * narrowing rounds to nearest even, as torch's float32 -> bfloat16 conversion does (a NaN stays a quiet NaN), so
 * that every kernel that stores bfloat16 stores what torch would. */
#ifndef TANDEM_BF16_H
#define TANDEM_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline void bf16_store(uint16_t *p, float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        *p = (uint16_t)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *p = (uint16_t)(bits >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* bf16_store of the lanes of v in mask into p[0..16), the same integer rounding lane by lane (not vcvtneps2bf16,
 * which flushes denormals to zero). */
static inline void bf16_store16(uint16_t *p, __m512 v, __mmask16 mask) {
    const __m512i bits = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __m512i out = _mm512_mask_mov_epi32(_mm512_srli_epi32(rounded, 16), nan, quiet);
    _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(out));
}
#endif

#endif
