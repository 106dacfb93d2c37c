// CPU reference ops of the decoder (RMSNorm, RoPE, causal GQA attention,
// embedding, cross-entropy), forward and backward side by side. Conventions as
// kernels/ops.h: outputs first, backward ADDS into d* buffers, no allocation
// (scratch comes from the caller), 0 or a negative MOE_E* code.
#ifndef MOE_KERNELS_CPU_NN_H
#define MOE_KERNELS_CPU_NN_H

#include <stddef.h>
#include <stdint.h>

// out [N, C] = x * rstd * w, rstd [N] = 1 / sqrt(mean(x^2) + eps), fp32.
int moe_cpu_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N, int C,
                            float eps);
int moe_cpu_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x,
                             const float *w, const float *rstd, int N, int C);

// Rotary embedding, Hugging Face rotate-half convention: dimension i pairs
// with i + hd/2, angle = pos * theta^(-2i/hd). x [B*T, H, hd], pos = row % T.
// In place is allowed (out == x).
int moe_cpu_rope_forward(float *out, const float *x, int B, int T, int H, int hd, float theta);
int moe_cpu_rope_backward(float *dx, const float *dout, int B, int T, int H, int hd, float theta);
// The forward at explicit positions: row n of x [N, H, hd] sits at pos[n]
// (KV-cache decoding); the same rotation bit for bit as moe_cpu_rope_forward.
int moe_cpu_rope_at(float *out, const float *x, const int *pos, int N, int H, int hd, float theta);

// Causal self-attention with grouped-query heads: q [B, T, Hq, hd],
// k, v [B, T, Hkv, hd] (Hq % Hkv == 0; query head h reads kv head h / (Hq/Hkv)).
// out [B, T, Hq, hd]; att [B, Hq, T] is the state saved for backward,
// backend-specific: the log-sum-exp of each query row's scaled scores (the
// probabilities are recomputed from it). scratch holds the tiles:
// moe_cpu_attention_scratch_floats(B, T, Hq, Hkv, hd) floats.
int moe_cpu_attention_forward(float *out, float *att, float *scratch, const float *q,
                              const float *k, const float *v, int B, int T, int Hq, int Hkv,
                              int hd);
// Floats of att (B * Hq * T) and of the scratch of forward and backward (its
// datt): one slot per pool thread (tiles, a head's transposed copies: O(T hd))
// and, with GQA, each query head's dK, dV partials (2 B Hq T hd), so the
// caller's planned buffers hold it all.
size_t moe_cpu_attention_state_floats(int B, int T, int Hq);
size_t moe_cpu_attention_scratch_floats(int B, int T, int Hq, int Hkv, int hd);
// y[i] = exp(x[i]) for x[i] <= 0 by the 8-lane polynomial the attention
// softmax uses (within 2 ulp; x < -87 gives 0), exposed so tests can bound it.
void moe_cpu_exp_vec(float *y, const float *x, size_t n);
// One query row against a KV cache (incremental decoding): q [Hq, hd] of the
// token at position pos attends to keys/values 0..pos of kc, vc [>= pos+1,
// Hkv, hd]; out [Hq, hd]; scores [pos + 1] is scratch. The softmax is the
// forward's (max-subtracted, double sum).
int moe_cpu_attention_cached(float *out, float *scores, const float *q, const float *kc,
                             const float *vc, int pos, int Hq, int Hkv, int hd);
// out is the forward's output (D = rowsum(dout * out) of FlashAttention-2);
// datt is the scratch, as the forward's.
int moe_cpu_attention_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                               const float *out, const float *att, const float *q, const float *k,
                               const float *v, int B, int T, int Hq, int Hkv, int hd);

// out [N, C] = table[tok[n]]; tokens are checked against V.
int moe_cpu_embedding_forward(float *out, const int32_t *tok, const float *table, int N, int C,
                              int V);
int moe_cpu_embedding_backward(float *dtable, const float *dout, const int32_t *tok, int N, int C);

// Mean cross-entropy over targets >= 0 (target -1 is ignored). losses [N] gets
// the per-token loss (0 where ignored). logits [N, V].
int moe_cpu_crossentropy_forward(float *losses, double *mean, const float *logits,
                                 const int32_t *target, int N, int V);
// dlogits [N, V] += dloss * (softmax - onehot) / n_valid.
int moe_cpu_crossentropy_backward(float *dlogits, const float *logits, const int32_t *target, int N,
                                  int V, float dloss);

// Cut cross-entropy: the same mean loss as crossentropy over logits = h @ W^T
// (h [N, D], W [V, D]) without materialising [N, V]; scratch holds one
// [MOE_CCE_NB, MOE_CCE_VB] tile (moe_cpu_cce_scratch_floats). lse [N] is saved
// for backward. Backward ADDS into dh [N, D] and dW [V, D], skipping tiles
// whose probabilities are all below filter_eps (0: no filtering); skipped
// counts them when not NULL.
#define MOE_CCE_NB 64
#define MOE_CCE_VB 512
size_t moe_cpu_cce_scratch_floats(void);
int moe_cpu_cce_forward(float *losses, float *lse, double *mean, const float *h, const float *W,
                        const int32_t *target, int N, int D, int V, float *scratch);
int moe_cpu_cce_backward(float *dh, float *dW, const float *h, const float *W,
                         const int32_t *target, const float *lse, int N, int D, int V, float dloss,
                         float filter_eps, float *scratch, long *skipped);

#endif
