// Training data: the built-in synthetic multi-task corpus (zero setup), llm.c
// token files (.bin) and raw UTF-8 text with the byte tokenizer. Batches are a
// pure function of (seed, split, cursor), so resuming needs only the cursor.
#ifndef MOE_DATA_H
#define MOE_DATA_H

#include "moe/config.h"

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

typedef struct {
    int kind; // 0 synthetic, 1 bin, 2 text
    int B, T, V;
    int n_tasks;
    int task_fn[MOE_MAX_TASKS]; // generator index of each configured task
    char task_names[MOE_MAX_TASKS][MOE_NAME_MAX];
    double val_fraction;
    uint64_t seed;
    int32_t *tokens;        // bin/text: all tokens
    long n_tokens, n_train; // tokens [0, n_train) train, [n_train, n_tokens) val
    uint64_t cursor[2];     // batches drawn per split
} moe_data;

// Known synthetic task names ("copy", "reverse", "sort", "add", "caesar").
int moe_synth_task_index(const char *name);

int moe_data_open(moe_data *d, const moe_config *cfg);
void moe_data_close(moe_data *d);

// Next batch of `split`: inputs/targets [B, T] (target -1: not scored), task
// [B] (0 for bin/text). Advances that split's cursor.
int moe_data_next(moe_data *d, int split, int32_t *inputs, int32_t *targets, int32_t *task);
// The batch at `index` without touching the cursor (eval uses fixed batches).
int moe_data_batch(moe_data *d, int split, uint64_t index, int32_t *inputs, int32_t *targets,
                   int32_t *task);

// Deterministic sample number `index` of task `task` in `split`.
void moe_synth_sample(const moe_data *d, int split, int task, uint64_t index, moe_sample *s);

#endif
