// Run folders and the CLI's help, end to end through the moe binary (issue 17
// items 3 and 4): a second run into a run folder is refused unless --resume or
// --overwrite says which is meant; Ctrl-C stops with a checkpoint and prints a
// resume command that finishes the run bit-identically to an uninterrupted
// one; keep_checkpoints rotates; "did you mean" for every class of name; one
// --set parser (list forms) in every command; --version.
#include "moe/error.h"
#include "moe/safetensors.h"
#include "testutil.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[600];

static int run_moe(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int run_moe(const char *fmt, ...) {
    char args[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    return tu_run_moe(dir, args);
}

static const char *err_text(void) {
    return tu_file_text(dir, "err.txt");
}

static void write_text(const char *name, const char *text) {
    tu_write_text(dir, name, text);
}

// Bytes of file dir/a equal to those of dir/b (both must exist).
static int same_bytes(const char *a, const char *b) {
    char pa[800], pb[800];
    snprintf(pa, sizeof pa, "%s/%s", dir, a);
    snprintf(pb, sizeof pb, "%s/%s", dir, b);
    FILE *fa = fopen(pa, "rb"), *fb = fopen(pb, "rb");
    ck_assert_msg(fa && fb, "missing %s or %s", pa, pb);
    int same = 1, ca, cb;
    do {
        ca = fgetc(fa), cb = fgetc(fb);
        same = ca == cb;
    } while (same && ca != EOF);
    fclose(fa);
    fclose(fb);
    return same;
}

// Lines of the whole file (tu_file_text keeps only its first 64 KiB).
static int count_lines(const char *name) {
    char p[1200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "r");
    if (!f) return 0;
    int n = 0;
    for (int c; (c = fgetc(f)) != EOF;)
        n += c == '\n';
    fclose(f);
    return n;
}

static void expect_in_err(const char *want) {
    ck_assert_msg(strstr(err_text(), want), "stderr lacks '%s': %s", want, err_text());
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

static void teardown(void) {
    char cmd[800];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    ck_assert_int_eq(system(cmd), 0);
}

START_TEST(test_train_refuses_an_out_that_holds_a_run) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 0);
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 4); // 3 steps, the final eval
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 2);
    expect_in_err("already holds a run");
    expect_in_err("--resume");
    expect_in_err("--overwrite");
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 4); // untouched
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r --resume %s/r --overwrite", dir,
                dir, dir),
        2);
    expect_in_err("give one");
}
END_TEST

// A run whose checkpoint is gone has nothing for --resume: the refusal offers
// only --overwrite.
START_TEST(test_a_run_without_checkpoint_is_not_offered_to_resume) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 0);
    char cmd[800];
    snprintf(cmd, sizeof cmd, "rm -rf '%s/r/checkpoint'", dir);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 2);
    expect_in_err("no checkpoint to resume");
    expect_in_err("--overwrite");
    ck_assert_msg(!strstr(err_text(), "--resume"), "offers --resume: %s", err_text());
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 4); // untouched
}
END_TEST

// Every file a resume reads is named with the option that gave it, the
// optimizer's moments as the model's weights, and the run is left as it was.
START_TEST(test_resume_errors_name_the_option_and_the_file) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 0);
    char p[800];
    snprintf(p, sizeof p, "%s/r/checkpoint/optimizer.safetensors", dir);
    FILE *f = fopen(p, "ab");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fputc(0, f), 0);
    ck_assert_int_eq(fclose(f), 0);
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 4 --quiet", dir), 2);
    expect_in_err("--resume: ");
    expect_in_err("optimizer.safetensors");
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 4);
}
END_TEST

// The "loss" value of step's record in r/metrics.jsonl, into out.
static void loss_of_step(int step, char *out, size_t cap) {
    char key[32];
    snprintf(key, sizeof key, "{\"step\": %d,", step);
    const char *rec = strstr(tu_file_text(dir, "r/metrics.jsonl"), key);
    ck_assert_msg(rec, "no record of step %d", step);
    const char *v = strstr(rec, "\"loss\": ");
    ck_assert_ptr_nonnull(v);
    snprintf(out, cap, "%.*s", (int)strcspn(v, ","), v);
}

