// Training steps on the GPU (trainer/train_gpu.h): the optimizer step of
// trainer/train.c (mean over micro-batches, global-norm clipping, AdamW) with
// the op table's device kernels. The CPU reference is moe_adamw_update and
// moe_grad_clip; the CPU table's AdamW is its arithmetic, the CUDA one agrees
// within rounding (nvcc fuses multiply-adds; tests/test_backend_ops.c), and
// the whole path runs on moe_ops_cpu in tests/test_train.c. The mean is a
// multiply by 1/accum: the CPU's division exactly when accum is a power of two.
#include "trainer/train_gpu.h"
#include "moe/error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

static bool on_cuda(const moe_ops *ops) {
    return !strncmp(ops->name, "cuda", 4);
}

// Host to device (or to the host copy on the CPU table).
static int up(const moe_ops *ops, void *dst, const void *src, size_t bytes) {
    if (!on_cuda(ops)) {
        if (bytes) memcpy(dst, src, bytes);
        return 0;
    }
#ifdef MOE_HAVE_CUDA
    return moe_cuda_upload(dst, src, bytes);
#else
    return moe_fail(MOE_EINVAL, "built without CUDA");
#endif
}

static int down(const moe_ops *ops, void *dst, const void *src, size_t bytes) {
    if (!on_cuda(ops)) {
        if (bytes) memcpy(dst, src, bytes);
        return 0;
    }
#ifdef MOE_HAVE_CUDA
    return moe_cuda_download(dst, src, bytes);
#else
    return moe_fail(MOE_EINVAL, "built without CUDA");
#endif
}

// The trainer's own device buffers, in the order init allocates them: AdamW
// m and v, the decay byte mask, the input and target tokens.
static void trainer_sizes(size_t n, size_t tokens, size_t out[5]) {
    out[0] = out[1] = n * sizeof(float);
    out[2] = n;
    out[3] = out[4] = tokens * sizeof(int32_t);
}

size_t moe_gpu_trainer_bytes(size_t n, size_t tokens, const moe_ops *ops, size_t *optimizer) {
    size_t s[5], b = 0;
    trainer_sizes(n, tokens, s);
    if (optimizer)
        *optimizer = ops->alloc_size(s[0]) + ops->alloc_size(s[1]) + ops->alloc_size(s[2]);
    for (int i = 0; i < 5; i++)
        b += ops->alloc_size(s[i]);
    return b;
}

int moe_gpu_trainer_init(moe_gpu_trainer *g, const moe_model *host, const moe_adamw *opt,
                         const moe_config *cfg, size_t tokens, const moe_ops *ops) {
    memset(g, 0, sizeof *g);
    if (!ops) {
#ifdef MOE_HAVE_CUDA
        ops = !strcmp(cfg->train.compute, "bf16") ? &moe_ops_cuda_bf16 : &moe_ops_cuda;
#else
        return moe_fail(MOE_EINVAL, "built without CUDA");
#endif
    }
    g->ops = ops;
    int rc = 0;
    if (opt->state != MOE_ADAMW_FP32)
        return moe_fail(MOE_EINVAL, "train.optimizer_state = bf16: the GPU trainer keeps fp32 "
                                    "moments (use train.optimizer_state = fp32)");
#ifdef MOE_HAVE_CUDA
    if (on_cuda(ops)) MOE_TRY(moe_cuda_init(moe_gpu_local_device())); // before any allocation
#endif
    MOE_TRY(moe_model_gpu_init(&g->m, host, ops));
    g->n = host->table.numel;
    g->tokens = tokens;
    size_t s[5];
    trainer_sizes(g->n, tokens, s);
    if (!(g->adam_m = ops->alloc(s[0])) || !(g->adam_v = ops->alloc(s[1])) ||
        !(g->decay = ops->alloc(s[2])) || !(g->in = ops->alloc(s[3])) ||
        !(g->tg = ops->alloc(s[4]))) {
        rc = MOE_ENOMEM; // ops->alloc left the message
        goto fail;
    }
    MOE_TRY_GOTO(up(ops, g->adam_m, opt->m, g->n * sizeof(float)), rc);
    MOE_TRY_GOTO(up(ops, g->adam_v, opt->v, g->n * sizeof(float)), rc);
    unsigned char *mask = malloc(g->n ? g->n : 1); // the device kernel takes a byte mask
    if (!mask) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "GPU trainer: decay mask: out of memory"), rc);
    moe_adamw_decay_mask(opt, mask);
    rc = up(ops, g->decay, mask, g->n);
    free(mask);
    if (rc < 0) goto fail;
    return 0;
