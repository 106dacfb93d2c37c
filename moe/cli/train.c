// `moe train CONFIG` and `moe eval CKPT`: config + --set overrides, the run
// folder, Ctrl-C handling (checkpoint, then exit 130) and the final report.
#include "moe/train.h"
#include "moe/checkpoint.h"
#include "moe/cli/cli.h"
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/infer.h"
#include "moe/plan.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"
#include "moe/tokenizer.h"

#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *train_help =
    "usage: moe train CONFIG.json [--set key=value]... [--out DIR] [--resume DIR]\n"
    "                 [--overwrite] [--steps N] [--device cpu|cuda] [--quiet] [--dry-run]\n"
    "                 [--force]\n"
    "       moe train --resume RUN_DIR [--set key=value]... [--steps N]\n"
    "       moe train --help-config      list every config key with its default\n"
    "\n"
    "Trains the model CONFIG describes (a JSON file of sections: model, moe, router,\n"
    "capacity, train, data, ...; keys not given take their defaults). --set overrides a\n"
    "key (typed by the key: --set router.top_k=1 --set moe.num_experts=[4,8]); --steps N\n"
    "is --set train.steps=N (not both), --device D is --set train.device=D. The run folder\n"
    "(default runs/<config name>) receives config.json (resolved), metrics.jsonl and\n"
    "checkpoint/ (or checkpoint-STEP/ folders and `latest`, with train.keep_checkpoints).\n"
    "A folder that already holds a run is refused unless --resume continues it or\n"
    "--overwrite replaces it; one holding another tool's config.json (an export) is\n"
    "refused, and so is a folder another moe train is writing (it holds the folder's\n"
    "lock until it exits). --resume takes a run folder (its latest checkpoint) or a\n"
    "checkpoint folder and continues bit-exactly; with no CONFIG it takes the config and\n"
    "the run folder from the run itself. A resumed run writes into the run it resumes or a\n"
    "folder that holds no run, never into another run. Ctrl-C (or SIGTERM) stops after\n"
    "the current step, saves a checkpoint, prints the command that continues and exits\n"
    "with 130.\n"
    "--dry-run prints the memory plan (as moe plan) and exits; --force starts a run the\n"
    "memory plan says will not fit. Under mpirun or srun every rank trains\n"
    "(parallel.ep experts-parallel ranks x data parallel); the ranks must run the same\n"
    "config, --out, --resume and data files (checked at start, exit 2 naming the first\n"
    "difference). Open MPI's mpirun kills the ranks 1 s after Ctrl-C, before the save:\n"
    "signal one rank instead (kill -INT PID), or start mpirun with\n"
    "--mca odls_base_sigkill_timeout 120.\n";

typedef struct {
    const char *out, *resume;
    bool quiet, dry_run, force, overwrite;
    bool resume_run;    // --resume RUN_DIR without a CONFIG: config and out from the run
    char notes[8][256]; // keys set but ignored (moe_config_ignored), printed at start
    int n_notes;
} train_args;

// "key=value" in a new string (NULL when out of memory).
static char *assignment(const char *key, const char *value) {
    size_t n = strlen(key) + strlen(value) + 2;
    char *s = malloc(n);
    if (s) snprintf(s, n, "%s=%s", key, value);
    return s;
}

static bool has_file(const char *dir, const char *name) {
    char p[PATH_MAX];
    struct stat st;
    return snprintf(p, sizeof p, "%s/%s", dir, name) < (int)sizeof p && stat(p, &st) == 0 &&
           S_ISREG(st.st_mode);
}

// The run folder of the checkpoint --resume reads: the folder holding the
// resolved checkpoint (RUN for RUN, RUN/checkpoint or RUN/checkpoint-STEP).
static int resume_run_dir(const char *resume, char *run, size_t cap) {
    char ck[PATH_MAX];
    MOE_TRY(moe_ckpt_resolve(resume, ck, sizeof ck, NULL));
    char *slash = strrchr(ck, '/');
    if (!slash)
        snprintf(run, cap, ".");
    else if (slash == ck)
        snprintf(run, cap, "/");
    else
        snprintf(run, cap, "%.*s", (int)(slash - ck), ck);
    return 0;
}

// The run's config.json would replace it: another tool's file (an export).
static int foreign_config(const char *out) {
    return moe_fail(MOE_EINVAL,
                    "--out %s: %s/config.json was not written by moe train (no metrics.jsonl or "
                    "checkpoint beside it; a `moe export --hf` folder?) and a run would replace "
                    "it; give another --out",
                    out, out);
}

