// Ablation grids: every combination of --grid values is trained from the same
// base config and seed; results.csv lists every run and results.md sorts the
// finished ones by final validation loss. A run that fails is reported in its
// row and the grid goes on.
#include "moe/ablate.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/report.h"
#include "moe/train.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int moe_grid_axis_parse(moe_grid_axis *ax, const char *spec) {
    memset(ax, 0, sizeof *ax);
    const char *eq = strchr(spec, '=');
    if (!eq || eq == spec || !eq[1])
        return moe_fail(MOE_EINVAL, "--grid %.64s%s: expected key=value1,value2,...", spec,
                        strlen(spec) > 64 ? "..." : "");
    if ((size_t)(eq - spec) >= sizeof ax->key)
        return moe_fail(MOE_EINVAL, "--grid: key '%.64s...' longer than %zu characters", spec,
                        sizeof ax->key - 1);
    memcpy(ax->key, spec, eq - spec);
    // Values split at commas outside brackets, so list values ([4,8]) work. Every
    // comma starts another value: an empty one (",," or a trailing comma) or an
    // unpaired bracket is an error, never a silently shorter grid.
    for (const char *p = eq + 1;; ax->n++) {
        if (ax->n == MOE_GRID_MAX_VALUES)
            return moe_fail(MOE_EINVAL, "--grid %s: more than %d values", ax->key,
                            MOE_GRID_MAX_VALUES);
        int depth = 0;
        size_t len = 0;
        while (p[len] && (depth > 0 || p[len] != ',') && depth >= 0) {
            depth += p[len] == '[' ? 1 : p[len] == ']' ? -1 : 0;
            len++;
        }
        if (depth != 0)
            return moe_fail(MOE_EINVAL, "--grid %s: value %d has an unpaired '[' or ']'", ax->key,
                            ax->n);
        if (!len) return moe_fail(MOE_EINVAL, "--grid %s: value %d is empty", ax->key, ax->n);
        if (len >= sizeof ax->values[0])
            return moe_fail(MOE_EINVAL, "--grid %s: value %d longer than %zu characters", ax->key,
                            ax->n, sizeof ax->values[0] - 1);
        memcpy(ax->values[ax->n], p, len);
        if (!p[len]) {
            ax->n++;
            return 0;
        }
        p += len + 1;
    }
}

// "key=value" of axis a's value i, allocated (NULL: out of memory).
static char *grid_set(const moe_grid_axis *a, int i) {
    size_t kl = strlen(a->key), vl = strlen(a->values[i]);
    char *s = malloc(kl + vl + 2);
    if (!s) return NULL;
    memcpy(s, a->key, kl);
    s[kl] = '=';
    memcpy(s + kl + 1, a->values[i], vl + 1);
    return s;
}

// The config of the run at grid indices idx: base, then the file of a
// `config` axis (its keys over the base's) with the --set assignments again
// (they win over every file), then the other axes' values. log: echo them.
static int run_config(moe_config *c, const moe_config *base, const moe_grid_axis *axes, int n_axes,
                      const int *idx, const char *const *sets, int n_sets, FILE *log) {
    *c = *base;
    for (int a = 0; a < n_axes; a++) {
        if (strcmp(axes[a].key, MOE_GRID_CONFIG)) continue;
        MOE_TRY(moe_config_load(c, NULL, axes[a].values[idx[a]]));
        for (int i = 0; i < n_sets; i++)
            MOE_TRY(moe_config_set(c, NULL, sets[i]));
        if (log) fprintf(log, " %s", axes[a].values[idx[a]]);
    }
    for (int a = 0; a < n_axes; a++) {
        if (!strcmp(axes[a].key, MOE_GRID_CONFIG)) continue;
        char *set = grid_set(&axes[a], idx[a]);
        int rc = set ? moe_config_set(c, NULL, set) : moe_fail(MOE_ENOMEM, "ablate: out of memory");
        if (rc == 0 && log) fprintf(log, " %s", set);
        free(set);
        MOE_TRY(rc);
    }
    return 0;
}

