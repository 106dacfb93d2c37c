// The `moe` command line: subcommand dispatch and the helpers subcommands
// share (option matching, config loading, one-line errors). Only the CLI
// parses argv; the library below it never prints or exits.
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include "moe/config.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>

// The version of CMake's project() and, when the source was a git checkout at
// configure time, `git describe` (both set by CMakeLists.txt).
#ifndef MOE_VERSION
#define MOE_VERSION "0.0.0"
#endif
#ifndef MOE_GIT_DESCRIBE
#define MOE_GIT_DESCRIBE ""
#endif

// Exit codes (DESIGN "CLI"), the same condition giving the same code in every
// command:
//   0  ok
//   1  runtime failure: I/O failure while writing an output (checkpoint, plan,
//      export, results), out of memory, NaN/Inf in training, a failed or stuck
//      MPI peer (comm.timeout_s)
//   2  bad usage or input: unknown, repeated or malformed option, extra
//      argument; a missing, unreadable, non-regular or corrupt input file
//      (config, checkpoint, data, prompts, logits); a config that does not fit
//      (including a memory plan above the available memory without --force)
// (130: interrupted by Ctrl-C after saving a checkpoint.)
enum { MOE_EXIT_OK = 0, MOE_EXIT_RUNTIME = 1, MOE_EXIT_USAGE = 2 };

// Runs `moe argv[1] ...` and returns the process exit status. Reentrant
// enough for tests: no global option state survives a call.
int moe_cli_main(int argc, char **argv);

// Subcommands: argv[0] is the subcommand name.
int moe_cli_route(int argc, char **argv);
int moe_cli_train(int argc, char **argv);
int moe_cli_eval(int argc, char **argv);
int moe_cli_ablate(int argc, char **argv);
int moe_cli_plan(int argc, char **argv);
int moe_cli_generate(int argc, char **argv);
int moe_cli_export(int argc, char **argv);
int moe_cli_prepare(int argc, char **argv);
int moe_cli_report(int argc, char **argv);

// Library status -> exit code: numeric failure, memory and I/O at run time 1,
// anything else (bad input, config, file contents) 2.
int moe_cli_exit_code(int rc);
// Status of reading an input (checkpoint, data, prompts) -> exit code: out of
// memory 1, anything else, an I/O error included, 2.
int moe_cli_input_exit_code(int rc);
// Prints "moe CMD: message" (one line) to stderr, records the message as the
// last error (moe_last_error) and returns exit_code.
int moe_cli_fail(const char *cmd, int exit_code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

// Matches argv[*i] against an option that takes a value, as "--name VALUE" or
// "--name=VALUE". Returns 1 and sets *value (advancing *i past a separate
// value), 0 if argv[*i] is another option, -1 if the value is missing (a
// message is recorded with moe_fail).
int moe_cli_opt_value(int argc, char **argv, int *i, const char *name, const char **value);
// The one rule of every subcommand: an option is given at most once (--set and
// --grid repeat). Like moe_cli_opt_value, but -1 with "NAME given twice" when
// *value is already set (callers start it at NULL).
int moe_cli_opt_once(int argc, char **argv, int *i, const char *name, const char **value);
// moe_cli_opt_once for an option naming a file or folder: an empty value is
// refused too (-1, "NAME needs a path, not an empty string"), since "" would
// otherwise fail later as a runtime error or, joined as "%s/file", name "/".
int moe_cli_opt_path(int argc, char **argv, int *i, const char *name, const char **value);
// A flag without value: 1 when arg is name (sets *on), 0 when it is not, -1
// (message recorded) when *on was already set.
int moe_cli_flag(const char *arg, const char *name, bool *on);

// An unknown option of command cmd: records (moe_fail, MOE_EINVAL returned)
// "unknown option 'ARG' (did you mean --x? see moe CMD --help)", the
// suggestion taken from the --options named in help. moe_cli_unknown_option
// also prints it (moe_cli_fail) and returns exit code 2.
int moe_cli_option_error(const char *cmd, const char *arg, const char *help);
int moe_cli_unknown_option(const char *cmd, const char *arg, const char *help);

// argv[0] of the running `moe` (as invoked: "moe", "./moe", "build/moe"), for
// commands printed to be run again.
const char *moe_cli_program(void);
// s as one shell word into out (cap bytes): unchanged when it holds only safe
// characters, else in single quotes.
void moe_cli_shell_quote(char *out, size_t cap, const char *s);

// MPI launches (mpirun, srun): true when the environment says this process is
// one rank of a job. moe_cli_mpi_world initialises MPI and wraps its world;
// moe_cli_mpi_finalize(NULL) does nothing.
struct moe_comm;
bool moe_cli_mpi_launched(void);
// MOE_EINVAL (ranks_per_node refused alike on every rank) finalises MPI.
int moe_cli_mpi_world(struct moe_comm **world, int ranks_per_node);
// This process's rank as the launcher's environment tells it, before MPI_Init
// (0 when not launched by one): who prints a failure every rank shares.
int moe_cli_mpi_rank(void);
void moe_cli_mpi_finalize(struct moe_comm *world);

// Ctrl-C and SIGTERM around a long command: moe_cli_stop_catch clears the flag
// it returns and installs handlers that only set it (the library polls it,
// stops at a safe point and cleans up); a second signal ends the process at
// once (the default action). moe_cli_stop_release restores the handlers.
volatile sig_atomic_t *moe_cli_stop_catch(void);
void moe_cli_stop_release(void);

// --steps N of train and ablate: N must be a valid train.steps, and no --set
// among sets (but skip, the one --steps became) may set train.steps too, since
// one of the two would silently win. Returns 0 or MOE_EINVAL with a message.
int moe_cli_check_steps(const char *steps, const char *const *sets, int n_sets, const char *skip);

// Parses a base-10 integer in [lo, hi]; false on junk (a blank on either
// side included) or out of range.
bool moe_cli_parse_long(const char *s, long long lo, long long hi, long long *out);
// The same for the value s of option name, with the message: "--step expects a
// non-negative integer, got ' 5'", or "--step 1e99 is out of range: expected
// 0..9223372036854775807". Returns 0 or MOE_EINVAL.
int moe_cli_parse_long_opt(const char *name, const char *s, long long lo, long long hi,
                           long long *out);
// Parses a finite decimal number in [lo, hi] (lo_open: lo itself excluded);
// false on junk, nan, inf or out of range. Every numeric CLI option uses it.
bool moe_cli_parse_double(const char *s, double lo, double hi, bool lo_open, double *out);

// Checks that CKPT_DIR is a readable checkpoint (config.json, and
// model.safetensors or a sharded index, regular files that open) before a
// command starts work, so an unusable checkpoint is bad input (exit 2) in every
// command. Returns 0 or a negative MOE_E* code with a message.
int moe_cli_check_ckpt(const char *dir);

// Fills cfg with the defaults, loads the JSON file path over them, applies
// the n_sets "key=value" overrides in order and checks the result. Returns 0
// or a negative MOE_E* code (the message names the key and where it was set).
int moe_cli_load_config(moe_config *cfg, const char *path, const char *const *sets, int n_sets);
// The same, and the notes of moe_config_ignored (keys set but ignored) into
// notes (at most max, *n_notes of them) for the command to print.
int moe_cli_load_config_noted(moe_config *cfg, const char *path, const char *const *sets,
                              int n_sets, char (*notes)[256], int max, int *n_notes);

#endif
