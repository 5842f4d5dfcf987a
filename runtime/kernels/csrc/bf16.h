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

#endif
