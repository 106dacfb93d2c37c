// Token-choice top-k routing: softmax or sigmoid scores (router/score.c),
// top-k choices (ties to the lower expert), capacity with position or priority
// slot order, combine weights (DeepSeek-V3 weights for sigmoid scores, arXiv
// 2412.19437 eq. 12-13, and router.route_scale), Switch/GShard aux loss (arXiv
// 2101.03961 eq. 4) and ST-MoE z-loss (arXiv 2202.08906 eq. 5), and the
// backward pass of all three to the logits.
#include "moe/router.h"
#include "kernels/cpu/cpu.h"
#include "moe/error.h"
#include "router/internal.h"

#include <math.h>
#include <string.h>

// One candidate of a token's top-k: its score and expert.
typedef struct {
    double s;
    int e;
} cand;

// a ranks below b in (score desc, index asc): the tie goes to the lower expert.
static inline bool ranks_below(cand a, cand b) {
    return a.s < b.s || (a.s == b.s && a.e > b.e);
}

static void heap_down(cand *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, m = i;
        if (l < n && ranks_below(h[l], h[m])) m = l;
        if (l + 1 < n && ranks_below(h[l + 1], h[m])) m = l + 1;
        if (m == i) return;
        cand t = h[i];
        h[i] = h[m], h[m] = t, i = m;
    }
}

// Offers expert e (experts arrive in index order) to the heap h of the best
// *n <= k so far, worst at the root. A full heap takes e only with a strictly
// larger score than the root's: e's index is above every kept one, so a tie
// leaves it out.
static inline void heap_offer(cand *h, int *n, int k, double s, int e) {
    if (*n < k) {
        int i = (*n)++;
        h[i] = (cand){s, e};
        while (i > 0 && ranks_below(h[i], h[(i - 1) / 2])) {
            cand t = h[i];
            h[i] = h[(i - 1) / 2], h[(i - 1) / 2] = t, i = (i - 1) / 2;
        }
    } else if (s > h[0].s) {
        h[0] = (cand){s, e};
        heap_down(h, k, 0);
    }
}

// Empties the heap into ch[0..n) best first (the root is the worst left).
static void heap_drain(int *ch, cand *h, int n) {
    while (n > 0) {
        ch[n - 1] = h[0].e;
        h[0] = h[--n];
        heap_down(h, n, 0);
    }
}

// Picks the k choices of one token into ch[0..k). Choice 0 is argmax p;
// later choices maximise p, or logits + Gumbel noise when gumbel != 0
// (DeepSpeed top-2 samples the second expert this way). Ties go to the lower
// expert index.
// bias [E] (NULL: none) is added to the scores for the choice only, never to
// the weights: the slot of DeepSeek-V3's auxiliary-loss-free balancing bias.
// The sum is a double of the two floats, so tiny scores that would round to a
// tie in float still order (README "Router semantics"); + 0 changes no score,
// so a bias of zeros chooses as none.
// Group-limited routing (router/groups.c) first masks the experts outside the
// token's groups, from the same biased scores; Gumbel-sampled choices stay
// inside the groups too.
//
// The k passes of argmax are the top k in (score desc, index asc) order: a
// heap of k candidates keyed by that order, then drained best first. Most
// experts lose to the root at the first compare, so a token costs about E
// compares (E log k at worst) and k log k to drain, not E k. Under Gumbel
// noise, choices 1..k-1 are the top k-1 noisy scores of the experts other
// than choice 0: each expert's noise is drawn once. rows is the part's scratch
// (moe_router_rows_bytes): k candidates, n_groups doubles, E allow bytes.
static void topk_row(int *ch, const float *p, const float *bias, const bool *usable, const float *x,
                     int E, int k, int gumbel, const moe_router_config *cfg, uint64_t step,
                     size_t row, void *rows) {
    const bool grouped = moe_router_groups_active(cfg);
    cand *h = rows;
    double *gscore = (double *)(h + k);
    unsigned char *allow = (unsigned char *)(gscore + E);
    if (grouped) moe_router_groups_allow_usable(allow, gscore, p, bias, usable, E, cfg);
    int n = 0;
    if (!gumbel || k == 1) {
        for (int e = 0; e < E; e++) {
            if ((grouped && !allow[e]) || (usable && !usable[e])) continue;
            heap_offer(h, &n, k, bias ? (double)p[e] + bias[e] : p[e], e);
        }
        heap_drain(ch, h, n);
        return;
    }
    int best = -1;
    double best_s = 0.0;
    for (int e = 0; e < E; e++) {
        if ((grouped && !allow[e]) || (usable && !usable[e])) continue;
        double s = bias ? (double)p[e] + bias[e] : p[e];
        if (best < 0 || s > best_s) best = e, best_s = s;
    }
    ch[0] = best;
    for (int e = 0; e < E; e++) {
        if ((grouped && !allow[e]) || (usable && !usable[e]) || e == best) continue;
        heap_offer(h, &n, k - 1, x[e] + moe_noise_gumbel(cfg->seed, step, row * E + e), e);
    }
    heap_drain(ch + 1, h, n);
}