// A resumed run writes its checkpoints, config and metrics into --out: that
// must be the run being resumed (the same folder, however named) or a folder
// that holds no run, never a second run it would silently replace.
static int check_resume_out(const char *resume, const char *out) {
    char run[PATH_MAX];
    MOE_TRY(resume_run_dir(resume, run, sizeof run));
    struct stat so, sr;
    if (stat(out, &so) == 0 && stat(run, &sr) == 0 && so.st_dev == sr.st_dev &&
        so.st_ino == sr.st_ino)
        return 0;
    if (moe_run_foreign_config(out)) return foreign_config(out);
    if (!moe_run_exists(out)) return 0;
    return moe_fail(MOE_EINVAL,
                    "--out %s already holds a run other than the one --resume %s continues (run "
                    "folder %s): continue it there (--out %s), or into a folder that holds no run; "
                    "--overwrite replaces %s's run only for a new run, without --resume",
                    out, resume, run, run, out);
}

// Parses train's options, loads CONFIG (or, with --resume RUN_DIR alone, the
// run's config.json) with the --set, --steps and --device overrides (applied
// in command-line order) into cfg, and fills a (out defaults to runs/<config
// name>, or the run folder; written into default_out).
static int parse_train_args(int argc, char **argv, moe_config *cfg, train_args *a,
                            char *default_out, size_t cap) {
    const char *config = NULL, *steps = NULL, *device = NULL;
    int rc = 0, n_sets = 0;
    const char **sets = malloc(sizeof *sets * (size_t)argc); // one per argument at most
    char *owned[2] = {NULL, NULL};                           // --steps, --device as --set
    char run_config[PATH_MAX];
    if (!sets) return moe_fail(MOE_ENOMEM, "out of memory");
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int m;
        if ((m = moe_cli_opt_value(argc, argv, &i, "--set", &v)) != 0) {
            if (m < 0) goto usage;
            sets[n_sets++] = v;
        } else if ((m = moe_cli_opt_path(argc, argv, &i, "--out", &a->out)) != 0 ||
                   (m = moe_cli_opt_path(argc, argv, &i, "--resume", &a->resume)) != 0) {
            if (m < 0) goto usage;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--steps", &steps)) != 0) {
            if (m < 0) goto usage;
            if (!(owned[0] = assignment("train.steps", steps))) goto nomem;
            sets[n_sets++] = owned[0];
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--device", &device)) != 0) {
            if (m < 0) goto usage;
            if (!(owned[1] = assignment("train.device", device))) goto nomem;
            sets[n_sets++] = owned[1];
        } else if ((m = moe_cli_flag(argv[i], "--quiet", &a->quiet)) != 0 ||
                   (m = moe_cli_flag(argv[i], "--dry-run", &a->dry_run)) != 0 ||
                   (m = moe_cli_flag(argv[i], "--force", &a->force)) != 0 ||
                   (m = moe_cli_flag(argv[i], "--overwrite", &a->overwrite)) != 0) {
            if (m < 0) goto usage;
        } else if (argv[i][0] == '-') {
            moe_cli_option_error("train", argv[i], train_help);
            goto usage;
        } else if (!config) {
            config = argv[i];
        } else {
            moe_fail(MOE_EINVAL, "more than one config file ('%s', '%s')", config, argv[i]);
            goto usage;
        }
    }
    if (steps && moe_cli_check_steps(steps, sets, n_sets, owned[0]) < 0) goto usage;
    if (device) { // named as --device, not as the --set it becomes
        moe_config scratch;
        moe_config_default(&scratch);
        if (moe_config_set(&scratch, NULL, owned[1]) < 0) {
            const char *msg = moe_last_error();
            moe_fail(MOE_EINVAL, "--device %s: %s", device,
                     msg + (strncmp(msg, "--set: ", 7) ? 0 : 7));
            goto usage;
        }
    }
    if (a->resume && a->overwrite) {
        moe_fail(MOE_EINVAL, "--resume continues a run and --overwrite replaces it: give one");
        goto usage;
    }
    if (!config && a->resume) { // the run's own resolved config, and the run as --out
        if (!has_file(a->resume, "config.json") || !moe_run_exists(a->resume)) {
            moe_fail(MOE_EINVAL,
                     "--resume %s without a CONFIG needs a run folder (config.json and a "
                     "checkpoint, as moe train writes); for a checkpoint folder give the config "
                     "too: moe train CONFIG --resume %s --out DIR",
                     a->resume, a->resume);
            goto usage;
        }
        snprintf(run_config, sizeof run_config, "%s/config.json", a->resume);
        config = run_config;
        a->resume_run = true;
        if (!a->out) a->out = a->resume;
    }
    if (!config) {
        moe_fail(MOE_EINVAL, "no config file (try configs/tiny.json)");
        goto usage;
    }
    MOE_TRY_GOTO(moe_cli_load_config_noted(cfg, config, sets, n_sets, a->notes, 8, &a->n_notes),
                 rc);
    if (!a->out) {
        const char *base = strrchr(config, '/') ? strrchr(config, '/') + 1 : config;
        const int len = (int)strcspn(base, ".");
        if (len == 0) { // ".json": the run would be runs/ itself
            moe_fail(MOE_EINVAL, "%s: no run name in the file name: give --out DIR", config);
            goto usage;
        }
        snprintf(default_out, cap, "runs/%.*s", len, base);
        a->out = default_out;
    }
    goto fail; // rc == 0: done
