// Token embedding lookup and its scatter-add backward.
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <string.h>

int moe_cpu_embedding_forward(float *out, const int32_t *tok, const float *table, int N, int C,
                              int V) {
    for (int n = 0; n < N; n++) {
        if (tok[n] < 0 || tok[n] >= V)
            return moe_fail(MOE_EINVAL, "token %d at position %d is outside the vocabulary (%d)",
                            tok[n], n, V);
        memcpy(out + (size_t)n * C, table + (size_t)tok[n] * C, sizeof(float) * C);
    }
    return 0;
}

int moe_cpu_embedding_backward(float *dtable, const float *dout, const int32_t *tok, int N, int C) {
    for (int n = 0; n < N; n++) {
        float *d = dtable + (size_t)tok[n] * C;
        const float *g = dout + (size_t)n * C;
        for (int c = 0; c < C; c++)
            d[c] += g[c];
    }
    return 0;
}
