// The expert side of an expert-parallel layer on a device backend
// (moe/moe_ep_rows.h): the exchange of moe/src/moe_layer.c (dispatch,
// combine, redispatch: counts first, then rows; received rows lie source by
// source, each source's in local-expert order) by the group's device exchange
// (NCCL) when it has one, else with the rows staged through host memory and
// moved by the EP group's alltoallv (MPI), so ranks sharing one GPU work,
// where NCCL cannot run. Each source's rows are one grouped GEMM per
// projection over the local experts; the weight gradients of the sources add
// up in source order.
//
// With cfg.overlap_degree = d > 1 the staged exchange runs in d rounds of
// peers (moe_ep_round_has): a round's rows are uploaded and its sources'
// GEMMs queued on the backend while the host moves the next round, and each
// round's results are read back behind an event, so the return exchange of
// round c starts while later rounds still compute (Tutel's overlap degree,
// arXiv 2206.03382, by whole sources here). Every source's GEMMs are the ones
// of d = 1 with the same rows, and the weight gradients still add up in
// source order after the rounds, so the bits do not depend on d.
#include "moe/moe_ep_rows.h"
#include "moe/cuda_sizes.h"
#include "moe/error.h"

#include <stdlib.h>
#include <string.h>

bool moe_ep_round_has(int n, int d, int c, int me, int peer, bool to) {
    const int q = to ? (peer - me + n) % n : (me - peer + n) % n;
    return (long)q * d >= (long)c * n && (long)q * d < (long)(c + 1) * n;
}

// Page-locked staging only for the overlapped exchange: it is scarce, and
// the one-shot exchange waits for every copy anyway.
static bool pinned(const moe_ep_rows *r) {
    return r->rounds > 1 && r->be.host_alloc;
}

static void *host_alloc(const moe_ep_rows *r, size_t bytes) {
    return pinned(r) ? r->be.host_alloc(bytes) : malloc(bytes);
}

static void host_free(const moe_ep_rows *r, void *p) {
    if (pinned(r))
        r->be.host_free(p);
    else
        free(p);
}

int moe_ep_rows_alloc(moe_ep_rows *r, const moe_layer_config *cfg, const moe_ops *ops,
                      const moe_ep_backend *be) {
    memset(r, 0, sizeof *r);
    if (cfg->ep_size < 2)
        return moe_fail(MOE_EINVAL, "expert-parallel rows: ep_size = %d", cfg->ep_size);
    r->ops = ops, r->cfg = *cfg, r->be = *be;
    if (!r->be.down_async) r->be.down_async = r->be.down;
    if (!r->be.up_async) r->be.up_async = r->be.up;
    r->rounds = cfg->overlap_degree > 1 ? cfg->overlap_degree : 1;
    if (r->rounds > cfg->ep_size)
        return moe_fail(MOE_EINVAL,
                        "moe layer: comm.overlap_degree = %d is more than parallel.ep = %d rounds",
                        r->rounds, cfg->ep_size);
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
    const size_t stage = R * D * sizeof(float) + 1;
    r->stage_send = host_alloc(r, stage);
    r->stage_recv = host_alloc(r, stage);
    r->send_rows = calloc(ep, sizeof(int));
    r->recv_rows = calloc(ep, sizeof(int));
    r->recv_kept = calloc(ep * El, sizeof(int));
    r->blk_off = calloc(ep * El + 1, sizeof(int));
    r->send_off = calloc(ep + 1, sizeof(int));
    r->recv_off = calloc(ep, sizeof(int));
    if (!r->stage_send || !r->stage_recv || !r->send_rows || !r->recv_rows || !r->recv_kept ||
        !r->blk_off || !r->send_off || !r->recv_off)
        return moe_fail(MOE_ENOMEM,
                        "moe layer: host staging of %zu rows of %zu floats (parallel.ep = %zu)", R,
                        D, ep);
    if (r->rounds == 1) return 0;
    r->stage_ret = host_alloc(r, stage);
    r->stage_pack = malloc(stage);
    r->cnt = calloc(ep, sizeof(int));
    r->events = calloc((size_t)r->rounds, sizeof(void *));
    if (!r->stage_ret || !r->stage_pack || !r->cnt || !r->events)
        return moe_fail(MOE_ENOMEM,
                        "moe layer: staging of the overlapped exchange (%zu rows of %zu floats, "
                        "comm.overlap_degree = %d)",
                        R, D, r->rounds);
    for (int c = 0; c < r->rounds && r->be.event_create; c++)
        MOE_TRY(r->be.event_create(&r->events[c]));
    return 0;
}