size_t moe_router_rows_bytes(int E, int k) {
    return ((sizeof(cand) * (size_t)k + 9 * (size_t)E + 15) / 16) * 16;
}

int moe_router_plan_k(const moe_router_config *cfg, int E) {
    return cfg->type == MOE_ROUTER_EXPERT_CHOICE ? E : cfg->top_k;
}

long moe_router_rows_max(const moe_router_config *cfg, int T, int E) {
    if (cfg->type == MOE_ROUTER_EXPERT_CHOICE)
        return (long)E * moe_expert_choice_capacity(cfg, T, E);
    return (long)T * cfg->top_k;
}

// The per-token work runs over the CPU thread pool in token ranges. A token's
// results depend on that token alone, so the split cannot change a bit; the
// sums across tokens (z-loss, counts, aux loss) stay serial in token order
// after the parallel part, as cheap O(T k) or O(T E) passes.
typedef struct {
    moe_plan *plan;
    const float *logits;
    const moe_router_config *cfg;
    uint64_t step;
    int T, E, k, parts, gumbel;
    bool sigmoid;
    double *fs; // [T] sigmoid aux term of each token (plan->scratch)
} fwd_job;

enum { TOKENS_PER_PART = 64 };

int moe_router_token_parts(int T) {
    int parts = (T + TOKENS_PER_PART - 1) / TOKENS_PER_PART, cap = 4 * moe_cpu_threads();
    return parts < cap ? parts : cap;
}

// The parts of a call over the plan: at most the parts its row scratch holds
// (the thread count may have grown since moe_plan_alloc; the split changes no
// result).
static int plan_parts(const moe_plan *plan, int T) {
    int parts = moe_router_token_parts(T);
    return parts < plan->rows_parts ? parts : plan->rows_parts;
}

static void *part_rows(const moe_plan *plan, int i) {
    return (char *)plan->rows + (size_t)i * plan->rows_bytes;
}

static void part_range(int T, int parts, int i, int *t0, int *t1) {
    *t0 = (int)((long)T * i / parts), *t1 = (int)((long)T * (i + 1) / parts);
}

// 1. scores, lse and choices. Sigmoid scores keep the softmax beside them:
// the z-loss stays on the logits.
static void scores_part(void *ctx, int i) {
    const fwd_job *j = ctx;
    moe_plan *plan = j->plan;
    const int E = j->E, k = j->k;
    int t0, t1;
    part_range(j->T, j->parts, i, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        const float *x = j->logits + (size_t)t * E;
        float *p = plan->probs + (size_t)t * E;
        if (j->sigmoid) {
            plan->lse[t] = moe_score_softmax_row(plan->softmax + (size_t)t * E, x, E);
            moe_score_sigmoid_row(p, x, E);
        } else {
            plan->lse[t] = moe_score_softmax_row(p, x, E);
        }
        topk_row(plan->choice + (size_t)t * k, p, plan->bias, plan->usable, x, E, k, j->gumbel,
                 j->cfg, j->step, t, part_rows(plan, i));
    }
}

