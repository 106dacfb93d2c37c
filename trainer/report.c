// A run folder's metrics.jsonl read into named series (moe/report.h) for the
// HTML report and the CSV export. Numbers are taken generically, so a field
// added to the records later (a per-layer statistic) shows up without a change
// here; only malformed lines are refused.
#include "moe/report.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/json_error.h"

#include "trainer/report_out.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>

moe_series *moe_metrics_find(const moe_run_metrics *m, const char *name) {
    for (int i = 0; i < m->n; i++)
        if (!strcmp(m->s[i].name, name)) return &m->s[i];
    return NULL;
}

// The length of s's first max bytes or fewer, cut before a whole UTF-8
// character (a message quoting a long name stays valid UTF-8).
static int utf8_cut(const char *s, int max) {
    int n = (int)strnlen(s, (size_t)max + 1);
    if (n <= max) return n;
    while (max > 0 && ((unsigned char)s[max] & 0xC0) == 0x80)
        max--;
    return max;
}

// A name longer than its buffer (cap bytes with the NUL) is refused, never
// cut: two long keys sharing a prefix would otherwise merge into one series.
static int name_too_long(const char *where, const char *what, const char *name, size_t cap) {
    int k = utf8_cut(name, 48);
    return moe_fail(MOE_EFORMAT, "%s: %s '%.*s%s' is %zu bytes, longer than the %zu a %s takes",
                    where, what, k, name, name[k] ? "..." : "", strlen(name), cap - 1, what);
}

// A series name from fmt ("%s.%s", "layer%d.%s") into out[cap]; one that does
// not fit is refused, quoting the start of the whole name.
__attribute__((format(printf, 4, 5))) static int series_name(char *out, size_t cap,
                                                             const char *where, const char *fmt,
                                                             ...) {
    va_list ap, aq;
    va_start(ap, fmt);
    va_copy(aq, ap);
    int w = vsnprintf(out, cap, fmt, ap);
    va_end(ap);
    int rc = 0;
    if (w < 0 || (size_t)w >= cap) {
        char *full = w < 0 ? NULL : malloc((size_t)w + 1);
        if (full) vsnprintf(full, (size_t)w + 1, fmt, aq);
        rc = full ? name_too_long(where, "field name", full, cap)
                  : moe_fail(MOE_ENOMEM, "%s: out of memory", where);
        free(full);
    }
    va_end(aq);
    return rc;
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
        if (strlen(name) >= sizeof s->name) return name_too_long(where, "field name", name, sizeof s->name);
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

// The widest list a series takes (columns: experts, tasks).
enum { MAX_LIST = 1 << 16 };

static bool all_numbers(json_t *a) {
    if (!json_is_array(a) || json_array_size(a) == 0 || json_array_size(a) > MAX_LIST) return false;
    for (size_t i = 0; i < json_array_size(a); i++)
        if (!json_is_number(json_array_get(a, i))) return false;
    return true;
}

// A list of numbers where null (a non-finite value) may stand for any of them.
static bool numbers_or_nulls(json_t *a) {
    if (!json_is_array(a) || json_array_size(a) == 0 || json_array_size(a) > MAX_LIST) return false;
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_number(x) && !json_is_null(x)) return false;
    }
    return true;
}

static const char *kind_of(json_t *v) {
    if (json_is_string(v)) return "a string";
    if (json_is_boolean(v)) return "a boolean";
    if (json_is_object(v)) return "an object";
    if (json_is_array(v) && json_array_size(v) == 0) return "an empty list";
    if (json_is_array(v) && json_array_size(v) > MAX_LIST)
        return "a list longer than 65536 (the most columns a series takes)";
    return "a list of other than numbers";
}

// A value that cannot be charted: skipped, the first one described.
static void bad_value(moe_run_metrics *m, const char *name, json_t *v, const char *where) {
    if (m->n_bad_values++ == 0)
        snprintf(m->bad_values, sizeof m->bad_values, "%.300s: '%.96s' is %s, not a number", where,
                 name, kind_of(v));
}

