// The CUDA implementations behind moe_ops_cuda (kernels/ops.h), one file per
// concern; declared here so ops_cuda.cu can fill the table. Signatures and
// semantics are those of the CPU twins in kernels/cpu/.
#ifndef MOE_KERNELS_OPS_CUDA_H
#define MOE_KERNELS_OPS_CUDA_H

#include "moe/cuda_sizes.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void *moe_cuda_alloc(size_t bytes);
void moe_cuda_free(void *p);
size_t moe_cuda_alloc_size(size_t bytes);
int moe_cuda_zero(float *x, size_t n);
int moe_cuda_mul(float *out, const float *a, const float *b, size_t n);
int moe_cuda_mul_add(float *out, const float *a, const float *b, size_t n);
int moe_cuda_add(float *out, const float *x, size_t n);

int moe_cuda_matmul(float *c, const float *a, const float *b, int M, int N, int K, bool trans_a,
                    bool trans_b, float alpha, float beta);
int moe_cuda_matmul_bf16(float *c, const float *a, const float *b, int M, int N, int K,
                         bool trans_a, bool trans_b, float alpha, float beta);

int moe_cuda_matmul_grouped(float *c, const float *a, const float *b, size_t b_stride,
                            const int *offsets, int G, int N, int K, bool trans_b, float alpha,
                            float beta);
int moe_cuda_matmul_grouped_wgrad(float *c, size_t c_stride, const float *a, const float *b,
                                  const int *offsets, int G, int M, int N, float alpha, float beta);
int moe_cuda_matmul_grouped_bf16(float *c, const float *a, const float *b, size_t b_stride,
                                 const int *offsets, int G, int N, int K, bool trans_b, float alpha,
                                 float beta);
int moe_cuda_matmul_grouped_wgrad_bf16(float *c, size_t c_stride, const float *a, const float *b,
                                       const int *offsets, int G, int M, int N, float alpha,
                                       float beta);

int moe_cuda_swiglu_forward(float *h, const float *ab, int n, int H);
int moe_cuda_swiglu_backward(float *dab, const float *dh, const float *ab, int n, int H);

int moe_cuda_dispatch_rows(int *row, const int *expert, const int *slot, const int *offsets, int T,
                           int k);
int moe_cuda_chunk_rows(int *crow, int *coff, const int *expert, int n, int E);
int moe_cuda_permute_forward(float *xe, const float *x, const int *row, int T, int k, int D);
int moe_cuda_permute_backward(float *dx, const float *dxe, const int *row, int T, int k, int D);
int moe_cuda_unpermute_forward(float *y, const float *ye, const int *row, const float *weight,
                               int T, int k, int D);
int moe_cuda_unpermute_backward(float *dye, float *dweight, const float *dy, const float *ye,
                                const int *row, const float *weight, int T, int k, int D);
int moe_cuda_gather_rows(float *out, const float *in, const int *idx, int n, int D);
int moe_cuda_scatter_add_rows(float *out, const float *in, const int *idx, int n, int D);

int moe_cuda_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N, int C,
                             float eps);
int moe_cuda_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x,
                              const float *w, const float *rstd, int N, int C);
int moe_cuda_rope_forward(float *out, const float *x, int B, int T, int H, int hd, float theta);
int moe_cuda_rope_backward(float *dx, const float *dout, int B, int T, int H, int hd, float theta);
int moe_cuda_attention_forward(float *out, float *att, float *scratch, const float *q,
                               const float *k, const float *v, int B, int T, int Hq, int Hkv,
                               int hd);
int moe_cuda_attention_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                                const float *out, const float *att, const float *q, const float *k,
                                const float *v, int B, int T, int Hq, int Hkv, int hd);
// att: the probabilities [B, Hq, T, T]; datt: one head h at a time [B, T, T]
// (their sizes: moe/cuda_sizes.h).
int moe_cuda_embedding_forward(float *out, const int32_t *tok, const float *table, int N, int C,
                               int V);
int moe_cuda_embedding_backward(float *dtable, const float *dout, const int32_t *tok, int N, int C);
int moe_cuda_crossentropy_forward(float *losses, double *mean, const float *logits,
                                  const int32_t *target, int N, int V);
int moe_cuda_crossentropy_backward(float *dlogits, const float *logits, const int32_t *target,
                                   int N, int V, float dloss);

int moe_cuda_adamw(float *params, float *m, float *v, const float *grads, const uint8_t *decay,
                   size_t n, long step, float lr, float beta1, float beta2, float eps,
                   float weight_decay);
int moe_cuda_sumsq(double *sumsq, const float *x, size_t n);
int moe_cuda_scale(float *x, size_t n, float s);

#ifdef __cplusplus
}
#endif

#endif
