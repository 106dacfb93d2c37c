// Counter-based random numbers: a splitmix64 finaliser over a key, so a value
// is a pure function of (seed, stream, index) and replays on resume and on any
// number of ranks or threads. The functions are pure, so the CUDA kernels
// (nvcc defines __CUDACC__) call the same code on the device: router noise on
// the GPU replays the CPU's bits (kernels/cuda/noise.cuh).
#ifndef MOE_RNG_H
#define MOE_RNG_H

#include <stdint.h>

#ifdef __CUDACC__
#define MOE_HD __host__ __device__
#else
#define MOE_HD
#endif

MOE_HD static inline uint64_t moe_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Hash of up to four words.
MOE_HD static inline uint64_t moe_hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return moe_mix64(moe_mix64(moe_mix64(moe_mix64(a) ^ b) ^ c) ^ d);
}

// Uniform double in [0, 1) from a hash.
MOE_HD static inline double moe_u01(uint64_t h) {
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

#endif
