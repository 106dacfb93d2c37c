// The CPU implementations behind moe_ops_cpu (kernels/ops.h), one file per
// concern; declared here so ops_cpu.c can fill the table and tests can name them.
#ifndef MOE_KERNELS_CPU_H
#define MOE_KERNELS_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// The CPU backend's thread pool (kernels/cpu/threads.c): moe_cpu_threads()
// starts it on first use (one thread per core of the affinity mask, at most
// MOE_NUM_THREADS) and sets OpenBLAS to one thread; parallel_for runs
// fn(ctx, i) for i in [0, n) on the pool and the caller, and returns when all
// are done. Items must not depend on which thread runs them; nested calls and
// calls from a second thread meanwhile run serially.
typedef void (*moe_cpu_task)(void *ctx, int i);
int moe_cpu_threads(void);
// 0 on any thread outside the pool, 1..threads-1 on its workers: tasks index
// per-thread scratch by it.
int moe_cpu_thread_id(void);
void moe_cpu_parallel_for(int n, moe_cpu_task fn, void *ctx);

// Row-major sgemm with explicit leading dimensions, split by rows or columns
// of C over the pool when large enough (never along K, so each element sums
// its products as the single-threaded sgemm does).
void moe_cpu_sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float *a,
                   int lda, const float *b, int ldb, float beta, float *c, int ldc);

void *moe_cpu_alloc(size_t bytes);
void moe_cpu_free(void *p);
size_t moe_cpu_alloc_size(size_t bytes);
int moe_cpu_zero(float *x, size_t n);
int moe_cpu_mul(float *out, const float *a, const float *b, size_t n);
int moe_cpu_mul_add(float *out, const float *a, const float *b, size_t n);
int moe_cpu_add(float *out, const float *x, size_t n);

int moe_cpu_matmul(float *c, const float *a, const float *b, int M, int N, int K, bool trans_a,
                   bool trans_b, float alpha, float beta);

int moe_cpu_matmul_grouped(float *c, const float *a, const float *b, size_t b_stride,
                           const int *offsets, int G, int N, int K, bool trans_b, float alpha,
                           float beta);
int moe_cpu_matmul_grouped_wgrad(float *c, size_t c_stride, const float *a, const float *b,
                                 const int *offsets, int G, int M, int N, float alpha, float beta);

int moe_cpu_swiglu_forward(float *h, const float *ab, int n, int H);
int moe_cpu_swiglu_backward(float *dab, const float *dh, const float *ab, int n, int H);

// dab = swiglu'(dh) written over ab (the values the non-inplace op adds).
int moe_cpu_swiglu_backward_inplace(float *ab, const float *dh, int n, int H);

// The MoE experts op (kernels/ops.h expert_ffn_*, kernels/cpu/moe_ffn.c).
int moe_cpu_expert_ffn_forward(float *y, float *ab, float *h, const float *x, const float *w,
                               size_t w_stride, size_t w2_offset, const int *off, const int *n,
                               int n_blocks, int E, int D, int H);
int moe_cpu_expert_ffn_backward(float *dx, float *dw, float *dw_tmp, const float *dy,
                                const float *x, float *ab, float *h, const float *w,
                                size_t w_stride, size_t w2_offset, const int *off, const int *n,
                                int n_blocks, int E, int D, int H);
// The same with its work split forced (tests: every split gives the same bits):
// 1 one item per block (one block per expert only), 2 row and weight-row parts
// in three passes, 0 chosen by the block count.
int moe_cpu_expert_ffn_backward_mode(float *dx, float *dw, float *dw_tmp, const float *dy,
                                     const float *x, float *ab, float *h, const float *w,
                                     size_t w_stride, size_t w2_offset, const int *off,
                                     const int *n, int n_blocks, int E, int D, int H, int mode);

int moe_cpu_dispatch_rows(int *row, const int *expert, const int *slot, const int *offsets, int T,
                          int k);
int moe_cpu_chunk_rows(int *crow, int *coff, const int *expert, int n, int E);
int moe_cpu_permute_forward(float *xe, const float *x, const int *row, int T, int k, int D);
int moe_cpu_permute_backward(float *dx, const float *dxe, const int *row, int T, int k, int D);
int moe_cpu_unpermute_forward(float *y, const float *ye, const int *row, const float *weight, int T,
                              int k, int D);
int moe_cpu_unpermute_backward(float *dye, float *dweight, const float *dy, const float *ye,
                               const int *row, const float *weight, int T, int k, int D);
int moe_cpu_gather_rows(float *out, const float *in, const int *idx, int n, int D);
int moe_cpu_scatter_add_rows(float *out, const float *in, const int *idx, int n, int D);

int moe_cpu_adamw(float *params, float *m, float *v, const float *grads, const uint8_t *decay,
                  size_t n, long step, float lr, float beta1, float beta2, float eps,
                  float weight_decay);
// The AdamW step on grads * grad_scale (the clipping scale), one pass.
int moe_cpu_adamw_scaled(float *params, float *m, float *v, const float *grads,
                         const uint8_t *decay, size_t n, long step, float lr, float beta1,
                         float beta2, float eps, float weight_decay, float grad_scale);
// The trainer's step (trainer/optim.c): weight decay on the n_ranges
// half-open ranges [ranges[2k], ranges[2k + 1]) (ascending, disjoint) and
// none elsewhere; m, v are float [n], or with bf16 uint16_t [n] bfloat16
// (arithmetic in float, stored rounded to nearest even). fp32 moments give
// the bits of moe_cpu_adamw_scaled with the equivalent mask.
int moe_cpu_adamw_ranged(float *params, void *m, void *v, bool bf16, const float *grads,
                         const size_t *ranges, int n_ranges, size_t n, long step, float lr,
                         float beta1, float beta2, float eps, float weight_decay, float grad_scale);
// Sum of squares in double, a fixed function of (x, n) whatever the thread
// count (chunk sums added in chunk order), so sharded norms match.
int moe_cpu_sumsq(double *sumsq, const float *x, size_t n);
int moe_cpu_scale(float *x, size_t n, float s);

#endif
