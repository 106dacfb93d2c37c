// Checkpoint folders: write everything into DIR.tmp (each file fsynced),
// rename DIR to DIR.old, DIR.tmp to DIR, fsync the parent, remove DIR.old.
// Loading validates every tensor against the model's table.
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const files[] = {"model.safetensors", "optimizer.safetensors", "config.json",
                                    "trainer_state.json", "task_experts.json"};
#define N_FILES 5

// out[PATH_MAX] = dir + suffix; MOE_EINVAL if it does not fit.
static int join(char *out, const char *dir, const char *suffix) {
    if (snprintf(out, PATH_MAX, "%s%s", dir, suffix) >= PATH_MAX)
        return moe_fail(MOE_EINVAL, "%s: path too long", dir);
    return 0;
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static void remove_dir(const char *dir) {
    char p[PATH_MAX];
    for (int i = 0; i < N_FILES; i++) {
        char name[64];
        snprintf(name, sizeof name, "/%s", files[i]);
        if (join(p, dir, name) == 0) unlink(p);
    }
    rmdir(dir);
}

static int fsync_path(const char *p) {
    int fd = open(p, O_RDONLY);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

// Writes a JSON document to path and fsyncs it.
static int write_json(const char *path, json_t *doc) {
    FILE *f = fopen(path, "w");
    if (!f) return moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
    int bad = json_dumpf(doc, f, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
    bad |= fputc('\n', f) == EOF || fflush(f) || fsync(fileno(f));
    bad |= fclose(f) != 0;
    return bad ? moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno)) : 0;
}

static int write_state(const char *path, const moe_model *m, const moe_adamw *opt,
                       const moe_train_state *st) {
    json_t *doc = json_object(), *caps = json_array();
    json_object_set_new(doc, "step", json_integer(st->step));
    json_object_set_new(doc, "adam_step", json_integer(opt->step));
    json_t *cur = json_array();
    json_array_append_new(cur, json_integer((json_int_t)st->cursor[0]));
    json_array_append_new(cur, json_integer((json_int_t)st->cursor[1]));
    json_object_set_new(doc, "data_cursor", cur);
    for (int l = 0; l < m->L; l++) {
        const moe_capacity_ctl *c = &m->cap[l];
        if (!c->capacity) continue;
        json_t *o = json_object(), *ema = json_array(), *cap = json_array();
        for (int e = 0; e < c->E; e++) {
            json_array_append_new(ema, json_real(c->ema[e]));
            json_array_append_new(cap, json_integer(c->capacity[e]));
        }
        json_object_set_new(o, "layer", json_integer(l));
        json_object_set_new(o, "steps", json_integer(c->steps));
        json_object_set_new(o, "seeded", json_boolean(c->seeded));
        json_object_set_new(o, "ema", ema);
        json_object_set_new(o, "capacity", cap);
        json_array_append_new(caps, o);
    }
    json_object_set_new(doc, "capacity", caps);
    int rc = write_json(path, doc);
    json_decref(doc);
    return rc;
}

// One file's tensors in single-process model order: this rank's tensors from
// buf, and with expert parallelism each MoE layer's full expert list from the
// gathered copies (gathered[l]: [E, 3HD], expert blocks as in the layer).
typedef struct {
    moe_st_entry *e;
    char (*names)[MOE_PARAM_NAME_MAX + 16];
    int n;
} entry_list;

static int is_expert(const char *name) {
    return strstr(name, ".experts.") != NULL;
}

static int build_entries(entry_list *out, const moe_model *m, const float *buf, float **gathered,
                         const char *suffix) {
    int n_max = m->table.count;
    for (int l = 0; l < m->L; l++)
        if (m->is_moe[l]) n_max += 3 * m->moe_cfg[l].E;
    out->e = calloc((size_t)n_max, sizeof *out->e);
    out->names = calloc((size_t)n_max, sizeof *out->names);
    out->n = 0;
    if (!out->e || !out->names) return moe_fail(MOE_ENOMEM, "checkpoint: out of memory");
    int last = -1;
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        if (!is_expert(v->name) || !gathered) {
            moe_st_entry *e = &out->e[out->n];
            snprintf(out->names[out->n], sizeof out->names[0], "%s%s", v->name, suffix);
            *e = (moe_st_entry){out->names[out->n++], MOE_ST_F32, v->ndim, {0}, buf + v->offset};
            memcpy(e->shape, v->shape, sizeof(int64_t) * v->ndim);
            continue;
        }
        int l = atoi(v->name + strlen("model.layers."));
        if (l == last) continue; // all of the layer's experts went in with the first
        last = l;
        const moe_layer_config *c = &m->moe_cfg[l];
        const int64_t D = c->D, H = c->H;
        static const char *const w[3] = {"w1", "w3", "w2"};
        for (int x = 0; x < c->E; x++)
            for (int k = 0; k < 3; k++) {
                moe_st_entry *e = &out->e[out->n];
                snprintf(out->names[out->n], sizeof out->names[0],
                         "model.layers.%d.block_sparse_moe.experts.%d.%s.weight%s", l, x, w[k],
                         suffix);
                const float *blk = gathered[l] + (size_t)x * 3 * H * D;
                *e = (moe_st_entry){out->names[out->n++],
                                    MOE_ST_F32,
                                    2,
                                    {k < 2 ? H : D, k < 2 ? D : H},
                                    blk + (size_t)k * H * D};
            }
    }
    return 0;
}

