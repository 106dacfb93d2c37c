// Checkpoints: a folder with model.safetensors (Hugging Face Mixtral tensor
// names), optimizer.safetensors (AdamW moments per tensor, NAME.exp_avg and
// NAME.exp_avg_sq, F32 also with train.optimizer_state = bf16), config.json
// (the resolved run config), trainer_state.json (step, data cursors,
// dynamic-capacity state), task_experts.json (each task's experts,
// moe/task_experts.h), tokenizer.model (a copy of model.tokenizer's
// SentencePiece model, when not bytes; config.json then says "tokenizer.model",
// a path relative to the folder) and manifest.json (every other file and its
// size, written last: the folder's completeness marker).
//
// With expert parallelism (ep > 1) the tensors are sharded: each rank of the
// first EP group writes model-{k}-of-{ep}.safetensors and
// optimizer-{k}-of-{ep}.safetensors (its own experts; shard 1 also the dense
// tensors), and rank 0 the two .index.json files (Hugging Face layout). One
// process and ep = 1 write the single files.
//
// Save protocol for folder DIR (the folders beside it are DIR.tmp, DIR.old and
// DIR.trash). Only rank 0 creates, renames and removes folders; shard writers
// only write their own files into DIR.tmp, on a filesystem all ranks share.
//   1. Recover from an earlier crash, oldest state first: remove DIR.trash;
//      if DIR is missing and DIR.tmp is complete, rename DIR.tmp -> DIR (it is
//      the newest complete copy), else move DIR.tmp to DIR.trash and remove
//      it; if DIR is still missing, rename DIR.old -> DIR, else move DIR.old to
//      DIR.trash and remove it. Afterwards only DIR (if any checkpoint) exists.
//   2. mkdir DIR.tmp (sharded: every rank agrees it exists); each writer
//      writes its shards (fsynced, renamed into place, DIR.tmp fsynced);
//      sharded: every rank's status is all-reduced, and rank 0 goes on only
//      if all succeeded; rank 0 writes the indices and the other files
//      (fsynced), then manifest.json last (every file and shard with its
//      size, fsynced); fsync DIR.tmp. A rank dying before the manifest leaves
//      DIR.tmp incomplete: the previous checkpoint resolves.
//   3. Swap: rename DIR -> DIR.old (if DIR exists), fsync the parent; rename
//      DIR.tmp -> DIR, fsync the parent.
//   4. Clean: rename DIR.old -> DIR.trash, remove DIR.trash (by listing it, so
//      a stray temp file of any name goes too), fsync the parent. A failure
//      here is logged, not returned: the new checkpoint is already in place,
//      and the next save's step 1 finishes the job.
// Nothing is ever deleted in place: a folder is renamed to DIR.trash (atomic)
// before its files go, so a crash mid-removal leaves only trash. At every
// instant one of DIR, a complete DIR.tmp or DIR.old holds a complete
// checkpoint, and moe_ckpt_resolve finds the newest of them.
#ifndef MOE_CHECKPOINT_H
#define MOE_CHECKPOINT_H

#include "moe/model.h"
#include "moe/optim.h"
#include "moe/parallel.h"
#include "moe/safetensors.h"
#include "moe/tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// The checkpoint's copy of its tokenizer (model.tokenizer other than bytes).
#define MOE_CKPT_TOKENIZER "tokenizer.model"

typedef struct {
    long step;          // optimizer steps completed
    uint64_t cursor[2]; // data cursors (train, val)
    double tokens;      // training tokens over the whole run (resumes included)
    double seconds;     // training time over the whole run (resumes included)
    // Per-step figures summed over the run (resumes included), for its means:
    // drop rate and MaxVio over `summed` steps, MFU over the `mfu_steps` that
    // measured it (a checkpoint older than these sums: 0, the means then
    // cover the steps after the resume).
    double drop_sum, vio_sum, mfu_sum;
    long summed, mfu_steps;
} moe_train_state;

