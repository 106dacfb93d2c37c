// Gating on the GPU: the CUDA twin of moe_router_forward/backward (router/)
// for routing without Gumbel noise. Softmax + top-k (ties to the lower
// expert), capacity, slot order (position, or Batch Prioritized Routing by a
// stable radix sort), slots by per-expert prefix sums, combine weights, aux
// and z losses, all in device memory with no host round trip per token: the
// host sends the capacity vector when one is given and reads back one error
// flag and the two loss scalars per call.
#ifndef MOE_KERNELS_ROUTER_CUDA_H
#define MOE_KERNELS_ROUTER_CUDA_H

#include "moe/router.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The fields of moe_plan (moe/router.h) in device memory, same shapes and
// meaning; aux_loss and z_loss are host floats.
typedef struct {
    int T, E, k, T_max;
    int *expert, *choice, *slot;   // [T, k]
    float *weight;                 // [T, k]
    float *probs;                  // [T, E]
    float *lse;                    // [T]
    int *counts, *kept, *capacity; // [E]
    int *offsets;                  // [E + 1]
    float *aux_f;                  // [E]
    int *order;                    // [T]
    float aux_loss, z_loss;
    // scratch: sort keys and values (double-buffered), cub temp storage,
    // per-expert reductions, error flags, task ranks
    uint64_t *keys, *keys_alt;
    int *order_alt;
    void *sort_tmp;
    size_t sort_tmp_bytes;
    int *hist, *hist1, *base; // [chunks, E] per-chunk counts and first ranks
    double *part;             // [tiles, E + 1] per-tile probability and lse^2 sums
    double *red;              // [E + 1]: P_e sums, then sum of lse^2
    int *flags;               // [2]: first token with a non-finite logit, first bad task id
    int *task_rank;           // [MOE_MAX_TASKS]
} moe_cuda_plan;

int moe_cuda_plan_alloc(moe_cuda_plan *plan, int T_max, int E, int k);
void moe_cuda_plan_free(moe_cuda_plan *plan);

// logits [T, E] and task_id [T] (or NULL) are device memory; capacity [E] is
// host memory or NULL (as moe_router_forward). Gumbel noise while training is
// not supported (MOE_EINVAL); jitter acts on the router input, not here.
int moe_cuda_router_forward(moe_cuda_plan *plan, const float *logits, const int *task_id,
                            const int *capacity, int T, int E, const moe_router_config *cfg,
                            bool training);

// dlogits [T, E] (device) += the gradient of moe_router_backward; dweight
// [T, k] device memory or NULL.
int moe_cuda_router_backward(float *dlogits, const float *dweight, const moe_cuda_plan *plan,
                             const moe_router_config *cfg, float aux_scale, float z_scale);

#ifdef __cplusplus
}
#endif

#endif
