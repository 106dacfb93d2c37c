// A run folder's metrics.jsonl read into named series (moe/report.h) for the
// HTML report and the CSV export. Numbers are taken generically, so a field
// added to the records later (a per-layer statistic) shows up without a change
// here; only malformed lines are refused.
#include "moe/report.h"
#include "moe/error.h"
#include "moe/file.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

moe_series *moe_metrics_find(const moe_run_metrics *m, const char *name) {
    for (int i = 0; i < m->n; i++)
        if (!strcmp(m->s[i].name, name)) return &m->s[i];
    return NULL;
}

// The series called name with ncol columns, created on first use. Records
// repeat their key order, so the hint makes the lookup O(1) on long runs.
static int series_get(moe_run_metrics *m, const char *name, int ncol, const char *where,
                      moe_series **out) {
    moe_series *s = NULL;
    if (m->hint < m->n && !strcmp(m->s[m->hint].name, name))
        s = &m->s[m->hint];
    else
        s = moe_metrics_find(m, name);
    if (!s) {
        if (strlen(name) >= sizeof s->name)
            return moe_fail(MOE_EFORMAT, "%s: field name '%.64s...' too long", where, name);
        if (m->n == m->cap) {
            int cap = m->cap ? 2 * m->cap : 32;
            moe_series *ns = realloc(m->s, sizeof *ns * cap);
            if (!ns) return moe_fail(MOE_ENOMEM, "%s: out of memory", where);
            m->s = ns, m->cap = cap;
        }
        s = &m->s[m->n++];
        memset(s, 0, sizeof *s);
        snprintf(s->name, sizeof s->name, "%s", name);
        s->ncol = ncol;
        if (!(s->col = calloc(ncol, sizeof *s->col)))
            return moe_fail(MOE_ENOMEM, "%s: out of memory", where);
        for (int c = 0; c < ncol; c++)
            snprintf(s->col[c], MOE_NAME_MAX, "e%d", c);
    } else if (s->ncol != ncol) {
        return moe_fail(MOE_EFORMAT, "%s: '%s' has %d values, earlier lines %d", where, name, ncol,
                        s->ncol);
    }
    m->hint = (int)(s - m->s) + 1;
    *out = s;
    return 0;
}

// Appends a row at step; a step at or before the last row (a resumed run logs
// its steps again) first drops the rows it supersedes.
static int series_add(moe_series *s, double step, const double *v, const char *where) {
    while (s->n > 0 && s->step[s->n - 1] >= step)
        s->n--;
    if (s->n == s->cap) {
        long cap = s->cap ? 2 * s->cap : 64;
        double *ns = realloc(s->step, sizeof(double) * cap);
        if (ns) s->step = ns;
        double *nv = ns ? realloc(s->v, sizeof(double) * cap * s->ncol) : NULL;
        if (!nv) return moe_fail(MOE_ENOMEM, "%s: out of memory", where);
        s->v = nv, s->cap = cap;
    }
    s->step[s->n] = step;
    memcpy(s->v + s->n * s->ncol, v, sizeof(double) * s->ncol);
    s->n++;
    return 0;
}

static int add_scalar(moe_run_metrics *m, const char *name, double step, double v,
                      const char *where) {
    moe_series *s = NULL;
    MOE_TRY(series_get(m, name, 1, where, &s));
    return series_add(s, step, &v, where);
}

static bool all_numbers(json_t *a) {
    if (!json_is_array(a) || json_array_size(a) == 0 || json_array_size(a) > 1 << 16) return false;
    for (size_t i = 0; i < json_array_size(a); i++)
        if (!json_is_number(json_array_get(a, i))) return false;
    return true;
}