// A resume from an earlier checkpoint of the run (it went on to step 5, the
// resume starts at 4) redoes step 5: its old records go, so the file holds
// one record per step, and the redone step equals the first one bit for bit.
START_TEST(test_resume_from_an_earlier_checkpoint_keeps_one_record_per_step) {
    const char *keep = "--set train.ckpt_every=2 --set train.keep_checkpoints=5 --quiet";
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 5 %s --out %s/r", dir, keep, dir), 0);
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 6); // 5 steps, the final eval
    char before[64], after[64];
    loss_of_step(5, before, sizeof before);
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --resume %s/r/checkpoint-4 --out %s/r --steps 5 %s", dir, dir,
                dir, keep),
        0);
    expect_in_err("dropped 2 records after step 4");
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 6);
    loss_of_step(5, after, sizeof after);
    ck_assert_str_eq(before, after);
}
END_TEST

// --dry-run refuses what train would refuse of synthetic data before any step.
START_TEST(test_dry_run_checks_synthetic_data) {
    ck_assert_int_eq(
        run_moe(
            "train %s/tiny.json --dry-run --set model.vocab_size=129 --set data.tasks=copy,sort",
            dir),
        2);
    expect_in_err("model.vocab_size >= 130");
    ck_assert_int_eq(run_moe("train %s/tiny.json --dry-run --set 'data.tasks=[]'", dir), 2);
    expect_in_err("data.tasks is empty");
}
END_TEST

// A second moe train into a folder another one is writing (two new runs, or
// two --resume of one run) is refused before it touches anything: the lock
// is held here as the first process would hold it.
START_TEST(test_train_refuses_a_run_folder_another_train_is_writing) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 0);
    char p[1400];
    snprintf(p, sizeof p, "cp -r '%s/r' '%s/before'", dir, dir);
    ck_assert_int_eq(system(p), 0);
    snprintf(p, sizeof p, "%s/r", dir);
    int fd = open(p, O_RDONLY | O_DIRECTORY);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(flock(fd, LOCK_EX | LOCK_NB), 0);
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 5 --quiet", dir), 2);
    expect_in_err("another moe train or moe ablate is writing");
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r --overwrite", dir, dir), 2);
    expect_in_err("another moe train or moe ablate is writing");
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 4);
    ck_assert(same_bytes("r/metrics.jsonl", "before/metrics.jsonl"));
    ck_assert(same_bytes("r/checkpoint/model.safetensors", "before/checkpoint/model.safetensors"));
    ck_assert(same_bytes("r/config.json", "before/config.json"));
    // the lock goes with its holder: the run is then free to continue
    close(fd);
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 5 --quiet", dir), 0);
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 7); // + steps 4, 5 and their eval
}
END_TEST

// A run refused at setup leaves no folder behind, the lock's included.
START_TEST(test_a_refused_run_leaves_no_folder) {
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --steps 3 --quiet --out %s/new/r --set model.vocab_size=3", dir,
                dir),
        2);
    struct stat st;
    char p[800];
    snprintf(p, sizeof p, "%s/new", dir);
    ck_assert_msg(stat(p, &st) != 0, "%s was left: %s", p, err_text());
}
END_TEST

// A config.json moe train did not write (a `moe export --hf` folder) is no
// run, but a run would replace it: refused, with --overwrite too.
START_TEST(test_train_refuses_an_out_holding_a_foreign_config) {
    char p[800];
    snprintf(p, sizeof p, "%s/hf", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    write_text("hf/config.json", "{\"model_type\": \"mixtral\"}\n");
    write_text("hf/model.safetensors", "x");
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/hf", dir, dir), 2);
    expect_in_err("hf/config.json was not written by moe train");
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --steps 3 --quiet --out %s/hf --overwrite", dir, dir), 2);
    expect_in_err("hf/config.json was not written by moe train");
    ck_assert_str_eq(tu_file_text(dir, "hf/config.json"), "{\"model_type\": \"mixtral\"}\n");
    ck_assert_str_eq(tu_file_text(dir, "hf/model.safetensors"), "x");
    // a resume into it alike
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 0);
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --resume %s/r --steps 4 --quiet --out %s/hf", dir, dir, dir),
        2);
    expect_in_err("hf/config.json was not written by moe train");
    ck_assert_str_eq(tu_file_text(dir, "hf/config.json"), "{\"model_type\": \"mixtral\"}\n");
}
END_TEST