// results.md's order: finished runs with a finite loss, ascending; then
// finished runs whose loss is NaN or Inf (status "nan"); then failed runs.
// Ties keep the run order (qsort is not stable: the index decides).
static int rank_class(const moe_ablate_row *r) {
    return !r->ok ? 2 : isfinite(r->val_loss) ? 0 : 1;
}

static int by_loss(const void *a, const void *b) {
    const moe_ablate_row *x = *(const moe_ablate_row *const *)a,
                         *y = *(const moe_ablate_row *const *)b;
    const int cx = rank_class(x), cy = rank_class(y);
    if (cx != cy) return cx - cy;
    if (cx == 0 && x->val_loss != y->val_loss) return x->val_loss < y->val_loss ? -1 : 1;
    return (x > y) - (x < y);
}

static const char *status_of(const moe_ablate_row *r) {
    return !r->ok ? "failed" : isfinite(r->val_loss) ? "ok" : "nan";
}

// Column of task name in cols (the union over every run, first seen first).
static int task_col(char (*cols)[MOE_NAME_MAX], int n_cols, const char *name) {
    for (int c = 0; c < n_cols; c++)
        if (!strcmp(cols[c], name)) return c;
    return -1;
}

// Run r's accuracy in column c: -1 when r has no such task or no figure for it.
static double acc_in(const moe_ablate_row *r, char (*cols)[MOE_NAME_MAX], int c) {
    for (int t = 0; r->ok && t < r->n_tasks; t++)
        if (!strcmp(r->task[t], cols[c])) return r->accuracy[t];
    return -1;
}

// Closes f; true when a write or the close failed (full disk, I/O error).
static bool closed_bad(FILE *f) {
    bool bad = ferror(f) != 0;
    return fclose(f) != 0 || bad;
}

