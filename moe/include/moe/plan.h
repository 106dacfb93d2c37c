// The planner behind `moe plan` and `moe train --dry-run`: memory of one rank
// (computed from the same layouts the trainer allocates, so it matches the
// library's allocation high-water mark), and the all-to-all traffic and an
// alpha-beta time estimate per optimizer step, flat vs hierarchical.
#ifndef MOE_PLAN_H
#define MOE_PLAN_H

#include "kernels/ops.h"
#include "moe/comm.h"
#include "moe/config.h"

#include <stdbool.h>

#include <stdio.h>

typedef struct {
    size_t params, grads, optimizer; // flat buffers; optimizer: AdamW m, v (as stored)
    size_t activations;              // dense activations and scratch
    size_t moe;                      // routing plans, expert row buffers, capacity state
    size_t step;                     // token/target/task buffers, accumulation buffer
    size_t data;                     // 0: token files are memory-mapped, not allocated
    size_t grad_pack;                // staging of the gradient all-reduces
    size_t ckpt_snapshot;            // train.async_checkpoint: params and moments copied
    size_t total;                    // predicted peak of the library's allocations
    size_t n_params;                 // parameters held by this rank
} moe_mem_plan;

// Memory of rank `rank` of `world` ranks for cfg (parallel.ep from cfg). The
// buffers of comm.node_dedup depend on the nodes: comm.ranks_per_node ranks
// each (0: every rank on one node), as a run of cfg finds them.
int moe_plan_memory(const moe_config *cfg, int world, int rank, moe_mem_plan *out);

// Device memory of one rank training on the GPU (train.device = cuda): the
// buffers moe_model_gpu_init and the GPU trainer allocate through the
// table's alloc, each request rounded as its alloc_size (on CUDA the 256-byte
// granule moe_cuda_alloc reserves and moe_cuda_mem_peak counts), sized by the
// functions the allocation code uses (moe/cuda_sizes.h). Not counted: the
// CUDA context, cuBLAS's workspace, NCCL, and the stream-ordered scratch that
// single ops take and free (cudaMallocAsync).
typedef struct {
    size_t params, grads;    // the device copy's flat buffers
    size_t optimizer;        // AdamW m, v (fp32) and the decay byte mask
    size_t activations;      // the activation block (attention [B, Hq, T, T]) and task ids
    size_t moe;              // CUDA MoE layers: expert row buffers and router plans
    size_t trainer;          // device token and target buffers
    size_t total;            // the sum: the tracked peak after a few steps
    bool sort_tmp_estimated; // cub's sort temp estimated (no CUDA device here)
} moe_gpu_mem_plan;

// ops NULL: the CUDA table's sizes (in any build); &moe_ops_cpu: the device
// path run on the CPU table (tests). Fails with the device path's message on
// configurations it refuses.
int moe_plan_device_memory(const moe_config *cfg, const moe_ops *ops, moe_gpu_mem_plan *out);

// Memory this process can still allocate: MemAvailable of /proc/meminfo, or
// the room left under its cgroup's limit when lower (v2: memory.max minus
// memory.current; v1: memory.limit_in_bytes minus memory.usage_in_bytes).
// source (n bytes) names where the figure came from. MOE_ENOTFOUND when
// neither can be read (not Linux).
int moe_plan_mem_available(size_t *bytes, char *source, size_t n);

typedef struct {
    int world, nodes, ranks_per_node; // the machine
    double gbps[2], latency_us[2];    // intra-node, inter-node links
} moe_machine;

typedef struct {
    long calls;       // all-to-all calls per step per rank
    long bytes, msgs; // payload sent to other ranks, per step per rank
    double seconds;   // alpha-beta estimate per step
    long bytes_inter; // the part of bytes sent to other nodes (the counters' bytes_inter)
    // Group-limited routing (router.n_groups, router.topk_groups), for routing
    // balanced over the experts and groups: nodes other than its own that a
    // token's k choices reach on average (-1: groups and nodes do not nest),
    // and the inter-node bytes per step per rank of a dispatch that sends one
    // copy per token and node (DeepSeek-V3's); this exchange sends one per
    // choice, k (N-1)/N per token whatever the groups.
    int nodes, n_groups, topk_groups; // N of the EP group; groups in force (topk 0: all)
    double remote_nodes;
    long bytes_inter_node_copy;
    // comm.node_dedup: bytes, msgs, calls and bytes_inter count the rows to
    // the experts and the combine's gradients once per token and node (plus
    // the index and the forwarding inside nodes), the return paths per choice.
    // Without a model of the nodes (remote_nodes < 0) every call is per choice.
    bool node_dedup;
} moe_a2a_plan;

// The machine a plan models: nodes x ranks_per_node (0: not given). With
// neither given: parallel.ep ranks, in nodes of comm.ranks_per_node when set
// (the node layout a run of cfg uses), else on one node; nodes defaults to 1
// and ranks_per_node to comm.ranks_per_node, else parallel.ep.
// MOE_EINVAL, naming the key or option, when comm.ranks_per_node does not
// divide the world or disagrees with the ranks_per_node given.
int moe_plan_machine(const moe_config *cfg, int nodes, int ranks_per_node, moe_machine *mc);

// All-to-all traffic of one rank per optimizer step, assuming every expert is
// filled to its static capacity (exact when every expert overflows; an upper
// bound otherwise; dropless configs are estimated at k*T/E rows per expert).
// Per MoE layer and micro-batch: one call of expert counts, then rows to the
// experts, back, and the same two in the backward pass.
int moe_plan_a2a(const moe_config *cfg, const moe_machine *mc, moe_a2a_algo algo,
                 moe_a2a_plan *out);

// Expert placement model (placement.*, moe/placement.h) for one MoE layer of
// the EP group (parallel.ep ranks, any number): every rank routes B*T*k
// assignments, a share `skew` of them to expert 0 and the rest evenly (skew
// 0: all even); load[e] instead, when given, is each expert's share (any
// scale). Each source keeps at most its capacity of an expert's rows; a
// replicated expert's capacity grows with its holders (moe_placement_capacity),
// so drops fall; the experts compute the kept rows. Index 0: the
// static table, 1: replicated (placement.slots_per_rank, or E/ep + 1 when the
// config has no spare slot), with home experts moved too under
// placement.mode = move (the swap greedy of moe_placement_update).
typedef struct {
    int E, P, S, replicas;
    double max_mean[2];  // max rank tokens / mean rank tokens
    double drop_rate[2]; // dropped / routed assignments
    double a2a_bytes[2]; // rows to other ranks per step per rank, all MoE layers, fwd + bwd
    double *tokens[2];   // [P] rank tokens of the layer (caller's arrays, or NULL)
    int moved;           // experts whose home rank changed (index 1)
} moe_place_plan;
int moe_plan_placement(const moe_config *cfg, double skew, const double *load, moe_place_plan *out);

// Prints the plan a person reads.
int moe_plan_print(const moe_config *cfg, const moe_machine *mc, FILE *f);
// The placement model printed: per-rank tokens with and without replicas.
int moe_plan_placement_print(const moe_config *cfg, double skew, const double *load, FILE *f);

#endif
