// Ablation grids: every combination of --grid values is trained from the same
// base config and seed (tables in trainer/ablate_tables.c). A run that fails
// is reported in its row and the grid goes on; a stop saves the current run
// and --resume continues the grid from out/ablate.json (trainer/ablate_state.c).
#include "moe/ablate.h"
#include "ablate_internal.h"
#include "config_internal.h"
#include "moe/checkpoint.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/report.h"
#include "moe/train.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
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
                            ax->n + 1);
        if (!len) return moe_fail(MOE_EINVAL, "--grid %s: value %d is empty", ax->key, ax->n + 1);
        if (len >= sizeof ax->values[0])
            return moe_fail(MOE_EINVAL, "--grid %s: value %d longer than %zu characters", ax->key,
                            ax->n + 1, sizeof ax->values[0] - 1);
        memcpy(ax->values[ax->n], p, len);
        // A value listed twice would train the same run twice under two rows.
        for (int i = 0; i < ax->n; i++)
            if (!strcmp(ax->values[i], ax->values[ax->n]))
                return moe_fail(MOE_EINVAL, "--grid %s: value %d repeats value %d (%s)", ax->key,
                                ax->n + 1, i + 1, ax->values[i]);
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
// (they win over every file), then the other axes' values. src (NULL: none)
// records where each key was set, a grid value as "--grid key". log: echo them.
static int run_config(moe_config *c, const moe_config *base, const moe_grid_axis *axes, int n_axes,
                      const int *idx, const char *const *sets, int n_sets, moe_config_src *src,
                      FILE *log) {
    *c = *base;
    for (int a = 0; a < n_axes; a++) {
        if (strcmp(axes[a].key, MOE_GRID_CONFIG)) continue;
        MOE_TRY(moe_config_load(c, src, axes[a].values[idx[a]]));
        for (int i = 0; i < n_sets; i++)
            MOE_TRY(moe_config_set(c, src, sets[i]));
        if (log) fprintf(log, " %s", axes[a].values[idx[a]]);
    }
    for (int a = 0; a < n_axes; a++) {
        if (!strcmp(axes[a].key, MOE_GRID_CONFIG)) continue;
        char *set = grid_set(&axes[a], idx[a]);
        int rc = set ? moe_config_set(c, src, set)
                     : moe_fail(MOE_ENOMEM, "out of memory (ablation grid)");
        if (rc < 0 && set) { // moe_config_set's "--set: " is ours to name
            const char *msg = moe_last_error();
            rc = moe_fail(rc, "--grid %s: %s", set, msg + (strncmp(msg, "--set: ", 7) ? 0 : 7));
        }
        if (rc == 0 && log) fprintf(log, " %s", set);
        if (rc == 0 && src) {
            char where[sizeof axes[a].key + 8];
            snprintf(where, sizeof where, "--grid %s", axes[a].key);
            moe_config_src_mark(src, axes[a].key, where);
        }
        free(set);
        MOE_TRY(rc);
    }
    return 0;
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
    int rc = nm && runs ? 0 : moe_fail(MOE_ENOMEM, "out of memory (ablation grid)");
    for (int i = 0; i < n && rc == 0; i++) {
        snprintf(nm[i].dir, sizeof nm[i].dir, "%s/run_%03d", out, i);
        snprintf(nm[i].name, sizeof nm[i].name, "run_%03d", i);
        for (int a = 0, len = 0; a < n_axes; a++)
            len += snprintf(nm[i].label + len, sizeof nm[i].label - len, "%s%s=%s", a ? " " : "",
                            axes[a].key, axes[a].values[rows[i].idx[a]]);
        runs[i] = (moe_report_run){nm[i].dir, nm[i].name, nm[i].label, rows[i].error,
                                   rows[i].ok ? rows[i].tokens_per_s : 0};
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
static const char *const ablate_files[] = {"results.csv", "results.md", "report.html",
                                           MOE_ABLATE_STATE, NULL};

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
        if (lstat(p, &st) < 0) continue;
        // A link (or file) named run_NNN is removed, never followed: the run
        // it points to belongs to someone else.
        if (!S_ISDIR(st.st_mode)) {
            if (unlink(p) < 0 && errno != ENOENT)
                rc = moe_fail(MOE_EIO, "%s: cannot remove: %s", p, strerror(errno));
            continue;
        }
        rc = moe_run_clear(p);
        if (rc == 0 && rmdir(p) < 0 && errno != ENOTEMPTY && errno != EEXIST)
            rc = moe_fail(MOE_EIO, "%s: cannot remove: %s", p, strerror(errno));
    }
    closedir(d);
    return rc;
}

