// bfloat16 (the top 16 bits of an IEEE float) conversions: widening is exact;
// narrowing rounds to nearest, ties to even, as the hardware formats do, and
// keeps a NaN a (quiet) NaN, where the plain rounding add could carry it into
// an infinity. Branch-free, so loops over them vectorise.
#ifndef MOE_BF16_H
#define MOE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float moe_bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Adding 0x7fff plus the lowest kept bit rounds the 16 dropped bits to
// nearest even (a carry may run into the exponent: the correct next binade,
// or infinity past the largest finite bf16).
static inline uint16_t moe_bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

#endif
