// Softmax cross-entropy over the vocabulary, mean over non-ignored targets
// (target -1). Backward: dlogits += dloss * (softmax(logits) - onehot) / n.
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <math.h>

static double row_lse(const float *x, int V) {
    float m = x[0];
    for (int v = 1; v < V; v++)
        if (x[v] > m) m = x[v];
    double s = 0.0;
    for (int v = 0; v < V; v++)
        s += exp((double)x[v] - m);
    return m + log(s);
}

static int count_valid(const int32_t *target, int N, int V, int *n_valid) {
    *n_valid = 0;
    for (int n = 0; n < N; n++) {
        if (target[n] >= V || target[n] < -1)
            return moe_fail(MOE_EINVAL, "target %d at position %d is outside the vocabulary (%d)",
                            target[n], n, V);
        *n_valid += target[n] >= 0;
    }
    return 0;
}

int moe_cpu_crossentropy_forward(float *losses, double *mean, const float *logits,
                                 const int32_t *target, int N, int V) {
    int n_valid;
    MOE_TRY(count_valid(target, N, V, &n_valid));
    double sum = 0.0;
    for (int n = 0; n < N; n++) {
        losses[n] = 0.0f;
        if (target[n] < 0) continue;
        const float *x = logits + (size_t)n * V;
        double l = row_lse(x, V) - x[target[n]];
        losses[n] = (float)l;
        sum += l;
    }
    *mean = n_valid ? sum / n_valid : 0.0;
    return 0;
}

int moe_cpu_crossentropy_backward(float *dlogits, const float *logits, const int32_t *target, int N,
                                  int V, float dloss) {
    int n_valid;
    MOE_TRY(count_valid(target, N, V, &n_valid));
    if (!n_valid) return 0;
    double scale = (double)dloss / n_valid;
    for (int n = 0; n < N; n++) {
        if (target[n] < 0) continue;
        const float *x = logits + (size_t)n * V;
        float *d = dlogits + (size_t)n * V;
        double lse = row_lse(x, V);
        for (int v = 0; v < V; v++)
            d[v] += (float)(scale * exp((double)x[v] - lse));
        d[target[n]] -= (float)scale;
    }
    return 0;
}
