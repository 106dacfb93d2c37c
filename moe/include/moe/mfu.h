// Model FLOPs utilisation (MFU) of a training run: the model's FLOPs per
// trained token (a count from the config, trainer/mfu.c states the formula)
// against the sgemm rate this machine measures through the CPU op table.
#ifndef MOE_MFU_H
#define MOE_MFU_H

#include "moe/config.h"

// FLOPs of one trained token (forward + backward = 3 x forward, 2 FLOPs per
// multiply-add, active parameters only; the formula is in trainer/mfu.c and
// README "CPU performance"). Returns 0 for a config with no layer sizes.
double moe_model_flops_per_token(const moe_config *cfg);

// The routed experts' share of that count (top_k assignments per token in
// every MoE layer). A step whose MoE layers drop a fraction r of their
// assignments computes moe_model_flops_per_token - r * this per token, and
// its MFU counts only those FLOPs (so dropping never raises MFU).
double moe_model_routed_flops_per_token(const moe_config *cfg);

// Measures the sgemm rate of this machine: square GEMMs of size n (n <= 0:
// 512) through moe_ops_cpu.matmul (the op and thread pool the model uses),
// best of about 0.1 s of calls, in GFLOP/s. MOE_ENOMEM or the op's error.
int moe_sgemm_rate(int n, double *gflops);

#endif
