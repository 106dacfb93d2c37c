// The MoE layer on the GPU (the CUDA build only): the forward and backward of
// moe_layer_forward/backward (moe/moe_layer.h) with every tensor in device
// memory, routing by the CUDA router (kernels/cuda/router_cuda.h) and the
// experts as grouped GEMMs over the expert segments (one cuBLAS grouped call
// per projection instead of one GEMM per expert). The host reads back the
// router's error flags, loss sums, counts and E + 1 segment offsets (the
// grouped GEMMs take host sizes) in one stream sync a forward, plus one a
// mini-sequence chunk for its offsets. The gate GEMM is fp32 on
// either table (routing is a discrete choice; see moe_layer_cuda_forward).
//
// Supported: expert parallelism (ep_size > 1, moe/src/moe_ep_rows.c: rows
// exchanged by NCCL, or by the EP group's alltoallv through host memory),
// mini-sequence chunks (n_chunks > 1, single process: the router over all T
// tokens, the experts and the shared expert one chunk at a time, recomputed
// in backward, as moe/src/moe_layer.c), task-level routing (n_tasks > 0: the
// gate reads the task embeddings, logits gathered per token), router noise
// (jitter on the gate input, Gumbel in the router, keyed as the CPU) and task
// priorities. Others fail with MOE_EINVAL naming the key.
#ifndef MOE_MOE_LAYER_CUDA_H
#define MOE_MOE_LAYER_CUDA_H

#include "moe/moe_ep_rows.h"
#include "moe/moe_layer.h"

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/router_cuda.h"

typedef struct {
    const moe_ops *ops; // moe_ops_cuda or moe_ops_cuda_bf16
    moe_layer_config cfg;
    int T; // tokens of the last forward, 0 before the first
    moe_cuda_plan plan;
    int *offsets_h;              // [E + 1] host copy of plan.offsets
    float *logits;               // [T_max, E]
    int *row;                    // [T_max * k]
    float *xe, *ab, *h, *ye;     // [rows_max, D | 2H | H | D]
    float *shared_ab, *shared_h; // [T_max, 2Hs | Hs]
    float *dlogits, *dweight;    // [T_max, E], [T_max * k]
    float *dye, *dxe, *dh, *dab; // [rows_max, D | D | H | 2H]
    float *sdh, *sdab;           // [T_max, Hs | 2Hs] shared expert backward
    // router noise and task routing, G = n_tasks or T_max gate-input rows
    float *noise, *gate_in, *dgate_in; // [G, D] jitter factors, jittered input, its gradient
    float *logits_g, *dlogits_g;       // [n_tasks, E] per-task logits and their gradient
    // mini-sequence chunks: row holds a chunk's [Tc * k] rows, the expert-side
    // buffers one chunk's rows, shared_* and sd* one chunk's tokens
    int *coff;     // [E + 1] the chunk's segment offsets (device)
    int *coff_h;   // [E + 1] their host copy
    bool jittered; // the last forward jittered the gate input
    // Expert parallelism (cfg.ep_size > 1): the experts' side of the rows
    const moe_ep_group *ep; // required when ep_size > 1, set by the caller
    moe_ep_rows epr;        // moe/moe_ep_rows.h with moe_cuda_download/upload
} moe_layer_cuda_acts;

int moe_layer_cuda_acts_alloc(moe_layer_cuda_acts *a, const moe_layer_config *cfg,
                              const moe_ops *ops);
void moe_layer_cuda_acts_free(moe_layer_cuda_acts *a);

// As moe_layer_forward: x, y and the parameter view p in device memory (a
// moe_layer_params_view over a device buffer); capacity [E] host memory or NULL.
// task_id [T] device memory: required with n_tasks > 0 (values in
// 0..n_tasks-1, which the caller has checked: the gather reads row task_id[t])
// and with router.task_priority, else may be NULL. training enables router
// noise, step seeds it (with router.seed), as on the CPU.
int moe_layer_cuda_forward(float *y, const float *x, const int *task_id, const int *capacity, int T,
                           const moe_layer_params *p, moe_layer_cuda_acts *a, bool training,
                           uint64_t step);
// As moe_layer_backward (ADDS into dx and dp), device memory throughout; the
// same task_id as the forward.
int moe_layer_cuda_backward(float *dx, const moe_layer_params *dp, const float *dy, const float *x,
                            const int *task_id, int T, const moe_layer_params *p,
                            moe_layer_cuda_acts *a, float aux_scale, float z_scale);

#endif

#endif