// --out naming a file is bad input, with or without --overwrite.
START_TEST(test_train_out_that_is_a_file_is_usage_error) {
    write_text("file", "keep\n");
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/file", dir, dir), 2);
    expect_in_err("exists and is not a folder");
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --steps 3 --quiet --out %s/file --overwrite", dir, dir), 2);
    expect_in_err("exists and is not a folder");
    ck_assert_str_eq(tu_file_text(dir, "file"), "keep\n");
    // a folder name longer than the file system takes is bad input too
    char name[301];
    memset(name, 'a', 300);
    name[300] = 0;
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/%s", dir, dir, name),
                     2);
    expect_in_err("File name too long");
}
END_TEST

// A file-size limit (ulimit -f) fails a write with EFBIG, named, exit 1 as a
// full disk does, instead of killing the process by SIGXFSZ without a word.
START_TEST(test_file_size_limit_fails_the_write_with_a_message) {
    char cmd[2400];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && ulimit -f 20 && exec '%s' train tiny.json --steps 3 --quiet --out r "
             ">out.txt 2>err.txt",
             dir, getenv("MOE_BIN"));
    const int st = system(cmd);
    ck_assert_msg(WIFEXITED(st), "killed by a signal: %s", err_text());
    ck_assert_int_eq(WEXITSTATUS(st), 1);
    expect_in_err("File too large");
    expect_in_err("model.safetensors");
}
END_TEST

// A resume refuses a metrics.jsonl moe report would refuse (a complete line
// that is no JSON: a cut-off last one is dropped instead), and one that is no
// regular file or a link (another run's file), before it resumes anything.
START_TEST(test_resume_refuses_a_bad_metrics_file_naming_it) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 0);
    char p[800], q[800];
    snprintf(p, sizeof p, "%s/r/metrics.jsonl", dir);
    FILE *f = fopen(p, "a");
    ck_assert_ptr_nonnull(f);
    fputs("garbage\n", f);
    fclose(f);
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 4", dir), 2);
    expect_in_err("r/metrics.jsonl:5:7: not JSON");
    ck_assert_msg(!strstr(err_text(), "resumed"), "resumed first: %s", err_text());
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 5); // untouched
    // a folder, and a link to another file
    snprintf(q, sizeof q, "%s/r/m.old", dir);
    ck_assert_int_eq(rename(p, q), 0);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 4 --quiet", dir), 2);
    expect_in_err("metrics.jsonl: not a regular file");
    ck_assert_int_eq(rmdir(p), 0);
    ck_assert_int_eq(symlink("m.old", p), 0);
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 4 --quiet", dir), 2);
    expect_in_err("metrics.jsonl: is a symbolic link");
    ck_assert_int_eq(count_lines("r/m.old"), 5);
}
END_TEST

// Resuming a finished run trains nothing and writes no second evaluation of
// its last step: the file keeps one record per step.
START_TEST(test_resume_of_a_finished_run_adds_no_records) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 0);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(run_moe("train --resume %s/r --quiet", dir), 0);
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 4); // 3 steps, one final eval
}
END_TEST

// Event files in the run folder r.
static int count_events(void) {
    char p[800];
    snprintf(p, sizeof p, "%s/r", dir);
    DIR *d = opendir(p);
    ck_assert_ptr_nonnull(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += !strncmp(e->d_name, "events.out.tfevents.", 20);
    closedir(d);
    return n;
}

// A run that fails before its first step leaves an empty metrics.jsonl and no
// checkpoint: nothing to resume, so the next run may use the folder.
START_TEST(test_a_run_failed_before_any_step_does_not_hold_the_folder) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r "
                             "--set model.rope_theta=1e-300",
                             dir, dir),
                     1);
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 0);
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 3 --quiet --out %s/r", dir, dir), 0);
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 4);
}
END_TEST

