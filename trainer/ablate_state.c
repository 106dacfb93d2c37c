// out/ablate.json: the grid of an ablation and the figures of each run it
// finished, rewritten after every run, so that `moe ablate --resume` keeps
// what a stopped (or killed) grid trained and refuses to mix two grids.
#include "ablate_internal.h"
#include "moe/config.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/json_error.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// JSON has no NaN nor Inf: a loss that is not finite is stored as its name.
static json_t *loss_json(double v) {
    if (isfinite(v)) return json_real(v);
    return json_string(isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
}

// The resolved config as JSON (moe_config_write's sections and keys).
static json_t *config_json(const moe_config *cfg) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return NULL;
    int rc = moe_config_write(cfg, f);
    fclose(f);
    json_t *j = rc == 0 ? json_loadb(buf, len, 0, NULL) : NULL;
    free(buf);
    return j;
}

static json_t *row_json(const moe_ablate_row *r) {
    json_t *tasks = json_array();
    for (int t = 0; tasks && t < r->n_tasks; t++)
        json_array_append_new(
            tasks, json_pack("{s:s, s:f}", "name", r->task[t], "accuracy", r->accuracy[t]));
    const char *status = r->ok ? "ok" : r->stopped ? "stopped" : "failed";
    return json_pack("{s:s, s:i, s:s, s:o, s:f, s:f, s:f, s:f, s:I, s:I, s:I, s:o}", "status",
                     status, "rc", r->rc, "error", r->error, "val_loss", loss_json(r->val_loss),
                     "tokens_per_s", r->tokens_per_s, "drop_rate", r->drop_rate, "max_vio",
                     r->max_vio, "seconds", r->seconds, "steps", (json_int_t)r->steps,
                     "total_steps", (json_int_t)r->total_steps, "steps_run",
                     (json_int_t)r->steps_run, "tasks", tasks);
}

// A config file's JSON as moe_config_load reads it (a regular file, past a
// leading byte order mark); NULL when it cannot be read or parsed.
static json_t *config_file_json(const char *path) {
    const void *data;
    size_t len;
    if (moe_map_regular(path, &data, &len) < 0) return NULL;
    const size_t bom = data ? moe_config_bom_len(data, len) : 0;
    json_t *j =
        data ? json_loadb((const char *)data + bom, len - bom, JSON_REJECT_DUPLICATES, NULL) : NULL;
    moe_unmap(data, len);
    return j;
}

// The contents of the config files a `config` axis names, by name: a file
// edited between a stop and --resume would put two grids in one table. (A
// file that no longer parses: null; the grid's check refuses it first.)
static json_t *config_files_json(const moe_grid_axis *axes, int n_axes) {
    json_t *files = json_object();
    for (int a = 0; files && a < n_axes; a++)
        for (int v = 0; !strcmp(axes[a].key, MOE_GRID_CONFIG) && v < axes[a].n; v++) {
            json_t *j = config_file_json(axes[a].values[v]);
            json_object_set_new(files, axes[a].values[v], j ? j : json_null());
        }
    return files;
}

int moe_ablate_state_write(const char *out, const moe_config *base, const moe_grid_axis *axes,
                           int n_axes, const moe_ablate_row *rows, const bool *done, int n) {
    json_t *grid = json_array(), *runs = json_array(), *cfg = config_json(base),
           *files = config_files_json(axes, n_axes);
    json_t *doc = cfg && files ? json_pack("{s:i, s:o, s:o, s:o, s:o}", "version", 1, "base", cfg,
                                           "grid", grid, "config_files", files, "runs", runs)
                               : NULL;
    bool ok = doc != NULL;
    for (int a = 0; ok && a < n_axes; a++) {
        json_t *vals = json_array();
        for (int v = 0; vals && v < axes[a].n; v++)
            json_array_append_new(vals, json_string(axes[a].values[v]));
        ok = json_array_append_new(
                 grid, json_pack("{s:s, s:o}", "key", axes[a].key, "values", vals)) == 0;
    }
    for (int i = 0; ok && i < n; i++)
        ok = json_array_append_new(runs, done[i] ? row_json(&rows[i]) : json_null()) == 0;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/" MOE_ABLATE_STATE, out);
    // Replaced whole (temp file, rename): a kill or a failed write in the
    // middle of it leaves the previous state, which --resume reads; written in
    // place, it left an empty or cut file that --resume refused.
    char *text = ok ? json_dumps(doc, JSON_INDENT(1) | JSON_REAL_PRECISION(17)) : NULL;
    const size_t len = text ? strlen(text) : 0;
    char *line = text ? realloc(text, len + 2) : NULL;
    if (line) line[len] = '\n';
    int rc = line ? moe_fs_replace_file(path, line, len + 1)
                  : moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    free(line ? line : text);
    json_decref(doc);
    return rc;
}

