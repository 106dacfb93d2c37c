// Per-task expert sets (Task-MoE, arXiv 2110.03742: a task-routed layer sends
// every token of a task to the same k experts) and per-task expert load of
// token-routed layers, as recorded in task_experts.json (moe/task_experts.h).
#include "moe/task_experts.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/json_error.h"
#include "moe/parse.h"
#include "moe/safetensors.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int moe_config_task_names(const moe_config *cfg, char names[][MOE_NAME_MAX]) {
    if (strcmp(cfg->data.kind, "synthetic") != 0 && !cfg->data.task_paths[0][0]) {
        snprintf(names[0], MOE_NAME_MAX, "all");
        return 1;
    }
    for (int i = 0; i < cfg->data.n_tasks; i++)
        snprintf(names[i], MOE_NAME_MAX, "%s", cfg->data.tasks[i]);
    return cfg->data.n_tasks;
}

int moe_config_task_index(const moe_config *cfg, const char *name) {
    char names[MOE_MAX_TASKS][MOE_NAME_MAX], known[MOE_MAX_TASKS * (MOE_NAME_MAX + 2)] = "";
    const char *cands[MOE_MAX_TASKS];
    int n = moe_config_task_names(cfg, names);
    for (int i = 0; i < n; i++) {
        if (!strcmp(names[i], name)) return i;
        strcat(known, i ? ", " : "");
        strcat(known, names[i]);
        cands[i] = names[i];
    }
    const char *best = moe_nearest(name, cands, n);
    char hint[MOE_NAME_MAX + 24] = "";
    if (best) snprintf(hint, sizeof hint, "did you mean %s? ", best);
    return moe_fail(MOE_EINVAL, "unknown task '%s' (%sthis checkpoint's tasks: %s)", name, hint,
                    known);
}

int moe_task_route(int *set, float *weight, const float *gate, const float *task_emb, int E, int D,
                   int n_tasks, const moe_router_config *router) {
    const int k = router->top_k;
    float *logits = malloc(sizeof(float) * (size_t)n_tasks * E);
    int *cap = malloc(sizeof(int) * (size_t)E), *ids = malloc(sizeof(int) * (size_t)n_tasks);
    moe_plan plan = {0};
    int rc = 0;
    if (!logits || !cap || !ids)
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "task experts: out of memory"), rc);
    for (int e = 0; e < E; e++) // one row per task: no expert can overflow
        cap[e] = n_tasks;
    for (int t = 0; t < n_tasks; t++) // row t is task t (router.task_priority orders by it)
        ids[t] = t;
    // the MoE layer's own gate GEMM and router: bit-identical choices
    MOE_TRY_GOTO(moe_ops_cpu.matmul(logits, task_emb, gate, n_tasks, E, D, false, true, 1.0f, 0.0f),
                 rc);
    MOE_TRY_GOTO(moe_plan_alloc(&plan, n_tasks, E, k), rc);
    MOE_TRY_GOTO(moe_router_forward(&plan, logits, ids, cap, n_tasks, E, router, false, 0), rc);
    for (int t = 0; t < n_tasks; t++) { // ascending experts, each with its weight
        int *c = set + (size_t)t * k;
        float *w = weight ? weight + (size_t)t * k : NULL;
        memcpy(c, plan.choice + (size_t)t * k, sizeof(int) * k);
        if (w) memcpy(w, plan.weight + (size_t)t * k, sizeof(float) * k);
        for (int i = 1; i < k; i++) // insertion sort of k pairs
            for (int j = i; j > 0 && c[j - 1] > c[j]; j--) {
                int ci = c[j];
                c[j] = c[j - 1], c[j - 1] = ci;
                if (w) {
                    float wi = w[j];
                    w[j] = w[j - 1], w[j - 1] = wi;
                }
            }
    }
fail:
    moe_plan_free(&plan);
    free(logits);
    free(cap);
    free(ids);
    return rc;
}

int moe_task_expert_set(int *set, const float *gate, const float *task_emb, int E, int D,
                        int n_tasks, const moe_router_config *router) {
    return moe_task_route(set, NULL, gate, task_emb, E, D, n_tasks, router);
}