nomem:
    rc = moe_fail(MOE_ENOMEM, "out of memory");
    goto fail;
usage:
    rc = MOE_EINVAL;
fail:
    free(owned[0]);
    free(owned[1]);
    free(sets);
    return rc;
}

// The largest part of the plan, and the config keys that shrink it.
static const char *keys_to_lower(const moe_mem_plan *p) {
    size_t act = p->activations + p->moe + p->step;
    size_t weights = p->params + p->grads + p->optimizer + p->grad_pack;
    if (p->data > act && p->data > weights) return "a smaller data file (data.path)";
    if (act >= weights)
        return "train.batch_size, model.seq_len, or raise memory.mini_seq / set memory.recompute";
    return "model.d_model, model.n_layers, moe.num_experts, moe.d_expert, or raise parallel.ep";
}

static double gib(size_t b) {
    return b / 1073741824.0;
}

// Refuses (MOE_ENOMEM, naming prediction, limit and keys) a run whose planned
// peak, times the ranks sharing this machine, exceeds the memory available to
// it: the kernel would kill the run part-way, without a message.
// MOE_MEM_LIMIT=bytes replaces the measured limit (tests, or a stricter cap).
static int check_memory(const moe_config *cfg, int world, int rank, int ranks_here) {
    moe_mem_plan p;
    MOE_TRY(moe_plan_memory(cfg, world, rank, &p));
    size_t avail;
    char source[128];
    const char *env = getenv("MOE_MEM_LIMIT");
    if (env && *env) {
        long long v;
        if (!moe_cli_parse_long(env, 0, LLONG_MAX, &v))
            return moe_fail(MOE_EINVAL, "MOE_MEM_LIMIT='%s': expected a number of bytes", env);
        avail = (size_t)v;
        snprintf(source, sizeof source, "MOE_MEM_LIMIT");
    } else if (moe_plan_mem_available(&avail, source, sizeof source) < 0) {
        return 0; // nothing to compare with (not Linux): run as before
    }
    size_t need = p.total * (size_t)(ranks_here > 0 ? ranks_here : 1);
    if (need <= avail) return 0;
    char who[64] = "";
    if (ranks_here > 1) snprintf(who, sizeof who, " x %d ranks on this machine", ranks_here);
    return moe_fail(MOE_ENOMEM,
                    "the memory plan predicts %.2f GiB (%zu bytes)%s but only %.2f GiB (%zu "
                    "bytes) are available (%s); lower %s (moe plan CONFIG shows the parts), or "
                    "pass --force to start anyway",
                    gib(p.total), p.total, who, gib(avail), avail, source, keys_to_lower(&p));
}

// Ranks of this job on this machine, as the launcher tells (1 when unknown).
static int local_ranks(void) {
    static const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                 "SLURM_NTASKS_PER_NODE"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        long long n;
        const char *v = getenv(vars[i]);
        if (v && moe_cli_parse_long(v, 1, 1 << 20, &n)) return (int)n;
    }
    return 1;
}

// The exit code of the lowest rank that failed (0: none), with its message,
// on every rank.
static int agree_exit(moe_comm *world, int code) {
    return -moe_comm_agree(world, -code);
}

// The run folder and the checkpoint of a new or resumed run; returns the exit
// code (0: usable) with the message recorded.
// Rank 0 (the process writing the run folder) takes its lock first: the
// checks below then see the folder no other moe train is changing.
static moe_run_lock_t run_lock = {.fd = -1};

