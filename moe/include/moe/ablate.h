// Ablation grids (moe ablate): every combination of the grid's values is
// trained with the same base config and seed; results.csv and a sorted
// results.md land in the output folder.
#ifndef MOE_ABLATE_H
#define MOE_ABLATE_H

#include "moe/config.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>

#define MOE_GRID_MAX_AXES 8
#define MOE_GRID_MAX_VALUES 16
#define MOE_GRID_MAX_RUNS 4096

typedef struct {
    char key[128];
    int n;
    char values[MOE_GRID_MAX_VALUES][64];
} moe_grid_axis;

// The grid key whose values are config files: each run loads its file over
// the base config (a grid over router families, each a whole configs/ entry).
#define MOE_GRID_CONFIG "config"

// One run of a grid as the tables show it: its value of each axis, whether it
// trained (ok) and its final figures, or why it failed.
typedef struct {
    int idx[MOE_GRID_MAX_AXES]; // value index per axis
    int ok;                     // 1: trained (its loss may still be NaN or Inf)
    char error[256];            // why it failed, or where it stopped (the tables escape it)
    double val_loss, tokens_per_s, drop_rate, max_vio, seconds;
    int rc; // the run's status (0: trained)
    int n_tasks;
    char task[MOE_MAX_TASKS][MOE_NAME_MAX];
    double accuracy[MOE_MAX_TASKS]; // < 0: no figure for the task
    int stopped;                    // 1: a signal stopped it (ok = 0; --resume continues it)
    long steps, total_steps;        // optimizer steps done, of train.steps
    long steps_run;                 // of them, steps whose drop rate and MaxVio the row holds
} moe_ablate_row;

// How moe_ablate_run runs a grid.
typedef struct {
    const char *out;         // the grid's folder: run_NNN, results.*, report.html, ablate.json
    const char *config_path; // the file base was loaded from (NULL: none): errors name its lines
    const char *const *sets; // --set assignments already in base, applied again after a
    int n_sets;              // `config` axis file
    bool overwrite;          // remove an earlier ablation's files in out first
    bool resume;             // continue the grid whose ablate.json out holds
    volatile sig_atomic_t *stop; // set by a signal handler: the current run saves and stops
    FILE *log;                   // progress lines (NULL: none)
    bool interrupted;            // set by the call: a stop ended the grid early
} moe_ablate_opts;

// Parses "key=v1,v2,..." (commas inside [...] belong to the value).
int moe_grid_axis_parse(moe_grid_axis *ax, const char *spec);
// Runs the grid into out/run_NNN; a failing run is recorded, not fatal (the
// call then returns a runtime code: MOE_ENUMERIC, or MOE_EIO / MOE_ENOMEM when
// the first failed run's was). Bad grid keys or values, a key given twice,
// and an out holding an earlier ablation (results.csv, results.md,
// report.html or run_NNN folders) fail with MOE_EINVAL before any training.
// sets: the --set assignments already in base, applied again after a `config`
// axis file. Progress lines go to log.
int moe_ablate(const moe_config *base, const moe_grid_axis *axes, int n_axes,
               const char *const *sets, int n_sets, const char *out, FILE *log);
// Writes out/results.csv (rows in run order) and out/results.md (finite losses
// ascending, then runs with a NaN or Inf loss, status "nan", then failed runs).
// Task columns are the union of the rows' tasks, first seen first; a row
// without a figure for a task leaves the cell empty (CSV) or n/a (md).
int moe_ablate_write_results(const char *out, const moe_grid_axis *axes, int n_axes,
                             const moe_ablate_row *rows, int n);
// The whole grid as moe ablate runs it. Every cell's config is checked first
// (as moe train checks its config, one process: parallel.ep = 1); a bad one
// fails with MOE_EINVAL naming the --grid key and the cell. out/ablate.json
// records the grid and each finished run's figures after every run. A stop
// (*o->stop set) checkpoints the current run, writes the tables of the runs
// so far (that one "stopped"), sets o->interrupted and returns 0. With
// o->resume the finished runs of out/ablate.json are kept, a stopped or
// unfinished run resumes from its checkpoint (or restarts without one) and
// the rest run; a grid or run config that differs from the folder's is
// refused (MOE_EINVAL naming the difference).
int moe_ablate_run(const moe_config *base, const moe_grid_axis *axes, int n_axes,
                   moe_ablate_opts *o);
// moe_ablate after removing what an earlier ablation wrote into out (its
// tables, report.html, and in each run_NNN what moe train writes): --overwrite.
int moe_ablate_overwrite(const moe_config *base, const moe_grid_axis *axes, int n_axes,
                         const char *const *sets, int n_sets, const char *out, FILE *log);

#endif