void moe_task_experts_free(moe_task_experts *te) {
    for (int l = 0; l < MOE_MAX_LAYERS; l++) {
        free(te->set[l]);
        free(te->share[l]);
    }
    memset(te, 0, sizeof *te);
}

int moe_task_experts_from_model(moe_task_experts *te, const moe_model *m) {
    memset(te, 0, sizeof *te);
    te->n_tasks = moe_config_task_names(&m->cfg, te->task);
    te->top_k = m->cfg.router.top_k;
    te->L = m->L;
    te->val_tokens = m->task_share ? m->task_share_tokens : 0;
    int idx = 0, rc = 0;
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_layer_config *c = &m->moe_cfg[l];
        te->E[l] = c->E;
        if (c->n_tasks > 0) {
            te->kind[l] = MOE_LAYER_TASK;
            if (c->n_tasks < te->n_tasks)
                MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "layer %d routes %d tasks, the data has %d", l,
                                      c->n_tasks, te->n_tasks),
                             rc);
            te->set[l] = malloc(sizeof(int) * (size_t)te->n_tasks * te->top_k);
            if (!te->set[l]) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "task experts: out of memory"), rc);
            rc = moe_task_expert_set(te->set[l], m->p[l].moe.gate, m->p[l].moe.task_emb, c->E, c->D,
                                     te->n_tasks, &c->router);
            if (rc == MOE_ENUMERIC) { // weights went non-finite: the trainer reports it
                free(te->set[l]);
                te->set[l] = NULL;
                rc = 0;
            }
            if (rc < 0) goto fail;
        } else {
            te->kind[l] = MOE_LAYER_TOKEN;
            if (m->task_share) {
                te->share[l] = malloc(sizeof(double) * (size_t)te->n_tasks * c->E);
                if (!te->share[l])
                    MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "task experts: out of memory"), rc);
                for (int t = 0; t < te->n_tasks; t++)
                    memcpy(te->share[l] + (size_t)t * c->E,
                           m->task_share + ((size_t)idx * m->n_tasks + t) * m->usage_E,
                           sizeof(double) * c->E);
            }
        }
        idx++;
    }
    return 0;
fail:
    moe_task_experts_free(te);
    return rc;
}

int moe_task_share_measure(moe_model *m, moe_data *d, int n_batches) {
    size_t n_moe = moe_model_load_len(m) / (m->usage_E ? m->usage_E : 1);
    size_t n = n_moe * m->n_tasks * m->usage_E;
    double *share = calloc(n ? n : 1, sizeof(double));
    int32_t *in = malloc(sizeof(int32_t) * d->B * d->T),
            *tg = malloc(sizeof(int32_t) * d->B * d->T);
    int32_t *task = malloc(sizeof(int32_t) * d->B);
    int rc = 0;
    if (!share || !in || !tg || !task)
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "task experts: out of memory"), rc);
    long tokens = 0;
    for (int b = 0; b < n_batches; b++) {
        MOE_TRY_GOTO(moe_data_batch(d, MOE_SPLIT_VAL, (uint64_t)b, in, tg, task), rc);
        MOE_TRY_GOTO(moe_model_forward(m, in, tg, task, d->B, d->T, false, 0), rc);
        if (!isfinite(m->loss))
            MOE_TRY_GOTO(moe_fail(MOE_ENUMERIC, "validation batch %d: loss is %g", b, m->loss), rc);
        tokens += (long)d->B * d->T;
        int idx = 0;
        for (int l = 0; l < m->L; l++) {
            if (!m->is_moe[l]) continue;
            const moe_plan *pl = &m->a[l].moe.plan;
            for (int i = 0; i < pl->T * pl->k; i++) {
                int t = m->task_tok[i / pl->k];
                if (pl->choice[i] < 0) continue; // expert choice: an unused entry
                share[((size_t)idx * m->n_tasks + t) * m->usage_E + pl->choice[i]] += 1.0;
            }
            idx++;
        }
    }
    for (size_t r = 0; r < n_moe * m->n_tasks; r++) { // counts -> shares per (layer, task)
        double tot = 0;
        for (int e = 0; e < m->usage_E; e++)
            tot += share[r * m->usage_E + e];
        for (int e = 0; e < m->usage_E && tot > 0; e++)
            share[r * m->usage_E + e] /= tot;
    }
    free(m->task_share);
    m->task_share = share;
    m->task_share_tokens = tokens;
    share = NULL;