static int check_run_folders(const train_args *a, int rank) {
    int rc;
    // A checkpoint to resume from is input: unusable is exit 2, as in eval.
    if (a->resume && (rc = moe_cli_check_ckpt(a->resume)) < 0) {
        moe_fail(rc, "--resume: %s", moe_last_error());
        return moe_cli_input_exit_code(rc);
    }
    if (rank == 0 && (rc = moe_run_lock(a->out, &run_lock)) < 0) return moe_cli_exit_code(rc);
    if (a->resume && check_resume_out(a->resume, a->out) < 0) return MOE_EXIT_USAGE;
    if (!a->resume && moe_run_foreign_config(a->out)) {
        foreign_config(a->out);
        return MOE_EXIT_USAGE;
    }
    // A second run into a run folder would mix two runs' metrics and replace
    // the first one's checkpoint: the user says which they mean.
    char ckpt[PATH_MAX];
    if (!a->resume && !a->overwrite && moe_run_exists(a->out)) {
        if (moe_ckpt_resolve(a->out, ckpt, sizeof ckpt, NULL) < 0) // nothing --resume could take
            moe_fail(MOE_EINVAL,
                     "--out %s already holds a run with no checkpoint to resume (metrics.jsonl "
                     "or an unfinished save); replace it with --overwrite, or give another --out",
                     a->out);
        else
            moe_fail(MOE_EINVAL,
                     "--out %s already holds a run (metrics.jsonl or a checkpoint); continue it "
                     "with --resume %s, or replace it with --overwrite",
                     a->out, a->out);
        return MOE_EXIT_USAGE;
    }
    return 0;
}

// Every rank writes its checkpoint shards into the run folder rank 0 has
// just created and locked, so every rank must see that folder: a rank whose
// --out names a folder of another filesystem (a path relative to another
// working folder, a node-local disk) would otherwise train to the first save
// and fail there. Returns the exit code (0: seen).
static int check_shared_out(const char *out, int rank) {
    struct stat st;
    if (rank == 0 || (stat(out, &st) == 0 && S_ISDIR(st.st_mode))) return 0;
    moe_fail(MOE_EINVAL,
             "rank %d does not see --out %s, the run folder rank 0 created: every rank must "
             "see the same run folder (a shared filesystem such as NFS or Lustre, and an "
             "absolute path or the same working folder on every rank)",
             rank, out);
    return MOE_EXIT_USAGE;
}

static int train_main(int argc, char **argv);

int moe_cli_train(int argc, char **argv) {
    const int code = train_main(argc, argv);
    // a run refused or failed before writing leaves no folder it created
    moe_run_unlock(&run_lock, code != MOE_EXIT_OK && code != 130);
    return code;
}

