// Routing scores of one token and their backward: the softmax over the experts
// (Switch, GShard, Mixtral) or an independent sigmoid per expert (DeepSeek-V3,
// arXiv 2412.19437 eq. 13). Rows are float; sums and exponentials are double.
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

int moe_router_check_logits(const float *logits, int T, int E) {
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            if (!isfinite(logits[(size_t)t * E + e]))
                return moe_fail(MOE_ENUMERIC, "logit of token %d, expert %d is %g", t, e,
                                logits[(size_t)t * E + e]);
    return 0;
}
