// Training steps on the GPU for trainer/train.c (train.device = cuda): a
// device copy of the model (moe_model_gpu_init), the AdamW moments and decay
// mask in device memory, and device token buffers. The host model stays the
// master for checkpoints and evaluation: moe_gpu_trainer_sync copies the
// parameters and moments back before those run.
#ifndef MOE_TRAINER_TRAIN_GPU_H
#define MOE_TRAINER_TRAIN_GPU_H

#include "moe/comm.h"
#include "moe/comm_nccl.h"
#include "moe/config.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/parallel.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    moe_model m; // the device copy
    const moe_ops *ops;
    float *adam_m, *adam_v;
    uint8_t *decay;
    int32_t *in, *tg; // [B * T]
    size_t n, tokens;
    moe_comm *world;     // data-parallel ranks (NULL or size 1: one process)
    moe_nccl_comm *nccl; // their gradient all-reduce on CUDA tables (parallel.ep = 1)
    // parallel.ep > 1, or CUDA ranks that share a GPU (or a build without
    // NCCL): the process grid whose reductions the host trainer uses (dense
    // gradients over the world, expert shards over their expert data-parallel
    // group), and on a CUDA table the host copy of the gradients they run on
    moe_parallel *par;
    float *host_grads;
    moe_nccl_comm *ep_nccl; // the CUDA layers' exchange when the EP group's GPUs are distinct
} moe_gpu_trainer;

// The CUDA device of this rank: the launcher's node-local rank (Open MPI,
// MPICH, MVAPICH, Slurm or LOCAL_RANK) modulo the devices present, else 0.
int moe_gpu_local_device(void);

// This process's device copy (on the device of moe_gpu_local_device);
// several ranks join for data parallelism with moe_gpu_trainer_connect. ops
// NULL: the CUDA table train.compute names; moe_ops_cpu runs the same path on
// the host (tests).
int moe_gpu_trainer_init(moe_gpu_trainer *g, const moe_model *host, const moe_adamw *opt,
                         const moe_config *cfg, size_t tokens, const moe_ops *ops);
void moe_gpu_trainer_free(moe_gpu_trainer *g);
// Bytes of the trainer's own buffers on ops (AdamW m, v, decay mask, tokens)
// for n parameters and a batch of tokens, each rounded as ops->alloc_size;
// *optimizer (when not NULL) gets the part of m, v and the mask.
size_t moe_gpu_trainer_bytes(size_t n, size_t tokens, const moe_ops *ops, size_t *optimizer);
// Several ranks over par's world (collective; every rank calls it after
// agreeing that init succeeded; par stays the caller's). Data parallelism
// (parallel.ep = 1): on a CUDA table with a GPU per rank an NCCL
// communicator for the gradient all-reduce, on the CPU table the host
// communicator's rank-order sum. Expert parallelism (parallel.ep > 1), and
// CUDA ranks sharing a GPU (where NCCL cannot run): moe_parallel_allreduce_buffer's
// sums, on a CUDA table through a host copy of the gradients; when the EP
// group's ranks have distinct GPUs the CUDA layers exchange rows over an NCCL
// communicator of the group (moe_parallel_device_exchange), else staged
// through host memory.
int moe_gpu_trainer_connect(moe_gpu_trainer *g, moe_parallel *par);
// Whether every rank of comm is on a device of its own (host name and
// device index differ; collective over comm): NCCL can join them then.
int moe_gpu_devices_distinct(moe_comm *comm, int device, bool *distinct);
// Sums the gradients over the ranks (no-op in one process).
int moe_gpu_allreduce_grads(moe_gpu_trainer *g);

// Zeroes the gradients (start of an optimizer step).
int moe_gpu_zero_grads(moe_gpu_trainer *g);
// One micro-batch: tokens to the device, forward, backward (gradients add up).
int moe_gpu_micro_batch(moe_gpu_trainer *g, const int32_t *in, const int32_t *tg,
                        const int32_t *task, int B, int T, uint64_t step);
// Mean over accum micro-batches (all ranks' included), global norm (*gnorm;
// under expert parallelism moe_parallel_grad_norm_on's, over every shard), clipping to
// train.grad_clip, one AdamW step at lr (opt->step advances, as
// moe_adamw_update). A non-finite norm fails before the update.
int moe_gpu_optimizer_step(moe_gpu_trainer *g, moe_adamw *opt, int accum, float lr,
                           const moe_config *cfg, double *gnorm);
// Parameters and AdamW moments back into the host model and optimizer.
int moe_gpu_trainer_sync(moe_gpu_trainer *g, moe_model *host, moe_adamw *opt);

#endif
