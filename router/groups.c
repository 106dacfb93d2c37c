// Group-limited routing (DeepSeek-V2 arXiv 2405.04434 §2.1.3 "device-limited
// routing", DeepSeek-V3 arXiv 2412.19437 §2.1.2 "node-limited routing"): the
// experts form n_groups groups of consecutive experts; a token keeps the
// topk_groups best groups and takes its top-k among their experts only. With
// one group per node of the expert-parallel group, a token's rows reach at
// most topk_groups nodes.
#include "moe/error.h"
#include "moe/router.h"
#include "router/internal.h"

#include <math.h>

bool moe_router_groups_active(const moe_router_config *cfg) {
    int ng = cfg->n_groups > 1 ? cfg->n_groups : 1;
    return cfg->topk_groups >= 1 && cfg->topk_groups < ng;
}

int moe_router_groups_check(const moe_router_config *cfg, int E) {
    const int ng = cfg->n_groups, tg = cfg->topk_groups;
    if (ng >= 1 && E % ng)
        return moe_fail(MOE_EINVAL,
                        "router.n_groups = %d does not divide the %d experts (moe.num_experts)", ng,
                        E);
    if (ng >= 1 && tg > ng)
        return moe_fail(MOE_EINVAL, "router.topk_groups = %d exceeds router.n_groups = %d", tg, ng);
    if (moe_router_groups_active(cfg) && (long)tg * (E / ng) < cfg->top_k)
        return moe_fail(MOE_EINVAL,
                        "router.topk_groups = %d groups of %d experts (router.n_groups = %d, %d "
                        "experts) hold fewer than router.top_k = %d experts",
                        tg, E / ng, ng, E, cfg->top_k);
    return 0;
}

// Group scores follow transformers: DeepseekV3TopkRouter sums the two highest
// biased scores of a group (topk(2).sum; one expert per group: that score);
// DeepseekV2's group_limited_greedy takes the highest score (max). The V3 rule
// applies when the bias holds a non-zero value: a bias of zeros routes as no
// bias, so a model whose bias is still zero (step 1 of training with
// router.bias_update_rate > 0) routes as eval and generate route its
// checkpoint, which attach no bias of zeros. The sums are taken in double.
// Experts outside the chosen groups are excluded, not set to score 0 as
// transformers' masked_fill does, so a negative biased score never loses to a
// masked one.
// With usable experts (inference under an expert budget) a group scores the
// same rule over its usable experts only: a left-out expert must not make its
// group win, and a group with one usable expert scores that expert, with none
// -inf (chosen only when fewer than topk_groups groups have any).
void moe_router_groups_allow_usable(unsigned char *allow, double *gscore, const float *p,
                                    const float *bias, const bool *usable, int E,
                                    const moe_router_config *cfg) {
    const int ng = cfg->n_groups, tg = cfg->topk_groups, s = E / ng;
    bool biased = false;
    for (int e = 0; bias && e < E; e++)
        biased |= bias[e] != 0.0f;
    for (int g = 0; g < ng; g++) {
        double b1 = -INFINITY, b2 = -INFINITY; // highest, second highest
        int n = 0;
        for (int e = g * s; e < (g + 1) * s; e++) {
            if (usable && !usable[e]) continue;
            double v = biased ? (double)p[e] + bias[e] : p[e];
            n++;
            if (v > b1)
                b2 = b1, b1 = v;
            else if (v > b2)
                b2 = v;
        }
        gscore[g] = biased && n > 1 ? b1 + b2 : b1;
    }
    for (int e = 0; e < E; e++)
        allow[e] = 0;
    // topk_groups passes of argmax; a chosen group is marked by its first
    // expert's allow bit. Only a strictly larger score replaces the best.
    for (int i = 0; i < tg; i++) {
        int best = -1;
        for (int g = 0; g < ng; g++)
            if (!allow[g * s] && (best < 0 || gscore[g] > gscore[best])) best = g;
        for (int e = best * s; e < (best + 1) * s; e++)
            allow[e] = 1;
    }
}

void moe_router_groups_allow(unsigned char *allow, double *gscore, const float *p,
                             const float *bias, int E, const moe_router_config *cfg) {
    moe_router_groups_allow_usable(allow, gscore, p, bias, NULL, E, cfg);
}
