// `moe ablate` as a user runs it: an --out holding an earlier ablation needs
// --overwrite, a --grid key may be given once, a run that fails is exit 1 and
// a bad grid exit 2 (README "Exit codes").
#include "testutil.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[600];

#define TINY MOE_SOURCE_DIR "/configs/tiny.json"
#define SMALL_MODEL                                                                                \
    " --set model.d_model=32 --set model.n_layers=1 --set model.d_ff=32 --set model.seq_len=16 "   \
    "--set train.batch_size=2 --set train.eval_every=0 "
#define SMALL SMALL_MODEL "--steps 1 "

static int ablate(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "ablate " TINY SMALL "%s", args);
    return tu_run_moe(dir, cmd);
}

static const char *err_text(void) {
    return tu_file_text(dir, "err.txt");
}

START_TEST(test_cli_ablate_out_holding_an_ablation_needs_overwrite) {
    char args[1024], p[800];
    snprintf(args, sizeof args, "--grid router.top_k=1,2,3 --out '%s/ab'", dir);
    ck_assert_int_eq(ablate(args), 0);
    snprintf(args, sizeof args, "--grid router.top_k=2,1 --out '%s/ab'", dir);
    ck_assert_int_eq(ablate(args), 2);
    ck_assert_ptr_nonnull(strstr(err_text(), "already holds an ablation"));
    ck_assert_ptr_nonnull(strstr(err_text(), "--overwrite"));
    snprintf(p, sizeof p, "%s/ab/run_002", dir);
    ck_assert_int_eq(access(p, F_OK), 0);
    snprintf(args, sizeof args, "--grid router.top_k=2,1 --out '%s/ab' --overwrite", dir);
    ck_assert_int_eq(ablate(args), 0);
    ck_assert_int_eq(access(p, F_OK), -1);
}
END_TEST

START_TEST(test_cli_ablate_grid_key_given_twice_is_exit_2) {
    char args[1024];
    snprintf(args, sizeof args, "--grid train.lr=1e-3 --grid train.lr=2e-3 --out '%s/twice'", dir);
    ck_assert_int_eq(ablate(args), 2);
    ck_assert_ptr_nonnull(strstr(err_text(), "--grid train.lr given twice"));
}
END_TEST

// A run of the grid failing at run time (a corrupt token file, which moe
// train alone refuses with exit 2) makes the ablation exit 1; the other run
// trains.
START_TEST(test_cli_ablate_failed_run_is_exit_1) {
    char bad[700], args[2048];
    snprintf(bad, sizeof bad, "%s/bad.bin", dir);
    FILE *f = fopen(bad, "w");
    for (int i = 0; i < 300; i++)
        fputs("garbage", f);
    fclose(f);
    snprintf(args, sizeof args,
             "--set data.path='%s' --grid data.kind=synthetic,llmc --out '%s/failed'", bad, dir);
    ck_assert_int_eq(ablate(args), 1);
    ck_assert_ptr_nonnull(strstr(err_text(), "1 of 2 runs failed (first: "));
    ck_assert_ptr_nonnull(strstr(err_text(), "/failed/run_001: "));
    // bad data would fail again: --resume keeps the run, and the message says so
    ck_assert_msg(strstr(err_text(), "; the same moe ablate command with --resume keeps them (it "
                                     "trains again only runs that failed on a write or on "
                                     "memory)\n") != NULL,
                  "%s", err_text());
}
END_TEST

// results.csv without the columns a rerun cannot repeat (tokens_per_s and
// seconds: fields 4 and 7 of a one-axis grid).
static void stable_csv(const char *path, char *buf, size_t cap) {
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    size_t n = 0;
    int field = 0, c;
    bool quoted = false;
    while ((c = fgetc(f)) != EOF && n + 1 < cap) {
        if (c == '"') quoted = !quoted;
        if (!quoted && c == ',') field++;
        if (field != 4 && field != 7) buf[n++] = (char)c;
        if (!quoted && c == '\n') field = 0;
    }
    buf[n] = 0;
    fclose(f);
}

#define STOP_GRID "--steps 1500 --grid train.lr=1e-3,2e-3,3e-3 --set train.eval_every=100 "

// Runs `moe ARGS` (stdout and stderr to out.txt, err.txt in dir) and sends it
// sig once path exists (or lets it end first): the wait status. No sleep
// decides the order, only the file.
static int signal_once_exists(const char *args, const char *path, int sig) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec '%s' %s >'%s/out.txt' 2>'%s/err.txt'", getenv("MOE_BIN"), args,
             dir, dir);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int st;
    while (access(path, F_OK) != 0 && waitpid(pid, &st, WNOHANG) == 0)
        usleep(200);
    ck_assert_int_eq(kill(pid, sig), 0);
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    return st;
}

