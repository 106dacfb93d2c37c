// The training loop: micro-batches with gradient accumulation, loss = CE +
// aux_coef*aux + z_coef*z, global-norm clipping, AdamW with warmup + cosine,
// metrics.jsonl per step, a live progress line on a terminal (plain lines
// otherwise), periodic evaluation and checkpoints, resume, and a stop on the
// first non-finite loss or gradient that names the step and the layer.
#include "moe/train.h"
#include "moe/alloc.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/json_error.h"
#include "moe/log.h"
#include "moe/mfu.h"
#include "moe/optim.h"
#include "moe/parallel.h"
#include "moe/plan.h"
#include "moe/task_experts.h"
#include "moe/tensorboard.h"
#include "moe/tokenizer.h"
#include "trainer/train_gpu.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

// SHARE_BATCHES: validation batches behind the per-task expert load that each
// checkpoint records for --expert-budget (moe/task_experts.h).
enum { EVAL_BATCHES = 8, EVAL_SAMPLES = 20, SHARE_BATCHES = 4 };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Unix seconds of a metrics record: lines another tool can place in time.
static double wall_time(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int all_finite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

// Names the first layer whose output went non-finite in the last forward.
static void nonfinite_layer(const moe_model *m, char *buf, size_t cap) {
    size_t n = (size_t)m->cur_B * m->cur_T * m->D;
    for (int l = 0; l < m->L; l++) {
        const float *out = l + 1 < m->L ? m->a[l + 1].x : m->xf;
        if (!all_finite(m->a[l].mid, n)) {
            snprintf(buf, cap, "layer %d (attention)", l);
            return;
        }
        if (!all_finite(out, n)) {
            snprintf(buf, cap, "layer %d (%s)", l, m->is_moe[l] ? "MoE" : "FFN");
            return;
        }
    }
    snprintf(buf, cap, "the LM head");
}

static const char *nonfinite_grad(const moe_model *m) {
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        if (!all_finite(m->grads + v->offset, v->numel)) return v->name;
    }
    return "(none)";
}

// Communication of this rank in one step: all-to-all in the EP group, and
// all-reduces over the world, the expert DP group and the EP group.
typedef struct {
    long a2a_bytes, a2a_msgs, ar_bytes;
    double a2a_s, ar_s;
    long a2a_inter; // the part of a2a_bytes sent to other nodes
} comm_step;

static comm_step comm_now(const moe_parallel *p) {
    comm_step c = {0};
    const moe_comm *comms[3] = {p->world, p->edp, p->ep};
    for (int i = 0; i < 3; i++) {
        moe_comm_stats s;
        moe_comm_stats_get(comms[i], &s);
        c.a2a_bytes += s.bytes_sent, c.a2a_msgs += s.msgs_sent, c.a2a_s += s.t_alltoall;
        c.ar_bytes += s.allreduce_bytes_sent, c.ar_s += s.t_allreduce;
        c.a2a_inter += s.bytes_inter;
    }
    return c;
}

// A JSON number, or null for NaN and the infinities, which JSON cannot hold.
static void json_number(FILE *f, const char *fmt, double x) {
    if (isfinite(x))
        fprintf(f, fmt, x);
    else
        fputs("null", f);
}

// The routing of a whole step, summed over its micro-batches and the ranks
// (one integer all-reduce): per MoE layer, the pre-drop assignments per
// expert, then the dropped assignments and what the drop rate divides them by
// (assignments; tokens under expert choice, where dropped = unrouted tokens).
// Integer sums: the same for any rank count and grad_accum with the same
// global batch. Layout [n MoE layers][E_max + 2] (moe_train_routing_len).
static void add_routing(int64_t *acc, const moe_model *m, int stride) {
    for (int l = 0, i = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_plan *p = &m->a[l].moe.plan;
        int64_t *row = acc + (size_t)i++ * stride;
        moe_load_stats st;
        moe_plan_stats(p, &st);
        for (int e = 0; e < p->E && e < stride - 2; e++)
            row[e] += p->counts[e];
        row[stride - 2] += st.dropped;
        row[stride - 1] += p->expert_choice ? p->T : st.assigned;
    }
}

size_t moe_train_routing_len(const moe_config *cfg, int *stride) {
    int n_moe = 0, e_max = 0;
    for (int l = 0; l < cfg->model.n_layers; l++)
        if (moe_config_is_moe(cfg, l)) {
            n_moe++;
            if (moe_config_experts(cfg, l) > e_max) e_max = moe_config_experts(cfg, l);
        }
    *stride = e_max + 2;
    return (size_t)n_moe * (size_t)*stride;
}

static double layer_drop_rate(const int64_t *row, int stride) {
    return row[stride - 1] > 0 ? (double)row[stride - 2] / (double)row[stride - 1] : 0.0;
}

// The step's drop rate: the mean over MoE layers of each layer's rate.
static double step_drop_rate(const int64_t *acc, int n_moe, int stride) {
    double s = 0;
    for (int i = 0; i < n_moe; i++)
        s += layer_drop_rate(acc + (size_t)i * stride, stride);
    return n_moe ? s / n_moe : 0.0;
}

// Returns -1 when the stream failed (full disk): metrics that were never
// written must not look like a finished run.
static int write_metrics(FILE *f, long step, const moe_model *m, double loss, double ce, double aux,
                         double z, float lr, double gnorm, double tps, double drop, comm_step c,
                         double mfu, double sgemm, const int64_t *routing, int stride) {
    const struct {
        const char *key, *fmt;
        double x;
        bool on;
    } v[] = {
        {"time", "%.3f", wall_time(), true},
        {"loss", "%.6f", loss, true},
        {"ce", "%.6f", ce, true},
        {"aux", "%.6f", aux, true},
        {"z", "%.6f", z, true},
        {"lr", "%.6g", lr, true},
        {"grad_norm", "%.6f", gnorm, true},
        {"tokens_per_s", "%.1f", tps, true},
        {"drop_rate", "%.6f", drop, true},
        {"mfu", "%.6f", mfu, mfu >= 0},             // CPU path only
        {"sgemm_gflops", "%.3f", sgemm, sgemm > 0}, // the first record of a process
    };
    fprintf(f, "{\"step\": %ld, ", step);
    for (size_t i = 0; i < sizeof v / sizeof *v; i++)
        if (v[i].on) {
            fprintf(f, "\"%s\": ", v[i].key);
            json_number(f, v[i].fmt, v[i].x);
            fputs(", ", f);
        }
    fprintf(f, "\"layers\": [");
    int first = 1;
    for (int l = 0, i = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_plan *p = &m->a[l].moe.plan;
        const int64_t *row = routing + (size_t)i++ * stride;
        fprintf(f, "%s{\"layer\": %d, \"drop_rate\": ", first ? "" : ", ", l);
        json_number(f, "%.6f", layer_drop_rate(row, stride));
        fputs(", \"max_vio\": ", f);
        json_number(f, "%.6f", m->max_vio[l]);
        fputs(", \"load\": [", f);
        for (int e = 0; e < p->E; e++)
            fprintf(f, "%s%lld", e ? ", " : "", (long long)row[e]);
        fprintf(f, "], \"capacity\": [");
        for (int e = 0; e < p->E; e++)
            fprintf(f, "%s%d", e ? ", " : "", p->capacity[e]);
        fprintf(f, "]}");
        first = 0;
    }
    fprintf(f,
            "], \"comm\": {\"a2a_bytes\": %ld, \"a2a_msgs\": %ld, \"a2a_s\": %.6f, "
            "\"allreduce_bytes\": %ld, \"allreduce_s\": %.6f, \"a2a_inter_bytes\": %ld}}\n",
            c.a2a_bytes, c.a2a_msgs, c.a2a_s, c.ar_bytes, c.ar_s, c.a2a_inter);
    return fflush(f) != 0 || ferror(f) ? -1 : 0;
}

