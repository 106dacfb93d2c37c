// Loading a checkpoint for task-routed inference: the dense tensors, then per
// MoE layer only the experts the task needs (task-routed layers: the k experts
// recorded in task_experts.json and re-derived from the gate; token-routed
// layers: all, or those above the expert budget). Tensors are read one by one
// by byte range, so bytes read = index + headers + the tensors kept.
// int8 experts: per-output-channel symmetric scales s = max|w| / 127,
// q = round(w / s) (ties to even, in [-127, 127]), dequantised to fp32 for
// the GEMM (LLM.int8-style weights).
#include "moe/alloc.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/infer.h"
#include "moe/log.h"
#include "moe/name_map.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Reads tensor name (F32, shape [d0] or [d0, d1]) into dst.
static int load(moe_st_set *s, const char *dir, float *dst, int64_t d0, int64_t d1, const char *fmt,
                ...) __attribute__((format(printf, 6, 7)));
static int load(moe_st_set *s, const char *dir, float *dst, int64_t d0, int64_t d1, const char *fmt,
                ...) {
    char name[MOE_PARAM_NAME_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    moe_st_file *f = NULL;
    const moe_st_tensor *t = moe_st_set_find(s, name, &f);
    if (!t) return moe_fail(MOE_EFORMAT, "%s: missing tensor '%s'", dir, name);
    const int nd = d1 ? 2 : 1;
    if (t->dtype != MOE_ST_F32 || t->ndim != nd || t->shape[0] != d0 ||
        (nd == 2 && t->shape[1] != d1)) {
        const int64_t want_shape[2] = {d0, d1};
        char have[160], want[160];
        moe_st_describe(have, sizeof have, t->dtype, t->ndim, t->shape);
        moe_st_describe(want, sizeof want, MOE_ST_F32, nd, want_shape);
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' is %s, the config expects %s", f->path, name,
                        have, want);
    }
    return moe_st_read(f, t, dst, (size_t)t->numel * sizeof(float));
}

// The names a checkpoint of this config holds, for the extra-tensor check.
typedef struct {
    char (*name)[MOE_PARAM_NAME_MAX];
    size_t n, cap;
} name_list;

