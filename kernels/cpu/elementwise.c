// CPU memory and elementwise ops: aligned allocation (64 bytes, one cache
// line / one AVX-512 vector, what OpenBLAS packs best from), zero, products.
#include "kernels/cpu/cpu.h"
#include "moe/error.h"

#include <stdlib.h>
#include <string.h>

void *moe_cpu_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64) != 0) return NULL;
    return p;
}

void moe_cpu_free(void *p) {
    free(p);
}

int moe_cpu_zero(float *x, size_t n) {
    if (n && !x) return moe_fail(MOE_EINVAL, "zero: NULL buffer of %zu floats", n);
    if (n) memset(x, 0, n * sizeof *x);
    return 0;
}

MOE_CPU_VECTORIZE
int moe_cpu_mul(float *out, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = a[i] * b[i];
    return 0;
}

MOE_CPU_VECTORIZE
int moe_cpu_mul_add(float *restrict out, const float *restrict a, const float *restrict b,
                    size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++)
            out[i + l] += a[i + l] * b[i + l];
    for (; i < n; i++)
        out[i] += a[i] * b[i];
    return 0;
}
