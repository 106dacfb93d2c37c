// CPU memory and elementwise ops: aligned allocation (64 bytes: one cache line,
// one AVX-512 vector; big buffers on transparent huge pages), zero, products.
#include "kernels/cpu/cpu.h"
#include "moe/alloc.h"
#include "moe/error.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define HUGE_PAGE ((size_t)2 << 20)
#define HUGE_MIN ((size_t)4 << 20)

size_t moe_cpu_alloc_size(size_t bytes) {
    if (bytes >= HUGE_MIN) return (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    return bytes ? (bytes + 63) / 64 * 64 : 64;
}

void *moe_cpu_alloc(size_t bytes) {
    void *p = NULL;
    if (bytes >= HUGE_MIN) {
        // Large activation/parameter buffers on 2 MiB pages where THP is "madvise":
        // GEMM packing streams them, and 4 KiB pages cost a TLB miss every 4 KiB.
        size_t n = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
        if (!(p = moe_aligned_alloc(HUGE_PAGE, n))) return NULL;
#ifdef MADV_HUGEPAGE
        madvise(p, n, MADV_HUGEPAGE); // advisory: failure just means small pages
#endif
        return p;
    }
    return moe_aligned_alloc(64, bytes ? (bytes + 63) / 64 * 64 : 64);
}

void moe_cpu_free(void *p) {
    moe_mfree(p);
}

// Big buffers (the MoE layer's expert-side gradients: 64 MiB at 128 experts
// top-8) are zeroed in slices over the pool.
typedef struct {
    float *x;
    size_t n;
    int parts;
} zero_job;

static void zero_part(void *ctx, int i) {
    const zero_job *j = ctx;
    size_t a = j->n * (size_t)i / (size_t)j->parts, b = j->n * (size_t)(i + 1) / (size_t)j->parts;
    memset(j->x + a, 0, (b - a) * sizeof *j->x);
}

int moe_cpu_zero(float *x, size_t n) {
    if (n && !x) return moe_fail(MOE_EINVAL, "zero: NULL buffer of %zu floats", n);
    if (n >= ((size_t)1 << 20)) {
        zero_job j = {x, n, moe_cpu_threads()};
        moe_cpu_parallel_for(j.parts, zero_part, &j);
    } else if (n) {
        memset(x, 0, n * sizeof *x);
    }
    return 0;
}

int moe_cpu_mul(float *out, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = a[i] * b[i];
    return 0;
}

int moe_cpu_mul_add(float *restrict out, const float *restrict a, const float *restrict b,
                    size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] += a[i] * b[i];
    return 0;
}

int moe_cpu_add(float *restrict out, const float *restrict x, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] += x[i];
    return 0;
}
