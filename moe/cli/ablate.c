// `moe ablate [CONFIG] --grid key=v1,v2 [--grid ...] [--steps N] [--set k=v] [--out DIR]
// [--overwrite]`: one process trains the runs one after another (never under mpirun).
#include "moe/ablate.h"
#include "moe/cli/cli.h"
#include "moe/comm.h"
#include "moe/error.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help =
    "usage: moe ablate [CONFIG.json] --grid key=v1,v2[,...] [--grid ...] [--steps N]\n"
    "                  [--set key=value]... [--out DIR] [--overwrite]\n"
    "\n"
    "Trains every combination of the grid values (same seed and data), then writes\n"
    "results.csv (every run) and results.md (sorted by final validation loss: per-task\n"
    "accuracy, tokens/s, drop rate, MaxVio) into DIR (default runs/ablate-<config name>), and\n"
    "report.html: the runs' loss curves overlaid and a table of their final figures.\n"
    "The grid key `config` takes config files: each run loads its file over CONFIG (or\n"
    "the defaults), then the --set values again, then the other grid values, so whole\n"
    "families of settings compare in one grid. A key may be given to --grid once.\n"
    "An --out that holds an earlier ablation (results.csv, results.md, report.html or\n"
    "run_NNN folders) is refused; --overwrite removes those files first (in run_NNN,\n"
    "what moe train writes). Exit 1 when a run fails (its row says why), 2 when the\n"
    "grid is bad. One process trains every run: ablate does not run under mpirun.\n"
    "Examples: moe ablate configs/tiny.json --grid router.slot_order=position,priority \\\n"
    "            --grid router.capacity_factor=0.5,1.0,2.0 --steps 200\n"
    "          moe ablate --grid "
    "config=configs/router_softmax_aux.json,configs/expert_choice.json\n";

int moe_cli_ablate(int argc, char **argv) {
    const char *config = NULL, *out = NULL, *steps = NULL;
    const char **sets = malloc(sizeof *sets * (size_t)argc); // one per argument at most
    char *steps_set = NULL;
    int n_sets = 0, n_axes = 0, code = MOE_EXIT_OK;
    bool overwrite = false;
    moe_grid_axis axes[MOE_GRID_MAX_AXES];
    if (!sets) return moe_cli_fail("ablate", MOE_EXIT_RUNTIME, "out of memory");
    for (int i = 1; i < argc && code == MOE_EXIT_OK; i++) {
        const char *v;
        int m;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            free(sets);
            return MOE_EXIT_OK;
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--grid", &v)) != 0) {
            if (m < 0)
                code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
            else if (n_axes == MOE_GRID_MAX_AXES)
                code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "at most %d --grid options",
                                    MOE_GRID_MAX_AXES);
            else if (moe_grid_axis_parse(&axes[n_axes++], v) < 0)
                code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--set", &v)) != 0) {
            if (m < 0)
                code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "--set needs key=value");
            else
                sets[n_sets++] = v;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--steps", &steps)) != 0) {
            size_t len = steps ? strlen(steps) + sizeof "train.steps=" : 0;
            if (m < 0)
                code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
            else if (!(steps_set = malloc(len)))
                code = moe_cli_fail("ablate", MOE_EXIT_RUNTIME, "out of memory");
            else {
                snprintf(steps_set, len, "train.steps=%s", steps);
                sets[n_sets++] = steps_set;
            }
        } else if ((m = moe_cli_flag(argv[i], "--overwrite", &overwrite)) != 0) {
            if (m < 0) code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if ((m = moe_cli_opt_path(argc, argv, &i, "--out", &out)) != 0) {
            if (m < 0) code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if (argv[i][0] == '-') {
            code = moe_cli_unknown_option("ablate", argv[i], help);
        } else if (!config) {
            config = argv[i];
        } else {
            code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "more than one config file ('%s', '%s')",
                                config, argv[i]);
        }
    }
    // (under mpirun on more than one rank the CLI refused it already: every
    // rank would train every run into the same folders)
    bool config_axis = false; // --grid config=a.json,b.json: each run's own file
    for (int a = 0; a < n_axes; a++)
        config_axis |= !strcmp(axes[a].key, MOE_GRID_CONFIG);
    moe_config cfg;
    if (code == MOE_EXIT_OK && !config && !config_axis)
        code = moe_cli_fail("ablate", MOE_EXIT_USAGE,
                            "no config file (or --grid config=A.json,B.json; see --help)");
    else if (code == MOE_EXIT_OK && !n_axes)
        code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "no --grid given (see --help)");
    else if (code == MOE_EXIT_OK && config && moe_cli_load_config(&cfg, config, sets, n_sets) < 0)
        code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
    if (code == MOE_EXIT_OK && !config) { // the config axis's files hold the model
        moe_config_default(&cfg);
        for (int i = 0; code == MOE_EXIT_OK && i < n_sets; i++)
            if (moe_config_set(&cfg, NULL, sets[i]) < 0)
                code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
    }
    char def[PATH_MAX];
    if (!out) {
        const char *base = !config                ? "grid"
                           : strrchr(config, '/') ? strrchr(config, '/') + 1
                                                  : config;
        snprintf(def, sizeof def, "runs/ablate-%.*s", (int)strcspn(base, "."), base);
        out = def;
    }
    // The runs' folders are created by the trainer; results land next to them.
    int rc = code != MOE_EXIT_OK ? 0
             : overwrite ? moe_ablate_overwrite(&cfg, axes, n_axes, sets, n_sets, out, stderr)
                         : moe_ablate(&cfg, axes, n_axes, sets, n_sets, out, stderr);
    free(steps_set);
    free(sets);
    if (code != MOE_EXIT_OK) return code;
    if (rc < 0) return moe_cli_fail("ablate", moe_cli_exit_code(rc), "%s", moe_last_error());
    printf("results: %s/results.md and %s/results.csv; report: %s/report.html\n", out, out, out);
    return MOE_EXIT_OK;
}