// 4. combine weights, renormalised over the kept choices (after dropping),
// times route_scale. Sigmoid follows DeepSeek-V3: divide by the sum + 1e-20.
// Sigmoid scores also leave each token's aux term sum_e f_e s_te / S_t in fs.
static void weights_part(void *ctx, int i) {
    const fwd_job *j = ctx;
    const moe_plan *plan = j->plan;
    const moe_router_config *cfg = j->cfg;
    const int E = j->E, k = j->k;
    int t0, t1;
    part_range(j->T, j->parts, i, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        const float *p = plan->probs + (size_t)t * E;
        const int *ex = plan->expert + (size_t)t * k;
        float *w = plan->weight + (size_t)t * k;
        double s = 0.0;
        for (int q = 0; q < k; q++)
            s += ex[q] >= 0 ? p[ex[q]] : 0.0;
        for (int q = 0; q < k; q++) {
            double v = ex[q] < 0 ? 0.0 : p[ex[q]];
            if (cfg->normalize_topk) v = j->sigmoid ? v / (s + 1e-20) : s > 0 ? v / s : 0.0;
            w[q] = (float)(v * cfg->route_scale); // route_scale 1: the bits of v
        }
        if (j->sigmoid) {
            double S = 0.0, fs = 0.0;
            for (int e = 0; e < E; e++)
                S += p[e], fs += (double)plan->aux_f[e] * p[e];
            j->fs[t] = S > 0 ? fs / S : 0.0;
        }
    }
}

int moe_router_forward(moe_plan *plan, const float *logits, const int *task_id, const int *capacity,
                       int T, int E, const moe_router_config *cfg, bool training, uint64_t step) {
    int k = moe_router_plan_k(cfg, E);
    if (T < 0 || T > plan->T_max || E != plan->E || k != plan->k)
        return moe_fail(
            MOE_EINVAL,
            "router: call sizes T=%d E=%d k=%d do not fit the plan (T_max=%d E=%d k=%d)", T, E, k,
            plan->T_max, plan->E, plan->k);
    MOE_TRY(moe_router_config_check(cfg, E));
    MOE_TRY(moe_router_check_logits(logits, T, E));
    plan->T = T;
    plan->expert_choice = cfg->type == MOE_ROUTER_EXPERT_CHOICE;
    plan->unrouted = 0;
    if (plan->expert_choice) {
        if (capacity)
            return moe_fail(MOE_EINVAL, "router.type = expert_choice takes no per-expert "
                                        "capacity (capacity.mode must be static)");
        return moe_expert_choice_forward(plan, logits, T, E, cfg);
    }
    const bool sigmoid = cfg->score == MOE_SCORE_SIGMOID;
    fwd_job job = {.plan = plan,
                   .logits = logits,
                   .cfg = cfg,
                   .step = step,
                   .T = T,
                   .E = E,
                   .k = k,
                   .parts = plan_parts(plan, T),
                   .sigmoid = sigmoid,
                   .gumbel = training && cfg->noise == MOE_NOISE_GUMBEL};

    // 1. scores, lse, choices (in parallel), then pre-drop counts and z.
    moe_cpu_parallel_for(job.parts, scores_part, &job);
    memset(plan->counts, 0, E * sizeof *plan->counts);
    double z = 0.0;
    for (int t = 0; t < T; t++) {
        z += (double)plan->lse[t] * plan->lse[t];
        const int *ch = plan->choice + (size_t)t * k;
        for (int j = 0; j < k; j++)
            plan->counts[ch[j]]++;
    }

    // 2. capacity per expert
    int c_static = moe_capacity_static(cfg, T, E);
    int c_max = 0;
    for (int e = 0; e < E; e++)
        if (plan->counts[e] > c_max) c_max = plan->counts[e];
    for (int e = 0; e < E; e++)
        plan->capacity[e] = c_static < 0 ? c_max : capacity ? capacity[e] : c_static;

    // 3. slots: choice rank by choice rank, tokens in slot order. An expert's
    // kept slots are 0..kept_e-1, so permuted rows are dense. Serial: a slot
    // goes to the first token in slot order.
    MOE_TRY(moe_slot_order_fill(plan->order, plan->scratch, plan->probs, task_id, T, E, cfg));
    memset(plan->kept, 0, E * sizeof *plan->kept);
    for (int j = 0; j < k; j++) {
        for (int i = 0; i < T; i++) {
            size_t a = (size_t)plan->order[i] * k + j;
            int e = plan->choice[a];
            if (plan->kept[e] < plan->capacity[e]) {
                plan->expert[a] = e;
                plan->slot[a] = plan->kept[e]++;
            } else {
                plan->expert[a] = -1;
                plan->slot[a] = -1;
            }
        }
    }
    plan->offsets[0] = 0;
    for (int e = 0; e < E; e++)
        plan->offsets[e + 1] = plan->offsets[e] + plan->kept[e];

    // 5 (first half). aux loss E * sum_e f_e P_e with f_e = the fraction of
    // pre-drop choices. Sigmoid scores do not sum to 1: P_e = mean_t s_te /
    // sum_e' s_te' (the normalised scores of DeepSeek-V3's sequence-wise
    // balance loss, eq. 20), so the per-token term is taken in weights_part,
    // which needs f_e first.
    memset(plan->aux_f, 0, E * sizeof *plan->aux_f);
    int kf = cfg->aux_counts_all_k ? k : 1;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < kf; j++)
            plan->aux_f[plan->choice[(size_t)t * k + j]] += 1.0f;
    for (int e = 0; e < E && sigmoid; e++)
        plan->aux_f[e] = T ? plan->aux_f[e] / T : 0.0f;

    // 4. combine weights (in parallel); the priority-order scratch (16 bytes
    // a token) is free again and holds the sigmoid per-token aux terms.
    job.fs = plan->scratch;
    moe_cpu_parallel_for(job.parts, weights_part, &job);

    // 5. aux loss and z-loss: sums in token order. P_e sums its column over
    // the tokens in order, all columns in one row-major pass.
    double aux = 0.0;
    if (sigmoid) {
        for (int t = 0; t < T; t++)
            aux += job.fs[t];
        aux = T ? aux / T : 0.0;
    } else {
        double *P = part_rows(plan, 0); // [E], the parts are done
        for (int e = 0; e < E; e++)
            P[e] = 0.0;
        for (int t = 0; t < T; t++) {
            const float *p = plan->probs + (size_t)t * E;
            for (int e = 0; e < E; e++)
                P[e] += p[e];
        }
        for (int e = 0; e < E; e++) {
            plan->aux_f[e] = T ? plan->aux_f[e] / T : 0.0f;
            aux += plan->aux_f[e] * (T ? P[e] / T : 0.0);
        }
    }
    plan->aux_loss = (float)(E * aux);
    plan->z_loss = T ? (float)(z / T) : 0.0f;
    return 0;
}