// "key=value key=value" of the cell at idx.
static void cell_label(char *buf, size_t cap, const moe_grid_axis *axes, int n_axes,
                       const int *idx) {
    buf[0] = 0;
    for (int a = 0, len = 0; a < n_axes && len < (int)cap; a++)
        len += snprintf(buf + len, cap - len, "%s%s=%s", a ? " " : "", axes[a].key,
                        axes[a].values[idx[a]]);
}

// A cell's config checked as moe train checks its own before training: the
// key ranks and combinations, one process (parallel.ep = 1), the device, and
// synthetic data (all config, free to open). Errors name where each key was
// set: the base file's line, --set, or --grid KEY.
static int check_cell(moe_config *c, const moe_config *base, const moe_grid_axis *axes, int n_axes,
                      const int *idx, const moe_ablate_opts *o) {
    moe_config_src *src = moe_config_src_new();
    if (!src) return moe_fail(MOE_ENOMEM, "out of memory (ablation grid)");
    int rc = 0;
    if (o->config_path) { // only for src: base holds the values already
        moe_config scratch;
        moe_config_default(&scratch);
        rc = moe_config_load(&scratch, src, o->config_path);
        for (int i = 0; rc == 0 && i < o->n_sets; i++)
            rc = moe_config_set(&scratch, src, o->sets[i]);
    } else {
        for (int i = 0; rc == 0 && i < o->n_sets; i++) {
            moe_config scratch = *base;
            rc = moe_config_set(&scratch, src, o->sets[i]);
        }
    }
    if (rc == 0) rc = run_config(c, base, axes, n_axes, idx, o->sets, o->n_sets, src, NULL);
    if (rc == 0) rc = moe_config_check(c, src);
    if (rc == 0 && c->parallel.ep != 1)
        rc = moe_fail(MOE_EINVAL,
                      "%s: parallel.ep = %d needs %d ranks, and moe ablate trains every run in "
                      "one process (parallel.ep = 1)",
                      moe_config_where(src, "parallel.ep"), c->parallel.ep, c->parallel.ep);
    if (rc == 0 && (rc = moe_device_check(c->train.device)) < 0)
        rc = moe_fail(rc, "%s: %s", moe_config_where(src, "train.device"), moe_last_error());
    if (rc == 0 && !strcmp(c->data.kind, "synthetic")) {
        moe_data d;
        if ((rc = moe_data_open(&d, c)) == 0) moe_data_close(&d);
    }
    moe_config_src_free(src);
    return rc;
}

// Which grid cell run i is: axis 0 varies fastest.
static void cell_of(int i, const moe_grid_axis *axes, int n_axes, int *idx) {
    for (int a = 0; a < n_axes; a++) {
        idx[a] = i % axes[a].n;
        i /= axes[a].n;
    }
}

// Checks the whole grid before anything is written or trained.
static int check_grid(const moe_config *base, const moe_grid_axis *axes, int n_axes,
                      moe_ablate_row *rows, int n, const moe_ablate_opts *o) {
    if (n_axes < 1 || n_axes > MOE_GRID_MAX_AXES)
        return moe_fail(MOE_EINVAL, "--grid: %d axes (1..%d)", n_axes, MOE_GRID_MAX_AXES);
    bool reads_data = false; // some cell reads data.path / data.val_path
    for (int i = 0; i < n; i++) {
        cell_of(i, axes, n_axes, rows[i].idx);
        moe_config c;
        int rc = check_cell(&c, base, axes, n_axes, rows[i].idx, o);
        char run[PATH_MAX];
        if (rc == 0 && snprintf(run, sizeof run, "%s/run_%03d", o->out, i) >= (int)sizeof run)
            rc = moe_fail(MOE_EINVAL, "--out %s: path too long", o->out);
        if (rc == 0) rc = moe_run_path_check(run, c.train.keep_checkpoints, (long)c.train.steps);
        if (rc < 0) {
            char label[MOE_GRID_MAX_AXES * 200];
            cell_label(label, sizeof label, axes, n_axes, rows[i].idx);
            return moe_fail(rc, "%s (grid run %d of %d: %s)", moe_last_error(), i + 1, n, label);
        }
        reads_data |= strcmp(c.data.kind, "synthetic") != 0;
    }
    // A grid over a key no run reads trains the same run several times.
    for (int a = 0; a < n_axes; a++)
        if (!reads_data &&
            (!strcmp(axes[a].key, "data.path") || !strcmp(axes[a].key, "data.val_path")))
            return moe_fail(MOE_EINVAL,
                            "--grid %s: every run uses data.kind = synthetic, which reads no "
                            "%s: the runs would be the same",
                            axes[a].key, axes[a].key);
    return 0;
}

