// The `moe` binary end to end: train/eval/ablate exit codes and one-line
// errors, and Ctrl-C during training (checkpoint written, exit 130, resumable).
#include "moe/error.h"
#include "testutil.h"
#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[600];

// Runs the moe binary with args (a shell word list); returns its exit status
// and leaves stdout and stderr in dir/out.txt and dir/err.txt.
static int run_moe(const char *args) {
    return tu_run_moe(dir, args);
}

static const char *file_text(const char *name) {
    return tu_file_text(dir, name);
}

static void write_text(const char *name, const char *text) {
    char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    fputs(text, f);
    fclose(f);
}

static const char *small =
    "{\"model\": {\"d_model\": 32, \"n_layers\": 2, \"d_ff\": 48, \"seq_len\": 32},\n"
    " \"moe\": {\"num_experts\": 4}, \"train\": {\"batch_size\": 4, \"eval_every\": 0}}\n";

START_TEST(test_cli_train_errors_and_success) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    char args[4096];
    write_text("bad.json", "{\"model\": {\"d_model\": 32},\n \"router\": {\"top_k\": \"x\"}}\n");
    snprintf(args, sizeof args, "train '%s/bad.json' --out '%s/r0'", dir, dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_ptr_nonnull(strstr(file_text("err.txt"), "bad.json:2:13: router.top_k must be"));
    write_text("small.json", small);
    snprintf(args, sizeof args, "train '%s/small.json' --set router.top_k=5 --out '%s/r0'", dir,
             dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_ptr_nonnull(strstr(file_text("err.txt"), "exceeds moe.num_experts = 4"));
    snprintf(args, sizeof args, "train '%s/missing.json'", dir);
    ck_assert_int_eq(run_moe(args), 2);
    snprintf(args, sizeof args,
             "train '%s/small.json' --set train.lr=1e30 --steps 5 --quiet --out "
             "'%s/r0'",
             dir, dir);
    ck_assert_int_eq(run_moe(args), 1); // diverges: a runtime failure
    ck_assert_ptr_nonnull(strstr(file_text("err.txt"), "step "));
    snprintf(args, sizeof args, "train '%s/small.json' --steps 10 --quiet --out '%s/r1'", dir, dir);
    ck_assert_int_eq(run_moe(args), 0);
    ck_assert_ptr_nonnull(strstr(file_text("out.txt"), "expert usage, layer 1"));
    snprintf(args, sizeof args, "eval '%s/r1/checkpoint'", dir);
    ck_assert_int_eq(run_moe(args), 0);
    ck_assert_ptr_nonnull(strstr(file_text("out.txt"), "accuracy"));
    snprintf(args, sizeof args, "eval '%s/nowhere'", dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_int_eq(run_moe("train --help-config"), 0);
    ck_assert_ptr_nonnull(strstr(file_text("out.txt"), "capacity.capacity_factor_max"));
    snprintf(args, sizeof args, "ablate '%s/small.json' --grid router.noise=loud --out '%s/a'", dir,
             dir);
    ck_assert_int_eq(run_moe(args), 2);
}
END_TEST

// --device cuda where there is no GPU: exit 2 with the reason (no CUDA in
// this build, or no device), before any run folder is written; --device with
// another name is a config error. (On a GPU, tests/test_train_gpu.c.)
START_TEST(test_cli_train_device_cuda_refused_with_reason) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    char args[4096];
    write_text("small.json", small);
    snprintf(args, sizeof args,
             "train '%s/small.json' --device cuda --steps 2 --quiet --out '%s/g'", dir, dir);
#ifdef MOE_HAVE_CUDA
    if (moe_cuda_device_count(NULL, 0) > 0) { // a GPU here: the run trains
        ck_assert_int_eq(run_moe(args), 0);
        return;
    }
#endif
    ck_assert_int_eq(run_moe(args), 2);
    const char *err = file_text("err.txt");
#ifdef MOE_HAVE_CUDA
    ck_assert_msg(strstr(err, "no CUDA device"), "%s", err);
#else
    ck_assert_msg(strstr(err, "built without CUDA"), "%s", err);
#endif
    snprintf(args, sizeof args, "train '%s/small.json' --device tpu --out '%s/g'", dir, dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_msg(strstr(file_text("err.txt"), "train.device"), "%s", file_text("err.txt"));
    // named as the option given, not as the --set it becomes
    ck_assert_msg(strstr(file_text("err.txt"), "moe train: --device tpu: train.device"), "%s",
                  file_text("err.txt"));
    snprintf(args, sizeof args, "train '%s/small.json' --device cpu --steps 2 --quiet --out '%s/c'",
             dir, dir);
    ck_assert_int_eq(run_moe(args), 0);
    // the overlapped exchange is the GPU layer's: refused on the CPU, naming both keys
    snprintf(args, sizeof args,
             "train '%s/small.json' --set comm.overlap_degree=2 --steps 2 --quiet --out '%s/o'",
             dir, dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_msg(strstr(file_text("err.txt"), "comm.overlap_degree = 2 needs train.device = cuda"),
                  "%s", file_text("err.txt"));
}
END_TEST

// SIGINT mid-run: the trainer finishes the step, writes a checkpoint and exits
// with 130; --resume continues from it.
START_TEST(test_cli_ctrl_c_saves_checkpoint) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    write_text("small.json", small);
    const char *bin = getenv("MOE_BIN");
    char cfg[700], out[700], metrics[800], ck[800];
    snprintf(cfg, sizeof cfg, "%s/small.json", dir);
    snprintf(out, sizeof out, "%s/run", dir);
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", out);
    snprintf(ck, sizeof ck, "%s/checkpoint/model.safetensors", out);
    pid_t pid = fork();
    if (pid == 0) {
        freopen("/dev/null", "w", stderr);
        execl(bin, bin, "train", cfg, "--steps", "1000000", "--quiet", "--out", out, (char *)NULL);
        _exit(127);
    }
    // Wait (bounded) until training has produced its first step.
    struct stat st;
    for (int i = 0; i < 3000 && (stat(metrics, &st) || st.st_size == 0); i++)
        usleep(10000);
    ck_assert_msg(stat(metrics, &st) == 0 && st.st_size > 0, "training never started");
    kill(pid, SIGINT);
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFEXITED(status));
    ck_assert_int_eq(WEXITSTATUS(status), 130);
    ck_assert_int_eq(stat(ck, &st), 0);
    // the step it stopped after, then one more by --resume
    const char *state = file_text("run/checkpoint/trainer_state.json");
    const char *at = strstr(state, "\"step\": ");
    ck_assert_ptr_nonnull(at);
    const long stopped = atol(at + 8);
    ck_assert_int_ge(stopped, 1);
    char args[4096];
    snprintf(args, sizeof args,
             "train '%s' --resume '%s/checkpoint' --steps %ld --quiet --out '%s'", cfg, out,
             stopped + 1, out);
    ck_assert_int_eq(run_moe(args), 0);
    snprintf(args, sizeof args, "\"step\": %ld,", stopped + 1);
    ck_assert_msg(strstr(file_text("run/metrics.jsonl"), args), "no step %ld", stopped + 1);
    // fewer steps in all than it has trained: nothing to train, said so
    snprintf(args, sizeof args,
             "train '%s' --resume '%s/checkpoint' --steps %ld --quiet --out '%s'", cfg, out,
             stopped, out);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_msg(strstr(file_text("err.txt"), "nothing to train"), "%s", file_text("err.txt"));
}
END_TEST

// --steps N beside --set train.steps=M: the later one silently won, so both
// is exit 2 naming both (nothing trained); a bad --steps names --steps.
START_TEST(test_cli_train_steps_beside_set_train_steps_is_exit_2) {
    char args[2048];
    write_text("s.json", small);
    snprintf(args, sizeof args, "train '%s/s.json' --steps 2 --set train.steps=5 --out '%s/st'",
             dir, dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_ptr_nonnull(
        strstr(file_text("err.txt"), "--steps 2 and --set train.steps=5 both set train.steps"));
    snprintf(args, sizeof args, "train '%s/s.json' --steps 0 --out '%s/st'", dir, dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_msg(strstr(file_text("err.txt"), "moe train: --steps 0: train.steps = 0") != NULL,
                  "%s", file_text("err.txt"));
    snprintf(args, sizeof args, "%s/st", dir);
    ck_assert_int_eq(access(args, F_OK), -1);
}
END_TEST

// Fewer training windows than a step's rows: the run trains (the epochs wrap
// inside a step) and a warning says so; it was silent. Exactly as many: none.
START_TEST(test_cli_train_step_larger_than_the_training_data_warns) {
    char args[2048], text[200];
    write_text("s.json", small);
    // 34 bytes, half held out: 17 training tokens, one window of 16 + 1
    write_text("one.txt", "abcdefghijklmnopqrstuvwxyzABCDEFGH");
    const char *sets = "--steps 2 --set model.seq_len=16 --set data.kind=text "
                       "--set data.val_fraction=0.5";
    snprintf(args, sizeof args,
             "train '%s/s.json' %s --set data.path='%s/one.txt' --set train.grad_accum=2 "
             "--out '%s/one'",
             dir, sets, dir, dir);
    ck_assert_msg(run_moe(args) == 0, "%s", file_text("err.txt"));
    ck_assert_msg(strstr(file_text("err.txt"),
                         "moe warn: a step reads 8 rows (train.batch_size 4 x train.grad_accum 2 "
                         "x 1 rank) but the training data holds 1 window of 17 tokens: each "
                         "step trains some more than once") != NULL,
                  "%s", file_text("err.txt"));
    // the one validation window is fewer than a batch's 4 rows (it said "after 0 batches")
    ck_assert_msg(strstr(file_text("err.txt"), "the validation windows start over within the "
                                               "first batch: some count more than once") != NULL,
                  "%s", file_text("err.txt"));
    // 130 bytes: 65 training tokens, 4 windows for the 4 rows of a step
    for (int i = 0; i < 130; i++)
        text[i] = (char)('a' + i % 26);
    text[130] = 0;
    write_text("four.txt", text);
    snprintf(args, sizeof args,
             "train '%s/s.json' %s --set data.path='%s/four.txt' --out '%s/four'", dir, sets, dir,
             dir);
    ck_assert_msg(run_moe(args) == 0, "%s", file_text("err.txt"));
    ck_assert_msg(strstr(file_text("err.txt"), "a step reads") == NULL, "%s", file_text("err.txt"));
    ck_assert_msg(strstr(file_text("err.txt"), "windows start over after 1 batch:") != NULL, "%s",
                  file_text("err.txt"));
}
END_TEST

static Suite *cli_train_suite(void) {
    Suite *s = suite_create("cli_train");
    TCase *tc = tcase_create("cli");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_cli_train_errors_and_success);
    tcase_add_test(tc, test_cli_ctrl_c_saves_checkpoint);
    tcase_add_test(tc, test_cli_train_device_cuda_refused_with_reason);
    tcase_add_test(tc, test_cli_train_steps_beside_set_train_steps_is_exit_2);
    tcase_add_test(tc, test_cli_train_step_larger_than_the_training_data_warns);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(cli_train_suite());
}
