// The decoder: parameter table with Hugging Face Mixtral names, seeded
// initialisation, and the forward/backward of the whole model over the op
// table (GEMMs and the decoder ops, kernels/ops.h), cut cross-entropy
// (kernels/cpu/nn.h) and the MoE layer.
#include "moe/model.h"
#include "kernels/cpu/nn.h"
#include "moe/alloc.h"
#include "moe/cuda_sizes.h"
#include "moe/error.h"
#include "moe/rng.h"
#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cce_cuda.h"
#include "kernels/cuda/cuda.h"
#include "moe/moe_layer_cuda.h"
#endif

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int add(moe_model *m, const char *prefix, const char *name, int64_t d0, int64_t d1) {
    int64_t shape[2] = {d0, d1};
    return moe_param_table_add(&m->table, prefix, name, d1 ? 2 : 1, shape);
}

static float *view(const moe_model *m, float *buf, const char *fmt, int layer) {
    char name[MOE_PARAM_NAME_MAX];
    snprintf(name, sizeof name, fmt, layer);
    const moe_param_view *v = moe_param_table_find(&m->table, name);
    return v ? buf + v->offset : NULL;
}

static void bind_block(moe_model *m, moe_block_params *b, float *buf, int l, size_t moe_off) {
    b->ln1 = view(m, buf, "model.layers.%d.input_layernorm.weight", l);
    b->wq = view(m, buf, "model.layers.%d.self_attn.q_proj.weight", l);
    b->wk = view(m, buf, "model.layers.%d.self_attn.k_proj.weight", l);
    b->wv = view(m, buf, "model.layers.%d.self_attn.v_proj.weight", l);
    b->wo = view(m, buf, "model.layers.%d.self_attn.o_proj.weight", l);
    b->ln2 = view(m, buf, "model.layers.%d.post_attention_layernorm.weight", l);
    if (m->is_moe[l]) {
        moe_layer_params_view(&b->moe, buf + moe_off, &m->moe_cfg[l]);
    } else {
        b->w13 = view(m, buf, "model.layers.%d.mlp.gate_proj.weight", l); // up_proj follows
        b->w2 = view(m, buf, "model.layers.%d.mlp.down_proj.weight", l);
    }
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

// FNV-1a of a tensor name.
static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

// N(0, 0.02) for matrices, 0.02/sqrt(2L) for projections into the residual
// stream (GPT-2), 1 for norm weights. Element j of tensor NAME draws from
// hash(seed, NAME, j): the same weights whatever the thread count, and on an
// expert shard the same as in a single process.
static void init_params(moe_model *m) {
    double scaled = 0.02 / sqrt(2.0 * m->L);
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        float *p = m->params + v->offset;
        if (ends_with(v->name, "norm.weight")) {
            for (size_t j = 0; j < v->numel; j++)
                p[j] = 1.0f;
            continue;
        }
        double std = ends_with(v->name, "o_proj.weight") ||
                             ends_with(v->name, "down_proj.weight") ||
                             ends_with(v->name, ".w2.weight")
                         ? scaled
                         : 0.02;
        uint64_t nh = name_hash(v->name);
        for (size_t j = 0; j < v->numel; j++) {
            double u1 = moe_u01(moe_hash4(m->cfg.train.seed, nh, j, 1)) + 1e-300;
            double u2 = moe_u01(moe_hash4(m->cfg.train.seed, nh, j, 2));
            p[j] = (float)(std * sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
        }
    }
}

// Cut cross-entropy's scratch on the model's backend (with the device copy below).
static size_t cce_scratch_floats(const moe_model *m, size_t N);

// Carves every activation buffer out of base (NULL: only counts floats).
static size_t layout_acts(moe_model *m, float *base) {
    size_t used = 0;
    const size_t N = (size_t)m->B * m->T, D = m->D, QD = (size_t)m->Hq * m->hd,
                 KD = (size_t)m->Hkv * m->hd;
#define TAKE(ptr, n)                                                                               \
    do {                                                                                           \
        if (base) (ptr) = base + used;                                                             \
        used += (n);                                                                               \
    } while (0)
    for (int l = 0; l < m->L; l++) {
        moe_block_acts *a = &m->a[l];
        TAKE(a->x, N * D);
        if (l == 0 || !m->recompute_attn) { // else layer 0's, set below
            TAKE(a->ln1, N * D);
            TAKE(a->rstd1, N);
            TAKE(a->q, N * QD);
            TAKE(a->k, N * KD);
            TAKE(a->v, N * KD);
            TAKE(a->att, m->ops->attention_state_floats(m->B, m->T, m->Hq));
            TAKE(a->atty, N * QD);
        }
        TAKE(a->mid, N * D);
        TAKE(a->ln2, N * D);
        TAKE(a->rstd2, N);
        if (!m->is_moe[l] && m->chunks == 1) {
            TAKE(a->ab, N * 2 * m->F);
            TAKE(a->h, N * m->F);
        }
    }
    for (int l = 1; base && m->recompute_attn && l < m->L; l++) {
        moe_block_acts *a = &m->a[l], *a0 = &m->a[0];
        a->ln1 = a0->ln1, a->rstd1 = a0->rstd1, a->q = a0->q, a->k = a0->k, a->v = a0->v;
        a->att = a0->att, a->atty = a0->atty;
    }
    TAKE(m->xf, N * D);
    TAKE(m->lnf, N * D);
    TAKE(m->rstdf, N);
    // Cut cross-entropy never materialises [N, V]: logits exist for one
    // sequence (inference), plus a tile of scratch and the saved lse.
    // With chunks, dense-FFN and LM-head intermediates exist for one chunk of
    // Nc tokens (recomputed in backward); logits also for one sequence, for
    // decoding.
    const bool cce = !strcmp(m->cfg.loss.impl, "cce");
    const size_t Nc = (N + m->chunks - 1) / m->chunks, T = (size_t)m->T;
    const size_t head_rows = cce ? T : m->chunks > 1 ? (Nc > T ? Nc : T) : N;
    TAKE(m->logits, head_rows * m->V);
    TAKE(m->ffn_ab, m->chunks > 1 ? Nc * 2 * m->F : 0);
    TAKE(m->ffn_h, m->chunks > 1 ? Nc * m->F : 0);
    TAKE(m->lse, cce ? N : 0);
    TAKE(m->cce_scratch, cce ? cce_scratch_floats(m, N) : 0);
    TAKE(m->losses, N);
    // the attention forward's scratch too
    const size_t n_datt = m->ops->attention_scratch_floats(m->B, m->T, m->Hq, m->Hkv, m->hd);
    TAKE(m->datt, n_datt);
    if (base && !n_datt) m->datt = NULL; // the backend keeps none: point at nothing
    if (m->forward_only) return used;    // the rest is backward's (NULL here)
    TAKE(m->dres, N * D);
    TAKE(m->dln, N * D);
    TAKE(m->dq, N * QD);
    TAKE(m->dk, N * KD);
    TAKE(m->dv, N * KD);
    TAKE(m->dqr, N * QD);
    TAKE(m->dkr, N * KD);
    TAKE(m->datty, N * QD);
    TAKE(m->dab, Nc * 2 * m->F);
    TAKE(m->dh, Nc * m->F);
    TAKE(m->dlogits, cce ? 0 : Nc * m->V);
#undef TAKE
    return used;
}

// One process holds every expert, whatever layout wrote the checkpoint
// (rank 0 saves the full expert set, each under its own name): eval and
// export read it as ep = 1, without the keys that only shape how ranks
// trade tokens (the placement table, the overlapped exchange), which the
// config check refuses at ep = 1.
static moe_config one_process(const moe_config *cfg) {
    moe_config one = *cfg;
    one.parallel.ep = 1;
    snprintf(one.placement.mode, sizeof one.placement.mode, "static");
    one.placement.slots_per_rank = 0;
    one.comm.overlap_degree = 1;
    return one;
}

int moe_model_init(moe_model *m, const moe_config *cfg, int B, int T, int n_tasks) {
    moe_config one = one_process(cfg);
    return moe_model_init_ep(m, &one, B, T, n_tasks, NULL);
}

// Sizes, layer configs and the parameter table: everything but the buffers.
// moe_off[l]: where MoE layer l's parameters start in the flat buffer.
static int model_setup(moe_model *m, const moe_config *cfg, int B, int T, int n_tasks,
                       const moe_ep_group *ep, size_t *moe_off) {
    memset(m, 0, sizeof *m);
    MOE_TRY(moe_config_check(cfg, NULL));
    // This model's batch may differ from train.batch_size (eval, generate):
    // its sizes are checked again before any product below is formed.
    MOE_TRY(moe_config_check_sizes(cfg, NULL, B, T));
    int ep_size = ep ? ep->size : 1;
    if (cfg->parallel.ep != ep_size)
        return moe_fail(MOE_EINVAL,
                        "parallel.ep = %d but this process is in an expert-parallel "
                        "group of %d (launch with mpirun)",
                        cfg->parallel.ep, ep_size);
    m->ep = ep;
    m->cfg = *cfg;
    m->ops = &moe_ops_cpu;
    m->V = cfg->model.vocab_size;
    m->D = cfg->model.d_model;
    m->L = cfg->model.n_layers;
    m->Hq = cfg->model.n_heads;
    m->Hkv = cfg->model.n_kv_heads;
    m->hd = m->D / m->Hq;
    m->F = cfg->model.d_ff;
    m->B = B;
    m->T = T;
    m->n_tasks = n_tasks < 1 ? 1 : n_tasks;
    m->chunks = cfg->memory.mini_seq > 1 ? cfg->memory.mini_seq : 1;
    m->recompute_attn = !strcmp(cfg->memory.recompute, "all");
    int rc = 0;
    moe_param_table_init(&m->table);
    MOE_TRY_GOTO(add(m, NULL, "model.embed_tokens.weight", m->V, m->D), rc);
    for (int l = 0; l < m->L; l++) {
        char pre[64];
        snprintf(pre, sizeof pre, "model.layers.%d.", l);
        int QD = m->Hq * m->hd, KD = m->Hkv * m->hd;
        MOE_TRY_GOTO(add(m, pre, "input_layernorm.weight", m->D, 0), rc);
        MOE_TRY_GOTO(add(m, pre, "self_attn.q_proj.weight", QD, m->D), rc);
        MOE_TRY_GOTO(add(m, pre, "self_attn.k_proj.weight", KD, m->D), rc);
        MOE_TRY_GOTO(add(m, pre, "self_attn.v_proj.weight", KD, m->D), rc);
        MOE_TRY_GOTO(add(m, pre, "self_attn.o_proj.weight", m->D, QD), rc);
        MOE_TRY_GOTO(add(m, pre, "post_attention_layernorm.weight", m->D, 0), rc);
        m->is_moe[l] = moe_config_is_moe(cfg, l);
        if (!m->is_moe[l]) {
            MOE_TRY_GOTO(add(m, pre, "mlp.gate_proj.weight", m->F, m->D), rc);
            MOE_TRY_GOTO(add(m, pre, "mlp.up_proj.weight", m->F, m->D), rc);
            MOE_TRY_GOTO(add(m, pre, "mlp.down_proj.weight", m->D, m->F), rc);
            continue;
        }
        moe_layer_config *mc = &m->moe_cfg[l];
        mc->T_max = B * T; // fits int: moe_config_check_sizes
        mc->D = m->D;
        mc->H = cfg->moe.d_expert ? cfg->moe.d_expert : m->F;
        mc->E = moe_config_experts(cfg, l);
        mc->H_shared = cfg->moe.shared_experts ? mc->H : 0;
        for (int i = 0; i < cfg->moe.n_task_layers; i++)
            if (cfg->moe.task_layers[i] == l) mc->n_tasks = m->n_tasks;
        mc->router = cfg->router;
        mc->ep_size = ep_size;
        mc->ep_rank = ep ? ep->rank : 0;
        mc->n_chunks = m->chunks;
        mc->overlap_degree = cfg->comm.overlap_degree;
        // each layer draws its own routing noise
        mc->router.seed = moe_hash4(cfg->router.seed, (uint64_t)l, 0x4C41594552ull, 0);
        if (mc->E > m->usage_E) m->usage_E = mc->E;
        MOE_TRY_GOTO(moe_layer_config_check(mc), rc);
        moe_off[l] = m->table.numel;
        snprintf(pre, sizeof pre, "model.layers.%d.block_sparse_moe.", l);
        MOE_TRY_GOTO(moe_layer_param_table(&m->table, pre, mc), rc);
    }
    MOE_TRY_GOTO(add(m, NULL, "model.norm.weight", m->D, 0), rc);
    if (!cfg->model.tie_embeddings) MOE_TRY_GOTO(add(m, NULL, "lm_head.weight", m->V, m->D), rc);
    return 0;
fail:
    moe_param_table_free(&m->table);
    return rc;
}

int moe_model_init_table(moe_model *m, const moe_config *cfg, int n_tasks) {
    moe_config one = one_process(cfg);
    size_t moe_off[MOE_MAX_LAYERS];
    return model_setup(m, &one, 1, 1, n_tasks, NULL, moe_off);
}

int moe_model_memory(const moe_config *cfg, int B, int T, int n_tasks, int ep_size, int ep_rank,
                     int dedup_G, moe_model_mem *out) {
    moe_model m;
    size_t moe_off[MOE_MAX_LAYERS];
    moe_ep_group g = {ep_size, ep_rank, NULL, NULL, 0, NULL}; // sizes only: never called
    memset(out, 0, sizeof *out);
    MOE_TRY(model_setup(&m, cfg, B, T, n_tasks, ep_size > 1 ? &g : NULL, moe_off));
    out->params = m.table.numel * sizeof(float);
    out->grads = out->params;
    out->activations = layout_acts(&m, NULL) * sizeof(float) + (size_t)B * T * sizeof(int32_t) +
                       ((size_t)m.usage_E + 1) * sizeof(int) +
                       (moe_model_load_len(&m) + 1) * (sizeof(double) + sizeof(float));
    for (int l = 0; l < m.L; l++) {
        if (!m.is_moe[l]) continue;
        out->moe += moe_layer_acts_bytes(&m.moe_cfg[l], m.ops);
        out->moe += moe_layer_node_dedup_bytes(&m.moe_cfg[l], dedup_G);
        if (cfg->router.capacity_mode == MOE_CAPACITY_DYNAMIC)
            out->moe += (size_t)m.moe_cfg[l].E * (sizeof(double) + sizeof(int));
    }
    out->n_params = m.table.numel;
    moe_param_table_free(&m.table);
    return 0;
}

// The model's buffers after model_setup; forward_only: no gradients, no
// backward buffers and parameters left zero (moe_model_init_eval).
static int model_alloc(moe_model *m, const moe_config *cfg, int B, int T, int n_tasks,
                       const moe_ep_group *ep, bool forward_only) {
    size_t moe_off[MOE_MAX_LAYERS] = {0};
    MOE_TRY(model_setup(m, cfg, B, T, n_tasks, ep, moe_off));
    m->forward_only = forward_only;
    int rc = 0;
    size_t n = m->table.numel, n_acts = layout_acts(m, NULL);
    m->params = moe_calloc(n, sizeof(float));
    m->grads = forward_only ? NULL : moe_calloc(n, sizeof(float));
    float *acts = moe_calloc(n_acts, sizeof(float));
    m->task_tok = moe_calloc((size_t)B * T, sizeof(int32_t));
    m->cap_all = moe_calloc((size_t)m->usage_E + 1, sizeof(int));
    m->load = moe_calloc(moe_model_load_len(m) + 1, sizeof(double));
    m->bias = moe_calloc(moe_model_load_len(m) + 1, sizeof(float));
    if (!m->params || (!forward_only && !m->grads) || !acts || !m->task_tok || !m->cap_all ||
        !m->load || !m->bias) {
        moe_mfree(acts);
        if (forward_only)
            rc = moe_fail(MOE_ENOMEM,
                          "model with %zu parameters and %zu activation floats (%.0f MiB): out "
                          "of memory",
                          n, n_acts, ((double)n + n_acts) * sizeof(float) / 1048576.0);
        else
            rc = moe_fail(MOE_ENOMEM,
                          "model with %zu parameters and %zu activation floats (%.0f MiB with "
                          "the gradients): out of memory (in training, a smaller "
                          "train.batch_size or model.seq_len needs less)",
                          n, n_acts, (2.0 * n + n_acts) * sizeof(float) / 1048576.0);
        goto fail;
    }
    layout_acts(m, acts);
    m->embed = m->params + moe_param_table_find(&m->table, "model.embed_tokens.weight")->offset;
    m->norm = view(m, m->params, "model.norm.weight", 0);
    m->lm_head = cfg->model.tie_embeddings ? m->embed : view(m, m->params, "lm_head.weight", 0);
    if (m->grads) {
        m->d_embed = m->grads + (m->embed - m->params);
        m->d_norm = view(m, m->grads, "model.norm.weight", 0);
        m->d_lm_head = m->grads + (m->lm_head - m->params);
    }
    for (int l = 0; l < m->L; l++) {
        bind_block(m, &m->p[l], m->params, l, moe_off[l]);
        if (m->grads) bind_block(m, &m->g[l], m->grads, l, moe_off[l]);
        if (!m->is_moe[l]) continue;
        MOE_TRY_GOTO(moe_layer_acts_alloc(&m->a[l].moe, &m->moe_cfg[l], m->ops), rc);
        m->a[l].moe.ep = ep;
        if (cfg->router.capacity_mode == MOE_CAPACITY_DYNAMIC)
            MOE_TRY_GOTO(moe_capacity_ctl_init(&m->cap[l], &cfg->router, B * T, m->moe_cfg[l].E),
                         rc);
    }
    if (cfg->router.bias_update_rate > 0) moe_model_bias_attach(m);
    if (!forward_only) init_params(m);
    return 0;
fail:
    moe_model_free(m);
    return rc;
}

int moe_model_init_ep(moe_model *m, const moe_config *cfg, int B, int T, int n_tasks,
                      const moe_ep_group *ep) {
    return model_alloc(m, cfg, B, T, n_tasks, ep, false);
}

int moe_model_init_eval(moe_model *m, const moe_config *cfg, int B, int T, int n_tasks) {
    moe_config one = one_process(cfg);
    return model_alloc(m, &one, B, T, n_tasks, NULL, true);
}

void moe_model_free(moe_model *m) {
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        moe_layer_acts_free(&m->a[l].moe);
        moe_capacity_ctl_free(&m->cap[l]);
    }
    moe_mfree(m->L > 0 ? m->a[0].x : NULL); // the activation block starts at layer 0's x
    moe_mfree(m->params);
    moe_mfree(m->grads);
    moe_mfree(m->task_tok);
    moe_mfree(m->cap_all);
    moe_mfree(m->load);
    moe_mfree(m->bias);
    free(m->task_share);
    moe_param_table_free(&m->table);
    memset(m, 0, sizeof *m);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// The device copy's own state (moe_model_gpu_init below).
struct moe_model_gpu {
    bool cuda;   // MoE layers on the CUDA router and grouped GEMMs (else the CPU layers)
    float *acts; // the activation block, from ops->alloc
    // [B T] per-token task ids in device memory, uploaded once per forward from
    // task_tok; only under task routing or task priorities (NULL otherwise)
    int *task_d;
    // [B T] host scratch for the chunked LM head's sums (memory.mini_seq on CUDA)
    int32_t *tg_h;
    float *loss_h;
#ifdef MOE_HAVE_CUDA
    moe_layer_cuda_acts moe[MOE_MAX_LAYERS];
#endif
};

// Adds the time since *t0 to *slot (when timing) and restarts the clock. On
// a CUDA device copy it first waits for the queued kernels, so each phase
// holds its own GPU time (timing costs one sync a phase).
static void lap(const moe_model *m, double *slot, double *t0) {
    if (!m->timing) return;
#ifdef MOE_HAVE_CUDA
    if (m->gpu && m->gpu->cuda) (void)moe_cuda_synchronize();
#endif
    double t = now();
    *slot += t - *t0;
    *t0 = t;
}

size_t moe_model_load_len(const moe_model *m) {
    size_t n_moe = 0;
    for (int l = 0; l < m->L; l++)
        n_moe += m->is_moe[l];
    return n_moe * m->usage_E;
}

void moe_model_capacity_step(moe_model *m) {
    int idx = 0;
    double mean[m->usage_E > 0 ? m->usage_E : 1];
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const double *sum = m->load + (size_t)idx++ * m->usage_E;
        if (!m->cap[l].capacity || m->load_calls == 0) continue;
        for (int e = 0; e < m->moe_cfg[l].E; e++)
            mean[e] = sum[e] / m->load_calls;
        moe_capacity_ctl_update_mean(&m->cap[l], &m->cfg.router, mean, m->B * m->T);
    }
    memset(m->load, 0, sizeof(double) * moe_model_load_len(m));
    m->load_calls = 0;
}