// A number or an array of numbers under name; anything else is not a series.
static int add_value(moe_run_metrics *m, const char *name, json_t *v, double step,
                     const char *where) {
    if (json_is_number(v)) return add_scalar(m, name, step, json_number_value(v), where);
    if (!all_numbers(v)) return 0;
    int n = (int)json_array_size(v);
    double *row = malloc(sizeof(double) * n);
    if (!row) return moe_fail(MOE_ENOMEM, "%s: out of memory", where);
    for (int i = 0; i < n; i++)
        row[i] = json_number_value(json_array_get(v, i));
    moe_series *s = NULL;
    int rc = series_get(m, name, n, where, &s);
    if (rc == 0) rc = series_add(s, step, row, where);
    free(row);
    return rc;
}

static int read_train(moe_run_metrics *m, json_t *rec, double step, const char *where) {
    const char *key;
    json_t *v;
    char name[256];
    json_object_foreach(rec, key, v) {
        if (!strcmp(key, "step")) continue;
        if (!strcmp(key, "layers")) {
            if (!json_is_array(v))
                return moe_fail(MOE_EFORMAT, "%s: 'layers' is not a list", where);
            for (size_t i = 0; i < json_array_size(v); i++) {
                json_t *o = json_array_get(v, i), *jl = json_object_get(o, "layer");
                if (!json_is_integer(jl) || json_integer_value(jl) < 0 ||
                    json_integer_value(jl) >= MOE_MAX_LAYERS)
                    return moe_fail(MOE_EFORMAT, "%s: layers[%zu] has no 'layer' in 0..%d", where,
                                    i, MOE_MAX_LAYERS - 1);
                const char *k2;
                json_t *v2;
                json_object_foreach(o, k2, v2) {
                    if (!strcmp(k2, "layer")) continue;
                    snprintf(name, sizeof name, "layer%d.%s", (int)json_integer_value(jl), k2);
                    MOE_TRY(add_value(m, name, v2, step, where));
                }
            }
        } else if (json_is_object(v)) {
            const char *k2;
            json_t *v2;
            json_object_foreach(v, k2, v2) {
                snprintf(name, sizeof name, "%s.%s", key, k2);
                MOE_TRY(add_value(m, name, v2, step, where));
            }
        } else {
            MOE_TRY(add_value(m, key, v, step, where));
        }
    }
    m->n_train++;
    return 0;
}

