// Checkpoints: a folder with model.safetensors (Hugging Face Mixtral tensor
// names), optimizer.safetensors (AdamW moments per tensor, NAME.exp_avg and
// NAME.exp_avg_sq), config.json (the resolved
// run config), trainer_state.json (step, data cursors, dynamic-capacity
// state) and task_experts.json (each task's experts, moe/task_experts.h). Written as DIR.tmp and swapped in by rename, so a crash leaves
// either the old or the new checkpoint, never a mix.
#ifndef MOE_CHECKPOINT_H
#define MOE_CHECKPOINT_H

#include "moe/model.h"
#include "moe/optim.h"
#include "moe/parallel.h"

#include <stdint.h>

typedef struct {
    long step;          // optimizer steps completed
    uint64_t cursor[2]; // data cursors (train, val)
} moe_train_state;

// par: the process grid (NULL in a single process). Every rank calls it; the
// expert shards are gathered and rank 0 writes; all ranks return its status.
int moe_ckpt_save(const char *dir, const moe_model *m, const moe_adamw *opt,
                  const moe_train_state *st, moe_parallel *par);
// Loads parameters (every tensor must exist with the model's shape, and no
// other tensor may be present), the dynamic-capacity state, and, when opt/st
// are given, the optimizer and trainer state. A crash mid-swap is recovered by
// reading DIR.old.
int moe_ckpt_load(const char *dir, moe_model *m, moe_adamw *opt, moe_train_state *st);
// Loads DIR/config.json over the defaults.
int moe_ckpt_config(const char *dir, moe_config *cfg);

#endif
