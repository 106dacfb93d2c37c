// Seeded router noise: counter-based uniforms (splitmix64 finaliser over the
// key), Switch-Transformer jitter (arXiv 2101.03961 §2.2) and Gumbel samples
// for DeepSpeed-style top-2 second-choice sampling.
#include "router/internal.h"

#include <math.h>

static uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double moe_noise_uniform(uint64_t seed, uint64_t step, uint64_t stream, uint64_t i) {
    uint64_t h = mix64(mix64(mix64(mix64(seed) ^ step) ^ stream) ^ i);
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

double moe_noise_gumbel(uint64_t seed, uint64_t step, uint64_t i) {
    // U in (0, 1): shift by half an ulp of 2^-53 so neither log sees 0.
    double u = moe_noise_uniform(seed, step, 2, i) + 0.5 / 9007199254740992.0;
    return -log(-log(u));
}

void moe_router_jitter(float *x, size_t n, double eps, uint64_t seed, uint64_t step) {
    for (size_t i = 0; i < n; i++) {
        double u = moe_noise_uniform(seed, step, 1, i);
        x[i] = (float)(x[i] * (1.0 - eps + 2.0 * eps * u));
    }
}

int moe_ceil_tol(double x) {
    return (int)ceil(x - 1e-9 * fmax(1.0, fabs(x)));
}