static int add_name(name_list *nl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int add_name(name_list *nl, const char *fmt, ...) {
    if (nl->n == nl->cap) {
        size_t cap = nl->cap ? 2 * nl->cap : 64;
        void *p = realloc(nl->name, cap * sizeof *nl->name);
        if (!p) return moe_fail(MOE_ENOMEM, "tensor names: out of memory");
        nl->name = p, nl->cap = cap;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(nl->name[nl->n++], MOE_PARAM_NAME_MAX, fmt, ap);
    va_end(ap);
    return 0;
}

static const char *list_name(const void *names, uint32_t i) {
    return ((const char(*)[MOE_PARAM_NAME_MAX])names)[i];
}

// The checkpoint may hold no tensor the config lacks (as moe_ckpt_load): a
// config.json edited to fewer layers or experts than the weights hold would
// otherwise generate from a truncated model.
static int check_no_extra(const moe_infer *m, const moe_st_set *s, const char *dir) {
    name_list nl = {0};
    moe_name_map idx = {0};
    int rc = 0;
    const char *pre = "model.layers", *bs = "block_sparse_moe";
    MOE_TRY_GOTO(add_name(&nl, "model.embed_tokens.weight"), rc);
    MOE_TRY_GOTO(add_name(&nl, "model.norm.weight"), rc);
    if (!m->cfg.model.tie_embeddings) MOE_TRY_GOTO(add_name(&nl, "lm_head.weight"), rc);
    static const char *const attn[] = {"input_layernorm",  "self_attn.q_proj",
                                       "self_attn.k_proj", "self_attn.v_proj",
                                       "self_attn.o_proj", "post_attention_layernorm"};
    for (int l = 0; l < m->L; l++) {
        const moe_infer_layer *y = &m->layer[l];
        for (int i = 0; i < 6; i++)
            MOE_TRY_GOTO(add_name(&nl, "%s.%d.%s.weight", pre, l, attn[i]), rc);
        if (!y->is_moe) {
            static const char *const mlp[] = {"gate_proj", "up_proj", "down_proj"};
            for (int i = 0; i < 3; i++)
                MOE_TRY_GOTO(add_name(&nl, "%s.%d.mlp.%s.weight", pre, l, mlp[i]), rc);
            continue;
        }
        MOE_TRY_GOTO(add_name(&nl, "%s.%d.%s.gate.weight", pre, l, bs), rc);
        MOE_TRY_GOTO(add_name(&nl, MOE_CKPT_BIAS_FMT, l), rc); // optional
        if (y->task_routed)
            MOE_TRY_GOTO(add_name(&nl, "%s.%d.%s.task_embedding.weight", pre, l, bs), rc);
        for (int w = 1; w <= 3; w++) {
            if (y->Hs)
                MOE_TRY_GOTO(add_name(&nl, "%s.%d.%s.shared_expert.w%d.weight", pre, l, bs, w), rc);
            for (int e = 0; e < y->E; e++)
                MOE_TRY_GOTO(add_name(&nl, "%s.%d.%s.experts.%d.w%d.weight", pre, l, bs, e, w), rc);
        }
    }
    MOE_TRY_GOTO(moe_name_map_reserve(&idx, nl.n), rc);
    for (size_t i = 0; i < nl.n; i++) {
        long dup;
        MOE_TRY_GOTO(moe_name_map_add(&idx, nl.name, list_name, i, &dup), rc);
    }
    for (int i = 0; i < s->n_files; i++)
        for (int j = 0; j < s->files[i]->n_tensors; j++) {
            const char *name = s->files[i]->tensors[j].name;
            if (moe_name_map_find(&idx, nl.name, list_name, name) < 0)
                MOE_TRY_GOTO(moe_fail(MOE_EFORMAT,
                                      "%s: tensor '%s' does not belong to the model of "
                                      "config.json (%d layers)",
                                      s->files[i]->path, name, m->L),
                             rc);
        }
fail:
    moe_name_map_free(&idx);
    free(nl.name);
    return rc;
}

// Floats of every non-expert weight (one block, carved in load order).
static size_t dense_floats(const moe_infer *m) {
    const size_t D = m->D, QD = (size_t)m->Hq * m->hd, KD = (size_t)m->Hkv * m->hd;
    size_t n = (size_t)m->V * D * (m->cfg.model.tie_embeddings ? 1 : 2) + D;
    for (int l = 0; l < m->L; l++) {
        const moe_infer_layer *y = &m->layer[l];
        n += 2 * D + 2 * QD * D + 2 * KD * D;
        if (!y->is_moe)
            n += 3 * (size_t)m->F * D;
        else
            n += (size_t)y->E * (D + 1) + (y->task_routed ? (size_t)m->n_tasks * D : 0) +
                 3 * (size_t)y->Hs * D;
    }
    return n;
}

static int load_dense(moe_infer *m, moe_st_set *s, const char *dir) {
    const int D = m->D, QD = m->Hq * m->hd, KD = m->Hkv * m->hd, F = m->F;
    size_t n = dense_floats(m);
    float *p = m->dense_block = moe_malloc(n * sizeof(float));
    if (!p) return moe_fail(MOE_ENOMEM, "%s: %zu bytes of weights: out of memory", dir, n * 4);
    m->stats.dense_bytes = n * sizeof(float);
#define TAKE(ptr, count) (ptr = p, p += (count))
    TAKE(m->embed, (size_t)m->V * D);
    MOE_TRY(load(s, dir, m->embed, m->V, D, "model.embed_tokens.weight"));
    for (int l = 0; l < m->L; l++) {
        moe_infer_layer *y = &m->layer[l];
        const char *pre = "model.layers";
        TAKE(y->ln1, D);
        MOE_TRY(load(s, dir, y->ln1, D, 0, "%s.%d.input_layernorm.weight", pre, l));
        TAKE(y->wq, (size_t)QD * D);
        MOE_TRY(load(s, dir, y->wq, QD, D, "%s.%d.self_attn.q_proj.weight", pre, l));
        TAKE(y->wk, (size_t)KD * D);
        MOE_TRY(load(s, dir, y->wk, KD, D, "%s.%d.self_attn.k_proj.weight", pre, l));
        TAKE(y->wv, (size_t)KD * D);
        MOE_TRY(load(s, dir, y->wv, KD, D, "%s.%d.self_attn.v_proj.weight", pre, l));
        TAKE(y->wo, (size_t)D * QD);
        MOE_TRY(load(s, dir, y->wo, D, QD, "%s.%d.self_attn.o_proj.weight", pre, l));
        TAKE(y->ln2, D);
        MOE_TRY(load(s, dir, y->ln2, D, 0, "%s.%d.post_attention_layernorm.weight", pre, l));
        if (!y->is_moe) { // gate_proj and up_proj rows form one [2F, D] block
            TAKE(y->w13, 2 * (size_t)F * D);
            MOE_TRY(load(s, dir, y->w13, F, D, "%s.%d.mlp.gate_proj.weight", pre, l));
            MOE_TRY(load(s, dir, y->w13 + (size_t)F * D, F, D, "%s.%d.mlp.up_proj.weight", pre, l));
            TAKE(y->w2, (size_t)D * F);
            MOE_TRY(load(s, dir, y->w2, D, F, "%s.%d.mlp.down_proj.weight", pre, l));
            continue;
        }
        const char *bs = "block_sparse_moe";
        TAKE(y->gate, (size_t)y->E * D);
        MOE_TRY(load(s, dir, y->gate, y->E, D, "%s.%d.%s.gate.weight", pre, l, bs));
        TAKE(y->bias, y->E); // routing uses it only when present and non-zero
        bool found = false, any = false;
        MOE_TRY(moe_ckpt_bias_read(s, dir, l, y->E, y->bias, &found));
        for (int e = 0; found && e < y->E; e++)
            any |= y->bias[e] != 0.0f;
        if (!any) y->bias = NULL;
        if (y->task_routed) {
            TAKE(y->task_emb, (size_t)m->n_tasks * D);
            MOE_TRY(load(s, dir, y->task_emb, m->n_tasks, D, "%s.%d.%s.task_embedding.weight", pre,
                         l, bs));
        }
        if (y->Hs) {
            const int Hs = y->Hs;
            TAKE(y->shared_w13, 2 * (size_t)Hs * D);
            MOE_TRY(
                load(s, dir, y->shared_w13, Hs, D, "%s.%d.%s.shared_expert.w1.weight", pre, l, bs));
            MOE_TRY(load(s, dir, y->shared_w13 + (size_t)Hs * D, Hs, D,
                         "%s.%d.%s.shared_expert.w3.weight", pre, l, bs));
            TAKE(y->shared_w2, (size_t)D * Hs);
            MOE_TRY(
                load(s, dir, y->shared_w2, D, Hs, "%s.%d.%s.shared_expert.w2.weight", pre, l, bs));
        }
    }
    TAKE(m->norm, D);
    MOE_TRY(load(s, dir, m->norm, D, 0, "model.norm.weight"));
    if (m->cfg.model.tie_embeddings) {
        m->lm_head = m->embed;
    } else {
        TAKE(m->lm_head, (size_t)m->V * D);
        MOE_TRY(load(s, dir, m->lm_head, m->V, D, "lm_head.weight"));
    }
#undef TAKE
    return 0;
}

// Group-limited routing picks a token's topk_groups groups among those with a
// kept expert, then its top_k experts inside them: every such choice of groups
// must hold top_k kept experts. While the topk_groups groups with the fewest
// kept experts hold fewer, the most used expert left out of those groups (by
// the task's share, ties to the lower expert) is kept too. A full group set
// always holds enough (moe_router_groups_check), so this ends.
static void budget_fill_groups(bool *keep, const double *share, int E, int k,
                               const moe_router_config *rc) {
    const int ng = rc->n_groups, tg = rc->topk_groups, s = E / ng;
    for (;;) {
        int cnt[ng], worst[ng], n_ne = 0;
        for (int g = 0; g < ng; g++) {
            cnt[g] = 0;
            for (int e = g * s; e < (g + 1) * s; e++)
                cnt[g] += keep[e];
            if (cnt[g] > 0) worst[n_ne++] = g;
        }
        // fewer non-empty groups than topk_groups: a token's groups hold every
        // kept expert, at least k of them
        if (n_ne < tg) return;
        for (int a = 0; a < tg; a++) // the tg groups with the fewest kept experts
            for (int b = a + 1; b < n_ne; b++)
                if (cnt[worst[b]] < cnt[worst[a]]) {
                    int t = worst[a];
                    worst[a] = worst[b], worst[b] = t;
                }
        int sum = 0, add = -1;
        for (int a = 0; a < tg; a++) {
            const int g = worst[a];
            sum += cnt[g];
            for (int e = g * s; e < (g + 1) * s; e++)
                if (!keep[e] &&
                    (add < 0 || share[e] > share[add] || (share[e] == share[add] && e < add)))
                    add = e;
        }
        if (sum >= k || add < 0) return;
        keep[add] = true;
    }
}

// Which experts each MoE layer keeps: y->slot, y->n_loaded, and y->allowed
// (the router's mask) when an expert budget leaves experts out.
static int choose_experts(moe_infer *m, const char *dir, const moe_infer_opts *o) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/task_experts.json", dir);
    moe_task_experts te; // checked against config.json here, against the weights below
    int rc = moe_ckpt_task_experts(dir, &m->cfg, NULL, &te), have = rc == 0;
    if (rc == MOE_ENOTFOUND) {
        m->stats.derived_sets = true;
        moe_log(MOE_LOG_INFO,
                "%s: no task_experts.json (older checkpoint): task experts derived from the "
                "gate and task embeddings",
                dir);
        rc = 0;
    }
    if (rc < 0) return rc;
    for (int l = 0; l < m->L; l++) {
        moe_infer_layer *y = &m->layer[l];
        if (!y->is_moe) continue;
        y->slot = calloc((size_t)y->E, sizeof(int));
        y->allowed = calloc((size_t)y->E, sizeof(bool));
        if (!y->slot || !y->allowed) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "out of memory"), rc);
        bool *keep = y->allowed;
        if (y->task_routed) {
            int set[m->n_tasks * m->k];
            MOE_TRY_GOTO(moe_task_expert_set(set, y->gate, y->task_emb, y->E, m->D, m->n_tasks,
                                             &m->cfg.router),
                         rc);
            const int *mine = set + (size_t)m->task * m->k;
            if (have) MOE_TRY_GOTO(moe_task_experts_check_set(&te, path, l, set), rc);
            for (int j = 0; j < m->k; j++)
                keep[mine[j]] = true;
        } else if (o->expert_budget > 0 && !o->full_load) {
            if (!have || !te.share[l])
                MOE_TRY_GOTO(moe_fail(MOE_EINVAL,
                                      "%s: --expert-budget needs the per-task expert load that "
                                      "checkpoints record in task_experts.json; this one has none",
                                      dir),
                             rc);
            // experts above the budget, and always the task's k most used (so
            // the router can still pick k)
            const double *sh = te.share[l] + (size_t)m->task * y->E;
            for (int e = 0; e < y->E; e++)
                keep[e] = sh[e] >= o->expert_budget;
            int order[y->E];
            for (int e = 0; e < y->E; e++)
                order[e] = e;
            for (int a = 0; a < m->k; a++) // partial selection sort: k largest shares
                for (int b = a + 1; b < y->E; b++)
                    if (sh[order[b]] > sh[order[a]]) {
                        int t = order[a];
                        order[a] = order[b], order[b] = t;
                    }
            for (int j = 0; j < m->k; j++)
                keep[order[j]] = true;
            if (moe_router_groups_active(&m->cfg.router))
                budget_fill_groups(keep, sh, y->E, m->k, &m->cfg.router);
        } else {
            for (int e = 0; e < y->E; e++)
                keep[e] = true;
        }
        if (o->full_load) // load everything, route as the partial load would
            for (int e = 0; e < y->E; e++)
                y->slot[e] = e;
        y->n_loaded = 0;
        for (int e = 0; e < y->E; e++)
            if (!o->full_load) y->slot[e] = keep[e] ? y->n_loaded++ : -1;
        if (o->full_load) y->n_loaded = y->E;
        int n_keep = 0;
        for (int e = 0; e < y->E; e++)
            n_keep += keep[e];
        // Only a budget restricts the router; a task-routed layer picks the
        // task's experts by itself, with the full softmax over all E.
        if (n_keep == y->E || y->task_routed) {
            free(y->allowed);
            y->allowed = NULL;
        }
    }