static int metrics_failed(const char *out_dir) {
    return moe_fail(MOE_EIO, "%s/metrics.jsonl: write failed: %s", out_dir, strerror(errno));
}

// One eval line of metrics.jsonl: per-task loss and accuracy (null where not
// scored) and each MoE layer's task x expert first-choice counts, rows in the
// order of "tasks" (the run report draws them). -1 when the stream failed.
static int write_eval(FILE *f, long step, const moe_eval_result *ev) {
    fprintf(f, "{\"eval_step\": %ld, \"time\": %.3f, \"val_loss\": ", step, wall_time());
    json_number(f, "%.6f", ev->val_loss);
    fputs(", \"tasks\": [", f);
    for (int t = 0; t < ev->n_tasks; t++) {
        json_t *name = json_string(ev->task[t]); // task names of file corpora: escaped
        char *q = name ? json_dumps(name, JSON_ENCODE_ANY) : NULL;
        fprintf(f, "%s{\"name\": %s, \"loss\": ", t ? ", " : "", q ? q : "\"?\"");
        free(q);
        json_decref(name);
        json_number(f, "%.6f", ev->task_loss[t]);
        fprintf(f, ev->accuracy[t] >= 0 ? ", \"accuracy\": %.4f}" : ", \"accuracy\": null}",
                ev->accuracy[t]);
    }
    fprintf(f, "], \"usage\": [");
    for (int i = 0; i < ev->n_moe && ev->usage; i++) {
        fprintf(f, "%s{\"layer\": %d, \"counts\": [", i ? ", " : "", ev->moe_layer[i]);
        for (int t = 0; t < ev->n_tasks; t++) {
            const long *u = ev->usage + ((size_t)i * ev->n_tasks + t) * ev->E;
            fprintf(f, "%s[", t ? ", " : "");
            for (int e = 0; e < ev->E; e++)
                fprintf(f, "%s%ld", e ? ", " : "", u[e]);
            fputc(']', f);
        }
        fprintf(f, "]}");
    }
    fprintf(f, "]}\n");
    return fflush(f) != 0 || ferror(f) ? -1 : 0;
}

// TensorBoard scalars (train.tensorboard): the figures of a step's record.
static int tb_step(moe_tb_writer *tb, long step, const double *parts, float lr, double gnorm,
                   double tps, double drop) {
    const char *tags[8] = {
        "train/loss", "train/ce",        "train/aux",          "train/z",
        "train/lr",   "train/grad_norm", "train/tokens_per_s", "train/drop_rate"};
    const float v[8] = {parts[0], parts[1], parts[2], parts[3], lr, gnorm, tps, drop};
    return moe_tb_scalars(tb, step, wall_time(), tags, v, 8);
}

// ... and of an eval record: validation loss, per-task loss and accuracy.
static int tb_eval(moe_tb_writer *tb, long step, const moe_eval_result *ev) {
    char names[1 + 2 * MOE_MAX_TASKS][MOE_NAME_MAX + 16];
    const char *tags[1 + 2 * MOE_MAX_TASKS];
    float v[1 + 2 * MOE_MAX_TASKS];
    int n = 0;
    snprintf(names[n], sizeof names[n], "eval/val_loss");
    v[n++] = (float)ev->val_loss;
    for (int t = 0; t < ev->n_tasks; t++) {
        snprintf(names[n], sizeof names[n], "eval/loss/%s", ev->task[t]);
        v[n++] = (float)ev->task_loss[t];
        if (ev->accuracy[t] < 0) continue; // not scored
        snprintf(names[n], sizeof names[n], "eval/accuracy/%s", ev->task[t]);
        v[n++] = (float)ev->accuracy[t];
    }
    for (int i = 0; i < n; i++)
        tags[i] = names[i];
    return moe_tb_scalars(tb, step, wall_time(), tags, v, n);
}

static double mean_max_vio(const moe_model *m) {
    double s = 0;
    int n = 0;
    for (int l = 0; l < m->L; l++)
        if (m->is_moe[l]) s += m->max_vio[l], n++;
    return n ? s / n : 0.0;
}

// The smoothed loss of the progress line: an EMA of the step losses with this
// factor, bias-corrected as in Adam (divided by 1 - LOSS_EMA^n) so the first
// steps show their own mean rather than a value pulled towards 0.
#define LOSS_EMA 0.9

// Columns of the terminal on stderr (80 when unknown).
static int term_cols(void) {
    struct winsize ws;
    if (ioctl(fileno(stderr), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
    return 80;
}

// On a terminal one line rewritten in place, cut to the terminal's width
// (fields dropped from the right, never wrapped); plain lines otherwise.
static void progress(bool tty, long step, long total, double loss, double ema, float lr, double tps,
                     double drop, double eta) {
    int e = (int)eta;
    if (!tty) {
        fprintf(stderr,
                "  step %ld/%ld  loss %.4f  ema %.4f  lr %.3g  %.0f tok/s  drop %.1f%%  eta %ds\n",
                step, total, loss, ema, lr, tps, 100 * drop, e);
        return;
    }
    char f[6][48];
    snprintf(f[0], sizeof f[0], "step %ld/%ld", step, total);
    snprintf(f[1], sizeof f[1], " | loss %.4f (ema %.4f)", loss, ema);
    snprintf(f[2], sizeof f[2], " | lr %.2e", lr);
    snprintf(f[3], sizeof f[3], " | %.0f tok/s", tps);
    snprintf(f[4], sizeof f[4], " | drop %.1f%%", 100 * drop);
    snprintf(f[5], sizeof f[5], " | ETA %d:%02d", e / 60, e % 60);
    char line[320];
    size_t n = 0, width = (size_t)term_cols() - 1; // the last column would wrap
    for (int i = 0; i < 6; i++) {
        size_t fl = strlen(f[i]);
        if (n + 2 + fl > width) break;
        memcpy(line + n, f[i], fl);
        n += fl;
    }
    line[n] = 0;
    if (n + 2 > width) line[width > 2 ? width - 2 : 0] = 0; // a very narrow terminal
    fprintf(stderr, "\r  %s\033[K", line);                  // \033[K clears what a longer line left
}

// Task ids are positions in data.tasks: a resume that lists the checkpoint's
// tasks in another order would give each task's tokens another task's id
// (its marker, its embedding). Other changes of the list are left to the
// shape checks of the load. Checkpoints without task_experts.json (older
// ones) record no order.
static int check_task_order(const moe_config *cfg, const char *resume) {
    char dir[PATH_MAX], path[PATH_MAX + 32];
    MOE_TRY(moe_ckpt_resolve(resume, dir, sizeof dir, NULL));
    snprintf(path, sizeof path, "%s/task_experts.json", dir);
    moe_task_experts te;
    int rc = moe_task_experts_read(path, &te);
    if (rc == MOE_ENOTFOUND) return 0;
    MOE_TRY(rc);
    char names[MOE_MAX_TASKS][MOE_NAME_MAX];
    const int n = moe_config_task_names(cfg, names);
    bool same_set = n == te.n_tasks;
    for (int t = 0; same_set && t < n; t++) {
        bool found = false;
        for (int u = 0; u < n && !found; u++)
            found = !strcmp(te.task[t], names[u]);
        same_set = found;
    }
    for (int t = 0; same_set && t < n && rc == 0; t++)
        if (strcmp(te.task[t], names[t]))
            rc = moe_fail(MOE_EINVAL,
                          "data.tasks lists the checkpoint's tasks in another order (task %d is "
                          "'%s' here, '%s' in %s): task ids are positions in the list, so a "
                          "resume keeps its order",
                          t, names[t], te.task[t], path);
    moe_task_experts_free(&te);
    return rc;
}

// The run folder's config.json. A resume writes it with its first checkpoint,
// not at the start: a resume that fails first (say, with a diverging --set)
// must not leave its settings for the next plain --resume of the run.
static int write_run_config(const moe_config *cfg, const char *out_dir) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/config.json", out_dir);
    FILE *cf = fopen(path, "w");
    int rc = cf ? moe_config_write(cfg, cf)
                : moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
    if (cf && fclose(cf) && rc == 0)
        rc = moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno));
    return rc;
}

