// Counter-based random numbers: a splitmix64 finaliser over a key, so a value
// is a pure function of (seed, stream, index) and replays on resume and on any
// number of ranks or threads.
#ifndef MOE_RNG_H
#define MOE_RNG_H

#include <stdint.h>

static inline uint64_t moe_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Hash of up to four words.
static inline uint64_t moe_hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return moe_mix64(moe_mix64(moe_mix64(moe_mix64(a) ^ b) ^ c) ^ d);
}

// Uniform double in [0, 1) from a hash.
static inline double moe_u01(uint64_t h) {
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

#endif