static int train_main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(train_help, stdout);
            return MOE_EXIT_OK;
        }
        if (!strcmp(argv[i], "--help-config")) {
            moe_config_help(stdout);
            return MOE_EXIT_OK;
        }
    }
    moe_config cfg;
    train_args a = {0};
    char default_out[PATH_MAX];
    int code = 0, rc = parse_train_args(argc, argv, &cfg, &a, default_out, sizeof default_out);
    if (rc < 0) code = moe_cli_input_exit_code(rc);
    moe_comm *world = NULL;
    int rank = 0, size = 1;
    if (moe_cli_mpi_launched()) {
        // The world first, with a node layout no config decides: every rank
        // then learns of a failure of any rank (its arguments, its run folder)
        // and of any difference between the ranks' runs before a collective
        // that depends on them, and rank 0 alone prints it.
        if ((rc = moe_cli_mpi_world(&world, 0)) < 0) {
            if (moe_cli_mpi_rank() == 0)
                moe_cli_fail("train", moe_cli_input_exit_code(rc), "%s", moe_last_error());
            return moe_cli_input_exit_code(rc);
        }
        rank = moe_comm_rank(world);
        size = moe_comm_size(world);
        code = agree_exit(world, code);
        if (code == 0 && (rc = moe_train_check_same(world, &cfg, a.out, a.resume)) < 0) {
            if (rc == MOE_EIO) { // an MPI failure, not agreed: peers may wait for this rank
                moe_cli_fail("train", MOE_EXIT_RUNTIME, "%s", moe_last_error());
                fflush(stderr);
                moe_comm_abort(world, MOE_EXIT_RUNTIME);
            }
            code = MOE_EXIT_USAGE; // (agreed inside)
        }
    }
    if (code == 0 && !a.dry_run) code = check_run_folders(&a, rank);
    if (world) code = agree_exit(world, code);
    if (world && code == 0 && !a.dry_run) code = agree_exit(world, check_shared_out(a.out, rank));
    // The node layout the config asks for: every rank holds the same value now,
    // so a refusal (it does not divide the ranks) is the same on every rank.
    if (world && code == 0 && cfg.comm.ranks_per_node > 0) {
        moe_comm_free(world);
        world = NULL;
        if ((rc = moe_cli_mpi_world(&world, cfg.comm.ranks_per_node)) < 0) {
            if (rank == 0)
                moe_cli_fail("train", moe_cli_input_exit_code(rc), "%s", moe_last_error());
            return moe_cli_input_exit_code(rc);
        }
    }
    if (code != 0) {
        if (rank == 0) moe_cli_fail("train", code, "%s", moe_last_error());
        moe_cli_mpi_finalize(world);
        return code;
    }
    for (int i = 0; rank == 0 && i < a.n_notes; i++)
        fprintf(stderr, "moe train: note: %s\n", a.notes[i]);
    if (a.dry_run) { // the plan of this config on parallel.ep ranks (as moe plan CONFIG)
        moe_machine mc = {0, 0, 0, {400, 100}, {2, 5}};
        moe_data d; // synthetic data is all config: its checks cost nothing
        const bool synth = rank == 0 && !strcmp(cfg.data.kind, "synthetic");
        if (synth && moe_data_open(&d, &cfg) < 0)
            code = MOE_EXIT_USAGE;
        else if (synth)
            moe_data_close(&d);
        if (rank == 0 && code == 0 &&
            (moe_plan_machine(&cfg, 0, 0, &mc) < 0 || moe_plan_print(&cfg, &mc, stdout) < 0))
            code = MOE_EXIT_USAGE;
        if (world) code = agree_exit(world, code);
        if (code != 0 && rank == 0) moe_cli_fail("train", code, "%s", moe_last_error());
        moe_cli_mpi_finalize(world);
        return code;
    }
    if (world) rc = moe_comm_set_timeout(world, cfg.comm.timeout_s);
    // Before any allocation: a run the machine cannot hold is refused with
    // its numbers (every rank agrees, so none waits for a refused peer).
    if (rc == 0 && !a.force) rc = check_memory(&cfg, size, rank, world ? local_ranks() : 1);
    if (world) rc = moe_comm_agree(world, rc);
    if (rc < 0) {
        code = rc == MOE_ENOMEM ? MOE_EXIT_RUNTIME : MOE_EXIT_USAGE;
        if (rank == 0) moe_cli_fail("train", code, "%s", moe_last_error());
        moe_cli_mpi_finalize(world);
        return code;
    }
    // The loop checks the flag after each step, saves a checkpoint and returns.
    moe_train_opts o = {a.out, a.resume, moe_cli_stop_catch(), stdout, a.quiet, NULL, 0, NULL,
                        NULL,  false};
    o.world = world;
    o.overwrite = a.overwrite;
    moe_train_result r;
    rc = moe_train(&cfg, &o, &r);
    moe_cli_stop_release();
    if (rc < 0) {
        int code = moe_cli_exit_code(rc);
        // A failure every rank agreed on is reported once; a failure of one
        // rank (its peers may wait in a collective) ends the whole job.
        if (!world || rank == 0 || !r.agreed) moe_cli_fail("train", code, "%s", moe_last_error());
        if (world && !r.agreed) {
            fflush(stderr);
            moe_comm_abort(world, code);
        }
        moe_cli_mpi_finalize(world);
        return code;
    }
    moe_eval_result_free(&r.eval);
    moe_cli_mpi_finalize(world);
    if (rank != 0) return r.interrupted ? 130 : MOE_EXIT_OK;
    if (r.interrupted) {
        // The run folder holds the resolved config (every --set applied):
        // resuming it alone continues exactly this run.
        char prog[PATH_MAX + 8], out[PATH_MAX + 8];
        moe_cli_shell_quote(prog, sizeof prog, moe_cli_program());
        moe_cli_shell_quote(out, sizeof out, a.out);
        char launch[96] = ""; // an MPI job continues under its launcher, with as many ranks
        if (world) snprintf(launch, sizeof launch, " (under mpirun or srun, %d ranks)", size);
        fprintf(stderr,
                "moe train: interrupted after step %ld of %d; checkpoint saved in %s\n"
                "continue with%s: %s train --resume %s\n",
                r.steps, cfg.train.steps, a.out, launch, prog, out);
        return 130;
    }
    return MOE_EXIT_OK;
}

