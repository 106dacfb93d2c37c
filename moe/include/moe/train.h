// Training loop, evaluation and the report a person reads: per-task
// validation loss and exact-match accuracy, and the expert-usage matrix per
// task for each MoE layer (who learned what).
#ifndef MOE_TRAIN_H
#define MOE_TRAIN_H

#include "kernels/ops.h"
#include "moe/config.h"
#include "moe/data.h"
#include "moe/model.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>

typedef struct {
    int n_tasks;
    char task[MOE_MAX_TASKS][MOE_NAME_MAX];
    double val_loss;                 // over all scored validation tokens
    double task_loss[MOE_MAX_TASKS]; // per task
    double accuracy[MOE_MAX_TASKS];  // exact match of greedy answers; < 0: n/a
    double unigram_entropy;          // baseline: entropy of the scored targets (nats)
    int n_moe, E;                    // usage dims: [n_moe][n_tasks][E]
    int moe_layer[MOE_MAX_LAYERS];   // model layer index of each MoE layer
    long *usage;                     // first-choice counts per layer, task, expert
} moe_eval_result;

// Validation loss over n_batches fixed batches (with usage counts) and, for
// synthetic data, accuracy over n_samples prompts per task.
int moe_eval(moe_model *m, moe_data *d, int n_batches, int n_samples, moe_eval_result *r);
void moe_eval_result_free(moe_eval_result *r);
void moe_eval_print(const moe_eval_result *r, FILE *f);
// Writes the logits of validation batch 0 to path (safetensors: tokens I32
// [B, T], task_ids I32 [B], logits F32 [B, T, V]), each sequence decoded
// alone and without capacity limits, as Hugging Face Mixtral computes them.
// The rows route as inference (and an export) does: a checkpoint of expert
// choice with router.ec_fallback = token_choice goes through the inference
// engine loaded from ckpt_dir (top-k token choice); without the fallback it is
// refused (nothing to compare: inference and export refuse it too).
int moe_eval_dump_logits(moe_model *m, moe_data *d, const char *ckpt_dir, const char *path);

typedef struct {
    const char *out_dir;         // run folder: config.json, metrics.jsonl, checkpoint/
    const char *resume_dir;      // checkpoint folder to continue from, or NULL
    volatile sig_atomic_t *stop; // set by a signal handler: checkpoint and return
    FILE *report;                // summary table at the end (NULL: none)
    bool quiet;                  // no progress display
    double *losses;              // optional [train.steps]: loss of each step
    long stop_after;             // > 0: checkpoint and stop once this many steps are done
    struct moe_comm *world;      // every rank of the job; NULL: this process alone
    // Train through the device copy of the model (trainer/train_gpu.c) on this
    // op table instead of the one train.device selects: tests pass
    // &moe_ops_cpu to check the GPU training path on a machine without one.
    const moe_ops *device_ops;
    bool overwrite; // remove what an earlier run wrote into out_dir (moe_run_clear) first
} moe_train_opts;

typedef struct {
    long steps;       // optimizer steps completed
    bool interrupted; // stopped by opts->stop
    bool agreed;      // the failure was agreed by every rank (setup), not one rank's
    double first_loss, last_loss;
    long steps_run;           // of them, steps run by this call (the rest before a resume)
    double tokens, seconds;   // training tokens and time over the whole run, resumes included
    double tokens_per_s;      // tokens / seconds
    double drop_rate;         // mean over the run's steps (steps_summed of them)
    double max_vio;           // MaxVio (router/bias.c), mean over MoE layers and those steps
    long steps_summed;        // steps the means cover: all, or those after resuming a
                              // checkpoint older than the sums (moe_train_state)
    long a2a_bytes, a2a_msgs; // all-to-all payload this rank sent over the run
    size_t mem_peak;          // high-water mark of the library's allocations (moe/alloc.h)
    moe_eval_result eval;     // final evaluation (caller frees)
    long a2a_inter_bytes;     // the part of a2a_bytes sent to other nodes
    // Model FLOPs utilisation (moe/mfu.h), CPU path only (0 on the GPU path):
    // mean over the run's steps that measured it, and this call's sgemm rate.
    double mfu, sgemm_gflops;
    // placement.mode = replicate: max / mean expert-side rows per rank of the
    // EP group over the run (1: balanced), and the expert rows' all-to-all
    // bytes per step per rank (mean over ranks); 0 without it.
    double rank_imbalance, place_a2a_bytes;
    long checkpoints; // checkpoints this call wrote (a run's last step is saved once)
} moe_train_result;

int moe_train(const moe_config *cfg, const moe_train_opts *o, moe_train_result *r);

// Elements of the per-step routing counts the loop keeps and sums over ranks
// (metrics.jsonl's load and drop rates of the whole step): [MoE layers][stride],
// stride = the largest expert count + 2. In the memory plan's step buffers.
size_t moe_train_routing_len(const moe_config *cfg, int *stride);

// Every rank of world holds the same resolved config (every key), out_dir,
// resume_dir (NULL: none) and data files (names and sizes of what data.path,
// data.val_path and the task globs resolve to). Collective, safe to call with
// any differences: returns 0 on every rank, or MOE_EINVAL on every rank naming
// the first differing key with rank 0's and the lowest differing rank's value.
// moe_train calls it first; callers that run collectives of their own before
// (the CLI) call it themselves as soon as the world exists.
int moe_train_check_same(struct moe_comm *world, const moe_config *cfg, const char *out_dir,
                         const char *resume_dir);

// Checks train.device: 0 for cpu; for cuda MOE_EINVAL when built without
// CUDA, MOE_EDEVICE when no device is visible, each with the reason.
int moe_device_check(const char *device);

#endif
