// The `moe` binary's consistency rules (README "Exit codes"): repeated options,
// extra positionals and unknown options are one-line errors with exit 2 in
// every subcommand; a missing checkpoint is exit 2 in every command; numbers
// must be finite; prompt files are bounded; the memory plan refuses a run that
// cannot fit (exit 1, --force overrides); output write errors are exit 1.
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[600];

static int run_moe(const char *args) {
    return tu_run_moe(dir, args);
}

static const char *err_text(void) {
    return tu_file_text(dir, "err.txt");
}

// stderr is one line naming the subcommand.
static void assert_one_line_error(const char *cmd, const char *needle) {
    const char *e = err_text();
    char prefix[64];
    snprintf(prefix, sizeof prefix, "moe %s: ", cmd);
    ck_assert_msg(strncmp(e, prefix, strlen(prefix)) == 0, "stderr '%s' lacks '%s'", e, prefix);
    ck_assert_msg(strchr(e, '\n') == e + strlen(e) - 1, "stderr is not one line: '%s'", e);
    ck_assert_msg(strstr(e, needle) != NULL, "stderr '%s' lacks '%s'", e, needle);
}

static void write_file(const char *name, const void *data, size_t n) {
    char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(data, 1, n, f), n);
    ck_assert_int_eq(fclose(f), 0);
}

static void setup(void) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
}

#define TINY MOE_SOURCE_DIR "/configs/tiny.json"

START_TEST(test_cli_option_given_twice_is_refused) {
    static const struct {
        const char *cmd, *args, *opt;
    } cases[] = {
        {"plan", "plan " TINY " --nodes 1 --nodes 2", "--nodes given twice"},
        {"train", "train " TINY " --out a --out b", "--out given twice"},
        {"train", "train " TINY " --quiet --quiet", "--quiet given twice"},
        {"eval", "eval ck --batches 1 --batches=2", "--batches given twice"},
        {"generate", "generate ck --task copy --task sort --prompt x", "--task given twice"},
        {"export", "export ck --hf a --hf b", "--hf given twice"},
        {"ablate", "ablate " TINY " --grid router.top_k=1,2 --steps 1 --steps 2",
         "--steps given twice"},
        {"route", "route --example --example", "--example given twice"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ck_assert_int_eq(run_moe(cases[i].args), 2);
        assert_one_line_error(cases[i].cmd, cases[i].opt);
    }
}
END_TEST

START_TEST(test_cli_extra_positional_is_refused) {
    ck_assert_int_eq(run_moe("eval ck1 ck2"), 2);
    assert_one_line_error("eval", "more than one checkpoint ('ck1', 'ck2')");
    ck_assert_int_eq(run_moe("plan " TINY " " TINY), 2);
    assert_one_line_error("plan", "more than one config file");
    ck_assert_int_eq(run_moe("route --example stray"), 2);
    assert_one_line_error("route", "unknown argument 'stray'");
    ck_assert_int_eq(run_moe("--version stray"), 2);
    ck_assert_str_eq(err_text(), "moe: --version takes no argument ('stray')\n");
    // a config file named ".json" names no run: runs/ itself would be the folder
    char p[700];
    snprintf(p, sizeof p, "cp " TINY " '%s/.json'", dir);
    ck_assert_int_eq(system(p), 0);
    snprintf(p, sizeof p, "train '%s/.json' --steps 1", dir);
    ck_assert_int_eq(run_moe(p), 2);
    assert_one_line_error("train", "no run name in the file name: give --out DIR");
}
END_TEST

START_TEST(test_cli_unknown_option_and_missing_value_are_refused) {
    static const char *cmds[] = {"train " TINY,  "eval ck",    "generate ck", "export ck",
                                 "ablate " TINY, "plan " TINY, "route",       "prepare x"};
    for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
        char args[256], name[16];
        snprintf(args, sizeof args, "%s --bogus", cmds[i]);
        sscanf(cmds[i], "%15s", name);
        ck_assert_int_eq(run_moe(args), 2);
        assert_one_line_error(name, "'--bogus'");
    }
    ck_assert_int_eq(run_moe("plan " TINY " --nodes"), 2);
    assert_one_line_error("plan", "--nodes needs a value");
}
END_TEST

