// The MoE feed-forward layer on the op table: Mixtral top-k SwiGLU experts
// (arXiv 2401.04088), Switch jitter on the router input (arXiv 2101.03961),
// shared expert (DeepSpeed-MoE PR-MoE, arXiv 2201.05596) and task-level routing
// (Task-MoE, arXiv 2110.03742). Shapes and semantics: moe/moe_layer.h.
#include "moe/moe_layer.h"
#include "moe/error.h"
#include "moe_dispatch_node.h"
#include "moe_dispatch_place.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

// ---- config and parameter layout ----------------------------------------------------

// Plan entries per token (top_k, or E under expert choice) and the most kept
// rows of T tokens (T * top_k, or E * C): router.h.
static int plan_k(const moe_layer_config *cfg) {
    return moe_router_plan_k(&cfg->router, cfg->E);
}

int moe_layer_config_check(const moe_layer_config *cfg) {
    if (!cfg) return moe_fail(MOE_EINVAL, "moe layer: NULL config");
    if (cfg->T_max < 1) return moe_fail(MOE_EINVAL, "moe layer: T_max = %d < 1", cfg->T_max);
    if (cfg->D < 1) return moe_fail(MOE_EINVAL, "moe layer: D = %d < 1", cfg->D);
    if (cfg->H < 1) return moe_fail(MOE_EINVAL, "moe layer: H = %d < 1", cfg->H);
    if (cfg->E < 1) return moe_fail(MOE_EINVAL, "moe layer: E = %d < 1", cfg->E);
    if (cfg->H_shared < 0)
        return moe_fail(MOE_EINVAL, "moe layer: H_shared = %d < 0", cfg->H_shared);
    if (cfg->n_tasks < 0) return moe_fail(MOE_EINVAL, "moe layer: n_tasks = %d < 0", cfg->n_tasks);
    MOE_TRY(moe_router_config_check(&cfg->router, cfg->E));
    if (cfg->n_tasks > 0 && cfg->router.type == MOE_ROUTER_EXPERT_CHOICE)
        return moe_fail(MOE_EINVAL, "moe layer: router.type = expert_choice cannot route by task "
                                    "(moe.task_layers)");
    if (cfg->n_chunks < 0 || cfg->n_chunks > cfg->T_max || (cfg->n_chunks > 1 && cfg->ep_size > 1))
        return moe_fail(MOE_EINVAL,
                        "moe layer: %d chunks (T_max %d) with expert parallelism %d: chunking "
                        "needs 1..T_max chunks and no expert parallelism",
                        cfg->n_chunks, cfg->T_max, cfg->ep_size);
    if (cfg->ep_size < 0 || (cfg->ep_size > 1 && (cfg->E % cfg->ep_size || cfg->ep_rank < 0 ||
                                                  cfg->ep_rank >= cfg->ep_size)))
        return moe_fail(MOE_EINVAL,
                        "moe layer: %d experts cannot be sharded over %d ranks (rank %d)", cfg->E,
                        cfg->ep_size, cfg->ep_rank);
    long k = plan_k(cfg);
    long Hm = cfg->H > cfg->H_shared ? cfg->H : cfg->H_shared;
    // Row indices are int; element offsets are size_t but sizes stay int in the op table.
    if ((long)cfg->T_max * k > INT_MAX / 2 || (long)cfg->T_max * 2 * Hm > INT_MAX ||
        2L * Hm * cfg->D > INT_MAX || (long)cfg->T_max * cfg->E > INT_MAX)
        return moe_fail(MOE_EINVAL,
                        "moe layer: T_max = %d with D = %d, H = %ld, E = %d, k = %ld "
                        "overflows int indexing",
                        cfg->T_max, cfg->D, Hm, cfg->E, k);
    return 0;
}

size_t moe_layer_num_params(const moe_layer_config *cfg) {
    size_t D = (size_t)cfg->D;
    return (size_t)cfg->E * D + (size_t)cfg->n_tasks * D + 3 * (size_t)cfg->H_shared * D +
           (size_t)moe_layer_local_experts(cfg) * 3 * (size_t)cfg->H * D;
}

int moe_layer_params_view(moe_layer_params *p, float *base, const moe_layer_config *cfg) {
    if (!p || !base || !cfg) return moe_fail(MOE_EINVAL, "moe layer params view: NULL argument");
    size_t D = (size_t)cfg->D, Hs = (size_t)cfg->H_shared;
    float *q = base;
    p->gate = q;
    q += (size_t)cfg->E * D;
    p->task_emb = cfg->n_tasks > 0 ? q : NULL;
    q += (size_t)cfg->n_tasks * D;
    p->shared_w13 = Hs ? q : NULL;
    p->shared_w2 = Hs ? q + 2 * Hs * D : NULL;
    q += 3 * Hs * D;
    p->experts = q;
    p->expert_numel = 3 * (size_t)cfg->H * D;
    p->w2_offset = 2 * (size_t)cfg->H * D;
    return 0;
}