// A record that a crash or a full disk cut off (metrics.jsonl without a final
// newline) goes before a resume appends: left there, it would glue onto the
// first new record and make that line unreadable too.
static int drop_cut_record(const char *path) {
    int fd = open(path, O_RDWR);
    if (fd < 0) return errno == ENOENT ? 0 : moe_fail(MOE_EIO, "%s: %s", path, strerror(errno));
    const off_t end = lseek(fd, 0, SEEK_END);
    off_t keep = end < 0 ? 0 : end;
    char buf[4096];
    int rc = end < 0 ? moe_fail(MOE_EIO, "%s: %s", path, strerror(errno)) : 0;
    while (rc == 0 && keep > 0) { // back to the last newline
        const size_t n = keep < (off_t)sizeof buf ? (size_t)keep : sizeof buf;
        if (pread(fd, buf, n, keep - (off_t)n) != (ssize_t)n) {
            rc = moe_fail(MOE_EIO, "%s: read failed: %s", path, strerror(errno));
            break;
        }
        size_t i = n;
        while (i > 0 && buf[i - 1] != '\n')
            i--;
        keep -= (off_t)(n - i);
        if (i > 0) break;
    }
    // A whole record that only lost its newline is kept: the newline is added.
    char *tail =
        rc == 0 && keep != end && end - keep < (1 << 20) ? malloc((size_t)(end - keep)) : NULL;
    if (tail && pread(fd, tail, (size_t)(end - keep), keep) == (ssize_t)(end - keep)) {
        json_t *rec = json_loadb(tail, (size_t)(end - keep), 0, NULL);
        if (rec && json_is_object(rec)) {
            if (pwrite(fd, "\n", 1, end) != 1)
                rc = moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno));
            keep = end;
        }
        json_decref(rec);
    }
    free(tail);
    if (rc == 0 && keep != end) {
        if (ftruncate(fd, keep) != 0)
            rc = moe_fail(MOE_EIO, "%s: cannot drop the cut-off last record: %s", path,
                          strerror(errno));
        else
            moe_log(MOE_LOG_WARN, "%s: dropped a cut-off last record (%lld bytes)", path,
                    (long long)(end - keep));
    }
    close(fd);
    return rc;
}

// The metrics.jsonl a resume appends to, checked before anything is resumed:
// a regular file (a link could be another run's file), each complete line a
// JSON object, as `moe report` reads it. A cut-off last line (no newline) is
// a crash's and drop_cut_record handles it; any other bad line was not
// written by moe train and is refused, naming it, not kept or dropped.
static int check_metrics(const char *out) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/metrics.jsonl", out) >= (int)sizeof path)
        return moe_fail(MOE_EINVAL, "%s: path too long", out);
    struct stat sb;
    if (lstat(path, &sb) != 0)
        return errno == ENOENT ? 0 : moe_fail(MOE_EIO, "%s: %s", path, strerror(errno));
    if (S_ISLNK(sb.st_mode))
        return moe_fail(MOE_EINVAL,
                        "%s: is a symbolic link; a run's metrics.jsonl is a regular file of its "
                        "own (the link may name another run's)",
                        path);
    if (!S_ISREG(sb.st_mode)) return moe_fail(MOE_EINVAL, "%s: not a regular file", path);
    FILE *f = fopen(path, "r");
    if (!f) return moe_fail(MOE_EIO, "%s: cannot open: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    long no = 0;
    int rc = 0;
    for (ssize_t n; rc == 0 && (n = getline(&line, &cap, f)) > 0;) {
        no++;
        if (line[n - 1] != '\n') break; // cut off: drop_cut_record's
        json_error_t e;
        json_t *rec = json_loadb(line, (size_t)n, 0, &e);
        if (!rec || !json_is_object(rec))
            rc = moe_fail(MOE_EINVAL,
                          "%s:%ld:%d: %s; moe train writes one JSON object a line: remove or "
                          "repair the line, then resume",
                          path, no, rec ? 1 : moe_json_column(&e),
                          rec ? "not a JSON object" : "not JSON");
        json_decref(rec);
    }
    if (rc == 0 && ferror(f)) rc = moe_fail(MOE_EIO, "%s: read failed: %s", path, strerror(errno));
    free(line);
    fclose(f);
    return rc;
}