static void free_entries(entry_list *l) {
    free(l->e);
    free(l->names);
}

// Gathers every MoE layer's expert blocks of buf over the EP group.
static int gather_experts(const moe_model *m, moe_parallel *par, const float *buf, float **out) {
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_layer_config *c = &m->moe_cfg[l];
        size_t blk = 3 * (size_t)c->H * c->D, local = blk * moe_layer_local_experts(c);
        out[l] = malloc(blk * c->E * sizeof(float));
        if (!out[l]) return moe_fail(MOE_ENOMEM, "checkpoint: gathering experts: out of memory");
        const float *mine = buf + (m->p[l].moe.experts - m->params);
        MOE_TRY(moe_comm_allgather(par->ep, mine, out[l], local * sizeof(float)));
    }
    return 0;
}

static int write_tensors(const char *path, const moe_model *m, moe_parallel *par, const float *buf,
                         const char *suffix, const char *const *meta) {
    float *gathered[MOE_MAX_LAYERS] = {0};
    entry_list el = {0};
    int sharded = par && par->ep_size > 1, rc = 0;
    if (sharded) MOE_TRY_GOTO(gather_experts(m, par, buf, gathered), rc);
    MOE_TRY_GOTO(build_entries(&el, m, buf, sharded ? gathered : NULL, suffix), rc);
    if (!par || par->rank == 0) rc = moe_st_write(path, el.e, el.n, meta);
fail:
    free_entries(&el);
    for (int l = 0; l < MOE_MAX_LAYERS; l++)
        free(gathered[l]);
    return rc;
}

static int save_files(const char *tmp, const moe_model *m, const moe_adamw *opt,
                      const moe_train_state *st, moe_parallel *par) {
    char p[PATH_MAX];
    const char *meta[] = {"format", "pt", "producer", "moe", NULL};
    int rc = 0;
    join(p, tmp, "/model.safetensors");
    MOE_TRY_GOTO(write_tensors(p, m, par, m->params, "", meta), rc);
    // Both moments in one file, tensor by tensor: shards load them by name.
    join(p, tmp, "/optimizer.safetensors");
    {
        float *gm[MOE_MAX_LAYERS] = {0}, *gv[MOE_MAX_LAYERS] = {0};
        entry_list a = {0}, b = {0};
        int sharded = par && par->ep_size > 1;
        if (sharded) {
            MOE_TRY_GOTO(gather_experts(m, par, opt->m, gm), rc);
            MOE_TRY_GOTO(gather_experts(m, par, opt->v, gv), rc);
        }
        rc = build_entries(&a, m, opt->m, sharded ? gm : NULL, ".exp_avg");
        if (rc == 0) rc = build_entries(&b, m, opt->v, sharded ? gv : NULL, ".exp_avg_sq");
        if (rc == 0 && (!par || par->rank == 0)) {
            moe_st_entry *all = malloc(sizeof *all * (size_t)(a.n + b.n));
            if (!all)
                rc = moe_fail(MOE_ENOMEM, "checkpoint: out of memory");
            else {
                memcpy(all, a.e, sizeof *all * a.n);
                memcpy(all + a.n, b.e, sizeof *all * b.n);
                rc = moe_st_write(p, all, a.n + b.n, NULL);
                free(all);
            }
        }
        free_entries(&a);
        free_entries(&b);
        for (int l = 0; l < MOE_MAX_LAYERS; l++)
            free(gm[l]), free(gv[l]);
        if (rc < 0) goto fail;
    }
    if (par && par->rank != 0) return 0;
    join(p, tmp, "/config.json");
    FILE *f = fopen(p, "w");
    if (!f) return moe_fail(MOE_EIO, "%s: cannot create: %s", p, strerror(errno));
    rc = moe_config_write(&m->cfg, f);
    if (rc == 0 && (fflush(f) || fsync(fileno(f)))) rc = moe_fail(MOE_EIO, "%s: write failed", p);
    if (fclose(f) && rc == 0) rc = moe_fail(MOE_EIO, "%s: write failed", p);
    if (rc < 0) return rc;
    join(p, tmp, "/task_experts.json");
    moe_task_experts te;
    MOE_TRY(moe_task_experts_from_model(&te, m));
    rc = moe_task_experts_write(p, &te);
    moe_task_experts_free(&te);
    if (rc < 0) return rc;
    join(p, tmp, "/trainer_state.json");
    return write_state(p, m, opt, st);
fail:
    return rc;
}

