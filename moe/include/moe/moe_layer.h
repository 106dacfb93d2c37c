// The MoE feed-forward layer (Mixtral semantics, DESIGN "Data flow of one MoE
// layer"): gate GEMM -> router -> permute -> per-expert SwiGLU FFN -> weighted
// combine, with an optional shared expert (PR-MoE / DeepSeek) and optional
// task-level routing (Task-MoE). llm.c style: forward/backward with caller-owned
// parameters, gradients and activations; backward ADDS into dx and the grads.
#ifndef MOE_MOE_LAYER_H
#define MOE_MOE_LAYER_H

#include "kernels/ops.h"
#include "moe/params.h"
#include "moe/router.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    int T_max;                // most tokens per call; sizes the activations
    int D;                    // model width
    int H;                    // expert FFN hidden (moe.d_expert)
    int E;                    // experts
    int H_shared;             // shared expert hidden, 0: no shared expert
    int n_tasks;              // > 0: Task-MoE, the gate input is task_embedding[task_id[t]]
    moe_router_config router; // top-k is router.top_k
    // Expert parallelism: the E experts are sharded over ep_size ranks; this
    // layer holds experts [ep_rank*E/ep_size, (ep_rank+1)*E/ep_size) and
    // exchanges rows through acts->ep. 0 or 1: every expert is local.
    int ep_size, ep_rank;
    // Mini-sequence chunking (MST, arXiv 2407.15892): > 1 runs the experts
    // and the shared expert on n_chunks consecutive token chunks, keeping
    // only one chunk's rows; backward recomputes them chunk by chunk. Routing
    // still covers all T tokens, so capacity and drops are unchanged.
    int n_chunks;
    // Expert parallelism on a device backend (moe/moe_ep_rows.h): the exchange
    // in this many rounds of peers, each round's expert GEMMs queued while the
    // next round travels (comm.overlap_degree; <= 1: one exchange). The CPU
    // layer ignores it.
    int overlap_degree;
} moe_layer_config;

// The exchange of an expert-parallel group (the layer knows nothing of MPI):
// alltoallv sends send_counts[r] elements of elem_size bytes to rank r (send
// is contiguous in rank order), learns recv_counts[r] from every rank (counts
// travel first) and receives the payload into recv in source-rank order;
// more than recv_cap elements is an error on every rank.
typedef struct {
    int size, rank;
    void *ctx;
    int (*alltoallv)(void *ctx, const void *send, const int *send_counts, void *recv,
                     int *recv_counts, size_t recv_cap, size_t elem_size);
    // comm.node_dedup: > 0 sends the rows to the experts and the gradients
    // of the combine once per token and node of dedup_G consecutive ranks
    // (moe/src/moe_dispatch_node.c); 0: one row per choice.
    int dedup_G;
    // The same exchange with send and recv in device memory (the CUDA layer;
    // NCCL when no two ranks of the group share a GPU), ordered after the
    // work queued on the backend's stream. NULL: the CUDA layer stages the
    // rows through host memory and calls alltoallv.
    int (*alltoallv_device)(void *ctx, const void *send, const int *send_counts, void *recv,
                            int *recv_counts, size_t recv_cap, size_t elem_size);
} moe_ep_group;

// Experts held by this layer (E / ep_size) and the first one's global index.
static inline int moe_layer_local_experts(const moe_layer_config *c) {
    return c->ep_size > 1 ? c->E / c->ep_size : c->E;
}
static inline int moe_layer_first_expert(const moe_layer_config *c) {
    return c->ep_size > 1 ? c->ep_rank * (c->E / c->ep_size) : 0;
}

// Sizes and router config consistent (MOE_EINVAL with the field at fault).
int moe_layer_config_check(const moe_layer_config *cfg);

// Pointers into a flat float buffer laid out as moe_layer_param_table lists it:
//   gate.weight [E, D]
//   task_embedding.weight [n_tasks, D]                  (n_tasks > 0)
//   shared_expert.{w1,w3}.weight [Hs, D], .w2 [D, Hs]  (H_shared > 0)
//   experts.{j}.w1.weight [H, D], .w3 [H, D], .w2 [D, H]  for the local experts
//                                          (j is the global expert index)
// Each expert's w1 and w3 are adjacent: one [2H, D] block, so x @ [w1;w3]^T is
// one GEMM. Dense parameters come first and each expert is one contiguous
// block of 3*H*D floats (expert-parallel sharding and per-task loading slice it).
typedef struct {
    float *gate;         // [E, D]
    float *task_emb;     // [n_tasks, D] or NULL
    float *shared_w13;   // [2*Hs, D] (w1 rows then w3 rows) or NULL
    float *shared_w2;    // [D, Hs] or NULL
    float *experts;      // one block of expert_numel floats per local expert
    size_t expert_numel; // 3*H*D
    size_t w2_offset;    // 2*H*D: w2 of an expert, from its block start
} moe_layer_params;

// e: local expert index (0 .. moe_layer_local_experts - 1)
static inline float *moe_layer_w13(const moe_layer_params *p, int e) {
    return p->experts + (size_t)e * p->expert_numel;
}
static inline float *moe_layer_w2(const moe_layer_params *p, int e) {
    return p->experts + (size_t)e * p->expert_numel + p->w2_offset;
}

// Floats of one layer's parameters (and of its gradients).
size_t moe_layer_num_params(const moe_layer_config *cfg);
// Fills the view over base (the layer's first float). Use it twice: once for
// the parameters, once for the gradient buffer.
int moe_layer_params_view(moe_layer_params *p, float *base, const moe_layer_config *cfg);
// Appends the layer's named views to t, each name prefixed (e.g.
// "model.layers.3.block_sparse_moe."); the layer starts at t->numel as it was
// before the call, which is where moe_layer_params_view's base must point.
int moe_layer_param_table(moe_param_table *t, const char *prefix, const moe_layer_config *cfg);