// An unknown option that the help text names as another program's or
// command's (mpirun --mca in train's, moe eval --dump-logits in export's) was
// suggested as itself: "unknown option '--mca' (did you mean --mca? ...)".
START_TEST(test_cli_unknown_option_is_not_suggested_as_itself) {
    ck_assert_int_eq(run_moe("train " TINY " --mca x"), 2);
    ck_assert_str_eq(err_text(), "moe train: unknown option '--mca' (see moe train --help)\n");
    ck_assert_int_eq(run_moe("export ck --hf out --dump-logits=3"), 2);
    ck_assert_str_eq(err_text(),
                     "moe export: unknown option '--dump-logits=3' (see moe export --help)\n");
    ck_assert_int_eq(run_moe("train " TINY " --stepz=3"), 2); // a near option still is
    assert_one_line_error("train", "unknown option '--stepz=3' (did you mean --steps? ");
}
END_TEST

// `moe help help` and `moe help --help` print the usage (exit 0), as `moe
// help` does; they said "unknown command 'help'" (exit 2).
START_TEST(test_cli_help_about_help_prints_the_usage) {
    static const char *args[] = {"help help", "help --help", "help -h"};
    for (size_t i = 0; i < sizeof args / sizeof *args; i++) {
        ck_assert_msg(run_moe(args[i]) == 0, "%s: %s", args[i], err_text());
        ck_assert_str_eq(err_text(), "");
        ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "usage: moe COMMAND"));
    }
    ck_assert_int_eq(run_moe("help nope"), 2);
}
END_TEST

// --help (-h) wins over whatever else the line holds, in every command as in
// `moe help CMD extra` and `moe --help extra`: the command's help on stdout,
// nothing on stderr, exit 0. moe route said "unknown argument 'extra'" (exit 2)
// and eval, export, prepare, plan, ablate and report refused an unknown option
// before a --help.
START_TEST(test_cli_help_wins_over_the_rest_of_the_line) {
    static const char *cmds[] = {"train", "eval", "generate", "export", "prepare",
                                 "route", "plan", "ablate",   "report"};
    static const char *forms[] = {"%s --help extra", "%s -h --bogus", "%s --bogus --help",
                                  "%s extra --help", "help %s extra"};
    for (size_t c = 0; c < sizeof cmds / sizeof *cmds; c++)
        for (size_t f = 0; f < sizeof forms / sizeof *forms; f++) {
            char args[64], usage[64];
            snprintf(args, sizeof args, forms[f], cmds[c]);
            snprintf(usage, sizeof usage, "usage: moe %s ", cmds[c]);
            ck_assert_msg(run_moe(args) == 0, "moe %s: %s", args, err_text());
            ck_assert_str_eq(err_text(), "");
            ck_assert_msg(!strncmp(tu_file_text(dir, "out.txt"), usage, strlen(usage)),
                          "moe %s printed '%.80s'", args, tu_file_text(dir, "out.txt"));
        }
    ck_assert_int_eq(run_moe("--help extra"), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "usage: moe COMMAND"));
}
END_TEST

// moe prepare's usage errors say what was expected: did-you-mean for an
// unknown option, the --doc values, what --tokenizer takes, an option where a
// path belongs (no folder named --quiet), and validation advice that fits.
static int prepare_a(const char *opts) { // prepare DIR/a.txt OPTS
    char args[2000];
    snprintf(args, sizeof args, "prepare '%s/a.txt' %s", dir, opts);
    return run_moe(args);
}