// A number, a list of numbers or null under name. Null (the writer's NaN or
// Inf) is a missing value: a row of NAN in a series that exists (an empty CSV
// cell, no point drawn); a series cannot start from one, as its width is
// not known yet.
static int add_value(moe_run_metrics *m, const char *name, json_t *v, double step,
                     const char *where) {
    if (json_is_number(v)) return add_scalar(m, name, step, json_number_value(v), where);
    moe_series *s = NULL;
    if (json_is_null(v)) {
        if (!moe_metrics_find(m, name)) return 0;
        MOE_TRY(series_get(m, name, moe_metrics_find(m, name)->ncol, where, &s));
        double *row = malloc(sizeof(double) * s->ncol);
        if (!row) return moe_fail(MOE_ENOMEM, "%s: out of memory", where);
        for (int i = 0; i < s->ncol; i++)
            row[i] = NAN;
        int rc = series_add(s, step, row, where);
        free(row);
        return rc;
    }
    if (!numbers_or_nulls(v)) {
        bad_value(m, name, v, where);
        return 0;
    }
    int n = (int)json_array_size(v);
    double *row = malloc(sizeof(double) * n);
    if (!row) return moe_fail(MOE_ENOMEM, "%s: out of memory", where);
    for (int i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        row[i] = json_is_number(x) ? json_number_value(x) : NAN;
    }
    int rc = series_get(m, name, n, where, &s);
    if (rc == 0) rc = series_add(s, step, row, where);
    free(row);
    return rc;
}

static int read_train(moe_run_metrics *m, json_t *rec, double step, const char *where) {
    const char *key;
    json_t *v;
    char name[sizeof(((moe_series *)0)->name)];
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
                    MOE_TRY(series_name(name, sizeof name, where, "layer%d.%s",
                                        (int)json_integer_value(jl), k2));
                    MOE_TRY(add_value(m, name, v2, step, where));
                }
            }
        } else if (json_is_object(v)) {
            const char *k2;
            json_t *v2;
            json_object_foreach(v, k2, v2) {
                MOE_TRY(series_name(name, sizeof name, where, "%s.%s", key, k2));
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
                           strcmp(m->task[t], json_string_value(name))))
            return moe_fail(MOE_EFORMAT, "%s: tasks differ from the earlier evaluations", where);
        if (strlen(json_string_value(name)) >= MOE_NAME_MAX)
            return name_too_long(where, "task name", json_string_value(name), MOE_NAME_MAX);
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
    char name[sizeof(((moe_series *)0)->name)];
    json_object_foreach(rec, key, v) {
        if (!strcmp(key, "eval_step") || !strcmp(key, "tasks") || !strcmp(key, "usage")) continue;
        MOE_TRY(series_name(name, sizeof name, where, "eval.%s", key));
        MOE_TRY(add_value(m, name, v, step, where));
    }
    MOE_TRY(read_eval_tasks(m, rec, step, where));
    m->n_eval++;
    return 0;
}

// Keeps the step of a train (k = 0) or eval (k = 1) record; the earlier
// records at or after it (a resumed run logs its steps again) are counted as
// superseded.
static int keep_step(moe_run_metrics *m, int k, double step, const char *where) {
    long dropped = 0;
    while (m->rec_n[k] > 0 && m->rec_step[k][m->rec_n[k] - 1] >= step)
        m->rec_n[k]--, dropped++;
    if (dropped && m->n_superseded == 0)
        snprintf(m->superseded, sizeof m->superseded, "%.400s", where);
    m->n_superseded += dropped;
    if (m->rec_n[k] == m->rec_cap[k]) {
        long cap = m->rec_cap[k] ? 2 * m->rec_cap[k] : 64;
        double *ns = realloc(m->rec_step[k], sizeof(double) * cap);
        if (!ns) return moe_fail(MOE_ENOMEM, "%s: out of memory", where);
        m->rec_step[k] = ns, m->rec_cap[k] = cap;
    }
    m->rec_step[k][m->rec_n[k]++] = step;
    return 0;
}

// One record; "step" makes a train record, "eval_step" an eval record; any
// other object (a kind added later) is passed over, the first one described.
static int read_record(moe_run_metrics *m, json_t *rec, const char *where) {
    if (!json_is_object(rec)) return moe_fail(MOE_EFORMAT, "%s: not a JSON object", where);
    json_t *st = json_object_get(rec, "step"), *ev = json_object_get(rec, "eval_step");
    json_t *which = st ? st : ev;
    if (!which) {
        if (m->n_no_step++ == 0)
            snprintf(m->no_step, sizeof m->no_step,
                     "%.400s: a record with neither 'step' nor 'eval_step'", where);
        return 0;
    }
    if (!json_is_integer(which) || json_integer_value(which) < 0)
        return moe_fail(MOE_EFORMAT, "%s: '%s' is not a non-negative integer", where,
                        st ? "step" : "eval_step");
    // Steps are kept as doubles: above 2^53 two steps could read as one.
    if (json_integer_value(which) > (json_int_t)1 << 53)
        return moe_fail(MOE_EFORMAT,
                        "%s: '%s' is %lld, above 2^53 = 9007199254740992 (the largest "
                        "step the report holds exactly)",
                        where, st ? "step" : "eval_step", (long long)json_integer_value(which));
    double step = (double)json_integer_value(which);
    MOE_TRY(keep_step(m, st ? 0 : 1, step, where));
    return st ? read_train(m, rec, step, where) : read_eval(m, rec, step, where);
}