static const char *eval_help =
    "usage: moe eval CKPT_DIR [--batches N] [--samples N] [--dump-logits FILE]\n"
    "                [--expert-budget P] [--quantize int8]\n"
    "\n"
    "Prints validation loss per task, exact-match accuracy of greedy answers per task\n"
    "(synthetic data) and the expert-usage matrix per task of every MoE layer, for the\n"
    "checkpoint folder CKPT_DIR (it holds config.json and model.safetensors).\n"
    "--dump-logits FILE writes the tokens and logits of validation batch 0 (safetensors:\n"
    "tokens, task_ids, logits; dropless routing) for scripts/hf_check.py, routed as\n"
    "inference and an export route: router.type = expert_choice is dumped with its\n"
    "router.ec_fallback = token_choice (refused without it; the loss above stays that of\n"
    "expert choice). FILE's folder must exist and may not be, nor lie in, any folder\n"
    "holding a checkpoint (manifest.json, model.safetensors or its index,\n"
    "trainer_state.json); FILE replaces only an earlier dump.\n"
    "--expert-budget P and --quantize int8 add a table of the per-task validation loss of\n"
    "the inference engine (moe generate) loaded with that option against its exact task-\n"
    "routed load, with the experts and expert bytes each keeps; the load is tried first,\n"
    "so what it needs (task_experts.json for a budget) is refused before evaluating.\n"
    "With data.val_path only the validation files are read (data.path may be gone).\n"
    "--batches N (default 8) reads N fixed validation batches from the first; token files\n"
    "hold finitely many validation windows, and a note says when N batches read some twice.\n";

// Per task: validation loss of the exact task-routed load and of the load with
// the given budget / int8, through the inference engine.
static int eval_infer_table(const char *dir, const moe_config *cfg, moe_data *d, int batches,
                            double budget, bool int8) {
    printf("\ninference engine, validation loss per task (%d batches): exact task-routed load vs "
           "%s%s%s\n",
           batches, budget > 0 ? "expert budget" : "", budget > 0 && int8 ? " + " : "",
           int8 ? "int8 experts" : "");
    if (budget > 0) printf("  (expert budget %g)\n", budget);
    printf("  %-10s %10s %10s %10s %8s %14s %14s\n", "task", "exact", "variant", "delta", "tokens",
           "expert MB", "variant MB");
    for (int t = 0; t < d->n_tasks; t++) {
        moe_infer a, b;
        moe_infer_opts oa = {.task = d->task_names[t]}, ob = oa;
        ob.expert_budget = budget, ob.quantize_int8 = int8;
        double la, lb;
        long na, nb;
        int rc = moe_infer_open(&a, dir, &oa);
        if (rc < 0) return rc;
        rc = moe_infer_val_loss(&a, d, batches, &la, &na);
        if (rc == 0) rc = moe_infer_open(&b, dir, &ob);
        if (rc < 0) {
            moe_infer_free(&a);
            return rc;
        }
        rc = moe_infer_val_loss(&b, d, batches, &lb, &nb);
        if (rc == 0) {
            printf("  %-10s %10.5f %10.5f %+10.6f %8ld %14.2f %14.2f   experts:", d->task_names[t],
                   la, lb, lb - la, na, a.stats.expert_bytes / 1e6, b.stats.expert_bytes / 1e6);
            for (int l = 0; l < a.L; l++)
                if (b.stats.experts[l]) printf(" %d/%d", b.stats.loaded[l], b.stats.experts[l]);
            putchar('\n');
        }
        moe_infer_free(&a);
        moe_infer_free(&b);
        if (rc < 0) return rc;
    }
    (void)cfg;
    return 0;
}

// The inference engine loads the variant the table compares (expert budget,
// int8) before anything is evaluated: what it lacks (task_experts.json for a
// budget) is refused up front, not after the whole evaluation has printed.
static int check_infer_variant(const char *dir, const moe_config *cfg, double budget, bool int8) {
    char names[MOE_MAX_TASKS][MOE_NAME_MAX];
    const int n = moe_config_task_names(cfg, names);
    moe_infer e;
    for (int t = 0; t < n; t++) { // each task: a budget keeps a set per task
        moe_infer_opts o = {.task = names[t], .expert_budget = budget, .quantize_int8 = int8};
        MOE_TRY(moe_infer_open(&e, dir, &o));
        moe_infer_free(&e);
    }
    return 0;
}

// An earlier dump of eval: a safetensors file of exactly tokens, task_ids and
// logits (the one kind of file --dump-logits may replace).
static bool is_logits_dump(const char *path) {
    moe_st_file *f;
    if (moe_st_open(path, &f) < 0) return false;
    bool yes = f->n_tensors == 3 && moe_st_find(f, "tokens") && moe_st_find(f, "task_ids") &&
               moe_st_find(f, "logits");
    moe_st_close(f);
    return yes;
}

