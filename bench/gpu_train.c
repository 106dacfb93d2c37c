// GPU training throughput (DESIGN "Performance targets"): tokens/s of
// `moe train --device cuda` on a ~100M-parameter Mixtral-style config (6
// layers, d_model 768, 8 experts of 768 per layer, top-2; seq_len 256, batch
// 16 or --batch N) on the synthetic corpus, one JSON line per precision. The
// rate is the trainer's own (mean over the run, first steps included). Each line carries
// the model FLOPs utilisation: the kept assignments' FLOPs per token
// (moe/mfu.h, the CPU path's count) times tokens/s, against the dense GEMM
// rate the same precision's op table reaches in the same run (8192^3
// matmuls: `mfu`, the CPU path's convention) and against the datasheet's
// dense peak where the device is known (`mfu_of_peak`).
//
// A `gpu_train_phases` line per precision says where a step's time goes: the
// device model's phase timers (each phase waits for its kernels, so these
// steps run slower than the throughput line's) and the optimizer step.
//
// Then device memory (issue 14 item 5), per precision and with mini-sequence
// chunks (memory.mini_seq 4 with recompute = moe and = all): `moe plan`'s device
// total (moe_plan_device_memory) against the tracked peak of moe_cuda_alloc
// over init and --steps steps of the GPU trainer, and cudaMemGetInfo's used
// bytes after those steps minus before init (that adds the allocator's pool,
// cuBLAS workspace and the per-op cudaMallocAsync scratch, which the plan
// does not count). The bf16 throughput line is repeated under mini_seq 4 with
// recompute = all (the cost of the recompute).
//
// usage: gpu_train [--steps N]
// Without a CUDA build or a GPU it prints why (as JSON) and exits 0.
#include "moe/error.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/plan.h"
#include "moe/train.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Sequences a step (--batch): more tokens a step give the GEMMs more rows
// against the same launches and host syncs.
static int batch = 16;

#ifdef MOE_HAVE_CUDA
#include "gpu_fill.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/ops_cuda.h"
#include "moe/mfu.h"
#include "trainer/train_gpu.h"

#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static const moe_ops *table(const char *compute) {
    return strcmp(compute, "bf16") ? &moe_ops_cuda : &moe_ops_cuda_bf16;
}

// Dense GEMM rate of the op table (TFLOP/s): n^3 matmuls, best of 3 rounds of 5.
static int gemm_rate(const moe_ops *ops, int n, double *tflops) {
    const size_t nn = (size_t)n * n;
    float *a = ops->alloc(nn * sizeof(float)), *b = ops->alloc(nn * sizeof(float));
    float *c = ops->alloc(nn * sizeof(float));
    int rc = a && b && c ? 0 : MOE_ENOMEM;
    if (rc == 0) rc = bench_fill_device(a, nn, 1.0f, 1);
    if (rc == 0) rc = bench_fill_device(b, nn, 1.0f, 2);
    double best = 1e30;
    for (int round = -1; round < 3 && rc == 0; round++) { // round -1 warms up
        rc = moe_cuda_synchronize();
        const double t0 = now_s();
        for (int i = 0; i < 5 && rc == 0; i++)
            rc = ops->matmul(c, a, b, n, n, n, false, true, 1.0f, 0.0f);
        if (rc == 0) rc = moe_cuda_synchronize();
        const double t = (now_s() - t0) / 5;
        if (round >= 0 && t < best) best = t;
    }
    *tflops = 2.0 * n * (double)nn / best / 1e12;
    ops->free(a), ops->free(b), ops->free(c);
    return rc;
}

// Dense tensor-core (bf16) or plain fp32 peak of the datasheet, TFLOP/s; 0:
// a device this table does not know.
static double spec_peak(const char *name, const char *compute) {
    const bool bf16 = !strcmp(compute, "bf16");
    if (strstr(name, "H100") && strstr(name, "PCIe")) return bf16 ? 756.0 : 51.2;
    if (strstr(name, "H100") && strstr(name, "NVL")) return bf16 ? 835.0 : 60.0;
    if (strstr(name, "H100") || strstr(name, "H200")) return bf16 ? 989.4 : 66.9;
    return 0.0;
}

// mini_seq > 1: memory.mini_seq with memory.recompute = recompute.
static void bench_config(moe_config *cfg, const char *compute, int steps, int mini_seq,
                         const char *recompute) {
    moe_config c;
    moe_config_default(&c);
    c.model.d_model = 768;
    c.model.n_layers = 6;
    c.model.n_heads = 12;
    c.model.n_kv_heads = 4;
    c.model.d_ff = 768;
    c.model.seq_len = 256;
    c.moe.num_experts[0] = 8;
    c.router.top_k = 2;
    c.train.batch_size = batch;
    c.train.steps = steps;
    c.train.warmup_steps = 2;
    c.train.eval_every = 0;
    snprintf(c.train.device, sizeof c.train.device, "cuda");
    snprintf(c.train.compute, sizeof c.train.compute, "%s", compute);
    if (mini_seq > 1) {
        c.memory.mini_seq = mini_seq;
        snprintf(c.memory.recompute, sizeof c.memory.recompute, "%s", recompute);
    }
    *cfg = c;
}