START_TEST(test_cli_prepare_messages_say_what_is_expected) {
    write_file("a.txt", "one line\nanother\n", 17);
    char out[800], opts[1000];
    snprintf(out, sizeof out, "--out '%s/o'", dir);
    snprintf(opts, sizeof opts, "%s --quite", out);
    ck_assert_int_eq(prepare_a(opts), 2);
    assert_one_line_error("prepare", "did you mean --quiet?");
    snprintf(opts, sizeof opts, "%s --doc para", out);
    ck_assert_int_eq(prepare_a(opts), 2);
    assert_one_line_error("prepare", "--doc para: expected file, paragraph or line");
    snprintf(opts, sizeof opts, "%s --tokenizer byte", out);
    ck_assert_int_eq(prepare_a(opts), 2);
    assert_one_line_error("prepare", "--tokenizer takes bytes or the path of a SentencePiece");
    ck_assert_int_eq(prepare_a("--out --quiet"), 2);
    assert_one_line_error("prepare", "--out needs a value, got the option '--quiet'");
    ck_assert_int_ne(access("--quiet", F_OK), 0); // no folder made where moe ran
    snprintf(opts, sizeof opts, "%s --quiet", out);
    ck_assert_int_eq(prepare_a(opts), 2);
    assert_one_line_error("prepare", "use --doc paragraph or line, more text");
    snprintf(opts, sizeof opts, "%s --doc line --quiet --seed 3", out);
    ck_assert_int_eq(prepare_a(opts), 2);
    assert_one_line_error("prepare", "--doc line, --val-fraction 0.1): use more text");
    snprintf(opts, sizeof opts, "%s --doc line --quiet --val-fraction 0", out);
    ck_assert_int_eq(prepare_a(opts), 0);
}
END_TEST

START_TEST(test_cli_non_finite_and_negative_numbers_are_refused) {
    static const char *args[] = {"plan " TINY " --latency-us nan,5",
                                 "plan " TINY " --latency-us 2,inf",
                                 "plan " TINY " --link-gbps -1,100",
                                 "plan " TINY " --link-gbps 0x1p3,1e999",
                                 "eval ck --expert-budget nan",
                                 "generate ck --task copy --prompt x --temperature nan",
                                 "generate ck --task copy --prompt x --temperature -1"};
    for (size_t i = 0; i < sizeof args / sizeof *args; i++) {
        ck_assert_int_eq(run_moe(args[i]), 2);
        ck_assert_ptr_null(strstr(tu_file_text(dir, "out.txt"), "nan"));
    }
    ck_assert_int_eq(run_moe("plan " TINY " --set parallel.ep=2 --latency-us 1.5,4"), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "1.5 us"));
}
END_TEST

// moe plan's placement model: --skew a share in [0, 1), --load one weight per
// expert, not both; a good one prints the per-rank table.
START_TEST(test_cli_plan_placement_options_are_checked) {
    ck_assert_int_eq(run_moe("plan " TINY " --set parallel.ep=4 --skew 1.5"), 2);
    assert_one_line_error("plan", "--skew needs a share");
    ck_assert_int_eq(run_moe("plan " TINY " --set parallel.ep=4 --load 1,2"), 2);
    assert_one_line_error("plan", "--load has 2 weights for 8 experts");
    ck_assert_int_eq(run_moe("plan " TINY " --set parallel.ep=4 --load 1,,2"), 2);
    assert_one_line_error("plan", "--load needs");
    ck_assert_int_eq(run_moe("plan " TINY " --set parallel.ep=4 --skew 0.5 --load 1,1,1,1,1,1,1,1"),
                     2);
    assert_one_line_error("plan", "give one of them");
    ck_assert_int_eq(run_moe("plan " TINY " --set parallel.ep=4 --skew 0.5"), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "max/mean"));
}
END_TEST