int moe_layer_param_table(moe_param_table *t, const char *prefix, const moe_layer_config *cfg) {
    int64_t D = cfg->D, H = cfg->H, Hs = cfg->H_shared;
    MOE_TRY(moe_param_table_add(t, prefix, "gate.weight", 2, (int64_t[]){cfg->E, D}));
    if (cfg->n_tasks > 0)
        MOE_TRY(moe_param_table_add(t, prefix, "task_embedding.weight", 2,
                                    (int64_t[]){cfg->n_tasks, D}));
    if (Hs > 0) {
        MOE_TRY(moe_param_table_add(t, prefix, "shared_expert.w1.weight", 2, (int64_t[]){Hs, D}));
        MOE_TRY(moe_param_table_add(t, prefix, "shared_expert.w3.weight", 2, (int64_t[]){Hs, D}));
        MOE_TRY(moe_param_table_add(t, prefix, "shared_expert.w2.weight", 2, (int64_t[]){D, Hs}));
    }
    static const char *const names[3] = {"w1", "w3", "w2"};
    const int e0 = moe_layer_first_expert(cfg);
    for (int e = e0; e < e0 + moe_layer_local_experts(cfg); e++)
        for (int m = 0; m < 3; m++) {
            char name[64];
            snprintf(name, sizeof name, "experts.%d.%s.weight", e, names[m]);
            int64_t shape[2] = {m < 2 ? H : D, m < 2 ? D : H};
            MOE_TRY(moe_param_table_add(t, prefix, name, 2, shape));
        }
    return 0;
}

// ---- activations -----------------------------------------------------------------------

size_t moe_layer_expert_rows(const moe_layer_config *cfg) {
    const size_t T = (size_t)cfg->T_max, E = (size_t)cfg->E, k = (size_t)plan_k(cfg);
    // Expert-side buffers hold one chunk: Tc tokens, Tc*k rows.
    const size_t Tc = cfg->n_chunks > 1 ? (T + cfg->n_chunks - 1) / cfg->n_chunks : T;
    // Expert choice: an expert takes C of all T tokens, and at most Tc of a chunk's.
    if (cfg->router.type == MOE_ROUTER_EXPERT_CHOICE) {
        const size_t C = (size_t)moe_expert_choice_capacity(&cfg->router, (int)T, cfg->E);
        return E * (C < Tc ? C : Tc);
    }
    return Tc * k;
}

// Every activation and scratch buffer of the layer, in one list: with total
// NULL it allocates them (a->field), else it only adds the bytes the backend
// would reserve to *total, so the memory estimate is the allocation itself.
static int layer_buffers(moe_layer_acts *a, const moe_layer_config *cfg, const moe_ops *ops,
                         size_t *total) {
    size_t T = (size_t)cfg->T_max, D = (size_t)cfg->D, H = (size_t)cfg->H, E = (size_t)cfg->E;
    size_t k = (size_t)plan_k(cfg), Hs = (size_t)cfg->H_shared;
    size_t nt = (size_t)cfg->n_tasks;
    size_t G = nt ? nt : T, jit = cfg->router.noise == MOE_NOISE_JITTER ? G * D : 0;
    // Expert-side buffers hold one chunk: Tc tokens, Tc*k rows.
    const int chunked = cfg->n_chunks > 1;
    size_t Tc = chunked ? (T + cfg->n_chunks - 1) / cfg->n_chunks : T;
    size_t Hm = H > Hs ? H : Hs;
    const size_t rows = moe_layer_expert_rows(cfg);
    size_t bytes = 0;
#define ALLOC(field, n)                                                                            \
    do {                                                                                           \
        bytes = (n) * sizeof *a->field;                                                            \
        if (total && bytes) *total += ops->alloc_size(bytes);                                      \
        if (!total && bytes && !(a->field = ops->alloc(bytes))) goto fail;                         \
    } while (0)
    ALLOC(noise, jit);
    ALLOC(gate_in, jit);
    ALLOC(logits_g, nt * E);
    ALLOC(logits, T * E);
    ALLOC(row, chunked ? 0 : Tc * k); // one entry per (token, plan entry)
    ALLOC(crow, chunked ? Tc * k : 0);
    ALLOC(coff, chunked ? E + 1 : 0);
    ALLOC(xe, rows * D);
    ALLOC(ab, rows * 2 * H);
    ALLOC(h, rows * H);
    ALLOC(ye, rows * D);
    ALLOC(shared_ab, Tc * 2 * Hs);
    ALLOC(shared_h, Tc * Hs);
    ALLOC(dlogits, T * E);
    ALLOC(dlogits_g, nt * E);
    ALLOC(dweight, T * k);
    ALLOC(dye, rows * D);
    ALLOC(dxe, rows * D);
    ALLOC(dh, Tc * Hm);
    ALLOC(dab, Tc * 2 * Hm);
    ALLOC(dgate_in, jit);
    const size_t ep = cfg->ep_size > 1 ? (size_t)cfg->ep_size : 1;
    const size_t El = (size_t)moe_layer_local_experts(cfg), R = ep * rows;
    ALLOC(blk_off, ep * El);
    ALLOC(blk_n, ep * El);
    ALLOC(send_rows, ep);
    ALLOC(recv_rows, ep);
    ALLOC(recv_kept, ep * El);
    if (ep > 1) {
        ALLOC(xr, R * D);
        ALLOC(abr, R * 2 * H);
        ALLOC(hr, R * H);
        ALLOC(yr, R * D);
        ALLOC(dyr, R * D);
        ALLOC(dxr, R * D);
        ALLOC(dw, 3 * H * D);
    } else if (!total) { // the expert side is the local side
        a->xr = a->xe, a->abr = a->ab, a->hr = a->h, a->yr = a->ye;
        a->dyr = a->dye, a->dxr = a->dxe;
    }
#undef ALLOC
    return 0;
fail:
    return moe_fail(MOE_ENOMEM, "moe layer acts: cannot allocate %zu bytes (%s backend)", bytes,
                    ops->name);
}