// How a checkpoint folder stores its tensors.
typedef enum {
    MOE_CKPT_SINGLE = 0, // model.safetensors
    MOE_CKPT_SHARDED,    // model.safetensors.index.json and the shards it names
} moe_ckpt_layout;

// The one resolver every reader (train --resume, eval, generate, export) goes
// through. Picks the folder to read for checkpoint dir: dir itself if it
// exists (only complete folders are ever renamed to it), else dir.tmp if its
// manifest says it is complete (a crash between the two renames of the swap),
// else dir.old (a crash during the swap, also of the old protocol). Writes
// that folder's path into out (out_size bytes) and, when layout is not NULL,
// its tensor layout. A folder holding both model.safetensors and
// model.safetensors.index.json is refused (MOE_EFORMAT): the writer never makes
// both, so one of them is stale and no rule could tell which; reading either
// silently is how eval and generate came to see different weights.
// Errors: MOE_ENOTFOUND (no checkpoint folder, or neither tensor file),
// MOE_EFORMAT (both layouts), MOE_EINVAL (path too long).
int moe_ckpt_resolve(const char *dir, char *out, size_t out_size, moe_ckpt_layout *layout);
// 1 when folder holds a manifest.json whose files all exist with the sizes it
// lists, else 0.
int moe_ckpt_complete(const char *folder);
// A reader's open of checkpoint dir, safe against a training run that saves
// meanwhile: resolves dir, calls read(folder, ctx) on the folder found, and
// when read fails and that folder is gone or another one (a save renamed or
// removed it: train.keep_checkpoints = 0 swaps checkpoint/, a rotation
// removes checkpoint-STEP/), resolves again and retries, a few times. So a
// reader sees the old checkpoint or the new one. moe_ckpt_config and
// moe_ckpt_load read through it.
int moe_ckpt_read_retry(const char *dir, int (*read)(const char *folder, void *ctx), void *ctx);
// Every reader's check of a resolved folder (moe_ckpt_config and
// moe_st_set_open call it): when folder holds a manifest.json, every file it
// lists must exist with the listed size, else MOE_EFORMAT naming the file and
// both sizes (a tokenizer.model, task_experts.json or config.json replaced
// after the save is as wrong as a replaced shard). No manifest: 0 (a folder
// assembled by hand, or written before manifests existed).
int moe_ckpt_check_sizes(const char *folder);

// par: the process grid (NULL in a single process). Every rank calls it; with
// ep > 1 each rank of the first EP group writes its shards (no rank holds
// another's experts), else rank 0 writes; all ranks return the first failure.
// Follows the protocol above; every file-system call goes through moe/fsio.h.
int moe_ckpt_save(const char *dir, const moe_model *m, const moe_adamw *opt,
                  const moe_train_state *st, moe_parallel *par);
// 1 when rank `rank` writes tensor files in a save with expert-parallel
// groups of ep: each rank of the first EP group, or rank 0 alone (ep = 1).
int moe_ckpt_writes_tensors(int rank, int ep);

