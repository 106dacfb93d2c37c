// The CLI writes over nothing it did not make: train --resume only into its own
// run (or a folder holding no run), eval --dump-logits never into a checkpoint
// nor over a non-dump; empty paths are exit 2; limits are stated in full.
#include "moe/error.h"
#include "testutil.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

static void write_text(const char *name, const char *text) {
    tu_write_text(dir, name, text);
}

// The bytes of dir/name (malloc'd, *n its size); asserts it exists.
static char *slurp(const char *name, size_t *n) {
    char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "rb");
    ck_assert_msg(f != NULL, "missing %s", p);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)len + 1);
    ck_assert_ptr_nonnull(b);
    ck_assert_uint_eq(fread(b, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return b;
}

// Asserts that dir/name still holds exactly the bytes was[0..n).
static void assert_unchanged(const char *name, const char *was, size_t n) {
    size_t m;
    char *now = slurp(name, &m);
    ck_assert_msg(m == n && memcmp(now, was, n) == 0, "%s changed", name);
    free(now);
}

static bool exists(const char *name) {
    char p[800];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0;
}

// One layer, two experts, 16 tokens a sequence: about a millisecond a step.
static const char *tiny =
    "{\"model\": {\"d_model\": 16, \"n_layers\": 1, \"n_heads\": 2, \"n_kv_heads\": 1,\n"
    "  \"d_ff\": 16, \"seq_len\": 16},\n"
    " \"moe\": {\"num_experts\": 2},\n"
    " \"train\": {\"batch_size\": 2, \"eval_every\": 0, \"warmup_steps\": 2}}\n";

static void setup(void) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    write_text("tiny.json", tiny);
}

START_TEST(test_resume_into_another_run_is_refused) {
    ck_assert_int_eq(run_moe("train tiny.json --steps 3 --quiet --out V"), 0);
    ck_assert_int_eq(run_moe("train tiny.json --steps 4 --quiet --out O"), 0);
    size_t n, nm;
    char *model = slurp("V/checkpoint/model.safetensors", &n);
    char *metrics = slurp("V/metrics.jsonl", &nm);
    ck_assert_int_eq(run_moe("train --resume O --out V --steps 8 --quiet"), 2);
    expect_in_err("--out V already holds a run");
    expect_in_err("--resume O");
    expect_in_err("--overwrite");
    ck_assert_int_eq(run_moe("train tiny.json --resume O/checkpoint --out V --steps 8 --quiet"), 2);
    expect_in_err("already holds a run");
    assert_unchanged("V/checkpoint/model.safetensors", model, n);
    assert_unchanged("V/metrics.jsonl", metrics, nm);
    free(model);
    free(metrics);
}
END_TEST

START_TEST(test_resume_into_the_default_run_folder_of_another_run_is_refused) {
    ck_assert_int_eq(run_moe("train tiny.json --steps 3 --quiet"), 0); // runs/tiny
    ck_assert_int_eq(run_moe("train tiny.json --steps 4 --quiet --out O"), 0);
    size_t n;
    char *model = slurp("runs/tiny/checkpoint/model.safetensors", &n);
    ck_assert_int_eq(run_moe("train tiny.json --resume O --steps 8 --quiet"), 2);
    expect_in_err("--out runs/tiny already holds a run");
    assert_unchanged("runs/tiny/checkpoint/model.safetensors", model, n);
    free(model);
}
END_TEST

