// Seeded router noise: counter-based uniforms (splitmix64 finaliser over the
// key), Switch-Transformer jitter (arXiv 2101.03961 §2.2) and Gumbel samples
// for DeepSpeed-style top-2 second-choice sampling.
#include "moe/rng.h"
#include "router/internal.h"

#include <limits.h>
#include <math.h>

double moe_noise_uniform(uint64_t seed, uint64_t step, uint64_t stream, uint64_t i) {
    return moe_u01(moe_hash4(seed, step, stream, i));
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
    double c = ceil(x - 1e-9 * fmax(1.0, fabs(x)));
    return c >= INT_MAX ? INT_MAX : c <= INT_MIN ? INT_MIN : (int)c; // factor 1e9 must not wrap
}
