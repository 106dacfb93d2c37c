// Expert parallelism of the CUDA MoE layer (moe/moe_layer_cuda.h): the
// exchange of moe/src/moe_layer.c (dispatch, combine, redispatch: counts
// first, then rows; received rows lie source by source, each source's in
// local-expert order) by the group's device exchange (NCCL) when it has one,
// else with the rows staged through host memory and moved by the EP group's
// alltoallv (MPI), so ranks sharing one GPU work, where NCCL cannot run. Each source's rows are one
// grouped GEMM per projection over the local experts; the weight gradients of the sources add up in
// source order.
#include "moe/error.h"
#include "moe/moe_layer_cuda.h"

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#include "moe/cuda_sizes.h"

#include <stdlib.h>
#include <string.h>

int moe_layer_cuda_ep_alloc(moe_layer_cuda_acts *a) {
    const moe_layer_config *cfg = &a->cfg;
    const size_t ep = (size_t)cfg->ep_size, El = (size_t)moe_layer_local_experts(cfg);
    const size_t R = ep * (size_t)cfg->T_max * (size_t)cfg->router.top_k, D = (size_t)cfg->D;
    void **dev[MOE_CUDA_EP_BUFS] = {(void **)&a->xr,  (void **)&a->abr, (void **)&a->hr,
                                    (void **)&a->yr,  (void **)&a->dxr, (void **)&a->dhr,
                                    (void **)&a->dabr};
    size_t sizes[MOE_CUDA_EP_BUFS];
    moe_cuda_layer_ep_sizes(cfg, sizes); // the planner's figures
    for (int i = 0; i < MOE_CUDA_EP_BUFS; i++)
        if (sizes[i] && !(*dev[i] = a->ops->alloc(sizes[i])))
            return MOE_ENOMEM; // ops->alloc left the message
    a->dyr = a->yr; // yr lives from the expert GEMMs to the combine, dyr in the backward only
    a->stage_send = malloc(R * D * sizeof(float) + 1);
    a->stage_recv = malloc(R * D * sizeof(float) + 1);
    a->send_rows = calloc(ep, sizeof(int));
    a->recv_rows = calloc(ep, sizeof(int));
    a->recv_kept = calloc(ep * El, sizeof(int));
    a->blk_off = calloc(ep * El + 1, sizeof(int));
    if (!a->stage_send || !a->stage_recv || !a->send_rows || !a->recv_rows || !a->recv_kept ||
        !a->blk_off)
        return moe_fail(MOE_ENOMEM,
                        "moe layer on the GPU: host staging of %zu rows of %zu floats "
                        "(parallel.ep = %zu)",
                        R, D, ep);
    return 0;
}

void moe_layer_cuda_ep_free(moe_layer_cuda_acts *a) {
    void *dev[] = {a->xr, a->abr, a->hr, a->yr, a->dxr, a->dhr, a->dabr};
    for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
        if (dev[i]) a->ops->free(dev[i]);
    free(a->stage_send);
    free(a->stage_recv);
    free(a->send_rows);
    free(a->recv_rows);
    free(a->recv_kept);
    free(a->blk_off);
}

// Rows src [n, D] (device) go out send_counts[r] to rank r; what arrives
// (recv_counts, at most cap rows) lands in dst (device), source by source:
// device to device where the group has a device exchange, else staged.
static int exchange(moe_layer_cuda_acts *a, float *dst, const float *src, const int *send_counts,
                    int *recv_counts, size_t cap) {
    const moe_ep_group *g = a->ep;
    const size_t row = (size_t)a->cfg.D * sizeof(float);
    if (g->alltoallv_device)
        return g->alltoallv_device(g->ctx, src, send_counts, dst, recv_counts, cap, row);
    size_t n = 0, got = 0;
    for (int r = 0; r < g->size; r++)
        n += (size_t)send_counts[r];
    MOE_TRY(moe_cuda_download(a->stage_send, src, n * row));
    MOE_TRY(g->alltoallv(g->ctx, a->stage_send, send_counts, a->stage_recv, recv_counts, cap, row));
    for (int r = 0; r < g->size; r++)
        got += (size_t)recv_counts[r];
    return moe_cuda_upload(dst, a->stage_recv, got * row);
}

// Each source's block of rows, one grouped GEMM over the local experts:
// c_(s,e) = a_(s,e) op(w_e), or with wgrad dW_e += a_(s,e)^T b_(s,e), source by
// source (the order of a single process's micro-batches).
static int per_source(moe_layer_cuda_acts *a, float *c, const float *in, const float *w,
                      size_t stride, int N, int K, bool trans_b, float beta) {
    const int El = moe_layer_local_experts(&a->cfg);
    for (int s = 0; s < a->cfg.ep_size; s++)
        MOE_TRY(a->ops->matmul_grouped(c, in, w, stride, a->blk_off + s * El, El, N, K, trans_b,
                                       1.0f, beta));
    return 0;
}

