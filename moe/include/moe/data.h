// Training data: the built-in synthetic multi-task corpus (zero setup), llm.c
// shards and nanoGPT .bin files (memory-mapped, by glob), raw UTF-8 text with
// the byte tokenizer, and one such corpus per task. Batches are a pure function
// of (seed, split, cursor), so resuming needs only the cursor.
#ifndef MOE_DATA_H
#define MOE_DATA_H

#include "moe/config.h"

#include <stdbool.h>
#include <stdint.h>

enum { MOE_SPLIT_TRAIN = 0, MOE_SPLIT_VAL = 1 };

// Synthetic samples: [marker(task)] input '=' answer '\n'. The marker of task
// i is byte 128 + i; inputs and answers are ASCII.
#define MOE_SYNTH_MARKER 128
#define MOE_SYNTH_MAX_SAMPLE 40

typedef struct {
    int task;
    int n_prompt, n_answer; // prompt = marker + input + '='; answer ends with '\n'
    int32_t tok[MOE_SYNTH_MAX_SAMPLE];
} moe_sample;

// The windows of one (task, split): pieces of token files, each holding
// n_windows windows of T+1 tokens at stride T from its first token.
typedef struct {
    int file;   // index into moe_data.files
    long start; // first token of the piece in that file
    long n_windows;
} moe_data_seg;

typedef struct {
    moe_data_seg *seg;
    long *cum; // [n_seg + 1]: windows before each piece
    int n_seg;
    long n_windows;
    long n_tokens;  // of the pieces given to this part, whole windows or not
    int n_pieces;   // pieces given (one per file), whole windows or not
    long max_piece; // tokens of the largest piece given
    long n_used;    // tokens inside at least one window
} moe_data_part;

struct moe_token_file;

typedef struct {
    int kind; // 0 synthetic, 1 token files (llmc, nanogpt), 2 text
    int B, T, V;
    int n_tasks;
    int task_fn[MOE_MAX_TASKS]; // generator index of each configured task
    char task_names[MOE_MAX_TASKS][MOE_NAME_MAX];
    double val_fraction;
    uint64_t seed;
    bool shuffle;                         // file windows in a seeded order per epoch
    struct moe_token_file *files;         // every file, memory-mapped
    int n_files;                          // (moe/shards.h)
    moe_data_part part[MOE_MAX_TASKS][2]; // windows of each task and split
    double task_cdf[MOE_MAX_TASKS];       // training rows: cumulative task probabilities
    long n_tokens, n_train;               // tokens in all files, in the training pieces
    uint64_t cursor[2];                   // batches drawn per split
    // Training rows before memo_row drew each task memo_count[t] times: row r's
    // place in its task's window order (a cache: a pure function of the seed).
    uint64_t memo_row, memo_count[MOE_MAX_TASKS];
    // Share of the training tokens in no window: windows do not cross files,
    // so each file's tail after its last whole window (or all of a file
    // shorter than one window) is never trained on. 0 for synthetic data.
    double unused_share;
    // A data.val_path file that data.path names too (NULL: none): validation
    // on training data (moe_train refuses it for a new run).
    const char *val_in_train;
} moe_data;

// Known synthetic task names ("copy", "reverse", "sort", "add", "caesar").
int moe_synth_task_index(const char *name);

int moe_data_open(moe_data *d, const moe_config *cfg);
// The validation split alone (moe eval): with data.val_path the training
// files (data.path) are not opened, so they need not exist; the training
// split is then empty and must not be drawn from.
int moe_data_open_val(moe_data *d, const moe_config *cfg);
void moe_data_close(moe_data *d);

// Token files `moe prepare` wrote (a manifest.json of "format": "llm.c"
// beside them) must come from the model's tokenizer: tok, opened from spec
// (model.tokenizer; tok NULL: bytes). A manifest whose vocab_size differs,
// or whose tokenizer_hash differs from moe_tok_hash(tok) (when both have
// one), or bytes against a model file, is refused (MOE_EINVAL) naming the
// folder, the manifest's tokenizer and spec. Folders without one pass.
struct moe_tokenizer;
int moe_data_check_tokenizer(const moe_data *d, const char *spec, const struct moe_tokenizer *tok);

// Next batch of `split`: inputs/targets [B, T] (target -1: not scored), task
// [B] (0 for a single file corpus). Advances that split's cursor.
// File data: row r of a split is a window of T+1 tokens. Training rows draw
// their task with data.task_sampling (a hash of seed and row), then take the
// task's next window in its order: a seeded permutation of all its windows,
// a new one each epoch (sampling without replacement), or file order with
// data.shuffle = false. Validation rows take the tasks in turn.
int moe_data_next(moe_data *d, int split, int32_t *inputs, int32_t *targets, int32_t *task);
// The batch at `index` without touching the cursor (eval uses fixed batches).
int moe_data_batch(moe_data *d, int split, uint64_t index, int32_t *inputs, int32_t *targets,
                   int32_t *task);

// Validation batches (from batch 0) before a window repeats: file data holds
// finitely many validation windows, and rows past them start over (taking
// the tasks in turn, a task runs out at its own count). -1: synthetic data,
// which never repeats.
long moe_data_val_distinct_batches(const moe_data *d);

// Deterministic sample number `index` of task `task` in `split`.
void moe_synth_sample(const moe_data *d, int split, int task, uint64_t index, moe_sample *s);

#endif
