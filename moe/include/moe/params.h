// Parameters live in one flat float buffer; a table of named views (name,
// shape, offset) describes it, so checkpoints, the optimizer and gradient
// all-reduce walk one list (STYLE "Parameters in one flat buffer"). Gradients
// use the same table over a second buffer of the same size.
#ifndef MOE_PARAMS_H
#define MOE_PARAMS_H

#include "moe/name_map.h"

#include <stddef.h>
#include <stdint.h>

#define MOE_PARAM_NAME_MAX 128
#define MOE_PARAM_MAX_DIMS 4

typedef struct {
    char name[MOE_PARAM_NAME_MAX]; // e.g. "model.layers.0.block_sparse_moe.gate.weight"
    int ndim;
    int64_t shape[MOE_PARAM_MAX_DIMS];
    size_t offset; // in floats from the start of the flat buffer
    size_t numel;
} moe_param_view;

typedef struct {
    moe_param_view *views;
    int count, cap;
    size_t numel;       // total floats; the next view starts here
    moe_name_map index; // name -> view number, for find and the duplicate check
} moe_param_table;

// An empty table (no allocation until the first add).
void moe_param_table_init(moe_param_table *t);
void moe_param_table_free(moe_param_table *t);
// Appends a view named prefix+name (prefix may be NULL) at offset t->numel.
// MOE_EINVAL on a bad shape, a too-long or duplicate name; MOE_ENOMEM.
int moe_param_table_add(moe_param_table *t, const char *prefix, const char *name, int ndim,
                        const int64_t *shape);
// The view with this exact name, or NULL. O(1): hashed.
const moe_param_view *moe_param_table_find(const moe_param_table *t, const char *name);

#endif