float *moe_model_bias(const moe_model *m, int l) {
    if (l < 0 || l >= m->L || !m->is_moe[l]) return NULL;
    int idx = 0;
    for (int i = 0; i < l; i++)
        idx += m->is_moe[i];
    return m->bias + (size_t)idx * m->usage_E;
}

void moe_model_bias_attach(moe_model *m) {
    for (int l = 0; l < m->L; l++)
        if (m->is_moe[l]) m->a[l].moe.plan.bias = moe_model_bias(m, l);
    m->bias_on = true;
}

void moe_model_bias_step(moe_model *m) {
    int idx = 0;
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const double *load = m->load + (size_t)idx * m->usage_E;
        const int E = m->moe_cfg[l].E;
        m->max_vio[l] = moe_router_max_vio(load, E);
        if (m->cfg.router.bias_update_rate > 0 && m->load_calls > 0)
            moe_router_bias_update(m->bias + (size_t)idx * m->usage_E, load, E,
                                   m->cfg.router.bias_update_rate);
        idx++;
    }
}

// ab [n, 2F] = in @ [w1; w3]^T, h [n, F] = silu(a) * b (a dense SwiGLU block).
static int dense_ffn(moe_model *m, const moe_block_params *p, float *ab, float *h, const float *in,
                     int n) {
    MOE_TRY(m->ops->matmul(ab, in, p->w13, n, 2 * m->F, m->D, false, true, 1.0f, 0.0f));
    return m->ops->swiglu_forward(h, ab, n, m->F);
}

