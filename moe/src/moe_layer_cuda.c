// The MoE layer on the GPU (moe/moe_layer_cuda.h): jitter, gate GEMM (per
// task under task routing), CUDA router, permute, grouped expert GEMMs + SwiGLU, weighted combine,
// shared expert, and the backward of each in reverse, with the same op sequence as the
// single-process path of moe/src/moe_layer.c (so the CPU layer is its
// reference, tests/test_backend_ops.c).
#include "moe/moe_layer_cuda.h"
#include "moe/error.h"

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#include "moe/cuda_sizes.h"

#include <stdlib.h>
#include <string.h>

// The expert-parallel exchange's transfers (moe/moe_ep_rows.h): blocking
// copies, and for comm.overlap_degree > 1 queued copies from page-locked
// staging and events, so rounds overlap with the expert GEMMs.
static const moe_ep_backend cuda_backend = {
    .down = moe_cuda_download,
    .up = moe_cuda_upload,
    .down_async = moe_cuda_download_async,
    .up_async = moe_cuda_upload_async,
    .host_alloc = moe_cuda_host_alloc,
    .host_free = moe_cuda_host_free,
    .event_create = moe_cuda_event_create,
    .event_destroy = moe_cuda_event_destroy,
    .event_record = moe_cuda_event_record,
    .event_wait = moe_cuda_event_wait,
};

int moe_layer_cuda_acts_alloc(moe_layer_cuda_acts *a, const moe_layer_config *cfg,
                              const moe_ops *ops) {
    memset(a, 0, sizeof *a);
    MOE_TRY(moe_layer_config_check(cfg));
    if (cfg->router.score != MOE_SCORE_SOFTMAX)
        return moe_fail(MOE_EINVAL, "moe layer on the GPU: router.score = sigmoid is not supported "
                                    "yet (use softmax, or the CPU)");
    if (cfg->router.bias_update_rate != 0)
        return moe_fail(MOE_EINVAL,
                        "moe layer on the GPU: router.bias_update_rate = %g (auxiliary-loss-free "
                        "balancing) is not supported yet (only 0; or use the CPU)",
                        cfg->router.bias_update_rate);
    if (cfg->router.type != MOE_ROUTER_TOKEN_CHOICE)
        return moe_fail(MOE_EINVAL, "moe layer on the GPU: router.type = expert_choice is not "
                                    "supported yet (use token_choice, or the CPU)");
    if (cfg->router.route_scale != 1.0)
        return moe_fail(MOE_EINVAL,
                        "moe layer on the GPU: router.route_scale = %g is not supported yet "
                        "(only 1; or use the CPU)",
                        cfg->router.route_scale);
    if (moe_router_groups_active(&cfg->router))
        return moe_fail(MOE_EINVAL,
                        "moe layer on the GPU: group-limited routing (router.n_groups = %d, "
                        "router.topk_groups = %d) is not supported yet (set router.topk_groups = "
                        "0, or use the CPU)",
                        cfg->router.n_groups, cfg->router.topk_groups);
    a->ops = ops;
    a->cfg = *cfg;
    int rc = 0;
    MOE_TRY_GOTO(moe_cuda_plan_alloc(&a->plan, cfg->T_max, cfg->E, cfg->router.top_k), rc);
    if (!(a->offsets_h = calloc((size_t)cfg->E + 1, sizeof(int))) ||
        !(a->coff_h = calloc((size_t)cfg->E + 1, sizeof(int)))) {
        rc = moe_fail(MOE_ENOMEM, "moe layer offsets");
        goto fail;
    }
    // sizes from moe_cuda_layer_sizes, the planner's (moe plan: device memory)
    void **ptrs[MOE_CUDA_LAYER_BUFS] = {
        (void **)&a->logits,    (void **)&a->row,     (void **)&a->xe,        (void **)&a->ab,
        (void **)&a->h,         (void **)&a->ye,      (void **)&a->shared_ab, (void **)&a->shared_h,
        (void **)&a->dlogits,   (void **)&a->dweight, (void **)&a->dye,       (void **)&a->dxe,
        (void **)&a->dh,        (void **)&a->dab,     (void **)&a->sdh,       (void **)&a->sdab,
        (void **)&a->noise,     (void **)&a->gate_in, (void **)&a->dgate_in,  (void **)&a->logits_g,
        (void **)&a->dlogits_g, (void **)&a->coff,
    };
    size_t sizes[MOE_CUDA_LAYER_BUFS];
    moe_cuda_layer_sizes(cfg, sizes);
    for (int i = 0; i < MOE_CUDA_LAYER_BUFS; i++) {
        if (!sizes[i]) continue; // the feature is off: no buffer
        if (!(*ptrs[i] = ops->alloc(sizes[i]))) {
            rc = MOE_ENOMEM; // ops->alloc left the message (size and config keys)
            goto fail;
        }
    }
    if (cfg->ep_size > 1) MOE_TRY_GOTO(moe_ep_rows_alloc(&a->epr, cfg, ops, &cuda_backend), rc);
    return 0;
fail:
    moe_layer_cuda_acts_free(a);
    return rc;
}