// Per token, with p the scores, w the combine weights over kept choices,
// S = sum_kept p, c = route_scale (w_i = c p_i / S, or c p_i raw):
//   normalised:   dp_i = (c dw_i - sum_j dw_j w_j) / S    for kept i (S + 1e-20: sigmoid)
//   raw:          dp_i = c dw_i
// softmax scores:
//   aux:          dp_e += aux_scale * E * f_e / T          (P_e = mean_t p)
//   softmax:      dlogit_e = p_e (dp_e - sum_e' p_e' dp_e')
// sigmoid scores, with A = sum_e p_e (aux: P_e = mean_t p_e / A):
//   aux:          dp_e += aux_scale * E / T * (f_e - sum_e' f_e' p_e' / A) / A
//   sigmoid:      dlogit_e = p_e (1 - p_e) dp_e
// both:
//   z-loss:       dlogit_e += z_scale * 2 lse q_e / T      (q the softmax of the logits)
typedef struct {
    float *dlogits;
    const float *dweight;
    const moe_plan *plan;
    const moe_router_config *cfg;
    double aux_c;
    float z_scale;
    int parts;
} bwd_job;

// dlogit_e terms of one expert with score p and dp; the same function for the
// chosen and the other experts, so both evaluate one expression.
static inline float softmax_term(float p, double dp, double dot, double zc) {
    return (float)(p * (dp - dot) + zc * p);
}

static inline float sigmoid_term(float p, double dp, double zc, float q) {
    return (float)((double)p * (1.0 - p) * dp + zc * q);
}