fail:
    if (have) moe_task_experts_free(&te);
    return rc;
}

// Reads the kept experts of every MoE layer into one block (fp32, or int8
// with per-row scales through a one-expert fp32 staging buffer).
static int load_experts(moe_infer *m, moe_st_set *s, const char *dir, bool int8) {
    size_t fp32 = 0, blocks = 0, rows = 0, maxblk = 0;
    for (int l = 0; l < m->L; l++) {
        const moe_infer_layer *y = &m->layer[l];
        if (!y->is_moe) continue;
        size_t blk = 3 * (size_t)y->H * m->D;
        blocks += (size_t)y->n_loaded * blk;
        rows += (size_t)y->n_loaded * (2 * (size_t)y->H + m->D);
        if (blk > maxblk) maxblk = blk;
    }
    fp32 = blocks * sizeof(float);
    size_t bytes = int8 ? blocks + rows * sizeof(float) : fp32;
    char *p = m->expert_block = moe_malloc(bytes ? bytes : 1);
    float *stage = int8 ? moe_malloc(maxblk * sizeof(float) + 1) : NULL;
    int rc = 0;
    if (!p || (int8 && !stage))
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: %zu bytes of experts: out of memory", dir, bytes),
                     rc);
    m->stats.expert_bytes = bytes;
    m->stats.expert_bytes_fp32 = fp32;
    float *scales = int8 ? (float *)p : NULL; // int8 layout: all scales, then all weights
    int8_t *q = int8 ? (int8_t *)(p + rows * sizeof(float)) : NULL;
    float *f = int8 ? NULL : (float *)p;
    for (int l = 0; l < m->L; l++) {
        moe_infer_layer *y = &m->layer[l];
        if (!y->is_moe) continue;
        const int D = m->D, H = y->H;
        const size_t blk = 3 * (size_t)H * D, nrow = 2 * (size_t)H + D;
        if (int8)
            y->q = q, y->q_scale = scales;
        else
            y->experts = f;
        for (int e = 0; e < y->E; e++) {
            if (y->slot[e] < 0) continue;
            float *dst = int8 ? stage : y->experts + (size_t)y->slot[e] * blk;
            MOE_TRY_GOTO(load(s, dir, dst, H, D,
                              "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l, e),
                         rc);
            MOE_TRY_GOTO(load(s, dir, dst + (size_t)H * D, H, D,
                              "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l, e),
                         rc);
            MOE_TRY_GOTO(load(s, dir, dst + 2 * (size_t)H * D, D, H,
                              "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l, e),
                         rc);
            if (!int8) continue;
            // rows of [w1; w3] have D columns, rows of w2 have H
            int8_t *qe = y->q + (size_t)y->slot[e] * blk;
            float *se = y->q_scale + (size_t)y->slot[e] * nrow;
            size_t off = 0;
            for (size_t r = 0; r < nrow; r++) {
                const size_t w = r < 2 * (size_t)H ? (size_t)D : (size_t)H;
                float amax = 0;
                for (size_t c = 0; c < w; c++)
                    amax = fmaxf(amax, fabsf(stage[off + c]));
                // (load refused non-finite weights, naming the tensor and element)
                float sc = amax / 127.0f;
                // A subnormal max: amax / 127 rounds on the coarse subnormal
                // grid (or to 0), and amax / sc may round to 128 or more,
                // which wraps in int8; the next larger scales keep q in
                // [-127, 127] and every error within sc / 2.
                if (amax > 0 && !(sc > 0)) sc = FLT_TRUE_MIN;
                while (amax > 0 && lrintf(amax / sc) > 127)
                    sc = nextafterf(sc, INFINITY);
                if (!(sc > 0)) sc = 1.0f; // a zero row: every q is 0
                se[r] = sc;
                for (size_t c = 0; c < w; c++)
                    qe[off + c] = (int8_t)lrintf(stage[off + c] / sc);
                off += w;
            }
        }
        if (int8) {
            q += (size_t)y->n_loaded * blk;
            scales += (size_t)y->n_loaded * nrow;
        } else {
            f += (size_t)y->n_loaded * blk;
        }
    }
fail:
    moe_mfree(stage);
    return rc;
}

// Scratch for N_max rows and the KV caches.
static int alloc_scratch(moe_infer *m) {
    const size_t N = m->N_max, D = m->D, QD = (size_t)m->Hq * m->hd, KD = (size_t)m->Hkv * m->hd;
    size_t Hm = m->F, Emax = 1, blk = 0;
    for (int l = 0; l < m->L; l++) {
        const moe_infer_layer *y = &m->layer[l];
        if (!y->is_moe) continue;
        if ((size_t)y->H > Hm) Hm = y->H;
        if ((size_t)y->Hs > Hm) Hm = y->Hs;
        if ((size_t)y->E > Emax) Emax = y->E;
        if (3 * (size_t)y->H * D > blk) blk = 3 * (size_t)y->H * D;
    }
    const size_t rows = N * m->k, cache = (size_t)m->max_batch * m->max_seq * KD;
    const bool int8 = m->stats.expert_bytes < m->stats.expert_bytes_fp32;
    size_t n = 0;
    float *base = NULL;
    for (int pass = 0; pass < 2; pass++) {
        n = 0;
#define TAKE(ptr, count)                                                                           \
    do {                                                                                           \
        if (base) ptr = base + n;                                                                  \
        n += (count);                                                                              \
    } while (0)
        TAKE(m->x, N * D);
        TAKE(m->ln, N * D);
        TAKE(m->rstd, N);
        TAKE(m->q, N * QD);
        TAKE(m->kk, N * KD);
        TAKE(m->vv, N * KD);
        TAKE(m->atty, N * QD);
        TAKE(m->mid, N * D);
        TAKE(m->ab, N * 2 * Hm);
        TAKE(m->h, N * Hm);
        TAKE(m->logits, N * m->V);
        TAKE(m->scores, (size_t)m->max_seq);
        TAKE(m->mlogits, N * Emax);
        TAKE(m->xe, rows * D);
        TAKE(m->eab, rows * 2 * Hm);
        TAKE(m->eh, rows * Hm);
        TAKE(m->ye, rows * D);
        TAKE(m->deq, int8 ? blk : 0);
        for (int l = 0; l < m->L; l++) {
            TAKE(m->layer[l].kc, cache);
            TAKE(m->layer[l].vc, cache);
        }
#undef TAKE
        if (pass == 0) {
            base = m->scratch_block = moe_calloc(n + 1, sizeof(float));
            if (!base) return moe_fail(MOE_ENOMEM, "inference scratch: out of memory");
        }
    }
    m->stats.cache_bytes = n * sizeof(float);
    m->row = moe_malloc(sizeof(int) * rows);
    m->cap = moe_malloc(sizeof(int) * Emax);
    m->task_tok = moe_malloc(sizeof(int) * N);
    if (!m->row || !m->cap || !m->task_tok)
        return moe_fail(MOE_ENOMEM, "inference scratch: out of memory");
    for (int l = 0; l < m->L; l++)
        if (m->layer[l].is_moe) {
            moe_infer_layer *y = &m->layer[l];
            MOE_TRY(moe_plan_alloc(&y->plan, (int)N, y->E, m->k));
            // an expert left out by the budget must stay unpickable with a bias too
            for (int e = 0; y->bias && y->allowed && e < y->E; e++)
                if (!y->allowed[e]) y->bias[e] = -1e30f;
            y->plan.bias = y->bias;
            y->plan.usable = y->allowed; // left out: never chosen, in no group's score
        }
    return 0;
}

struct open_args {
    moe_infer *m;
    const moe_infer_opts *o;
};

static int open_read(const char *dir, void *ctx);

// Through moe_ckpt_read_retry: a train.keep_checkpoints = 0 save that
// replaces the folder between the resolve and the reads opens the new one.
int moe_infer_open(moe_infer *m, const char *dir, const moe_infer_opts *o) {
    struct open_args a = {m, o};
    memset(m, 0, sizeof *m);
    return moe_ckpt_read_retry(dir, open_read, &a);
}

// moe_infer_open of the resolved folder dir.
static int open_read(const char *dir, void *ctx) {
    moe_infer *m = ((struct open_args *)ctx)->m;
    const moe_infer_opts *o = ((struct open_args *)ctx)->o;
    memset(m, 0, sizeof *m);
    moe_st_set *s = NULL;
    int rc = 0;
    // room left for the file names below
    if (strlen(dir) >= PATH_MAX - 64) return moe_fail(MOE_EINVAL, "%s: path too long", dir);
    MOE_TRY(moe_ckpt_config(dir, &m->cfg));
    const moe_config *c = &m->cfg;
    moe_infer_opts one; // a model of one task (one corpus) needs no --task
    char names[MOE_MAX_TASKS][MOE_NAME_MAX];
    if (!o->task && moe_config_task_names(c, names) == 1) one = *o, one.task = names[0], o = &one;
    if (!o->task) return moe_fail(MOE_EINVAL, "no task given (--task NAME)");
    int task = moe_config_task_index(c, o->task);
    if (task < 0) return task;
    if (o->expert_budget < 0 || o->expert_budget > 1)
        return moe_fail(MOE_EINVAL, "expert budget %g is not a share in [0, 1]", o->expert_budget);
    if (c->parallel.ep != 1) m->cfg.parallel.ep = 1;  // inference runs in one process
    if (c->router.type == MOE_ROUTER_EXPERT_CHOICE) { // README "Expert-choice routing"
        if (c->router.ec_fallback != MOE_EC_FALLBACK_TOKEN_CHOICE)
            return moe_fail(MOE_EINVAL,
                            "%s/config.json: router.type = expert_choice routes over a whole "
                            "batch and is training only; inference needs router.ec_fallback = "
                            "token_choice (top_k token choice with the same gate)",
                            dir);
        m->cfg.router.type = MOE_ROUTER_TOKEN_CHOICE;
    }
    m->task = task;
    m->V = c->model.vocab_size, m->D = c->model.d_model, m->L = c->model.n_layers;
    m->Hq = c->model.n_heads, m->Hkv = c->model.n_kv_heads, m->hd = m->D / m->Hq;
    m->F = c->model.d_ff, m->k = c->router.top_k;
    m->n_tasks = moe_config_task_names(c, names);
    m->max_batch = o->max_batch > 0 ? o->max_batch : 1;
    m->max_seq = o->max_seq > 0 ? o->max_seq : c->model.seq_len;
    m->N_max = m->max_seq > m->max_batch ? m->max_seq : m->max_batch;
    if (m->N_max < m->n_tasks) m->N_max = m->n_tasks; // task logits share the logit scratch
    for (int l = 0; l < m->L; l++) {
        moe_infer_layer *y = &m->layer[l];
        y->is_moe = moe_config_is_moe(c, l);
        if (!y->is_moe) continue;
        y->E = moe_config_experts(c, l);
        y->H = c->moe.d_expert ? c->moe.d_expert : m->F;
        y->Hs = c->moe.shared_experts ? y->H : 0;
        for (int i = 0; i < c->moe.n_task_layers; i++)
            y->task_routed |= c->moe.task_layers[i] == l;
        if (m->k > y->E)
            return moe_fail(MOE_EINVAL, "router.top_k %d > %d experts in layer %d", m->k, y->E, l);
        m->stats.n_moe++;
    }
    MOE_TRY_GOTO(moe_st_set_open(dir, &s), rc);
    MOE_TRY_GOTO(check_no_extra(m, s, dir), rc);
    MOE_TRY_GOTO(load_dense(m, s, dir), rc);
    MOE_TRY_GOTO(choose_experts(m, dir, o), rc);
    MOE_TRY_GOTO(load_experts(m, s, dir, o->quantize_int8), rc);
    MOE_TRY_GOTO(alloc_scratch(m), rc);
    m->stats.bytes_read = moe_st_set_bytes_read(s);
    m->stats.ckpt_bytes = s->total_bytes;
    for (int l = 0; l < m->L; l++) {
        m->stats.loaded[l] = m->layer[l].n_loaded;
        m->stats.experts[l] = m->layer[l].E;
        m->stats.task_routed[l] = m->layer[l].task_routed;
    }
    moe_st_set_close(s);
    return 0;
fail:
    moe_st_set_close(s);
    moe_infer_free(m);
    return rc;
}

void moe_infer_free(moe_infer *m) {
    for (int l = 0; l < MOE_MAX_LAYERS; l++) {
        free(m->layer[l].slot);
        free(m->layer[l].allowed);
        moe_plan_free(&m->layer[l].plan);
    }
    moe_mfree(m->dense_block);
    moe_mfree(m->expert_block);
    moe_mfree(m->scratch_block);
    moe_mfree(m->row);
    moe_mfree(m->cap);
    moe_mfree(m->task_tok);
    memset(m, 0, sizeof *m);
}
