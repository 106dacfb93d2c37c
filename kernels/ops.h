// The op table of the compute backends (ggml-style): every op the MoE layer
// and the decoder need, as function pointers with one CPU implementation
// (kernels/cpu/, the reference, OpenBLAS for GEMMs) and one CUDA implementation
// (kernels/cuda/, cuBLAS for GEMMs) with the same signatures and semantics.
// All float/int pointers are backend memory (host for CPU, device for CUDA);
// scalar results (double *mean, double *sumsq) are host memory.
#ifndef MOE_KERNELS_OPS_H
#define MOE_KERNELS_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Conventions (llm.c): outputs first; backward ops ADD into their d* outputs
// (the caller zeroes them); every op returns 0 or a negative MOE_E* code; no
// op allocates. Matrices are row-major and contiguous.
//
// Index arrays used by the permute ops: row [T*k] gives, for token t and
// choice j, the row of the expert-contiguous buffer that holds the pair, or -1
// when the assignment was dropped. Rows of kept pairs are distinct.
typedef struct moe_ops {
    const char *name; // "cpu", "cuda"

    // Backend memory (buffers are suitably aligned for the backend's GEMM).
    void *(*alloc)(size_t bytes); // NULL on failure
    void (*free)(void *p);
    size_t (*alloc_size)(size_t bytes); // bytes alloc reserves for a request (rounding)
    int (*zero)(float *x, size_t n);

    // c[M,N] = alpha * op(a) @ op(b) + beta * c, op(a) [M,K], op(b) [K,N].
    // trans_a: a is stored [K,M]; trans_b: b is stored [N,K]. beta = 0 ignores
    // the old contents of c (NaN included); M, N or K may be 0.
    int (*matmul)(float *c, const float *a, const float *b, int M, int N, int K, bool trans_a,
                  bool trans_b, float alpha, float beta);

    // Grouped GEMMs over the G row segments of an expert-contiguous buffer,
    // segment g = rows [offsets[g], offsets[g+1]) (offsets: host memory, G+1
    // entries), n_g rows; a segment with n_g = 0 is skipped (c_g untouched).
    // Expert weights are b_g = b + g * b_stride (or c_g = c + g * c_stride).
    // matmul_grouped: c_g [n_g, N] = alpha * a_g [n_g, K] @ op(b_g) + beta * c_g,
    //   op(b_g) = b_g^T with b_g [N, K] when trans_b, else b_g [K, N].
    int (*matmul_grouped)(float *c, const float *a, const float *b, size_t b_stride,
                          const int *offsets, int G, int N, int K, bool trans_b, float alpha,
                          float beta);
    // matmul_grouped_wgrad: c_g [M, N] = alpha * a_g^T @ b_g + beta * c_g with
    //   a_g [n_g, M], b_g [n_g, N] (weight gradients: dW_g += dY_g^T X_g).
    //   Both skip empty segments (n_g = 0): their c_g is left as it is, whatever beta.
    int (*matmul_grouped_wgrad)(float *c, size_t c_stride, const float *a, const float *b,
                                const int *offsets, int G, int M, int N, float alpha, float beta);

    // SwiGLU on the fused projection ab [n, 2H] (row i = [a_i | b_i], a = w1 x,
    // b = w3 x): h [n, H] = silu(a) * b, silu(a) = a * sigmoid(a).
    int (*swiglu_forward)(float *h, const float *ab, int n, int H);
    // dab [n, 2H] += (dh * b * silu'(a) | dh * silu(a)).
    int (*swiglu_backward)(float *dab, const float *dh, const float *ab, int n, int H);

    // The MoE layer's experts as one op, so a backend can schedule the blocks
    // together (NULL: the layer runs them one by one through matmul and
    // swiglu). Block b is rows [off[b], off[b] + n[b]) of the expert-side
    // buffers (off, n: host memory; n_blocks a multiple of E), computed with
    // expert b % E's weights: w + (b % E) * w_stride holds [w1; w3] [2H, D],
    // then w2 [D, H] at w2_offset. Rows outside every block are not touched.
    // Forward: ab = x [w1; w3]^T [rows, 2H], h = swiglu(ab), y = h w2^T [rows, D].
    int (*expert_ffn_forward)(float *y, float *ab, float *h, const float *x, const float *w,
                              size_t w_stride, size_t w2_offset, const int *off, const int *n,
                              int n_blocks, int E, int D, int H);
    // Backward: dx (overwritten) = dab [w1; w3] with dab = swiglu'(dy w2) on
    // ab; weight gradients dw (layout of w) += dy^T h and dab^T x, over an
    // expert's blocks in block order; with several blocks per expert each
    // block's product is formed in dw_tmp [3 H D] (layout of one expert) and
    // then added. ab and h are consumed: they end up holding dab and dh.
    int (*expert_ffn_backward)(float *dx, float *dw, float *dw_tmp, const float *dy, const float *x,
                               float *ab, float *h, const float *w, size_t w_stride,
                               size_t w2_offset, const int *off, const int *n, int n_blocks, int E,
                               int D, int H);

    // row [T*k] = expert >= 0 ? offsets[expert] + slot : -1 (from a moe_plan).
    int (*dispatch_rows)(int *row, const int *expert, const int *slot, const int *offsets, int T,
                         int k);
    // Rows of one mini-sequence chunk's n plan entries (expert [n], -1 for a
    // dropped one; values < E): coff [E + 1] = the chunk's expert segment
    // offsets, crow [n] = coff[e] + the entry's rank among the chunk's entries
    // of expert e in entry order (token order), -1 for a dropped entry.
    int (*chunk_rows)(int *crow, int *coff, const int *expert, int n, int E);
    // Gather tokens into the expert-contiguous buffer: xe[row[t*k+j]] = x[t].
    int (*permute_forward)(float *xe, const float *x, const int *row, int T, int k, int D);
    // dx[t] += sum_j dxe[row[t*k+j]] over kept j.
    int (*permute_backward)(float *dx, const float *dxe, const int *row, int T, int k, int D);
    // Weighted combine: y[t] = sum_j weight[t*k+j] * ye[row[t*k+j]] over kept j
    // (overwrites y; a token with every choice dropped gets 0).
    int (*unpermute_forward)(float *y, const float *ye, const int *row, const float *weight, int T,
                             int k, int D);
    // dye[row] += weight * dy[t]; dweight[t*k+j] += dot(dy[t], ye[row]) (kept j).
    int (*unpermute_backward)(float *dye, float *dweight, const float *dy, const float *ye,
                              const int *row, const float *weight, int T, int k, int D);

    // out[i] = in[idx[i]] for i < n (rows of width D); idx[i] < 0 gives 0.
    int (*gather_rows)(float *out, const float *in, const int *idx, int n, int D);
    // out[idx[i]] += in[i] for i < n (rows of width D); idx[i] < 0 is skipped.
    int (*scatter_add_rows)(float *out, const float *in, const int *idx, int n, int D);

    // out[i] = a[i] * b[i] (out may alias a or b).
    int (*mul)(float *out, const float *a, const float *b, size_t n);
    // out[i] += a[i] * b[i].
    int (*mul_add)(float *out, const float *a, const float *b, size_t n);
    // out[i] += x[i] (residual connections).
    int (*add)(float *out, const float *x, size_t n);

    // ---- decoder ops: semantics and shapes as kernels/cpu/nn.h ---------------------
    int (*rmsnorm_forward)(float *out, float *rstd, const float *x, const float *w, int N, int C,
                           float eps);
    int (*rmsnorm_backward)(float *dx, float *dw, const float *dout, const float *x, const float *w,
                            const float *rstd, int N, int C);
    int (*rope_forward)(float *out, const float *x, int B, int T, int H, int hd, float theta);
    int (*rope_backward)(float *dx, const float *dout, int B, int T, int H, int hd, float theta);
    int (*attention_forward)(float *out, float *att, float *scratch, const float *q, const float *k,
                             const float *v, int B, int T, int Hq, int Hkv, int hd);
    // att is backend-private saved state (CPU: row log-sum-exp; CUDA: the
    // probabilities); out is the forward's output.
    int (*attention_backward)(float *dq, float *dk, float *dv, float *datt, const float *dout,
                              const float *out, const float *att, const float *q, const float *k,
                              const float *v, int B, int T, int Hq, int Hkv, int hd);
    // Floats the caller provides for att (kept from forward to backward, one
    // per layer) and for the scratch (forward's scratch, backward's datt; one
    // buffer, free between calls): the backend's own sizes, so the model (and
    // moe plan's memory model) allocate no more than it needs and the backend
    // allocates nothing. CPU: att [B, Hq, T], scratch one slot per pool thread
    // (tiles, per-head copies: O(T hd)) and with GQA per-head dK, dV partials
    // [2, B, Hq, T, hd]; CUDA: att [B, Hq, T, T], datt [B, T, T], forward none.
    size_t (*attention_state_floats)(int B, int T, int Hq);
    size_t (*attention_scratch_floats)(int B, int T, int Hq, int Hkv, int hd);
    // tok/target are backend memory; an id outside the vocabulary fails with
    // the same message on both (CUDA copies the ids to the host to check them).
    int (*embedding_forward)(float *out, const int32_t *tok, const float *table, int N, int C,
                             int V);
    int (*embedding_backward)(float *dtable, const float *dout, const int32_t *tok, int N, int C);
    int (*crossentropy_forward)(float *losses, double *mean, const float *logits,
                                const int32_t *target, int N, int V);
    int (*crossentropy_backward)(float *dlogits, const float *logits, const int32_t *target, int N,
                                 int V, float dloss);

    // ---- optimizer ------------------------------------------------------------------
    // One AdamW step (trainer/optim.c semantics) over n parameters: step is the
    // 1-based step count after this update (bias correction), decay[i] != 0
    // applies weight_decay to parameter i.
    int (*adamw)(float *params, float *m, float *v, const float *grads, const uint8_t *decay,
                 size_t n, long step, float lr, float beta1, float beta2, float eps,
                 float weight_decay);
    // *sumsq = sum_i x[i]^2 in double (the gradient norm is its square root).
    int (*sumsq)(double *sumsq, const float *x, size_t n);
    // x[i] *= s (gradient clipping).
    int (*scale)(float *x, size_t n, float s);
} moe_ops;

extern const moe_ops moe_ops_cpu;
#ifdef MOE_HAVE_CUDA
// kernels/cuda/: fp32 everywhere (the equivalence tests), and the same ops
// with bf16 tensor-core GEMMs (fp32 storage and accumulation, inputs rounded to
// bf16 inside cuBLAS: CUBLAS_COMPUTE_32F_FAST_16BF).
extern const moe_ops moe_ops_cuda;
extern const moe_ops moe_ops_cuda_bf16;
#endif

#ifdef __cplusplus
}
#endif

#endif