// Every form README gives: the run folder (alone or with its CONFIG), its
// checkpoint folder, checkpoint-STEP of a rotating run, another name of the
// same folder, and a fresh folder.
START_TEST(test_resume_into_its_own_run_or_a_new_folder_works) {
    ck_assert_int_eq(run_moe("train tiny.json --steps 2 --quiet --out O"), 0);
    ck_assert_int_eq(run_moe("train --resume O --steps 3 --quiet"), 0);
    ck_assert_int_eq(run_moe("train tiny.json --resume O --out O --steps 4 --quiet"), 0);
    ck_assert_int_eq(run_moe("train tiny.json --resume O/checkpoint/ --out ./O/ --steps 5 --quiet"),
                     0);
    ck_assert_int_eq(run_moe("train tiny.json --resume O/checkpoint --out N --steps 6 --quiet"), 0);
    ck_assert(exists("N/checkpoint/model.safetensors"));
    ck_assert_int_eq(symlink("O", tu_path(dir, "L", "")), 0);
    ck_assert_int_eq(run_moe("train --resume O --out L --steps 7 --quiet"), 0);
#define ROTATE "--set train.keep_checkpoints=3 --set train.ckpt_every=2"
    ck_assert_int_eq(run_moe("train tiny.json --steps 4 --quiet --out K " ROTATE), 0);
    ck_assert_int_eq(
        run_moe("train tiny.json --resume K/checkpoint-2 --out K --steps 6 --quiet " ROTATE), 0);
    ck_assert(exists("K/checkpoint-6"));
    ck_assert_int_eq(run_moe("train --resume K/checkpoint-6 --out K --steps 7 --quiet"), 2);
    expect_in_err("without a CONFIG needs a run folder"); // unchanged rule
    ck_assert_int_eq(run_moe("train --resume K --steps 8 --quiet"), 0);
    ck_assert(exists("K/checkpoint-8"));
}
END_TEST

START_TEST(test_eval_dump_into_the_checkpoint_is_refused) {
    ck_assert_int_eq(run_moe("train tiny.json --steps 2 --quiet --out R"), 0);
    size_t n;
    char *model = slurp("R/checkpoint/model.safetensors", &n);
    ck_assert_int_eq(
        run_moe("eval R --batches 1 --samples 0 --dump-logits R/checkpoint/model.safetensors"), 2);
    expect_in_err("lies in the checkpoint R/checkpoint");
    ck_assert_int_eq(
        run_moe("eval R/checkpoint/ --batches 1 --samples 0 --dump-logits ./R/checkpoint/x.st"), 2);
    expect_in_err("lies in the checkpoint");
    assert_unchanged("R/checkpoint/model.safetensors", model, n);
    ck_assert(!exists("R/checkpoint/x.st"));
    free(model);
    // any checkpoint of the run folder read, not only the one that resolves
    ck_assert_int_eq(run_moe("train tiny.json --steps 4 --quiet --out K "
                             "--set train.keep_checkpoints=2 --set train.ckpt_every=2"),
                     0);
    model = slurp("K/checkpoint-2/model.safetensors", &n);
    ck_assert_int_eq(
        run_moe("eval K --batches 1 --samples 0 --dump-logits K/checkpoint-2/model.safetensors"),
        2);
    expect_in_err("lies in the checkpoint K/checkpoint-2");
    assert_unchanged("K/checkpoint-2/model.safetensors", model, n);
    free(model);
    ck_assert_int_eq(run_moe("eval K --batches 1 --samples 0 --dump-logits K/logits.st"), 0);
}
END_TEST

START_TEST(test_eval_dump_replaces_only_an_earlier_dump) {
    ck_assert_int_eq(run_moe("train tiny.json --steps 2 --quiet --out R"), 0);
    size_t n;
    char *metrics = slurp("R/metrics.jsonl", &n);
    ck_assert_int_eq(run_moe("eval R --batches 1 --samples 0 --dump-logits R/metrics.jsonl"), 2);
    expect_in_err("exists and is not an earlier logits dump");
    assert_unchanged("R/metrics.jsonl", metrics, n);
    free(metrics);
    ck_assert_int_eq(run_moe("eval R --batches 1 --samples 0 --dump-logits R"), 2);
    expect_in_err("exists and is not an earlier logits dump");
    ck_assert_int_eq(run_moe("eval R --batches 1 --samples 0 --dump-logits d.st"), 0);
    ck_assert_int_eq(run_moe("eval R --batches 1 --samples 0 --dump-logits d.st"), 0);
}
END_TEST

// The dump is written beside its path and renamed over it: a failed write
// leaves the earlier dump whole and no partial file.
START_TEST(test_eval_dump_failed_write_leaves_the_earlier_file) {
    ck_assert_int_eq(run_moe("train tiny.json --steps 2 --quiet --out R"), 0);
    ck_assert_int_eq(run_moe("eval R --batches 1 --samples 0 --dump-logits d.st"), 0);
    size_t n;
    char *was = slurp("d.st", &n);
    int before = tu_count_entries(dir);
    // counted calls of the dump: mkstemp, then the writes; the first write fails
    setenv("MOE_FAULT", "2:fail", 1);
    int rc = run_moe("eval R --batches 1 --samples 0 --dump-logits d.st");
    unsetenv("MOE_FAULT");
    ck_assert_int_eq(rc, 1);
    expect_in_err("d.st");
    assert_unchanged("d.st", was, n);
    ck_assert_int_eq(tu_count_entries(dir), before); // no d.st.tmp.* left
    free(was);
}
END_TEST