int moe_ckpt_save(const char *dir, const moe_model *m, const moe_adamw *opt,
                  const moe_train_state *st, moe_parallel *par) {
    char tmp[PATH_MAX], old[PATH_MAX], p[PATH_MAX];
    MOE_TRY(join(tmp, dir, ".tmp"));
    MOE_TRY(join(old, dir, ".old"));
    MOE_TRY(join(p, tmp, "/trainer_state.json")); // the longest name fits: all fit
    int rank0 = !par || par->rank == 0, rc = 0;
    if (rank0) {
        remove_dir(tmp);
        if (mkdir(tmp, 0755) && errno != EEXIST)
            rc = moe_fail(MOE_EIO, "%s: cannot create: %s", tmp, strerror(errno));
    }
    // Every rank takes part in the gathers; rank 0 writes; all learn its status.
    if (rc == 0) rc = save_files(tmp, m, opt, st, par);
    if (par) rc = moe_comm_agree(par->world, rc);
    if (!rank0) return rc;
    if (rc < 0) goto fail;
    fsync_path(tmp);
    // The swap: at every moment DIR or DIR.old holds a complete checkpoint.
    remove_dir(old);
    if (exists(dir) && rename(dir, old)) {
        rc = moe_fail(MOE_EIO, "%s: cannot move aside: %s", dir, strerror(errno));
        goto fail;
    }
    if (rename(tmp, dir)) {
        rc = moe_fail(MOE_EIO, "%s: cannot rename to %s: %s", tmp, dir, strerror(errno));
        goto fail;
    }
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", dir);
    char *slash = strrchr(parent, '/');
    if (slash) *slash = 0;
    fsync_path(slash ? parent : ".");
    remove_dir(old);
    return 0;
fail:
    remove_dir(tmp);
    return rc;
}

// DIR, or DIR.old if a crash interrupted the swap.
static const char *resolve(const char *dir, char *buf) {
    if (join(buf, dir, "/model.safetensors") || exists(buf)) return dir;
    if (join(buf, dir, ".old")) return dir;
    return exists(buf) ? buf : dir;
}

int moe_ckpt_config(const char *dir, moe_config *cfg) {
    char buf[PATH_MAX], p[PATH_MAX];
    dir = resolve(dir, buf);
    MOE_TRY(join(p, dir, "/config.json"));
    moe_config_default(cfg);
    MOE_TRY(moe_config_load(cfg, NULL, p));
    int rc = moe_config_check(cfg, NULL); // readers size arrays by it: check before use
    return rc < 0 ? moe_fail(rc, "%s: %s", p, moe_last_error()) : 0;
}

// Reads this model's tensors (each view's name + suffix) into buf. With
// extras_allowed == 0 a tensor the model lacks is an error, except another
// shard's experts on an expert-parallel rank.
static int load_tensors(const char *path, moe_model *m, float *buf, const char *suffix,
                        int extras_allowed) {
    moe_st_file *f;
    MOE_TRY(moe_st_open(path, &f));
    int rc = 0;
    char name[MOE_PARAM_NAME_MAX + 16];
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        snprintf(name, sizeof name, "%s%s", v->name, suffix);
        const moe_st_tensor *t = moe_st_find(f, name);
        if (!t) {
            rc = moe_fail(MOE_EFORMAT, "%s: missing tensor '%s'", path, name);
            goto fail;
        }
        int same = t->dtype == MOE_ST_F32 && t->ndim == v->ndim;
        for (int d = 0; same && d < v->ndim; d++)
            same = t->shape[d] == v->shape[d];
        if (!same) {
            rc = moe_fail(MOE_EFORMAT,
                          "%s: tensor '%s' is %s with %d dims [%lld, %lld], the config expects "
                          "F32 [%lld, %lld]",
                          path, name, moe_st_dtype_name(t->dtype), t->ndim, (long long)t->shape[0],
                          (long long)(t->ndim > 1 ? t->shape[1] : 0), (long long)v->shape[0],
                          (long long)(v->ndim > 1 ? v->shape[1] : 0));
            goto fail;
        }
        MOE_TRY_GOTO(moe_st_read(f, t, buf + v->offset, v->numel * sizeof(float)), rc);
    }
    if (!extras_allowed && f->n_tensors != m->table.count) {
        for (int i = 0; i < f->n_tensors; i++)
            if (!moe_param_table_find(&m->table, f->tensors[i].name) &&
                !(m->ep && is_expert(f->tensors[i].name))) {
                rc = moe_fail(MOE_EFORMAT, "%s: tensor '%s' does not belong to this config", path,
                              f->tensors[i].name);
                goto fail;
            }
    }