// Per-task loss and accuracy (columns named by the tasks) and the task x
// expert usage of the latest evaluation.
static int read_eval_tasks(moe_run_metrics *m, json_t *rec, double step, const char *where) {
    json_t *tasks = json_object_get(rec, "tasks"), *usage = json_object_get(rec, "usage");
    if (!tasks) return 0; // records written before per-task figures
    size_t nt = json_array_size(tasks);
    if (!json_is_array(tasks) || nt == 0 || nt > MOE_MAX_TASKS)
        return moe_fail(MOE_EFORMAT, "%s: 'tasks' must be a list of 1..%d tasks", where,
                        MOE_MAX_TASKS);
    double loss[MOE_MAX_TASKS], acc[MOE_MAX_TASKS];
    for (size_t t = 0; t < nt; t++) {
        json_t *o = json_array_get(tasks, t), *name = json_object_get(o, "name");
        json_t *l = json_object_get(o, "loss"), *a = json_object_get(o, "accuracy");
        if (!json_is_string(name) || (!json_is_number(l) && !json_is_null(l)) ||
            (!json_is_number(a) && !json_is_null(a)))
            return moe_fail(MOE_EFORMAT,
                            "%s: tasks[%zu] needs 'name' and numeric (or null) 'loss', 'accuracy'",
                            where, t);
        if (m->n_tasks && (m->n_tasks != (int)nt ||
                           strncmp(m->task[t], json_string_value(name), MOE_NAME_MAX - 1)))
            return moe_fail(MOE_EFORMAT, "%s: tasks differ from the earlier evaluations", where);
        loss[t] = json_is_number(l) ? json_number_value(l) : NAN;
        acc[t] = json_is_number(a) ? json_number_value(a) : NAN;
    }
    if (!m->n_tasks) {
        m->n_tasks = (int)nt;
        for (size_t t = 0; t < nt; t++)
            snprintf(m->task[t], MOE_NAME_MAX, "%s",
                     json_string_value(json_object_get(json_array_get(tasks, t), "name")));
    }
    const char *names[2] = {"eval.task_loss", "eval.accuracy"};
    const double *rows[2] = {loss, acc};
    for (int k = 0; k < 2; k++) {
        moe_series *s;
        MOE_TRY(series_get(m, names[k], (int)nt, where, &s));
        for (size_t t = 0; t < nt; t++)
            snprintf(s->col[t], MOE_NAME_MAX, "%s", m->task[t]);
        MOE_TRY(series_add(s, step, rows[k], where));
    }
    if (!usage) return 0;
    if (!json_is_array(usage) || json_array_size(usage) > MOE_MAX_LAYERS)
        return moe_fail(MOE_EFORMAT, "%s: 'usage' is not a list of layers", where);
    for (int i = 0; i < m->n_usage; i++)
        free(m->usage[i].counts);
    m->n_usage = 0;
    m->usage_step = (long)step;
    for (size_t i = 0; i < json_array_size(usage); i++) {
        json_t *o = json_array_get(usage, i), *jl = json_object_get(o, "layer"),
               *c = json_object_get(o, "counts");
        if (!json_is_integer(jl) || !json_is_array(c) || json_array_size(c) != nt ||
            !all_numbers(json_array_get(c, 0)))
            return moe_fail(MOE_EFORMAT, "%s: usage[%zu] needs 'layer' and 'counts' [%zu tasks][E]",
                            where, i, nt);
        moe_usage *u = &m->usage[m->n_usage];
        u->layer = (int)json_integer_value(jl);
        u->E = (int)json_array_size(json_array_get(c, 0));
        if (!(u->counts = malloc(sizeof(double) * nt * u->E)))
            return moe_fail(MOE_ENOMEM, "%s: out of memory", where);
        m->n_usage++;
        for (size_t t = 0; t < nt; t++) {
            json_t *row = json_array_get(c, t);
            if (!all_numbers(row) || json_array_size(row) != (size_t)u->E)
                return moe_fail(MOE_EFORMAT, "%s: usage[%zu] row %zu needs %d numbers", where, i, t,
                                u->E);
            for (int e = 0; e < u->E; e++)
                u->counts[t * u->E + e] = json_number_value(json_array_get(row, e));
        }
    }
    return 0;
}

static int read_eval(moe_run_metrics *m, json_t *rec, double step, const char *where) {
    const char *key;
    json_t *v;
    char name[256];
    json_object_foreach(rec, key, v) {
        if (!strcmp(key, "eval_step") || !strcmp(key, "tasks") || !strcmp(key, "usage")) continue;
        snprintf(name, sizeof name, "eval.%s", key);
        MOE_TRY(add_value(m, name, v, step, where));
    }
    MOE_TRY(read_eval_tasks(m, rec, step, where));
    m->n_eval++;
    return 0;
}

// One record; "step" makes a train record, "eval_step" an eval record, and
// any other object (a kind added later) is passed over.
static int read_record(moe_run_metrics *m, json_t *rec, const char *where) {
    if (!json_is_object(rec)) return moe_fail(MOE_EFORMAT, "%s: not a JSON object", where);
    json_t *st = json_object_get(rec, "step"), *ev = json_object_get(rec, "eval_step");
    json_t *which = st ? st : ev;
    if (!which) return 0;
    if (!json_is_integer(which) || json_integer_value(which) < 0)
        return moe_fail(MOE_EFORMAT, "%s: '%s' is not a non-negative integer", where,
                        st ? "step" : "eval_step");
    double step = (double)json_integer_value(which);
    return st ? read_train(m, rec, step, where) : read_eval(m, rec, step, where);
}