// The counts and first lines of what was skipped or replaced, as messages.
static void describe_skips(moe_run_metrics *m) {
    char first[512];
    if (m->n_bad_values) {
        snprintf(first, sizeof first, "%s", m->bad_values);
        snprintf(m->bad_values, sizeof m->bad_values, "%.400s: skipped (%ld such value%s in all)",
                 first, m->n_bad_values, m->n_bad_values > 1 ? "s" : "");
    }
    if (m->n_no_step) {
        snprintf(first, sizeof first, "%s", m->no_step);
        snprintf(m->no_step, sizeof m->no_step, "%.400s: skipped (%ld such record%s in all)", first,
                 m->n_no_step, m->n_no_step > 1 ? "s" : "");
    }
    if (m->n_superseded) {
        snprintf(first, sizeof first, "%s", m->superseded);
        snprintf(m->superseded, sizeof m->superseded,
                 "%ld earlier record%s replaced by steps logged again (a resumed run), first at "
                 "%.400s",
                 m->n_superseded, m->n_superseded > 1 ? "s" : "", first);
    }
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
    if (!doc) return moe_json_fail(MOE_EFORMAT, path, &jerr);
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
            rc = moe_fail(MOE_EFORMAT, "%s:%d: not JSON: %s", where, moe_json_column(&jerr),
                          jerr.text);
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
    if (rc == 0) describe_skips(m);
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
    free(m->rec_step[0]);
    free(m->rec_step[1]);
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

// The shortest of %.15g, %.16g, %.17g that reads back as v: every number
// round-trips (a Unix time keeps its milliseconds), and 0.1 stays "0.1".
static void csv_num(FILE *f, double v) {
    if (!isfinite(v)) {
        fputc(',', f); // null: an empty cell
        return;
    }
    char s[40];
    for (int p = 15; p <= 17; p++) {
        snprintf(s, sizeof s, "%.*g", p, v);
        if (strtod(s, NULL) == v) break;
    }
    fprintf(f, ",%s", s);
}

// File names of the CSVs, one per series and per usage layer: the name with
// every character other than [A-Za-z0-9_-] as '_' ("layer0.load" ->
// "layer0_load"); a name already taken gets _2, _3, ... so no file is
// written twice ("a/b" and "a_b", or a top-level "layer0_load" beside the
// series "layer0.load"). The usage tables come first: their names are fixed.
typedef char csv_name[sizeof(((moe_series *)0)->name) + 16];

static bool name_taken(const csv_name *names, int n, const char *s) {
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], s)) return true;
    return false;
}

// names[n] = base made safe, with a suffix when taken; true when suffixed.
static bool unique_name(csv_name *names, int n, const char *base) {
    char b[sizeof(csv_name) - 16];
    snprintf(b, sizeof b, "%s", *base ? base : "_");
    for (char *c = b; *c; c++)
        if (!(isalnum((unsigned char)*c) || *c == '_' || *c == '-')) *c = '_';
    snprintf(names[n], sizeof names[n], "%s", b);
    int k = 1;
    while (name_taken(names, n, names[n]))
        snprintf(names[n], sizeof names[n], "%s_%d", b, ++k);
    return k > 1;
}

// "'a/b' -> a_b_2.csv, ..." into note (cut with "..." when full).
static void note_rename(char *note, size_t cap, const char *series, const char *file) {
    if (!note || cap < 8) return;
    size_t used = strlen(note);
    if (used + 4 >= cap) return;
    int w = snprintf(note + used, cap - used, "%s'%s' -> %s.csv", used ? ", " : "", series, file);
    if (w < 0 || (size_t)w >= cap - used) memcpy(note + cap - 4, "...", 4);
}