void moe_layer_cuda_acts_free(moe_layer_cuda_acts *a) {
    if (a->ops) {
        void *bufs[] = {a->logits,    a->row,      a->xe,        a->ab,      a->h,     a->ye,
                        a->shared_ab, a->shared_h, a->dlogits,   a->dweight, a->dye,   a->dxe,
                        a->dh,        a->dab,      a->sdh,       a->sdab,    a->noise, a->gate_in,
                        a->dgate_in,  a->logits_g, a->dlogits_g, a->coff};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
            if (bufs[i]) a->ops->free(bufs[i]);
    }
    if (a->cfg.ep_size > 1) moe_ep_rows_free(&a->epr);
    moe_cuda_plan_free(&a->plan); // NULL fields are skipped
    free(a->offsets_h);
    free(a->coff_h);
    memset(a, 0, sizeof *a);
}

// Tokens per chunk: all T_max without mini-sequence chunks.
static int chunk_tokens(const moe_layer_config *cfg) {
    return cfg->n_chunks > 1 ? (cfg->T_max + cfg->n_chunks - 1) / cfg->n_chunks : cfg->T_max;
}

// The experts' forward on tokens [t0, t0 + tc) of the routed batch (x: their
// rows): xe, ab, h, ye over the expert segments, which *off points at (host).
// Without chunks the rows are the plan's (offset + slot); with chunks the
// chunk's kept assignments in expert order, token order inside an expert
// (chunk_rows, as moe/src/moe_layer.c), and their offsets are read back.
static int chunk_experts(moe_layer_cuda_acts *a, const int **off, const float *x,
                         const moe_layer_params *p, int t0, int tc) {
    const moe_ops *ops = a->ops;
    const int D = a->cfg.D, H = a->cfg.H, E = a->cfg.E, k = a->cfg.router.top_k;
    if (a->cfg.n_chunks > 1) {
        MOE_TRY(ops->chunk_rows(a->row, a->coff, a->plan.expert + (size_t)t0 * k, tc * k, E));
        MOE_TRY(moe_cuda_download(a->coff_h, a->coff, sizeof(int) * (E + 1)));
        *off = a->coff_h;
    } else {
        MOE_TRY(ops->dispatch_rows(a->row, a->plan.expert, a->plan.slot, a->plan.offsets, tc, k));
        *off = a->offsets_h;
    }
    MOE_TRY(ops->permute_forward(a->xe, x, a->row, tc, k, D));
    if (a->cfg.ep_size > 1) { // the experts live on the EP group's ranks (no chunks)
        a->epr.ep = a->ep;
        return moe_ep_rows_forward(&a->epr, a->ye, a->xe, a->offsets_h, p);
    }
    // ab_e = xe_e [w1;w3]_e^T, h = SwiGLU(ab), ye_e = h_e w2_e^T over the segments
    MOE_TRY(ops->matmul_grouped(a->ab, a->xe, p->experts, p->expert_numel, *off, E, 2 * H, D, true,
                                1.0f, 0.0f));
    MOE_TRY(ops->swiglu_forward(a->h, a->ab, (*off)[E], H));
    return ops->matmul_grouped(a->ye, a->h, p->experts + p->w2_offset, p->expert_numel, *off, E, D,
                               H, true, 1.0f, 0.0f);
}

