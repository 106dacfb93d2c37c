// Expert-choice routing, Zhou et al. 2022 (arXiv 2202.09368) §3.1: S = softmax(logits) [T, E];
// every expert takes its top-C tokens by S[:, e], C = capacity_factor * T * k / E, so the load
// is balanced by construction and a token gets 0..E experts. The combine weight of a pair is
// its softmax score (no renormalisation, as in the paper), times router.route_scale.
#include "moe/error.h"
#include "moe/router.h"
#include "router/internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int moe_expert_choice_capacity(const moe_router_config *cfg, int T, int E) {
    if (T <= 0 || E < 1) return 0;
    int c = moe_ceil_tol(cfg->capacity_factor * cfg->top_k * (double)T / E);
    return c < 1 ? 1 : c > T ? T : c;
}

// A token's score for one expert; sorted by score descending, then token
// ascending, so the order is total and qsort's instability cannot show.
typedef struct {
    float s;
    int t;
} ec_key;

static int ec_cmp(const void *a, const void *b) {
    const ec_key *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return (x->t > y->t) - (x->t < y->t);
}

// Fills the plan with k = E entries per token. Slots inside an expert follow
// token order (like the position order of token choice), so the permuted rows
// of an expert are its tokens in ascending index.
int moe_expert_choice_forward(moe_plan *plan, const float *logits, int T, int E,
                              const moe_router_config *cfg) {
    _Static_assert(sizeof(ec_key) <= 16, "ec_key must fit the slot-order scratch");
    const int C = moe_expert_choice_capacity(cfg, T, E);
    float *S = plan->probs;
    double z = 0.0;
    for (int t = 0; t < T; t++) {
        const float *x = logits + (size_t)t * E;
        plan->lse[t] = moe_score_softmax_row(S + (size_t)t * E, x, E);
        z += (double)plan->lse[t] * plan->lse[t];
    }

    // 1. each expert's top-C tokens: mark slot[t, e] (indexed by expert for now) with 0.
    int *sel = plan->slot; // [T, E]
    for (size_t i = 0; i < (size_t)T * E; i++)
        sel[i] = -1;
    ec_key *keys = plan->scratch;
    for (int e = 0; e < E; e++) {
        for (int t = 0; t < T; t++)
            keys[t] = (ec_key){S[(size_t)t * E + e], t};
        qsort(keys, (size_t)T, sizeof *keys, ec_cmp);
        for (int i = 0; i < C; i++)
            sel[(size_t)keys[i].t * E + e] = 0;
    }
    // 2. per token, its experts in descending score (ties: the lower expert),
    // then -1; slots counted in token order. sel row t is read before expert
    // row t is written and slot row t is rewritten only after.
    for (int e = 0; e < E; e++)
        plan->kept[e] = 0, plan->counts[e] = C, plan->capacity[e] = C;
    plan->unrouted = 0;
    for (int t = 0; t < T; t++) {
        const float *p = S + (size_t)t * E;
        int *ex = plan->expert + (size_t)t * E, *sl = sel + (size_t)t * E, n = 0;
        for (int e = 0; e < E; e++) {
            if (sl[e] < 0) continue;
            int i = n++; // insertion: equal scores keep the lower expert first
            while (i > 0 && p[ex[i - 1]] < p[e]) {
                ex[i] = ex[i - 1];
                i--;
            }
            ex[i] = e;
        }
        plan->unrouted += n == 0;
        float *w = plan->weight + (size_t)t * E;
        for (int j = 0; j < E; j++) {
            const int e = j < n ? ex[j] : -1;
            ex[j] = e;
            plan->choice[(size_t)t * E + j] = e;
            sl[j] = e < 0 ? -1 : plan->kept[e]++;
            w[j] = e < 0 ? 0.0f : (float)(p[e] * cfg->route_scale);
        }
    }
    plan->offsets[0] = 0;
    for (int e = 0; e < E; e++)
        plan->offsets[e + 1] = plan->offsets[e] + plan->kept[e];
    for (int t = 0; t < T; t++)
        plan->order[t] = t;
    // Balanced by construction: no aux loss (router.aux_loss_coef is ignored).
    memset(plan->aux_f, 0, E * sizeof *plan->aux_f);
    plan->aux_loss = 0.0f;
    plan->z_loss = T ? (float)(z / T) : 0.0f;
    plan->expert_choice = true;
    return 0;
}

// w = c * p_e for each chosen pair (c = route_scale): dp_e = c * dw for the
// token's chosen experts, 0 elsewhere; then the softmax backward
// dlogit_e = p_e (dp_e - sum_e' p_e' dp_e') plus the z-loss term 2 z_scale lse p_e / T.
// Which tokens an expert took is treated as a constant, as top-k is for token choice.
void moe_expert_choice_backward(float *dlogits, const float *dweight, const moe_plan *plan,
                                const moe_router_config *cfg, float z_scale) {
    const int T = plan->T, E = plan->E;
    for (int t = 0; t < T; t++) {
        const float *p = plan->probs + (size_t)t * E;
        const int *ex = plan->expert + (size_t)t * E;
        const float *dw = dweight ? dweight + (size_t)t * E : NULL;
        float *dl = dlogits + (size_t)t * E;
        double dot = 0.0; // sum_e p_e dp_e over the chosen experts
        for (int j = 0; j < E && dw && ex[j] >= 0; j++)
            dot += p[ex[j]] * cfg->route_scale * dw[j];
        const double zc = 2.0 * z_scale * plan->lse[t] / T;
        for (int e = 0; e < E; e++)
            dl[e] += (float)(p[e] * (zc - dot));
        for (int j = 0; j < E && dw && ex[j] >= 0; j++)
            dl[ex[j]] += (float)(p[ex[j]] * cfg->route_scale * dw[j]);
    }
}