void moe_ep_rows_free(moe_ep_rows *r) {
    if (r->ops) {
        void *dev[] = {r->xr, r->abr, r->hr, r->yr, r->dxr, r->dhr, r->dabr};
        for (size_t i = 0; i < sizeof dev / sizeof *dev; i++)
            if (dev[i]) r->ops->free(dev[i]);
    }
    if (r->stage_send) host_free(r, r->stage_send);
    if (r->stage_recv) host_free(r, r->stage_recv);
    if (r->stage_ret) host_free(r, r->stage_ret);
    for (int c = 0; r->events && c < r->rounds; c++)
        if (r->events[c]) r->be.event_destroy(r->events[c]);
    free(r->events);
    free(r->stage_pack);
    free(r->send_off);
    free(r->recv_off);
    free(r->cnt);
    free(r->send_rows);
    free(r->recv_rows);
    free(r->recv_kept);
    free(r->blk_off);
    memset(r, 0, sizeof *r);
}

static int total(const int *counts, int n) {
    int t = 0;
    for (int i = 0; i < n; i++)
        t += counts[i];
    return t;
}

// Rows src [n, D] (backend) go out send_counts[i] to rank i; what arrives
// (want[i] rows from rank i, announced by the counts; at most cap rows) lands
// in dst (backend), source by source: device to device where the group has a
// device exchange, else staged.

static int exchange(moe_ep_rows *r, float *dst, const float *src, const int *send_counts,
                    const int *want, size_t cap) {
    const moe_ep_group *g = r->ep;
    const size_t row = (size_t)r->cfg.D * sizeof(float);
    const int n = g->size;
    int got[n];
    if (g->alltoallv_device) {
        MOE_TRY(g->alltoallv_device(g->ctx, src, send_counts, dst, got, cap, row));
    } else {
        MOE_TRY(r->be.down(r->stage_send, src, (size_t)total(send_counts, n) * row));
        MOE_TRY(g->alltoallv(g->ctx, r->stage_send, send_counts, r->stage_recv, got, cap, row));
        MOE_TRY(r->be.up(dst, r->stage_recv, (size_t)total(got, n) * row));
    }
    for (int i = 0; i < n; i++)
        if (got[i] != want[i])
            return moe_fail(MOE_EINVAL, "moe layer: rank %d sent %d rows, %d announced", i, got[i],
                            want[i]);
    return 0;
}

// ---- the overlapped exchange (rounds > 1) ----------------------------------------------

// Rows at host base + off[i] of the peers i that round c sends to (to) or
// returns to (!to), counts[i] each, packed in rank order into stage_pack;
// r->cnt gets the round's send counts (0 for the other peers).
static void pack_round(moe_ep_rows *r, int c, bool to, const float *base, const int *off,
                       const int *counts) {
    const int n = r->cfg.ep_size, me = r->cfg.ep_rank;
    const size_t D = (size_t)r->cfg.D;
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        r->cnt[i] = moe_ep_round_has(n, r->rounds, c, me, i, to) ? counts[i] : 0;
        if (r->cnt[i])
            memcpy(r->stage_pack + at * D, base + (size_t)off[i] * D,
                   (size_t)r->cnt[i] * D * sizeof(float));
        at += (size_t)r->cnt[i];
    }
}

// Round c of an exchange: the packed rows go out, what arrives (from the
// round's sources when to, else from its destinations: want[i] rows each)
// lands in host recv + *used and is queued for upload to dst + off[i] rows.
static int move_round(moe_ep_rows *r, int c, bool to, float *recv, size_t *used, float *dst,
                      const int *off, const int *want, size_t cap) {
    const moe_ep_group *g = r->ep;
    const int n = r->cfg.ep_size, me = r->cfg.ep_rank;
    const size_t D = (size_t)r->cfg.D, row = D * sizeof(float);
    int got[n];
    MOE_TRY(g->alltoallv(g->ctx, r->stage_pack, r->cnt, recv + *used * D, got, cap - *used, row));
    for (int i = 0; i < n; i++) {
        const bool in = moe_ep_round_has(n, r->rounds, c, me, i, !to);
        if (got[i] != (in ? want[i] : 0))
            return moe_fail(MOE_EINVAL, "moe layer: rank %d sent %d rows in round %d, expected %d",
                            i, got[i], c, in ? want[i] : 0);
        if (!got[i]) continue;
        MOE_TRY(r->be.up_async(dst + (size_t)off[i] * D, recv + *used * D, (size_t)got[i] * row));
        *used += (size_t)got[i];
    }
    return 0;
}

// Reads back source s's rows of from (backend) into stage_ret, queued.
static int read_back(moe_ep_rows *r, int s, const float *from) {
    const size_t D = (size_t)r->cfg.D, o = (size_t)r->recv_off[s] * D;
    return r->be.down_async(r->stage_ret + o, from + o,
                            (size_t)r->recv_rows[s] * D * sizeof(float));
}

