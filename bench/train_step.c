// Training-step benchmark: tokens/s of a config (default configs/tiny.json)
// and the share of step time in attention (its norm, projections, RoPE and
// the attention kernel), MoE experts, router + permute, LM head + loss,
// optimizer (gradient norm + fused clip/AdamW; optimizer_norm: the norm
// pass alone) and the rest; the CPU time split into user and system, and
// context switches (getrusage over the measured steps, all threads). One JSON line; --machine NAME
// adds it.
//
// --stream-floor replaces the AdamW update by a pass that moves the same
// bytes over the same chunks and threads (fp32 moments: reads parameters,
// gradients and both moments and writes parameters and moments back
// unchanged, one multiply-add by zero each), so the optimizer's time less the
// norm pass gives the update's memory floor inside a real step. The
// parameters never change, so the routing (and the tokens capacity drops)
// differs from a training run: compare the milliseconds, not the shares.
//   build/bench/train_step [CONFIG] [--steps N] [--machine NAME] [--stream-floor]
#include "kernels/cpu/cpu.h"
#include "moe/config.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/model.h"
#include "moe/optim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

typedef struct {
    float *p, *m, *v;
    const float *g;
    size_t n;
} stream_job;

enum { STREAM_CHUNK = 1 << 15 }; // the update's chunk (kernels/cpu/adamw.c)

static void stream_chunk(void *ctx, int c) {
    const stream_job *J = ctx;
    const size_t i0 = (size_t)c * STREAM_CHUNK;
    const size_t i1 = J->n - i0 < STREAM_CHUNK ? J->n : i0 + STREAM_CHUNK;
    float *restrict p = J->p, *restrict m = J->m, *restrict v = J->v;
    const float *restrict g = J->g;
    for (size_t i = i0; i < i1; i++) {
        const float z = 0.0f * g[i];
        p[i] += z, m[i] += z, v[i] += z;
    }
}

// fp32 moments only (the default state).
static void stream_floor(moe_adamw *opt, float *params, const float *grads, size_t n) {
    stream_job J = {.p = params,
                    .m = moe_adamw_moment(opt, 0),
                    .v = moe_adamw_moment(opt, 1),
                    .g = grads,
                    .n = n};
    moe_cpu_parallel_for((int)((n + STREAM_CHUNK - 1) / STREAM_CHUNK), stream_chunk, &J);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int main(int argc, char **argv) {
    const char *config = "configs/tiny.json";
    const char *machine = "";
    int steps = 30, warmup = 5;
    bool floor_only = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--machine") && i + 1 < argc)
            machine = argv[++i];
        else if (!strcmp(argv[i], "--stream-floor"))
            floor_only = true;
        else
            config = argv[i];
    }
    moe_config cfg;
    moe_config_default(&cfg);
    moe_data d;
    moe_model m;
    moe_adamw opt;
    if (moe_config_load(&cfg, NULL, config) || moe_config_check(&cfg, NULL) ||
        moe_data_open(&d, &cfg) || moe_model_init(&m, &cfg, d.B, d.T, d.n_tasks) ||
        moe_adamw_init_state(&opt, &m.table, cfg.train.decay_all,
                             strcmp(cfg.train.optimizer_state, "bf16") ? MOE_ADAMW_FP32
                                                                       : MOE_ADAMW_BF16)) {
        fprintf(stderr, "train_step: %s\n", moe_last_error());
        return 1;
    }
    if (floor_only && opt.state != MOE_ADAMW_FP32) {
        fprintf(stderr, "train_step: --stream-floor needs train.optimizer_state = fp32\n");
        return 2;
    }
    size_t n = moe_model_numel(&m), nt = (size_t)d.B * d.T;
    int32_t *in = malloc(sizeof(int32_t) * nt), *tg = malloc(sizeof(int32_t) * nt);
    int32_t *task = malloc(sizeof(int32_t) * d.B);
    moe_model_timing tm;
    double t_opt = 0, t_norm = 0, t_total = 0;
    struct rusage ru0, ru1;
    for (int s = 0; s < warmup + steps; s++) {
        if (s == warmup) {
            memset(&tm, 0, sizeof tm);
            m.timing = &tm;
            t_opt = 0, t_norm = 0;
            getrusage(RUSAGE_SELF, &ru0);
        }
        double t0 = now();
        memset(m.grads, 0, sizeof(float) * n);
        if (moe_data_next(&d, MOE_SPLIT_TRAIN, in, tg, task) ||
            moe_model_forward(&m, in, tg, task, d.B, d.T, true, (uint64_t)s) ||
            moe_model_backward(&m, in, tg, task)) {
            fprintf(stderr, "train_step: %s\n", moe_last_error());
            return 1;
        }
        double t1 = now();
        double gn = moe_grad_norm(m.grads, n), tn = now();
        if (floor_only)
            stream_floor(&opt, m.params, m.grads, n);
        else
            moe_adamw_update_clipped(&opt, m.params, m.grads, gn, cfg.train.grad_clip,
                                     (float)cfg.train.lr, 0.9f, 0.95f, 1e-8f, 0.1f);
        double t2 = now();
        if (s >= warmup) {
            t_opt += t2 - t1;
            t_norm += tn - t1;
            t_total += t2 - t0;
        }
    }
    getrusage(RUSAGE_SELF, &ru1);
    const double user = (ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec) +
                        1e-6 * (ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec);
    const double sys = (ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) +
                       1e-6 * (ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec);
    const moe_layer_timing *lt = &tm.moe_layer;
    double routing = lt->gate + lt->router + lt->permute + lt->unpermute;
    double experts = lt->experts + lt->shared;
    double other = t_total - tm.attention - tm.ffn - tm.moe - tm.head - tm.embed - t_opt;
    other += tm.moe - routing - experts; // MoE-block norms and residual adds
    printf("{\"bench\":\"train_step\",\"machine\":\"%s\",\"config\":\"%s\",\"optimizer\":\"%s\","
           "\"optimizer_state\":\"%s\",\"params\":%zu,"
           "\"tokens_per_step\":%zu,\"steps\":%d,\"ms_per_step\":%.2f,\"tokens_per_s\":%.0f,"
           "\"share\":{\"attention\":%.3f,\"moe_experts\":%.3f,\"router_permute\":%.3f,"
           "\"dense_ffn\":%.3f,\"lm_head_loss\":%.3f,\"optimizer\":%.3f,\"optimizer_norm\":%.3f,"
           "\"embedding\":%.3f,\"other\":%.3f},\"wall_s\":%.3f,\"user_s\":%.3f,"
           "\"sys_s\":%.3f,\"sys_share\":%.4f,\"voluntary_csw\":%ld,\"involuntary_csw\":%ld,"
           "\"cpu_threads\":%d}\n",
           machine, config, floor_only ? "stream_floor" : "adamw", cfg.train.optimizer_state, n, nt,
           steps, 1e3 * t_total / steps, nt * steps / t_total, tm.attention / t_total,
           experts / t_total, routing / t_total, tm.ffn / t_total, tm.head / t_total,
           t_opt / t_total, t_norm / t_total, tm.embed / t_total, other / t_total, t_total, user,
           sys, sys / (user + sys), ru1.ru_nvcsw - ru0.ru_nvcsw, ru1.ru_nivcsw - ru0.ru_nivcsw,
           moe_cpu_threads());
    free(in);
    free(tg);
    free(task);
    moe_adamw_free(&opt);
    moe_model_free(&m);
    moe_data_close(&d);
    return 0;
}