// Host <-> copy transfers (below): device copies on a CUDA table, memcpy on the CPU one.
static int copy_bytes(const moe_model *g, void *dst, const void *src, size_t bytes, bool up);

// n targets and per-token losses where the host can read them: the arrays
// themselves, or read back from a CUDA device copy into its host scratch.
static int host_view(const moe_model *m, const int32_t **tg, const float **loss,
                     const int32_t *targets, int n) {
    *tg = targets;
    if (loss) *loss = m->losses;
    if (!m->gpu || !m->gpu->cuda) return 0;
    *tg = m->gpu->tg_h;
    MOE_TRY(copy_bytes(m, m->gpu->tg_h, targets, (size_t)n * sizeof(int32_t), false));
    if (!loss) return 0;
    *loss = m->gpu->loss_h;
    return copy_bytes(m, m->gpu->loss_h, m->losses, (size_t)n * sizeof(float), false);
}

// Plain LM-head loss chunk by chunk: logits exist for one chunk at a time.
static int chunked_head_forward(moe_model *m, const int32_t *targets, int N) {
    const int D = m->D, V = m->V, Nc = (N + m->chunks - 1) / m->chunks;
    double sum = 0.0, mean;
    long valid = 0;
    for (int r0 = 0; r0 < N; r0 += Nc) {
        const int n = N - r0 < Nc ? N - r0 : Nc;
        MOE_TRY(m->ops->matmul(m->logits, m->lnf + (size_t)r0 * D, m->lm_head, n, V, D, false, true,
                               1.0f, 0.0f));
        MOE_TRY(m->ops->crossentropy_forward(m->losses + r0, &mean, m->logits, targets + r0, n, V));
    }
    const int32_t *tg;
    const float *loss;
    MOE_TRY(host_view(m, &tg, &loss, targets, N));
    for (int i = 0; i < N; i++)
        if (tg[i] >= 0) sum += loss[i], valid++;
    m->ce = valid ? sum / valid : 0.0;
    return 0;
}

