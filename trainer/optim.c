// AdamW with bias correction and decoupled weight decay, the learning-rate
// schedule and gradient clipping, over the flat buffers. The arithmetic is the
// CPU op table's (kernels/cpu/adamw.c), which the GPU kernels are checked by.
#include "moe/optim.h"
#include "kernels/cpu/cpu.h"
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
    opt->step++; // >= 1, the kernel's only failure
    (void)moe_cpu_adamw(params, opt->m, opt->v, grads, opt->decay, opt->n, opt->step, lr, beta1,
                        beta2, eps, weight_decay);
}

static float clip_scale(double norm, double max_norm) {
    if (max_norm <= 0 || norm <= max_norm || !isfinite(norm)) return 1.0f;
    return (float)(max_norm / (norm + 1e-6));
}

float moe_adamw_update_clipped(moe_adamw *opt, float *params, const float *grads, double norm,
                               double max_norm, float lr, float beta1, float beta2, float eps,
                               float weight_decay) {
    const float scale = clip_scale(norm, max_norm);
    opt->step++;
    (void)moe_cpu_adamw_scaled(params, opt->m, opt->v, grads, opt->decay, opt->n, opt->step, lr,
                               beta1, beta2, eps, weight_decay, scale);
    return scale;
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
    double s;
    (void)moe_cpu_sumsq(&s, grads, n);
    return sqrt(s);
}

float moe_grad_clip(float *grads, size_t n, double norm, double max_norm) {
    float scale = clip_scale(norm, max_norm);
    if (scale != 1.0f) (void)moe_cpu_scale(grads, n, scale);
    return scale;
}
