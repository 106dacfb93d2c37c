// AdamW with bias correction and decoupled weight decay, the learning-rate
// schedule and gradient clipping, over the flat buffers. The arithmetic is the
// CPU op table's (kernels/cpu/adamw.c), which the GPU kernels are checked by.
#include "moe/optim.h"
#include "kernels/cpu/cpu.h"
#include "moe/alloc.h"
#include "moe/bf16.h"
#include "moe/error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

int moe_adamw_state_parse(const char *name, moe_adamw_state *out) {
    if (!strcmp(name, "fp32"))
        *out = MOE_ADAMW_FP32;
    else if (!strcmp(name, "bf16"))
        *out = MOE_ADAMW_BF16;
    else
        return moe_fail(MOE_EINVAL, "train.optimizer_state = '%s': expected fp32 or bf16", name);
    return 0;
}

size_t moe_adamw_state_size(moe_adamw_state state) {
    return state == MOE_ADAMW_BF16 ? sizeof(uint16_t) : sizeof(float);
}

static bool decays(const moe_param_view *v, bool decay_all) {
    return decay_all || (!ends_with(v->name, "norm.weight") && !strstr(v->name, "embed_tokens") &&
                         !strstr(v->name, "task_embedding"));
}

int moe_adamw_init_state(moe_adamw *opt, const moe_param_table *table, bool decay_all,
                         moe_adamw_state state) {
    memset(opt, 0, sizeof *opt);
    const size_t n = table->numel, es = moe_adamw_state_size(state);
    opt->state = state;
    void *m = moe_calloc(n ? n : 1, es), *v = moe_calloc(n ? n : 1, es);
    // A handful of ranges (at most one per view): untracked, like names.
    opt->decay = malloc(sizeof(size_t) * 2 * (size_t)(table->count ? table->count : 1));
    if (state == MOE_ADAMW_BF16)
        opt->m16 = m, opt->v16 = v;
    else
        opt->m = m, opt->v = v;
    if (!m || !v || !opt->decay) {
        moe_mfree(m), moe_mfree(v);
        free(opt->decay);
        memset(opt, 0, sizeof *opt);
        return moe_fail(MOE_ENOMEM, "optimizer state for %zu parameters: out of memory", n);
    }
    opt->n = n;
    // Views in offset order; a decayed view starting where the last range
    // ends extends it.
    for (int i = 0; i < table->count; i++) {
        const moe_param_view *pv = &table->views[i];
        if (!decays(pv, decay_all) || !pv->numel) continue;
        const int k = opt->n_decay;
        if (k && opt->decay[2 * k - 1] == pv->offset)
            opt->decay[2 * k - 1] = pv->offset + pv->numel;
        else {
            opt->decay[2 * k] = pv->offset, opt->decay[2 * k + 1] = pv->offset + pv->numel;
            opt->n_decay++;
        }
    }
    return 0;
}

int moe_adamw_init(moe_adamw *opt, const moe_param_table *table, bool decay_all) {
    return moe_adamw_init_state(opt, table, decay_all, MOE_ADAMW_FP32);
}

void moe_adamw_free(moe_adamw *opt) {
    moe_mfree(opt->m);
    moe_mfree(opt->v);
    moe_mfree(opt->m16);
    moe_mfree(opt->v16);
    free(opt->decay);
    memset(opt, 0, sizeof *opt);
}

void *moe_adamw_moment(const moe_adamw *opt, int which) {
    if (opt->state == MOE_ADAMW_BF16) return which ? opt->v16 : opt->m16;
    return which ? opt->v : opt->m;
}

void moe_adamw_moment_get(const moe_adamw *opt, int which, size_t off, size_t count, float *out) {
    if (opt->state != MOE_ADAMW_BF16) {
        memcpy(out, (which ? opt->v : opt->m) + off, count * sizeof(float));
        return;
    }
    const uint16_t *h = (which ? opt->v16 : opt->m16) + off;
    for (size_t i = 0; i < count; i++)
        out[i] = moe_bf16_to_float(h[i]);
}

void moe_adamw_moment_set(moe_adamw *opt, int which, size_t off, size_t count, const float *in) {
    if (opt->state != MOE_ADAMW_BF16) {
        memcpy((which ? opt->v : opt->m) + off, in, count * sizeof(float));
        return;
    }
    uint16_t *h = (which ? opt->v16 : opt->m16) + off;
    for (size_t i = 0; i < count; i++)
        h[i] = moe_bf16_round(in[i]);
}

void moe_adamw_decay_mask(const moe_adamw *opt, unsigned char *mask) {
    memset(mask, 0, opt->n);
    for (int k = 0; k < opt->n_decay; k++)
        memset(mask + opt->decay[2 * k], 1, opt->decay[2 * k + 1] - opt->decay[2 * k]);
}

static void update(moe_adamw *opt, float *params, const float *grads, float lr, float beta1,
                   float beta2, float eps, float weight_decay, float scale) {
    opt->step++; // >= 1, the kernel's only failure
    (void)moe_cpu_adamw_ranged(params, moe_adamw_moment(opt, 0), moe_adamw_moment(opt, 1),
                               opt->state == MOE_ADAMW_BF16, grads, opt->decay, opt->n_decay,
                               opt->n, opt->step, lr, beta1, beta2, eps, weight_decay, scale);
}

void moe_adamw_update(moe_adamw *opt, float *params, const float *grads, float lr, float beta1,
                      float beta2, float eps, float weight_decay) {
    update(opt, params, grads, lr, beta1, beta2, eps, weight_decay, 1.0f);
}

static float clip_scale(double norm, double max_norm) {
    if (max_norm <= 0 || norm <= max_norm || !isfinite(norm)) return 1.0f;
    return (float)(max_norm / (norm + 1e-6));
}

float moe_adamw_update_clipped(moe_adamw *opt, float *params, const float *grads, double norm,
                               double max_norm, float lr, float beta1, float beta2, float eps,
                               float weight_decay) {
    const float scale = clip_scale(norm, max_norm);
    update(opt, params, grads, lr, beta1, beta2, eps, weight_decay, scale);
    return scale;
}

// In double, scaling lr_max by a fraction <= 1: the config allows lr_max up to
// FLT_MAX, and lr_max * (step + 1) first, in float, overflowed to inf.
float moe_lr_schedule(int step, int total, int warmup, float lr_max, float min_ratio) {
    if (step < warmup) return (float)(lr_max * ((double)step + 1) / (double)warmup);
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
