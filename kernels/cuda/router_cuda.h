// Gating on the GPU: the CUDA twin of moe_router_forward/backward (router/)
// and of the router noise (router/noise.c). Softmax + top-k (ties to the lower
// expert), capacity, slot order (position, or Batch Prioritized Routing by a
// stable radix sort), slots by per-expert prefix sums, combine weights, aux
// and z losses, all in device memory with no host round trip per token: the
// host sends the capacity vector when one is given and, once per forward,
// reads back O(E) values: error flags, the loss sums, and per expert the
// counts, kept entries, capacities and row offsets the layer and trainer use.
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
    // Host mirrors in one page-locked block, filled by the forward's single
    // read-back (one stream sync a layer): the statistics the layer and the
    // trainer read (counts, kept, capacity, offsets) with the flags and sums;
    // and the given capacities and task ranks staged for their upload.
    void *host;
    double *red_h;                                 // [E + 1]
    float *aux_f_h;                                // [E]
    int *counts_h, *kept_h, *capacity_h, *flags_h; // [E], [E], [E], [2]
    int *offsets_h;                                // [E + 1]
    int *cap_in_h, *task_rank_in_h;                // [E], [MOE_MAX_TASKS]: inputs on their way up
} moe_cuda_plan;

// Device buffers of moe_cuda_plan_sizes (moe/cuda_sizes.h) through moe_cuda_alloc.
int moe_cuda_plan_alloc(moe_cuda_plan *plan, int T_max, int E, int k);
// cub's temp storage for sorting n (uint64 key, int value) pairs (asks the runtime).
int moe_cuda_sort_tmp_query(int n, size_t *bytes);
void moe_cuda_plan_free(moe_cuda_plan *plan);

// logits [T, E] and task_id [T] (or NULL) are device memory; capacity [E] is
// host memory or NULL (as moe_router_forward). training enables Gumbel noise
// (router.noise = gumbel: choices 2..k as router/router.c topk_row), keyed by
// (cfg->seed, step); jitter acts on the router input (moe_cuda_router_jitter).
int moe_cuda_router_forward(moe_cuda_plan *plan, const float *logits, const int *task_id,
                            const int *capacity, int T, int E, const moe_router_config *cfg,
                            bool training, uint64_t step);

// dlogits [T, E] (device) += the gradient of moe_router_backward; dweight
// [T, k] device memory or NULL.
int moe_cuda_router_backward(float *dlogits, const float *dweight, const moe_cuda_plan *plan,
                             const moe_router_config *cfg, float aux_scale, float z_scale);

// Switch jitter on the device, moe_router_jitter's keys and bits: out[i] =
// in[i] * U(1-eps, 1+eps) keyed by (seed, step, i); in NULL reads as ones
// (out gets the factors). out may equal in. Device memory.
int moe_cuda_router_jitter(float *out, const float *in, size_t n, double eps, uint64_t seed,
                           uint64_t step);

// For the host-device equality test: hash[i] = moe_hash4(seed, step, 1, i),
// uniform[i] = moe_noise_uniform(seed, step, 1, i), gumbel[i] =
// moe_noise_gumbel(seed, step, i), computed on the device into device memory.
int moe_cuda_noise_samples(uint64_t *hash, double *uniform, double *gumbel, size_t n, uint64_t seed,
                           uint64_t step);

#ifdef __cplusplus
}
#endif

#endif
