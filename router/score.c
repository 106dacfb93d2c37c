// Routing scores of one token and their backward: the softmax over the experts
// (Switch, GShard, Mixtral) or an independent sigmoid per expert (DeepSeek-V3,
// arXiv 2412.19437 eq. 13). Rows are float; sums and exponentials are double.
#include "kernels/cpu/cpu.h"
#include "moe/error.h"
#include "router/internal.h"

#include <math.h>

float moe_score_softmax_row(float *p, const float *x, int E) {
    float m = x[0];
    for (int e = 1; e < E; e++)
        if (x[e] > m) m = x[e];
    double s = 0.0;
    for (int e = 0; e < E; e++) {
        double v = exp((double)x[e] - m); // one exp per logit
        s += v;
        p[e] = (float)v;
    }
    double inv = 1.0 / s;
    for (int e = 0; e < E; e++)
        p[e] = (float)(p[e] * inv);
    return (float)(m + log(s));
}

// 1 / (1 + exp(-x)) for x >= 0 and exp(x) / (1 + exp(x)) below: exp never
// overflows, and small scores keep their relative precision.
void moe_score_sigmoid_row(float *s, const float *x, int E) {
    for (int e = 0; e < E; e++) {
        double v = x[e];
        if (v >= 0) {
            s[e] = (float)(1.0 / (1.0 + exp(-v)));
        } else {
            double z = exp(v);
            s[e] = (float)(z / (1.0 + z));
        }
    }
}

typedef struct {
    const float *logits;
    int T, E, parts;
    long *first; // [parts] first non-finite index of each range, -1: none
} check_job;

static void check_part(void *ctx, int i) {
    const check_job *j = ctx;
    const long n = (long)j->T * j->E, i0 = n * i / j->parts, i1 = n * (i + 1) / j->parts;
    j->first[i] = -1;
    for (long q = i0; q < i1; q++)
        if (!isfinite(j->logits[q])) {
            j->first[i] = q;
            return;
        }
}

// Over the pool in index ranges; the lowest range with a bad logit names the
// first one, as a serial scan would.
int moe_router_check_logits(const float *logits, int T, int E) {
    enum { PER_PART = 1 << 15 };
    const long n = (long)T * E;
    int parts = (int)((n + PER_PART - 1) / PER_PART), cap = 4 * moe_cpu_threads();
    if (parts > cap) parts = cap;
    if (parts < 1) return 0;
    long first[parts];
    check_job job = {logits, T, E, parts, first};
    moe_cpu_parallel_for(parts, check_part, &job);
    for (int i = 0; i < parts; i++)
        if (first[i] >= 0)
            return moe_fail(MOE_ENUMERIC, "logit of token %ld, expert %ld is %g", first[i] / E,
                            first[i] % E, logits[first[i]]);
    return 0;
}
