// Device buffers of pseudo-random values for the GPU benches: a host block of
// scale * uniform(-sqrt 3, sqrt 3) (unit variance for scale 1) from xorshift64*,
// tiled over the buffer. Speeds do not depend on the values; routing only
// needs the gate to vary.
#ifndef MOE_BENCH_GPU_FILL_H
#define MOE_BENCH_GPU_FILL_H

#include "kernels/cuda/cuda.h"
#include "moe/error.h"

#include <stddef.h>
#include <stdint.h>

static inline int bench_fill_device(float *d, size_t n, float scale, uint64_t seed) {
    enum { BLOCK = 1 << 20 };
    static float host[BLOCK];
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int i = 0; i < BLOCK; i++) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        double u = ((s * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
        host[i] = (float)(scale * (2.0 * u - 1.0) * 1.7320508);
    }
    for (size_t o = 0; o < n; o += BLOCK)
        MOE_TRY(moe_cuda_upload(d + o, host, (n - o < BLOCK ? n - o : BLOCK) * sizeof(float)));
    return 0;
}

#endif