// Plan vs measured device memory of the GPU trainer on the bench config.
static int memory(const char *compute, int steps, int mini_seq, const char *recompute) {
    moe_config c;
    bench_config(&c, compute, steps, mini_seq, recompute);
    const int B = c.train.batch_size, T = c.model.seq_len;
    moe_gpu_mem_plan p;
    MOE_TRY(moe_plan_device_memory(&c, NULL, &p));
    moe_model m;
    moe_adamw opt;
    MOE_TRY(moe_model_init(&m, &c, B, T, 1));
    int rc = moe_adamw_init(&opt, &m.table, false);
    int32_t *tok = malloc(sizeof *tok * (size_t)B * T);
    size_t free0 = 0, free1 = 0, total = 0;
    moe_gpu_trainer g = {0};
    if (rc == 0 && !tok) rc = moe_fail(MOE_ENOMEM, "tokens");
    if (rc == 0) rc = moe_cuda_init(0);
    if (rc == 0) rc = moe_cuda_synchronize();
    if (rc == 0) rc = moe_cuda_mem_info(&free0, &total);
    const size_t base = moe_cuda_mem_in_use();
    moe_cuda_mem_reset_peak();
    if (rc == 0) rc = moe_gpu_trainer_init(&g, &m, &opt, &c, (size_t)B * T, NULL);
    for (int s = 0; s < steps && rc == 0; s++) {
        for (int i = 0; i < B * T; i++)
            tok[i] = (int32_t)((i * 7919u + (unsigned)s * 104729u) % (unsigned)c.model.vocab_size);
        double gn = 0;
        rc = moe_gpu_zero_grads(&g);
        if (rc == 0) rc = moe_gpu_micro_batch(&g, tok, tok, NULL, B, T, (uint64_t)s);
        if (rc == 0) rc = moe_gpu_optimizer_step(&g, &opt, 1, 1e-3f, &c, &gn);
    }
    if (rc == 0) rc = moe_cuda_synchronize();
    if (rc == 0) rc = moe_cuda_mem_info(&free1, &total);
    const size_t peak = moe_cuda_mem_peak() - base;
    char name[256] = "";
    if (rc == 0) moe_cuda_device_info(name, sizeof name, NULL, NULL);
    if (rc == 0)
        printf("{\"bench\":\"gpu_train_memory\",\"device\":\"%s\",\"compute\":\"%s\","
               "\"mini_seq\":%d,\"recompute\":\"%s\",\"steps\":%d,\"plan_device_bytes\":%zu,"
               "\"tracked_peak_bytes\":%zu,\"plan_rel_err\":%.6f,\"meminfo_delta_bytes\":%zu,"
               "\"meminfo_rel_to_plan\":%.4f}\n",
               name, compute, c.memory.mini_seq, c.memory.recompute, steps, p.total, peak,
               ((double)peak - (double)p.total) / (double)p.total, free0 - free1,
               (double)(free0 - free1) / (double)p.total);
    moe_gpu_trainer_free(&g);
    free(tok);
    moe_adamw_free(&opt);
    moe_model_free(&m);
    return rc;
}

static int run(const char *compute, int steps, int mini_seq, const char *recompute) {
    moe_config c;
    bench_config(&c, compute, steps, mini_seq, recompute);
    char dir[] = "/tmp/moe_gpu_train_XXXXXX";
    if (!mkdtemp(dir)) return moe_fail(MOE_EIO, "mkdtemp failed");
    moe_model_mem mem;
    MOE_TRY(moe_model_memory(&c, c.train.batch_size, c.model.seq_len, 1, 1, 0, 0, &mem));
    moe_train_opts o = {0};
    o.out_dir = dir;
    o.quiet = true;
    moe_train_result r;
    MOE_TRY(moe_train(&c, &o, &r));
    char name[256] = "";
    moe_cuda_device_info(name, sizeof name, NULL, NULL);
    double gemm = 0;
    MOE_TRY(gemm_rate(table(compute), 8192, &gemm));
    const double flops =
        moe_model_flops_per_token(&c) - r.drop_rate * moe_model_routed_flops_per_token(&c);
    const double model_tflops = flops * r.tokens_per_s / 1e12, peak = spec_peak(name, compute);
    printf("{\"bench\":\"gpu_train\",\"device\":\"%s\",\"compute\":\"%s\",\"mini_seq\":%d,"
           "\"recompute\":\"%s\",\"params\":%zu,\"tokens_per_step\":%d,\"steps\":%ld,"
           "\"tokens_per_s\":%.0f,\"first_loss\":%.4f,\"last_loss\":%.4f,\"drop_rate\":%.4f,"
           "\"flops_per_token\":%.4g,\"model_tflops\":%.2f,\"gemm_tflops\":%.2f,\"mfu\":%.4f,"
           "\"peak_tflops_spec\":%.1f,\"mfu_of_peak\":%.4f}\n",
           name, compute, c.memory.mini_seq, c.memory.recompute, mem.n_params,
           c.train.batch_size * c.model.seq_len, r.steps, r.tokens_per_s, r.first_loss, r.last_loss,
           r.drop_rate, flops, model_tflops, gemm, model_tflops / gemm, peak,
           peak > 0 ? model_tflops / peak : 0.0);
    moe_eval_result_free(&r.eval);
    return 0;
}

