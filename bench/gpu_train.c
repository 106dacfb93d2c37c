// GPU training throughput (DESIGN "Performance targets"): tokens/s of
// `moe train --device cuda` on a ~100M-parameter Mixtral-style config (6
// layers, d_model 768, 8 experts of 768 per layer, top-2; seq_len 256, batch
// 16) on the synthetic corpus, one JSON line per precision. The rate is the
// trainer's own (mean over the run, first steps included).
//
// usage: gpu_train [--steps N]
// Without a CUDA build or a GPU it prints why (as JSON) and exits 0.
#include "moe/error.h"
#include "moe/model.h"
#include "moe/train.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"

static int run(const char *compute, int steps) {
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
    c.train.batch_size = 16;
    c.train.steps = steps;
    c.train.warmup_steps = 2;
    c.train.eval_every = 0;
    snprintf(c.train.device, sizeof c.train.device, "cuda");
    snprintf(c.train.compute, sizeof c.train.compute, "%s", compute);
    char dir[] = "/tmp/moe_gpu_train_XXXXXX";
    if (!mkdtemp(dir)) return moe_fail(MOE_EIO, "mkdtemp failed");
    moe_model_mem mem;
    MOE_TRY(moe_model_memory(&c, c.train.batch_size, c.model.seq_len, 1, 1, 0, &mem));
    moe_train_opts o = {0};
    o.out_dir = dir;
    o.quiet = true;
    moe_train_result r;
    MOE_TRY(moe_train(&c, &o, &r));
    char name[256] = "";
    moe_cuda_device_info(name, sizeof name, NULL, NULL);
    printf("{\"bench\":\"gpu_train\",\"device\":\"%s\",\"compute\":\"%s\",\"params\":%zu,"
           "\"tokens_per_step\":%d,\"steps\":%ld,\"tokens_per_s\":%.0f,\"first_loss\":%.4f,"
           "\"last_loss\":%.4f}\n",
           name, compute, mem.n_params, c.train.batch_size * c.model.seq_len, r.steps,
           r.tokens_per_s, r.first_loss, r.last_loss);
    moe_eval_result_free(&r.eval);
    return 0;
}
#endif

int main(int argc, char **argv) {
    int steps = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: gpu_train [--steps N]\n");
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
    if (run("bf16", steps) < 0 || run("fp32", steps) < 0) {
        fprintf(stderr, "gpu_train: %s\n", moe_last_error());
        return 1;
    }
    return 0;
#endif
}