START_TEST(test_empty_path_options_are_bad_usage) {
    static const struct {
        const char *args, *want;
    } cases[] = {
        {"train tiny.json --out ''", "--out needs a path"},
        {"train tiny.json --resume ''", "--resume needs a path"},
        {"train --resume=", "--resume needs a path"},
        {"eval ''", "the checkpoint folder name is empty"},
        {"eval R --dump-logits ''", "--dump-logits needs a path"},
        {"generate '' --task copy --prompt a", "the checkpoint folder name is empty"},
        {"generate R --task copy --input ''", "--input needs a path"},
        {"export '' --hf x", "the checkpoint folder name is empty"},
        {"export R --hf ''", "--hf needs a path"},
        // a grid that cannot run: a broken check must not write results into "/"
        {"ablate tiny.json --out '' --grid router.no_such_key=1,2", "--out needs a path"},
        {"route --example --out ''", "--out needs a path"},
        {"route --logits '' --out x", "--logits needs a path"},
        {"route --logits x --task-ids '' --out x", "--task-ids needs a path"},
        {"prepare tiny.json --out ''", "--out needs a path"},
        {"prepare tiny.json --out p --tokenizer ''",
         "--tokenizer needs a path (or bytes): it is empty"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ck_assert_msg(run_moe("%s", cases[i].args) == 2, "%s: exit not 2: %s", cases[i].args,
                      err_text());
        expect_in_err(cases[i].want);
    }
}
END_TEST

// A value out of range gets the whole range, not a lower bound it satisfies.
START_TEST(test_option_ranges_are_stated_in_full) {
    static const struct {
        const char *args, *want;
    } cases[] = {
        {"generate ck --task copy --prompt a --max-new 100000000",
         "--max-new needs an integer in [0, 1048576]"},
        {"generate ck --task copy --prompt a --top-k 100000000",
         "--top-k needs an integer in [0, 1048576]"},
        {"eval ck --batches 1000000000", "--batches needs an integer in [1, 1048576]"},
        {"eval ck --samples 99999999", "--samples needs an integer in [0, 1048576]"},
        {"plan tiny.json --nodes 2000000", "--nodes needs an integer in [1, 1048576]"},
        {"prepare tiny.json --out p --shard-tokens 0",
         "--shard-tokens needs an integer in [1, 2147483647], got '0'"},
        {"prepare tiny.json --out p --seed -1",
         "--seed needs an integer in [0, 9223372036854775807], got '-1'"},
        {"prepare tiny.json --out p --val-fraction 1", "--val-fraction needs a number in [0, 1)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ck_assert_int_eq(run_moe("%s", cases[i].args), 2);
        expect_in_err(cases[i].want);
    }
}
END_TEST

START_TEST(test_generate_input_line_limit_is_stated) {
    char p[800];
    snprintf(p, sizeof p, "%s/many.txt", dir);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    for (int i = 0; i < 4097; i++)
        fputs("ab=\n", f);
    fclose(f);
    ck_assert_int_eq(run_moe("generate ck --task copy --input many.txt"), 2);
    expect_in_err("many.txt: more than 4096 lines (--input takes at most 4096 prompts)");
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("cli_guards");
    TCase *tc = tcase_create("guards");
    tcase_set_timeout(tc, 300);
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_add_test(tc, test_resume_into_another_run_is_refused);
    tcase_add_test(tc, test_resume_into_the_default_run_folder_of_another_run_is_refused);
    tcase_add_test(tc, test_resume_into_its_own_run_or_a_new_folder_works);
    tcase_add_test(tc, test_eval_dump_into_the_checkpoint_is_refused);
    tcase_add_test(tc, test_eval_dump_replaces_only_an_earlier_dump);
    tcase_add_test(tc, test_eval_dump_failed_write_leaves_the_earlier_file);
    tcase_add_test(tc, test_empty_path_options_are_bad_usage);
    tcase_add_test(tc, test_option_ranges_are_stated_in_full);
    tcase_add_test(tc, test_generate_input_line_limit_is_stated);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
