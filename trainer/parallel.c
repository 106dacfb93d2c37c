// Process grid, the expert-parallel exchange, gradient all-reduces and the
// global gradient norm (see moe/parallel.h).
#include "moe/parallel.h"
#include "kernels/cpu/cpu.h"
#include "moe/alloc.h"
#include "moe/error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

static int ep_alltoallv(void *ctx, const void *send, const int *send_counts, void *recv,
                        int *recv_counts, size_t recv_cap, size_t elem_size) {
    moe_parallel *p = ctx;
    return moe_comm_alltoallv(p->ep, p->algo, send, send_counts, recv, recv_counts, recv_cap,
                              elem_size);
}

#ifdef MOE_HAVE_CUDA
// The EP exchange of device rows over NCCL, on the backend's stream.
static int ep_alltoallv_device(void *ctx, const void *send, const int *send_counts, void *recv,
                               int *recv_counts, size_t recv_cap, size_t elem_size) {
    moe_parallel *p = ctx;
    return moe_nccl_alltoallv(p->ep_nccl, p->algo, send, send_counts, recv, recv_counts, recv_cap,
                              elem_size, moe_cuda_stream());
}
#endif

int moe_parallel_device_exchange(moe_parallel *p, moe_nccl_comm *nccl) {
    p->ep_nccl = nccl;
#ifdef MOE_HAVE_CUDA
    p->group.alltoallv_device = nccl ? ep_alltoallv_device : NULL;
    return 0;
#else
    p->group.alltoallv_device = NULL;
    return nccl ? moe_fail(MOE_EINVAL, "built without CUDA") : 0;
#endif
}

int moe_parallel_init(moe_parallel *p, moe_comm *world, const moe_config *cfg) {
    memset(p, 0, sizeof *p);
    p->world = world;
    p->size = moe_comm_size(world);
    p->rank = moe_comm_rank(world);
    p->ep_size = cfg->parallel.ep;
    if (p->size % p->ep_size)
        return moe_fail(MOE_EINVAL, "parallel.ep = %d does not divide the %d rank%s", p->ep_size,
                        p->size, p->size == 1 ? "" : "s");
    for (int l = 0; l < cfg->model.n_layers; l++) {
        int E = moe_config_experts(cfg, l);
        if (E && E % p->ep_size)
            return moe_fail(MOE_EINVAL,
                            "layer %d has %d experts, not divisible by parallel.ep = %d", l, E,
                            p->ep_size);
    }
    p->dp_size = p->size / p->ep_size;
    p->ep_rank = p->rank % p->ep_size;
    p->dp_rank = p->rank / p->ep_size;
    p->algo = strcmp(cfg->comm.all_to_all, "hierarchical") ? MOE_A2A_FLAT : MOE_A2A_HIERARCHICAL;
    MOE_TRY(moe_comm_split(world, p->dp_rank, p->ep_rank, &p->ep));
    int rc = moe_comm_split(world, p->ep_rank, p->dp_rank, &p->edp);
    if (rc < 0) {
        moe_parallel_free(p);
        return rc;
    }
    p->group = (moe_ep_group){p->ep_size, p->ep_rank, p, ep_alltoallv, 0, NULL};
    if (cfg->comm.node_dedup) p->group.dedup_G = moe_comm_ranks_per_node(p->ep);
    return 0;
}

int moe_parallel_ep_nodes(const moe_parallel *p) {
    int G = p->ep ? moe_comm_ranks_per_node(p->ep) : 1;
    return G >= 1 && p->ep_size % G == 0 ? p->ep_size / G : p->ep_size;
}

int moe_parallel_resolve_groups(const moe_parallel *p, moe_config *cfg) {
    moe_router_config *r = &cfg->router;
    if (r->n_groups != 0) return 0;
    const int nodes = moe_parallel_ep_nodes(p);
    r->n_groups = nodes;
    if (r->topk_groups >= nodes) r->topk_groups = 0;
    for (int l = 0; l < cfg->model.n_layers; l++) {
        int E = moe_config_experts(cfg, l);
        if (E && moe_router_groups_active(r) && (long)r->topk_groups * (E / nodes) < r->top_k)
            return moe_fail(MOE_EINVAL,
                            "router.n_groups = 0 makes one group per node: %d nodes of %d "
                            "experts, and router.topk_groups = %d of them hold fewer than "
                            "router.top_k = %d experts",
                            nodes, E / nodes, r->topk_groups, r->top_k);
    }
    return 0;
}