// results.csv in run order, results.md in rank order. Task columns are the
// union of every run's tasks (grids over data.tasks give runs different
// sets); a run without a figure leaves its cell empty in both files.
int moe_ablate_write_results(const char *out, const moe_grid_axis *axes, int n_axes,
                             const moe_ablate_row *rows, int n) {
    char(*cols)[MOE_NAME_MAX] = calloc((size_t)n * MOE_MAX_TASKS + 1, sizeof *cols);
    const moe_ablate_row **order = calloc((size_t)n, sizeof *order);
    if (!cols || !order) {
        free(cols);
        free(order);
        return moe_fail(MOE_ENOMEM, "ablate: out of memory");
    }
    int n_cols = 0;
    for (int i = 0; i < n; i++) {
        order[i] = &rows[i];
        for (int t = 0; t < rows[i].n_tasks; t++)
            if (task_col(cols, n_cols, rows[i].task[t]) < 0)
                snprintf(cols[n_cols++], MOE_NAME_MAX, "%s", rows[i].task[t]);
    }
    int rc = 0;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/results.csv", out);
    FILE *f = fopen(path, "w");
    if (!f) {
        rc = moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
        goto done;
    }
    fprintf(f, "run");
    for (int a = 0; a < n_axes; a++)
        fprintf(f, ",%s", axes[a].key);
    fprintf(f, ",status,val_loss,tokens_per_s,drop_rate,max_vio,seconds");
    for (int c = 0; c < n_cols; c++)
        fprintf(f, ",acc_%s", cols[c]);
    fprintf(f, ",error\n");
    for (int i = 0; i < n; i++) {
        const moe_ablate_row *r = &rows[i];
        fprintf(f, "%d", i);
        for (int a = 0; a < n_axes; a++)
            fprintf(f, ",\"%s\"", axes[a].values[r->idx[a]]);
        fprintf(f, ",%s,", status_of(r)); // a failed run has no loss nor MaxVio: empty cells
        if (r->ok) fprintf(f, "%.6f", r->val_loss);
        fprintf(f, ",%.1f,%.6f,", r->tokens_per_s, r->drop_rate);
        if (r->ok) fprintf(f, "%.4f", r->max_vio);
        fprintf(f, ",%.1f", r->seconds);
        for (int c = 0; c < n_cols; c++) {
            const double acc = acc_in(r, cols, c);
            if (acc >= 0)
                fprintf(f, ",%.4f", acc);
            else
                fputc(',', f);
        }
        fprintf(f, ",\"%s\"\n", r->error);
    }
    if (closed_bad(f)) {
        rc = moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno));
        goto done;
    }
    qsort(order, n, sizeof *order, by_loss);
    snprintf(path, sizeof path, "%s/results.md", out);
    f = fopen(path, "w");
    if (!f) {
        rc = moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
        goto done;
    }
    fprintf(f, "| rank |");
    for (int a = 0; a < n_axes; a++)
        fprintf(f, " %s |", axes[a].key);
    fprintf(f, " val loss |");
    for (int c = 0; c < n_cols; c++)
        fprintf(f, " acc %s |", cols[c]);
    fprintf(f, " tokens/s | drop rate | MaxVio |\n|---|");
    for (int a = 0; a < n_axes + 4 + n_cols; a++)
        fprintf(f, "---|");
    fputc('\n', f);
    for (int i = 0; i < n; i++) {
        const moe_ablate_row *r = order[i];
        fprintf(f, "| %d |", i + 1);
        for (int a = 0; a < n_axes; a++)
            fprintf(f, " %s |", axes[a].values[r->idx[a]]);
        if (!r->ok) {
            fprintf(f, " failed: %s |", r->error);
            for (int t = 0; t < n_cols + 3; t++)
                fprintf(f, " |");
            fputc('\n', f);
            continue;
        }
        if (isfinite(r->val_loss))
            fprintf(f, " %.4f |", r->val_loss);
        else // ranked after every finite loss
            fprintf(f, " %s (not finite) |",
                    isnan(r->val_loss) ? "nan"
                    : r->val_loss > 0  ? "inf"
                                       : "-inf");
        for (int c = 0; c < n_cols; c++) {
            const double acc = acc_in(r, cols, c);
            if (acc < 0)
                fprintf(f, " n/a |");
            else
                fprintf(f, " %.1f%% |", 100 * acc);
        }
        fprintf(f, " %.0f | %.2f%% | %.3f |\n", r->tokens_per_s, 100 * r->drop_rate, r->max_vio);
    }
    if (closed_bad(f)) rc = moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno));
done:
    free(cols);
    free(order);
    return rc;
}

// report.html beside the tables: the runs' loss curves overlaid and their
// final figures (moe/report.h).
static int write_report(const char *out, const moe_grid_axis *axes, int n_axes,
                        const moe_ablate_row *rows, int n) {
    typedef struct {
        char dir[PATH_MAX], name[16], label[MOE_GRID_MAX_AXES * 200];
    } names;
    names *nm = calloc(n, sizeof *nm);
    moe_report_run *runs = calloc(n, sizeof *runs);
    int rc = nm && runs ? 0 : moe_fail(MOE_ENOMEM, "ablate: out of memory");
    for (int i = 0; i < n && rc == 0; i++) {
        snprintf(nm[i].dir, sizeof nm[i].dir, "%s/run_%03d", out, i);
        snprintf(nm[i].name, sizeof nm[i].name, "run_%03d", i);
        for (int a = 0, len = 0; a < n_axes; a++)
            len += snprintf(nm[i].label + len, sizeof nm[i].label - len, "%s%s=%s", a ? " " : "",
                            axes[a].key, axes[a].values[rows[i].idx[a]]);
        runs[i] = (moe_report_run){nm[i].dir, nm[i].name, nm[i].label, rows[i].error};
    }
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/report.html", out);
    if (rc == 0) rc = moe_report_compare_html(path, out, runs, n);
    free(nm);
    free(runs);
    return rc;
}

// "run_" and three or more digits: a run folder of an ablation.
static bool is_run_name(const char *name) {
    if (strncmp(name, "run_", 4)) return false;
    size_t d = 0;
    while (isdigit((unsigned char)name[4 + d]))
        d++;
    return d >= 3 && !name[4 + d];
}