// Ctrl-C during run 2 of 3: run_001 saves a checkpoint, the tables hold the
// finished run and the stopped one, exit 130; the same command with --resume
// continues run_001 from its checkpoint, trains run_002 and writes tables
// equal to an uninterrupted grid's (but for tokens/s and seconds). The signal
// is sent once run_001 has started (its metrics.jsonl exists): no sleep
// decides the order.
START_TEST(test_cli_ablate_ctrl_c_stops_and_resume_finishes_the_grid) {
    char args[2048], cmd[4096], p[800];
    // Long enough runs that run_001 is still training when the signal lands.
    snprintf(args, sizeof args, "ablate " TINY SMALL_MODEL STOP_GRID "--out '%s/whole'", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 0);
    snprintf(args, sizeof args, "ablate " TINY SMALL_MODEL STOP_GRID "--out '%s/stop'", dir);
    snprintf(p, sizeof p, "%s/stop/run_001/metrics.jsonl", dir);
    const int st = signal_once_exists(args, p, SIGINT);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "status %d: %s", st, err_text());
    ck_assert_ptr_nonnull(strstr(err_text(), "--resume"));
    snprintf(p, sizeof p, "%s/stop/results.csv", dir);
    FILE *f = fopen(p, "r");
    ck_assert_ptr_nonnull(f);
    fclose(f);
    const char *csv = tu_file_text(dir, "stop/results.csv");
    ck_assert_msg(strstr(csv, "\n0,\"1e-3\",ok,") != NULL, "%s", csv);
    ck_assert_msg(strstr(csv, "\n1,\"2e-3\",stopped,") != NULL, "%s", csv);
    ck_assert_ptr_null(strstr(csv, "\n2,"));
    snprintf(p, sizeof p, "%s/stop/run_001/checkpoint", dir);
    ck_assert_int_eq(access(p, F_OK), 0);
    // The same command again is refused (no --resume nor --overwrite): the
    // finished run stays.
    snprintf(cmd, sizeof cmd, "%s", args);
    ck_assert_int_eq(tu_run_moe(dir, cmd), 2);
    ck_assert_ptr_nonnull(strstr(err_text(), "--resume"));
    snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " --resume");
    ck_assert_msg(tu_run_moe(dir, cmd) == 0, "%s", err_text());
    static char whole[16384], resumed[16384];
    snprintf(p, sizeof p, "%s/whole/results.csv", dir);
    stable_csv(p, whole, sizeof whole);
    snprintf(p, sizeof p, "%s/stop/results.csv", dir);
    stable_csv(p, resumed, sizeof resumed);
    ck_assert_str_eq(resumed, whole);
}
END_TEST

// A file size limit too small for a checkpoint: each run fails with the write
// error (errno's text), the grid goes on and exits 1; once the limit is lifted,
// --resume trains the runs that failed on the write again (it kept them as
// failed) and the tables equal an unlimited grid's.
START_TEST(test_cli_ablate_resume_retrains_runs_a_failed_write_stopped) {
    char args[1024], p[800];
    snprintf(args, sizeof args, "--grid train.lr=1e-3,2e-3 --out '%s/whole_fs'", dir);
    ck_assert_int_eq(ablate(args), 0);
    struct rlimit old, small;
    ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    small = old;
    small.rlim_cur = 64 * 1024; // the tables fit, a checkpoint does not
    signal(SIGXFSZ, SIG_IGN);   // (the child gets EFBIG, as moe itself ignores it)
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &small), 0);
    snprintf(args, sizeof args, "--grid train.lr=1e-3,2e-3 --out '%s/fs'", dir);
    int rc = ablate(args);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, SIG_DFL);
    ck_assert_int_eq(rc, 1);
    ck_assert_msg(strstr(err_text(), "2 of 2 runs failed (first: ") != NULL, "%s", err_text());
    ck_assert_ptr_nonnull(strstr(err_text(), "write failed: File too large"));
    ck_assert_msg(strstr(err_text(), "; the same moe ablate command with --resume trains again "
                                     "the 2 that failed on a write or on memory\n") != NULL,
                  "%s", err_text());
    const char *csv = tu_file_text(dir, "fs/results.csv");
    ck_assert_msg(strstr(csv, "\n1,\"2e-3\",failed,") != NULL, "%s", csv);
    snprintf(args, sizeof args, "--grid train.lr=1e-3,2e-3 --out '%s/fs' --resume", dir);
    ck_assert_msg(ablate(args) == 0, "%s", err_text());
    ck_assert_msg(strstr(err_text(), "[1/2] run_000: failed earlier (") != NULL, "%s", err_text());
    ck_assert_ptr_nonnull(strstr(err_text(), "File too large), training again"));
    static char whole[16384], resumed[16384];
    snprintf(p, sizeof p, "%s/whole_fs/results.csv", dir);
    stable_csv(p, whole, sizeof whole);
    snprintf(p, sizeof p, "%s/fs/results.csv", dir);
    stable_csv(p, resumed, sizeof resumed);
    ck_assert_str_eq(resumed, whole);
}
END_TEST

