// Ablation grids (moe ablate): every combination of the grid's values is
// trained with the same base config and seed; results.csv and a sorted
// results.md land in the output folder.
#ifndef MOE_ABLATE_H
#define MOE_ABLATE_H

#include "moe/config.h"

#include <stdio.h>

#define MOE_GRID_MAX_AXES 8
#define MOE_GRID_MAX_VALUES 16

typedef struct {
    char key[128];
    int n;
    char values[MOE_GRID_MAX_VALUES][64];
} moe_grid_axis;

// The grid key whose values are config files: each run loads its file over
// the base config (a grid over router families, each a whole configs/ entry).
#define MOE_GRID_CONFIG "config"

// Parses "key=v1,v2,..." (commas inside [...] belong to the value).
int moe_grid_axis_parse(moe_grid_axis *ax, const char *spec);
// Runs the grid into out/run_NNN; a failing run is recorded, not fatal. Bad
// grid keys or values fail before any training. sets: the --set assignments
// already in base, applied again after a `config` axis file. Progress lines
// go to log.
int moe_ablate(const moe_config *base, const moe_grid_axis *axes, int n_axes,
               const char *const *sets, int n_sets, const char *out, FILE *log);

#endif
