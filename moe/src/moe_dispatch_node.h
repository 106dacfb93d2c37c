// Node-deduplicated expert-parallel dispatch (comm.node_dedup), private to
// the MoE layer: the forward rows to the experts and the backward of the
// combine cross a node boundary once per token and node (DeepSeek-V3,
// arXiv 2412.19437 sec 3.2.2). The expert side ends with today's rows.
#ifndef MOE_DISPATCH_NODE_H
#define MOE_DISPATCH_NODE_H

#include "moe/moe_layer.h"

#include <stdbool.h>

// The layer's exchange is node-deduplicated (expert parallelism, dedup_G set).
static inline bool moe_node_dedup_on(const moe_layer_acts *a) {
    return a->cfg.ep_size > 1 && a->ep && a->ep->dedup_G > 0;
}

// Forward dispatch: a->xe (token side, expert order) to a->xr, filling
// blk_off, blk_n, send_rows, recv_rows and recv_kept as the per-choice
// dispatch does; keeps the index for moe_node_redispatch.
int moe_node_dispatch(moe_layer_acts *a);

// Backward of the combine: dy [T, D] (token order) to the expert side `to`
// as weight * dy rows, the arithmetic of the token-side unpermute backward,
// with the last forward's routing.
int moe_node_redispatch(moe_layer_acts *a, const float *dy, float *to);

// Rows of the layer's token-side expert buffers (xe): a source's rows to
// all ranks together (moe/src/moe_layer.c).
size_t moe_layer_expert_rows(const moe_layer_config *cfg);

// Frees a->node (NULL: nothing).
void moe_node_state_free(moe_layer_acts *a);

#endif
