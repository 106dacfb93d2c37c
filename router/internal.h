// Helpers shared by the router's files; not part of the public API.
#ifndef MOE_ROUTER_INTERNAL_H
#define MOE_ROUTER_INTERNAL_H

#include "moe/router.h"

#include <stddef.h>
#include <stdint.h>

// Counter-based uniform in [0, 1): a pure function of (seed, step, stream, i),
// so noise replays exactly across resume, ranks and thread counts.
double moe_noise_uniform(uint64_t seed, uint64_t step, uint64_t stream, uint64_t i);
// Standard Gumbel sample -log(-log(U)) from the same counter.
double moe_noise_gumbel(uint64_t seed, uint64_t step, uint64_t i);

// ceil(x) that ignores representation error below 1e-9 relative, so that
// k*T*1.1/E = 2*25*1.1/5 = 11.000000000000002 gives 11, not 12. Saturates
// at INT_MAX.
int moe_ceil_tol(double x);

// Fills order[T] with the slot-assignment order of the tokens (README
// "Router semantics": position = token order, priority = BPR). scratch holds
// T sort keys (moe_slot_order_scratch_bytes).
size_t moe_slot_order_scratch_bytes(int T);
int moe_slot_order_fill(int *order, void *scratch, const float *probs, const int *task_id, int T,
                        int E, const moe_router_config *cfg);

// Scores of one token's logits x[E] (router/score.c). The softmax row returns
// the logsumexp; the sigmoid row is computed without overflow for any finite x.
float moe_score_softmax_row(float *p, const float *x, int E);
void moe_score_sigmoid_row(float *s, const float *x, int E);

// MOE_ENUMERIC naming the first logit of [T, E] that is NaN or infinite.
int moe_router_check_logits(const float *logits, int T, int E);

// router.n_groups and router.topk_groups against E experts and top_k
// (router/groups.c): the groups divide E, a token's groups hold top_k experts.
int moe_router_groups_check(const moe_router_config *cfg, int E);
// Expert-choice routing (router/expert_choice.c), reached from
// moe_router_forward/backward when cfg->type is MOE_ROUTER_EXPERT_CHOICE; the
// plan has k = E entries per token. The backward adds into dlogits.
int moe_expert_choice_forward(moe_plan *plan, const float *logits, int T, int E,
                              const moe_router_config *cfg);
void moe_expert_choice_backward(float *dlogits, const float *dweight, const moe_plan *plan,
                                const moe_router_config *cfg, float z_scale);

// Parallel parts of a routing call of T tokens (the CPU pool's token ranges),
// and the scratch bytes one part needs for E experts and k choices a token.
int moe_router_token_parts(int T);
size_t moe_router_rows_bytes(int E, int k);

#endif