static int per_source_wgrad(moe_layer_cuda_acts *a, float *dw, size_t stride, const float *dy,
                            const float *in, int M, int N) {
    const int El = moe_layer_local_experts(&a->cfg);
    for (int s = 0; s < a->cfg.ep_size; s++)
        MOE_TRY(a->ops->matmul_grouped_wgrad(dw, stride, dy, in, a->blk_off + s * El, El, M, N,
                                             1.0f, 1.0f));
    return 0;
}

int moe_layer_cuda_ep_forward(moe_layer_cuda_acts *a, const moe_layer_params *p) {
    const moe_layer_config *cfg = &a->cfg;
    const moe_ep_group *g = a->ep;
    const int ep = cfg->ep_size, El = moe_layer_local_experts(cfg), E = cfg->E;
    const int D = cfg->D, H = cfg->H, rows_max = cfg->T_max * cfg->router.top_k;
    if (!g || g->size != ep || g->rank != cfg->ep_rank)
        return moe_fail(MOE_EINVAL,
                        "moe layer on the GPU: expert-parallel group missing or not "
                        "%d ranks",
                        ep);
    // counts: expert e's kept rows are its segment (offsets are the exclusive sum of kept)
    int kept[E], per_peer[ep], got[ep];
    for (int e = 0; e < E; e++)
        kept[e] = a->offsets_h[e + 1] - a->offsets_h[e];
    for (int r = 0; r < ep; r++) {
        per_peer[r] = El;
        a->send_rows[r] = a->offsets_h[(r + 1) * El] - a->offsets_h[r * El];
    }
    MOE_TRY(g->alltoallv(g->ctx, kept, per_peer, a->recv_kept, got, (size_t)ep * El, sizeof(int)));
    MOE_TRY(exchange(a, a->xr, a->xe, a->send_rows, a->recv_rows, (size_t)ep * rows_max));
    a->blk_off[0] = 0;
    for (int s = 0; s < ep; s++) {
        int want = 0;
        for (int le = 0; le < El; le++) {
            want += a->recv_kept[s * El + le];
            a->blk_off[s * El + le + 1] = a->blk_off[s * El + le] + a->recv_kept[s * El + le];
        }
        if (want != a->recv_rows[s])
            return moe_fail(MOE_EINVAL,
                            "moe layer on the GPU: rank %d sent %d rows but announced %d", s,
                            a->recv_rows[s], want);
    }
    const int R = a->blk_off[ep * El];
    // ab = xr [w1;w3]^T, h = SwiGLU(ab), yr = h w2^T, block by block
    MOE_TRY(per_source(a, a->abr, a->xr, p->experts, p->expert_numel, 2 * H, D, true, 0.0f));
    MOE_TRY(a->ops->swiglu_forward(a->hr, a->abr, R, H));
    MOE_TRY(
        per_source(a, a->yr, a->hr, p->experts + p->w2_offset, p->expert_numel, D, H, true, 0.0f));
    // combine: the outputs back to their tokens' ranks, into ye in expert order
    MOE_TRY(exchange(a, a->ye, a->yr, a->recv_rows, got, (size_t)rows_max));
    for (int r = 0; r < ep; r++)
        if (got[r] != a->send_rows[r])
            return moe_fail(MOE_EINVAL, "moe layer on the GPU: rank %d returned %d rows of %d", r,
                            got[r], a->send_rows[r]);
    return 0;
}

int moe_layer_cuda_ep_backward(moe_layer_cuda_acts *a, const moe_layer_params *dp,
                               const moe_layer_params *p) {
    const moe_layer_config *cfg = &a->cfg;
    const int ep = cfg->ep_size, El = moe_layer_local_experts(cfg);
    const int D = cfg->D, H = cfg->H, rows_max = cfg->T_max * cfg->router.top_k;
    const int R = a->blk_off[ep * El];
    int got[ep];
    // redispatch: dye to the experts' ranks with the forward's counts
    MOE_TRY(exchange(a, a->dyr, a->dye, a->send_rows, got, (size_t)ep * rows_max));
    for (int s = 0; s < ep; s++)
        if (got[s] != a->recv_rows[s])
            return moe_fail(MOE_EINVAL, "moe layer on the GPU: rank %d sent %d gradient rows of %d",
                            s, got[s], a->recv_rows[s]);
    const float *w2 = p->experts + p->w2_offset;
    float *dw2 = dp->experts + dp->w2_offset;
    MOE_TRY(per_source(a, a->dhr, a->dyr, w2, p->expert_numel, H, D, false, 0.0f));
    MOE_TRY(per_source_wgrad(a, dw2, dp->expert_numel, a->dyr, a->hr, D, H));
    MOE_TRY(a->ops->zero(a->dabr, (size_t)R * 2 * H));
    MOE_TRY(a->ops->swiglu_backward(a->dabr, a->dhr, a->abr, R, H));
    MOE_TRY(per_source_wgrad(a, dp->experts, dp->expert_numel, a->dabr, a->xr, 2 * H, D));
    MOE_TRY(per_source(a, a->dxr, a->dabr, p->experts, p->expert_numel, D, 2 * H, false, 0.0f));
    // combine: the input gradients back to their tokens' ranks, into dxe
    MOE_TRY(exchange(a, a->dxe, a->dxr, a->recv_rows, got, (size_t)rows_max));
    return 0;
}

#endif