// Where a step's time goes: 2 warm-up steps, then `steps` steps with the
// device model's phase timers on and the optimizer timed on its own.
static int phases(const char *compute, int steps) {
    moe_config c;
    bench_config(&c, compute, steps, 1, "");
    const int B = c.train.batch_size, T = c.model.seq_len;
    moe_model m;
    moe_adamw opt;
    MOE_TRY(moe_model_init(&m, &c, B, T, 1));
    int rc = moe_adamw_init(&opt, &m.table, false);
    int32_t *tok = malloc(sizeof *tok * (size_t)B * T);
    moe_gpu_trainer g = {0};
    moe_model_timing tm;
    memset(&tm, 0, sizeof tm);
    double t_opt = 0, t_total = 0;
    if (rc == 0 && !tok) rc = moe_fail(MOE_ENOMEM, "tokens");
    if (rc == 0) rc = moe_gpu_trainer_init(&g, &m, &opt, &c, (size_t)B * T, NULL);
    for (int s = -2; s < steps && rc == 0; s++) {
        if (s == 0) g.m.timing = &tm;
        for (int i = 0; i < B * T; i++)
            tok[i] = (int32_t)((i * 7919u + (unsigned)s * 104729u) % (unsigned)c.model.vocab_size);
        double gn = 0;
        rc = moe_cuda_synchronize();
        const double t0 = now_s();
        if (rc == 0) rc = moe_gpu_zero_grads(&g);
        if (rc == 0) rc = moe_gpu_micro_batch(&g, tok, tok, NULL, B, T, (uint64_t)(s + 2));
        if (rc == 0) rc = moe_cuda_synchronize();
        const double t1 = now_s();
        if (rc == 0) rc = moe_gpu_optimizer_step(&g, &opt, 1, 1e-3f, &c, &gn);
        if (rc == 0) rc = moe_cuda_synchronize();
        if (s >= 0) t_opt += now_s() - t1, t_total += now_s() - t0;
    }
    char name[256] = "";
    if (rc == 0) moe_cuda_device_info(name, sizeof name, NULL, NULL);
    const double other = t_total - tm.attention - tm.moe - tm.ffn - tm.head - tm.embed - t_opt;
    if (rc == 0 && t_total > 0)
        printf("{\"bench\":\"gpu_train_phases\",\"device\":\"%s\",\"compute\":\"%s\","
               "\"tokens_per_step\":%d,\"steps\":%d,\"ms_per_step\":%.3f,"
               "\"share\":{\"attention\":%.3f,\"moe\":%.3f,"
               "\"dense_ffn\":%.3f,\"lm_head_loss\":%.3f,\"embedding\":%.3f,\"optimizer\":%.3f,"
               "\"other\":%.3f}}\n",
               name, compute, B * T, steps, 1e3 * t_total / steps, tm.attention / t_total,
               tm.moe / t_total, tm.ffn / t_total, tm.head / t_total, tm.embed / t_total,
               t_opt / t_total, other / t_total);
    moe_gpu_trainer_free(&g);
    free(tok);
    moe_adamw_free(&opt);
    moe_model_free(&m);
    return rc;
}
#endif

int main(int argc, char **argv) {
    int steps = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            batch = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: gpu_train [--steps N] [--batch SEQUENCES (16)]\n");
            return 2;
        }
    }
#ifndef MOE_HAVE_CUDA
    (void)steps;
    printf("{\"bench\":\"gpu_train\",\"skipped\":\"built without CUDA\"}\n");
    return 0;
#else
    char why[256] = "";
    if (moe_cuda_device_count(why, sizeof why) == 0) {
        printf("{\"bench\":\"gpu_train\",\"skipped\":\"no CUDA device: %s\"}\n", why);
        return 0;
    }
    if (run("bf16", steps, 1, "") < 0 || run("fp32", steps, 1, "") < 0 ||
        run("bf16", steps, 4, "all") < 0 || phases("bf16", steps) < 0 ||
        phases("fp32", steps) < 0 || memory("bf16", steps, 1, "") < 0 ||
        memory("fp32", steps, 1, "") < 0 || memory("bf16", steps, 4, "moe") < 0 ||
        memory("bf16", steps, 4, "all") < 0) {
        fprintf(stderr, "gpu_train: %s\n", moe_last_error());
        return 1;
    }
    return 0;
#endif
}
