// AdamW (Loshchilov & Hutter, arXiv 1711.05101) over the flat parameter
// buffer, with per-view weight-decay masks, warmup + cosine learning rate,
// and global-norm gradient clipping.
#ifndef MOE_OPTIM_H
#define MOE_OPTIM_H

#include "moe/params.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct {
    size_t n;
    float *m, *v;         // first and second moments [n]
    unsigned char *decay; // [n] 1 where weight decay applies
    long step;            // updates applied
} moe_adamw;

// decay: a view gets weight decay unless its name ends in "norm.weight" or it
// is an embedding (embed_tokens, task_embedding), the GPT-2/llm.c rule;
// decay_all (train.decay_all) gives every view weight decay.
int moe_adamw_init(moe_adamw *opt, const moe_param_table *table, bool decay_all);
void moe_adamw_free(moe_adamw *opt);
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