// Asynchronous save (train.async_checkpoint): the writes of a save run on a
// background thread from a snapshot, and training goes on.
//   begin (collective, at a step boundary): waits for the save in flight, if
//     any (at most one); copies the small state (the selection biases; rank 0
//     renders its small files: config, trainer state, task experts, indices)
//     and rank 0 does step 1 of the protocol (recover, mkdir DIR.tmp). Then a
//     thread copies what this rank writes (its parameters and both AdamW
//     moments) into the snapshot, allocated once by init on the ranks that
//     write tensors (moe plan counts it), and writes this rank's files into
//     DIR.tmp and fsyncs them: pure file I/O, no MPI call (MPI may lack thread
//     support).
//   wait_snapshot: blocks until the thread's copy is done. The caller must
//     call it after begin and before anything changes the parameters or the
//     moments (the optimizer update, expert migration, a reload, copying a
//     device model back to the host); reading them (forward, backward) may
//     overlap the copy. Returns 1 on its first call after a begin, else 0
//     (cheap: a flag). NULL ok.
//   poll (collective, every step boundary while a save is pending): the
//     ranks' "my thread is done" flags are summed (one small all-reduce);
//     once all are done, the commit runs on the calling thread: the statuses
//     are agreed, rank 0 writes the manifest, swaps the folder into place and
//     updates `latest` and the rotation, exactly as moe_ckpt_save_run. A
//     thread's failure is returned there with its message (naming the file).
//     wait = true blocks until this rank's thread is done. Returns 1 when a
//     save was committed, 0 when none is pending or a rank still writes.
//   wait: poll with wait = true; before a synchronous save, at the end of
//     training, and before exit on a failure every rank shares.
// Crash safety is the protocol's: until the commit DIR.tmp has no manifest,
// so a crash leaves the previous checkpoint as the one that resolves. The
// files are those moe_ckpt_save_run writes, byte for byte.
typedef struct moe_ckpt_async moe_ckpt_async;
int moe_ckpt_async_init(moe_ckpt_async **out, const moe_model *m, const moe_parallel *par);
int moe_ckpt_async_begin(moe_ckpt_async *a, const char *run, int keep, const moe_model *m,
                         const moe_adamw *opt, const moe_train_state *st, moe_parallel *par,
                         char *saved, size_t cap);
int moe_ckpt_async_poll(moe_ckpt_async *a, moe_parallel *par, bool wait);
int moe_ckpt_async_wait(moe_ckpt_async *a, moe_parallel *par);
int moe_ckpt_async_wait_snapshot(moe_ckpt_async *a);
// The step of the save in flight, else -1.
long moe_ckpt_async_pending(const moe_ckpt_async *a);
// Joins the thread of a save in flight without committing it (its DIR.tmp
// stays incomplete: the next save's recovery removes it), then frees. NULL ok.
void moe_ckpt_async_free(moe_ckpt_async *a);

// Loads parameters (every tensor must exist with the model's shape, and no
// other tensor may be present), the dynamic-capacity state, and, when opt/st
// are given, the optimizer and trainer state, from the folder moe_ckpt_resolve
// picks. Every field of trainer_state.json is checked (type and range) and a
// bad one is refused naming the file and the field.
int moe_ckpt_load(const char *dir, moe_model *m, moe_adamw *opt, moe_train_state *st);
// The selection bias of MoE layer l (auxiliary-loss-free balancing,
// router.bias_update_rate): F32 [E] in model.safetensors, named after
// transformers' DeepseekV3 mlp.gate.e_score_correction_bias. Written while the
// model routes with a bias; optional on reading (absent: zeros).
#define MOE_CKPT_BIAS_FMT "model.layers.%d.block_sparse_moe.gate.e_score_correction_bias"
// The layer of a bias tensor name (exactly MOE_CKPT_BIAS_FMT), else -1.
int moe_ckpt_bias_layer(const char *name);
// Reads layer l's bias from set s into out [E] when the tensor is present
// (*found = true), checked F32 [E] and finite; what names the set in messages.
// Absent: out untouched, *found = false.
int moe_ckpt_bias_read(const moe_st_set *s, const char *what, int l, int E, float *out,
                       bool *found);

// Loads config.json of the resolved folder over the defaults. A relative
// model.tokenizer is resolved against that folder (its tokenizer.model).
int moe_ckpt_config(const char *dir, moe_config *cfg);
// The tokenizer of checkpoint dir whose config is cfg (from moe_ckpt_config):
// *out = NULL for bytes, else the opened SentencePiece model, refused
// (MOE_EFORMAT, both numbers) when it has more pieces than model.vocab_size:
// ids beyond the model's rows would index past the embedding. Every reader
// that decodes or exports text takes it from here (generate, export).
int moe_ckpt_tokenizer(const char *dir, const moe_config *cfg, moe_tokenizer **out);