// The shared expert's activations for tc tokens (x: their rows).
static int shared_forward(moe_layer_cuda_acts *a, const float *x, const moe_layer_params *p,
                          int tc) {
    const int D = a->cfg.D, Hs = a->cfg.H_shared;
    MOE_TRY(a->ops->matmul(a->shared_ab, x, p->shared_w13, tc, 2 * Hs, D, false, true, 1.0f, 0.0f));
    return a->ops->swiglu_forward(a->shared_h, a->shared_ab, tc, Hs);
}

// Combine and experts backward for tokens [t0, t0 + tc) (dx, dy: their rows),
// with the activations chunk_experts left: dweight of those tokens, the expert
// weights' gradients added, dx += the permuted input's gradient.
static int experts_backward(moe_layer_cuda_acts *a, float *dx, const moe_layer_params *dp,
                            const float *dy, const moe_layer_params *p, const int *off, int t0,
                            int tc) {
    const moe_ops *ops = a->ops;
    const int D = a->cfg.D, H = a->cfg.H, E = a->cfg.E, k = a->cfg.router.top_k, rows = off[E];
    const float *w2 = p->experts + p->w2_offset;
    float *dw2 = dp->experts + dp->w2_offset;
    // combine: dye[row] = w dy[t], dweight = <dy[t], ye[row]>
    MOE_TRY(ops->zero(a->dye, (size_t)rows * D));
    MOE_TRY(ops->unpermute_backward(a->dye, a->dweight + (size_t)t0 * k, dy, a->ye, a->row,
                                    a->plan.weight + (size_t)t0 * k, tc, k, D));
    if (a->cfg.ep_size > 1) { // the experts live on the EP group's ranks
        MOE_TRY(moe_ep_rows_backward(&a->epr, a->dxe, a->dye, dp, p));
        return ops->permute_backward(dx, a->dxe, a->row, tc, k, D);
    }
    // experts (moe_layer.c ffn_backward, every segment at once)
    MOE_TRY(
        ops->matmul_grouped(a->dh, a->dye, w2, p->expert_numel, off, E, H, D, false, 1.0f, 0.0f));
    MOE_TRY(
        ops->matmul_grouped_wgrad(dw2, dp->expert_numel, a->dye, a->h, off, E, D, H, 1.0f, 1.0f));
    MOE_TRY(ops->zero(a->dab, (size_t)rows * 2 * H));
    MOE_TRY(ops->swiglu_backward(a->dab, a->dh, a->ab, rows, H));
    MOE_TRY(ops->matmul_grouped_wgrad(dp->experts, dp->expert_numel, a->dab, a->xe, off, E, 2 * H,
                                      D, 1.0f, 1.0f));
    MOE_TRY(ops->matmul_grouped(a->dxe, a->dab, p->experts, p->expert_numel, off, E, D, 2 * H,
                                false, 1.0f, 0.0f));
    return ops->permute_backward(dx, a->dxe, a->row, tc, k, D);
}

