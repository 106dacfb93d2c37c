// The two halves of moe_ckpt_save_run around the save itself (trainer/run_dir.c),
// shared with the asynchronous save (trainer/checkpoint.c), which commits the
// folder steps later; not part of the public API.
#ifndef MOE_CHECKPOINT_INTERNAL_H
#define MOE_CHECKPOINT_INTERNAL_H

#include "moe/parallel.h"

#include <jansson.h>
#include <limits.h>
#include <stddef.h>

// Folders already renamed to their trash names (so no reader resolves them),
// whose removal an asynchronous save leaves to a background thread.
typedef struct {
    char (*path)[PATH_MAX];
    int n, cap;
} moe_ckpt_trash;

// Adds p; on MOE_ENOMEM the caller removes p itself.
int moe_ckpt_trash_add(moe_ckpt_trash *t, const char *p);
// Removes every folder of t (pure file I/O: any thread) and empties it; the
// first failure is returned, the others are still tried.
int moe_ckpt_trash_empty(moe_ckpt_trash *t);
void moe_ckpt_trash_free(moe_ckpt_trash *t);

// The folder a save of step into run writes (RUN/checkpoint-STEP with keep >
// 0, else RUN/checkpoint), into saved (cap bytes).
int moe_ckpt_run_folder(const char *run, int keep, long step, char *saved, size_t cap);
// MOE_EINVAL when a save of checkpoint folder dir would write a path longer
// than PATH_MAX allows (checked again by every save).
int moe_ckpt_path_check(const char *dir);
// Rank 0, once the folder of step is in place: `latest` and the rotation
// (steps 2-3 of the save with rotation in moe/checkpoint.h). later NULL: the
// pruned folders are removed now; else they are only renamed to their trash
// names (and fsynced) and added to later, for the caller to remove.
int moe_ckpt_run_finish(const char *run, int keep, long step, moe_ckpt_trash *later);

// Tests only: called by moe_ckpt_read_retry between resolving a folder and
// reading it (a save can replace the folder there); NULL in normal use.
extern void (*moe_ckpt_resolved_hook)(const char *folder);

// The placement state (trainer/placement.c) for trainer_state.json's
// "placement": *out NULL without placement.mode = replicate.
int moe_parallel_placement_state(const moe_parallel *p, const moe_model *m, json_t **out);

#endif