// The nearest folder at or above `folder` that holds a checkpoint file (its
// manifest, weights, weight index or trainer state) into hit, with the file
// into what; false when none does. folder must exist.
static bool in_checkpoint_folder(const char *folder, char *hit, size_t cap, const char **what) {
    static const char *marks[] = {"manifest.json", "model.safetensors",
                                  "model.safetensors.index.json", "trainer_state.json"};
    char p[PATH_MAX], f[PATH_MAX + 64];
    if (!realpath(folder, p)) return false;
    for (;;) {
        for (size_t i = 0; i < sizeof marks / sizeof *marks; i++)
            if (snprintf(f, sizeof f, "%s/%s", strcmp(p, "/") ? p : "", marks[i]) < (int)sizeof f &&
                access(f, F_OK) == 0) {
                snprintf(hit, cap, "%s", p);
                *what = marks[i];
                return true;
            }
        char *slash = strrchr(p, '/');
        if (!slash || !strcmp(p, "/")) return false;
        if (slash == p)
            p[1] = 0;
        else
            *slash = 0;
    }
}

// --dump-logits FILE may not land in the checkpoint eval reads, in any
// checkpoint of its run folder, nor in any other folder holding a checkpoint
// (another run's), and replaces only an earlier logits dump: a slip of the
// path would otherwise overwrite weights with logits.
static int check_dump_path(const char *dir, const char *dump) {
    char ck[PATH_MAX], run[PATH_MAX], p[PATH_MAX];
    MOE_TRY(moe_ckpt_resolve(dir, ck, sizeof ck, NULL));
    MOE_TRY(resume_run_dir(dir, run, sizeof run));
    const char *hit = moe_path_within(dump, ck) ? ck : NULL;
    DIR *d = !hit && moe_run_exists(run) ? opendir(run) : NULL;
    struct dirent *e;
    while (d && !hit && (e = readdir(d)) != NULL) {
        long step;
        int sfx;
        bool ckpt = moe_ckpt_step_name(e->d_name, &step, &sfx) ||
                    !strncmp(e->d_name, "checkpoint", sizeof "checkpoint" - 1);
        if (ckpt && snprintf(p, sizeof p, "%s/%s", run, e->d_name) < (int)sizeof p &&
            moe_path_within(dump, p))
            hit = p;
    }
    if (d) closedir(d);
    if (hit)
        return moe_fail(MOE_EINVAL,
                        "--dump-logits %s: lies in the checkpoint %s; write the dump outside "
                        "checkpoint folders",
                        dump, hit);
    // the folder FILE goes into exists and is no checkpoint's, nor inside one
    snprintf(p, sizeof p, "%s", dump);
    char *slash = strrchr(p, '/');
    if (!slash)
        snprintf(p, sizeof p, ".");
    else if (slash == p)
        p[1] = 0;
    else
        *slash = 0;
    struct stat fs;
    if (stat(p, &fs) != 0 || !S_ISDIR(fs.st_mode))
        return moe_fail(MOE_EINVAL, "--dump-logits %s: the folder %s does not exist", dump, p);
    const char *what;
    if (in_checkpoint_folder(p, ck, sizeof ck, &what))
        return moe_fail(MOE_EINVAL,
                        "--dump-logits %s: lies in the checkpoint folder %s (it holds %s); write "
                        "the dump outside checkpoint folders",
                        dump, ck, what);
    struct stat st;
    if (stat(dump, &st) == 0 && (!S_ISREG(st.st_mode) || !is_logits_dump(dump)))
        return moe_fail(MOE_EINVAL,
                        "--dump-logits %s: exists and is not an earlier logits dump (tokens, "
                        "task_ids, logits); give a new file name",
                        dump);
    return 0;
}