fail:
    free(share);
    free(in);
    free(tg);
    free(task);
    return rc;
}

// ---- task_experts.json --------------------------------------------------------------

int moe_task_experts_write(const char *path, const moe_task_experts *te) {
    json_t *doc = json_object(), *tasks = json_array(), *layers = json_array();
    json_object_set_new(doc, "format", json_integer(1));
    json_object_set_new(doc, "top_k", json_integer(te->top_k));
    for (int t = 0; t < te->n_tasks; t++)
        json_array_append_new(tasks, json_string(te->task[t]));
    json_object_set_new(doc, "tasks", tasks);
    json_object_set_new(doc, "val_tokens", json_integer(te->val_tokens));
    for (int l = 0; l < te->L; l++) {
        if (te->kind[l] == MOE_LAYER_DENSE) continue;
        json_t *o = json_object(), *rows = json_array();
        json_object_set_new(o, "layer", json_integer(l));
        json_object_set_new(o, "routing",
                            json_string(te->kind[l] == MOE_LAYER_TASK ? "task" : "token"));
        json_object_set_new(o, "num_experts", json_integer(te->E[l]));
        for (int t = 0; t < te->n_tasks; t++) {
            json_t *row = json_array();
            if (te->kind[l] == MOE_LAYER_TASK && te->set[l])
                for (int j = 0; j < te->top_k; j++)
                    json_array_append_new(row, json_integer(te->set[l][(size_t)t * te->top_k + j]));
            else if (te->share[l])
                for (int e = 0; e < te->E[l]; e++)
                    json_array_append_new(row, json_real(te->share[l][(size_t)t * te->E[l] + e]));
            json_array_append_new(rows, row);
        }
        if (te->kind[l] == MOE_LAYER_TASK && te->set[l])
            json_object_set_new(o, "experts", rows);
        else if (te->kind[l] == MOE_LAYER_TOKEN && te->share[l])
            json_object_set_new(o, "share", rows);
        else
            json_decref(rows);
        json_array_append_new(layers, o);
    }
    json_object_set_new(doc, "layers", layers);
    // Written and fsynced through the counted calls (moe/fsio.h) that the
    // checkpoint's fault-injection test cuts.
    int rc = moe_fs_write_json(path, doc,
                               JSON_INDENT(1) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
    json_decref(doc);
    return rc;
}

static int read_layer(const char *path, json_t *o, moe_task_experts *te) {
    json_t *jl = json_object_get(o, "layer"), *jr = json_object_get(o, "routing"),
           *je = json_object_get(o, "num_experts");
    if (!json_is_integer(jl) || json_integer_value(jl) < 0 ||
        json_integer_value(jl) >= MOE_MAX_LAYERS || !json_is_string(jr) || !json_is_integer(je) ||
        json_integer_value(je) < 1 || json_integer_value(je) > 1 << 20)
        return moe_fail(MOE_EFORMAT, "%s: a layer entry lacks 'layer', 'routing' or 'num_experts'",
                        path);
    const int l = (int)json_integer_value(jl), E = (int)json_integer_value(je);
    const bool task = !strcmp(json_string_value(jr), "task");
    if (!task && strcmp(json_string_value(jr), "token"))
        return moe_fail(MOE_EFORMAT, "%s: layer %d: 'routing' is '%s', expected task or token",
                        path, l, json_string_value(jr));
    if (te->kind[l]) return moe_fail(MOE_EFORMAT, "%s: layer %d is listed twice", path, l);
    te->E[l] = E;
    te->kind[l] = task ? MOE_LAYER_TASK : MOE_LAYER_TOKEN;
    if (l >= te->L) te->L = l + 1;
    json_t *rows = json_object_get(o, task ? "experts" : "share");
    if (!rows) return 0; // not measured (token layers) or not derivable (non-finite weights)
    if (!json_is_array(rows) || json_array_size(rows) != (size_t)te->n_tasks)
        return moe_fail(MOE_EFORMAT, "%s: layer %d '%s' must have one row per task (%d)", path, l,
                        task ? "experts" : "share", te->n_tasks);
    const int width = task ? te->top_k : E;
    if (task)
        te->set[l] = malloc(sizeof(int) * (size_t)te->n_tasks * width);
    else
        te->share[l] = malloc(sizeof(double) * (size_t)te->n_tasks * width);
    if (task ? !te->set[l] : !te->share[l]) return moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    for (int t = 0; t < te->n_tasks; t++) {
        json_t *row = json_array_get(rows, (size_t)t);
        if (!json_is_array(row) || json_array_size(row) != (size_t)width)
            return moe_fail(MOE_EFORMAT, "%s: layer %d task '%s' needs %d entries", path, l,
                            te->task[t], width);
        for (int j = 0; j < width; j++) {
            json_t *v = json_array_get(row, (size_t)j);
            if (task) {
                if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= E)
                    return moe_fail(MOE_EFORMAT,
                                    "%s: layer %d task '%s': expert index not in 0..%d", path, l,
                                    te->task[t], E - 1);
                te->set[l][(size_t)t * width + j] = (int)json_integer_value(v);
                // a set, as written: ascending ({4, 0} read as "recorded {4, 0}, routed
                // {0, 4}", as if the sets differed)
                if (j > 0 && te->set[l][(size_t)t * width + j - 1] >= json_integer_value(v))
                    return moe_fail(MOE_EFORMAT,
                                    "%s: layer %d task '%s': expert indices must be distinct "
                                    "and ascending",
                                    path, l, te->task[t]);
            } else {
                if (!json_is_number(v))
                    return moe_fail(MOE_EFORMAT, "%s: layer %d task '%s': share is not a number",
                                    path, l, te->task[t]);
                if (!(json_number_value(v) >= 0 && json_number_value(v) <= 1))
                    return moe_fail(MOE_EFORMAT,
                                    "%s: layer %d task '%s': share %g is not in [0, 1]", path, l,
                                    te->task[t], json_number_value(v));
                te->share[l][(size_t)t * width + j] = json_number_value(v);
            }
        }
    }
    return 0;
}