int moe_layer_cuda_forward(float *y, const float *x, const int *task_id, const int *capacity, int T,
                           const moe_layer_params *p, moe_layer_cuda_acts *a, bool training,
                           uint64_t step) {
    const moe_layer_config *cfg = &a->cfg;
    const moe_ops *ops = a->ops;
    if (y == x) return moe_fail(MOE_EINVAL, "moe layer forward: y aliases x");
    if (T < 1 || T > cfg->T_max)
        return moe_fail(MOE_EINVAL, "moe layer forward: T = %d not in 1..T_max = %d", T,
                        cfg->T_max);
    const int D = cfg->D, E = cfg->E, k = cfg->router.top_k, Hs = cfg->H_shared;
    const int nt = cfg->n_tasks;
    if (nt > 0 && (!task_id || !p->task_emb))
        return moe_fail(MOE_EINVAL, "moe layer forward: task routing (moe.task_layers) needs the "
                                    "task ids and the task_embedding tensor");
    a->T = 0;
    // The gate GEMM stays fp32 on the bf16 table (Switch Transformer's selective
    // precision): bf16 logits (~3 digits) move near-ties across the top-k and
    // capacity cut-offs, so the routing, a discrete choice, would differ from
    // the fp32 CPU layer's for tokens whose scores nearly tie. Its input is x,
    // or the n_tasks task embeddings whose logit rows are broadcast by task id
    // (moe_layer.c); jitter multiplies that input by the CPU's keyed factors.
    const float *gin = nt ? p->task_emb : x;
    const int G = nt ? nt : T;
    a->jittered = training && cfg->router.noise == MOE_NOISE_JITTER;
    if (a->jittered) {
        MOE_TRY(moe_cuda_router_jitter(a->noise, NULL, (size_t)G * D, cfg->router.noise_eps,
                                       cfg->router.seed, step));
        MOE_TRY(moe_ops_cuda.mul(a->gate_in, gin, a->noise, (size_t)G * D));
        gin = a->gate_in;
    }
    if (nt) {
        MOE_TRY(moe_ops_cuda.matmul(a->logits_g, gin, p->gate, nt, E, D, false, true, 1.0f, 0.0f));
        MOE_TRY(moe_ops_cuda.gather_rows(a->logits, a->logits_g, task_id, T, E));
    } else {
        MOE_TRY(moe_ops_cuda.matmul(a->logits, gin, p->gate, T, E, D, false, true, 1.0f, 0.0f));
    }
    MOE_TRY(moe_cuda_router_forward(&a->plan, a->logits, task_id, capacity, T, E, &cfg->router,
                                    training, step));
    memcpy(a->offsets_h, a->plan.offsets_h, sizeof(int) * (E + 1)); // read back by the router
    const int Tc = chunk_tokens(cfg);
    for (int t0 = 0; t0 < T; t0 += Tc) { // one chunk: all T tokens without mini_seq
        const int tc = T - t0 < Tc ? T - t0 : Tc;
        const size_t xo = (size_t)t0 * D;
        const int *off = NULL;
        MOE_TRY(chunk_experts(a, &off, x + xo, p, t0, tc));
        MOE_TRY(ops->unpermute_forward(y + xo, a->ye, a->row, a->plan.weight + (size_t)t0 * k, tc,
                                       k, D));
        if (Hs) {
            MOE_TRY(shared_forward(a, x + xo, p, tc));
            MOE_TRY(
                ops->matmul(y + xo, a->shared_h, p->shared_w2, tc, D, Hs, false, true, 1.0f, 1.0f));
        }
    }
    a->T = T;
    return 0;
}