START_TEST(test_overwrite_replaces_the_run) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 5 --quiet --out %s/r "
                             "--set train.keep_checkpoints=2 --set train.ckpt_every=1 "
                             "--set train.tensorboard=true",
                             dir, dir),
                     0);
    ck_assert_int_eq(count_events(), 1);
    write_text("r/notes.txt", "mine\n");
    write_text("r/latest.tmp", "checkpoint-5\n"); // a save stopped before its rename: a file
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 2 --quiet --out %s/r --overwrite "
                             "--set train.tensorboard=true",
                             dir, dir),
                     0);
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 3);          // the new run's alone
    ck_assert_int_eq(count_events(), 1);                          // the old curves are gone
    ck_assert_str_eq(tu_file_text(dir, "r/notes.txt"), "mine\n"); // not the run's: stays
    char p[800];
    struct stat st;
    snprintf(p, sizeof p, "%s/r/checkpoint-5", dir); // the old run's checkpoints are gone
    ck_assert_int_ne(stat(p, &st), 0);
    snprintf(p, sizeof p, "%s/r/latest", dir);
    ck_assert_int_ne(stat(p, &st), 0);
    snprintf(p, sizeof p, "%s/r/latest.tmp", dir);
    ck_assert_int_ne(stat(p, &st), 0);
    ck_assert_int_eq(run_moe("eval %s/r --batches 1 --samples 0", dir), 0);
}
END_TEST

