// The process grid of a training run: world = dp x ep ranks, rank =
// dp_rank * ep + ep_rank. An expert-parallel (EP) group is ep consecutive
// ranks sharing one copy of every expert; ranks with the same ep_rank hold
// the same experts and form an expert data-parallel group. Dense gradients
// are summed over the world, expert gradients over the expert DP group, both
// in rank order (bit-reproducible).
#ifndef MOE_PARALLEL_H
#define MOE_PARALLEL_H

#include "moe/comm.h"
#include "moe/comm_nccl.h"
#include "moe/config.h"
#include "moe/model.h"
#include "moe/optim.h"

typedef struct {
    moe_comm *world; // every rank (a local communicator in a single process)
    moe_comm *ep;    // this rank's EP group
    moe_comm *edp;   // ranks holding the same experts
    int size, rank, ep_size, ep_rank, dp_size, dp_rank;
    moe_a2a_algo algo;
    moe_ep_group group;     // the model's exchange, bound to ep
    moe_nccl_comm *ep_nccl; // the EP group's device exchange (NULL: none), not owned
    float *pack;            // staging for grouped all-reduces
    size_t pack_n;
    // placement.mode = replicate (trainer/placement.c): per layer, NULL for
    // dense layers; the global load EMA [layer][E] the tables come from; the
    // measured expert-side rows (max over ranks, mean over ranks) summed over
    // the steps, for max/mean rank tokens.
    struct moe_place_layer *place[MOE_MAX_LAYERS];
    double *place_ema;
    bool place_seeded;
    long place_steps;
    double place_rows_max, place_rows_mean, place_a2a_bytes;
    double *place_acc;   // kept rows [layer][E], rows per layer, bytes sent: this step's
    int place_acc_calls; // micro-batches added to place_acc
    float *place_buf;    // staging of replica gradients and weights
    size_t place_buf_n;
} moe_parallel;

// Builds the grid over world (not owned) from parallel.ep and comm.all_to_all;
// size % ep and E % ep are checked (the caller agrees the status over ranks).
int moe_parallel_init(moe_parallel *p, moe_comm *world, const moe_config *cfg);
void moe_parallel_free(moe_parallel *p);
// The CUDA layers' exchange of device rows: over nccl (a communicator of the
// EP group, comm.all_to_all's algorithm; the caller keeps it alive and frees
// it), or NULL for the rows staged through host memory and the group's MPI
// exchange.
int moe_parallel_device_exchange(moe_parallel *p, moe_nccl_comm *nccl);

// Sums the gradients of every rank: dense tensors over the world, expert
// tensors over the expert DP group.
int moe_parallel_allreduce_grads(moe_parallel *p, moe_model *m);
// The same sums over a host buffer laid out as t (no placement replicas): the
// GPU trainer's gradients staged through host memory.
int moe_parallel_allreduce_buffer(moe_parallel *p, const moe_param_table *t, float *grads);
// Global L2 norm of the gradients: per-tensor sums of squares (an expert's
// three tensors count as one unit) added in model order over every expert of
// every layer, so one process and any grid give the same bits.
int moe_parallel_grad_norm(moe_parallel *p, const moe_model *m, double *norm);
// The same norm with ops->sumsq over m's gradients: a device copy's (its
// views bound to device memory) on a CUDA table, the host's on moe_ops_cpu.
int moe_parallel_grad_norm_on(moe_parallel *p, const moe_model *m, const moe_ops *ops,
                              double *norm);

// Nodes spanned by this rank's EP group: ep / (its ranks per node); every
// rank is a node of its own when the group has no regular node layout.
int moe_parallel_ep_nodes(const moe_parallel *p);
// router.n_groups = 0 (one group per node) becomes the EP group's node count
// in cfg, and topk_groups above it becomes 0 (every node), so the config the
// run writes routes the same in one process. Refuses a node count whose
// topk_groups groups hold fewer than router.top_k experts.
int moe_parallel_resolve_groups(const moe_parallel *p, moe_config *cfg);

// Load-driven placement (placement.mode = replicate | move; nothing for
// static).
// Init attaches a static table to every MoE layer of m. Observe, once per
// optimizer step after the backward pass (collective over the world), adds
// each expert's kept rows of the step (every micro-batch accumulated, else
// the last forward), summed over every rank, to the
// load EMA (capacity.ema) and measures the rows each rank computed. Step,
// after the optimizer update: every placement.update_every steps recomputes
// the tables from the EMA (identical on every rank), then
// copies each replicated expert's weights from its home rank to its replicas,
// so every replica holds the home's bits. The replicas' gradients are summed
// into the home expert by moe_parallel_allreduce_grads. Under move, an
// update that changes an expert's home sends its weights and both AdamW
// moments (opt) to the new home (one exchange in each EP group, the same in
// every one) and renames the parameter views, so local expert j of a rank is
// the expert of its home slot j, named as such in checkpoints.
int moe_parallel_placement_init(moe_parallel *p, moe_model *m, const moe_config *cfg);
int moe_parallel_placement_observe(moe_parallel *p, const moe_model *m);
// After each micro-batch's forward (grad_accum > 1): adds its kept rows, so
// observe measures the step's load; observe alone takes the last forward's.
int moe_parallel_placement_accumulate(moe_parallel *p, const moe_model *m);
int moe_parallel_placement_step(moe_parallel *p, moe_model *m, moe_adamw *opt, long steps_done);
// The expert local expert j of this rank holds in MoE layer l, and the EP
// rank that is expert x's home: the table's (contiguous blocks without
// placement).
int moe_parallel_expert_of(const moe_parallel *p, const moe_model *m, int l, int j);
int moe_parallel_expert_home(const moe_parallel *p, const moe_model *m, int l, int x);
// Over the observed steps and MoE layers: (sum of each layer's largest rank
// rows) / (sum of its mean rank rows) on the expert side (1: balanced; 0 before any step or
// without placement), and *a2a_bytes (NULL: not wanted) the expert rows each
// rank sent to other ranks per step, mean over ranks, forward and backward.
double moe_parallel_placement_imbalance(const moe_parallel *p, double *a2a_bytes);
// Resume: the load EMA and tables saved in DIR's trainer_state.json (every
// field checked; nothing changes on a failure); moved homes rename the
// parameter views, so call it before moe_ckpt_load, which loads by name. A checkpoint without them,
// or from another parallel.ep or placement.slots_per_rank, is logged and the
// run starts from the static table. Then, collective once every rank loaded
// (the caller agrees the status first), sync copies the home weights to the
// replicas.
int moe_parallel_placement_resume(moe_parallel *p, moe_model *m, const char *dir);
int moe_parallel_placement_sync(moe_parallel *p, moe_model *m);
// Called by moe_parallel_allreduce_grads (no-op without replicas).
int moe_parallel_placement_reduce_grads(moe_parallel *p, moe_model *m);
void moe_parallel_placement_free(moe_parallel *p);

#endif