// The files of an ablation in out: its tables and report, and run_NNN folders.
static const char *const ablate_files[] = {"results.csv", "results.md", "report.html", NULL};

// 1 when out holds an earlier ablation's files, else 0.
static int holds_ablation(const char *out) {
    char p[PATH_MAX];
    struct stat st;
    for (int i = 0; ablate_files[i]; i++)
        if (snprintf(p, sizeof p, "%s/%s", out, ablate_files[i]) < (int)sizeof p &&
            lstat(p, &st) == 0)
            return 1;
    DIR *d = opendir(out);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while (!found && (e = readdir(d)) != NULL)
        found = is_run_name(e->d_name);
    closedir(d);
    return found;
}

// --overwrite: removes what an earlier ablation wrote into out (its tables,
// report, and in every run_NNN folder what moe train writes, then the folder
// when that leaves it empty); files of anyone else stay.
static int clear_ablation(const char *out) {
    char p[PATH_MAX];
    for (int i = 0; ablate_files[i]; i++) {
        snprintf(p, sizeof p, "%s/%s", out, ablate_files[i]);
        if (unlink(p) < 0 && errno != ENOENT)
            return moe_fail(MOE_EIO, "%s: cannot remove: %s", p, strerror(errno));
    }
    DIR *d = opendir(out);
    if (!d) return 0;
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (!is_run_name(e->d_name)) continue;
        if (snprintf(p, sizeof p, "%s/%s", out, e->d_name) >= (int)sizeof p) continue;
        struct stat st;
        if (lstat(p, &st) < 0 || !S_ISDIR(st.st_mode)) continue;
        rc = moe_run_clear(p);
        if (rc == 0 && rmdir(p) < 0 && errno != ENOTEMPTY && errno != EEXIST)
            rc = moe_fail(MOE_EIO, "%s: cannot remove: %s", p, strerror(errno));
    }
    closedir(d);
    return rc;
}