// Records of steps after the checkpoint a resume starts from (a run that went
// on past its last save, then crashed or failed) describe training the resume
// discards and redoes: they go, as TensorBoard's purge_step drops events, so
// the file keeps one record per step. Records are appended in step order, so
// the first one past step cuts the file there.
static int drop_records_after(const char *path, long step, bool *eval_at_step) {
    FILE *f = fopen(path, "r+");
    if (!f) return errno == ENOENT ? 0 : moe_fail(MOE_EIO, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    long at = 0, cut = -1, dropped = 0;
    for (ssize_t n; (n = getline(&line, &cap, f)) > 0; at += n) {
        long s;
        const bool eval = sscanf(line, "{\"eval_step\": %ld", &s) == 1;
        if (!eval && sscanf(line, "{\"step\": %ld", &s) != 1)
            continue; // not one of ours: kept where it is
        if (eval && s == step) *eval_at_step = true;
        if (cut < 0 && s > step) cut = at;
        dropped += cut >= 0;
    }
    free(line);
    int rc = ferror(f) ? moe_fail(MOE_EIO, "%s: read failed: %s", path, strerror(errno)) : 0;
    if (rc == 0 && cut >= 0 && ftruncate(fileno(f), cut) != 0)
        rc = moe_fail(MOE_EIO, "%s: cannot drop the records after step %ld: %s", path, step,
                      strerror(errno));
    else if (rc == 0 && cut >= 0)
        moe_log(MOE_LOG_WARN,
                "%s: dropped %ld records after step %ld, the step the resume starts from (their "
                "training is redone)",
                path, dropped, step);
    fclose(f);
    return rc;
}

// A synchronous save, after the asynchronous one in flight (if any) is
// committed: the order of the checkpoints on disk is the order of the steps.
static int save_after(moe_ckpt_async *ack, const char *run, int keep, const moe_model *m,
                      const moe_adamw *opt, const moe_train_state *st, moe_parallel *par,
                      char *saved, size_t cap) {
    MOE_TRY(moe_ckpt_async_wait(ack, par));
    return moe_ckpt_save_run(run, keep, m, opt, st, par, saved, cap);
}

// Whether n bf16 values are all finite (exponent bits not all ones).
static bool bf16_finite(const uint16_t *h, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((h[i] & 0x7f80) == 0x7f80) return false;
    return true;
}

// The first tensor of the parameters or either moment with a non-finite
// value ("NAME" or "NAME.exp_avg_sq"), or NULL: a checkpoint holding one is
// refused by every reader, --resume included.
static const char *nonfinite_state(const moe_model *m, const moe_adamw *opt, char *buf,
                                   size_t cap) {
    static const char *const sfx[] = {".exp_avg", ".exp_avg_sq"};
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        bool ok = all_finite(m->params + v->offset, v->numel);
        int bad = -1;
        for (int w = 0; ok && w < 2; w++) {
            const void *x = moe_adamw_moment(opt, w);
            ok = opt->state == MOE_ADAMW_BF16
                     ? bf16_finite((const uint16_t *)x + v->offset, v->numel)
                     : all_finite((const float *)x + v->offset, v->numel);
            if (!ok) bad = w;
        }
        if (!ok) {
            snprintf(buf, cap, "%s%s", v->name, bad < 0 ? "" : sfx[bad]);
            return buf;
        }
    }
    return NULL;
}

// Before a checkpoint of this step: the state it will hold must be finite,
// and its weights must give a finite loss on the validation batches its
// task shares are measured on. An update that blew the weights up (finite
// but huge: only the next forward turns them into NaN) shows there, and its
// checkpoint is not written: the last one stays the newest. Collective.
static int check_and_measure(moe_model *m, const moe_adamw *opt, moe_data *d, moe_comm *world,
                             long step) {
    char name[MOE_PARAM_NAME_MAX + 16];
    const char *bad = nonfinite_state(m, opt, name, sizeof name);
    int64_t any = bad != NULL; // expert tensors differ by rank: every rank must know
    MOE_TRY(moe_comm_allreduce_i64(world, &any, 1));
    if (any)
        return moe_fail(MOE_ENUMERIC,
                        "step %ld: the update left a non-finite value in %s; its checkpoint is "
                        "not written",
                        step, bad ? bad : "another rank's tensors");
    int rc = moe_task_share_measure(m, d, SHARE_BATCHES);
    if (rc != MOE_ENUMERIC) return rc;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", moe_last_error());
    return moe_fail(MOE_ENUMERIC,
                    "step %ld: the weights after this step give a non-finite validation loss "
                    "(%s); its checkpoint is not written",
                    step, msg);
}

// The run's tokenizer (NULL for bytes), read once: every checkpoint copies
// these bytes, so a model.tokenizer file replaced or removed mid-run changes
// nothing saved. A resume takes the checkpoint's copy, what the run trained
// with: the file model.tokenizer names may be gone (the copy is used), but
// when it is there it must hold the same bytes.
static int open_run_tokenizer(const moe_config *cfg, const char *resume, moe_tokenizer **out) {
    *out = NULL;
    const char *spec = cfg->model.tokenizer;
    if (!strcmp(spec, "bytes")) return 0;
    moe_tokenizer *t = NULL, *user = NULL;
    if (resume) {
        moe_config ck;
        MOE_TRY(moe_ckpt_config(resume, &ck));
        if (strcmp(ck.model.tokenizer, "bytes") && strcmp(ck.model.tokenizer, spec))
            MOE_TRY(moe_ckpt_tokenizer(resume, &ck, &t));
        struct stat sb;
        if (t && stat(spec, &sb) != 0 && errno == ENOENT) {
            moe_log(MOE_LOG_INFO,
                    "model.tokenizer %s is gone: resuming with the checkpoint's copy %s", spec,
                    ck.model.tokenizer);
        } else if (t) {
            size_t a, b;
            int rc = moe_tok_open(spec, &user);
            if (rc < 0) rc = moe_fail(rc, "model.tokenizer: %s", moe_last_error());
            const void *ta = rc == 0 ? moe_tok_model_bytes(t, &a) : NULL;
            const void *ub = rc == 0 ? moe_tok_model_bytes(user, &b) : NULL;
            if (rc == 0 && (a != b || memcmp(ta, ub, a)))
                rc = moe_fail(MOE_EINVAL,
                              "model.tokenizer = %s differs from %s, the tokenizer the checkpoint "
                              "was trained with: resume with that file (or remove %s to use the "
                              "checkpoint's copy)",
                              spec, ck.model.tokenizer, spec);
            moe_tok_free(user);
            if (rc < 0) {
                moe_tok_free(t);
                return rc;
            }
        }
    }
    if (!t) {
        const int rc = moe_tok_open(spec, &t);
        if (rc < 0) return moe_fail(rc, "model.tokenizer: %s", moe_last_error());
    }
    const int V = moe_tok_vocab_size(t);
    if (cfg->model.vocab_size < V) {
        moe_tok_free(t);
        return moe_fail(MOE_EINVAL,
                        "model.tokenizer = %s has %d pieces but model.vocab_size = %d: set "
                        "model.vocab_size >= %d",
                        spec, V, cfg->model.vocab_size, V);
    }
    *out = t;
    return 0;
}