static int bad(const char *path, int run, const char *what) {
    if (run < 0) return moe_fail(MOE_EINVAL, "%s: %s", path, what);
    return moe_fail(MOE_EINVAL, "%s: runs[%d]: %s", path, run, what);
}

// A number field of run i (integer or real); false when missing or not one.
static bool num_of(json_t *o, const char *key, double *v) {
    json_t *x = json_object_get(o, key);
    if (!json_is_number(x)) return false;
    *v = json_number_value(x);
    return true;
}

static int read_row(const char *path, int i, json_t *o, moe_ablate_row *r) {
    const char *status, *error;
    json_t *tasks, *loss;
    double rc, steps, total, run;
    if (json_unpack(o, "{s:s, s:s, s:o, s:o}", "status", &status, "error", &error, "val_loss",
                    &loss, "tasks", &tasks) < 0 ||
        !num_of(o, "rc", &rc) || !num_of(o, "tokens_per_s", &r->tokens_per_s) ||
        !num_of(o, "drop_rate", &r->drop_rate) || !num_of(o, "max_vio", &r->max_vio) ||
        !num_of(o, "seconds", &r->seconds) || !num_of(o, "steps", &steps) ||
        !num_of(o, "total_steps", &total) || !num_of(o, "steps_run", &run) || !json_is_array(tasks))
        return bad(path, i,
                   "expected status, error, rc, val_loss, tokens_per_s, drop_rate, max_vio, "
                   "seconds, steps, total_steps, steps_run and tasks");
    r->ok = !strcmp(status, "ok");
    r->stopped = !strcmp(status, "stopped");
    if (!r->ok && !r->stopped && strcmp(status, "failed"))
        return bad(path, i, "status must be ok, failed or stopped");
    if (rc > 0 || rc < -1000 || steps < 0 || steps > 1e12 || total < 0 || total > 1e12 || run < 0 ||
        run > steps)
        return bad(path, i, "rc, steps, total_steps or steps_run out of range");
    r->rc = (int)rc, r->steps = (long)steps, r->total_steps = (long)total, r->steps_run = (long)run;
    snprintf(r->error, sizeof r->error, "%s", error);
    if (json_is_number(loss))
        r->val_loss = json_number_value(loss);
    else if (json_is_string(loss) && !strcmp(json_string_value(loss), "nan"))
        r->val_loss = NAN;
    else if (json_is_string(loss) && !strcmp(json_string_value(loss), "inf"))
        r->val_loss = INFINITY;
    else if (json_is_string(loss) && !strcmp(json_string_value(loss), "-inf"))
        r->val_loss = -INFINITY;
    else
        return bad(path, i, "val_loss must be a number, \"nan\", \"inf\" or \"-inf\"");
    if (json_array_size(tasks) > MOE_MAX_TASKS) return bad(path, i, "more tasks than the maximum");
    r->n_tasks = (int)json_array_size(tasks);
    for (int t = 0; t < r->n_tasks; t++) {
        const char *name;
        double acc;
        if (json_unpack(json_array_get(tasks, t), "{s:s, s:F}", "name", &name, "accuracy", &acc) <
                0 ||
            strlen(name) >= MOE_NAME_MAX)
            return bad(path, i, "tasks: expected {\"name\": short text, \"accuracy\": number}");
        snprintf(r->task[t], MOE_NAME_MAX, "%s", name);
        r->accuracy[t] = acc;
    }
    return 0;
}

// "v1,v2,..." of a grid axis as the folder or this command has it.
static void values_text(char *buf, size_t cap, json_t *vals, const moe_grid_axis *ax) {
    size_t len = 0;
    buf[0] = 0;
    const int n = vals ? (int)json_array_size(vals) : ax->n;
    for (int v = 0; v < n && len < cap; v++) {
        const char *s = vals ? json_string_value(json_array_get(vals, v)) : ax->values[v];
        len += snprintf(buf + len, cap - len, "%s%s", v ? "," : "", s ? s : "?");
    }
}