fail:
    moe_gpu_trainer_free(g);
    return rc;
}

int moe_gpu_local_device(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                          "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"};
    int local = 0;
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) {
            local = atoi(v);
            break;
        }
    }
#ifdef MOE_HAVE_CUDA
    int n = moe_cuda_device_count(NULL, 0);
    return n > 0 ? local % n : 0;
#else
    (void)local;
    return 0;
#endif
}

int moe_gpu_trainer_connect(moe_gpu_trainer *g, moe_parallel *par) {
    moe_comm *world = par->world;
    g->world = world;
    if (!world || moe_comm_size(world) == 1) return 0;
    if (!on_cuda(g->ops)) {
        if (par->ep_size > 1) g->par = par;
        return 0;
    }
#ifdef MOE_HAVE_CUDA
    // NCCL cannot join two ranks on one device: those sum their gradients
    // (and exchange expert rows) through host memory. The check is collective
    // over the communicator NCCL would span, so its ranks decide alike.
    const int device = moe_gpu_local_device();
    bool distinct = false;
    MOE_TRY(moe_gpu_devices_distinct(par->ep_size > 1 ? par->ep : world, device, &distinct));
#ifndef MOE_HAVE_NCCL
    distinct = false; // no NCCL: the host path for every layout
#endif
    if (par->ep_size == 1 && distinct) return moe_nccl_comm_init(&g->nccl, world, device);
    g->par = par;
    if (!(g->host_grads = malloc(g->n * sizeof(float) + 1)))
        return moe_fail(MOE_ENOMEM, "GPU trainer: host copy of %zu gradients", g->n);
    if (par->ep_size == 1 || !distinct) return 0;
    MOE_TRY(moe_nccl_comm_init(&g->ep_nccl, par->ep, device));
    return moe_parallel_device_exchange(par, g->ep_nccl);
#else
    return moe_fail(MOE_EINVAL, "built without CUDA");
#endif
}

int moe_gpu_devices_distinct(moe_comm *comm, int device, bool *distinct) {
    typedef struct {
        char host[64];
        int device;
    } where;
    const int n = moe_comm_size(comm);
    where me, *all = calloc((size_t)n, sizeof *all);
    if (!all) return moe_fail(MOE_ENOMEM, "GPU placement of %d ranks", n);
    memset(&me, 0, sizeof me);
    if (gethostname(me.host, sizeof me.host - 1) != 0) snprintf(me.host, sizeof me.host, "?");
    me.device = device;
    int rc = moe_comm_allgather(comm, &me, all, sizeof me);
    *distinct = true;
    for (int i = 0; rc == 0 && i < n; i++)
        for (int j = 0; j < i; j++)
            if (all[i].device == all[j].device && !strcmp(all[i].host, all[j].host))
                *distinct = false;
    free(all);
    return rc;
}

int moe_gpu_allreduce_grads(moe_gpu_trainer *g) {
    if (!g->world || moe_comm_size(g->world) == 1) return 0;
    if (g->par) { // expert parallel, or ranks sharing a GPU
        if (!on_cuda(g->ops)) return moe_parallel_allreduce_buffer(g->par, &g->m.table, g->m.grads);
        const size_t bytes = g->n * sizeof(float);
        MOE_TRY(down(g->ops, g->host_grads, g->m.grads, bytes));
        MOE_TRY(moe_parallel_allreduce_buffer(g->par, &g->m.table, g->host_grads));
        return up(g->ops, g->m.grads, g->host_grads, bytes);
    }
    if (!on_cuda(g->ops)) return moe_comm_allreduce_f32(g->world, g->m.grads, g->n);
#ifdef MOE_HAVE_CUDA
    if (!g->nccl)
        return moe_fail(MOE_EINVAL, "data-parallel training on the GPU needs NCCL (built without "
                                    "it, or not connected)");
    MOE_TRY(moe_nccl_allreduce_f32(g->nccl, g->m.grads, g->n, moe_cuda_stream()));
    return 0;
#else
    return moe_fail(MOE_EINVAL, "built without CUDA");
#endif
}