int moe_train(const moe_config *cfg_in, const moe_train_opts *o, moe_train_result *r) {
    memset(r, 0, sizeof *r);
    moe_config cfg_run = *cfg_in; // with router.n_groups = 0 resolved to the node count
    const moe_config *cfg = &cfg_run;
    moe_comm *local = NULL, *world = o->world;
    if (!world) MOE_TRY(moe_comm_local(&local));
    if (!world) world = local;
    moe_parallel par;
    moe_data d;
    moe_model m;
    moe_adamw opt;
    moe_tokenizer *tok = NULL; // the tokenizer every save copies (open_run_tokenizer)
    memset(&par, 0, sizeof par);
    memset(&d, 0, sizeof d);
    memset(&m, 0, sizeof m);
    memset(&opt, 0, sizeof opt);
    FILE *metrics = NULL;
    moe_tb_writer tb = {0};
    int32_t *in = NULL, *tg = NULL, *task = NULL;
    int64_t *routing = NULL; // the step's routing counts (add_routing)
    int stride = 0;
    const size_t routing_len = moe_train_routing_len(cfg_in, &stride);
    float *acc = NULL;   // gradient sum over micro-batches
    moe_gpu_trainer gpu; // train.device = cuda: the device copy that trains
    memset(&gpu, 0, sizeof gpu);
    const bool on_gpu = o->device_ops || !strcmp(cfg->train.device, "cuda");
    char path[PATH_MAX], ckpt[PATH_MAX];
    long saved_step = -1;       // the step of this call's last periodic save
    moe_ckpt_async *ack = NULL; // train.async_checkpoint: the periodic saves' snapshot and thread
    bool shared_fail = false;   // a failure every rank meets at the same step boundary
    // Setup: every rank checks; all agree on the first failure (lowest rank),
    // so an invalid config or file on one rank ends every rank cleanly.
    // First of all, before any collective that depends on them: every rank
    // holds the same config, run folder and data (agreed inside).
    int rc = moe_train_check_same(world, cfg, o->out_dir, o->resume_dir);
    if (rc < 0) {
        r->agreed = rc != MOE_EIO; // (an MPI failure is this rank's alone)
        goto fail;
    }
    rc = moe_config_check(cfg, NULL);
    // A run folder whose checkpoint paths are too long would fail its first
    // save, after the training it was to keep.
    if (rc == 0)
        rc = moe_run_path_check(o->out_dir, cfg->train.keep_checkpoints, (long)cfg->train.steps);
    if (rc == 0) rc = open_run_tokenizer(cfg, o->resume_dir, &tok);
    if (rc == 0) rc = moe_device_check(cfg->train.device);
    if (rc == 0) rc = moe_parallel_init(&par, world, cfg);
    if (rc == 0) rc = moe_parallel_resolve_groups(&par, &cfg_run);
    const bool lead = moe_comm_rank(world) == 0;
    if (rc == 0) rc = moe_data_open(&d, cfg);
    if (rc == 0) rc = moe_data_check_tokenizer(&d, cfg->model.tokenizer, tok);
    // Validation on training data measures nothing; a run that already did it
    // (this was once accepted) may still be resumed, with the warning.
    if (rc == 0 && d.val_in_train && !o->resume_dir)
        rc = moe_fail(MOE_EINVAL,
                      "data.val_path = '%s' names %s, which data.path = '%s' names too: "
                      "validation would be on training data; give held-out files (moe prepare "
                      "writes DIR/val_*.bin), or drop data.val_path to hold out "
                      "data.val_fraction of each file",
                      cfg->data.val_path, d.val_in_train, cfg->data.path);
    if (rc == 0 && d.val_in_train && lead)
        moe_log(MOE_LOG_WARN,
                "data.val_path names %s, which data.path names too: validation is "
                "on training data",
                d.val_in_train);
    if (rc == 0 && lead && d.unused_share > 0.25)
        moe_log(MOE_LOG_WARN,
                "%.0f%% of the training tokens are in no window of %d tokens and never trained "
                "on (windows do not cross files: each file's tail, or all of a file shorter "
                "than a window): use fewer, larger files or a smaller model.seq_len",
                100 * d.unused_share, d.T + 1);
    const long val_distinct = rc == 0 ? moe_data_val_distinct_batches(&d) : -1;
    if (lead && val_distinct >= 0 && val_distinct < EVAL_BATCHES) {
        char when[64] = "within the first batch"; // fewer windows than one batch's rows
        if (val_distinct > 0)
            snprintf(when, sizeof when, "after %ld batch%s", val_distinct,
                     val_distinct == 1 ? "" : "es");
        moe_log(MOE_LOG_WARN,
                "each evaluation reads %d batches of %d rows, but the validation windows start "
                "over %s: some count more than once (raise data.val_fraction, or give more "
                "tokens in data.val_path)",
                EVAL_BATCHES, d.B, when);
    }
    // A step fewer windows than rows trains some of them twice in one step
    // (the epochs wrap inside it): legal, but worth a word.
    long train_windows = 0;
    for (int t = 0; rc == 0 && d.kind != 0 && t < d.n_tasks; t++)
        train_windows += d.part[t][MOE_SPLIT_TRAIN].n_windows;
    const long step_rows = (long)d.B * cfg->train.grad_accum * par.size;
    if (lead && train_windows > 0 && train_windows < step_rows)
        moe_log(MOE_LOG_WARN,
                "a step reads %ld rows (train.batch_size %d x train.grad_accum %d x %d rank%s) "
                "but the training data holds %ld window%s of %d tokens: each step trains some "
                "more than once (give more tokens, or a smaller batch or model.seq_len)",
                step_rows, d.B, cfg->train.grad_accum, par.size, par.size == 1 ? "" : "s",
                train_windows,
                train_windows == 1 ? "" : "s", d.T + 1);
    if (rc == 0)
        rc = moe_model_init_ep(&m, cfg, d.B, d.T, d.n_tasks, par.ep_size > 1 ? &par.group : NULL);
    m.tokenizer = tok;
    moe_adamw_state ost = MOE_ADAMW_FP32;
    if (rc == 0) rc = moe_adamw_state_parse(cfg->train.optimizer_state, &ost);
    if (rc == 0) rc = moe_adamw_init_state(&opt, &m.table, cfg->train.decay_all, ost);
    if (rc == 0 && on_gpu && strcmp(cfg->placement.mode, "static"))
        rc = moe_fail(MOE_EINVAL, "placement.mode = %s needs the CPU training path",
                      cfg->placement.mode);
    if (rc == 0) rc = moe_parallel_placement_init(&par, &m, cfg);
    moe_train_state st = {.step = 0};
    bool eval_at_start = false; // metrics.jsonl holds an evaluation of the resumed step
    // The placement first: moved experts rename the views the load finds by name.
    if (rc == 0 && o->resume_dir) {
        rc = moe_parallel_placement_resume(&par, &m, o->resume_dir);
        if (rc == 0) rc = check_task_order(cfg, o->resume_dir);
        if (rc == 0) rc = moe_ckpt_load(o->resume_dir, &m, &opt, &st);
        // (at train.steps exactly it only finishes: a stop during the last step)
        if (rc == 0 && st.step > cfg->train.steps)
            rc = moe_fail(MOE_EINVAL, "%s is at step %ld, past train.steps = %ld: nothing to train",
                          o->resume_dir, st.step, (long)cfg->train.steps);
        // Named like the CLI's own checks of the model file, which ran before.
        if (rc < 0) moe_fail(rc, "--resume: %s", moe_last_error());
    }
    if (rc == 0 && lead && o->resume_dir) rc = check_metrics(o->out_dir);
    if (rc == 0 && cfg->train.async_checkpoint) rc = moe_ckpt_async_init(&ack, &m, &par);
    if (rc == 0 && on_gpu)
        rc = moe_gpu_trainer_init(&gpu, &m, &opt, cfg, (size_t)d.B * d.T, o->device_ops);
    rc = moe_comm_agree(world, rc);
    r->agreed = rc < 0;
    if (rc < 0) goto fail;
    if (on_gpu) { // collective: every rank got here
        rc = moe_comm_agree(world, moe_gpu_trainer_connect(&gpu, &par));
        r->agreed = rc < 0;
        if (rc < 0) goto fail;
    }
    if (o->resume_dir) {
        rc = moe_comm_agree(world, moe_parallel_placement_sync(&par, &m)); // collective
        r->agreed = rc < 0;
        if (rc < 0) goto fail;
        d.cursor[0] = st.cursor[0];
        d.cursor[1] = st.cursor[1];
        if (lead) moe_log(MOE_LOG_INFO, "resumed from %s at step %ld", o->resume_dir, st.step);
    }
    snprintf(ckpt, sizeof ckpt, "%s/checkpoint", o->out_dir); // until a save names it
    size_t nt = (size_t)d.B * d.T;
    in = moe_malloc(sizeof(int32_t) * nt);
    tg = moe_malloc(sizeof(int32_t) * nt);
    task = moe_malloc(sizeof(int32_t) * d.B);
    acc = moe_malloc(sizeof(float) * (cfg->train.grad_accum > 1 ? m.table.numel : 1));
    routing = moe_malloc(sizeof(int64_t) * (routing_len ? routing_len : 1));
    if (!in || !tg || !task || !acc || !routing)
        rc = moe_fail(MOE_ENOMEM, "training buffers: out of memory");
    // The run folder appears only once data, model and checkpoint are known
    // good: a run refused at setup leaves nothing behind.
    if (rc == 0 && lead && o->overwrite) rc = moe_run_clear(o->out_dir);
    if (rc == 0 && lead) rc = moe_make_dirs(o->out_dir);
    if (rc == 0 && lead) { // only rank 0 writes the run folder
        if (!o->resume_dir) rc = write_run_config(cfg, o->out_dir);
        snprintf(path, sizeof path, "%s/metrics.jsonl", o->out_dir);
        if (rc == 0 && o->resume_dir) rc = drop_cut_record(path);
        if (rc == 0 && o->resume_dir) rc = drop_records_after(path, st.step, &eval_at_start);
        if (rc == 0 && !(metrics = fopen(path, o->resume_dir ? "a" : "w")))
            rc = moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
        if (rc == 0 && cfg->train.tensorboard)
            rc = moe_tb_open(&tb, o->out_dir, o->resume_dir ? st.step + 1 : 0);
    }
    rc = moe_comm_agree(world, rc);
    r->agreed = rc < 0;
    if (rc < 0) goto fail;
    const long total = cfg->train.steps;
    const int accum = cfg->train.grad_accum, W = par.size;
    const size_t n = moe_model_numel(&m);
    const bool quiet = o->quiet || !lead, tty = !quiet && isatty(fileno(stderr));
    if (!quiet)
        fprintf(stderr,
                "training %zu parameters%s%s, %ld steps of %d x %d tokens x %d micro-batches x "
                "%d ranks\n",
                n, par.ep_size > 1 ? " (this rank's shard)" : "",
                on_gpu ? (gpu.ops == &moe_ops_cpu ? " (device path on the CPU)" : " on the GPU")
                       : "",
                total, d.B, d.T, accum, W);
    // MFU against this machine's sgemm rate (moe/mfu.h); the GPU path has no
    // measured rate and reports none.
    double sgemm = 0, flops_tok = on_gpu ? 0 : moe_model_flops_per_token(cfg);
    const double routed_tok = moe_model_routed_flops_per_token(cfg);
    if (!on_gpu) MOE_TRY_GOTO(moe_sgemm_rate(0, &sgemm), rc);
    double t_start = now(), tokens = 0, ema = 0;
    long steps_run = 0;
    const double tokens0 = st.tokens, seconds0 = st.seconds; // before a resume
    for (long step = st.step; step < total; step++) {
        double t0 = now(), parts[4] = {0, 0, 0, 0}; // loss, ce, aux, z
        const comm_step c0 = comm_now(&par);
        double gnorm;
        float lr = moe_lr_schedule((int)step, (int)total, cfg->train.warmup_steps,
                                   (float)cfg->train.lr, (float)cfg->train.min_lr_ratio);
        moe_model *fm = on_gpu ? &gpu.m : &m; // the model that trains (its routing statistics)
        memset(routing, 0, sizeof(int64_t) * routing_len);
        if (on_gpu) { // trainer/train_gpu.c: the same step on the device
            MOE_TRY_GOTO(moe_gpu_zero_grads(&gpu), rc);
            const double div = (double)accum * W;
            for (int a = 0; a < accum; a++) {
                uint64_t idx = d.cursor[MOE_SPLIT_TRAIN] + (uint64_t)a * W + par.rank;
                MOE_TRY_GOTO(moe_data_batch(&d, MOE_SPLIT_TRAIN, idx, in, tg, task), rc);
                rc = moe_gpu_micro_batch(&gpu, in, tg, task, d.B, d.T, (uint64_t)step);
                if (rc < 0) {
                    rc = moe_fail(rc, "step %ld: %s", step + 1, moe_last_error());
                    goto fail;
                }
                add_routing(routing, &gpu.m, stride);
                parts[0] += gpu.m.loss / div, parts[1] += gpu.m.ce / div;
                parts[2] += gpu.m.aux / div, parts[3] += gpu.m.z / div;
            }
            d.cursor[MOE_SPLIT_TRAIN] += (uint64_t)accum * W;
            MOE_TRY_GOTO(moe_gpu_allreduce_grads(&gpu), rc); // as moe_parallel_allreduce_grads
            MOE_TRY_GOTO(moe_comm_allreduce_f64(world, parts, 4), rc);
            MOE_TRY_GOTO(moe_comm_allreduce_i64(world, routing, routing_len), rc);
            int64_t gcalls = gpu.m.load_calls;
            MOE_TRY_GOTO(moe_comm_allreduce_f64(world, gpu.m.load, moe_model_load_len(&gpu.m)), rc);
            MOE_TRY_GOTO(moe_comm_allreduce_i64(world, &gcalls, 1), rc);
            gpu.m.load_calls = (long)gcalls;
            moe_model_bias_step(&gpu.m);
            moe_model_capacity_step(&gpu.m);
            // (the device copy: the host buffers the snapshot reads change only
            // at moe_gpu_trainer_sync, which waits for it)
            rc = moe_gpu_optimizer_step(&gpu, &opt, accum * W, lr, cfg, &gnorm);
            if (rc < 0) {
                rc = moe_fail(rc, "step %ld: %s", step + 1, moe_last_error());
                goto fail;
            }
            goto stepped;
        }
        if (accum > 1) memset(acc, 0, sizeof(float) * n);
        for (int a = 0; a < accum; a++) {
            // Each micro-batch's gradient starts from zero and is added to
            // the sum in order: the arithmetic of the rank-order all-reduce,
            // so one process with grad_accum = ranks gives the same bits.
            if (a > 0)
                for (size_t i = 0; i < n; i++)
                    acc[i] += m.grads[i];
            memset(m.grads, 0, sizeof(float) * n);
            // Micro-batch a of rank r is global micro-batch a*W + r of the step.
            uint64_t idx = d.cursor[MOE_SPLIT_TRAIN] + (uint64_t)a * W + par.rank;
            MOE_TRY_GOTO(moe_data_batch(&d, MOE_SPLIT_TRAIN, idx, in, tg, task), rc);
            rc = moe_model_forward(&m, in, tg, task, d.B, d.T, true, (uint64_t)step);
            if (rc < 0) {
                rc = moe_fail(rc, "step %ld: %s", step + 1, moe_last_error());
                goto fail;
            }
            if (!isfinite(m.loss)) {
                char where[64];
                nonfinite_layer(&m, where, sizeof where);
                rc = moe_fail(MOE_ENUMERIC,
                              "step %ld: loss is %g (ce %g, aux %g, z %g); first "
                              "non-finite output in %s",
                              step + 1, m.loss, m.ce, m.aux, m.z, where);
                goto fail;
            }
            MOE_TRY_GOTO(moe_model_backward(&m, in, tg, task), rc);
            MOE_TRY_GOTO(moe_parallel_placement_accumulate(&par, &m), rc); // every micro-batch
            add_routing(routing, &m, stride);
            const double div = (double)accum * W;
            parts[0] += m.loss / div, parts[1] += m.ce / div;
            parts[2] += m.aux / div, parts[3] += m.z / div;
        }
        d.cursor[MOE_SPLIT_TRAIN] += (uint64_t)accum * W;
        if (accum > 1)
            for (size_t i = 0; i < n; i++)
                m.grads[i] += acc[i];
        MOE_TRY_GOTO(moe_parallel_allreduce_grads(&par, &m), rc);
        if (accum * W > 1)
            for (size_t i = 0; i < n; i++)
                m.grads[i] /= (float)(accum * W);
        MOE_TRY_GOTO(moe_comm_allreduce_f64(world, parts, 4), rc);
        MOE_TRY_GOTO(moe_comm_allreduce_i64(world, routing, routing_len), rc);
        int64_t calls = m.load_calls;
        MOE_TRY_GOTO(moe_comm_allreduce_f64(world, m.load, moe_model_load_len(&m)), rc);
        MOE_TRY_GOTO(moe_comm_allreduce_i64(world, &calls, 1), rc);
        m.load_calls = (long)calls;
        moe_model_bias_step(&m); // the global load: every rank moves its bias alike
        MOE_TRY_GOTO(moe_parallel_placement_observe(&par, &m), rc);
        moe_model_capacity_step(&m);
        MOE_TRY_GOTO(moe_parallel_grad_norm(&par, &m, &gnorm), rc);
        if (!isfinite(gnorm)) { // the global norm: every rank stops here
            shared_fail = true;
            rc = moe_fail(MOE_ENUMERIC, "step %ld: non-finite gradient in %s", step + 1,
                          nonfinite_grad(&m));
            goto fail;
        }
        // A save begun at the last boundary copies the parameters and moments on
        // its thread while this step's forward and backward read them: the
        // update (and the placement step's migration after it) waits for the copy.
        moe_ckpt_async_wait_snapshot(ack);
        moe_adamw_update_clipped(&opt, m.params, m.grads, gnorm, cfg->train.grad_clip, lr,
                                 (float)cfg->train.beta1, (float)cfg->train.beta2, 1e-8f,
                                 (float)cfg->train.weight_decay);
        MOE_TRY_GOTO(moe_parallel_placement_step(&par, &m, &opt, step + 1), rc);
    stepped:
        st.step = step + 1;
        const double loss = parts[0];
        double dt = now() - t0, tps = (double)nt * accum * W / dt,
               drop = step_drop_rate(routing, (int)(routing_len / (size_t)stride), stride);
        tokens += (double)nt * accum * W;
        st.drop_sum += drop;
        st.vio_sum += mean_max_vio(fm);
        st.summed++;
        // Dropped assignments are not computed: count the kept ones only.
        const double done_tok = flops_tok - routed_tok * drop;
        const double mfu = sgemm > 0 ? done_tok * tps / (W * sgemm * 1e9) : -1;
        if (mfu >= 0) st.mfu_sum += mfu, st.mfu_steps++;
        steps_run++;
        ema = LOSS_EMA * ema + (1 - LOSS_EMA) * loss;
        st.tokens = tokens0 + tokens;
        st.seconds = seconds0 + (now() - t_start);
        if (o->losses) o->losses[step] = loss;
        if (steps_run == 1) r->first_loss = loss;
        r->last_loss = loss;
        comm_step c = comm_now(&par);
        c.a2a_bytes -= c0.a2a_bytes, c.a2a_msgs -= c0.a2a_msgs, c.a2a_s -= c0.a2a_s;
        c.ar_bytes -= c0.ar_bytes, c.ar_s -= c0.ar_s;
        r->a2a_bytes += c.a2a_bytes, r->a2a_msgs += c.a2a_msgs;
        c.a2a_inter -= c0.a2a_inter, r->a2a_inter_bytes += c.a2a_inter;
        if (metrics &&
            write_metrics(metrics, step + 1, fm, loss, parts[1], parts[2], parts[3], lr, gnorm, tps,
                          drop, c, mfu, steps_run == 1 ? sgemm : 0, routing, stride) < 0) {
            rc = metrics_failed(o->out_dir);
            goto fail;
        }
        if (tb.f) MOE_TRY_GOTO(tb_step(&tb, step + 1, parts, lr, gnorm, tps, drop), rc);
        double eta = (now() - t_start) / steps_run * (total - step - 1);
        if (!quiet && (tty || (step + 1) % cfg->train.log_every == 0 || step + 1 == total))
            progress(tty, step + 1, total, loss, ema / (1 - pow(LOSS_EMA, (double)steps_run)), lr,
                     tokens / (now() - t_start), drop, eta);
        if (cfg->train.eval_every > 0 && (step + 1) % cfg->train.eval_every == 0 &&
            step + 1 < total) {
            moe_eval_result ev; // every rank evaluates the same batches in step
            if (on_gpu) moe_ckpt_async_wait_snapshot(ack); // the sync overwrites the host buffers
            if (on_gpu) MOE_TRY_GOTO(moe_gpu_trainer_sync(&gpu, &m, &opt), rc); // eval on the host
            MOE_TRY_GOTO(moe_eval(&m, &d, EVAL_BATCHES, EVAL_SAMPLES, &ev), rc);
            if (metrics && write_eval(metrics, step + 1, &ev) < 0) {
                moe_eval_result_free(&ev);
                rc = metrics_failed(o->out_dir);
                goto fail;
            }
            if (tb.f && (rc = tb_eval(&tb, step + 1, &ev)) < 0) {
                moe_eval_result_free(&ev);
                goto fail;
            }
            if (tty) fputc('\n', stderr);
            if (!quiet)
                fprintf(stderr, "  eval at step %ld: val loss %.4f\n", step + 1, ev.val_loss);
            moe_eval_result_free(&ev);
        }
        // A stop request on any rank (Ctrl-C reaches them all under mpirun)
        // stops every rank after the same step.
        int64_t stop = (o->stop && *o->stop) || (o->stop_after > 0 && st.step >= o->stop_after);
        MOE_TRY_GOTO(moe_comm_allreduce_i64(world, &stop, 1), rc);
        // An asynchronous save in flight is committed at the first step
        // boundary where every rank's thread has finished writing.
        double t_ck = now();
        if (ack && (rc = moe_ckpt_async_poll(ack, &par, false)) < 0) goto fail;
        if (rc > 0)
            moe_log(MOE_LOG_DEBUG, "step %ld: async checkpoint committed in %.3f s", step + 1,
                    now() - t_ck);
        rc = 0;
        if (stop || (cfg->train.ckpt_every > 0 && (step + 1) % cfg->train.ckpt_every == 0)) {
            st.cursor[0] = d.cursor[0];
            st.cursor[1] = d.cursor[1];
            moe_ckpt_async_wait_snapshot(ack); // the sync overwrites the host buffers
            if (on_gpu) MOE_TRY_GOTO(moe_gpu_trainer_sync(&gpu, &m, &opt), rc);
            MOE_TRY_GOTO(check_and_measure(&m, &opt, &d, world, st.step), rc);
            const double t_save = now();
            if (ack && !stop) // a stop's save is the last: written before returning
                MOE_TRY_GOTO(moe_ckpt_async_begin(ack, o->out_dir, cfg->train.keep_checkpoints, &m,
                                                  &opt, &st, &par, ckpt, sizeof ckpt),
                             rc);
            else
                MOE_TRY_GOTO(save_after(ack, o->out_dir, cfg->train.keep_checkpoints, &m, &opt, &st,
                                        &par, ckpt, sizeof ckpt),
                             rc);
            saved_step = st.step;
            r->checkpoints++;
            if (lead && o->resume_dir && r->checkpoints == 1)
                MOE_TRY_GOTO(write_run_config(cfg, o->out_dir), rc);
            moe_log(MOE_LOG_DEBUG,
                    "step %ld: checkpoint %s took %.3f s on the training thread (and %.3f s "
                    "measuring the task shares)",
                    step + 1, ack && !stop ? "begin (snapshot)" : "save", now() - t_save,
                    t_save - t_ck);
        }
        if (stop) {
            r->interrupted = true;
            break;
        }
    }
    if (tty) fputc('\n', stderr);
    r->steps = st.step;
    r->steps_run = steps_run;
    r->tokens = st.tokens;
    r->seconds = st.seconds;
    r->tokens_per_s = st.seconds > 0 ? st.tokens / st.seconds : 0;
    r->steps_summed = st.summed;
    r->drop_rate = st.summed ? st.drop_sum / st.summed : 0;
    r->max_vio = st.summed ? st.vio_sum / st.summed : 0;
    r->rank_imbalance = moe_parallel_placement_imbalance(&par, &r->place_a2a_bytes);
    r->mfu = st.mfu_steps && sgemm > 0 ? st.mfu_sum / st.mfu_steps : 0;
    r->sgemm_gflops = sgemm;
    r->mem_peak = moe_mem_peak();
    if (!r->interrupted) {
        st.cursor[0] = d.cursor[0];
        st.cursor[1] = d.cursor[1];
        moe_ckpt_async_wait_snapshot(ack); // the final save (save_after waits for all of it)
        if (on_gpu) MOE_TRY_GOTO(moe_gpu_trainer_sync(&gpu, &m, &opt), rc);
        if (saved_step == st.step) { // the last step's periodic save: commit it, not again
            MOE_TRY_GOTO(moe_ckpt_async_wait(ack, &par), rc);
        } else {
            MOE_TRY_GOTO(check_and_measure(&m, &opt, &d, world, st.step), rc);
            MOE_TRY_GOTO(save_after(ack, o->out_dir, cfg->train.keep_checkpoints, &m, &opt, &st,
                                    &par, ckpt, sizeof ckpt),
                         rc);
            r->checkpoints++;
            if (lead && o->resume_dir && r->checkpoints == 1)
                MOE_TRY_GOTO(write_run_config(cfg, o->out_dir), rc);
        }
        MOE_TRY_GOTO(moe_eval(&m, &d, EVAL_BATCHES, EVAL_SAMPLES, &r->eval), rc);
        // A resume of a finished run trains nothing: its final evaluation is
        // recorded already, and the file keeps one record per step.
        const bool recorded = eval_at_start && steps_run == 0;
        if (metrics && !recorded && write_eval(metrics, st.step, &r->eval) < 0) {
            moe_eval_result_free(&r->eval);
            rc = metrics_failed(o->out_dir);
            goto fail;
        }
        if (tb.f && !recorded && (rc = tb_eval(&tb, st.step, &r->eval)) < 0) {
            moe_eval_result_free(&r->eval);
            goto fail;
        }
        if (o->report && lead) {
            char resumed[96] = ""; // the figures cover the whole run, resumes included
            if (r->steps_run < r->steps)
                snprintf(resumed, sizeof resumed, " (%ld of them after resuming%s)", r->steps_run,
                         r->steps_summed < r->steps ? "; the means cover only those" : "");
            fprintf(o->report,
                    "\ntrained %ld steps%s: %.0f tokens in %.1f s, %.0f tokens/s, mean drop rate "
                    "%.2f%%, mean MaxVio %.3f\n",
                    r->steps, resumed, r->tokens, r->seconds, r->tokens_per_s, 100 * r->drop_rate,
                    r->max_vio);
            if (r->sgemm_gflops > 0)
                fprintf(o->report,
                        "model FLOPs utilisation: mean %.3f of the sgemm rate %.1f GFLOP/s "
                        "(%.3g FLOP per token without drops)\n",
                        r->mfu, r->sgemm_gflops, flops_tok);
            if (r->rank_imbalance > 0)
                fprintf(o->report,
                        "expert placement: max/mean rows per rank %.3f, all-to-all rows %.0f "
                        "bytes per step per rank\n",
                        r->rank_imbalance, r->place_a2a_bytes);
            moe_eval_print(&r->eval, o->report);
            moe_mem_plan mp; // rank 0's buffers against the planner's prediction
            if (moe_plan_memory(cfg, W, 0, &mp) == 0)
                fprintf(o->report,
                        "\nmemory: allocation peak %.1f MiB (moe plan predicted %.1f MiB)\n",
                        r->mem_peak / 1048576.0, mp.total / 1048576.0);
            fprintf(o->report, "\ncheckpoint: %s\n", ckpt);
        }
    }
fail:
    // A failure (the non-finite abort included) changes nothing the copy reads
    // before this wait; the pending save is then completed or abandoned below.
    moe_ckpt_async_wait_snapshot(ack);
    if (rc < 0 && moe_ckpt_async_pending(ack) >= 0) {
        // A failure all ranks share (or one process) still completes the save
        // in flight, a snapshot of a good step; otherwise the ranks cannot
        // agree on it, and its incomplete folder is left for the next save's
        // recovery. The failure's message is kept either way.
        char msg[512];
        snprintf(msg, sizeof msg, "%s", moe_last_error());
        long pend = moe_ckpt_async_pending(ack);
        if (shared_fail || moe_comm_size(world) == 1) {
            if (moe_ckpt_async_wait(ack, &par) < 0)
                moe_log(MOE_LOG_WARN, "the checkpoint of step %ld was not completed: %s", pend,
                        moe_last_error());
        } else {
            moe_log(MOE_LOG_WARN,
                    "the checkpoint of step %ld was not completed (a rank failed alone); the "
                    "previous one stays the newest",
                    pend);
        }
        moe_fail(rc, "%s", msg);
    }
    moe_ckpt_async_free(ack);
    moe_gpu_trainer_free(&gpu);
    if (metrics && fclose(metrics) && rc == 0) rc = metrics_failed(o->out_dir);
    int tb_rc = moe_tb_close(&tb);
    if (rc == 0) rc = tb_rc;
    moe_mfree(in);
    moe_mfree(tg);
    moe_mfree(task);
    moe_mfree(acc);
    moe_mfree(routing);
    moe_adamw_free(&opt);
    moe_model_free(&m);
    moe_tok_free(tok);
    moe_data_close(&d);
    moe_parallel_free(&par);
    if (local) moe_comm_free(local);
    return rc;
}