static int ablate(const moe_config *base, const moe_grid_axis *axes, int n_axes,
                  const char *const *sets, int n_sets, const char *out, bool overwrite, FILE *log) {
    if (n_axes < 1 || n_axes > MOE_GRID_MAX_AXES)
        return moe_fail(MOE_EINVAL, "ablate: %d grid axes (1..%d)", n_axes, MOE_GRID_MAX_AXES);
    // A key twice would train one cell labelled with both values but run with the last.
    for (int a = 0; a < n_axes; a++)
        for (int b = 0; b < a; b++)
            if (!strcmp(axes[a].key, axes[b].key))
                return moe_fail(MOE_EINVAL,
                                "--grid %s given twice (list every value in one: "
                                "--grid %s=v1,v2,...)",
                                axes[a].key, axes[a].key);
    int n = 1;
    for (int a = 0; a < n_axes; a++) {
        n *= axes[a].n;
        if (n > 4096) return moe_fail(MOE_EINVAL, "ablate: more than 4096 runs");
    }
    moe_ablate_row *rows = calloc(n, sizeof *rows);
    if (!rows) return moe_fail(MOE_ENOMEM, "ablate: out of memory");
    // Validate every combination before training anything: each run's whole
    // config too, since a value valid alone can clash with the base
    // (router.top_k above moe.num_experts).
    for (int i = 0; i < n; i++) {
        for (int a = 0, rest = i; a < n_axes; a++) {
            rows[i].idx[a] = rest % axes[a].n;
            rest /= axes[a].n;
        }
        moe_config c;
        int rc = run_config(&c, base, axes, n_axes, rows[i].idx, sets, n_sets, NULL);
        if (rc == 0) rc = moe_config_check(&c, NULL);
        if (rc < 0) {
            const char *msg = moe_last_error(); // moe_config_set's "--set: " is ours to name
            rc = moe_fail(rc, "--grid run %d: %s", i + 1,
                          msg + (strncmp(msg, "--set: ", 7) ? 0 : 7));
            free(rows);
            return rc;
        }
    }
    struct stat sb;
    if (stat(out, &sb) == 0 && !S_ISDIR(sb.st_mode)) {
        free(rows);
        return moe_fail(MOE_EINVAL, "--out %s: exists and is not a folder", out);
    }
    // Runs of an earlier grid would be replaced one by one, and those beyond this
    // grid's size left matching nothing in the new tables.
    if (!overwrite && holds_ablation(out)) {
        free(rows);
        return moe_fail(MOE_EINVAL,
                        "--out %s already holds an ablation (results.csv or run_NNN folders); "
                        "replace it with --overwrite, or choose another --out",
                        out);
    }
    { // the tables land here even when every run fails before making its folder
        int rc = overwrite ? clear_ablation(out) : 0;
        if (rc == 0) rc = moe_make_dirs(out);
        if (rc < 0) {
            free(rows);
            return rc;
        }
    }
    for (int i = 0; i < n; i++) {
        moe_ablate_row *r = &rows[i];
        moe_config c;
        char dir[PATH_MAX];
        if (log) fprintf(log, "[%d/%d]", i + 1, n);
        run_config(&c, base, axes, n_axes, r->idx, sets, n_sets, log); // validated above
        snprintf(dir, sizeof dir, "%s/run_%03d", out, i);
        if (log) fprintf(log, " ..."), fflush(log);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        moe_train_opts o = {.out_dir = dir, .quiet = true};
        moe_train_result res;
        int rc = moe_train(&c, &o, &res);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        r->seconds = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
        r->ok = rc == 0;
        r->rc = rc;
        if (rc < 0) {
            snprintf(r->error, sizeof r->error, "%s", moe_last_error());
            for (char *q = r->error; *q; q++)
                if (*q == '"' || *q == '|') *q = '\'';
            if (log) fprintf(log, " failed: %s\n", r->error);
        } else {
            r->val_loss = res.eval.val_loss;
            r->tokens_per_s = res.tokens_per_s;
            r->drop_rate = res.drop_rate;
            r->max_vio = res.max_vio;
            r->n_tasks = res.eval.n_tasks;
            for (int t = 0; t < r->n_tasks; t++) {
                snprintf(r->task[t], MOE_NAME_MAX, "%s", res.eval.task[t]);
                r->accuracy[t] = res.eval.accuracy[t];
            }
            moe_eval_result_free(&res.eval);
            if (log)
                fprintf(log, " val loss %.4f, MaxVio %.3f (%.0f s)\n", r->val_loss, r->max_vio,
                        r->seconds);
        }
    }
    int failed = 0, first = -1;
    for (int i = 0; i < n; i++)
        if (!rows[i].ok && failed++ == 0) first = i;
    int rc = write_report(out, axes, n_axes, rows, n);
    if (rc == 0) rc = moe_ablate_write_results(out, axes, n_axes, rows, n);
    // A grid with a failed run is a failed ablation, the table written all the
    // same: a runtime failure (exit 1) whatever the run's own code, since every
    // config was checked before the first run.
    if (rc == 0 && failed) {
        const int code = rows[first].rc == MOE_ENOMEM || rows[first].rc == MOE_EIO ? rows[first].rc
                                                                                   : MOE_ENUMERIC;
        rc = moe_fail(code,
                      "%d of %d runs failed (first: %s/run_%03d: %s); the table of all runs is in "
                      "%s/results.md",
                      failed, n, out, first, rows[first].error, out);
    }
    free(rows);
    return rc;
}

int moe_ablate(const moe_config *base, const moe_grid_axis *axes, int n_axes,
               const char *const *sets, int n_sets, const char *out, FILE *log) {
    return ablate(base, axes, n_axes, sets, n_sets, out, false, log);
}

int moe_ablate_overwrite(const moe_config *base, const moe_grid_axis *axes, int n_axes,
                         const char *const *sets, int n_sets, const char *out, FILE *log) {
    return ablate(base, axes, n_axes, sets, n_sets, out, true, log);
}
