// The expert side of an expert-parallel layer on a device backend
// (moe/moe_ep_rows.h): the exchange of moe/src/moe_layer.c (dispatch,
// combine, redispatch: counts first, then rows; received rows lie source by
// source, each source's in local-expert order) by the group's device exchange
// (NCCL) when it has one, else with the rows staged through host memory and
// moved by the EP group's alltoallv (MPI), so ranks sharing one GPU work,
// where NCCL cannot run. Each source's rows are one grouped GEMM per
// projection over the local experts; the weight gradients of the sources add
// up in source order.
#include "moe/moe_ep_rows.h"
#include "moe/cuda_sizes.h"
#include "moe/error.h"

#include <stdlib.h>
#include <string.h>

int moe_ep_rows_alloc(moe_ep_rows *r, const moe_layer_config *cfg, const moe_ops *ops,
                      moe_ep_copy_fn down, moe_ep_copy_fn up) {
    memset(r, 0, sizeof *r);
    if (cfg->ep_size < 2)
        return moe_fail(MOE_EINVAL, "expert-parallel rows: ep_size = %d", cfg->ep_size);
    r->ops = ops, r->cfg = *cfg, r->down = down, r->up = up;
    const size_t ep = (size_t)cfg->ep_size, El = (size_t)moe_layer_local_experts(cfg);
    const size_t R = ep * (size_t)cfg->T_max * (size_t)cfg->router.top_k, D = (size_t)cfg->D;
    void **dev[MOE_CUDA_EP_BUFS] = {(void **)&r->xr,  (void **)&r->abr, (void **)&r->hr,
                                    (void **)&r->yr,  (void **)&r->dxr, (void **)&r->dhr,
                                    (void **)&r->dabr};
    size_t sizes[MOE_CUDA_EP_BUFS];
    moe_cuda_layer_ep_sizes(cfg, sizes); // the planner's figures
    for (int i = 0; i < MOE_CUDA_EP_BUFS; i++)
        if (sizes[i] && !(*dev[i] = ops->alloc(sizes[i])))
            return MOE_ENOMEM; // ops->alloc left the message
    r->dyr = r->yr; // yr lives from the expert GEMMs to the combine, dyr in the backward only
    r->stage_send = malloc(R * D * sizeof(float) + 1);
    r->stage_recv = malloc(R * D * sizeof(float) + 1);
    r->send_rows = calloc(ep, sizeof(int));
    r->recv_rows = calloc(ep, sizeof(int));
    r->recv_kept = calloc(ep * El, sizeof(int));
    r->blk_off = calloc(ep * El + 1, sizeof(int));
    if (!r->stage_send || !r->stage_recv || !r->send_rows || !r->recv_rows || !r->recv_kept ||
        !r->blk_off)
        return moe_fail(MOE_ENOMEM,
                        "moe layer: host staging of %zu rows of %zu floats (parallel.ep = %zu)", R,
                        D, ep);
    return 0;
}

void moe_ep_rows_free(moe_ep_rows *r) {
    if (r->ops) {
        void *dev[] = {r->xr, r->abr, r->hr, r->yr, r->dxr, r->dhr, r->dabr};
        for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
            if (dev[i]) r->ops->free(dev[i]);
    }
    free(r->stage_send);
    free(r->stage_recv);
    free(r->send_rows);
    free(r->recv_rows);
    free(r->recv_kept);
    free(r->blk_off);
    memset(r, 0, sizeof *r);
}

// Rows src [n, D] (backend) go out send_counts[i] to rank i; what arrives
// (recv_counts, at most cap rows) lands in dst (backend), source by source:
// device to device where the group has a device exchange, else staged.
static int exchange(moe_ep_rows *r, float *dst, const float *src, const int *send_counts,
                    int *recv_counts, size_t cap) {
    const moe_ep_group *g = r->ep;
    const size_t row = (size_t)r->cfg.D * sizeof(float);
    if (g->alltoallv_device)
        return g->alltoallv_device(g->ctx, src, send_counts, dst, recv_counts, cap, row);
    size_t n = 0, got = 0;
    for (int i = 0; i < g->size; i++)
        n += (size_t)send_counts[i];
    MOE_TRY(r->down(r->stage_send, src, n * row));
    MOE_TRY(g->alltoallv(g->ctx, r->stage_send, send_counts, r->stage_recv, recv_counts, cap, row));
    for (int i = 0; i < g->size; i++)
        got += (size_t)recv_counts[i];
    return r->up(dst, r->stage_recv, got * row);
}

// Each source's block of rows, one grouped GEMM over the local experts:
// c_(s,e) = a_(s,e) op(w_e), or with wgrad dW_e += a_(s,e)^T b_(s,e), source by
// source (the order of a single process's micro-batches).
static int per_source(moe_ep_rows *r, float *c, const float *in, const float *w, size_t stride,
                      int N, int K, bool trans_b) {
    const int El = moe_layer_local_experts(&r->cfg);
    for (int s = 0; s < r->cfg.ep_size; s++)
        MOE_TRY(r->ops->matmul_grouped(c, in, w, stride, r->blk_off + s * El, El, N, K, trans_b,
                                       1.0f, 0.0f));
    return 0;
}

