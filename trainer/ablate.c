// Ablation grids: every combination of --grid values is trained from the same
// base config and seed; results.csv lists every run and results.md sorts the
// finished ones by final validation loss. A run that fails is reported in its
// row and the grid goes on.
#include "moe/ablate.h"
#include "moe/error.h"
#include "moe/report.h"
#include "moe/train.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

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

typedef struct {
    int idx[MOE_GRID_MAX_AXES];
    int ok;
    char error[256];
    double val_loss, tokens_per_s, drop_rate, max_vio, seconds;
    int rc; // the run's status (0: trained)
    int n_tasks;
    char task[MOE_MAX_TASKS][MOE_NAME_MAX];
    double accuracy[MOE_MAX_TASKS];
} run_row;

static int by_loss(const void *a, const void *b) {
    const run_row *x = a, *y = b;
    if (x->ok != y->ok) return y->ok - x->ok; // finished runs first
    if (!x->ok) return 0;
    return (x->val_loss > y->val_loss) - (x->val_loss < y->val_loss);
}

// Closes f; true when a write or the close failed (full disk, I/O error).
static bool closed_bad(FILE *f) {
    bool bad = ferror(f) != 0;
    return fclose(f) != 0 || bad;
}

static int write_results(const char *out, const moe_grid_axis *axes, int n_axes, run_row *rows,
                         int n) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/results.csv", out);
    FILE *f = fopen(path, "w");
    if (!f) return moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
    if (f) {
        fprintf(f, "run");
        for (int a = 0; a < n_axes; a++)
            fprintf(f, ",%s", axes[a].key);
        fprintf(f, ",status,val_loss,tokens_per_s,drop_rate,max_vio,seconds");
        for (int t = 0; t < rows[0].n_tasks; t++)
            fprintf(f, ",acc_%s", rows[0].task[t]);
        fprintf(f, ",error\n");
        for (int i = 0; i < n; i++) {
            run_row *r = &rows[i];
            fprintf(f, "%d", i);
            for (int a = 0; a < n_axes; a++)
                fprintf(f, ",\"%s\"", axes[a].values[r->idx[a]]);
            fprintf(f, ",%s,%.6f,%.1f,%.6f,%.4f,%.1f", r->ok ? "ok" : "failed",
                    r->ok ? r->val_loss : NAN, r->tokens_per_s, r->drop_rate,
                    r->ok ? r->max_vio : NAN, r->seconds);
            for (int t = 0; t < rows[0].n_tasks; t++)
                fprintf(f, ",%.4f", r->ok ? r->accuracy[t] : NAN);
            fprintf(f, ",\"%s\"\n", r->error);
        }
        if (closed_bad(f)) return moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno));
    }
    qsort(rows, n, sizeof *rows, by_loss);
    snprintf(path, sizeof path, "%s/results.md", out);
    f = fopen(path, "w");
    if (!f) return moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
    fprintf(f, "| rank |");
    for (int a = 0; a < n_axes; a++)
        fprintf(f, " %s |", axes[a].key);
    fprintf(f, " val loss |");
    for (int t = 0; t < rows[0].n_tasks; t++)
        fprintf(f, " acc %s |", rows[0].task[t]);
    fprintf(f, " tokens/s | drop rate | MaxVio |\n|---|");
    for (int a = 0; a < n_axes + 4 + rows[0].n_tasks; a++)
        fprintf(f, "---|");
    fputc('\n', f);
    for (int i = 0; i < n; i++) {
        run_row *r = &rows[i];
        fprintf(f, "| %d |", i + 1);
        for (int a = 0; a < n_axes; a++)
            fprintf(f, " %s |", axes[a].values[r->idx[a]]);
        if (!r->ok) {
            fprintf(f, " failed: %s |", r->error);
            for (int t = 0; t < rows[0].n_tasks + 3; t++)
                fprintf(f, " |");
            fputc('\n', f);
            continue;
        }
        fprintf(f, " %.4f |", r->val_loss);
        for (int t = 0; t < r->n_tasks; t++) {
            if (r->accuracy[t] < 0)
                fprintf(f, " n/a |");
            else
                fprintf(f, " %.1f%% |", 100 * r->accuracy[t]);
        }
        fprintf(f, " %.0f | %.2f%% | %.3f |\n", r->tokens_per_s, 100 * r->drop_rate, r->max_vio);
    }
    return closed_bad(f) ? moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno)) : 0;
}

// report.html beside the tables: the runs' loss curves overlaid and their
// final figures (moe/report.h).
static int write_report(const char *out, const moe_grid_axis *axes, int n_axes, const run_row *rows,
                        int n) {
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

int moe_ablate(const moe_config *base, const moe_grid_axis *axes, int n_axes,
               const char *const *sets, int n_sets, const char *out, FILE *log) {
    if (n_axes < 1 || n_axes > MOE_GRID_MAX_AXES)
        return moe_fail(MOE_EINVAL, "ablate: %d grid axes (1..%d)", n_axes, MOE_GRID_MAX_AXES);
    int n = 1;
    for (int a = 0; a < n_axes; a++) {
        n *= axes[a].n;
        if (n > 4096) return moe_fail(MOE_EINVAL, "ablate: more than 4096 runs");
    }
    run_row *rows = calloc(n, sizeof *rows);
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
    for (int i = 0; i < n; i++) {
        run_row *r = &rows[i];
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
    // Failed rows take their task names from a finished one for the header.
    for (int i = 0; i < n; i++)
        if (rows[i].ok) {
            for (int j = 0; j < n; j++)
                if (!rows[j].ok) {
                    rows[j].n_tasks = rows[i].n_tasks;
                    memcpy(rows[j].task, rows[i].task, sizeof rows[i].task);
                }
            break;
        }
    int rc = write_report(out, axes, n_axes, rows, n); // before the tables sort the rows
    if (rc == 0) rc = write_results(out, axes, n_axes, rows, n);
    int failed = 0, first = -1;
    for (int i = 0; i < n; i++)
        if (!rows[i].ok && failed++ == 0) first = i;
    // A grid with a failed run is a failed ablation (exit 1), the table written all the same.
    if (rc == 0 && failed)
        rc = moe_fail(first >= 0 && rows[first].rc != MOE_EINVAL ? rows[first].rc : MOE_ENUMERIC,
                      "%d of %d runs failed (first: %s/run_%03d: %s); the table of all runs is in "
                      "%s/results.md",
                      failed, n, out, first, rows[first].error, out);
    free(rows);
    return rc;
}