size_t moe_layer_acts_bytes(const moe_layer_config *cfg, const moe_ops *ops) {
    moe_layer_acts dummy;
    size_t total = moe_plan_bytes(cfg->T_max, cfg->E, plan_k(cfg));
    layer_buffers(&dummy, cfg, ops, &total);
    return total;
}

int moe_layer_acts_alloc(moe_layer_acts *a, const moe_layer_config *cfg, const moe_ops *ops) {
    if (!a || !ops) return moe_fail(MOE_EINVAL, "moe layer acts: NULL argument");
    memset(a, 0, sizeof *a);
    MOE_TRY(moe_layer_config_check(cfg));
    a->ops = ops;
    a->cfg = *cfg;
    int rc = moe_plan_alloc(&a->plan, cfg->T_max, cfg->E, plan_k(cfg));
    if (rc < 0) return moe_trace(rc, __FILE__, __LINE__);
    rc = layer_buffers(a, cfg, ops, NULL);
    if (rc < 0) moe_layer_acts_free(a);
    return rc;
}

void moe_layer_acts_free(moe_layer_acts *a) {
    if (!a) return;
    if (a->ops) {
        void *bufs[] = {a->noise,    a->gate_in, a->logits_g,  a->logits,  a->row,
                        a->xe,       a->ab,      a->h,         a->ye,      a->shared_ab,
                        a->shared_h, a->dlogits, a->dlogits_g, a->dweight, a->dye,
                        a->dxe,      a->dh,      a->dab,       a->dgate_in};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            a->ops->free(bufs[i]);
        void *idx[] = {a->blk_off,   a->blk_n, a->send_rows, a->recv_rows,
                       a->recv_kept, a->crow,  a->coff};
        for (size_t i = 0; i < sizeof idx / sizeof idx[0]; i++)
            a->ops->free(idx[i]);
        moe_node_state_free(a);
        if (a->cfg.ep_size > 1) {
            void *ep[] = {a->xr, a->abr, a->hr, a->yr, a->dyr, a->dxr, a->dw};
            for (size_t i = 0; i < sizeof ep / sizeof ep[0]; i++)
                a->ops->free(ep[i]);
        }
    }
    moe_plan_free(&a->plan);
    memset(a, 0, sizeof *a);
}

// ---- timing ------------------------------------------------------------------------------

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Adds the seconds since *t0 to *acc and restarts the clock (no-op without timing).
static void lap(moe_layer_timing *tm, double *acc, double *t0) {
    if (!tm) return;
    double t = now_s();
    *acc += t - *t0;
    *t0 = t;
}
#define LAP(field) lap(tm, tm ? &tm->field : NULL, &t0)

// ---- forward -------------------------------------------------------------------------

// The plan's rows must fit the expert-order buffers: expert e's kept rows are
// offsets[e] .. offsets[e] + kept[e] - 1, inside its segment and below rows_max.
static int check_plan(const moe_plan *pl, int T, int E, int k) {
    if (pl->offsets[0] != 0 || pl->offsets[E] > T * k)
        return moe_fail(MOE_EINVAL, "moe layer: router plan uses %d rows, more than T*k = %d",
                        pl->offsets[E], T * k);
    for (int e = 0; e < E; e++)
        if (pl->kept[e] < 0 || pl->kept[e] > T || pl->offsets[e] + pl->kept[e] > pl->offsets[e + 1])
            return moe_fail(MOE_EINVAL,
                            "moe layer: router plan expert %d keeps %d rows in segment [%d, %d)", e,
                            pl->kept[e], pl->offsets[e], pl->offsets[e + 1]);
    return 0;
}