static int add_cfg(moe_run_metrics *m, const char *key, const char *val) {
    char **k = realloc(m->cfg_key, sizeof(char *) * (m->n_cfg + 1));
    if (k) m->cfg_key = k;
    char **v = k ? realloc(m->cfg_val, sizeof(char *) * (m->n_cfg + 1)) : NULL;
    if (v) m->cfg_val = v;
    char *ks = strdup(key), *vs = strdup(val);
    if (!v || !ks || !vs) {
        free(ks);
        free(vs);
        return moe_fail(MOE_ENOMEM, "config.json: out of memory");
    }
    m->cfg_key[m->n_cfg] = ks;
    m->cfg_val[m->n_cfg++] = vs;
    return 0;
}

// config.json flattened: nested objects join their keys with '.', other
// values are kept as compact JSON (strings without their quotes).
static int flatten_cfg(moe_run_metrics *m, json_t *o, const char *prefix) {
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        char name[512];
        snprintf(name, sizeof name, "%s%s%s", prefix, *prefix ? "." : "", key);
        if (json_is_object(v)) {
            MOE_TRY(flatten_cfg(m, v, name));
            continue;
        }
        if (json_is_string(v)) {
            MOE_TRY(add_cfg(m, name, json_string_value(v)));
            continue;
        }
        char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT | JSON_REAL_PRECISION(10));
        if (!s) return moe_fail(MOE_ENOMEM, "config.json: out of memory");
        int rc = add_cfg(m, name, s);
        free(s);
        MOE_TRY(rc);
    }
    return 0;
}

static int read_config(moe_run_metrics *m, const char *run_dir) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/config.json", run_dir);
    struct stat sb;
    if (stat(path, &sb) != 0) return 0; // the table says the config is missing
    FILE *f;
    MOE_TRY(moe_fopen_regular(path, &f));
    json_error_t jerr;
    json_t *doc = json_loadf(f, 0, &jerr);
    fclose(f);
    if (!doc) return moe_fail(MOE_EFORMAT, "%s:%d:%d: %s", path, jerr.line, jerr.column, jerr.text);
    int rc = json_is_object(doc) ? flatten_cfg(m, doc, "")
                                 : moe_fail(MOE_EFORMAT, "%s: not a JSON object", path);
    json_decref(doc);
    return rc;
}

int moe_metrics_read(const char *run_dir, moe_run_metrics *m) {
    memset(m, 0, sizeof *m);
    struct stat sb;
    if (stat(run_dir, &sb) != 0) return moe_fail(MOE_ENOTFOUND, "%s: no such run folder", run_dir);
    if (!S_ISDIR(sb.st_mode)) return moe_fail(MOE_EINVAL, "%s: not a folder", run_dir);
    char path[PATH_MAX], where[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run_dir);
    FILE *f;
    MOE_TRY(moe_fopen_regular(path, &f));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    long lineno = 0;
    int rc = 0;
    while ((len = getline(&line, &cap, f)) > 0) {
        lineno++;
        const bool complete = line[len - 1] == '\n';
        size_t n = (size_t)len - complete;
        while (n > 0 && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t'))
            n--;
        if (n == 0) continue;
        snprintf(where, sizeof where, "%s:%ld", path, lineno);
        json_error_t jerr;
        json_t *rec = json_loadb(line, n, 0, &jerr);
        if (!rec && !complete) { // the writer died in the middle of this line
            snprintf(m->warning, sizeof m->warning,
                     "%.400s: last line cut short (the run stopped while writing it), skipped",
                     where);
            break;
        }
        if (!rec) {
            rc = moe_fail(MOE_EFORMAT, "%s:%d: not JSON: %s", where, jerr.column, jerr.text);
            break;
        }
        rc = read_record(m, rec, where);
        json_decref(rec);
        if (rc < 0) break;
    }
    if (rc == 0 && ferror(f)) rc = moe_fail(MOE_EIO, "%s: read failed: %s", path, strerror(errno));
    free(line);
    fclose(f);
    if (rc == 0 && m->n_train == 0)
        rc = moe_fail(MOE_EFORMAT, "%s: no training steps recorded", path);
    if (rc == 0) rc = read_config(m, run_dir);
    if (rc < 0) moe_metrics_free(m);
    return rc;
}

void moe_metrics_free(moe_run_metrics *m) {
    for (int i = 0; i < m->n; i++) {
        free(m->s[i].col);
        free(m->s[i].step);
        free(m->s[i].v);
    }
    free(m->s);
    for (int i = 0; i < m->n_usage; i++)
        free(m->usage[i].counts);
    for (int i = 0; i < m->n_cfg; i++) {
        free(m->cfg_key[i]);
        free(m->cfg_val[i]);
    }
    free(m->cfg_key);
    free(m->cfg_val);
    memset(m, 0, sizeof *m);
}

// ---- CSV -----------------------------------------------------------------------------

// mkdir of one level (the parent must exist): the CSV folder.
static int make_dir(const char *dir) {
    struct stat sb;
    if (mkdir(dir, 0755) == 0) return 0;
    if (errno == EEXIST && stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode)) return 0;
    if (errno == EEXIST) return moe_fail(MOE_EINVAL, "%s: exists and is not a folder", dir);
    return moe_fail(MOE_EIO, "%s: cannot create: %s", dir, strerror(errno));
}

