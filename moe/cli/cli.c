// `moe` subcommand dispatch, help and version, and the small argv and config
// helpers the subcommands share. Exit codes: 0 ok, 1 runtime failure, 2 bad
// usage/input.
#include "moe/cli/cli.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/parse.h"
#include "moe/safetensors.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command commands[] = {
    {"train", moe_cli_train, "train a model from a JSON config"},
    {"eval", moe_cli_eval, "evaluate a checkpoint: loss and accuracy per task, expert usage"},
    {"generate", moe_cli_generate,
     "generate for one task, loading only the experts it routes to (KV cache)"},
    {"export", moe_cli_export, "write a Hugging Face Mixtral folder from a checkpoint"},
    {"prepare", moe_cli_prepare, "tokenize text files into llm.c shards (train/val by document)"},
    {"ablate", moe_cli_ablate, "train a grid of config variants and tabulate the results"},
    {"plan", moe_cli_plan, "memory per rank and all-to-all traffic of a config on a machine"},
    {"route", moe_cli_route, "route logits from a safetensors file into a dispatch plan"},
    {"report", moe_cli_report, "an HTML page of charts (and CSVs) from a run folder's metrics"},
};
enum { N_COMMANDS = sizeof commands / sizeof *commands };

static void usage(FILE *fp) {
    fprintf(fp, "usage: moe COMMAND [OPTIONS]\n"
                "\n"
                "commands:\n");
    for (int i = 0; i < N_COMMANDS; i++)
        fprintf(fp, "  %-10s %s\n", commands[i].name, commands[i].summary);
    fprintf(fp, "\n"
                "  moe COMMAND --help   options of one command\n"
                "  moe --version        print the version\n"
                "\n"
                "exit status: 0 ok, 1 runtime failure, 2 bad usage or input\n");
}

int moe_cli_exit_code(int rc) {
    return rc == MOE_ENUMERIC || rc == MOE_ENOMEM || rc == MOE_EIO ? MOE_EXIT_RUNTIME
                                                                   : MOE_EXIT_USAGE;
}

int moe_cli_input_exit_code(int rc) {
    return rc == MOE_ENOMEM ? MOE_EXIT_RUNTIME : MOE_EXIT_USAGE;
}

int moe_cli_fail(const char *cmd, int exit_code, const char *fmt, ...) {
    // Format first: fmt's arguments may point into the last-error buffer.
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_fail(MOE_EINVAL, "%s", msg); // so in-process callers (tests) can read it
    fprintf(stderr, "moe %s: %s\n", cmd, msg);
    return exit_code;
}

int moe_cli_opt_value(int argc, char **argv, int *i, const char *name, const char **value) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0) return 0;
    if (a[n] == '=') {
        *value = a + n + 1;
        return 1;
    }
    if (a[n] != '\0') return 0;
    if (*i + 1 >= argc) return moe_fail(MOE_EINVAL, "%s needs a value", name), -1;
    *value = argv[++*i];
    return 1;
}

int moe_cli_opt_once(int argc, char **argv, int *i, const char *name, const char **value) {
    const char *prev = *value;
    int m = moe_cli_opt_value(argc, argv, i, name, value);
    if (m > 0 && prev) return moe_fail(MOE_EINVAL, "%s given twice", name), -1;
    return m;
}

int moe_cli_opt_path(int argc, char **argv, int *i, const char *name, const char **value) {
    int m = moe_cli_opt_once(argc, argv, i, name, value);
    if (m > 0 && !**value)
        return moe_fail(MOE_EINVAL, "%s needs a path, not an empty string", name), -1;
    return m;
}

int moe_cli_flag(const char *arg, const char *name, bool *on) {
    if (strcmp(arg, name) != 0) return 0;
    if (*on) return moe_fail(MOE_EINVAL, "%s given twice", name), -1;
    *on = true;
    return 1;
}