// The training seconds a checkpoint folder's trainer_state.json records for
// the steps before it (0 when it holds none: moe_train refuses it then).
// Mapped, not json_load_file: a FIFO there would block.
static double ckpt_train_seconds(const char *ck) {
    char p[PATH_MAX + 32];
    const void *text = NULL;
    size_t len = 0;
    if (snprintf(p, sizeof p, "%s/trainer_state.json", ck) >= (int)sizeof p ||
        moe_map_regular(p, &text, &len) < 0 || !text)
        return 0;
    json_error_t jerr;
    json_t *doc = json_loadb(text, len, 0, &jerr);
    moe_unmap(text, len);
    const json_t *v = json_object_get(doc, "train_seconds");
    const double s = json_is_number(v) ? json_number_value(v) : 0;
    json_decref(doc);
    return isfinite(s) && s > 0 ? s : 0;
}

// A run --resume continues: its figures are the whole run's. The means and
// steps_run come from the checkpoint's sums (moe_train_state), which cover
// every step unless the checkpoint predates them; then the stopped row's
// means are joined in when the resume started where it stopped. The seconds
// before the resume are the stopped row's when it chains (whole calls, setup
// and evaluation included), else the checkpoint's training seconds (a kill -9
// left no row, or one older than the checkpoint).
static void join_resumed(moe_ablate_row *r, const moe_ablate_row *prev, const moe_train_result *res,
                         double ck_seconds) {
    const bool chains = prev && res->steps - res->steps_run == prev->steps;
    r->steps_run = res->steps_summed;
    if (chains && res->steps_summed < res->steps) {
        const long s1 = prev->steps_run, s2 = res->steps_summed, s = s1 + s2;
        if (s > 0) {
            r->drop_rate = (prev->drop_rate * s1 + r->drop_rate * s2) / s;
            r->max_vio = (prev->max_vio * s1 + r->max_vio * s2) / s;
        }
        r->steps_run = s;
    }
    r->seconds += chains ? prev->seconds : ck_seconds;
}

// Trains run i into dir; with resume, continues a run folder that holds a
// checkpoint (prev: its stopped row, NULL if none) or restarts one that holds
// none.
static void train_run(moe_ablate_row *r, const moe_config *c, const char *dir, bool resume,
                      const moe_ablate_row *prev, volatile sig_atomic_t *stop, FILE *log) {
    char ck[PATH_MAX];
    struct stat st;
    const bool exists = lstat(dir, &st) == 0;
    const bool from_ckpt = resume && exists && moe_ckpt_resolve(dir, ck, sizeof ck, NULL) == 0;
    moe_train_opts o = {.out_dir = dir, .quiet = true, .stop = stop};
    o.resume_dir = from_ckpt ? dir : NULL;
    o.overwrite = exists && !from_ckpt; // started, nothing saved: from the start
    if (log && from_ckpt) fprintf(log, " (resuming)");
    if (log && o.overwrite) fprintf(log, " (restarting: no checkpoint)");
    if (log) fprintf(log, " ..."), fflush(log);
    // read before moe_train replaces the checkpoint
    const double ck_seconds = from_ckpt ? ckpt_train_seconds(ck) : 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    moe_train_result res;
    int idx[MOE_GRID_MAX_AXES];
    memcpy(idx, r->idx, sizeof idx);
    const int rc = moe_train(c, &o, &res);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    memset(r, 0, sizeof *r);
    memcpy(r->idx, idx, sizeof idx);
    r->seconds = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    r->rc = rc;
    r->total_steps = c->train.steps;
    if (rc < 0) {
        snprintf(r->error, sizeof r->error, "%s", moe_last_error());
        if (log) fprintf(log, " failed: %s\n", r->error);
        return;
    }
    r->steps = res.steps;
    r->steps_run = res.steps_run;
    r->tokens_per_s = res.tokens_per_s;
    r->drop_rate = res.drop_rate;
    r->max_vio = res.max_vio;
    join_resumed(r, from_ckpt ? prev : NULL, &res, ck_seconds);
    if (res.interrupted) {
        r->stopped = 1;
        snprintf(r->error, sizeof r->error,
                 "stopped at step %ld of %ld (checkpoint saved; --resume continues it)", r->steps,
                 r->total_steps);
        if (log) fprintf(log, " %s\n", r->error);
        return;
    }
    r->ok = 1;
    r->val_loss = res.eval.val_loss;
    r->n_tasks = res.eval.n_tasks;
    for (int t = 0; t < r->n_tasks; t++) {
        snprintf(r->task[t], MOE_NAME_MAX, "%s", res.eval.task[t]);
        r->accuracy[t] = res.eval.accuracy[t];
    }
    moe_eval_result_free(&res.eval);
    if (log)
        fprintf(log, " val loss %.4f, MaxVio %.3f (%.0f s)\n", r->val_loss, r->max_vio, r->seconds);
}