// A CSV cell: quoted when it holds a comma, quote or line break.
static void csv_cell(FILE *f, const char *s) {
    if (!strpbrk(s, ",\"\r\n")) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

static void csv_num(FILE *f, double v) {
    if (isfinite(v))
        fprintf(f, ",%.9g", v);
    else
        fputc(',', f); // null: an empty cell
}

static int csv_close(FILE *f, const char *path) {
    bool bad = ferror(f) != 0;
    if (fclose(f) != 0 || bad)
        return moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno));
    return 0;
}

int moe_report_csv(const moe_run_metrics *m, const char *dir, int *n_files) {
    *n_files = 0;
    MOE_TRY(make_dir(dir));
    char path[PATH_MAX];
    for (int i = 0; i < m->n; i++) {
        const moe_series *s = &m->s[i];
        char file[sizeof s->name];
        snprintf(file, sizeof file, "%s", s->name);
        for (char *c = file; *c; c++)
            if (*c == '.' || *c == '/') *c = '_';
        snprintf(path, sizeof path, "%s/%s.csv", dir, file);
        FILE *f = fopen(path, "w");
        if (!f) return moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
        fputs("step", f);
        for (int c = 0; c < s->ncol; c++) {
            fputc(',', f);
            csv_cell(f, s->ncol == 1 ? s->name : s->col[c]);
        }
        fputc('\n', f);
        for (long r = 0; r < s->n; r++) {
            fprintf(f, "%.0f", s->step[r]);
            for (int c = 0; c < s->ncol; c++)
                csv_num(f, s->v[r * s->ncol + c]);
            fputc('\n', f);
        }
        MOE_TRY(csv_close(f, path));
        ++*n_files;
    }
    for (int i = 0; i < m->n_usage; i++) {
        const moe_usage *u = &m->usage[i];
        snprintf(path, sizeof path, "%s/layer%d_task_experts.csv", dir, u->layer);
        FILE *f = fopen(path, "w");
        if (!f) return moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
        fputs("task", f);
        for (int e = 0; e < u->E; e++)
            fprintf(f, ",e%d", e);
        fputc('\n', f);
        for (int t = 0; t < m->n_tasks; t++) {
            csv_cell(f, m->task[t]);
            for (int e = 0; e < u->E; e++)
                csv_num(f, u->counts[t * u->E + e]);
            fputc('\n', f);
        }
        MOE_TRY(csv_close(f, path));
        ++*n_files;
    }
    return 0;
}