// A run's metrics.jsonl: how many step and evaluation records it holds, and
// the last step's "loss" field as written.
static void run_records(const char *path, int *steps, int *evals, char *loss, size_t cap) {
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    static char line[65536];
    *steps = *evals = 0;
    loss[0] = 0;
    while (fgets(line, sizeof line, f)) {
        *evals += !strncmp(line, "{\"eval_step\": ", 14);
        if (strncmp(line, "{\"step\": ", 9)) continue;
        ++*steps;
        const char *l = strstr(line, "\"loss\": ");
        ck_assert_ptr_nonnull(l);
        snprintf(loss, cap, "%.*s", (int)strcspn(l + 8, ","), l + 8);
    }
    fclose(f);
}

#define KILL_GRID "--steps 30 --grid train.lr=1e-3,2e-3,3e-3 --set train.eval_every=10 "

// kill -9 of moe ablate once run_000 holds its final checkpoint (renamed into
// place whole, so its appearance is the point; the final evaluation and the
// grid's record of the run come after it): the same command with --resume
// gives the tables of an uninterrupted grid (but for tokens/s and seconds),
// each run's metrics.jsonl one record per step and evaluation, and the same
// last loss per run.
START_TEST(test_cli_ablate_kill_9_then_resume_equals_an_uninterrupted_grid) {
    char args[2048], cmd[4096], p[800];
    snprintf(args, sizeof args, "ablate " TINY SMALL_MODEL KILL_GRID "--out '%s/kwhole'", dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", err_text());
    snprintf(args, sizeof args, "ablate " TINY SMALL_MODEL KILL_GRID "--out '%s/kill'", dir);
    snprintf(p, sizeof p, "%s/kill/run_000/checkpoint", dir);
    const int st = signal_once_exists(args, p, SIGKILL);
    ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "status %d: %s", st, err_text());
    snprintf(cmd, sizeof cmd, "%s --resume", args);
    ck_assert_msg(tu_run_moe(dir, cmd) == 0, "%s", err_text());
    // run_000 is resumed from its checkpoint or kept (when the grid recorded
    // it before the kill), never trained again from the start
    const char *log = err_text();
    ck_assert_msg(strstr(log, "[1/3] train.lr=1e-3 (resuming) ...") != NULL ||
                      strstr(log, "[1/3] run_000: finished earlier, kept") != NULL,
                  "%s", log);
    static char whole[16384], resumed[16384];
    snprintf(p, sizeof p, "%s/kwhole/results.csv", dir);
    stable_csv(p, whole, sizeof whole);
    snprintf(p, sizeof p, "%s/kill/results.csv", dir);
    stable_csv(p, resumed, sizeof resumed);
    ck_assert_str_eq(resumed, whole);
    // every row holds the whole run: run_000's steps_run counts the steps
    // before the kill too (it was 0 when the resume found no step left)
    const char *state = tu_file_text(dir, "kill/ablate.json");
    int whole_runs = 0;
    for (const char *q = state; (q = strstr(q, "\"steps_run\": 30,")) != NULL; q++)
        whole_runs++;
    ck_assert_msg(whole_runs == 3, "%.900s", strstr(state, "steps_run") ? strstr(state, "steps_run") : state);
    for (int i = 0; i < 3; i++) {
        int s1, e1, s2, e2;
        char l1[64], l2[64];
        snprintf(p, sizeof p, "%s/kwhole/run_%03d/metrics.jsonl", dir, i);
        run_records(p, &s1, &e1, l1, sizeof l1);
        snprintf(p, sizeof p, "%s/kill/run_%03d/metrics.jsonl", dir, i);
        run_records(p, &s2, &e2, l2, sizeof l2);
        ck_assert_int_eq(s1, 30);
        ck_assert_int_eq(e1, 3); // steps 10 and 20, and the final one
        ck_assert_int_eq(s2, s1);
        ck_assert_int_eq(e2, e1);
        ck_assert_str_eq(l2, l1);
    }
}
END_TEST