// Expert parallelism, forward: rows of expert e go to the rank that holds it.
// Counts per (source, local expert) travel first, so every owner knows its
// blocks; then the rows. Without expert parallelism the blocks are the plan's.
static int dispatch(moe_layer_acts *a) {
    const moe_layer_config *cfg = &a->cfg;
    const int El = moe_layer_local_experts(cfg), D = cfg->D;
    const moe_plan *pl = &a->plan;
    if (cfg->ep_size <= 1) {
        for (int e = 0; e < El; e++)
            a->blk_off[e] = pl->offsets[e], a->blk_n[e] = pl->kept[e];
        return 0;
    }
    if (moe_place_on(a)) return moe_place_dispatch(a);
    const moe_ep_group *g = a->ep;
    if (!g || g->size != cfg->ep_size || g->rank != cfg->ep_rank)
        return moe_fail(MOE_EINVAL, "moe layer: expert-parallel group missing or not %d ranks",
                        cfg->ep_size);
    int per_peer[g->size];
    for (int r = 0; r < g->size; r++) {
        per_peer[r] = El;
        a->send_rows[r] = pl->offsets[(r + 1) * El] - pl->offsets[r * El];
    }
    int got[g->size];
    MOE_TRY(g->alltoallv(g->ctx, pl->kept, per_peer, a->recv_kept, got, (size_t)g->size * El,
                         sizeof(int)));
    const size_t cap = (size_t)g->size * moe_router_rows_max(&cfg->router, cfg->T_max, cfg->E);
    MOE_TRY(g->alltoallv(g->ctx, a->xe, a->send_rows, a->xr, a->recv_rows, cap,
                         (size_t)D * sizeof(float)));
    // Received rows lie source by source, each source's in local-expert order.
    int off = 0;
    for (int s = 0; s < g->size; s++) {
        int want = 0;
        for (int le = 0; le < El; le++) {
            a->blk_off[s * El + le] = off;
            a->blk_n[s * El + le] = a->recv_kept[s * El + le];
            off += a->recv_kept[s * El + le];
            want += a->recv_kept[s * El + le];
        }
        if (want != a->recv_rows[s])
            return moe_fail(MOE_EINVAL, "moe layer: rank %d sent %d rows but announced %d", s,
                            a->recv_rows[s], want);
    }
    return 0;
}

// Sends the expert side's rows (from) back to their tokens' ranks (into to).
static int combine(moe_layer_acts *a, const float *from, float *to) {
    const moe_layer_config *cfg = &a->cfg;
    if (cfg->ep_size <= 1) return 0; // aliases: nothing to move
    if (moe_place_on(a)) return moe_place_combine(a, from, to);
    int got[cfg->ep_size];
    MOE_TRY(a->ep->alltoallv(a->ep->ctx, from, a->recv_rows, to, got,
                             (size_t)moe_router_rows_max(&cfg->router, cfg->T_max, cfg->E),
                             (size_t)cfg->D * sizeof(float)));
    return 0;
}

// Local-side rows (from) to the expert side (to), with the forward's counts.
static int redispatch(moe_layer_acts *a, float *from, float *to) {
    const moe_layer_config *cfg = &a->cfg;
    if (cfg->ep_size <= 1) return 0;
    if (moe_place_on(a)) return moe_place_redispatch(a, from, to);
    int got[cfg->ep_size];
    MOE_TRY(a->ep->alltoallv(a->ep->ctx, from, a->send_rows, to, got,
                             (size_t)cfg->ep_size *
                                 moe_router_rows_max(&cfg->router, cfg->T_max, cfg->E),
                             (size_t)cfg->D * sizeof(float)));
    return 0;
}

static int check_tasks(const int *task_id, int T, int n_tasks) {
    if (!task_id) return moe_fail(MOE_EINVAL, "moe layer: task routing needs task_id");
    for (int t = 0; t < T; t++)
        if (task_id[t] < 0 || task_id[t] >= n_tasks)
            return moe_fail(MOE_EINVAL, "moe layer: task_id[%d] = %d not in 0..%d", t, task_id[t],
                            n_tasks - 1);
    return 0;
}

// ---- mini-sequence chunks ---------------------------------------------------------------

// Forward of one SwiGLU FFN with fused [w1;w3] (n rows): ab = in w13^T
// [n, 2H]; h = swiglu(ab) [n, H]; out = h w2^T [n, D] (overwritten).
static int ffn_forward(const moe_ops *ops, float *out, float *ab, float *h, const float *in,
                       const float *w13, const float *w2, int n, int D, int H) {
    MOE_TRY(ops->matmul(ab, in, w13, n, 2 * H, D, false, true, 1.0f, 0.0f));
    MOE_TRY(ops->swiglu_forward(h, ab, n, H));
    MOE_TRY(ops->matmul(out, h, w2, n, D, H, false, true, 1.0f, 0.0f));
    return 0;
}