void moe_parallel_free(moe_parallel *p) {
    if (p->ep) moe_comm_free(p->ep);
    if (p->edp) moe_comm_free(p->edp);
    moe_mfree(p->pack);
    moe_parallel_placement_free(p);
    memset(p, 0, sizeof *p);
}

static int is_expert(const moe_param_view *v) {
    return strstr(v->name, ".experts.") != NULL;
}

// Packs the gradients (grads, laid out as t) of the views with is_expert ==
// expert, sums them over comm, and unpacks.
static int allreduce_kind(moe_parallel *p, const moe_param_table *t, float *grads, moe_comm *comm,
                          int expert) {
    if (moe_comm_size(comm) == 1) return 0;
    size_t n = 0;
    for (int i = 0; i < t->count; i++)
        if (is_expert(&t->views[i]) == expert) n += t->views[i].numel;
    if (n > p->pack_n) {
        float *q = moe_realloc(p->pack, n * sizeof(float));
        if (!q) return moe_fail(MOE_ENOMEM, "gradient all-reduce: %zu floats", n);
        p->pack = q, p->pack_n = n;
    }
    size_t o = 0;
    for (int i = 0; i < t->count; i++) {
        const moe_param_view *v = &t->views[i];
        if (is_expert(v) != expert) continue;
        memcpy(p->pack + o, grads + v->offset, v->numel * sizeof(float));
        o += v->numel;
    }
    MOE_TRY(moe_comm_allreduce_f32(comm, p->pack, n));
    o = 0;
    for (int i = 0; i < t->count; i++) {
        const moe_param_view *v = &t->views[i];
        if (is_expert(v) != expert) continue;
        memcpy(grads + v->offset, p->pack + o, v->numel * sizeof(float));
        o += v->numel;
    }
    return 0;
}

int moe_parallel_allreduce_buffer(moe_parallel *p, const moe_param_table *t, float *grads) {
    MOE_TRY(allreduce_kind(p, t, grads, p->world, 0));
    return allreduce_kind(p, t, grads, p->edp, 1);
}

int moe_parallel_allreduce_grads(moe_parallel *p, moe_model *m) {
    MOE_TRY(moe_parallel_placement_reduce_grads(p, m));
    return moe_parallel_allreduce_buffer(p, &m->table, m->grads);
}

int moe_parallel_grad_norm(moe_parallel *p, const moe_model *m, double *norm) {
    return moe_parallel_grad_norm_on(p, m, &moe_ops_cpu, norm);
}

int moe_parallel_grad_norm_on(moe_parallel *p, const moe_model *m, const moe_ops *ops,
                              double *norm) {
    // Every expert's sum of squares, [MoE layer][expert], from its owner.
    int n_moe = 0, E_max = m->usage_E > 0 ? m->usage_E : 1;
    for (int l = 0; l < m->L; l++)
        n_moe += m->is_moe[l];
    double *ex = calloc((size_t)n_moe * E_max + 1, sizeof(double));
    if (!ex) return moe_fail(MOE_ENOMEM, "gradient norm: out of memory");
    int rc = 0; // a device failure still joins the collective below
    for (int l = 0, i = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_layer_config *c = &m->moe_cfg[l];
        const moe_layer_params *g = &m->g[l].moe;
        for (int e = 0; e < moe_layer_local_experts(c) && rc == 0; e++) {
            const int x = moe_parallel_expert_of(p, m, l, e); // moved homes: the table's expert
            rc = ops->sumsq(&ex[(size_t)i * E_max + x], moe_layer_w13(g, e), g->expert_numel);
        }
        i++;
    }
    int rc_all = moe_comm_allreduce_f64(p->ep, ex, (size_t)n_moe * E_max); // zeros elsewhere: exact
    if (rc == 0) rc = rc_all;
    if (rc < 0) {
        free(ex);
        return rc;
    }
    // Tensors in model order; a layer's experts, all E of them, in place of
    // its local expert tensors.
    double s = 0.0;
    int moe_i = -1, last_layer = -1;
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        if (!is_expert(v)) {
            double t = 0;
            if ((rc = ops->sumsq(&t, m->grads + v->offset, v->numel)) < 0) break;
            s += t;
            continue;
        }
        int layer = atoi(v->name + strlen("model.layers."));
        if (layer == last_layer) continue; // this layer's experts are already in
        last_layer = layer;
        moe_i++;
        for (int e = 0; e < m->moe_cfg[layer].E; e++)
            s += ex[(size_t)moe_i * E_max + e];
    }
    free(ex);
    if (rc < 0) return rc;
    *norm = sqrt(s);
    return 0;
}