// Its backward: each chunk's logits are recomputed; the chunk's gradient is
// scaled to the mean over all N tokens.
static int chunked_head_backward(moe_model *m, const int32_t *targets, int N) {
    const int D = m->D, V = m->V, Nc = (N + m->chunks - 1) / m->chunks;
    long valid = 0;
    const int32_t *tg;
    MOE_TRY(host_view(m, &tg, NULL, targets, N));
    for (int i = 0; i < N; i++)
        valid += tg[i] >= 0;
    for (int r0 = 0; r0 < N && valid; r0 += Nc) {
        const int n = N - r0 < Nc ? N - r0 : Nc;
        long local = 0;
        for (int i = 0; i < n; i++)
            local += tg[r0 + i] >= 0;
        const float *lnf = m->lnf + (size_t)r0 * D;
        MOE_TRY(m->ops->matmul(m->logits, lnf, m->lm_head, n, V, D, false, true, 1.0f, 0.0f));
        MOE_TRY(m->ops->zero(m->dlogits, (size_t)n * V));
        MOE_TRY(m->ops->crossentropy_backward(m->dlogits, m->logits, targets + r0, n, V,
                                              (float)local / (float)valid));
        MOE_TRY(m->ops->matmul(m->d_lm_head, m->dlogits, lnf, V, D, n, true, false, 1.0f, 1.0f));
        MOE_TRY(m->ops->matmul(m->dln + (size_t)r0 * D, m->dlogits, m->lm_head, n, D, V, false,
                               false, 1.0f, 0.0f));
    }
    return 0;
}

// ---- the device copy (moe_model_gpu_init) ----------------------------------------------