// The experts' forward on one chunk: xe, ab, h, ye for its rows.
static int chunk_experts(moe_layer_acts *a, const float *x, const moe_layer_params *p, int t0,
                         int tc) {
    const moe_ops *ops = a->ops;
    const int D = a->cfg.D, H = a->cfg.H, k = plan_k(&a->cfg);
    // the kept assignments of tokens [t0, t0 + tc) in expert order, token
    // order inside an expert: a->crow, a->coff
    MOE_TRY(ops->chunk_rows(a->crow, a->coff, a->plan.expert + (size_t)t0 * k, tc * k, a->cfg.E));
    MOE_TRY(ops->permute_forward(a->xe, x + (size_t)t0 * D, a->crow, tc, k, D));
    if (ops->expert_ffn_forward) { // no expert parallelism here: one block per expert
        for (int e = 0; e < a->cfg.E; e++)
            a->blk_off[e] = a->coff[e], a->blk_n[e] = a->coff[e + 1] - a->coff[e];
        return ops->expert_ffn_forward(a->ye, a->ab, a->h, a->xe, p->experts, p->expert_numel,
                                       p->w2_offset, a->blk_off, a->blk_n, a->cfg.E, a->cfg.E, D,
                                       H);
    }
    for (int e = 0; e < a->cfg.E; e++) {
        const int n = a->coff[e + 1] - a->coff[e];
        if (n == 0) continue;
        const size_t r0 = (size_t)a->coff[e];
        MOE_TRY(ffn_forward(ops, a->ye + r0 * D, a->ab + r0 * 2 * H, a->h + r0 * H, a->xe + r0 * D,
                            moe_layer_w13(p, e), moe_layer_w2(p, e), n, D, H));
    }
    return 0;
}

static int chunk_shared(moe_layer_acts *a, const float *x, const moe_layer_params *p, int tc) {
    const int D = a->cfg.D, Hs = a->cfg.H_shared;
    MOE_TRY(a->ops->matmul(a->shared_ab, x, p->shared_w13, tc, 2 * Hs, D, false, true, 1.0f, 0.0f));
    return a->ops->swiglu_forward(a->shared_h, a->shared_ab, tc, Hs);
}

static int chunked_forward(float *y, const float *x, const moe_layer_params *p, moe_layer_acts *a,
                           int T) {
    const int D = a->cfg.D, k = plan_k(&a->cfg), Hs = a->cfg.H_shared;
    const int Tc = (a->cfg.T_max + a->cfg.n_chunks - 1) / a->cfg.n_chunks;
    for (int t0 = 0; t0 < T; t0 += Tc) {
        const int tc = T - t0 < Tc ? T - t0 : Tc;
        MOE_TRY(chunk_experts(a, x, p, t0, tc));
        MOE_TRY(a->ops->unpermute_forward(y + (size_t)t0 * D, a->ye, a->crow,
                                          a->plan.weight + (size_t)t0 * k, tc, k, D));
        if (Hs) {
            MOE_TRY(chunk_shared(a, x + (size_t)t0 * D, p, tc));
            MOE_TRY(a->ops->matmul(y + (size_t)t0 * D, a->shared_h, p->shared_w2, tc, D, Hs, false,
                                   true, 1.0f, 1.0f));
        }
    }
    return 0;
}

// Backward of the experts and the shared expert, chunk by chunk: each chunk's
// rows are recomputed, then differentiated; weight gradients add up over the
// chunks, dweight [T, k] (zeroed by the caller) is filled for the router.
static int ffn_backward(const moe_ops *ops, float *din, float din_beta, float *dw13, float *dw2,
                        const float *dout, const float *in, const float *ab, const float *h,
                        const float *w13, const float *w2, float *dh, float *dab, int n, int D,
                        int H);

static int chunked_backward(float *dx, const moe_layer_params *dp, const float *dy, const float *x,
                            const moe_layer_params *p, moe_layer_acts *a, int T) {
    const moe_ops *ops = a->ops;
    const int D = a->cfg.D, H = a->cfg.H, k = plan_k(&a->cfg), Hs = a->cfg.H_shared;
    const int Tc = (a->cfg.T_max + a->cfg.n_chunks - 1) / a->cfg.n_chunks;
    for (int t0 = 0; t0 < T; t0 += Tc) {
        const int tc = T - t0 < Tc ? T - t0 : Tc;
        MOE_TRY(chunk_experts(a, x, p, t0, tc));
        const int rows = a->coff[a->cfg.E];
        MOE_TRY(ops->zero(a->dye, (size_t)rows * D));
        MOE_TRY(ops->unpermute_backward(a->dye, a->dweight + (size_t)t0 * k, dy + (size_t)t0 * D,
                                        a->ye, a->crow, a->plan.weight + (size_t)t0 * k, tc, k, D));
        if (ops->expert_ffn_backward) // blocks as chunk_experts set them
            MOE_TRY(ops->expert_ffn_backward(a->dxe, dp->experts, NULL, a->dye, a->xe, a->ab, a->h,
                                             p->experts, p->expert_numel, p->w2_offset, a->blk_off,
                                             a->blk_n, a->cfg.E, a->cfg.E, D, H));
        for (int e = 0; !ops->expert_ffn_backward && e < a->cfg.E; e++) {
            const int n = a->coff[e + 1] - a->coff[e];
            if (n == 0) continue;
            const size_t r0 = (size_t)a->coff[e];
            MOE_TRY(ffn_backward(ops, a->dxe + r0 * D, 0.0f, moe_layer_w13(dp, e),
                                 moe_layer_w2(dp, e), a->dye + r0 * D, a->xe + r0 * D,
                                 a->ab + r0 * 2 * H, a->h + r0 * H, moe_layer_w13(p, e),
                                 moe_layer_w2(p, e), a->dh, a->dab, n, D, H));
        }
        MOE_TRY(ops->permute_backward(dx + (size_t)t0 * D, a->dxe, a->crow, tc, k, D));
        if (Hs) {
            MOE_TRY(chunk_shared(a, x + (size_t)t0 * D, p, tc));
            MOE_TRY(ffn_backward(ops, dx + (size_t)t0 * D, 1.0f, dp->shared_w13, dp->shared_w2,
                                 dy + (size_t)t0 * D, x + (size_t)t0 * D, a->shared_ab, a->shared_h,
                                 p->shared_w13, p->shared_w2, a->dh, a->dab, tc, D, Hs));
        }
    }
    return 0;
}