// A checkpoint folder without its model file, and one that does not exist:
// exit 2 in eval, export, generate and train --resume alike.
START_TEST(test_cli_missing_checkpoint_is_exit_2_in_every_command) {
    char args[2048], ck[700];
    snprintf(args, sizeof args,
             "train " TINY " --set model.d_model=32 --set model.n_layers=1 --set model.d_ff=32 "
             "--set model.seq_len=16 --set train.batch_size=2 --set train.eval_every=0 "
             "--steps 1 --quiet --out '%s/run'",
             dir);
    ck_assert_int_eq(run_moe(args), 0);
    snprintf(ck, sizeof ck, "%s/run/checkpoint", dir);
    char model[800];
    snprintf(model, sizeof model, "%s/model.safetensors", ck);
    ck_assert_int_eq(unlink(model), 0);
    for (int missing_dir = 0; missing_dir < 2; missing_dir++) {
        const char *c = missing_dir ? "/nonexistent/checkpoint" : ck;
        const char *fmts[] = {"eval '%s'", "export '%s' --hf '%s/hf'",
                              "generate '%s' --task copy --prompt ab=",
                              "train " TINY " --resume '%s' --out '%s/r2' --quiet"};
        const char *names[] = {"eval", "export", "generate", "train"};
        for (int i = 0; i < 4; i++) {
            snprintf(args, sizeof args, fmts[i], c, dir);
            ck_assert_msg(run_moe(args) == 2, "%s: exit %d, expected 2 (%s)", names[i],
                          run_moe(args), err_text());
            assert_one_line_error(names[i], missing_dir ? "nonexistent" : "model.safetensors");
        }
    }
}
END_TEST

START_TEST(test_cli_generate_input_must_be_a_bounded_text_file) {
    char args[1024];
    snprintf(args, sizeof args, "generate ck --task copy --input '%s'", dir);
    ck_assert_int_eq(run_moe(args), 2);
    assert_one_line_error("generate", "not a regular file");
    ck_assert_int_eq(run_moe("generate ck --task copy --input /dev/zero"), 2);
    assert_one_line_error("generate", "not a regular file");
    write_file("nul.txt", "ab=\nc\0d=\n", 9);
    snprintf(args, sizeof args, "generate ck --task copy --input '%s/nul.txt'", dir);
    ck_assert_int_eq(run_moe(args), 2);
    assert_one_line_error("generate", "nul.txt:2: NUL byte at column 2");
    size_t n = (2u << 20) + 10;
    char *big = malloc(n);
    ck_assert_ptr_nonnull(big);
    memset(big, 'a', n);
    write_file("long.txt", big, n);
    free(big);
    snprintf(args, sizeof args, "generate ck --task copy --input '%s/long.txt'", dir);
    ck_assert_int_eq(run_moe(args), 2);
    assert_one_line_error("generate", "long.txt:1: line longer than");
}
END_TEST

// MOE_MEM_LIMIT stands for the machine's available memory: a plan above it is
// refused before the run folder exists; --force starts it anyway.
START_TEST(test_cli_train_refuses_a_run_above_available_memory) {
    char args[1024], out[700];
    struct stat st;
    snprintf(out, sizeof out, "%s/big", dir);
    snprintf(args, sizeof args, "train " TINY " --steps 1 --quiet --out '%s'", out);
    setenv("MOE_MEM_LIMIT", "1000000", 1);
    ck_assert_int_eq(run_moe(args), 1);
    assert_one_line_error("train", "the memory plan predicts");
    ck_assert_ptr_nonnull(strstr(err_text(), "1000000 bytes) are available (MOE_MEM_LIMIT)"));
    ck_assert_ptr_nonnull(strstr(err_text(), "--force"));
    ck_assert_int_ne(stat(out, &st), 0);
    snprintf(args, sizeof args, "train " TINY " --steps 1 --quiet --force --out '%s'", out);
    ck_assert_int_eq(run_moe(args), 0);
    setenv("MOE_MEM_LIMIT", "1000000000000", 1);
    snprintf(args, sizeof args, "train " TINY " --steps 1 --quiet --out '%s/ok'", dir);
    ck_assert_int_eq(run_moe(args), 0);
    setenv("MOE_MEM_LIMIT", "lots", 1);
    snprintf(args, sizeof args, "train " TINY " --steps 1 --quiet --out '%s/ok2'", dir);
    ck_assert_int_eq(run_moe(args), 2);
    assert_one_line_error("train", "MOE_MEM_LIMIT='lots'");
    unsetenv("MOE_MEM_LIMIT");
}
END_TEST