void moe_gpu_trainer_free(moe_gpu_trainer *g) {
    moe_nccl_comm_free(g->nccl);
    if (g->ep_nccl) moe_parallel_device_exchange(g->par, NULL);
    moe_nccl_comm_free(g->ep_nccl);
    free(g->host_grads);
    const moe_ops *ops = g->ops;
    if (ops) {
        void *bufs[] = {g->adam_m, g->adam_v, g->decay, g->in, g->tg};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
            if (bufs[i]) ops->free(bufs[i]);
    }
    moe_model_gpu_free(&g->m);
    memset(g, 0, sizeof *g);
}

int moe_gpu_zero_grads(moe_gpu_trainer *g) {
    return g->ops->zero(g->m.grads, g->n);
}

int moe_gpu_micro_batch(moe_gpu_trainer *g, const int32_t *in, const int32_t *tg,
                        const int32_t *task, int B, int T, uint64_t step) {
    const size_t nt = (size_t)B * T;
    if (nt > g->tokens)
        return moe_fail(MOE_EINVAL, "GPU batch of %zu tokens exceeds %zu", nt, g->tokens);
    MOE_TRY(up(g->ops, g->in, in, nt * sizeof(int32_t)));
    MOE_TRY(up(g->ops, g->tg, tg, nt * sizeof(int32_t)));
    MOE_TRY(moe_model_forward(&g->m, g->in, g->tg, task, B, T, true, step));
    if (!isfinite(g->m.loss))
        return moe_fail(MOE_ENUMERIC, "loss is %g (ce %g, aux %g, z %g) on the GPU", g->m.loss,
                        g->m.ce, g->m.aux, g->m.z);
    return moe_model_backward(&g->m, g->in, g->tg, task);
}

int moe_gpu_optimizer_step(moe_gpu_trainer *g, moe_adamw *opt, int accum, float lr,
                           const moe_config *cfg, double *gnorm) {
    const moe_ops *ops = g->ops;
    if (accum > 1) MOE_TRY(ops->scale(g->m.grads, g->n, 1.0f / (float)accum));
    if (g->par) { // the experts of other ranks count too
        MOE_TRY(moe_parallel_grad_norm_on(g->par, &g->m, ops, gnorm));
    } else {
        double ss = 0.0;
        MOE_TRY(ops->sumsq(&ss, g->m.grads, g->n));
        *gnorm = sqrt(ss);
    }
    if (!isfinite(*gnorm)) return moe_fail(MOE_ENUMERIC, "non-finite gradient (on the GPU)");
    const double max_norm = cfg->train.grad_clip;
    if (max_norm > 0 && *gnorm > max_norm) // moe_grad_clip
        MOE_TRY(ops->scale(g->m.grads, g->n, (float)(max_norm / (*gnorm + 1e-6))));
    opt->step++;
    return ops->adamw(g->m.params, g->adam_m, g->adam_v, g->m.grads, g->decay, g->n, opt->step, lr,
                      (float)cfg->train.beta1, (float)cfg->train.beta2, 1e-8f,
                      (float)cfg->train.weight_decay);
}

int moe_gpu_trainer_sync(moe_gpu_trainer *g, moe_model *host, moe_adamw *opt) {
    MOE_TRY(moe_model_gpu_download(host, &g->m));
    MOE_TRY(down(g->ops, opt->m, g->adam_m, g->n * sizeof(float)));
    return down(g->ops, opt->v, g->adam_v, g->n * sizeof(float));
}