// --overwrite removes what a run wrote, and a folder named metrics.jsonl or a
// file named checkpoint is no run's: it is refused, and what it holds stays.
START_TEST(test_overwrite_keeps_a_folder_or_file_where_a_run_writes_the_other) {
    char p[800];
    snprintf(p, sizeof p, "%s/a", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/a/metrics.jsonl", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    write_text("a/metrics.jsonl/notes.txt", "mine\n");
    snprintf(p, sizeof p, "%s/b", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    write_text("b/checkpoint", "mine too\n");
    write_text("b/metrics.jsonl", "");
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --steps 2 --quiet --out %s/a --overwrite", dir, dir), 2);
    expect_in_err("a/metrics.jsonl: a folder where moe train writes a file");
    ck_assert_str_eq(tu_file_text(dir, "a/metrics.jsonl/notes.txt"), "mine\n");
    ck_assert_int_eq(
        run_moe("train %s/tiny.json --steps 2 --quiet --out %s/b --overwrite", dir, dir), 2);
    expect_in_err("b/checkpoint: a file where moe train writes a folder");
    ck_assert_str_eq(tu_file_text(dir, "b/checkpoint"), "mine too\n");
    ck_assert_str_eq(tu_file_text(dir, "b/metrics.jsonl"), ""); // nothing went before the check
}
END_TEST

START_TEST(test_resume_run_dir_alone_continues_the_run) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 4 --quiet --out %s/r", dir, dir), 0);
    // no CONFIG: the run's config.json and the run folder itself; --steps on top
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 6", dir), 0);
    const char *out = tu_file_text(dir, "out.txt");
    ck_assert_msg(strstr(out, "trained 6 steps (2 of them after resuming)"), "%s", out);
    ck_assert_int_eq(count_lines("r/metrics.jsonl"), 4 + 1 + 2 + 1);
    // a folder that is no run
    ck_assert_int_eq(run_moe("train --resume %s", dir), 2);
    expect_in_err("needs a run folder");
}
END_TEST

// Ctrl-C (SIGINT) after the first metrics line: exit 130, a checkpoint, and a
// printed command that, run as printed, finishes the run with the same bits
// as a run never interrupted.
START_TEST(test_sigint_stops_with_a_checkpoint_and_a_working_resume_command) {
    const char *bin = getenv("MOE_BIN");
    char cfg[700], out[700], metrics[800];
    snprintf(cfg, sizeof cfg, "%s/tiny.json", dir);
    snprintf(out, sizeof out, "%s/run", dir);
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", out);
    char errp[800];
    snprintf(errp, sizeof errp, "%s/sigint.txt", dir);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        if (!freopen(errp, "w", stderr)) _exit(127);
        execl(bin, bin, "train", cfg, "--steps", "10000", "--quiet", "--out", out, (char *)NULL);
        _exit(127);
    }
    struct stat st; // the first step's line (a generous bound: 60 s)
    for (int i = 0; i < 60000 && (stat(metrics, &st) || st.st_size == 0); i++)
        usleep(1000);
    ck_assert_msg(stat(metrics, &st) == 0 && st.st_size > 0, "training never started");
    kill(pid, SIGINT);
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFEXITED(status));
    ck_assert_msg(WEXITSTATUS(status) == 130, "exit %d (finished before the signal?)",
                  WEXITSTATUS(status));
    const char *err = tu_file_text(dir, "sigint.txt");
    const char *cmd = strstr(err, "continue with: ");
    ck_assert_msg(cmd, "no resume command in: %s", err);
    cmd += strlen("continue with: ");
    char line[1200];
    snprintf(line, sizeof line, "%.*s", (int)strcspn(cmd, "\n"), cmd);
    ck_assert_ptr_nonnull(strstr(line, " train --resume "));
    ck_assert_int_eq(count_lines("run/metrics.jsonl") < 10000, 1);
    // the printed command, as printed
    char shell[3000];
    snprintf(shell, sizeof shell, "%s >'%s/out.txt' 2>'%s/err.txt'", line, dir, dir);
    int rc = system(shell);
    ck_assert(WIFEXITED(rc));
    ck_assert_msg(WEXITSTATUS(rc) == 0, "'%s' exited %d: %s", line, WEXITSTATUS(rc), err_text());
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "trained 10000 steps ("));
    // the same run, never interrupted
    ck_assert_int_eq(run_moe("train %s --steps 10000 --quiet --out %s/ref", cfg, dir), 0);
    ck_assert(same_bytes("run/checkpoint/model.safetensors", "ref/checkpoint/model.safetensors"));
    ck_assert(
        same_bytes("run/checkpoint/optimizer.safetensors", "ref/checkpoint/optimizer.safetensors"));
    ck_assert_int_eq(count_lines("run/metrics.jsonl"), count_lines("ref/metrics.jsonl"));
}
END_TEST

START_TEST(test_keep_checkpoints_rotation_and_readers_take_the_run_folder) {
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 7 --quiet --out %s/r "
                             "--set train.keep_checkpoints=2 --set train.ckpt_every=2",
                             dir, dir),
                     0);
    char p[800];
    snprintf(p, sizeof p, "%s/r", dir);
    ck_assert_int_eq(tu_count_entries(p), 5); // config.json metrics.jsonl latest + 2
    ck_assert_str_eq(tu_file_text(dir, "r/latest"), "checkpoint-7\n");
    struct stat st;
    snprintf(p, sizeof p, "%s/r/checkpoint-6/model.safetensors", dir);
    ck_assert_int_eq(stat(p, &st), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "checkpoint: "));
    // every reader takes the run folder: the checkpoint `latest` names
    ck_assert_int_eq(run_moe("eval %s/r --batches 1 --samples 0", dir), 0);
    ck_assert_int_eq(run_moe("generate %s/r --task copy --prompt abc", dir), 0);
    ck_assert_int_eq(run_moe("export %s/r --hf %s/hf", dir, dir), 0);
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 8 --quiet", dir), 0);
    ck_assert_str_eq(tu_file_text(dir, "r/latest"), "checkpoint-8\n");
    snprintf(p, sizeof p, "%s/r/checkpoint-6", dir);
    ck_assert_int_ne(stat(p, &st), 0); // rotated out
    // back to one checkpoint/ folder: `latest` and checkpoint-STEP go, readers follow
    ck_assert_int_eq(
        run_moe("train --resume %s/r --steps 9 --quiet --set train.keep_checkpoints=0", dir), 0);
    snprintf(p, sizeof p, "%s/r", dir);
    ck_assert_int_eq(tu_count_entries(p), 3); // config.json metrics.jsonl checkpoint
    ck_assert_int_eq(run_moe("train --resume %s/r --steps 10 --quiet", dir), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "trained 10 steps (1 of them"));
}
END_TEST