int moe_layer_forward(float *y, const float *x, const int *task_id, const int *capacity, int T,
                      const moe_layer_params *p, moe_layer_acts *a, bool training, uint64_t step) {
    if (!y || !x || !p || !a || !a->ops)
        return moe_fail(MOE_EINVAL, "moe layer forward: NULL argument");
    if (y == x) return moe_fail(MOE_EINVAL, "moe layer forward: y aliases x");
    const moe_layer_config *cfg = &a->cfg;
    const moe_ops *ops = a->ops;
    if (T < 1 || T > cfg->T_max)
        return moe_fail(MOE_EINVAL, "moe layer forward: T = %d not in 1..T_max = %d", T,
                        cfg->T_max);
    const int D = cfg->D, H = cfg->H, E = cfg->E, k = plan_k(cfg), Hs = cfg->H_shared;
    const int nt = cfg->n_tasks;
    if (nt > 0) MOE_TRY(check_tasks(task_id, T, nt));
    if (!p->gate || (nt && !p->task_emb) || (Hs && (!p->shared_w13 || !p->shared_w2)) ||
        !p->experts)
        return moe_fail(MOE_EINVAL, "moe layer forward: parameter view missing a tensor");
    moe_layer_timing *tm = a->timing;
    double t0 = tm ? now_s() : 0;
    a->T = 0; // invalid until this forward succeeds

    // Gate: logits = G @ Wg^T with G = x [T, D], or the task embeddings [n_tasks, D]
    // whose n_tasks logit rows are computed once and broadcast by task id.
    const float *gin = nt ? p->task_emb : x;
    const int G = nt ? nt : T;
    a->jittered = training && cfg->router.noise == MOE_NOISE_JITTER;
    if (a->jittered) {
        // Switch jitter multiplies the router input by U(1-eps, 1+eps); jittering
        // ones keeps the factors for backward, the experts still see the clean x.
        for (size_t i = 0; i < (size_t)G * D; i++)
            a->noise[i] = 1.0f;
        moe_router_jitter(a->noise, (size_t)G * D, cfg->router.noise_eps, cfg->router.seed, step);
        MOE_TRY(ops->mul(a->gate_in, gin, a->noise, (size_t)G * D));
        gin = a->gate_in;
    }
    if (nt) {
        MOE_TRY(ops->matmul(a->logits_g, gin, p->gate, nt, E, D, false, true, 1.0f, 0.0f));
        MOE_TRY(ops->gather_rows(a->logits, a->logits_g, task_id, T, E));
    } else {
        MOE_TRY(ops->matmul(a->logits, gin, p->gate, T, E, D, false, true, 1.0f, 0.0f));
    }
    LAP(gate);

    // Under replicas capacity follows the holders (moe_dispatch_place.h).
    if (moe_place_on(a)) capacity = moe_place_capacity(a, capacity, T);
    MOE_TRY(moe_router_forward(&a->plan, a->logits, task_id, capacity, T, E, &cfg->router, training,
                               step));
    MOE_TRY(check_plan(&a->plan, T, E, k));
    LAP(router);

    if (cfg->n_chunks > 1) {
        MOE_TRY(chunked_forward(y, x, p, a, T));
        LAP(experts);
        a->T = T;
        return 0;
    }
    MOE_TRY(ops->dispatch_rows(a->row, a->plan.expert, a->plan.slot, a->plan.offsets, T, k));
    MOE_TRY(ops->permute_forward(a->xe, x, a->row, T, k, D));
    LAP(permute);

    MOE_TRY(moe_node_dedup_on(a) ? moe_node_dispatch(a) : dispatch(a));
    LAP(permute);

    // Experts, one block per (source rank, local expert): xr [n, D] @ [2H, D]^T
    // -> abr, SwiGLU -> hr, [n, H] @ [D, H]^T -> yr. A block has the shape the
    // source's rows would have in a single-process step, so results match it.
    // Under a replicated placement the blocks are (source rank, slot), and
    // replicas' weights live outside p: the loop below handles them.
    const int El = moe_place_slots(a), n_src = cfg->ep_size > 1 ? cfg->ep_size : 1;
    const int *blk_n = moe_place_on(a) ? a->place->blk_n : a->blk_n;
    const int *blk_off = moe_place_on(a) ? a->place->blk_off : a->blk_off;
    const bool fused = ops->expert_ffn_forward && !moe_place_on(a);
    if (fused)
        MOE_TRY(ops->expert_ffn_forward(a->yr, a->abr, a->hr, a->xr, p->experts, p->expert_numel,
                                        p->w2_offset, a->blk_off, a->blk_n, n_src * El, El, D, H));
    for (int b = 0; !fused && b < n_src * El; b++) {
        const int n = blk_n[b], e = b % El;
        if (n == 0) continue;
        const size_t r0 = (size_t)blk_off[b];
        const float *w13 = moe_place_w13(a, p, e, false), *w2 = w13 + p->w2_offset;
        MOE_TRY(ffn_forward(ops, a->yr + r0 * D, a->abr + r0 * 2 * H, a->hr + r0 * H,
                            a->xr + r0 * D, w13, w2, n, D, H));
    }
    LAP(experts);
    MOE_TRY(combine(a, a->yr, a->ye));
    LAP(unpermute);

    MOE_TRY(ops->unpermute_forward(y, a->ye, a->row, a->plan.weight, T, k, D));
    LAP(unpermute);

    if (Hs) { // y += w2s(silu(w1s x) * w3s x) for every token
        MOE_TRY(ops->matmul(a->shared_ab, x, p->shared_w13, T, 2 * Hs, D, false, true, 1.0f, 0.0f));
        MOE_TRY(ops->swiglu_forward(a->shared_h, a->shared_ab, T, Hs));
        MOE_TRY(ops->matmul(y, a->shared_h, p->shared_w2, T, D, Hs, false, true, 1.0f, 1.0f));
        LAP(shared);
    }
    a->T = T;
    return 0;
}