// --steps N next to a train.steps from --set or --grid: one would silently
// win, so both is exit 2 naming both; a bad --steps names --steps.
START_TEST(test_cli_ablate_steps_beside_a_train_steps_setting_is_exit_2) {
    char args[1024];
    snprintf(args, sizeof args, "--set train.steps=5 --grid train.lr=1e-3 --out '%s/st'", dir);
    ck_assert_int_eq(ablate(args), 2);
    ck_assert_ptr_nonnull(strstr(err_text(), "--steps 1 and --set train.steps=5 both set"));
    snprintf(args, sizeof args, "--grid train.steps=5,3 --out '%s/st'", dir);
    ck_assert_int_eq(ablate(args), 2);
    ck_assert_ptr_nonnull(strstr(err_text(), "--steps 1 and --grid train.steps both set"));
    snprintf(args, sizeof args, "ablate " TINY " --steps 0 --grid train.lr=1e-3 --out '%s/st'",
             dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_msg(strstr(err_text(), "moe ablate: --steps 0: train.steps = 0") != NULL, "%s",
                  err_text());
    snprintf(args, sizeof args, "%s/st", dir);
    ck_assert_int_eq(access(args, F_OK), -1);
}
END_TEST

// --overwrite over a run_000 that is a link removes the link; the run it
// points to (someone else's) is neither cleared nor trained into.
START_TEST(test_cli_ablate_overwrite_removes_a_run_link_not_its_target) {
    char args[1024], p[800], target[700];
    snprintf(args, sizeof args, "--grid train.lr=1e-3 --out '%s/theirs'", dir);
    ck_assert_int_eq(ablate(args), 0);
    snprintf(target, sizeof target, "%s/theirs/run_000", dir);
    snprintf(p, sizeof p, "%s/mine", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/mine/run_000", dir);
    ck_assert_int_eq(symlink(target, p), 0);
    snprintf(p, sizeof p, "%s/theirs/run_000/metrics.jsonl", dir);
    struct stat before, after;
    ck_assert_int_eq(stat(p, &before), 0);
    snprintf(args, sizeof args, "--grid train.lr=2e-3 --out '%s/mine' --overwrite", dir);
    ck_assert_msg(ablate(args) == 0, "%s", err_text());
    ck_assert_int_eq(stat(p, &after), 0);
    ck_assert_int_eq(after.st_ino, before.st_ino);
    ck_assert_int_eq(after.st_mtime, before.st_mtime);
    ck_assert_int_eq(after.st_size, before.st_size);
    const char *theirs = tu_file_text(dir, "theirs/run_000/config.json");
    ck_assert_ptr_nonnull(strstr(theirs, "\"lr\": 0.001"));
    ck_assert_ptr_null(strstr(theirs, "\"lr\": 0.002"));
    snprintf(p, sizeof p, "%s/mine/run_000", dir);
    ck_assert_int_eq(lstat(p, &after), 0);
    ck_assert(S_ISDIR(after.st_mode));
}
END_TEST

// An ablation in progress holds its folder's lock (as moe train holds its run
// folder's): a second ablate of that folder, even with --overwrite, is refused
// and removes nothing (it used to delete the first one's runs under it).
START_TEST(test_cli_ablate_second_ablate_of_a_busy_folder_is_exit_2) {
    char args[1024], p[800];
    snprintf(args, sizeof args, "--grid router.top_k=1,2 --out '%s/busy'", dir);
    ck_assert_int_eq(ablate(args), 0);
    snprintf(p, sizeof p, "%s/busy", dir);
    int fd = open(p, O_RDONLY | O_DIRECTORY); // the first ablate, still training
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(flock(fd, LOCK_EX | LOCK_NB), 0);
    snprintf(args, sizeof args, "--grid router.top_k=1,2 --out '%s/busy' --overwrite", dir);
    ck_assert_int_eq(ablate(args), 2);
    ck_assert_msg(strstr(err_text(), "holds the folder's lock") != NULL, "%s", err_text());
    snprintf(args, sizeof args, "--grid router.top_k=1,2 --out '%s/busy' --resume", dir);
    ck_assert_int_eq(ablate(args), 2);
    close(fd);
    snprintf(p, sizeof p, "%s/busy/run_001/checkpoint", dir);
    ck_assert_int_eq(access(p, F_OK), 0);
}
END_TEST

static Suite *cli_ablate_suite(void) {
    Suite *s = suite_create("cli_ablate");
    TCase *tc = tcase_create("cli_ablate");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_cli_ablate_out_holding_an_ablation_needs_overwrite);
    tcase_add_test(tc, test_cli_ablate_grid_key_given_twice_is_exit_2);
    tcase_add_test(tc, test_cli_ablate_failed_run_is_exit_1);
    tcase_add_test(tc, test_cli_ablate_ctrl_c_stops_and_resume_finishes_the_grid);
    tcase_add_test(tc, test_cli_ablate_resume_retrains_runs_a_failed_write_stopped);
    tcase_add_test(tc, test_cli_ablate_kill_9_then_resume_equals_an_uninterrupted_grid);
    tcase_add_test(tc, test_cli_ablate_steps_beside_a_train_steps_setting_is_exit_2);
    tcase_add_test(tc, test_cli_ablate_overwrite_removes_a_run_link_not_its_target);
    tcase_add_test(tc, test_cli_ablate_second_ablate_of_a_busy_folder_is_exit_2);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    return tu_run(cli_ablate_suite());
}
