// Device twins of router/noise.c: the keyed uniforms (moe/rng.h, shared with
// the host), Switch jitter factors and Gumbel samples. The double arithmetic
// uses the _rn intrinsics, which nvcc never fuses into an FMA, so the jitter
// factors have the bits of router/noise.c (compiled with -ffp-contract=off for
// the same reason). The Gumbel transform calls CUDA's log, within 1 ulp of
// glibc's: a sample may differ from the CPU's in its last bit.
#ifndef MOE_KERNELS_CUDA_NOISE_CUH
#define MOE_KERNELS_CUDA_NOISE_CUH

#include "moe/rng.h"

#include <stdint.h>

__device__ static inline double moe_dev_noise_uniform(uint64_t seed, uint64_t step, uint64_t stream,
                                                      uint64_t i) {
    return moe_u01(moe_hash4(seed, step, stream, i));
}

// moe_noise_gumbel: U shifted by half an ulp of 2^-53 into (0, 1), -log(-log U).
__device__ static inline double moe_dev_noise_gumbel(uint64_t seed, uint64_t step, uint64_t i) {
    double u = __dadd_rn(moe_dev_noise_uniform(seed, step, 2, i), 0.5 / 9007199254740992.0);
    return -log(-log(u));
}

// The factor 1 - eps + 2 eps u of moe_router_jitter, evaluated as the C
// expression parses: (1 - eps) + ((2 eps) u).
__device__ static inline double moe_dev_jitter_factor(double eps, uint64_t seed, uint64_t step,
                                                      uint64_t i) {
    double u = moe_dev_noise_uniform(seed, step, 1, i);
    return __dadd_rn(__dsub_rn(1.0, eps), __dmul_rn(__dmul_rn(2.0, eps), u));
}

#endif