static int csv_usage(const moe_run_metrics *m, const moe_usage *u, const char *path) {
    report_out o;
    MOE_TRY(report_out_open(&o, path));
    FILE *f = o.f;
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
    return report_out_commit(&o, path, REPORT_OUT_CSV, NULL);
}

static int csv_series(const moe_series *s, const char *path) {
    report_out o;
    MOE_TRY(report_out_open(&o, path));
    FILE *f = o.f;
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
    return report_out_commit(&o, path, REPORT_OUT_CSV, NULL);
}

// The file name of every CSV, usage tables first, then the series; names
// renamed to stay unique are listed in note. NULL when out of memory.
static csv_name *csv_names(const moe_run_metrics *m, const char *dir, char *note, size_t note_cap) {
    const int n = m->n_usage + m->n;
    csv_name *names = calloc((size_t)n + 1, sizeof *names);
    if (!names) {
        moe_fail(MOE_ENOMEM, "%s: out of memory", dir);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (i < m->n_usage) {
            char base[32];
            snprintf(base, sizeof base, "layer%d_task_experts", m->usage[i].layer);
            unique_name(names, i, base);
        } else {
            const moe_series *s = &m->s[i - m->n_usage];
            // a suffix hides which series the file holds: the note says
            if (unique_name(names, i, s->name)) note_rename(note, note_cap, s->name, names[i]);
        }
    }
    return names;
}

int moe_report_csv_check(const moe_run_metrics *m, const char *dir) {
    struct stat sb;
    if (stat(dir, &sb) != 0) return 0; // created by the write: nothing in it to lose
    if (!S_ISDIR(sb.st_mode)) return moe_fail(MOE_EINVAL, "%s: exists and is not a folder", dir);
    csv_name *names = csv_names(m, dir, NULL, 0);
    if (!names) return MOE_ENOMEM;
    char path[PATH_MAX + sizeof(csv_name)];
    int rc = 0;
    for (int i = 0; i < m->n_usage + m->n && rc == 0; i++) {
        snprintf(path, sizeof path, "%s/%s.csv", dir, names[i]);
        rc = report_out_check(path, REPORT_OUT_CSV, NULL);
    }
    free(names);
    return rc;
}

// path with its folder resolved (symlinks, "..", "."): "a/./b/x" and "a/b/x"
// name one file. The last part stays as given; so does a path whose folder
// does not resolve (the write then fails on its own).
static void resolved(const char *path, char *out, size_t cap) {
    char dir[PATH_MAX], real[PATH_MAX];
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else
        snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    if (realpath(dir, real))
        snprintf(out, cap, "%s/%s", real, base);
    else
        snprintf(out, cap, "%s", path);
}

int moe_report_csv_collision(const moe_run_metrics *m, const char *dir, const char *page,
                             char *series, size_t cap) {
    csv_name *names = csv_names(m, dir, NULL, 0);
    if (!names) return MOE_ENOMEM;
    char want[PATH_MAX + 8], path[PATH_MAX + sizeof(csv_name)], got[PATH_MAX + 8];
    resolved(page, want, sizeof want);
    struct stat a, b;
    const bool page_exists = stat(page, &a) == 0;
    int hit = 0;
    for (int i = 0; i < m->n_usage + m->n && !hit; i++) {
        snprintf(path, sizeof path, "%s/%s.csv", dir, names[i]);
        resolved(path, got, sizeof got);
        hit = !strcmp(want, got) ||
              (page_exists && stat(path, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino);
        if (hit && series) snprintf(series, cap, "%s", names[i]);
    }
    free(names);
    return hit;
}

int moe_report_csv(const moe_run_metrics *m, const char *dir, int *n_files, char *note,
                   size_t note_cap) {
    *n_files = 0;
    if (note && note_cap) note[0] = 0;
    MOE_TRY(moe_report_csv_check(m, dir)); // every target first: none written, or all
    MOE_TRY(make_dir(dir));
    csv_name *names = csv_names(m, dir, note, note_cap);
    if (!names) return MOE_ENOMEM;
    char path[PATH_MAX + sizeof(csv_name)];
    int rc = 0;
    for (int i = 0; i < m->n_usage + m->n && rc == 0; i++) {
        snprintf(path, sizeof path, "%s/%s.csv", dir, names[i]);
        rc = i < m->n_usage ? csv_usage(m, &m->usage[i], path)
                            : csv_series(&m->s[i - m->n_usage], path);
        if (rc == 0) ++*n_files;
    }
    free(names);
    return rc;
}