START_TEST(test_did_you_mean_for_every_class_of_name) {
    ck_assert_int_eq(run_moe("trian"), 2); // command
    expect_in_err("did you mean train?");
    ck_assert_int_eq(run_moe("train %s/tiny.json --stepz 3", dir), 2); // option
    expect_in_err("did you mean --steps?");
    ck_assert_int_eq(run_moe("plan %s/tiny.json --node 2", dir), 2);
    expect_in_err("did you mean --nodes?");
    ck_assert_int_eq(run_moe("route --exampel"), 2);
    expect_in_err("did you mean --example?");
    ck_assert_int_eq(run_moe("train %s/tiny.json --set router.topk=1", dir), 2); // --set key
    expect_in_err("did you mean router.top_k?");
    expect_in_err("moe train --help-config");
    write_text("key.json", "{\"train\": {\"step\": 3}}\n"); // key in a file
    ck_assert_int_eq(run_moe("train %s/key.json", dir), 2);
    expect_in_err("did you mean train.steps?");
    write_text("sec.json", "{\"trian\": {\"steps\": 3}}\n"); // section in a file
    ck_assert_int_eq(run_moe("train %s/sec.json", dir), 2);
    expect_in_err("did you mean train?");
    ck_assert_int_eq(run_moe("train %s/tiny.json --set router.noise=jiter", dir), 2); // enum
    expect_in_err("did you mean jitter?");
    expect_in_err("moe train --help-config");
    ck_assert_int_eq(run_moe("route --example --set router.slot_order=prority"), 2);
    expect_in_err("did you mean priority?");
    ck_assert_int_eq(run_moe("plan %s/tiny.json --set loss.impl=cc", dir), 2);
    expect_in_err("did you mean cce?");
    ck_assert_int_eq(run_moe("train %s/tiny.json --set data.tasks=[copy,revrse]", dir), 2); // task
    expect_in_err("did you mean reverse?");
    ck_assert_int_eq(run_moe("train %s/tiny.json --steps 1 --quiet --out %s/r", dir, dir), 0);
    ck_assert_int_eq(run_moe("generate %s/r --task sot --prompt abc", dir), 2);
    expect_in_err("did you mean sort?");
    ck_assert_int_eq(run_moe("train %s/tiny.json --set zzzzzz=1", dir), 2); // nothing near
    ck_assert_ptr_null(strstr(err_text(), "did you mean"));
}
END_TEST