// ---- backward ------------------------------------------------------------------------

// Backward of one SwiGLU FFN with fused [w1;w3] (n rows): given dout [n, D],
// dw2 += dout^T h; dh = dout w2; dab = swiglu'(dh); dw13 += dab^T in;
// din = dab w13 (overwritten when din_beta = 0, added when 1).
static int ffn_backward(const moe_ops *ops, float *din, float din_beta, float *dw13, float *dw2,
                        const float *dout, const float *in, const float *ab, const float *h,
                        const float *w13, const float *w2, float *dh, float *dab, int n, int D,
                        int H) {
    MOE_TRY(ops->matmul(dh, dout, w2, n, H, D, false, false, 1.0f, 0.0f));
    MOE_TRY(ops->matmul(dw2, dout, h, D, H, n, true, false, 1.0f, 1.0f));
    MOE_TRY(ops->zero(dab, (size_t)n * 2 * H));
    MOE_TRY(ops->swiglu_backward(dab, dh, ab, n, H));
    MOE_TRY(ops->matmul(dw13, dab, in, 2 * H, D, n, true, false, 1.0f, 1.0f));
    MOE_TRY(ops->matmul(din, dab, w13, n, D, 2 * H, false, false, 1.0f, din_beta));
    return 0;
}

int moe_layer_backward(float *dx, const moe_layer_params *dp, const float *dy, const float *x,
                       const int *task_id, int T, const moe_layer_params *p, moe_layer_acts *a,
                       float aux_scale, float z_scale) {
    if (!dx || !dp || !dy || !x || !p || !a || !a->ops)
        return moe_fail(MOE_EINVAL, "moe layer backward: NULL argument");
    if (dx == dy) return moe_fail(MOE_EINVAL, "moe layer backward: dx aliases dy");
    if (a->T == 0) return moe_fail(MOE_EINVAL, "moe layer backward: no successful forward to undo");
    if (T != a->T)
        return moe_fail(MOE_EINVAL, "moe layer backward: T = %d but the last forward had T = %d", T,
                        a->T);
    const moe_layer_config *cfg = &a->cfg;
    const moe_ops *ops = a->ops;
    const int D = cfg->D, H = cfg->H, E = cfg->E, k = plan_k(cfg), Hs = cfg->H_shared;
    const int nt = cfg->n_tasks;
    if (nt > 0) MOE_TRY(check_tasks(task_id, T, nt));
    if (!dp->gate || (nt && !dp->task_emb) || (Hs && (!dp->shared_w13 || !dp->shared_w2)) ||
        !dp->experts)
        return moe_fail(MOE_EINVAL, "moe layer backward: gradient view missing a tensor");
    const moe_plan *pl = &a->plan;
    const int rows = pl->offsets[E];
    moe_layer_timing *tm = a->timing;
    double t0 = tm ? now_s() : 0;

    bool consumed = false; // by the backend's expert op
    // Combine: dye[row] = weight * dy[t], dweight[t, j] = <dy[t], ye[row]>.
    MOE_TRY(ops->zero(a->dweight, (size_t)T * k));
    if (cfg->n_chunks > 1) {
        MOE_TRY(chunked_backward(dx, dp, dy, x, p, a, T));
        LAP(experts);
        goto router;
    }
    MOE_TRY(ops->zero(a->dye, (size_t)rows * D));
    MOE_TRY(ops->unpermute_backward(a->dye, a->dweight, dy, a->ye, a->row, pl->weight, T, k, D));
    LAP(unpermute);

    MOE_TRY(moe_node_dedup_on(a) ? moe_node_redispatch(a, dy, a->dyr)
                                 : redispatch(a, a->dye, a->dyr));
    LAP(unpermute);

    // Expert blocks. With expert parallelism each block's weight gradient is
    // computed from zero and added to the total in source order: the sum a
    // single process forms over its micro-batches, so the bits agree.
    const int El = moe_place_slots(a), n_src = cfg->ep_size > 1 ? cfg->ep_size : 1;
    const int *blk_n = moe_place_on(a) ? a->place->blk_n : a->blk_n;
    const int *blk_off = moe_place_on(a) ? a->place->blk_off : a->blk_off;
    const size_t n13 = 2 * (size_t)H * D, n2 = (size_t)D * H;
    const bool fused = ops->expert_ffn_backward && !moe_place_on(a);
    if (fused) {
        MOE_TRY(ops->expert_ffn_backward(a->dxr, dp->experts, a->dw, a->dyr, a->xr, a->abr, a->hr,
                                         p->experts, p->expert_numel, p->w2_offset, a->blk_off,
                                         a->blk_n, n_src * El, El, D, H));
        consumed = true;
    }
    for (int e = 0; !fused && e < El; e++) {
        for (int s = 0; s < n_src; s++) {
            const int n = blk_n[s * El + e];
            if (n == 0) continue;
            const size_t r0 = (size_t)blk_off[s * El + e];
            float *g13 = moe_place_w13(a, dp, e, true), *dw13 = g13, *dw2 = g13 + dp->w2_offset;
            const float *w13 = moe_place_w13(a, p, e, false);
            if (n_src > 1) {
                MOE_TRY(ops->zero(a->dw, n13 + n2));
                dw13 = a->dw, dw2 = a->dw + n13;
            }
            MOE_TRY(ffn_backward(ops, a->dxr + r0 * D, 0.0f, dw13, dw2, a->dyr + r0 * D,
                                 a->xr + r0 * D, a->abr + r0 * 2 * H, a->hr + r0 * H, w13,
                                 w13 + p->w2_offset, a->dh, a->dab, n, D, H));
            if (n_src > 1) // w13 and w2 are one block
                for (size_t i = 0; i < n13 + n2; i++)
                    g13[i] += a->dw[i];
        }
    }
    LAP(experts);
    MOE_TRY(combine(a, a->dxr, a->dxe));
    LAP(permute);

    MOE_TRY(ops->permute_backward(dx, a->dxe, a->row, T, k, D));
    LAP(permute);

    if (Hs) {
        MOE_TRY(ffn_backward(ops, dx, 1.0f, dp->shared_w13, dp->shared_w2, dy, x, a->shared_ab,
                             a->shared_h, p->shared_w13, p->shared_w2, a->dh, a->dab, T, D, Hs));
        LAP(shared);
    }

router:
    MOE_TRY(ops->zero(a->dlogits, (size_t)T * E));
    moe_router_backward(a->dlogits, a->dweight, pl, &cfg->router, aux_scale, z_scale);
    LAP(router);

    // Gate: logits = G Wg^T, so dWg += dlogits_G^T G and dG = dlogits_G Wg; with
    // task routing dlogits_G sums each task's token rows (the broadcast's adjoint).
    const float *dl = a->dlogits;
    int G = T;
    const float *gin = x;
    float *dgin = dx;
    if (nt) {
        MOE_TRY(ops->zero(a->dlogits_g, (size_t)nt * E));
        MOE_TRY(ops->scatter_add_rows(a->dlogits_g, a->dlogits, task_id, T, E));
        dl = a->dlogits_g;
        G = nt;
        gin = p->task_emb;
        dgin = dp->task_emb;
    }
    if (a->jittered) gin = a->gate_in;
    MOE_TRY(ops->matmul(dp->gate, dl, gin, E, D, G, true, false, 1.0f, 1.0f));
    if (a->jittered) { // d(G * u) / dG = u
        MOE_TRY(ops->matmul(a->dgate_in, dl, p->gate, G, D, E, false, false, 1.0f, 0.0f));
        MOE_TRY(ops->mul_add(dgin, a->dgate_in, a->noise, (size_t)G * D));
    } else {
        MOE_TRY(ops->matmul(dgin, dl, p->gate, G, D, E, false, false, 1.0f, 1.0f));
    }
    LAP(gate);
    if (consumed) a->T = 0; // the saved activations now hold their gradients
    return 0;
}