START_TEST(test_cli_route_example_refuses_the_keys_it_fixes) {
    ck_assert_int_eq(run_moe("route --example --set router.top_k=1"), 2);
    assert_one_line_error("route", "--set router.top_k=1 cannot apply");
    ck_assert_int_eq(run_moe("route --example --set router.min_capacity=1"), 0);
}
END_TEST

// train.compute = bf16 is the GPU's tensor-core path: moe train on the CPU
// refuses it, moe plan of a GPU run keeps it.
START_TEST(test_cli_bf16_compute_is_refused_on_the_cpu) {
    ck_assert_int_eq(run_moe("train " TINY " --set train.compute=bf16 --dry-run --out r"), 2);
    assert_one_line_error("train", "--set train.compute: train.compute = bf16 needs --device cuda");
    ck_assert_int_eq(
        run_moe("plan " TINY
                " --set train.device=cuda --set train.compute=bf16 --set model.d_model=32"),
        0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "train.device = cuda"));
}
END_TEST

// Integer options of the shared parser refuse a blank before the number as
// they refuse one after it (strtoll skipped it); route's summary names the
// group-limited routing it applied.
START_TEST(test_cli_integer_options_refuse_blanks) {
    ck_assert_int_eq(run_moe("plan " TINY " --nodes ' 2'"), 2);
    ck_assert_int_eq(run_moe("plan " TINY " --nodes '2 '"), 2);
    ck_assert_int_eq(run_moe("plan " TINY " --link-gbps ' 400,100'"), 2);
    ck_assert_int_eq(run_moe("route --example --train --step ' 5'"), 2);
    assert_one_line_error("route", "--step expects a non-negative integer, got ' 5'");
    ck_assert_int_eq(run_moe("route --example --set router.n_groups=2 --set router.topk_groups=1"),
                     0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"),
                                 "group-limited: router.topk_groups = 1 of router.n_groups = 2 "
                                 "groups of 2 experts"));
}
END_TEST

START_TEST(test_cli_stdout_write_error_is_exit_1) {
    const char *bin = getenv("MOE_BIN");
    ck_assert_ptr_nonnull(bin);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' plan " TINY " >/dev/full 2>'%s/err.txt'", bin, dir);
    int st = system(cmd);
    ck_assert(WIFEXITED(st));
    ck_assert_int_eq(WEXITSTATUS(st), 1);
    assert_one_line_error("plan", "writing to standard output failed");
}
END_TEST

static Suite *cli_errors_suite(void) {
    Suite *s = suite_create("cli_errors");
    TCase *tc = tcase_create("cli");
    tcase_set_timeout(tc, 300);
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_add_test(tc, test_cli_option_given_twice_is_refused);
    tcase_add_test(tc, test_cli_extra_positional_is_refused);
    tcase_add_test(tc, test_cli_unknown_option_and_missing_value_are_refused);
    tcase_add_test(tc, test_cli_unknown_option_is_not_suggested_as_itself);
    tcase_add_test(tc, test_cli_help_about_help_prints_the_usage);
    tcase_add_test(tc, test_cli_help_wins_over_the_rest_of_the_line);
    tcase_add_test(tc, test_cli_prepare_messages_say_what_is_expected);
    tcase_add_test(tc, test_cli_non_finite_and_negative_numbers_are_refused);
    tcase_add_test(tc, test_cli_plan_placement_options_are_checked);
    tcase_add_test(tc, test_cli_missing_checkpoint_is_exit_2_in_every_command);
    tcase_add_test(tc, test_cli_generate_input_must_be_a_bounded_text_file);
    tcase_add_test(tc, test_cli_train_refuses_a_run_above_available_memory);
    tcase_add_test(tc, test_cli_route_example_refuses_the_keys_it_fixes);
    tcase_add_test(tc, test_cli_bf16_compute_is_refused_on_the_cpu);
    tcase_add_test(tc, test_cli_integer_options_refuse_blanks);
    tcase_add_test(tc, test_cli_stdout_write_error_is_exit_1);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(cli_errors_suite());
}