// Run folders (trainer/run_dir.c). A run folder RUN holds config.json,
// metrics.jsonl and its checkpoints: RUN/checkpoint/ (train.keep_checkpoints =
// 0), or RUN/checkpoint-STEP/ folders and the file RUN/latest, one line naming
// the newest of them. moe_ckpt_resolve given RUN reads the checkpoint `latest`
// names (else the highest-numbered checkpoint-STEP, else RUN/checkpoint), so
// every reader takes a run folder as well as a checkpoint folder.
//
// Save with rotation (keep > 0), crash-safe at every counted call:
//   1. save RUN/checkpoint-STEP by the protocol above;
//   2. write RUN/latest.tmp (fsynced), rename it to RUN/latest, fsync RUN;
//   3. remove, each renamed to NAME.trash first, every checkpoint-S folder
//      beyond the keep newest and every leftover of a failed save (S.tmp,
//      S.old, S.trash of any S): `latest` names checkpoint-STEP, kept, so a
//      crash at any point leaves a complete checkpoint that `latest` names.
//      A failure in step 3 is logged, not returned (the new checkpoint is in
//      place; the next save's step 3 finishes the job).
// keep = 0 saves RUN/checkpoint alone, then removes `latest` and the
// checkpoint-STEP folders an earlier setting of the run left (all older). saved (cap bytes)
// receives the folder written.
int moe_ckpt_save_run(const char *run, int keep, const moe_model *m, const moe_adamw *opt,
                      const moe_train_state *st, moe_parallel *par, char *saved, size_t cap);
// "checkpoint-STEP", optionally followed by .tmp, .old or .trash (*suffix:
// MOE_CKPT_NAME_PLAIN, _TMP, _OLD, _TRASH): 1 with *step and *suffix set, else 0.
enum { MOE_CKPT_NAME_PLAIN, MOE_CKPT_NAME_TMP, MOE_CKPT_NAME_OLD, MOE_CKPT_NAME_TRASH };
int moe_ckpt_step_name(const char *name, long *step, int *suffix);
// 1 when folder RUN holds a run: a non-empty metrics.jsonl, a checkpoint, checkpoint-STEP
// or latest (or the leftovers of a save of one of them), else 0.
int moe_run_exists(const char *run);
// MOE_EINVAL, naming RUN, when a run into RUN with train.keep_checkpoints =
// keep and train.steps = steps would write a path longer than PATH_MAX allows
// (its longest: a checkpoint's temp files): checked before training, as a save
// would fail only after it.
int moe_run_path_check(const char *run, int keep, long steps);
// Removes what a run wrote into RUN (metrics.jsonl, config.json, checkpoint*,
// latest*, its TensorBoard event files), for train --overwrite; other files
// are left alone. A config.json moe train did not write (moe_run_foreign_config),
// a folder where a run writes a file (metrics.jsonl/) or a file where it
// writes a folder (checkpoint) is refused (MOE_EINVAL) before anything is removed.
int moe_run_clear(const char *run);
// 1 when RUN holds a config.json but nothing else moe train writes (no
// metrics.jsonl, checkpoint or latest): another tool's file (a `moe export --hf`
// folder), which a run must not replace.
int moe_run_foreign_config(const char *run);
// The exclusive lock of a run folder, held by the one process writing it for
// the whole run: two `moe train` with one --out would delete each other's
// checkpoint.tmp and interleave metrics.jsonl. moe_run_lock creates RUN (and
// its missing parents) and flocks the folder itself, so no file is added; a
// folder another process holds is refused (MOE_EINVAL, naming it). Released
// at exit at the latest; moe_run_unlock with remove_created also removes the
// folders it created while they are still empty (a run refused at setup
// leaves nothing behind).
typedef struct {
    int fd;                        // -1: not held
    char run[4096], created[4096]; // created: the topmost folder moe_run_lock made ("" none)
} moe_run_lock_t;
int moe_run_lock(const char *run, moe_run_lock_t *lk);
void moe_run_unlock(moe_run_lock_t *lk, bool remove_created);

#endif