static int mark(moe_ep_rows *r, int c) {
    return r->be.event_record ? r->be.event_record(r->events[c]) : 0;
}

static int wait_mark(moe_ep_rows *r, int c) {
    return r->be.event_wait ? r->be.event_wait(r->events[c]) : 0;
}

// Forward and backward of source s's rows (per_source's calls for one source).
static int source_forward(moe_ep_rows *r, int s, const moe_layer_params *p) {
    const int El = moe_layer_local_experts(&r->cfg), D = r->cfg.D, H = r->cfg.H;
    const int *off = r->blk_off + s * El;
    const size_t o = (size_t)off[0];
    MOE_TRY(r->ops->matmul_grouped(r->abr, r->xr, p->experts, p->expert_numel, off, El, 2 * H, D,
                                   true, 1.0f, 0.0f));
    if (r->recv_rows[s])
        MOE_TRY(r->ops->swiglu_forward(r->hr + o * H, r->abr + o * 2 * H, r->recv_rows[s], H));
    return r->ops->matmul_grouped(r->yr, r->hr, p->experts + p->w2_offset, p->expert_numel, off, El,
                                  D, H, true, 1.0f, 0.0f);
}

static int source_backward(moe_ep_rows *r, int s, const moe_layer_params *p) {
    const int El = moe_layer_local_experts(&r->cfg), D = r->cfg.D, H = r->cfg.H;
    const int *off = r->blk_off + s * El;
    const size_t o = (size_t)off[0];
    MOE_TRY(r->ops->matmul_grouped(r->dhr, r->dyr, p->experts + p->w2_offset, p->expert_numel, off,
                                   El, H, D, false, 1.0f, 0.0f));
    if (r->recv_rows[s])
        MOE_TRY(r->ops->swiglu_backward(r->dabr + o * 2 * H, r->dhr + o * H, r->abr + o * 2 * H,
                                        r->recv_rows[s], H));
    return r->ops->matmul_grouped(r->dxr, r->dabr, p->experts, p->expert_numel, off, El, D, 2 * H,
                                  false, 1.0f, 0.0f);
}

// The rows out (dispatch or redispatch: src, this rank's rows in destination
// order) round by round into in_dst, each round's sources computed by fn as
// they arrive and their results (res) read back behind the round's event.
static int rounds_out(moe_ep_rows *r, const float *src, float *in_dst, const float *res,
                      const moe_layer_params *p,
                      int (*fn)(moe_ep_rows *, int, const moe_layer_params *)) {
    const int n = r->cfg.ep_size, me = r->cfg.ep_rank, d = r->rounds;
    const size_t D = (size_t)r->cfg.D, R = (size_t)n * r->cfg.T_max * r->cfg.router.top_k;
    MOE_TRY(r->be.down(r->stage_send, src, (size_t)r->send_off[n] * D * sizeof(float)));
    size_t used = 0;
    for (int c = 0; c < d; c++) {
        pack_round(r, c, true, r->stage_send, r->send_off, r->send_rows);
        MOE_TRY(move_round(r, c, true, r->stage_recv, &used, in_dst, r->recv_off, r->recv_rows, R));
        for (int s = 0; s < n; s++)
            if (moe_ep_round_has(n, d, c, me, s, false)) MOE_TRY(fn(r, s, p));
        for (int s = 0; s < n; s++)
            if (moe_ep_round_has(n, d, c, me, s, false)) MOE_TRY(read_back(r, s, res));
        MOE_TRY(mark(r, c));
    }
    return 0;
}

// The results back to their tokens' ranks into out_dst (destination order),
// round c once its event has passed. stage_send is free again (its rows were
// packed): the returns land there.
static int rounds_back(moe_ep_rows *r, float *out_dst) {
    const size_t R = (size_t)r->cfg.ep_size * r->cfg.T_max * r->cfg.router.top_k;
    size_t used = 0;
    for (int c = 0; c < r->rounds; c++) {
        MOE_TRY(wait_mark(r, c));
        pack_round(r, c, false, r->stage_ret, r->recv_off, r->recv_rows);
        MOE_TRY(
            move_round(r, c, false, r->stage_send, &used, out_dst, r->send_off, r->send_rows, R));
    }
    return 0;
}

// The weight gradients, one grouped GEMM per source over the local experts:
// dW_e += a_(s,e)^T b_(s,e) source by source (the order of a single process's
// micro-batches).
static int per_source_wgrad(moe_ep_rows *r, float *dw, size_t stride, const float *dy,
                            const float *in, int M, int N) {
    const int El = moe_layer_local_experts(&r->cfg);
    for (int s = 0; s < r->cfg.ep_size; s++)
        MOE_TRY(r->ops->matmul_grouped_wgrad(dw, stride, dy, in, r->blk_off + s * El, El, M, N,
                                             1.0f, 1.0f));
    return 0;
}