int moe_task_experts_read(const char *path, moe_task_experts *te) {
    memset(te, 0, sizeof *te);
    struct stat sb;
    if (stat(path, &sb) != 0) return moe_fail(MOE_ENOTFOUND, "%s: not found", path);
    json_error_t jerr;
    FILE *in;
    MOE_TRY(moe_fopen_regular(path, &in));
    json_t *doc = json_loadf(in, 0, &jerr);
    fclose(in);
    if (!doc) return moe_json_fail(MOE_EFORMAT, path, &jerr);
    int rc = 0;
    json_t *tasks = json_object_get(doc, "tasks"), *layers = json_object_get(doc, "layers"),
           *k = json_object_get(doc, "top_k"), *vt = json_object_get(doc, "val_tokens");
    if (!json_is_array(tasks) || json_array_size(tasks) < 1 ||
        json_array_size(tasks) > MOE_MAX_TASKS || !json_is_array(layers) || !json_is_integer(k) ||
        json_integer_value(k) < 1 || json_integer_value(k) > 1 << 20)
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: needs 'tasks', 'top_k' and 'layers'", path), rc);
    te->top_k = (int)json_integer_value(k);
    te->val_tokens = json_is_integer(vt) ? (long)json_integer_value(vt) : 0;
    te->n_tasks = (int)json_array_size(tasks);
    for (int t = 0; t < te->n_tasks; t++) {
        json_t *s = json_array_get(tasks, (size_t)t);
        if (!json_is_string(s))
            MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: tasks[%d] is not a string", path, t), rc);
        snprintf(te->task[t], MOE_NAME_MAX, "%s", json_string_value(s));
    }
    for (size_t i = 0; i < json_array_size(layers); i++)
        MOE_TRY_GOTO(read_layer(path, json_array_get(layers, i), te), rc);
    json_decref(doc);
    return 0;
fail:
    json_decref(doc);
    moe_task_experts_free(te);
    return rc;
}