// Where the folder stands before the first run: new (refused if it holds an
// ablation), replaced (--overwrite) or continued (--resume: rows and done
// from its ablate.json, whose grid and base config must be this call's).
static int prepare_out(const moe_config *base, const moe_grid_axis *axes, int n_axes,
                       moe_ablate_row *rows, bool *done, int n, const moe_ablate_opts *o) {
    const char *out = o->out;
    struct stat sb;
    if (stat(out, &sb) == 0 && !S_ISDIR(sb.st_mode))
        return moe_fail(MOE_EINVAL, "--out %s: exists and is not a folder", out);
    if (o->resume) return moe_ablate_state_read(out, base, axes, n_axes, rows, done, n);
    // Runs of an earlier grid would be replaced one by one, and those beyond this
    // grid's size left matching nothing in the new tables.
    if (!o->overwrite && holds_ablation(out))
        return moe_fail(MOE_EINVAL,
                        "--out %s already holds an ablation (results.csv, " MOE_ABLATE_STATE
                        " or run_NNN folders); continue a stopped one with --resume, replace it "
                        "with --overwrite, or choose another --out",
                        out);
    if (o->overwrite) MOE_TRY(clear_ablation(out));
    // the tables land here even when every run fails before making its folder
    MOE_TRY(moe_make_dirs(out));
    return moe_ablate_state_write(out, base, axes, n_axes, rows, done, n);
}

