// Model FLOPs per trained token and the measured sgemm rate they are divided
// by: the model FLOPs utilisation (MFU) `moe train` prints and writes to
// metrics.jsonl (README "CPU performance").
#include "moe/mfu.h"
#include "kernels/ops.h"
#include "moe/error.h"

#include <stdlib.h>
#include <time.h>

// Forward FLOPs per token, 2 per multiply-add, over the parameters a token
// uses (the convention of PaLM, arXiv 2204.02311 appendix B, with the causal
// half of attention counted, as the causal kernel computes only that half):
//   per layer  attention projections 2 * D * (2*QD + 2*KD)
//              (QD = n_heads * hd, KD = n_kv_heads * hd, hd = D / n_heads)
//              attention scores and values 2 * 2 * T * QD * 1/2 = 2 * T * QD
//              dense FFN (SwiGLU, 3 matrices) 2 * 3 * D * d_ff, or MoE:
//              2 * 3 * D * H * (top_k + shared_experts) + router gate 2 * D * E
//              (H = moe.d_expert or d_ff; expert choice counted as top_k too)
//   LM head    2 * D * vocab_size
// Training counts 3 x forward (backward: the gradients of both GEMM inputs).
// Norms, RoPE, softmax, embedding look-ups and the optimizer are not counted.
double moe_model_flops_per_token(const moe_config *cfg) {
    const double D = cfg->model.d_model, T = cfg->model.seq_len, V = cfg->model.vocab_size;
    if (cfg->model.n_heads <= 0 || D <= 0) return 0;
    const double hd = (double)(cfg->model.d_model / cfg->model.n_heads);
    const double QD = cfg->model.n_heads * hd, KD = cfg->model.n_kv_heads * hd;
    const double H = cfg->moe.d_expert ? cfg->moe.d_expert : cfg->model.d_ff;
    double fwd = 2 * D * V;
    for (int l = 0; l < cfg->model.n_layers; l++) {
        fwd += 2 * D * (2 * QD + 2 * KD) + 2 * T * QD;
        if (moe_config_is_moe(cfg, l))
            fwd += 2 * 3 * D * H * (cfg->router.top_k + cfg->moe.shared_experts) +
                   2 * D * moe_config_experts(cfg, l);
        else
            fwd += 2 * 3 * D * cfg->model.d_ff;
    }
    return 3 * fwd;
}

// The routed experts' part of moe_model_flops_per_token: 3 x 2 * 3 * D * H *
// top_k over the MoE layers. A dropped assignment is not computed (the token
// passes through), so a step with drop rate r does r times this less work.
double moe_model_routed_flops_per_token(const moe_config *cfg) {
    const double D = cfg->model.d_model;
    const double H = cfg->moe.d_expert ? cfg->moe.d_expert : cfg->model.d_ff;
    double fwd = 0;
    for (int l = 0; l < cfg->model.n_layers; l++)
        if (moe_config_is_moe(cfg, l)) fwd += 2 * 3 * D * H * cfg->router.top_k;
    return 3 * fwd;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Best of many calls rather than the mean: the machine is shared, and the
// rate is the ceiling the model's GEMMs could reach, not a typical call.
int moe_sgemm_rate(int n, double *gflops) {
    *gflops = 0;
    if (n <= 0) n = 512;
    const size_t nn = (size_t)n * n;
    // Plain malloc: scratch of a measurement, outside the run's allocation
    // peak (moe_mem_peak) that `moe train` compares with `moe plan`.
    float *a = malloc(sizeof(float) * nn), *b = malloc(sizeof(float) * nn),
          *c = malloc(sizeof(float) * nn);
    int rc = 0;
    if (!a || !b || !c) {
        rc = moe_fail(MOE_ENOMEM, "sgemm rate: out of memory for %d x %d matrices", n, n);
        goto fail;
    }
    for (size_t i = 0; i < nn; i++) // small values, no denormals or overflow
        a[i] = (float)((i * 7 + 3) % 17) / 17.0f - 0.5f, b[i] = (float)((i * 5 + 1) % 13) / 13.0f;
    MOE_TRY_GOTO(moe_ops_cpu.matmul(c, a, b, n, n, n, false, true, 1.0f, 0.0f), rc); // warm-up
    double best = 1e30, t_end = now_s() + 0.1;
    for (int i = 0; i < 3 || now_s() < t_end; i++) {
        double t0 = now_s();
        MOE_TRY_GOTO(moe_ops_cpu.matmul(c, a, b, n, n, n, false, true, 1.0f, 0.0f), rc);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
        if (i >= 1000) break;
    }
    *gflops = 2.0 * n * n * n / (best > 0 ? best : 1e-9) / 1e9;
fail:
    free(a);
    free(b);
    free(c);
    return rc;
}
