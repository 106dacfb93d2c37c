// `moe ablate CONFIG --grid key=v1,v2 [--grid ...] [--steps N] [--set k=v] [--out DIR]`
#include "moe/ablate.h"
#include "moe/cli/cli.h"
#include "moe/error.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

static const char *help =
    "usage: moe ablate CONFIG.json --grid key=v1,v2[,...] [--grid ...] [--steps N]\n"
    "                  [--set key=value]... [--out DIR]\n"
    "\n"
    "Trains every combination of the grid values (same seed and data), then writes\n"
    "results.csv (every run) and results.md (sorted by final validation loss: per-task\n"
    "accuracy, tokens/s, drop rate) into DIR (default runs/ablate-<config name>).\n"
    "Example: moe ablate configs/tiny.json --grid router.slot_order=position,priority \\\n"
    "           --grid router.capacity_factor=0.5,1.0,2.0 --steps 200\n";

int moe_cli_ablate(int argc, char **argv) {
    const char *config = NULL, *out = NULL;
    const char *sets[64];
    int n_sets = 0, n_axes = 0;
    moe_grid_axis axes[MOE_GRID_MAX_AXES];
    char steps_set[64];
    for (int i = 1; i < argc; i++) {
        const char *v;
        int m;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return MOE_EXIT_OK;
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--grid", &v)) != 0) {
            if (m < 0) return moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
            if (n_axes == MOE_GRID_MAX_AXES)
                return moe_cli_fail("ablate", MOE_EXIT_USAGE, "at most %d --grid options",
                                    MOE_GRID_MAX_AXES);
            if (moe_grid_axis_parse(&axes[n_axes++], v) < 0)
                return moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--set", &v)) != 0) {
            if (m < 0 || n_sets == 63)
                return moe_cli_fail("ablate", MOE_EXIT_USAGE, "--set needs key=value");
            sets[n_sets++] = v;
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--steps", &v)) != 0) {
            if (m < 0 || n_sets == 63)
                return moe_cli_fail("ablate", MOE_EXIT_USAGE, "--steps needs a number");
            snprintf(steps_set, sizeof steps_set, "train.steps=%s", v);
            sets[n_sets++] = steps_set;
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--out", &v)) != 0) {
            if (m < 0) return moe_cli_fail("ablate", MOE_EXIT_USAGE, "--out needs a folder");
            out = v;
        } else if (argv[i][0] == '-') {
            return moe_cli_fail("ablate", MOE_EXIT_USAGE, "unknown option '%s'", argv[i]);
        } else if (!config) {
            config = argv[i];
        } else {
            return moe_cli_fail("ablate", MOE_EXIT_USAGE, "more than one config file");
        }
    }
    if (!config) return moe_cli_fail("ablate", MOE_EXIT_USAGE, "no config file (see --help)");
    if (!n_axes) return moe_cli_fail("ablate", MOE_EXIT_USAGE, "no --grid given (see --help)");
    moe_config cfg;
    int rc = moe_cli_load_config(&cfg, config, sets, n_sets);
    if (rc < 0) return moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
    char def[PATH_MAX];
    if (!out) {
        const char *base = strrchr(config, '/') ? strrchr(config, '/') + 1 : config;
        snprintf(def, sizeof def, "runs/ablate-%.*s", (int)strcspn(base, "."), base);
        out = def;
    }
    // The runs' folders are created by the trainer; results land next to them.
    rc = moe_ablate(&cfg, axes, n_axes, out, stderr);
    if (rc < 0) return moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
    printf("results: %s/results.md and %s/results.csv\n", out, out);
    return MOE_EXIT_OK;
}
