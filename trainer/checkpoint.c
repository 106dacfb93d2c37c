// Checkpoint folders: write everything into DIR.tmp (each file fsynced),
// rename DIR to DIR.old, DIR.tmp to DIR, fsync the parent, remove DIR.old.
// Loading validates every tensor against the model's table.
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/safetensors.h"

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
                                    "trainer_state.json"};
#define N_FILES 4

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

int moe_ckpt_save(const char *dir, const moe_model *m, const moe_adamw *opt,
                  const moe_train_state *st) {
    char tmp[PATH_MAX], old[PATH_MAX], p[PATH_MAX];
    MOE_TRY(join(tmp, dir, ".tmp"));
    MOE_TRY(join(old, dir, ".old"));
    MOE_TRY(join(p, tmp, "/trainer_state.json")); // the longest name fits: all fit
    remove_dir(tmp);
    if (mkdir(tmp, 0755) && errno != EEXIST)
        return moe_fail(MOE_EIO, "%s: cannot create: %s", tmp, strerror(errno));
    int rc = 0;
    moe_st_entry *e = calloc((size_t)m->table.count, sizeof *e);
    if (!e) return moe_fail(MOE_ENOMEM, "checkpoint: out of memory");
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        e[i].name = v->name;
        e[i].dtype = MOE_ST_F32;
        e[i].ndim = v->ndim;
        memcpy(e[i].shape, v->shape, sizeof(int64_t) * v->ndim);
        e[i].data = m->params + v->offset;
    }
    const char *meta[] = {"format", "pt", "producer", "moe", NULL};
    join(p, tmp, "/model.safetensors");
    MOE_TRY_GOTO(moe_st_write(p, e, m->table.count, meta), rc);
    moe_st_entry oe[2] = {{"exp_avg", MOE_ST_F32, 1, {(int64_t)opt->n}, opt->m},
                          {"exp_avg_sq", MOE_ST_F32, 1, {(int64_t)opt->n}, opt->v}};
    join(p, tmp, "/optimizer.safetensors");
    MOE_TRY_GOTO(moe_st_write(p, oe, 2, NULL), rc);
    join(p, tmp, "/config.json");
    FILE *f = fopen(p, "w");
    if (!f) {
        rc = moe_fail(MOE_EIO, "%s: cannot create: %s", p, strerror(errno));
        goto fail;
    }
    rc = moe_config_write(&m->cfg, f);
    if (rc == 0 && (fflush(f) || fsync(fileno(f)))) rc = moe_fail(MOE_EIO, "%s: write failed", p);
    if (fclose(f) && rc == 0) rc = moe_fail(MOE_EIO, "%s: write failed", p);
    if (rc < 0) goto fail;
    join(p, tmp, "/trainer_state.json");
    MOE_TRY_GOTO(write_state(p, m, opt, st), rc);
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
    free(e);
    return 0;
fail:
    free(e);
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
    return moe_config_load(cfg, NULL, p);
}

static int load_params(const char *path, moe_model *m) {
    moe_st_file *f;
    MOE_TRY(moe_st_open(path, &f));
    int rc = 0;
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        const moe_st_tensor *t = moe_st_find(f, v->name);
        if (!t) {
            rc = moe_fail(MOE_EFORMAT, "%s: missing tensor '%s'", path, v->name);
            goto fail;
        }
        int same = t->dtype == MOE_ST_F32 && t->ndim == v->ndim;
        for (int d = 0; same && d < v->ndim; d++)
            same = t->shape[d] == v->shape[d];
        if (!same) {
            rc = moe_fail(MOE_EFORMAT,
                          "%s: tensor '%s' is %s with %d dims [%lld, %lld], the config expects "
                          "F32 [%lld, %lld]",
                          path, v->name, moe_st_dtype_name(t->dtype), t->ndim,
                          (long long)t->shape[0], (long long)(t->ndim > 1 ? t->shape[1] : 0),
                          (long long)v->shape[0], (long long)(v->ndim > 1 ? v->shape[1] : 0));
            goto fail;
        }
        MOE_TRY_GOTO(moe_st_read(f, t, m->params + v->offset, v->numel * sizeof(float)), rc);
    }
    if (f->n_tensors != m->table.count) {
        for (int i = 0; i < f->n_tensors; i++)
            if (!moe_param_table_find(&m->table, f->tensors[i].name)) {
                rc = moe_fail(MOE_EFORMAT, "%s: tensor '%s' does not belong to this config", path,
                              f->tensors[i].name);
                goto fail;
            }
    }
fail:
    moe_st_close(f);
    return rc;
}

static int load_optimizer(const char *path, moe_adamw *opt) {
    moe_st_file *f;
    MOE_TRY(moe_st_open(path, &f));
    int rc = 0;
    const char *names[2] = {"exp_avg", "exp_avg_sq"};
    float *dst[2] = {opt->m, opt->v};
    for (int i = 0; i < 2; i++) {
        const moe_st_tensor *t = moe_st_find(f, names[i]);
        if (!t || t->dtype != MOE_ST_F32 || t->ndim != 1 || (size_t)t->shape[0] != opt->n) {
            rc = moe_fail(MOE_EFORMAT, "%s: tensor '%s' missing or not F32 [%zu]", path, names[i],
                          opt->n);
            goto fail;
        }
        MOE_TRY_GOTO(moe_st_read(f, t, dst[i], opt->n * sizeof(float)), rc);
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
        return moe_fail(MOE_ENOTFOUND,
                        "%s: no checkpoint here (model.safetensors "
                        "missing)",
                        dir);
    MOE_TRY(load_params(p, m));
    if (opt) {
        MOE_TRY(join(p, dir, "/optimizer.safetensors"));
        MOE_TRY(load_optimizer(p, opt));
    }
    MOE_TRY(join(p, dir, "/trainer_state.json"));
    return load_state(p, m, opt, st); // dynamic capacity is part of the model's state
}
