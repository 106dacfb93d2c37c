// The grid's state file (out/ablate.json), shared by the grid runner
// (trainer/ablate.c) and its reader/writer (trainer/ablate_state.c); not part
// of the public API.
#ifndef MOE_ABLATE_INTERNAL_H
#define MOE_ABLATE_INTERNAL_H

#include "moe/ablate.h"

#define MOE_ABLATE_STATE "ablate.json"

// Writes out/ablate.json (through a temporary file and a rename, so that a
// kill leaves the previous state whole): the base config (every key, before
// the grid's values), the grid, and rows[i] for every i
// with done[i] (the others null).
int moe_ablate_state_write(const char *out, const moe_config *base, const moe_grid_axis *axes,
                           int n_axes, const moe_ablate_row *rows, const bool *done, int n);
// Reads out/ablate.json for --resume: MOE_EINVAL when it is missing, malformed
// (naming the field), records another grid than axes (naming the axis and
// both value lists) or another base config (naming the first key that
// differs). Fills rows[i] and done[i] for every recorded run; the rows' idx
// stay as the caller set them.
int moe_ablate_state_read(const char *out, const moe_config *base, const moe_grid_axis *axes,
                          int n_axes, moe_ablate_row *rows, bool *done, int n);

#endif
