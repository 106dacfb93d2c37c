// Device memory of the CUDA backend as plain arithmetic, compiled in every
// build: the allocation code (kernels/cuda/router.cu, moe/src/moe_layer_cuda.c,
// trainer/model.c, trainer/train_gpu.c) sizes its buffers with these, and
// `moe plan` predicts a GPU's memory from the same functions on any machine.
#ifndef MOE_CUDA_SIZES_H
#define MOE_CUDA_SIZES_H

#include "kernels/ops.h"
#include "moe/moe_layer.h"

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bytes moe_cuda_alloc reserves (and its tracking counts) for a request:
// cudaMalloc's 256-byte granule, 256 for an empty request.
size_t moe_cuda_granule(size_t bytes);

// The router plan's device buffers (kernels/cuda/router.cu moe_cuda_plan_alloc,
// in its order); sort_tmp: cub's radix-sort temp storage for T_max items.
enum { MOE_CUDA_PLAN_BUFS = 23, MOE_CUDA_ROUTER_CHUNK = 1024, MOE_CUDA_LOSS_TILE = 1024 };
void moe_cuda_plan_sizes(int T_max, int E, int k, size_t sort_tmp, size_t out[MOE_CUDA_PLAN_BUFS]);
// cub's temp storage for sorting n (uint64 key, int value) pairs: the exact
// figure when this is a CUDA build with a device (cub asks the runtime),
// otherwise an estimate (alternate keys and values plus 128 KiB of
// histograms and tile state) and *exact = false.
size_t moe_cuda_sort_tmp_bytes(int n, bool *exact);

// The CUDA MoE layer's device buffers (moe/src/moe_layer_cuda.c, in its
// order; 0: not allocated), and the layer's total with its router plan, each
// buffer rounded to the granule. With n_chunks > 1 the expert-side buffers
// hold one chunk (moe_layer_cuda_forward recomputes chunks in backward).
enum { MOE_CUDA_LAYER_BUFS = 22 };
void moe_cuda_layer_sizes(const moe_layer_config *cfg, size_t out[MOE_CUDA_LAYER_BUFS]);
size_t moe_cuda_layer_bytes(const moe_layer_config *cfg, size_t sort_tmp);
// Its expert-parallel buffers (moe/src/moe_ep_rows.c, in its order; all
// 0 when ep_size <= 1): xr, abr, hr, yr (also dyr), dxr, dhr, dabr for the
// ep_size * T_max * k rows the layer's experts may receive. Included in
// moe_cuda_layer_bytes.
enum { MOE_CUDA_EP_BUFS = 7 };
void moe_cuda_layer_ep_sizes(const moe_layer_config *cfg, size_t out[MOE_CUDA_EP_BUFS]);

// Attention on the GPU keeps the probabilities [B, Hq, T, T] and one query
// head's [B, T, T] scratch (kernels/cuda/attention.cu).
size_t moe_cuda_attention_state_floats(int B, int T, int Hq);
size_t moe_cuda_attention_scratch_floats(int B, int T, int Hq, int Hkv, int hd);

// Cut cross-entropy's device scratch (kernels/cuda/cce.cu): per-split partials
// of the forward, one [N, chunk] slab of the backward (slab: 2^24 floats
// unless set).
enum { MOE_CUDA_CCE_SPLIT_BLOCKS = 512, MOE_CUDA_CCE_BM = 128 };
size_t moe_cuda_cce_scratch_floats(int N, int V);
void moe_cuda_cce_set_slab_floats(size_t floats); // 0: the default
size_t moe_cuda_cce_slab_floats(void);

// A sizing-only table (name "cuda", alloc_size and the attention sizes; no
// ops): layouts computed with it are the CUDA table's, in any build.
extern const moe_ops moe_ops_cuda_sizes;

#ifdef __cplusplus
}
#endif

#endif