int moe_cli_eval(int argc, char **argv) {
    const char *dir = NULL, *dump = NULL, *batches_s = NULL, *samples_s = NULL, *budget_s = NULL,
               *quant = NULL;
    long long batches = 8, samples = 20;
    double budget = 0;
    bool int8 = false;
    for (int i = 1; i < argc; i++) {
        int m;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(eval_help, stdout);
            return MOE_EXIT_OK;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--batches", &batches_s)) != 0) {
            if (m < 0) return moe_cli_fail("eval", MOE_EXIT_USAGE, "%s", moe_last_error());
            if (!moe_cli_parse_long(batches_s, 1, 1 << 20, &batches))
                return moe_cli_fail("eval", MOE_EXIT_USAGE, "--batches needs an integer in [1, %d]",
                                    1 << 20);
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--samples", &samples_s)) != 0) {
            if (m < 0) return moe_cli_fail("eval", MOE_EXIT_USAGE, "%s", moe_last_error());
            if (!moe_cli_parse_long(samples_s, 0, 1 << 20, &samples))
                return moe_cli_fail("eval", MOE_EXIT_USAGE, "--samples needs an integer in [0, %d]",
                                    1 << 20);
        } else if ((m = moe_cli_opt_path(argc, argv, &i, "--dump-logits", &dump)) != 0) {
            if (m < 0) return moe_cli_fail("eval", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--expert-budget", &budget_s)) != 0) {
            if (m < 0) return moe_cli_fail("eval", MOE_EXIT_USAGE, "%s", moe_last_error());
            if (!moe_cli_parse_double(budget_s, 0, 1, true, &budget))
                return moe_cli_fail("eval", MOE_EXIT_USAGE,
                                    "--expert-budget needs a share in (0, 1]");
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--quantize", &quant)) != 0) {
            if (m < 0) return moe_cli_fail("eval", MOE_EXIT_USAGE, "%s", moe_last_error());
            if (strcmp(quant, "int8"))
                return moe_cli_fail("eval", MOE_EXIT_USAGE, "--quantize: only int8 is supported");
            int8 = true;
        } else if (argv[i][0] == '-') {
            return moe_cli_unknown_option("eval", argv[i], eval_help);
        } else if (!dir) {
            dir = argv[i];
        } else {
            return moe_cli_fail("eval", MOE_EXIT_USAGE, "more than one checkpoint ('%s', '%s')",
                                dir, argv[i]);
        }
    }
    if (!dir) return moe_cli_fail("eval", MOE_EXIT_USAGE, "no checkpoint folder given");
    moe_config cfg;
    moe_data d;
    moe_model m;
    moe_eval_result r;
    int rc = moe_cli_check_ckpt(dir);
    if (rc == 0) rc = moe_ckpt_config(dir, &cfg);
    if (rc == 0 && dump) rc = check_dump_path(dir, dump);
    if (rc == 0 && dump && cfg.router.type == MOE_ROUTER_EXPERT_CHOICE &&
        cfg.router.ec_fallback != MOE_EC_FALLBACK_TOKEN_CHOICE) // what moe_eval_dump_logits refuses
        rc = moe_fail(MOE_EINVAL,
                      "--dump-logits: %s/config.json: router.type = expert_choice routes over a "
                      "whole batch; the dump compares an export, which needs router.ec_fallback "
                      "= token_choice",
                      dir);
    if (rc == 0 && (budget > 0 || int8)) rc = check_infer_variant(dir, &cfg, budget, int8);
    if (rc < 0) return moe_cli_fail("eval", moe_cli_input_exit_code(rc), "%s", moe_last_error());
    // eval reads only validation batches: with data.val_path the training
    // files need not be there
    if ((rc = moe_data_open_val(&d, &cfg)) < 0)
        return moe_cli_fail("eval", moe_cli_input_exit_code(rc), "%s", moe_last_error());
    // prepare's shards must be of the checkpoint's tokenizer, as train checks
    moe_tokenizer *tok = NULL;
    rc = moe_ckpt_tokenizer(dir, &cfg, &tok);
    if (rc == 0) rc = moe_data_check_tokenizer(&d, cfg.model.tokenizer, tok);
    moe_tok_free(tok);
    if (rc < 0) {
        moe_data_close(&d);
        return moe_cli_fail("eval", moe_cli_input_exit_code(rc), "%s", moe_last_error());
    }
    const long distinct = moe_data_val_distinct_batches(&d);
    if (distinct >= 0 && batches > distinct) {
        char when[64] = "within the first batch"; // fewer windows than one batch's rows
        if (distinct > 0)
            snprintf(when, sizeof when, "after %ld batch%s", distinct, distinct == 1 ? "" : "es");
        fprintf(stderr,
                "moe eval: note: the validation windows start over %s of %d rows; --batches "
                "%lld reads some of them more than once\n",
                when, d.B, batches);
    }
    // Reading the checkpoint is input (exit 2 when unusable); evaluating is not.
    bool loaded = false;
    if ((rc = moe_model_init_eval(&m, &cfg, d.B, d.T, d.n_tasks)) == 0 &&
        (rc = moe_ckpt_load(dir, &m, NULL, NULL)) == 0 && (loaded = true) &&
        (rc = moe_eval(&m, &d, (int)batches, (int)samples, &r)) == 0) {
        moe_eval_print(&r, stdout);
        moe_eval_result_free(&r);
        if (dump && (rc = moe_eval_dump_logits(&m, &d, dir, dump)) == 0)
            printf("\nlogits of validation batch 0 written to %s\n", dump);
        if (rc == 0 && (budget > 0 || int8))
            rc = eval_infer_table(dir, &cfg, &d, (int)batches, budget, int8);
    }
    int code =
        rc < 0 ? moe_cli_fail("eval", loaded ? moe_cli_exit_code(rc) : moe_cli_input_exit_code(rc),
                              "%s", moe_last_error())
               : 0;
    moe_model_free(&m);
    moe_data_close(&d);
    return code;
}