// strto* skip leading blanks and *end catches only trailing ones: ' 5' would
// pass as 5 while '5 ' fails, so a blank first is refused too.
static bool blank_first(const char *s) {
    return isspace((unsigned char)s[0]);
}

bool moe_cli_parse_double(const char *s, double lo, double hi, bool lo_open, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    // strtod also reads "nan", "inf" and hex floats: only finite values pass.
    if (end == s || *end || blank_first(s) || !isfinite(v) || v < lo || v > hi ||
        (lo_open && v == lo))
        return false;
    *out = v;
    return true;
}

// 0: s is a base-10 integer in [lo, hi]; 1: it is no integer (blank, junk);
// 2: an integer out of the range, or beyond long long.
static int parse_ll(const char *s, long long lo, long long hi, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || blank_first(s)) return 1;
    if (errno || v < lo || v > hi) return 2;
    *out = v;
    return 0;
}

bool moe_cli_parse_long(const char *s, long long lo, long long hi, long long *out) {
    return parse_ll(s, lo, hi, out) == 0;
}

int moe_cli_parse_long_opt(const char *name, const char *s, long long lo, long long hi,
                           long long *out) {
    const int why = parse_ll(s, lo, hi, out);
    const char *what = lo == 0   ? "a non-negative integer"
                       : lo == 1 ? "a positive integer"
                                 : "an integer";
    if (why == 1) return moe_fail(MOE_EINVAL, "%s expects %s, got '%.64s'", name, what, s);
    if (why == 2)
        return moe_fail(MOE_EINVAL, "%s %.64s is out of range: expected %lld..%lld", name, s, lo,
                        hi);
    return 0;
}

int moe_cli_load_config(moe_config *cfg, const char *path, const char *const *sets, int n_sets) {
    int n;
    return moe_cli_load_config_noted(cfg, path, sets, n_sets, NULL, 0, &n);
}

int moe_cli_load_config_noted(moe_config *cfg, const char *path, const char *const *sets,
                              int n_sets, char (*notes)[256], int max, int *n_notes) {
    *n_notes = 0;
    moe_config_default(cfg);
    moe_config_src *src = moe_config_src_new();
    int rc = moe_config_load(cfg, src, path);
    for (int i = 0; rc == 0 && i < n_sets; i++)
        rc = moe_config_set(cfg, src, sets[i]);
    if (rc == 0) rc = moe_config_check(cfg, src);
    if (rc == 0 && notes) *n_notes = moe_config_ignored(cfg, src, notes, max);
    moe_config_src_free(src);
    return rc;
}

int moe_cli_check_ckpt(const char *dir) {
    if (!*dir) return moe_fail(MOE_EINVAL, "the checkpoint folder name is empty");
    char rdir[PATH_MAX];
    MOE_TRY(moe_ckpt_resolve(dir, rdir, sizeof rdir, NULL)); // the readers' resolver
    moe_config cfg;
    MOE_TRY(moe_ckpt_config(dir, &cfg));
    moe_st_set *s; // every header (and the index) checked, no tensor read
    MOE_TRY(moe_st_set_open(rdir, &s));
    moe_st_set_close(s);
    return 0;
}

static const command *find_command(const char *name) {
    for (int i = 0; i < N_COMMANDS; i++)
        if (!strcmp(commands[i].name, name)) return &commands[i];
    return NULL;
}

// "moe: unknown command 'trian' (did you mean train? ...)": one line.
static int unknown_command(const char *name) {
    const char *names[N_COMMANDS];
    for (int i = 0; i < N_COMMANDS; i++)
        names[i] = commands[i].name;
    const char *best = moe_nearest(name, names, N_COMMANDS);
    char hint[64] = "";
    if (best) snprintf(hint, sizeof hint, "did you mean %s? ", best);
    moe_fail(MOE_EINVAL, "unknown command '%.64s'", name);
    fprintf(stderr, "moe: unknown command '%.64s' (%smoe --help lists the commands)\n", name, hint);
    return MOE_EXIT_USAGE;
}

