// Token embedding lookup and its scatter-add backward on the GPU, the twin of
// kernels/cpu/embedding.c. Tokens are checked on the host first (one copy of
// N ints) so a bad id fails with the CPU's message instead of reading out of
// bounds. The backward is the deterministic scatter-add (scatter_add.cu):
// repeated tokens add in position order, as on the CPU.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/ops_cuda.h"

#include <stdlib.h>

__global__ static void embedding_fwd_kernel(float *out, const int32_t *tok, const float *table,
                                            int N, int C) {
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *src = table + (size_t)tok[n] * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            out[n * C + c] = src[c];
    }
}

// Copies tok [N] to the host and checks every id against [lo, V).
static int check_ids(const int32_t *tok, int N, int V, int lo, const char *what) {
    int32_t *h = (int32_t *)malloc(N * sizeof *h);
    if (!h) return moe_fail(MOE_ENOMEM, "%s check: %d ids", what, N);
    int rc = moe_cuda_download(h, tok, N * sizeof *h);
    for (int n = 0; rc == 0 && n < N; n++)
        if (h[n] < lo || h[n] >= V)
            rc = moe_fail(MOE_EINVAL, "%s %d at position %d is outside the vocabulary (%d)", what,
                          h[n], n, V);
    free(h);
    return rc;
}

extern "C" int moe_cuda_embedding_forward(float *out, const int32_t *tok, const float *table, int N,
                                          int C, int V) {
    if (N < 0 || C < 1) return moe_fail(MOE_EINVAL, "embedding: N=%d C=%d", N, C);
    if (!N) return 0;
    MOE_TRY(check_ids(tok, N, V, 0, "token"));
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    embedding_fwd_kernel<<<moe_cuda_row_blocks(N), 128, 0, c.stream>>>(out, tok, table, N, C);
    CUDA_LAUNCH_CHECK();
    return 0;
}

// Tokens were checked by the forward of the same batch.
extern "C" int moe_cuda_embedding_backward(float *dtable, const float *dout, const int32_t *tok,
                                           int N, int C) {
    if (N < 0 || C < 1) return moe_fail(MOE_EINVAL, "embedding: N=%d C=%d", N, C);
    if (!N) return 0;
    return moe_cuda_scatter_add_rows(dtable, dout, tok, N, C); // token order, no atomics
}

// Shared with crossentropy.cu: target ids may also be -1 (ignored).
extern "C" int moe_cuda_check_targets(const int32_t *target, int N, int V, int *n_valid,
                                      int32_t *host) {
    MOE_TRY(moe_cuda_download(host, target, N * sizeof *host));
    *n_valid = 0;
    for (int n = 0; n < N; n++) {
        if (host[n] < -1 || host[n] >= V)
            return moe_fail(MOE_EINVAL, "target %d at position %d is outside the vocabulary (%d)",
                            host[n], n, V);
        *n_valid += host[n] >= 0;
    }
    return 0;
}