// Cut cross-entropy: kernels/cuda/cce.cu on a CUDA device copy, else kernels/cpu/cce.c.
static size_t cce_scratch_floats(const moe_model *m, size_t N) {
    if (m->gpu && m->gpu->cuda) return moe_cuda_cce_scratch_floats((int)N, m->V);
    return moe_cpu_cce_scratch_floats();
}

static int cce_forward(moe_model *m, const int32_t *targets, int N) {
#ifdef MOE_HAVE_CUDA
    if (m->gpu && m->gpu->cuda)
        return moe_cuda_cce_forward(m->losses, m->lse, &m->ce, m->lnf, m->lm_head, targets, N, m->D,
                                    m->V, m->cce_scratch);
#endif
    return moe_cpu_cce_forward(m->losses, m->lse, &m->ce, m->lnf, m->lm_head, targets, N, m->D,
                               m->V, m->cce_scratch);
}

static int cce_backward(moe_model *m, const int32_t *targets, int N) {
    const float eps = m->cfg.loss.cce_filter ? FLT_EPSILON : 0.0f;
#ifdef MOE_HAVE_CUDA
    if (m->gpu && m->gpu->cuda)
        return moe_cuda_cce_backward(m->dln, m->d_lm_head, m->lnf, m->lm_head, targets, m->lse, N,
                                     m->D, m->V, 1.0f, eps, m->cce_scratch, NULL);
#endif
    return moe_cpu_cce_backward(m->dln, m->d_lm_head, m->lnf, m->lm_head, targets, m->lse, N, m->D,
                                m->V, 1.0f, eps, m->cce_scratch, NULL);
}

// Host <-> copy transfers: device copies on a CUDA table, memcpy on the CPU one.
static int copy_bytes(const moe_model *g, void *dst, const void *src, size_t bytes, bool up) {
    if (!g->gpu->cuda) {
        if (bytes) memcpy(dst, src, bytes);
        return 0;
    }
#ifdef MOE_HAVE_CUDA
    return up ? moe_cuda_upload(dst, src, bytes) : moe_cuda_download(dst, src, bytes);
#else
    return moe_fail(MOE_EINVAL, "built without CUDA");
#endif
}

#ifdef MOE_HAVE_CUDA
// The MoE layer of a device model: the CUDA layer, then the routing
// statistics the host code reads (counts, kept, capacity, losses) copied into
// the layer's host plan.
static int gpu_moe_forward(moe_model *m, int l, float *y, const int *cap, int N, bool training,
                           uint64_t step) {
    moe_layer_cuda_acts *g = &m->gpu->moe[l];
    MOE_TRY(moe_layer_cuda_forward(y, m->a[l].ln2, m->gpu->task_d, cap, N, &m->p[l].moe, g,
                                   training, step));
    moe_plan *plan = &m->a[l].moe.plan;
    const int E = g->plan.E;
    plan->T = N;
    // the router's read-back left them in its host mirrors: no further sync
    memcpy(plan->counts, g->plan.counts_h, sizeof(int) * E);
    memcpy(plan->kept, g->plan.kept_h, sizeof(int) * E);
    memcpy(plan->capacity, g->plan.capacity_h, sizeof(int) * E);
    memcpy(plan->offsets, g->offsets_h, sizeof(int) * (E + 1));
    plan->aux_loss = g->plan.aux_loss;
    plan->z_loss = g->plan.z_loss;
    return 0;
}

static int gpu_moe_backward(moe_model *m, int l, int N, float aux_scale, float z_scale) {
    return moe_layer_cuda_backward(m->dln, &m->g[l].moe, m->dres, m->a[l].ln2, m->gpu->task_d, N,
                                   &m->p[l].moe, &m->gpu->moe[l], aux_scale, z_scale);
}
#else
static int gpu_moe_forward(moe_model *m, int l, float *y, const int *cap, int N, bool training,
                           uint64_t step) {
    return moe_fail(MOE_EINVAL, "built without CUDA");
}

static int gpu_moe_backward(moe_model *m, int l, int N, float aux_scale, float z_scale) {
    return moe_fail(MOE_EINVAL, "built without CUDA");
}
#endif

// The first setting the device path cannot train yet (NULL: none).
static const char *gpu_unsupported(const moe_config *cfg, bool bias_on) {
    const char *no = cfg->comm.node_dedup                     ? "comm.node_dedup"
                     : cfg->router.score != MOE_SCORE_SOFTMAX ? "router.score = sigmoid"
                     : cfg->router.route_scale != 1.0         ? "router.route_scale other than 1"
                     : moe_router_groups_active(&cfg->router)
                         ? "router.topk_groups (group-limited routing)"
                     : cfg->router.type != MOE_ROUTER_TOKEN_CHOICE ? "router.type = expert_choice"
                                                                   : NULL;
    if (!no && cfg->router.bias_update_rate != 0)
        no = "router.bias_update_rate other than 0 (auxiliary-loss-free balancing)";
    if (!no && bias_on)
        no = "a non-zero expert selection bias (the checkpoint's gate.e_score_correction_bias)";
    return no;
}