int moe_cli_option_error(const char *cmd, const char *arg, const char *help) {
    // The options a command takes are the "--name" words of its help text:
    // one list, which cannot drift from what --help shows. The help also
    // names other programs' and commands' options (mpirun --mca, moe eval
    // --dump-logits): the word itself is no suggestion, since it was refused.
    char word[64]; // "--stepz=3": the name alone is compared
    snprintf(word, sizeof word, "%.*s", (int)strcspn(arg, "="), arg);
    const char *opts[64];
    char names[64][32];
    int n = 0;
    for (const char *p = help; (p = strstr(p, "--")) != NULL && n < 64;) {
        size_t len = 2 + strspn(p + 2, "abcdefghijklmnopqrstuvwxyz0123456789-");
        if (len > 2 && len < sizeof names[0] &&
            (strlen(word) != len || strncmp(p, word, len) != 0)) {
            snprintf(names[n], sizeof names[0], "%.*s", (int)len, p);
            opts[n] = names[n];
            bool dup = false;
            for (int i = 0; i < n && !dup; i++)
                dup = !strcmp(names[i], names[n]);
            if (!dup) n++;
        }
        p += len;
    }
    const char *best = moe_nearest(word, opts, n);
    char hint[64] = "";
    if (best) snprintf(hint, sizeof hint, "did you mean %s? ", best);
    return moe_fail(MOE_EINVAL, "unknown option '%s' (%ssee moe %s --help)", arg, hint, cmd);
}

int moe_cli_unknown_option(const char *cmd, const char *arg, const char *help) {
    moe_cli_option_error(cmd, arg, help);
    return moe_cli_fail(cmd, MOE_EXIT_USAGE, "%s", moe_last_error());
}

static const char *program = "moe";

const char *moe_cli_program(void) {
    return program;
}

void moe_cli_shell_quote(char *out, size_t cap, const char *s) {
    if (s[0] &&
        strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-=:+,") ==
            strlen(s)) {
        snprintf(out, cap, "%s", s);
        return;
    }
    size_t n = 0; // 'it'\''s': a quote inside ends the quoting, escapes, reopens
    if (cap) out[n++] = '\'';
    for (const char *p = s; *p && n + 5 < cap; p++) {
        if (*p == '\'') {
            memcpy(out + n, "'\\''", 4);
            n += 4;
        } else {
            out[n++] = *p;
        }
    }
    if (n + 1 < cap) out[n++] = '\'';
    out[n < cap ? n : cap - 1] = 0;
}

// Every command but train runs in one process: under mpirun/srun each rank
// would run it whole (the same files written by each, the output printed once
// per rank). Refused on more than one rank, by rank 0; one rank may run it.
static int single_process(const char *cmd) {
    if (!moe_cli_mpi_launched()) return MOE_EXIT_OK;
    struct moe_comm *world = NULL;
    int rc = moe_cli_mpi_world(&world, 0), code = MOE_EXIT_OK;
    if (rc < 0) {
        code = moe_cli_fail(cmd, moe_cli_exit_code(rc), "%s", moe_last_error());
    } else if (moe_comm_size(world) > 1) {
        if (moe_comm_rank(world) == 0)
            moe_cli_fail(cmd, MOE_EXIT_USAGE,
                         "runs in one process; launched on %d MPI ranks, each would run it whole "
                         "(and write the same outputs): run moe %s without mpirun/srun "
                         "(only moe train runs over ranks)",
                         moe_comm_size(world), cmd);
        code = MOE_EXIT_USAGE;
    }
    moe_cli_mpi_finalize(world);
    return code;
}