// router.task_priority=[0,2,1] and =0,2,1 in route, plan, train and ablate.
START_TEST(test_set_list_forms_are_accepted_by_every_command) {
    enum { T = 6, E = 4 };
    float logits[T * E];
    int32_t task[T] = {0, 1, 2, 0, 1, 2};
    for (int i = 0; i < T * E; i++)
        logits[i] = (float)((i * 7) % 5) * 0.25f;
    moe_st_entry e[2] = {{"logits", MOE_ST_F32, 2, {T, E}, logits},
                         {"task_ids", MOE_ST_I32, 1, {T}, task}};
    char p[800];
    snprintf(p, sizeof p, "%s/logits.safetensors", dir);
    ck_assert_int_eq(moe_st_write(p, e, 2, NULL), 0);
    write_text("three.json", "{\"model\": {\"d_model\": 16, \"n_layers\": 1, \"n_heads\": 2,\n"
                             "  \"n_kv_heads\": 1, \"d_ff\": 16, \"seq_len\": 16},\n"
                             " \"moe\": {\"num_experts\": 2}, \"train\": {\"batch_size\": 2,\n"
                             "  \"eval_every\": 0}, \"data\": {\"tasks\": [\"copy\", "
                             "\"reverse\", \"sort\"]}}\n");
    const char *forms[2] = {"[0,2,1]", "0,2,1"};
    for (int f = 0; f < 2; f++) {
        const char *v = forms[f];
        ck_assert_msg(
            run_moe("route --logits %s/logits.safetensors --set router.slot_order=priority "
                    "--set 'router.task_priority=%s' --out %s/plan%d.safetensors",
                    dir, v, dir, f) == 0,
            "route %s: %s", v, err_text());
        // (task priorities need priority order: position order never reads them)
        ck_assert_msg(run_moe("plan %s/three.json --set router.slot_order=priority "
                              "--set 'router.task_priority=%s'",
                              dir, v) == 0,
                      "plan %s: %s", v, err_text());
        ck_assert_msg(run_moe("train %s/three.json --set router.slot_order=priority "
                              "--set 'router.task_priority=%s' --dry-run",
                              dir, v) == 0,
                      "train %s: %s", v, err_text());
        ck_assert_msg(run_moe("ablate %s/three.json --set router.slot_order=priority "
                              "--set 'router.task_priority=%s' --steps 1 "
                              "--grid router.top_k=1,2 --out %s/ab%d",
                              dir, v, dir, f) == 0,
                      "ablate %s: %s", v, err_text());
    }
    ck_assert(same_bytes("plan0.safetensors", "plan1.safetensors"));
    // and a malformed list is refused alike, naming the key, in all of them
    ck_assert_int_eq(run_moe("plan %s/three.json --set 'router.task_priority=[0,2'", dir), 2);
    expect_in_err("router.task_priority");
    ck_assert_int_eq(run_moe("route --logits %s/logits.safetensors --set "
                             "'router.task_priority=[0,2' --out %s/x.safetensors",
                             dir, dir),
                     2);
    expect_in_err("router.task_priority");
}
END_TEST

START_TEST(test_ablate_exits_nonzero_when_a_run_failed) {
    ck_assert_int_eq(
        run_moe("ablate %s/tiny.json --steps 3 --grid train.lr=1e-3,1e30 --out %s/ab", dir, dir),
        1);
    expect_in_err("1 of 2 runs failed");
    struct stat st;
    char p[800];
    snprintf(p, sizeof p, "%s/ab/results.md", dir); // the table is written all the same
    ck_assert_int_eq(stat(p, &st), 0);
}
END_TEST

// A run folder whose checkpoint files would pass PATH_MAX is refused before
// training, not at its first save after it (and the event file's name is not
// cut short); the message keeps its reason, which the path alone would fill.
START_TEST(test_a_run_folder_too_long_for_its_checkpoints_is_refused_before_training) {
    char out[4041]; // with "/checkpoint.tmp/" and its longest file name: past 4095
    size_t n = 0;
    for (int i = 0; i < 19; i++) { // 19 folders of 200 characters
        memset(out + n, 'd', 200);
        out[n + 200] = '/';
        n += 201;
    }
    memset(out + n, 'r', sizeof out - 1 - n);
    out[sizeof out - 1] = 0;
    write_text("out.name", out); // the shell reads it: a command line holds 4 KiB
    static const char *const cmds[] = {
        "train tiny.json --steps 3 --quiet --set train.tensorboard=true --out",
        "ablate tiny.json --steps 3 --grid train.lr=1e-3,2e-3 --out"};
    for (int c = 0; c < 2; c++) {
        ck_assert_int_eq(tu_run_moe_in(dir, "%s \"$(cat out.name)\"", cmds[c]), 2);
        const char *e = err_text();
        ck_assert_msg(strstr(e, "path too long for a run folder"), "%s", e);
        ck_assert_msg(strstr(e, "choose a shorter folder"), "%s", e);
        ck_assert_uint_lt(strlen(e), 600);
        char p[1000];
        snprintf(p, sizeof p, "%s/%.200s", dir, out);
        struct stat st;
        ck_assert_msg(stat(p, &st) != 0, "%s: the run's folders were made", cmds[c]);
    }
}
END_TEST