int moe_model_gpu_init(moe_model *g, const moe_model *h, const moe_ops *ops) {
    memset(g, 0, sizeof *g);
    const moe_config *cfg = &h->cfg;
    const bool cuda = !strncmp(ops->name, "cuda", 4);
#ifndef MOE_HAVE_CUDA
    if (cuda) return moe_fail(MOE_EINVAL, "built without CUDA");
#endif
    // expert parallelism: the CPU table's copy runs the host layers, which
    // exchange, the CUDA layers their own exchange over the same group
    const char *no = gpu_unsupported(cfg, h->bias_on);
    if (no) return moe_fail(MOE_EINVAL, "training on the GPU does not support %s yet", no);
    *g = *h; // sizes, config, table and the host-side statistics arrays (shared)
    g->ops = ops;
    g->timing = NULL;
    g->usage = NULL;
    g->task_share = NULL;
    g->params = g->grads = NULL;
    g->gpu = calloc(1, sizeof *g->gpu);
    if (!g->gpu) return moe_fail(MOE_ENOMEM, "device model");
    g->gpu->cuda = cuda;
    const size_t n = h->table.numel, n_acts = layout_acts(g, NULL);
    int rc = 0;
    if (!(g->params = ops->alloc(n * sizeof(float))) ||
        !(g->grads = ops->alloc(n * sizeof(float))) ||
        !(g->gpu->acts = ops->alloc((n_acts ? n_acts : 1) * sizeof(float))) ||
        (cuda && (cfg->moe.n_task_layers > 0 || cfg->router.n_task_priority > 0) &&
         !(g->gpu->task_d = ops->alloc((size_t)h->B * h->T * sizeof(int))))) {
        rc = MOE_ENOMEM; // ops->alloc left the message (size and config keys)
        goto fail;
    }
    if (cuda && h->chunks > 1 &&
        (!(g->gpu->tg_h = malloc((size_t)h->B * h->T * sizeof(int32_t))) ||
         !(g->gpu->loss_h = malloc((size_t)h->B * h->T * sizeof(float))))) {
        rc = moe_fail(MOE_ENOMEM, "device model: host scratch of the chunked LM head");
        goto fail;
    }
    MOE_TRY_GOTO(copy_bytes(g, g->params, h->params, n * sizeof(float), true), rc);
    MOE_TRY_GOTO(ops->zero(g->grads, n), rc);
    layout_acts(g, g->gpu->acts);
    g->embed = g->params + (h->embed - h->params);
    g->d_embed = g->grads + (h->embed - h->params);
    g->norm = g->params + (h->norm - h->params);
    g->d_norm = g->grads + (h->norm - h->params);
    g->lm_head = g->params + (h->lm_head - h->params);
    g->d_lm_head = g->grads + (h->lm_head - h->params);
    for (int l = 0; l < g->L; l++) {
        size_t moe_off = h->is_moe[l] ? (size_t)(h->p[l].moe.gate - h->params) : 0;
        bind_block(g, &g->p[l], g->params, l, moe_off);
        bind_block(g, &g->g[l], g->grads, l, moe_off);
#ifdef MOE_HAVE_CUDA
        if (g->is_moe[l] && cuda) {
            MOE_TRY_GOTO(moe_layer_cuda_acts_alloc(&g->gpu->moe[l], &g->moe_cfg[l], ops), rc);
            g->gpu->moe[l].ep = h->ep;
        }
#endif
        // on the CPU table the copy's MoE layers use the host model's layer
        // buffers (g->a[l].moe is a copy of h's): only one of the two runs
    }
    return 0;
fail:
    moe_model_gpu_free(g);
    return rc;
}

void moe_model_gpu_free(moe_model *g) {
    if (!g->gpu) return;
#ifdef MOE_HAVE_CUDA
    for (int l = 0; l < g->L; l++)
        if (g->is_moe[l] && g->gpu->cuda) moe_layer_cuda_acts_free(&g->gpu->moe[l]);
#endif
    if (g->gpu->acts) g->ops->free(g->gpu->acts);
    if (g->gpu->task_d) g->ops->free(g->gpu->task_d);
    free(g->gpu->tg_h);
    free(g->gpu->loss_h);
    if (g->params) g->ops->free(g->params);
    if (g->grads) g->ops->free(g->grads);
    free(g->gpu);
    memset(g, 0, sizeof *g); // the shared host arrays belong to the host model
}

int moe_model_device_memory(const moe_config *cfg, int B, int T, int n_tasks, const moe_ops *ops,
                            moe_model_mem *out) {
    moe_model m;
    size_t moe_off[MOE_MAX_LAYERS];
    struct moe_model_gpu gpu = {0};
    memset(out, 0, sizeof *out);
    if (!ops) ops = &moe_ops_cuda_sizes;
    // any rank of an EP group: every one holds E / ep experts and the same buffers
    moe_ep_group ep = {cfg->parallel.ep, 0, NULL, NULL, 0, NULL}; // sizes only: never called
    MOE_TRY(model_setup(&m, cfg, B, T, n_tasks, cfg->parallel.ep > 1 ? &ep : NULL, moe_off));
    const char *no = gpu_unsupported(cfg, false);
    if (no) {
        moe_param_table_free(&m.table);
        return moe_fail(MOE_EINVAL, "training on the GPU does not support %s yet", no);
    }
    // moe_model_gpu_init's buffers, sized as it sizes them
    m.ops = ops;
    gpu.cuda = !strncmp(ops->name, "cuda", 4);
    m.gpu = &gpu;
    const size_t n = m.table.numel, n_acts = layout_acts(&m, NULL);
    out->n_params = n;
    out->params = ops->alloc_size(n * sizeof(float));
    out->grads = out->params;
    out->activations = ops->alloc_size((n_acts ? n_acts : 1) * sizeof(float));
    if (gpu.cuda && (cfg->moe.n_task_layers > 0 || cfg->router.n_task_priority > 0))
        out->activations += ops->alloc_size((size_t)B * T * sizeof(int));
    // on the CPU table the copy's MoE layers use the host model's buffers
    for (int l = 0; l < m.L && gpu.cuda; l++)
        if (m.is_moe[l])
            out->moe += moe_cuda_layer_bytes(&m.moe_cfg[l],
                                             moe_cuda_sort_tmp_bytes(m.moe_cfg[l].T_max, NULL));
    moe_param_table_free(&m.table);
    return 0;
}

int moe_model_gpu_download(moe_model *h, const moe_model *g) {
    for (int l = 0; l < h->L; l++)
        h->cap[l] = g->cap[l]; // controller counters (its arrays are shared)
    h->load_calls = g->load_calls;
    return copy_bytes(g, h->params, g->params, h->table.numel * sizeof(float), false);
}

// Layer l's attention up to its output before o_proj: ln1, rstd1, q, k, v
// (after RoPE), att and atty from the layer input x. The backward pass calls
// it again under memory.recompute = all (same inputs, same bits).
static int attention_inner(moe_model *m, int l, int B, int T) {
    const moe_ops *ops = m->ops;
    moe_block_acts *a = &m->a[l];
    const moe_block_params *p = &m->p[l];
    const int N = B * T, D = m->D, QD = m->Hq * m->hd, KD = m->Hkv * m->hd;
    const float eps = (float)m->cfg.model.norm_eps, theta = (float)m->cfg.model.rope_theta;
    MOE_TRY(m->ops->rmsnorm_forward(a->ln1, a->rstd1, a->x, p->ln1, N, D, eps));
    MOE_TRY(ops->matmul(a->q, a->ln1, p->wq, N, QD, D, false, true, 1.0f, 0.0f));
    MOE_TRY(ops->matmul(a->k, a->ln1, p->wk, N, KD, D, false, true, 1.0f, 0.0f));
    MOE_TRY(ops->matmul(a->v, a->ln1, p->wv, N, KD, D, false, true, 1.0f, 0.0f));
    MOE_TRY(m->ops->rope_forward(a->q, a->q, B, T, m->Hq, m->hd, theta));
    MOE_TRY(m->ops->rope_forward(a->k, a->k, B, T, m->Hkv, m->hd, theta));
    return m->ops->attention_forward(a->atty, a->att, m->datt, a->q, a->k, a->v, B, T, m->Hq,
                                     m->Hkv, m->hd);
}