int moe_layer_cuda_backward(float *dx, const moe_layer_params *dp, const float *dy, const float *x,
                            const int *task_id, int T, const moe_layer_params *p,
                            moe_layer_cuda_acts *a, float aux_scale, float z_scale) {
    const moe_layer_config *cfg = &a->cfg;
    const moe_ops *ops = a->ops;
    if (dx == dy) return moe_fail(MOE_EINVAL, "moe layer backward: dx aliases dy");
    if (a->T == 0 || T != a->T)
        return moe_fail(MOE_EINVAL, "moe layer backward: T = %d, last forward T = %d", T, a->T);
    const int D = cfg->D, E = cfg->E, k = cfg->router.top_k, Hs = cfg->H_shared;
    const int nt = cfg->n_tasks;
    if (nt > 0 && (!task_id || !dp->task_emb))
        return moe_fail(MOE_EINVAL, "moe layer backward: task routing (moe.task_layers) needs the "
                                    "task ids and the task_embedding gradient");
    MOE_TRY(ops->zero(a->dweight, (size_t)T * k));
    const int Tc = chunk_tokens(cfg);
    for (int t0 = 0; t0 < T; t0 += Tc) {
        const int tc = T - t0 < Tc ? T - t0 : Tc;
        const size_t xo = (size_t)t0 * D;
        const int *off = cfg->n_chunks > 1 ? a->coff_h : a->offsets_h;  // the forward's last
        if (Tc < T) MOE_TRY(chunk_experts(a, &off, x + xo, p, t0, tc)); // recompute the chunk
        MOE_TRY(experts_backward(a, dx + xo, dp, dy + xo, p, off, t0, tc));
        if (!Hs) continue;
        if (Tc < T) MOE_TRY(shared_forward(a, x + xo, p, tc));
        // moe_layer.c ffn_backward with din_beta = 1
        MOE_TRY(ops->matmul(a->sdh, dy + xo, p->shared_w2, tc, Hs, D, false, false, 1.0f, 0.0f));
        MOE_TRY(
            ops->matmul(dp->shared_w2, dy + xo, a->shared_h, D, Hs, tc, true, false, 1.0f, 1.0f));
        MOE_TRY(ops->zero(a->sdab, (size_t)tc * 2 * Hs));
        MOE_TRY(ops->swiglu_backward(a->sdab, a->sdh, a->shared_ab, tc, Hs));
        MOE_TRY(
            ops->matmul(dp->shared_w13, a->sdab, x + xo, 2 * Hs, D, tc, true, false, 1.0f, 1.0f));
        MOE_TRY(
            ops->matmul(dx + xo, a->sdab, p->shared_w13, tc, D, 2 * Hs, false, false, 1.0f, 1.0f));
    }
    // router and gate: dWg += dlogits^T x, dx += dlogits Wg
    MOE_TRY(ops->zero(a->dlogits, (size_t)T * E));
    MOE_TRY(moe_cuda_router_backward(a->dlogits, a->dweight, &a->plan, &cfg->router, aux_scale,
                                     z_scale));
    if (!nt && !a->jittered) {
        MOE_TRY(ops->matmul(dp->gate, a->dlogits, x, E, D, T, true, false, 1.0f, 1.0f));
        MOE_TRY(ops->matmul(dx, a->dlogits, p->gate, T, D, E, false, false, 1.0f, 1.0f));
        return 0;
    }
    // moe_layer.c: with task routing dlogits_G sums each task's token rows (the
    // broadcast's adjoint, a deterministic scatter-add) and the gate input's
    // gradient goes to task_embedding; under jitter dWg reads the jittered
    // input and dG = (dlogits_G Wg) * u.
    const float *dl = a->dlogits, *gin = x;
    float *dgin = dx;
    int G = T;
    if (nt) {
        MOE_TRY(ops->zero(a->dlogits_g, (size_t)nt * E));
        MOE_TRY(ops->scatter_add_rows(a->dlogits_g, a->dlogits, task_id, T, E));
        dl = a->dlogits_g, gin = p->task_emb, dgin = dp->task_emb, G = nt;
    }
    if (a->jittered) gin = a->gate_in;
    MOE_TRY(ops->matmul(dp->gate, dl, gin, E, D, G, true, false, 1.0f, 1.0f));
    if (a->jittered) {
        MOE_TRY(ops->matmul(a->dgate_in, dl, p->gate, G, D, E, false, false, 1.0f, 0.0f));
        MOE_TRY(ops->mul_add(dgin, a->dgate_in, a->noise, (size_t)G * D));
    } else {
        MOE_TRY(ops->matmul(dgin, dl, p->gate, G, D, E, false, false, 1.0f, 1.0f));
    }
    return 0;
}

#endif
