// Run reports (moe report): a run folder's metrics.jsonl read into named
// series, written as one self-contained HTML page of SVG charts, as CSV files,
// and as a page comparing the runs of an ablation grid.
#ifndef MOE_REPORT_H
#define MOE_REPORT_H

#include "moe/config.h"

#include <stdbool.h>
#include <stddef.h>

// One series over steps: rows of ncol numbers (NAN where a value was null).
// Names: a train record's top-level number KEY is "KEY" ("loss", "lr"); a
// number inside a top-level object OBJ is "OBJ.KEY" ("comm.a2a_bytes"); a
// field of a MoE layer entry is "layerL.KEY" ("layer0.load", one column per
// expert); an eval record's numbers are "eval.KEY", its per-task figures
// "eval.task_loss" and "eval.accuracy" (one column per task). Fields nobody
// knows yet (a new per-layer statistic) become series the same way.
typedef struct {
    char name[96];
    int ncol;
    char (*col)[MOE_NAME_MAX]; // [ncol] column names: e0.. or the task names
    long n, cap;
    double *step; // [n] ascending
    double *v;    // [n, ncol]
    bool used;    // set by the HTML writer once drawn (the rest go to "other series")
} moe_series;

// Task x expert first-choice counts of one MoE layer at the last evaluation.
typedef struct {
    int layer, E;
    double *counts; // [n_tasks, E]
} moe_usage;

typedef struct {
    moe_series *s;
    int n, cap;
    int hint; // next series to try: records repeat their key order
    int n_tasks;
    char task[MOE_MAX_TASKS][MOE_NAME_MAX];
    int n_usage;
    long usage_step;
    moe_usage usage[MOE_MAX_LAYERS];
    // The resolved config (RUN/config.json) flattened to "section.key" = value.
    int n_cfg;
    char **cfg_key, **cfg_val;
    long n_train, n_eval; // records read
    char warning[512];    // non-empty: a truncated last line was skipped
    // Values skipped because they are no number, null or list of them (a
    // string where a number belongs), and records skipped because they have
    // neither "step" nor "eval_step": the first one named with its line, and
    // how many in all (empty / 0 when none).
    char bad_values[512], no_step[512];
    long n_bad_values, n_no_step;
    // Records dropped because a resumed run logged their steps again, and the
    // line where that first happened (empty / 0 when none).
    char superseded[512];
    long n_superseded;
    double *rec_step[2]; // internal: steps of the train [0] and eval [1] records kept
    long rec_n[2], rec_cap[2];
} moe_run_metrics;

// Reads run_dir/metrics.jsonl and run_dir/config.json (optional). A malformed
// line fails naming the file and line; a last line cut short (no newline: the
// run was killed mid-write) is skipped and described in m->warning. A null
// where a number belongs (the writer's non-finite value) is a missing value:
// NAN in the series. Values of another type and records without a step are
// skipped and described in m->bad_values and m->no_step. A step logged again
// (a resumed run) replaces the rows from that step on (m->superseded).
int moe_metrics_read(const char *run_dir, moe_run_metrics *m);
void moe_metrics_free(moe_run_metrics *m);
// The series called name, or NULL.
moe_series *moe_metrics_find(const moe_run_metrics *m, const char *name);

// Points per line at most; longer series are drawn as means of equal buckets
// (the chart's caption says so). Heatmaps keep at most MOE_REPORT_MAX_COLUMNS
// (buckets of steps) and MOE_REPORT_MAX_ROWS (ranges of experts) likewise.
enum { MOE_REPORT_MAX_POINTS = 1000, MOE_REPORT_MAX_COLUMNS = 120, MOE_REPORT_MAX_ROWS = 128 };

// One HTML page (inline SVG and CSS, nothing fetched) for the run read into m,
// written all or nothing (a failed write leaves an earlier page whole). An
// existing path that is not a page written by moe report (the run's
// metrics.jsonl, a checkpoint, a folder) is refused with MOE_EINVAL.
int moe_report_html(moe_run_metrics *m, const char *run_dir, const char *path);
// One CSV per series into dir (created if missing): NAME.csv with every
// character other than [A-Za-z0-9_-] as '_', a header row, the step in the
// first column; and layerL_task_experts.csv per layer (one row per task). A
// name already taken gets _2, _3, ...; note (may be NULL) then lists the
// series so renamed. Numbers are written so that they read back exactly.
// Every file is written all or nothing (an earlier one stays whole when a
// write fails), and an existing file that is not a CSV of ours is refused.
// *n_files gets the count written.
// The checks moe_report_csv makes before writing, alone: dir is a folder or
// absent, and no CSV it would write would replace a file that is not a CSV of
// ours. moe report runs it before writing the page, so a refusal writes
// nothing at all.
int moe_report_csv_check(const moe_run_metrics *m, const char *dir);
int moe_report_csv(const moe_run_metrics *m, const char *dir, int *n_files, char *note,
                   size_t note_cap);
// 1 when one of the CSVs moe_report_csv would write into dir is the file
// page (the HTML page's path; the same file by its resolved folder, or by
// device and inode when both exist), with that CSV's name (no ".csv") in
// series; 0 when none is; MOE_ENOMEM. moe report refuses the pair up front:
// the page would be written and then refused as "not a CSV of ours".
int moe_report_csv_collision(const moe_run_metrics *m, const char *dir, const char *page,
                             char *series, size_t cap);

// Runs of a grid for the comparison page: each run folder's metrics are read
// here; a run that failed (error non-empty) or left no readable metrics gets
// its row without curves.
typedef struct {
    const char *dir;
    const char *name;  // short, for legends ("run_003")
    const char *label; // what differs ("router.top_k=2 train.lr=0.01")
    const char *error; // "" when the run finished
    // Training tokens / training seconds of the whole run, as results.csv has
    // it; 0: the mean of the steps' tokens_per_s in its metrics instead.
    double tokens_per_s;
} moe_report_run;
// Loss curves of every run overlaid and a table of final figures per run.
int moe_report_compare_html(const char *path, const char *title, const moe_report_run *runs, int n);

#endif