static int weight_grads(moe_ep_rows *r, const moe_layer_params *dp) {
    const int D = r->cfg.D, H = r->cfg.H;
    MOE_TRY(
        per_source_wgrad(r, dp->experts + dp->w2_offset, dp->expert_numel, r->dyr, r->hr, D, H));
    return per_source_wgrad(r, dp->experts, dp->expert_numel, r->dabr, r->xr, 2 * H, D);
}

int moe_ep_rows_forward(moe_ep_rows *r, float *ye, const float *xe, const int *offsets,
                        const moe_layer_params *p) {
    const moe_layer_config *cfg = &r->cfg;
    const moe_ep_group *g = r->ep;
    const int ep = cfg->ep_size, El = moe_layer_local_experts(cfg), E = cfg->E;
    const int rows_max = cfg->T_max * cfg->router.top_k;
    if (!g || g->size != ep || g->rank != cfg->ep_rank)
        return moe_fail(MOE_EINVAL, "moe layer: expert-parallel group missing or not %d ranks", ep);
    // counts: expert e's kept rows are its segment (offsets: the exclusive sum of kept)
    int kept[E], per_peer[ep], got[ep];
    memset(per_peer, 0, sizeof per_peer); // filled below; gcc 12 cannot tell
    for (int e = 0; e < E; e++)
        kept[e] = offsets[e + 1] - offsets[e];
    for (int i = 0; i < ep; i++) {
        per_peer[i] = El;
        r->send_rows[i] = offsets[(i + 1) * El] - offsets[i * El];
    }
    MOE_TRY(g->alltoallv(g->ctx, kept, per_peer, r->recv_kept, got, (size_t)ep * El, sizeof(int)));
    // The blocks follow from the counts before any row moves: (source, local
    // expert) in order, each source's rows from send_off / recv_rows.
    r->blk_off[0] = r->send_off[0] = 0;
    for (int s = 0; s < ep; s++) {
        r->send_off[s + 1] = r->send_off[s] + r->send_rows[s];
        r->recv_off[s] = r->blk_off[s * El];
        r->recv_rows[s] = 0;
        for (int le = 0; le < El; le++) {
            r->recv_rows[s] += r->recv_kept[s * El + le];
            r->blk_off[s * El + le + 1] = r->blk_off[s * El + le] + r->recv_kept[s * El + le];
        }
    }
    if (r->rounds > 1) {
        MOE_TRY(rounds_out(r, xe, r->xr, r->yr, p, source_forward));
        return rounds_back(r, ye);
    }
    MOE_TRY(exchange(r, r->xr, xe, r->send_rows, r->recv_rows, (size_t)ep * rows_max));
    for (int s = 0; s < ep; s++)
        MOE_TRY(source_forward(r, s, p));
    // combine: the outputs back to their tokens' ranks, into ye in expert order
    return exchange(r, ye, r->yr, r->recv_rows, r->send_rows, (size_t)rows_max);
}

int moe_ep_rows_backward(moe_ep_rows *r, float *dxe, const float *dye, const moe_layer_params *dp,
                         const moe_layer_params *p) {
    const moe_layer_config *cfg = &r->cfg;
    const int ep = cfg->ep_size, El = moe_layer_local_experts(cfg);
    const int H = cfg->H, rows_max = cfg->T_max * cfg->router.top_k;
    const int R = r->blk_off[ep * El];
    // dH, dAB and dX source by source, then the weight gradients in source
    // order; overlapped, each source as its rows arrive, and the weight
    // gradients queued before the returns so they compute while rows move
    MOE_TRY(r->ops->zero(r->dabr, (size_t)R * 2 * H));
    if (r->rounds > 1) {
        MOE_TRY(rounds_out(r, dye, r->dyr, r->dxr, p, source_backward));
        MOE_TRY(weight_grads(r, dp));
        return rounds_back(r, dxe);
    }
    // redispatch: dye to the experts' ranks with the forward's counts
    MOE_TRY(exchange(r, r->dyr, dye, r->send_rows, r->recv_rows, (size_t)ep * rows_max));
    for (int s = 0; s < ep; s++)
        MOE_TRY(source_backward(r, s, p));
    MOE_TRY(weight_grads(r, dp));
    // combine: the input gradients back to their tokens' ranks, into dxe
    return exchange(r, dxe, r->dxr, r->recv_rows, r->send_rows, (size_t)rows_max);
}
