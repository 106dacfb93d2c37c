// Cut cross-entropy on the GPU (kernels/cuda/cce.cu), the twin of
// moe_cpu_cce_forward/backward (kernels/cpu/nn.h): the same signatures and
// semantics, with device pointers (h, W, target, losses, lse, dh, dW, scratch)
// and host scalars (mean, skipped). Compiled only when MOE_HAVE_CUDA.
#ifndef MOE_KERNELS_CCE_CUDA_H
#define MOE_KERNELS_CCE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Floats of device scratch that forward and backward need for at most N
// tokens and a vocabulary of V: per-split (max, sum) partials of the forward
// and one [N, chunk] slab of the backward's G = softmax - onehot (chunk: a
// multiple of MOE_CCE_VB columns, about 64 MiB of slab at any N), never [N, V].
size_t moe_cuda_cce_scratch_floats(int N, int V);
// Sets the slab size in floats (0: the default, 2^24); tests make it small so
// that small vocabularies still take several chunks. Not thread-safe: set it
// before any call.
void moe_cuda_cce_set_slab_floats(size_t floats);

// losses [N], lse [N] (saved for backward), *mean over targets >= 0 (-1 is
// ignored); h [N, D], W [V, D], target [N].
int moe_cuda_cce_forward(float *losses, float *lse, double *mean, const float *h, const float *W,
                         const int32_t *target, int N, int D, int V, float *scratch);
// dh [N, D] += G W, dW [V, D] += G^T h with G = (softmax - onehot) * dloss /
// n_valid, recomputed from lse. With filter_eps > 0, a [MOE_CCE_NB,
// MOE_CCE_VB] tile of G (the CPU's tiles) whose probabilities are all below
// filter_eps and that holds no target is dropped, exactly as on the CPU;
// *skipped (when not NULL) counts the dropped tiles.
int moe_cuda_cce_backward(float *dh, float *dW, const float *h, const float *W,
                          const int32_t *target, const float *lse, int N, int D, int V, float dloss,
                          float filter_eps, float *scratch, long *skipped);

#ifdef __cplusplus
}
#endif

#endif