// The grid of the folder against this command's: the first axis that differs.
static int same_grid(const char *path, json_t *grid, const moe_grid_axis *axes, int n_axes) {
    if (!json_is_array(grid)) return bad(path, -1, "expected a \"grid\" list");
    const int n = (int)json_array_size(grid);
    for (int a = 0; a < n || a < n_axes; a++) {
        json_t *g = json_array_get(grid, a), *vals = json_object_get(g, "values");
        const char *key = json_string_value(json_object_get(g, "key"));
        if (a < n && (!key || !json_is_array(vals)))
            return bad(path, -1, "grid: expected {\"key\": text, \"values\": [text, ...]}");
        char there[2048] = "(none)", here[2048] = "(none)";
        if (a < n) values_text(there, sizeof there, vals, NULL);
        if (a < n_axes) values_text(here, sizeof here, NULL, &axes[a]);
        if (a < n && a < n_axes && !strcmp(key, axes[a].key) && !strcmp(there, here)) continue;
        return moe_fail(MOE_EINVAL,
                        "--resume: %s records another grid: its --grid %d is %s%s%s, this "
                        "command's is %s%s%s (resume with the same --grid options, in the same "
                        "order)",
                        path, a + 1, a < n ? key : "", a < n ? "=" : "", there,
                        a < n_axes ? axes[a].key : "", a < n_axes ? "=" : "", here);
    }
    return 0;
}

// The base config the folder's grid ran (before the grid's values) against
// this command's: the first key that differs.
static int same_base(const char *path, json_t *there, const moe_config *cfg) {
    json_t *here = config_json(cfg);
    int rc = here ? 0 : moe_fail(MOE_ENOMEM, "out of memory (ablation grid)");
    if (rc == 0 && !json_is_object(there))
        rc = bad(path, -1, "expected the grid's \"base\" config");
    const char *sec, *key;
    json_t *obj, *v;
    json_object_foreach(rc == 0 ? here : NULL, sec, obj) {
        json_object_foreach(obj, key, v) {
            json_t *w = json_object_get(json_object_get(there, sec), key);
            if (w && json_equal(v, w)) continue;
            char *a = w ? json_dumps(w, JSON_ENCODE_ANY | JSON_COMPACT) : NULL,
                 *b = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
            rc = moe_fail(MOE_EINVAL,
                          "--resume: %s records a grid run with %s.%s = %s, this command gives "
                          "%s (the config file, --set or --steps differ from the grid's; resume "
                          "with the same ones)",
                          path, sec, key, a ? a : "(none)", b ? b : "?");
            free(a);
            free(b);
            break;
        }
        if (rc < 0) break;
    }
    json_decref(here);
    return rc;
}

// The config files of the grid as the folder recorded them against their
// contents now (a folder written before they were recorded: not checked).
static int same_files(const char *path, json_t *there, const moe_grid_axis *axes, int n_axes) {
    if (!there) return 0;
    json_t *here = config_files_json(axes, n_axes);
    int rc = here ? 0 : moe_fail(MOE_ENOMEM, "out of memory (ablation grid)");
    const char *name;
    json_t *v;
    json_object_foreach(rc == 0 ? here : NULL, name, v) {
        if (json_equal(v, json_object_get(there, name))) continue;
        rc = moe_fail(MOE_EINVAL,
                      "--resume: --grid %s=%s: the file differs from the one %s records the "
                      "grid running (edited since?): restore it, or run the grid anew with "
                      "--overwrite",
                      MOE_GRID_CONFIG, name, path);
        break;
    }
    json_decref(here);
    return rc;
}

int moe_ablate_state_read(const char *out, const moe_config *base, const moe_grid_axis *axes,
                          int n_axes, moe_ablate_row *rows, bool *done, int n) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/" MOE_ABLATE_STATE, out);
    FILE *f;
    int rc = moe_fopen_regular(path, &f);
    if (rc == MOE_ENOTFOUND)
        return moe_fail(MOE_EINVAL,
                        "--resume: %s holds no ablation to continue (no " MOE_ABLATE_STATE
                        "); run the grid without --resume",
                        out);
    if (rc < 0) return moe_fail(MOE_EINVAL, "--resume: %s", moe_last_error());
    json_error_t je;
    json_t *doc = json_loadf(f, 0, &je);
    fclose(f);
    if (!doc) return moe_json_fail(MOE_EINVAL, path, &je);
    json_t *runs = json_object_get(doc, "runs");
    rc = same_grid(path, json_object_get(doc, "grid"), axes, n_axes);
    if (rc == 0) rc = same_base(path, json_object_get(doc, "base"), base);
    if (rc == 0) rc = same_files(path, json_object_get(doc, "config_files"), axes, n_axes);
    if (rc == 0 && (!json_is_array(runs) || (int)json_array_size(runs) != n))
        rc = bad(path, -1, "expected a \"runs\" list with one entry per run of the grid");
    for (int i = 0; rc == 0 && i < n; i++) {
        json_t *o = json_array_get(runs, i);
        done[i] = !json_is_null(o);
        if (done[i] && !json_is_object(o)) rc = bad(path, i, "expected an object or null");
        if (done[i] && rc == 0) rc = read_row(path, i, o, &rows[i]);
    }
    json_decref(doc);
    return rc;
}