int moe_cli_main(int argc, char **argv) {
    if (argc > 0 && argv[0] && argv[0][0]) program = argv[0];
    if (argc < 2) {
        fprintf(stderr, "moe: no command given (moe --help lists the commands)\n");
        return MOE_EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        // `moe help route` = `moe route --help`; `moe help help` and `moe help
        // --help` ask for this usage, as `moe help` does
        const bool about_help = argc > 2 && (!strcmp(argv[2], "help") ||
                                             !strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"));
        if (argc > 2 && strcmp(cmd, "help") == 0 && !about_help) {
            const command *c = find_command(argv[2]);
            if (!c) return unknown_command(argv[2]);
            char *help_argv[] = {argv[2], "--help", NULL};
            return c->run(2, help_argv);
        }
        usage(stdout);
        return MOE_EXIT_OK;
    }
    if (!strcmp(cmd, "--version")) {
        if (argc > 2) {
            fprintf(stderr, "moe: --version takes no argument ('%.64s')\n", argv[2]);
            return MOE_EXIT_USAGE;
        }
        printf("moe %s%s%s\n", MOE_VERSION, MOE_GIT_DESCRIBE[0] ? " (git " : "",
               MOE_GIT_DESCRIBE[0] ? MOE_GIT_DESCRIBE ")" : "");
        return MOE_EXIT_OK;
    }
    const command *c = find_command(cmd);
    if (!c) return unknown_command(cmd);
    // --help (-h) anywhere after the command wins, whatever else the line
    // holds, as `moe help COMMAND` and `moe --help` ignore what follows them:
    // the command's help, exit 0. One rule here, not one per command parser.
    char *help_argv[] = {argv[1], "--help", NULL}, **run_argv = argv + 1;
    int run_argc = argc - 1;
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            run_argc = 2;
            run_argv = help_argv;
        }
    if (moe_map_guard_install() < 0)
        return moe_cli_fail(cmd, MOE_EXIT_RUNTIME, "%s", moe_last_error());
    int code = strcmp(cmd, "train") ? single_process(cmd) : MOE_EXIT_OK;
    if (code != MOE_EXIT_OK) return code;
    int rc = c->run(run_argc, run_argv);
    // Results on stdout are output too: a full disk or a closed pipe there is
    // a failure, not a silent exit 0.
    if (fflush(stdout) != 0 || ferror(stdout)) {
        int err = errno;
        clearerr(stdout);
        if (rc == MOE_EXIT_OK)
            rc = moe_cli_fail(cmd, MOE_EXIT_RUNTIME, "writing to standard output failed: %s",
                              strerror(err));
    }
    return rc;
}

static volatile sig_atomic_t stop_flag;
static void (*old_int)(int), (*old_term)(int);

static void on_stop_signal(int sig) {
    stop_flag = 1;
    signal(sig, SIG_DFL);
}

volatile sig_atomic_t *moe_cli_stop_catch(void) {
    stop_flag = 0;
    old_int = signal(SIGINT, on_stop_signal);
    old_term = signal(SIGTERM, on_stop_signal);
    return &stop_flag;
}

void moe_cli_stop_release(void) {
    signal(SIGINT, old_int);
    signal(SIGTERM, old_term);
}

int moe_cli_check_steps(const char *steps, const char *const *sets, int n_sets, const char *skip) {
    for (int i = 0; i < n_sets; i++)
        if (sets[i] != skip && !strncmp(sets[i], "train.steps=", 12))
            return moe_fail(MOE_EINVAL, "--steps %s and --set %s both set train.steps: give one",
                            steps, sets[i]);
    moe_config scratch; // named as --steps, not as the --set it becomes
    moe_config_default(&scratch);
    char set[128];
    snprintf(set, sizeof set, "train.steps=%.100s", steps);
    if (moe_config_set(&scratch, NULL, set) < 0) {
        const char *msg = moe_last_error();
        return moe_fail(MOE_EINVAL, "--steps %s: %s", steps,
                        msg + (strncmp(msg, "--set: ", 7) ? 0 : 7));
    }
    return 0;
}