fail:
    moe_st_close(f);
    return rc;
}

static int state_int(json_t *o, const char *key, const char *path, json_int_t *out) {
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return moe_fail(MOE_EFORMAT, "%s: '%s' missing or not a non-negative integer", path, key);
    *out = json_integer_value(v);
    return 0;
}

static int load_state(const char *path, moe_model *m, moe_adamw *opt, moe_train_state *st) {
    json_error_t jerr;
    MOE_TRY(moe_check_regular_file(path)); // a FIFO would block json_load_file
    json_t *doc = json_load_file(path, 0, &jerr);
    if (!doc) return moe_fail(MOE_EFORMAT, "%s:%d:%d: %s", path, jerr.line, jerr.column, jerr.text);
    int rc = 0;
    json_int_t step = 0, adam_step = 0, c0, c1;
    json_t *cur = json_object_get(doc, "data_cursor");
    MOE_TRY_GOTO(state_int(doc, "step", path, &step), rc);
    MOE_TRY_GOTO(state_int(doc, "adam_step", path, &adam_step), rc);
    if (!json_is_array(cur) || json_array_size(cur) != 2 ||
        !json_is_integer(json_array_get(cur, 0)) || !json_is_integer(json_array_get(cur, 1))) {
        rc = moe_fail(MOE_EFORMAT, "%s: 'data_cursor' must be two integers", path);
        goto fail;
    }
    c0 = json_integer_value(json_array_get(cur, 0));
    c1 = json_integer_value(json_array_get(cur, 1));
    json_t *caps = json_object_get(doc, "capacity");
    size_t n_dyn = 0;
    for (int l = 0; l < m->L; l++)
        n_dyn += m->cap[l].capacity != NULL;
    if (!json_is_array(caps) || json_array_size(caps) != n_dyn) {
        rc = moe_fail(MOE_EFORMAT, "%s: 'capacity' must list the %zu dynamic-capacity layers", path,
                      n_dyn);
        goto fail;
    }
    size_t i = 0;
    for (int l = 0; l < m->L; l++) {
        moe_capacity_ctl *c = &m->cap[l];
        if (!c->capacity) continue;
        json_t *o = json_array_get(caps, i++), *ema = json_object_get(o, "ema"),
               *cap = json_object_get(o, "capacity"), *steps = json_object_get(o, "steps");
        if (json_integer_value(json_object_get(o, "layer")) != l || !json_is_integer(steps) ||
            json_array_size(ema) != (size_t)c->E || json_array_size(cap) != (size_t)c->E) {
            rc = moe_fail(MOE_EFORMAT, "%s: capacity state of layer %d does not match the model",
                          path, l);
            goto fail;
        }
        c->steps = (long)json_integer_value(steps);
        c->seeded = json_is_true(json_object_get(o, "seeded"));
        for (int e = 0; e < c->E; e++) {
            c->ema[e] = json_number_value(json_array_get(ema, e));
            c->capacity[e] = (int)json_integer_value(json_array_get(cap, e));
        }
    }
    if (st) {
        st->step = (long)step;
        st->cursor[0] = (uint64_t)c0;
        st->cursor[1] = (uint64_t)c1;
    }
    if (opt) opt->step = (long)adam_step;
fail:
    json_decref(doc);
    return rc;
}

int moe_ckpt_load(const char *dir, moe_model *m, moe_adamw *opt, moe_train_state *st) {
    char buf[PATH_MAX], p[PATH_MAX];
    dir = resolve(dir, buf);
    MOE_TRY(join(p, dir, "/model.safetensors"));
    if (!exists(p))
        return moe_fail(MOE_ENOTFOUND, "%s: no checkpoint here (model.safetensors missing)", dir);
    MOE_TRY(load_tensors(p, m, m->params, "", 0));
    if (opt) {
        MOE_TRY(join(p, dir, "/optimizer.safetensors"));
        MOE_TRY(load_tensors(p, m, opt->m, ".exp_avg", 1));
        MOE_TRY(load_tensors(p, m, opt->v, ".exp_avg_sq", 1));
    }
    MOE_TRY(join(p, dir, "/trainer_state.json"));
    return load_state(p, m, opt, st); // dynamic capacity is part of the model's state
}