int moe_ablate_run(const moe_config *base, const moe_grid_axis *axes, int n_axes,
                   moe_ablate_opts *o) {
    o->interrupted = false;
    if (o->resume && o->overwrite)
        return moe_fail(MOE_EINVAL,
                        "--resume continues a grid and --overwrite replaces it: give one");
    // A key twice would train one cell labelled with both values but run with the last.
    for (int a = 0; a < n_axes; a++)
        for (int b = 0; b < a; b++)
            if (!strcmp(axes[a].key, axes[b].key))
                return moe_fail(MOE_EINVAL,
                                "--grid %s given twice (list every value in one: "
                                "--grid %s=v1,v2,...)",
                                axes[a].key, axes[a].key);
    int n = 1;
    for (int a = 0; a < n_axes && a < MOE_GRID_MAX_AXES; a++) {
        n *= axes[a].n;
        if (n > MOE_GRID_MAX_RUNS)
            return moe_fail(MOE_EINVAL,
                            "--grid: more than %d runs (the product of the value "
                            "counts); split the grid",
                            MOE_GRID_MAX_RUNS);
    }
    moe_ablate_row *rows = calloc(n, sizeof *rows);
    bool *done = calloc(n, sizeof *done);
    int rc = rows && done ? 0 : moe_fail(MOE_ENOMEM, "out of memory (ablation grid)");
    // Every cell before training anything: a value valid alone can clash with
    // the base (router.top_k above moe.num_experts).
    if (rc == 0) rc = check_grid(base, axes, n_axes, rows, n, o);
    if (rc == 0) rc = prepare_out(base, axes, n_axes, rows, done, n, o);
    int n_rows = n; // rows in the tables: those started, when a stop ends the grid early
    for (int i = 0; rc == 0 && i < n; i++) {
        moe_ablate_row *r = &rows[i];
        // A run that failed on a write or on memory (a full disk, a file size
        // limit) may succeed now: --resume trains it again. Other failures
        // (bad data) would repeat, and are kept.
        const bool retry = done[i] && !r->ok && !r->stopped &&
                           (r->rc == MOE_EIO || r->rc == MOE_ENOMEM);
        if (retry && o->log)
            fprintf(o->log, "[%d/%d] run_%03d: failed earlier (%s), training again\n", i + 1, n,
                    i, r->error);
        if (done[i] && !r->stopped && !retry) { // finished before a --resume
            if (o->log)
                fprintf(o->log, "[%d/%d] run_%03d: %s earlier, kept\n", i + 1, n, i,
                        r->ok ? "finished" : "failed");
            continue;
        }
        if (o->stop && *o->stop) { // between two runs
            o->interrupted = true;
            n_rows = i;
            break;
        }
        moe_config c;
        char dir[PATH_MAX];
        if (o->log) fprintf(o->log, "[%d/%d]", i + 1, n);
        run_config(&c, base, axes, n_axes, r->idx, o->sets, o->n_sets, NULL, o->log);
        snprintf(dir, sizeof dir, "%s/run_%03d", o->out, i);
        const moe_ablate_row prev = *r;
        train_run(r, &c, dir, o->resume, done[i] ? &prev : NULL, o->stop, o->log);
        done[i] = true;
        rc = moe_ablate_state_write(o->out, base, axes, n_axes, rows, done, n);
        if (r->stopped) {
            o->interrupted = true;
            n_rows = i + 1;
            break;
        }
    }
    int failed = 0, first = -1, again = 0; // again: failed runs a --resume trains again
    for (int i = 0; i < n_rows; i++)
        if (!rows[i].ok && !rows[i].stopped) {
            if (failed++ == 0) first = i;
            again += rows[i].rc == MOE_EIO || rows[i].rc == MOE_ENOMEM;
        }
    if (rc == 0) rc = write_report(o->out, axes, n_axes, rows, n_rows);
    if (rc == 0) rc = moe_ablate_write_results(o->out, axes, n_axes, rows, n_rows);
    // A grid with a failed run is a failed ablation, the table written all the
    // same: a runtime failure (exit 1) whatever the run's own code, since every
    // config was checked before the first run. A stopped grid reports the stop.
    if (rc == 0 && failed && !o->interrupted) {
        const int code = rows[first].rc == MOE_ENOMEM || rows[first].rc == MOE_EIO ? rows[first].rc
                                                                                   : MOE_ENUMERIC;
        char tail[96];
        if (again)
            snprintf(tail, sizeof tail, "trains again the %d that failed on a write or on memory",
                     again);
        else
            snprintf(tail, sizeof tail,
                     "keeps them (it trains again only runs that failed on a "
                     "write or on memory)");
        // The run's error is cut to what leaves room for the advice after it
        // (a message holds 511 bytes).
        int room = 511 - 2 * (int)strlen(o->out) - (int)strlen(tail) - 160;
        rc = moe_fail(
            code,
            "%d of %d runs failed (first: %s/run_%03d: %.*s); the table of all runs is in "
            "%s/results.md; the same moe ablate command with --resume %s",
            failed, n, o->out, first, room > 40 ? room : 40, rows[first].error, o->out, tail);
    }
    free(rows);
    free(done);
    return rc;
}

int moe_ablate(const moe_config *base, const moe_grid_axis *axes, int n_axes,
               const char *const *sets, int n_sets, const char *out, FILE *log) {
    moe_ablate_opts o = {.out = out, .sets = sets, .n_sets = n_sets, .log = log};
    return moe_ablate_run(base, axes, n_axes, &o);
}

int moe_ablate_overwrite(const moe_config *base, const moe_grid_axis *axes, int n_axes,
                         const char *const *sets, int n_sets, const char *out, FILE *log) {
    moe_ablate_opts o = {.out = out, .sets = sets, .n_sets = n_sets, .log = log, .overwrite = true};
    return moe_ablate_run(base, axes, n_axes, &o);
}
