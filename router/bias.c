// Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 sec 2.1.2;
// Wang et al. 2024, arXiv 2408.15664 eq. 3-4): the per-expert selection bias
// moves by a fixed rate against the sign of each expert's load error, and
// MaxVio, the paper's balance figure. The bias enters routing in router/router.c.
#include "moe/router.h"

void moe_router_bias_update(float *bias, const double *load, int E, double rate) {
    double sum = 0.0;
    for (int e = 0; e < E; e++)
        sum += load[e];
    // sign(mean - load_e) = sign(sum - E * load_e): loads are token counts, so
    // both sides are exact integers and an expert at the mean gets exactly 0
    const float r = (float)rate;
    for (int e = 0; e < E; e++) {
        double d = sum - (double)E * load[e];
        bias[e] += d > 0 ? r : d < 0 ? -r : 0.0f;
    }
}

double moe_router_max_vio(const double *load, int E) {
    double sum = 0.0, max = 0.0;
    for (int e = 0; e < E; e++) {
        sum += load[e];
        if (load[e] > max) max = load[e];
    }
    return sum > 0 ? max * E / sum - 1.0 : 0.0;
}