// A message longer than the buffer keeps its start and its end (the reason),
// cut between whole UTF-8 characters.
START_TEST(test_a_long_error_message_keeps_its_end) {
    static char path[6002] = "/"; // odd lengths: both cuts fall inside a character
    for (int i = 0; i < 3000; i++)
        memcpy(path + 1 + 2 * i, "\xc3\xa9", 2);
    ck_assert_int_eq(moe_fail(MOE_EINVAL, "%s: the reasons", path), MOE_EINVAL);
    const char *e = moe_last_error();
    ck_assert_uint_lt(strlen(e), 512);
    ck_assert_msg(!strncmp(e, "/\xc3\xa9\xc3\xa9", 5), "%s", e);
    ck_assert_msg(strstr(e, "\xc3\xa9...\xc3\xa9"), "%s", e);
    const char *end = ": the reasons";
    ck_assert_str_eq(e + strlen(e) - strlen(end), end);
    for (const unsigned char *b = (const unsigned char *)e; *b; b++) {
        if (*b == 0xc3) ck_assert_uint_eq(b[1], 0xa9);
        if (*b == 0xa9) ck_assert_uint_eq(b[-1], 0xc3);
    }
    // an argument of its own message still reads as the message before
    moe_fail(MOE_EIO, "context: %s", moe_last_error());
    ck_assert_str_eq(moe_last_error() + strlen(moe_last_error()) - strlen(end), end);
}
END_TEST

START_TEST(test_version_names_the_project_version) {
    ck_assert_int_eq(run_moe("--version"), 0);
    const char *out = tu_file_text(dir, "out.txt");
    int a, b, c;
    ck_assert_msg(sscanf(out, "moe %d.%d.%d", &a, &b, &c) == 3, "%s", out);
}
END_TEST

int main(void) {
    Suite *s = suite_create("run_folders");
    TCase *tc = tcase_create("cli");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_train_refuses_an_out_that_holds_a_run);
    tcase_add_test(tc, test_a_run_without_checkpoint_is_not_offered_to_resume);
    tcase_add_test(tc, test_resume_errors_name_the_option_and_the_file);
    tcase_add_test(tc, test_dry_run_checks_synthetic_data);
    tcase_add_test(tc, test_resume_from_an_earlier_checkpoint_keeps_one_record_per_step);
    tcase_add_test(tc, test_overwrite_replaces_the_run);
    tcase_add_test(tc, test_overwrite_keeps_a_folder_or_file_where_a_run_writes_the_other);
    tcase_add_test(tc, test_a_run_failed_before_any_step_does_not_hold_the_folder);
    tcase_add_test(tc, test_resume_run_dir_alone_continues_the_run);
    tcase_add_test(tc, test_sigint_stops_with_a_checkpoint_and_a_working_resume_command);
    tcase_add_test(tc, test_keep_checkpoints_rotation_and_readers_take_the_run_folder);
    tcase_add_test(tc, test_did_you_mean_for_every_class_of_name);
    tcase_add_test(tc, test_set_list_forms_are_accepted_by_every_command);
    tcase_add_test(tc, test_ablate_exits_nonzero_when_a_run_failed);
    tcase_add_test(tc, test_train_refuses_a_run_folder_another_train_is_writing);
    tcase_add_test(tc, test_a_refused_run_leaves_no_folder);
    tcase_add_test(tc, test_train_refuses_an_out_holding_a_foreign_config);
    tcase_add_test(tc, test_train_out_that_is_a_file_is_usage_error);
    tcase_add_test(tc, test_file_size_limit_fails_the_write_with_a_message);
    tcase_add_test(tc, test_resume_refuses_a_bad_metrics_file_naming_it);
    tcase_add_test(tc, test_resume_of_a_finished_run_adds_no_records);
    tcase_add_test(tc, test_version_names_the_project_version);
    tcase_add_test(tc, test_a_run_folder_too_long_for_its_checkpoints_is_refused_before_training);
    tcase_add_test(tc, test_a_long_error_message_keeps_its_end);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