// Seconds spent per phase, ADDED by forward and backward when the caller sets
// acts->timing (CPU wall clock; NULL: no timing). Routing = gate + router +
// permute + unpermute.
typedef struct {
    double gate;      // gate GEMM (and its backward), task broadcast, jitter
    double router;    // moe_router_forward / moe_router_backward
    double permute;   // dispatch rows, gather into expert order (and backward)
    double experts;   // expert GEMMs + SwiGLU
    double unpermute; // weighted combine (and backward: dye, dweight)
    double shared;    // shared expert
} moe_layer_timing;

// Activations saved by forward for backward, and backward's scratch; sized
// once for cfg by moe_layer_acts_alloc (backend memory from ops->alloc, the
// plan in host memory). rows_max = T_max * k; under expert choice k is E
// (plan entries per token) and rows_max = E * C (moe_router_rows_max).
typedef struct {
    const moe_ops *ops;
    moe_layer_config cfg; // the sizes it was allocated for
    int T;                // tokens of the last forward, 0 before the first
    bool jittered;        // the last forward applied router jitter
    moe_plan plan;        // routing of the last forward
    float *noise;         // [G, D] jitter factors, G = n_tasks or T_max (jitter configs only)
    float *gate_in;       // [G, D] jittered gate input (jitter configs only)
    float *logits_g;      // [n_tasks, E] per-task logits (task routing only)
    float *logits;        // [T_max, E]
    int *row;             // [T_max * k] row of (t, j) in expert order, -1 dropped
    float *xe;            // [rows_max, D] tokens in expert order
    float *ab;            // [rows_max, 2H] x @ [w1;w3]^T
    float *h;             // [rows_max, H] silu(a) * b
    float *ye;            // [rows_max, D] expert outputs
    float *shared_ab;     // [T_max, 2Hs]
    float *shared_h;      // [T_max, Hs]
    // backward scratch
    float *dlogits;   // [T_max, E]
    float *dlogits_g; // [n_tasks, E]
    float *dweight;   // [T_max * k]
    float *dye;       // [rows_max, D]
    float *dxe;       // [rows_max, D]
    float *dh;        // [T_max, max(H, Hs)]: one expert at a time
    float *dab;       // [T_max, 2 max(H, Hs)]
    float *dgate_in;  // [G, D] (jitter configs only)
    // Expert side: rows this rank's experts process. Without expert
    // parallelism these alias xe, ab, h, ye, dye, dxe; with it they hold the
    // rows received from the group, R = ep_size * T_max * k at most.
    float *xr, *abr, *hr, *yr, *dyr, *dxr;
    int *blk_off, *blk_n; // [ep_size * E_local]: rows of (source s, local expert le)
    int *send_rows, *recv_rows, *recv_kept; // [ep], [ep], [ep * E_local]
    float *dw;                   // [3 H D] per-block weight gradient (expert parallel only)
    const moe_ep_group *ep;      // required when cfg.ep_size > 1, set by the caller
    int *crow, *coff;            // chunking: [Tc * k] rows of a chunk, [E + 1] offsets
    moe_layer_timing *timing;    // optional, set by the caller
    struct moe_node_state *node; // node-deduplicated exchange (ep->dedup_G), its own memory
    // placement.mode = replicate (moe/placement.h), set by the caller; NULL or
    // without replicas: the contiguous exchange.
    struct moe_place_layer *place;
} moe_layer_acts;

int moe_layer_acts_alloc(moe_layer_acts *a, const moe_layer_config *cfg, const moe_ops *ops);
// Bytes moe_layer_acts_alloc takes for cfg on ops (the routing plan included).
size_t moe_layer_acts_bytes(const moe_layer_config *cfg, const moe_ops *ops);
// Bytes the node-deduplicated exchange (moe_ep_group.dedup_G) adds to a
// layer of cfg in a group whose nodes hold dedup_G ranks, allocated on the
// first forward (0 when dedup_G <= 0 or ep_size < 2).
size_t moe_layer_node_dedup_bytes(const moe_layer_config *cfg, int dedup_G);
void moe_layer_acts_free(moe_layer_acts *a);

// y [T, D] = MoE(x [T, D]) (+ shared expert). task_id [T]: required with
// n_tasks > 0 (values in 0..n_tasks-1), else optional (priority routing).
// capacity [E] or NULL: per-expert C_e passed to the router (dynamic capacity).
// training enables router noise, step seeds it. cfg must be the config the
// activations were allocated with. Routing and the aux/z losses land in
// a->plan. y must not alias x.
int moe_layer_forward(float *y, const float *x, const int *task_id, const int *capacity, int T,
                      const moe_layer_params *p, moe_layer_acts *a, bool training, uint64_t step);

// Backward of the last forward (same x, task_id, T, parameters): ADDS into
// dx [T, D] and the gradient view dp (same layout as p). dy [T, D]. aux_scale
// and z_scale are dL/d aux_loss and dL/d z_loss (e.g. the configured coefs).
// With task routing the gate gradient flows into task_embedding, not dx.
// dx must not alias dy. One backward per forward: where the backend has the
// expert op (kernels/ops.h expert_ffn_backward) the saved expert activations
// become their gradients, and a second backward is refused.
int moe_layer_backward(float *dx, const moe_layer_params *dp, const float *dy, const float *x,
                       const int *task_id, int T, const moe_layer_params *p, moe_layer_acts *a,
                       float aux_scale, float z_scale);

#endif