int moe_model_forward(moe_model *m, const int32_t *inputs, const int32_t *targets,
                      const int32_t *task, int B, int T, bool training, uint64_t step) {
    if (B < 1 || T < 1 || B > m->B || T > m->T)
        return moe_fail(MOE_EINVAL, "model forward: batch %d x %d exceeds %d x %d", B, T, m->B,
                        m->T);
    const moe_ops *ops = m->ops;
    const int N = B * T, D = m->D, QD = m->Hq * m->hd;
    const float eps = (float)m->cfg.model.norm_eps;
    const int Nc = (N + m->chunks - 1) / m->chunks; // FFN rows at a time
    m->cur_B = B, m->cur_T = T;
    for (int n = 0; n < N; n++) {
        int t = task ? task[n / T] : 0;
        if (t < 0 || t >= m->n_tasks)
            return moe_fail(MOE_EINVAL, "task id %d of sequence %d: the model knows %d tasks", t,
                            n / T, m->n_tasks);
        m->task_tok[n] = t;
    }
    if (m->gpu && m->gpu->task_d) // the CUDA layers read the ids from device memory
        MOE_TRY(copy_bytes(m, m->gpu->task_d, m->task_tok, (size_t)N * sizeof(int), true));
    m->aux = m->z = 0.0;
    double t0 = m->timing ? now() : 0;
    for (int l = 0; l < m->L; l++)
        m->a[l].moe.timing = m->timing ? &m->timing->moe_layer : NULL;
    MOE_TRY(m->ops->embedding_forward(m->a[0].x, inputs, m->embed, N, D, m->V));
    lap(m, m->timing ? &m->timing->embed : NULL, &t0);
    int moe_idx = 0;
    for (int l = 0; l < m->L; l++) {
        moe_block_acts *a = &m->a[l];
        moe_block_params *p = &m->p[l];
        float *next = l + 1 < m->L ? m->a[l + 1].x : m->xf;
        MOE_TRY(attention_inner(m, l, B, T));
        MOE_TRY(ops->matmul(a->mid, a->atty, p->wo, N, D, QD, false, true, 1.0f, 0.0f));
        MOE_TRY(ops->add(a->mid, a->x, (size_t)N * D));
        MOE_TRY(m->ops->rmsnorm_forward(a->ln2, a->rstd2, a->mid, p->ln2, N, D, eps));
        lap(m, m->timing ? &m->timing->attention : NULL, &t0);
        if (!m->is_moe[l]) {
            for (int r0 = 0; r0 < N; r0 += Nc) { // one chunk, or all N rows
                const int n = N - r0 < Nc ? N - r0 : Nc;
                float *ab = m->chunks > 1 ? m->ffn_ab : a->ab, *h = m->chunks > 1 ? m->ffn_h : a->h;
                MOE_TRY(dense_ffn(m, p, ab, h, a->ln2 + (size_t)r0 * D, n));
                MOE_TRY(ops->matmul(next + (size_t)r0 * D, h, p->w2, n, D, m->F, false, true, 1.0f,
                                    0.0f));
            }
        } else {
            // Learned capacities apply to batches of the training shape; other
            // shapes (generation) use the static formula.
            const int *cap = m->cap[l].capacity && N == m->B * m->T ? m->cap[l].capacity : NULL;
            if (m->dropless && m->cfg.router.type != MOE_ROUTER_EXPERT_CHOICE) { // EC: no C_e
                for (int e = 0; e < m->moe_cfg[l].E; e++)
                    m->cap_all[e] = N;
                cap = m->cap_all;
            }
            int rc = m->gpu && m->gpu->cuda ? gpu_moe_forward(m, l, next, cap, N, training, step)
                                            : moe_layer_forward(next, a->ln2, m->task_tok, cap, N,
                                                                &p->moe, &a->moe, training, step);
            if (rc < 0) return moe_fail(rc, "layer %d (MoE): %s", l, moe_last_error());
            const moe_plan *plan = &a->moe.plan;
            m->aux += plan->aux_loss;
            m->z += plan->z_loss;
            if (training)
                for (int e = 0; e < plan->E; e++)
                    m->load[(size_t)moe_idx * m->usage_E + e] += plan->counts[e];
            if (m->usage)
                for (int n = 0; n < N; n++) {
                    size_t row = (size_t)moe_idx * m->n_tasks + m->task_tok[n];
                    const int e0 = plan->choice[(size_t)n * plan->k]; // -1: expert choice took none
                    if (e0 >= 0) m->usage[row * m->usage_E + e0]++;
                }
            moe_idx++;
        }
        lap(m, m->timing ? (m->is_moe[l] ? &m->timing->moe : &m->timing->ffn) : NULL, &t0);
        MOE_TRY(ops->add(next, a->mid, (size_t)N * D));
    }
    m->load_calls += training;
    MOE_TRY(m->ops->rmsnorm_forward(m->lnf, m->rstdf, m->xf, m->norm, N, D, eps));
    const bool cce = !strcmp(m->cfg.loss.impl, "cce");
    m->ce = 0.0;
    if (cce && targets) {
        MOE_TRY(cce_forward(m, targets, N));
    } else if (cce && N > m->T) {
        return moe_fail(MOE_EINVAL,
                        "loss.impl = cce computes logits for one sequence at a time, "
                        "not %d x %d tokens",
                        B, T);
    } else if (targets && m->chunks > 1) {
        MOE_TRY(chunked_head_forward(m, targets, N));
    } else if (m->chunks > 1 && N > m->T) {
        return moe_fail(MOE_EINVAL,
                        "with memory.mini_seq the model computes logits for one "
                        "sequence at a time, not %d x %d tokens",
                        B, T);
    } else {
        MOE_TRY(ops->matmul(m->logits, m->lnf, m->lm_head, N, m->V, D, false, true, 1.0f, 0.0f));
        m->ce = 0.0;
        if (targets)
            MOE_TRY(m->ops->crossentropy_forward(m->losses, &m->ce, m->logits, targets, N, m->V));
    }
    m->loss = m->ce + m->cfg.router.aux_loss_coef * m->aux + m->cfg.router.z_loss_coef * m->z;
    lap(m, m->timing ? &m->timing->head : NULL, &t0);
    return 0;
}

