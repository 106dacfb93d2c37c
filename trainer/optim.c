// AdamW with bias correction and decoupled weight decay, the learning-rate
// schedule and gradient clipping. Everything is elementwise over the flat
// buffers, so the same code serves every parameter.
#include "moe/optim.h"
#include "moe/alloc.h"
#include "moe/error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

int moe_adamw_init(moe_adamw *opt, const moe_param_table *table, bool decay_all) {
    memset(opt, 0, sizeof *opt);
    size_t n = table->numel;
    opt->m = moe_calloc(n ? n : 1, sizeof(float));
    opt->v = moe_calloc(n ? n : 1, sizeof(float));
    opt->decay = moe_calloc(n ? n : 1, 1);
    if (!opt->m || !opt->v || !opt->decay) {
        moe_adamw_free(opt);
        return moe_fail(MOE_ENOMEM, "optimizer state for %zu parameters: out of memory", n);
    }
    opt->n = n;
    for (int i = 0; i < table->count; i++) {
        const moe_param_view *v = &table->views[i];
        int decay =
            decay_all || (!ends_with(v->name, "norm.weight") && !strstr(v->name, "embed_tokens") &&
                          !strstr(v->name, "task_embedding"));
        memset(opt->decay + v->offset, decay, v->numel);
    }
    return 0;
}

void moe_adamw_free(moe_adamw *opt) {
    moe_mfree(opt->m);
    moe_mfree(opt->v);
    moe_mfree(opt->decay);
    memset(opt, 0, sizeof *opt);
}

void moe_adamw_update(moe_adamw *opt, float *params, const float *grads, float lr, float beta1,
                      float beta2, float eps, float weight_decay) {
    opt->step++;
    double bc1 = 1.0 - pow(beta1, (double)opt->step), bc2 = 1.0 - pow(beta2, (double)opt->step);
    for (size_t i = 0; i < opt->n; i++) {
        float g = grads[i];
        float m = opt->m[i] = beta1 * opt->m[i] + (1.0f - beta1) * g;
        float v = opt->v[i] = beta2 * opt->v[i] + (1.0f - beta2) * g * g;
        float mhat = (float)(m / bc1), vhat = (float)(v / bc2);
        float wd = opt->decay[i] ? weight_decay : 0.0f;
        params[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * params[i]);
    }
}

float moe_lr_schedule(int step, int total, int warmup, float lr_max, float min_ratio) {
    if (step < warmup) return lr_max * (float)(step + 1) / (float)warmup;
    if (total <= warmup) return lr_max;
    double progress = (double)(step - warmup) / (double)(total - warmup);
    if (progress > 1.0) progress = 1.0;
    double cosine = 0.5 * (1.0 + cos(M_PI * progress));
    return (float)(lr_max * (min_ratio + (1.0 - min_ratio) * cosine));
}

double moe_grad_norm(const float *grads, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)grads[i] * grads[i];
    return sqrt(s);
}

float moe_grad_clip(float *grads, size_t n, double norm, double max_norm) {
    if (max_norm <= 0 || norm <= max_norm || !isfinite(norm)) return 1.0f;
    float scale = (float)(max_norm / (norm + 1e-6));
    for (size_t i = 0; i < n; i++)
        grads[i] *= scale;
    return scale;
}
