// AdamW (Loshchilov & Hutter, arXiv 1711.05101) over the flat parameter
// buffer, with per-view weight decay, fp32 or bf16 moments (train.optimizer_state),
// warmup + cosine learning rate, and global-norm gradient clipping.
#ifndef MOE_OPTIM_H
#define MOE_OPTIM_H

#include "moe/params.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// How the moments are stored. bf16 halves their memory (4 instead of 8 bytes
// per parameter) and the update's traffic; the arithmetic stays float and
// each stored value is rounded to nearest even (moe/bf16.h).
typedef enum { MOE_ADAMW_FP32 = 0, MOE_ADAMW_BF16 = 1 } moe_adamw_state;

typedef struct {
    size_t n;
    moe_adamw_state state;
    float *m, *v;        // first and second moments [n] (fp32; NULL with bf16)
    uint16_t *m16, *v16; // the same as bfloat16 [n] (bf16; NULL with fp32)
    // Weight decay applies on [decay[2k], decay[2k + 1]) for k < n_decay
    // (ascending, disjoint; adjacent decayed views merged) and nowhere else:
    // decay is per view, so the update reads no per-parameter mask.
    size_t *decay;
    int n_decay;
    long step; // updates applied
} moe_adamw;

// decay: a view gets weight decay unless its name ends in "norm.weight" or it
// is an embedding (embed_tokens, task_embedding), the GPT-2/llm.c rule;
// decay_all (train.decay_all) gives every view weight decay. fp32 moments.
int moe_adamw_init(moe_adamw *opt, const moe_param_table *table, bool decay_all);
// The same with the moments stored as state says.
int moe_adamw_init_state(moe_adamw *opt, const moe_param_table *table, bool decay_all,
                         moe_adamw_state state);
// train.optimizer_state's value ("fp32" | "bf16"); MOE_EINVAL naming the key otherwise.
int moe_adamw_state_parse(const char *name, moe_adamw_state *out);
// Bytes per stored moment element: 4 (fp32) or 2 (bf16).
size_t moe_adamw_state_size(moe_adamw_state state);
void moe_adamw_free(moe_adamw *opt);
// Moment which (0: m, 1: v) as stored: float * or uint16_t *.
void *moe_adamw_moment(const moe_adamw *opt, int which);
// Elements [off, off + count) of moment which as floats (exact), and their
// assignment from floats (rounded to nearest even with bf16).
void moe_adamw_moment_get(const moe_adamw *opt, int which, size_t off, size_t count, float *out);
void moe_adamw_moment_set(moe_adamw *opt, int which, size_t off, size_t count, const float *in);
// The decay ranges as a byte mask [n] (1: decayed), for a kernel that takes one.
void moe_adamw_decay_mask(const moe_adamw *opt, unsigned char *mask);
void moe_adamw_update(moe_adamw *opt, float *params, const float *grads, float lr, float beta1,
                      float beta2, float eps, float weight_decay);
// Clipping and the update in one pass: the step on grads scaled as
// moe_grad_clip(grads, n, norm, max_norm) would scale them (grads are left
// as they are); equal bit for bit to clip-then-update. Returns the scale.
float moe_adamw_update_clipped(moe_adamw *opt, float *params, const float *grads, double norm,
                               double max_norm, float lr, float beta1, float beta2, float eps,
                               float weight_decay);

// lr at step (0-based): linear warmup to lr_max over warmup steps, then cosine
// to lr_max * min_ratio at `total`.
float moe_lr_schedule(int step, int total, int warmup, float lr_max, float min_ratio);

// Global L2 norm of grads [n] (double accumulation).
double moe_grad_norm(const float *grads, size_t n);
// Scales grads so that their norm is at most max_norm (0: no clipping);
// returns the scale applied (1 if none).
float moe_grad_clip(float *grads, size_t n, double norm, double max_norm);

#endif