// ---- checks against the checkpoint ------------------------------------------------

// "{3, 5}": k expert ids.
static void set_text(char *buf, size_t cap, const int *set, int k) {
    size_t len = (size_t)snprintf(buf, cap, "{");
    for (int j = 0; j < k && len < cap; j++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", j ? ", " : "", set[j]);
    if (len < cap) snprintf(buf + len, cap - len, "}");
}

// "copy, reverse" into buf.
static void names_text(char *buf, size_t cap, char (*names)[MOE_NAME_MAX], int n) {
    size_t len = 0;
    buf[0] = 0;
    for (int t = 0; t < n && len < cap; t++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%s", t ? ", " : "", names[t]);
}

// The tasks of the config, in its order (rows are indexed by task id), and
// its top_k.
static int check_header(const moe_task_experts *te, const char *path, const moe_config *cfg) {
    char names[MOE_MAX_TASKS][MOE_NAME_MAX];
    int n = moe_config_task_names(cfg, names), t = 0;
    while (t < n && t < te->n_tasks && !strcmp(te->task[t], names[t]))
        t++;
    if (t < n || te->n_tasks != n) {
        char have[512], want[512];
        names_text(have, sizeof have, (char(*)[MOE_NAME_MAX])te->task, te->n_tasks);
        names_text(want, sizeof want, names, n);
        return moe_fail(MOE_EFORMAT,
                        "%s: lists the tasks [%s] but config.json has [%s] (task %d: %s%s%s vs "
                        "%s%s%s)",
                        path, have, want, t, t < te->n_tasks ? "'" : "",
                        t < te->n_tasks ? te->task[t] : "none", t < te->n_tasks ? "'" : "",
                        t < n ? "'" : "", t < n ? names[t] : "none", t < n ? "'" : "");
    }
    if (te->top_k != cfg->router.top_k)
        return moe_fail(MOE_EFORMAT, "%s: top_k %d but config.json has router.top_k %d", path,
                        te->top_k, cfg->router.top_k);
    return 0;
}

// Exactly the config's MoE layers, each with its routing and expert count.
static int check_layers(const moe_task_experts *te, const char *path, const moe_config *cfg) {
    const int L = cfg->model.n_layers;
    for (int l = 0; l < MOE_MAX_LAYERS; l++) {
        const bool moe = l < L && moe_config_is_moe(cfg, l);
        bool task = false;
        for (int i = 0; i < cfg->moe.n_task_layers; i++)
            task |= cfg->moe.task_layers[i] == l;
        if (!moe && te->kind[l] != MOE_LAYER_DENSE)
            return l >= L ? moe_fail(MOE_EFORMAT,
                                     "%s: lists layer %d, but config.json has %d layers (0..%d)",
                                     path, l, L, L - 1)
                          : moe_fail(MOE_EFORMAT,
                                     "%s: lists layer %d, a dense layer in config.json", path, l);
        if (!moe) continue;
        if (te->kind[l] == MOE_LAYER_DENSE)
            return moe_fail(MOE_EFORMAT, "%s: does not list MoE layer %d of config.json", path, l);
        const int want = task ? MOE_LAYER_TASK : MOE_LAYER_TOKEN;
        if (te->kind[l] != want)
            return moe_fail(MOE_EFORMAT,
                            "%s: layer %d routes by %s, but config.json's moe.task_layers makes it "
                            "%s-routed",
                            path, l, te->kind[l] == MOE_LAYER_TASK ? "task" : "token",
                            task ? "task" : "token");
        if (te->E[l] != moe_config_experts(cfg, l))
            return moe_fail(MOE_EFORMAT, "%s: layer %d has %d experts, config.json %d", path, l,
                            te->E[l], moe_config_experts(cfg, l));
    }
    return 0;
}

int moe_task_experts_check_set(const moe_task_experts *te, const char *path, int l,
                               const int *set) {
    const int k = te->top_k;
    for (int t = 0; te->set[l] && t < te->n_tasks; t++) {
        const int *rec = te->set[l] + (size_t)t * k, *got = set + (size_t)t * k;
        if (!memcmp(rec, got, sizeof(int) * k)) continue;
        char a[256], b[256];
        set_text(a, sizeof a, rec, k);
        set_text(b, sizeof b, got, k);
        return moe_fail(MOE_EFORMAT,
                        "%s: layer %d task '%s' is recorded with experts %s, but the weights "
                        "route it to %s",
                        path, l, te->task[t], a, b);
    }
    return 0;
}

int moe_ckpt_task_router(const moe_st_set *s, int l, int D, void **gate, int64_t gs[2], void **emb,
                         int64_t es[2]) {
    char gname[128], ename[128];
    snprintf(gname, sizeof gname, "model.layers.%d.block_sparse_moe.gate.weight", l);
    snprintf(ename, sizeof ename, "model.layers.%d.block_sparse_moe.task_embedding.weight", l);
    *gate = *emb = NULL;
    moe_st_file *gf = NULL, *ef = NULL;
    if (!moe_st_set_find(s, gname, &gf) || !moe_st_set_find(s, ename, &ef))
        return moe_fail(MOE_EFORMAT, "layer %d: no '%s' or '%s'", l, gname, ename);
    int rc = moe_st_load(gf, gname, MOE_ST_F32, 2, gs, gate);
    if (rc == 0) rc = moe_st_load(ef, ename, MOE_ST_F32, 2, es, emb);
    if (rc == 0 && (gs[1] != D || es[1] != D))
        rc = moe_fail(MOE_EFORMAT, "'%s' or '%s' does not have the config's d_model %d", gname,
                      ename, D);
    if (rc < 0) {
        free(*gate);
        free(*emb);
        *gate = *emb = NULL;
    }
    return rc;
}

// Each task-routed layer's recorded sets equal the ones its gate and task
// embeddings give (the layer's own router, as inference derives them).
static int check_sets(const moe_task_experts *te, const char *path, const moe_config *cfg,
                      const moe_st_set *s) {
    const int k = te->top_k, n = te->n_tasks, D = cfg->model.d_model;
    int rc = 0;
    for (int l = 0; l < cfg->model.n_layers && rc == 0; l++) {
        if (te->kind[l] != MOE_LAYER_TASK || !te->set[l]) continue;
        void *gate = NULL, *emb = NULL;
        int64_t gs[2], es[2];
        int *set = NULL;
        rc = moe_ckpt_task_router(s, l, D, &gate, gs, &emb, es);
        if (rc < 0) return moe_fail(rc, "%s: %s", path, moe_last_error());
        if (gs[0] != te->E[l] || es[0] < n)
            rc = moe_fail(MOE_EFORMAT,
                          "%s: layer %d: gate [%lld, %d] or task embeddings [%lld, %d] do not "
                          "have the config's %d experts and %d tasks",
                          path, l, (long long)gs[0], D, (long long)es[0], D, te->E[l], n);
        if (rc == 0 && !(set = malloc(sizeof(int) * (size_t)n * k)))
            rc = moe_fail(MOE_ENOMEM, "%s: out of memory", path);
        if (rc == 0) rc = moe_task_expert_set(set, gate, emb, te->E[l], D, n, &cfg->router);
        if (rc == 0) rc = moe_task_experts_check_set(te, path, l, set);
        free(set);
        free(gate);
        free(emb);
    }
    return rc;
}

int moe_ckpt_task_experts(const char *dir, const moe_config *cfg, const moe_st_set *s,
                          moe_task_experts *te) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/task_experts.json", dir) >= (int)sizeof path)
        return moe_fail(MOE_EINVAL, "%s: path too long", dir);
    MOE_TRY(moe_task_experts_read(path, te));
    int rc = check_header(te, path, cfg);
    if (rc == 0) rc = check_layers(te, path, cfg);
    if (rc == 0 && s) rc = check_sets(te, path, cfg, s);
    if (rc < 0) moe_task_experts_free(te);
    return rc;
}