// The tokens of one range; each token writes only its own dlogits row. A
// token's experts are distinct, so at most one choice adds to an expert's dp.
static void backward_part(void *ctx, int i) {
    const bwd_job *J = ctx;
    const moe_plan *plan = J->plan;
    const moe_router_config *cfg = J->cfg;
    const int T = plan->T, E = plan->E, k = plan->k;
    const bool sigmoid = cfg->score == MOE_SCORE_SIGMOID;
    const double aux_c = J->aux_c;
    int t0, t1;
    part_range(T, J->parts, i, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        const float *p = plan->probs + (size_t)t * E;
        const int *ex = plan->expert + (size_t)t * k;
        const float *w = plan->weight + (size_t)t * k;
        const float *dw = J->dweight ? J->dweight + (size_t)t * k : NULL;
        float *dl = J->dlogits + (size_t)t * E;

        // dp of each kept choice, in dpk[j]; the old dlogits of the kept
        // choices in dl0[j] (the part's row scratch holds 12 k bytes)
        double *dpk = part_rows(plan, i);
        float *dl0 = (float *)(dpk + k);
        double s = 0.0, dot_w = 0.0;
        for (int j = 0; j < k; j++) {
            dpk[j] = 0.0;
            if (ex[j] < 0) continue;
            s += p[ex[j]];
            if (dw) dot_w += (double)dw[j] * w[j];
        }
        if (sigmoid) s += 1e-20;
        for (int j = 0; j < k; j++) {
            if (ex[j] < 0 || !dw) continue;
            double g = cfg->route_scale * dw[j];
            if (cfg->normalize_topk)
                dpk[j] = s > 0 ? (g - dot_w) / s : 0.0;
            else
                dpk[j] = g;
        }
        // Every expert first takes the dp of an unchosen one, then the kept
        // choices redo their own entry from the saved input: O(E + k), not
        // O(E k), and no [E] scratch.
        for (int j = 0; j < k; j++)
            if (ex[j] >= 0) dl0[j] = dl[ex[j]];
        double zc = 2.0 * J->z_scale * plan->lse[t] / T;
        if (sigmoid) {
            const float *q = plan->softmax + (size_t)t * E;
            double A = 0.0, fs = 0.0;
            for (int e = 0; e < E; e++)
                A += p[e], fs += (double)plan->aux_f[e] * p[e];
            double fa = A > 0 ? fs / A : 0.0, ia = A > 0 ? aux_c / A : 0.0;
            for (int e = 0; e < E; e++)
                dl[e] += sigmoid_term(p[e], ia * (plan->aux_f[e] - fa), zc, q[e]);
            for (int j = 0; j < k; j++) {
                const int e = ex[j];
                if (e < 0) continue;
                double dp = ia * (plan->aux_f[e] - fa);
                dp += dpk[j];
                dl[e] = dl0[j] + sigmoid_term(p[e], dp, zc, q[e]);
            }
            continue;
        }
        double dot = 0.0; // sum_e p_e dp_e
        for (int e = 0; e < E; e++)
            dot += p[e] * aux_c * plan->aux_f[e];
        for (int j = 0; j < k; j++)
            if (ex[j] >= 0) dot += p[ex[j]] * dpk[j];
        for (int e = 0; e < E; e++)
            dl[e] += softmax_term(p[e], aux_c * plan->aux_f[e], dot, zc);
        for (int j = 0; j < k; j++) {
            const int e = ex[j];
            if (e < 0) continue;
            double dp = aux_c * plan->aux_f[e];
            dp += dpk[j];
            dl[e] = dl0[j] + softmax_term(p[e], dp, dot, zc);
        }
    }
}

void moe_router_backward(float *dlogits, const float *dweight, const moe_plan *plan,
                         const moe_router_config *cfg, float aux_scale, float z_scale) {
    int T = plan->T, E = plan->E;
    if (T == 0) return;
    if (plan->expert_choice) {
        moe_expert_choice_backward(dlogits, dweight, plan, cfg, z_scale);
        return;
    }
    bwd_job job = {
        dlogits, dweight, plan, cfg, (double)aux_scale * E / T, z_scale, plan_parts(plan, T)};
    moe_cpu_parallel_for(job.parts, backward_part, &job);
}
