// Training on files through the CLI, against the messages a user would meet:
// an unreadable input is bad input (exit 2), windows too large for every file
// say that windows do not cross files, unused tokens are warned of, keys set
// but ignored get a note (and a resumed run's saved defaults none), and
// validation on the training files is refused.
#include "moe/error.h"
#include "testutil.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[600];

// moe with args (printf-style), dir as working directory, stdout and stderr
// to dir/out.txt and dir/err.txt: its exit status.
#define run_moe(...) tu_run_moe_in(dir, __VA_ARGS__)

static const char *err_text(void) {
    return tu_file_text(dir, "err.txt");
}

static void expect_in_err(const char *want) {
    ck_assert_msg(strstr(err_text(), want), "stderr lacks '%s': %s", want, err_text());
}

// n bytes of lower-case letters into dir/name.
static void write_letters(const char *name, int n) {
    char *t = malloc((size_t)n + 1);
    ck_assert_ptr_nonnull(t);
    for (int i = 0; i < n; i++)
        t[i] = (char)('a' + i % 26);
    t[n] = 0;
    tu_write_text(dir, name, t);
    free(t);
}

// One layer, two experts, windows of 17 tokens: about a millisecond a step.
static void setup(void) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    tu_write_text(dir, "tiny.json",
                  "{\"model\": {\"d_model\": 16, \"n_layers\": 1, \"n_heads\": 2, \"n_kv_heads\": "
                  "1,\n  \"d_ff\": 16, \"seq_len\": 16},\n \"moe\": {\"num_experts\": 2},\n"
                  " \"train\": {\"batch_size\": 2, \"eval_every\": 0, \"warmup_steps\": 2}}\n");
}

#define TEXT "train tiny.json --quiet --steps 2 --set data.kind=text "

// A path that cannot be opened for what it is (a symbolic link loop here;
// permissions cannot be tested as root) is bad input, not an I/O failure.
START_TEST(test_unreadable_input_is_bad_input_exit_2) {
    ck_assert_int_eq(symlink("a.txt", tu_path(dir, "b.txt", "")), 0);
    ck_assert_int_eq(symlink("b.txt", tu_path(dir, "a.txt", "")), 0);
    ck_assert_int_eq(run_moe("prepare a.txt --out p --quiet"), 2);
    expect_in_err("a.txt: cannot open: Too many levels of symbolic links");
    ck_assert_int_eq(run_moe(TEXT "--out r --set data.path=a.txt"), 2);
    expect_in_err("a.txt: cannot open: Too many levels of symbolic links");
}
END_TEST

// Files each shorter than a window: the total would do, but windows do not
// cross files, and the message says so with the largest file's tokens.
START_TEST(test_files_shorter_than_a_window_say_windows_do_not_cross_files) {
    for (int i = 0; i < 4; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%d.txt", i);
        write_letters(name, 10 + i); // 10..13 tokens, 46 in all; a window is 17
    }
    write_letters("v.txt", 100);
    ck_assert_int_eq(run_moe(TEXT "--out r --set 'data.path=t*.txt' --set data.val_path=v.txt"), 2);
    expect_in_err("t*.txt: no file holds a training window of 17 tokens (windows do not cross "
                  "files): the largest of its 4 files holds 13 tokens, 46 in all");
}
END_TEST

// Whole-file windows leaving over a quarter of the training tokens unused:
// two 30-token files hold one 17-token window each, 26 of 60 tokens unused.
START_TEST(test_unused_share_of_training_tokens_is_warned) {
    write_letters("t0.txt", 30);
    write_letters("t1.txt", 30);
    write_letters("v.txt", 100);
    ck_assert_int_eq(run_moe(TEXT "--out r --set 'data.path=t*.txt' --set data.val_path=v.txt"), 0);
    expect_in_err("43% of the training tokens are in no window of 17 tokens");
    write_letters("t0.txt", 33); // 2 windows cover all 33 tokens: no warning
    write_letters("t1.txt", 33);
    ck_assert_int_eq(run_moe(TEXT "--out r2 --set 'data.path=t*.txt' --set data.val_path=v.txt"),
                     0);
    ck_assert_msg(!strstr(err_text(), "no window"), "%s", err_text());
}
END_TEST

// Keys a user set that the config then ignores get a note each, at start.
START_TEST(test_keys_set_but_ignored_get_a_note) {
    write_letters("t.txt", 400);
    write_letters("v.txt", 100);
    ck_assert_int_eq(run_moe("train tiny.json --quiet --steps 2 --out s --set data.path=t.txt"), 0);
    expect_in_err("note: --set data.path: data.path is ignored: data.kind = synthetic");
    ck_assert_int_eq(run_moe(TEXT "--out r --set data.path=t.txt --set data.val_path=v.txt --set "
                                  "data.val_fraction=0.3 --set data.task_sampling=uniform --set "
                                  "data.task_temperature=2 --set data.tasks=copy,add"),
                     0);
    expect_in_err("note: --set data.val_fraction: data.val_fraction = 0.3 is ignored");
    expect_in_err("note: --set data.task_sampling: data.task_sampling is ignored");
    expect_in_err("note: --set data.task_temperature: data.task_temperature = 2 is ignored");
    expect_in_err("note: --set data.tasks: data.tasks is ignored: with data.kind = text");
}
END_TEST

// A text run's saved config.json holds every key at its default (data.tasks
// too): resuming it is neither refused nor noted.
START_TEST(test_resumed_text_run_gets_no_note) {
    write_letters("t.txt", 400);
    ck_assert_int_eq(run_moe(TEXT "--out r --set data.path=t.txt"), 0);
    ck_assert_msg(!strstr(err_text(), "note:"), "%s", err_text());
    ck_assert_int_eq(run_moe("train --resume r --steps 4 --quiet"), 0);
    ck_assert_msg(!strstr(err_text(), "note:"), "%s", err_text());
}
END_TEST

// data.val_path naming a training file (however spelled) validates on
// training data: a new run is refused naming both keys.
START_TEST(test_val_path_sharing_a_training_file_is_refused) {
    write_letters("t0.txt", 400);
    write_letters("t1.txt", 400);
    ck_assert_int_eq(run_moe(TEXT "--out r --set 'data.path=t*.txt' --set data.val_path=./t1.txt"),
                     2);
    expect_in_err("data.val_path = './t1.txt' names ./t1.txt, which data.path = 't*.txt' names "
                  "too: validation would be on training data");
    ck_assert_int_eq(access(tu_path(dir, "r", ""), F_OK), -1); // nothing written
}
END_TEST

static Suite *cli_data_suite(void) {
    Suite *s = suite_create("cli_data");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_add_test(tc, test_unreadable_input_is_bad_input_exit_2);
    tcase_add_test(tc, test_files_shorter_than_a_window_say_windows_do_not_cross_files);
    tcase_add_test(tc, test_unused_share_of_training_tokens_is_warned);
    tcase_add_test(tc, test_keys_set_but_ignored_get_a_note);
    tcase_add_test(tc, test_resumed_text_run_gets_no_note);
    tcase_add_test(tc, test_val_path_sharing_a_training_file_is_refused);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(cli_data_suite());
}
