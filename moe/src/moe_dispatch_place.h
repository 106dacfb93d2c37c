// Expert-parallel exchange under a replicated placement, private to the MoE
// layer (moe/src/moe_dispatch_place.c). The same three moves as the
// contiguous exchange: rows to the experts, outputs back, and in backward the
// combine's gradients to the experts again.
#ifndef MOE_DISPATCH_PLACE_H
#define MOE_DISPATCH_PLACE_H

#include "moe/moe_layer.h"
#include "moe/placement.h"

#include <stdbool.h>

// The layer routes through a placement with replicas.
static inline bool moe_place_on(const moe_layer_acts *a) {
    return a->cfg.ep_size > 1 && a->place && a->place->active;
}

// Expert slots of this rank (blocks per source) and a slot's weights or
// gradient: home experts in p, replicas in the placement's buffers.
static inline int moe_place_slots(const moe_layer_acts *a) {
    return moe_place_on(a) ? a->place->t.S : moe_layer_local_experts(&a->cfg);
}
static inline float *moe_place_w13(const moe_layer_acts *a, const moe_layer_params *p, int j,
                                   bool grad) {
    const int El = moe_layer_local_experts(&a->cfg);
    if (j < El) return moe_layer_w13(p, j);
    return (grad ? a->place->rep_g : a->place->rep_w) + (size_t)(j - El) * a->place->numel;
}

// The capacities this source rank routes T tokens with: `capacity` (NULL:
// the static formula) with each replicated expert's grown to this source's
// share of its holder's budget (moe_placement_capacity), in the placement's
// array; unchanged when the router keeps every row (capacity_factor <= 0).
const int *moe_place_capacity(moe_layer_acts *a, const int *capacity, int T);
// a->xe (expert order) to a->xr; fills the placement's blocks and counts.
int moe_place_dispatch(moe_layer_acts *a);
// Expert side `from` back into token-side expert order `to`.
int moe_place_combine(moe_layer_acts *a, const float *from, float *to);
// Token-side expert order `from` to the expert side `to` (forward's counts).
int moe_place_redispatch(moe_layer_acts *a, float *from, float *to);

#endif