static int per_source_wgrad(moe_ep_rows *r, float *dw, size_t stride, const float *dy,
                            const float *in, int M, int N) {
    const int El = moe_layer_local_experts(&r->cfg);
    for (int s = 0; s < r->cfg.ep_size; s++)
        MOE_TRY(r->ops->matmul_grouped_wgrad(dw, stride, dy, in, r->blk_off + s * El, El, M, N,
                                             1.0f, 1.0f));
    return 0;
}

int moe_ep_rows_forward(moe_ep_rows *r, float *ye, const float *xe, const int *offsets,
                        const moe_layer_params *p) {
    const moe_layer_config *cfg = &r->cfg;
    const moe_ep_group *g = r->ep;
    const int ep = cfg->ep_size, El = moe_layer_local_experts(cfg), E = cfg->E;
    const int D = cfg->D, H = cfg->H, rows_max = cfg->T_max * cfg->router.top_k;
    if (!g || g->size != ep || g->rank != cfg->ep_rank)
        return moe_fail(MOE_EINVAL, "moe layer: expert-parallel group missing or not %d ranks", ep);
    // counts: expert e's kept rows are its segment (offsets: the exclusive sum of kept)
    int kept[E], per_peer[ep], got[ep];
    for (int e = 0; e < E; e++)
        kept[e] = offsets[e + 1] - offsets[e];
    for (int i = 0; i < ep; i++) {
        per_peer[i] = El;
        r->send_rows[i] = offsets[(i + 1) * El] - offsets[i * El];
    }
    MOE_TRY(g->alltoallv(g->ctx, kept, per_peer, r->recv_kept, got, (size_t)ep * El, sizeof(int)));
    MOE_TRY(exchange(r, r->xr, xe, r->send_rows, r->recv_rows, (size_t)ep * rows_max));
    r->blk_off[0] = 0;
    for (int s = 0; s < ep; s++) {
        int want = 0;
        for (int le = 0; le < El; le++) {
            want += r->recv_kept[s * El + le];
            r->blk_off[s * El + le + 1] = r->blk_off[s * El + le] + r->recv_kept[s * El + le];
        }
        if (want != r->recv_rows[s])
            return moe_fail(MOE_EINVAL, "moe layer: rank %d sent %d rows but announced %d", s,
                            r->recv_rows[s], want);
    }
    const int R = r->blk_off[ep * El];
    // ab = xr [w1;w3]^T, h = SwiGLU(ab), yr = h w2^T, block by block
    MOE_TRY(per_source(r, r->abr, r->xr, p->experts, p->expert_numel, 2 * H, D, true));
    MOE_TRY(r->ops->swiglu_forward(r->hr, r->abr, R, H));
    MOE_TRY(per_source(r, r->yr, r->hr, p->experts + p->w2_offset, p->expert_numel, D, H, true));
    // combine: the outputs back to their tokens' ranks, into ye in expert order
    MOE_TRY(exchange(r, ye, r->yr, r->recv_rows, got, (size_t)rows_max));
    for (int i = 0; i < ep; i++)
        if (got[i] != r->send_rows[i])
            return moe_fail(MOE_EINVAL, "moe layer: rank %d returned %d rows of %d", i, got[i],
                            r->send_rows[i]);
    return 0;
}

int moe_ep_rows_backward(moe_ep_rows *r, float *dxe, const float *dye, const moe_layer_params *dp,
                         const moe_layer_params *p) {
    const moe_layer_config *cfg = &r->cfg;
    const int ep = cfg->ep_size, El = moe_layer_local_experts(cfg);
    const int D = cfg->D, H = cfg->H, rows_max = cfg->T_max * cfg->router.top_k;
    const int R = r->blk_off[ep * El];
    int got[ep];
    // redispatch: dye to the experts' ranks with the forward's counts
    MOE_TRY(exchange(r, r->dyr, dye, r->send_rows, got, (size_t)ep * rows_max));
    for (int s = 0; s < ep; s++)
        if (got[s] != r->recv_rows[s])
            return moe_fail(MOE_EINVAL, "moe layer: rank %d sent %d gradient rows of %d", s, got[s],
                            r->recv_rows[s]);
    const float *w2 = p->experts + p->w2_offset;
    float *dw2 = dp->experts + dp->w2_offset;
    MOE_TRY(per_source(r, r->dhr, r->dyr, w2, p->expert_numel, H, D, false));
    MOE_TRY(per_source_wgrad(r, dw2, dp->expert_numel, r->dyr, r->hr, D, H));
    MOE_TRY(r->ops->zero(r->dabr, (size_t)R * 2 * H));
    MOE_TRY(r->ops->swiglu_backward(r->dabr, r->dhr, r->abr, R, H));
    MOE_TRY(per_source_wgrad(r, dp->experts, dp->expert_numel, r->dabr, r->xr, 2 * H, D));
    MOE_TRY(per_source(r, r->dxr, r->dabr, p->experts, p->expert_numel, D, 2 * H, false));
    // combine: the input gradients back to their tokens' ranks, into dxe
    return exchange(r, dxe, r->dxr, r->recv_rows, got, (size_t)rows_max);
}
