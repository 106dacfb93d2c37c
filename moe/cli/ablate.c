// `moe ablate [CONFIG] --grid key=v1,v2 [--grid ...] [--steps N] [--set k=v] [--out DIR]
// [--overwrite | --resume]`: one process trains the runs one after another (never under
// mpirun); Ctrl-C stops the current run at a checkpoint and --resume continues the grid.
#include "moe/ablate.h"
#include "moe/checkpoint.h"
#include "moe/cli/cli.h"
#include "moe/comm.h"
#include "moe/error.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help =
    "usage: moe ablate [CONFIG.json] --grid key=v1,v2[,...] [--grid ...] [--steps N]\n"
    "                  [--set key=value]... [--out DIR] [--overwrite | --resume]\n"
    "\n"
    "Trains every combination of the grid values (same seed and data), then writes\n"
    "results.csv (every run) and results.md (sorted by final validation loss: per-task\n"
    "accuracy, tokens/s, drop rate, MaxVio) into DIR (default runs/ablate-<config name>), and\n"
    "report.html: the runs' loss curves overlaid and a table of their final figures.\n"
    "tokens/s is a run's training tokens / training seconds, in every table.\n"
    "The grid key `config` takes config files: each run loads its file over CONFIG (or\n"
    "the defaults), then the --set values again, then the other grid values, so whole\n"
    "families of settings compare in one grid. A key may be given to --grid once, with at\n"
    "most 16 values; at most 8 --grid keys and 4096 runs. Every run's config is checked\n"
    "before the first run (exit 2 naming the --grid key and the run). --steps N sets\n"
    "train.steps for every run: it cannot be combined with a train.steps --set or --grid.\n"
    "An --out that holds an earlier ablation (results.csv, results.md, report.html,\n"
    "ablate.json or run_NNN folders) is refused; --overwrite removes those files first (in\n"
    "run_NNN, what moe train writes; a run_NNN link is removed, not followed).\n"
    "Ctrl-C (or SIGTERM) stops the current run after its step with a checkpoint, writes\n"
    "the tables of the runs so far (that run's status: stopped) and exits 130; the same\n"
    "command with --resume keeps the finished runs, resumes the stopped one from its\n"
    "checkpoint (a run with none starts again), trains the rest and writes the full tables.\n"
    "--resume refuses a grid, config, --set or --steps other than the folder's, naming it,\n"
    "and a --grid config=... file edited since the grid ran it.\n"
    "Exit 1 when a run fails (its row says why), 2 when the grid is bad, 130 when stopped.\n"
    "One process trains every run: ablate does not run under mpirun.\n"
    "Examples: moe ablate configs/tiny.json --grid router.slot_order=position,priority \\\n"
    "            --grid router.capacity_factor=0.5,1.0,2.0 --steps 200\n"
    "          moe ablate --grid "
    "config=configs/router_softmax_aux.json,configs/expert_choice.json\n";

// The command line again, shell-quoted, with --resume (and without --overwrite):
// what continues the grid.
static void print_resume(int argc, char **argv, bool resume) {
    char q[PATH_MAX + 8];
    moe_cli_shell_quote(q, sizeof q, moe_cli_program());
    fprintf(stderr, "continue with: %s ablate", q);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--overwrite")) continue; // it would replace what --resume keeps
        moe_cli_shell_quote(q, sizeof q, argv[i]);
        fprintf(stderr, " %s", q);
    }
    fprintf(stderr, "%s\n", resume ? "" : " --resume");
}

// --steps N is train.steps=N for every run: a train.steps from --set or
// --grid as well would silently win over it (or lose), so both is refused.
static int check_steps(const char *steps, const char *const *sets, int n_sets,
                       const moe_grid_axis *axes, int n_axes) {
    MOE_TRY(moe_cli_check_steps(steps, sets, n_sets, NULL));
    for (int a = 0; a < n_axes; a++)
        if (!strcmp(axes[a].key, "train.steps"))
            return moe_fail(MOE_EINVAL,
                            "--steps %s and --grid train.steps both set train.steps: give one",
                            steps);
    return 0;
}

int moe_cli_ablate(int argc, char **argv) {
    const char *config = NULL, *out = NULL, *steps = NULL;
    const char **sets = malloc(sizeof *sets * (size_t)argc); // one per argument at most
    char *steps_set = NULL;
    int n_sets = 0, n_axes = 0, code = MOE_EXIT_OK;
    bool overwrite = false, resume = false;
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
            if (m < 0) code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if ((m = moe_cli_flag(argv[i], "--overwrite", &overwrite)) != 0 ||
                   (m = moe_cli_flag(argv[i], "--resume", &resume)) != 0) {
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
    // --steps last among the assignments, checked against the others first.
    if (code == MOE_EXIT_OK && steps) {
        size_t len = strlen(steps) + sizeof "train.steps=";
        if (check_steps(steps, sets, n_sets, axes, n_axes) < 0)
            code = moe_cli_fail("ablate", MOE_EXIT_USAGE, "%s", moe_last_error());
        else if (!(steps_set = malloc(len)))
            code = moe_cli_fail("ablate", MOE_EXIT_RUNTIME, "out of memory");
        else {
            snprintf(steps_set, len, "train.steps=%s", steps);
            sets[n_sets++] = steps_set;
        }
    }
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
    moe_ablate_opts o = {.out = out,
                         .config_path = config,
                         .sets = sets,
                         .n_sets = n_sets,
                         .overwrite = overwrite,
                         .resume = resume,
                         .log = stderr};
    int rc = 0;
    // One process writes a grid folder: a second ablate with --overwrite or
    // --resume would delete or retrain the runs of the first while it trains.
    moe_run_lock_t lock = {.fd = -1};
    if (code == MOE_EXIT_OK && (rc = moe_run_lock(out, &lock)) < 0)
        code = moe_cli_fail("ablate", moe_cli_exit_code(rc), "%s", moe_last_error());
    if (code == MOE_EXIT_OK) {
        o.stop = moe_cli_stop_catch(); // the current run saves and the grid stops
        rc = moe_ablate_run(&cfg, axes, n_axes, &o);
        moe_cli_stop_release();
    }
    moe_run_unlock(&lock, rc < 0); // a refused grid leaves no folder it created
    free(steps_set);
    free(sets);
    if (code != MOE_EXIT_OK) return code;
    if (rc < 0) return moe_cli_fail("ablate", moe_cli_exit_code(rc), "%s", moe_last_error());
    if (o.interrupted) {
        fprintf(stderr,
                "moe ablate: interrupted; the tables of the runs so far are in %s/results.md "
                "and %s/results.csv\n",
                out, out);
        print_resume(argc, argv, resume);
        return 130;
    }
    printf("results: %s/results.md and %s/results.csv; report: %s/report.html\n", out, out, out);
    return MOE_EXIT_OK;
}