int moe_model_backward(moe_model *m, const int32_t *inputs, const int32_t *targets,
                       const int32_t *task) {
    if (m->forward_only)
        return moe_fail(MOE_EINVAL, "model backward: this model was built for evaluation (no "
                                    "gradients)");
    const moe_ops *ops = m->ops;
    const int B = m->cur_B, T = m->cur_T, N = B * T, D = m->D, QD = m->Hq * m->hd,
              KD = m->Hkv * m->hd;
    const float theta = (float)m->cfg.model.rope_theta;
    const float aux_c = (float)m->cfg.router.aux_loss_coef, z_c = (float)m->cfg.router.z_loss_coef;
    const int Nc = (N + m->chunks - 1) / m->chunks;
    if (!N) return moe_fail(MOE_EINVAL, "model backward before forward");
    (void)task; // the forward recorded per-token task ids in m->task_tok

    double t0 = m->timing ? now() : 0;
    if (!strcmp(m->cfg.loss.impl, "cce")) {
        MOE_TRY(ops->zero(m->dln, (size_t)N * D));
        MOE_TRY(cce_backward(m, targets, N));
    } else if (m->chunks > 1) {
        MOE_TRY(chunked_head_backward(m, targets, N));
    } else {
        MOE_TRY(ops->zero(m->dlogits, (size_t)N * m->V));
        MOE_TRY(m->ops->crossentropy_backward(m->dlogits, m->logits, targets, N, m->V, 1.0f));
        MOE_TRY(ops->matmul(m->d_lm_head, m->dlogits, m->lnf, m->V, D, N, true, false, 1.0f, 1.0f));
        MOE_TRY(ops->matmul(m->dln, m->dlogits, m->lm_head, N, D, m->V, false, false, 1.0f, 0.0f));
    }
    MOE_TRY(ops->zero(m->dres, (size_t)N * D));
    MOE_TRY(m->ops->rmsnorm_backward(m->dres, m->d_norm, m->dln, m->xf, m->norm, m->rstdf, N, D));
    lap(m, m->timing ? &m->timing->head : NULL, &t0);
    for (int l = m->L - 1; l >= 0; l--) {
        moe_block_acts *a = &m->a[l];
        moe_block_params *p = &m->p[l], *g = &m->g[l];
        // FFN block: next = mid + ffn(rmsnorm(mid)); dres holds d next.
        MOE_TRY(ops->zero(m->dln, (size_t)N * D));
        if (!m->is_moe[l]) {
            for (int r0 = 0; r0 < N; r0 += Nc) {
                const int n = N - r0 < Nc ? N - r0 : Nc, F = m->F;
                const float *ln2 = a->ln2 + (size_t)r0 * D, *dres = m->dres + (size_t)r0 * D;
                float *ab = a->ab, *h = a->h;
                if (m->chunks > 1) { // recompute the chunk's intermediates
                    ab = m->ffn_ab, h = m->ffn_h;
                    MOE_TRY(dense_ffn(m, p, ab, h, ln2, n));
                }
                MOE_TRY(ops->matmul(m->dh, dres, p->w2, n, F, D, false, false, 1.0f, 0.0f));
                MOE_TRY(ops->matmul(g->w2, dres, h, D, F, n, true, false, 1.0f, 1.0f));
                MOE_TRY(ops->zero(m->dab, (size_t)n * 2 * F));
                MOE_TRY(ops->swiglu_backward(m->dab, m->dh, ab, n, F));
                MOE_TRY(ops->matmul(g->w13, m->dab, ln2, 2 * F, D, n, true, false, 1.0f, 1.0f));
                MOE_TRY(ops->matmul(m->dln + (size_t)r0 * D, m->dab, p->w13, n, D, 2 * F, false,
                                    false, 1.0f, 0.0f));
            }
        } else {
            if (m->gpu && m->gpu->cuda)
                MOE_TRY(gpu_moe_backward(m, l, N, aux_c, z_c));
            else
                MOE_TRY(moe_layer_backward(m->dln, &g->moe, m->dres, a->ln2, m->task_tok, N,
                                           &p->moe, &a->moe, aux_c, z_c));
        }
        MOE_TRY(m->ops->rmsnorm_backward(m->dres, g->ln2, m->dln, a->mid, p->ln2, a->rstd2, N, D));
        lap(m, m->timing ? (m->is_moe[l] ? &m->timing->moe : &m->timing->ffn) : NULL, &t0);
        // Attention block: mid = x + atty @ Wo^T; dres holds d mid.
        if (m->recompute_attn) MOE_TRY(attention_inner(m, l, B, T));
        MOE_TRY(ops->matmul(g->wo, m->dres, a->atty, D, QD, N, true, false, 1.0f, 1.0f));
        MOE_TRY(ops->matmul(m->datty, m->dres, p->wo, N, QD, D, false, false, 1.0f, 0.0f));
        MOE_TRY(ops->zero(m->dq, (size_t)N * QD));
        MOE_TRY(ops->zero(m->dk, (size_t)N * KD));
        MOE_TRY(ops->zero(m->dv, (size_t)N * KD));
        MOE_TRY(m->ops->attention_backward(m->dq, m->dk, m->dv, m->datt, m->datty, a->atty, a->att,
                                           a->q, a->k, a->v, B, T, m->Hq, m->Hkv, m->hd));
        MOE_TRY(ops->zero(m->dqr, (size_t)N * QD));
        MOE_TRY(ops->zero(m->dkr, (size_t)N * KD));
        MOE_TRY(m->ops->rope_backward(m->dqr, m->dq, B, T, m->Hq, m->hd, theta));
        MOE_TRY(m->ops->rope_backward(m->dkr, m->dk, B, T, m->Hkv, m->hd, theta));
        MOE_TRY(ops->matmul(g->wq, m->dqr, a->ln1, QD, D, N, true, false, 1.0f, 1.0f));
        MOE_TRY(ops->matmul(g->wk, m->dkr, a->ln1, KD, D, N, true, false, 1.0f, 1.0f));
        MOE_TRY(ops->matmul(g->wv, m->dv, a->ln1, KD, D, N, true, false, 1.0f, 1.0f));
        MOE_TRY(ops->matmul(m->dln, m->dqr, p->wq, N, D, QD, false, false, 1.0f, 0.0f));
        MOE_TRY(ops->matmul(m->dln, m->dkr, p->wk, N, D, KD, false, false, 1.0f, 1.0f));
        MOE_TRY(ops->matmul(m->dln, m->dv, p->wv, N, D, KD, false, false, 1.0f, 1.0f));
        MOE_TRY(m->ops->rmsnorm_backward(m->dres, g->ln1, m->dln, a->x, p->ln1, a->rstd1, N, D));
        lap(m, m->timing ? &m->timing->attention : NULL, &t0);
    }
    MOE_TRY(m->ops->embedding_backward(m->d_embed, m->dres, inputs, N, D));
    lap(m, m->timing ? &m->timing->embed : NULL, &t0);
    return 0;
}
