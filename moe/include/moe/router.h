// Gating: softmax or sigmoid scores, top-k with noise, capacity, slot order (position or
// Batch Prioritized Routing), combine weights, aux and z losses, load
// statistics and the dynamic-capacity controller. Plain arrays in, a plan out;
// the router knows nothing of models or ranks. Semantics: DESIGN.md "Router
// semantics" and the choices recorded in README.md "Router semantics".
#ifndef MOE_ROUTER_H
#define MOE_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus // included by the CUDA router (kernels/cuda/router.cu)
extern "C" {
#endif

#define MOE_MAX_TASKS 64

typedef enum { MOE_SLOT_POSITION = 0, MOE_SLOT_PRIORITY } moe_slot_order;
typedef enum { MOE_NOISE_NONE = 0, MOE_NOISE_JITTER, MOE_NOISE_GUMBEL } moe_noise;
typedef enum { MOE_CAPACITY_STATIC = 0, MOE_CAPACITY_DYNAMIC } moe_capacity_mode;
// router.score: softmax over the experts, or an independent sigmoid per expert
// (DeepSeek-V3); README "Router semantics" gives the weights and losses of each.
typedef enum { MOE_SCORE_SOFTMAX = 0, MOE_SCORE_SIGMOID } moe_score;
// router.type: each token picks its top-k experts, or each expert picks its
// top-C tokens (Zhou et al. 2022, router/expert_choice.c; README "Expert-choice routing").
typedef enum { MOE_ROUTER_TOKEN_CHOICE = 0, MOE_ROUTER_EXPERT_CHOICE } moe_router_type;
// router.ec_fallback: how inference routes an expert-choice model (it cannot see the batch).
typedef enum { MOE_EC_FALLBACK_NONE = 0, MOE_EC_FALLBACK_TOKEN_CHOICE } moe_ec_fallback;

typedef struct {
    int top_k;                 // router.top_k
    double capacity_factor;    // router.capacity_factor, <= 0: dropless
    int min_capacity;          // router.min_capacity
    moe_slot_order slot_order; // router.slot_order
    bool normalize_topk;       // router.normalize_topk
    moe_noise noise;           // router.noise (applied only when training)
    double noise_eps;          // router.noise_eps (jitter half-width)
    double aux_loss_coef;      // router.aux_loss_coef
    double z_loss_coef;        // router.z_loss_coef
    bool aux_counts_all_k;     // router.aux_counts_all_k
    int n_task_priority;       // length of router.task_priority (0: none)
    double task_priority[MOE_MAX_TASKS];
    uint64_t seed;      // router.seed
    moe_score score;    // router.score
    double route_scale; // router.route_scale: multiplies every combine weight

    moe_capacity_mode capacity_mode; // capacity.mode
    double ema;                      // capacity.ema
    double headroom;                 // capacity.headroom
    int update_every;                // capacity.update_every
    double capacity_factor_max;      // capacity.capacity_factor_max

    // Group-limited routing (DeepSeek-V2/V3, router/groups.c): experts split
    // into n_groups groups of consecutive experts; a token picks topk_groups
    // groups, then its top-k inside them. n_groups 0: one group per node of
    // the expert-parallel group, resolved by the trainer (1 elsewhere);
    // topk_groups 0: every group (no limit).
    int n_groups;    // router.n_groups
    int topk_groups; // router.topk_groups
    // router.bias_update_rate: auxiliary-loss-free balancing (router/bias.c);
    // 0: the selection bias never moves
    double bias_update_rate;
    moe_router_type type;        // router.type
    moe_ec_fallback ec_fallback; // router.ec_fallback (inference of an expert-choice model)
} moe_router_config;

// Fills every key with its documented default.
void moe_router_config_default(moe_router_config *cfg);
// Sets one key from text, e.g. ("router.top_k", "2") or ("capacity.mode",
// "dynamic"); the "router."/"capacity." prefix is required. task_priority takes
// a comma list "3,1,2". Unknown key or bad value: MOE_EINVAL with a message.
int moe_router_config_set(moe_router_config *cfg, const char *key, const char *value);
// Checks the config against E experts (top_k in 1..E, eps ranges, ...) and
// keys that contradict each other (task priorities under position order).
int moe_router_config_check(const moe_router_config *cfg, int E);

// Group-limited routing in force: the groups (n_groups, 0 read as 1) and the
// groups a token may use (topk_groups, 0 read as all) leave some out.
bool moe_router_groups_active(const moe_router_config *cfg);
// Sets allow[e] = 1 for the experts of the token's topk_groups best groups, 0
// elsewhere (README "Group-limited routing"). A group scores the sum of its
// two highest scores p + bias (in double) when bias holds a non-zero value
// (DeepSeek-V3), else its highest score p (DeepSeek-V2; NULL or a bias of
// zeros); ties go to the lower group. gscore holds
// n_groups doubles of scratch. Needs moe_router_groups_active(cfg).
void moe_router_groups_allow(unsigned char *allow, double *gscore, const float *p,
                             const float *bias, int E, const moe_router_config *cfg);
// The same over the experts with usable[e] (NULL: all): the others count in
// no group's score (a group scores its usable experts only, a single one by
// its own score, a group with none below every other), so they never make a
// group win (inference under an expert budget, moe_plan.usable).
void moe_router_groups_allow_usable(unsigned char *allow, double *gscore, const float *p,
                                    const float *bias, const bool *usable, int E,
                                    const moe_router_config *cfg);

// The most experts a layer has (moe.num_experts); readers of router inputs
// (moe route --logits) refuse wider ones.
enum { MOE_MAX_EXPERTS = 1 << 16 };

// The dispatch plan of one routing call. Arrays are sized once for
// (T_max, E, k) by moe_plan_alloc and reused every step. Under expert choice
// k is E (moe_router_plan_k): token t's experts fill expert[t, 0..n_t) in
// descending score (ties to the lower expert), the rest is -1 / -1 / 0.
typedef struct {
    int T, E, k; // this call's sizes (T <= T_max)
    int T_max;
    int *expert;    // [T, k] expert of choice j, -1 if dropped
    int *choice;    // [T, k] expert of choice j before dropping (kept for stats)
    int *slot;      // [T, k] row within the expert's segment, -1 if dropped
    float *weight;  // [T, k] combine weight, 0 if dropped
    float *probs;   // [T, E] routing scores: softmax or sigmoid of the logits (router.score)
    float *softmax; // [T, E] softmax of the logits under sigmoid scores (z-loss backward)
    float *lse;     // [T] logsumexp of the logits (z-loss)
    int *counts;    // [E] assignments before dropping (all k choices)
    int *kept;      // [E] assignments kept
    int *capacity;  // [E] capacity used for this call
    int *offsets;   // [E + 1] start row of each expert in the permuted buffer
    float *aux_f;   // [E] f_e of the aux loss (treated as constant in backward)
    float aux_loss; // E * sum_e f_e * P_e (P_e: mean score, sigmoid scores summed to 1 first)
    float z_loss;   // mean_t lse_t^2
    int *order;     // [T] token order used for slot assignment
    void *scratch;  // [T] sort keys for the priority order
    void *block;    // one allocation backing every array above
    // [E] selection bias (auxiliary-loss-free balancing, router/bias.c), added
    // to the scores for the top-k choice only; owned and set by the caller
    // after moe_plan_alloc. NULL (the default): no bias; a bias of zeros
    // routes bit for bit as NULL.
    const float *bias;
    // [E] experts the token-choice router may choose (NULL, the default: all;
    // training never sets it); owned and set by the caller after
    // moe_plan_alloc. An expert left out is never chosen and counts in no
    // group's score. The caller guarantees top_k usable experts in every
    // token's reach (any topk_groups groups under group-limited routing).
    const bool *usable;

    bool expert_choice; // routed by expert choice (counts = kept = capacity = C for every expert)
    int unrouted;       // expert choice: tokens that no expert took (they skip the experts)
    void *rows;         // [rows_parts] router scratch of rows_bytes each, one per parallel part
    size_t rows_bytes;
    int rows_parts;
} moe_plan;

int moe_plan_alloc(moe_plan *plan, int T_max, int E, int k);
// Bytes moe_plan_alloc takes for these sizes.
size_t moe_plan_bytes(int T_max, int E, int k);
void moe_plan_free(moe_plan *plan);

// Static capacity C = max(min_capacity, ceil(k*T/E * capacity_factor)).
// Dropless configs (capacity_factor <= 0) return -1: capacity is the max count.
int moe_capacity_static(const moe_router_config *cfg, int T, int E);

// Entries per token in a plan: top_k under token choice, E under expert choice.
int moe_router_plan_k(const moe_router_config *cfg, int E);
// Expert-choice capacity, the tokens every expert takes from a call of T tokens:
// C = ceil(capacity_factor * k * T / E) (representation error ignored as in the
// static formula), clamped to 1..T (0 when T = 0). router.min_capacity is not used.
int moe_expert_choice_capacity(const moe_router_config *cfg, int T, int E);
// Most kept rows one call of T tokens can produce: T * top_k, or E * C under expert choice.
long moe_router_rows_max(const moe_router_config *cfg, int T, int E);

// Routes T tokens. logits [T, E] row-major. task_id [T] or NULL (needed only
// for priority with task_priority). capacity [E] or NULL: per-expert C_e from
// the dynamic controller; NULL uses the static/dropless formula. training
// enables noise; step seeds it (with cfg->seed) so any run can replay it.
// Fails with MOE_ENUMERIC on a non-finite logit, MOE_EINVAL on bad sizes.
int moe_router_forward(moe_plan *plan, const float *logits, const int *task_id, const int *capacity,
                       int T, int E, const moe_router_config *cfg, bool training, uint64_t step);

// Gradient of the routing outputs w.r.t. the logits, ADDED into dlogits [T, E]:
// from the combine weights (dweight [T, k], may be NULL), from the aux loss
// scaled by aux_scale (dL/d aux, e.g. aux_loss_coef) and from the z-loss
// scaled by z_scale. Top-k selection and f_e are treated as constants.
void moe_router_backward(float *dlogits, const float *dweight, const moe_plan *plan,
                         const moe_router_config *cfg, float aux_scale, float z_scale);

// Multiplies x[i] by U(1-eps, 1+eps) (Switch jitter on the router input),
// drawn from a counter-based generator keyed by (seed, step, i).
void moe_router_jitter(float *x, size_t n, double eps, uint64_t seed, uint64_t step);

// Per-call load statistics of a plan.
// Under expert choice assigned = kept = capacity = E * C, dropped counts the
// tokens that no expert took and drop_rate = dropped / T.
typedef struct {
    long assigned;    // sum of counts
    long kept;        // sum of kept
    long dropped;     // assigned - kept
    long capacity;    // sum of capacities
    double drop_rate; // dropped / assigned
    double padding;   // (capacity - kept) / capacity: slots allocated but empty
    int max_count, min_count;
} moe_load_stats;

void moe_plan_stats(const moe_plan *plan, moe_load_stats *st);

// Dynamic capacity (README "Dynamic capacity"): EMA of per-expert load, and
// C_e = clamp(ceil(m_e * (1 + headroom)), min_capacity, ceil(k*T/E * cf_max)).
typedef struct {
    int E;
    long steps;    // updates seen
    bool seeded;   // m_e initialised from the first measurement
    double *ema;   // [E] m_e
    int *capacity; // [E] C_e in force
} moe_capacity_ctl;

int moe_capacity_ctl_init(moe_capacity_ctl *ctl, const moe_router_config *cfg, int T, int E);
void moe_capacity_ctl_free(moe_capacity_ctl *ctl);
// counts [E]: pre-drop load of one routing call of T tokens. Updates C_e
// every update_every updates.
void moe_capacity_ctl_update(moe_capacity_ctl *ctl, const moe_router_config *cfg, const int *counts,
                             int T);
// The same with a mean load per routing call of T tokens: the trainer passes
// a whole step's load, summed over micro-batches and ranks and divided by the
// number of routing calls, so every rank computes the same C_e.
void moe_capacity_ctl_update_mean(moe_capacity_ctl *ctl, const moe_router_config *cfg,
                                  const double *load, int T);

// Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 sec 2.1.2;
// Wang et al. 2024, arXiv 2408.15664). load [E]: tokens routed to each expert
// (pre-drop choices) over a whole global batch. After an optimizer step,
// bias_e += rate * sign(mean load - load_e): overloaded experts down, underloaded
// up, an expert at the mean unchanged. Identical loads give identical bits on
// every rank.
void moe_router_bias_update(float *bias, const double *load, int E, double rate);
// MaxVio of a load [E] (Wang et al. 2024): max_e load_e / mean load - 1; 0 when
// no token was routed. 0 is perfect balance, E - 1 all load on one expert.
double moe_router_max_vio(const double *load, int E);

#ifdef __cplusplus
}
#endif

#endif
