// `moe ablate` as a user runs it: an --out holding an earlier ablation needs
// --overwrite, a --grid key may be given once, a run that fails is exit 1 and
// a bad grid exit 2 (README "Exit codes").
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[600];

#define TINY MOE_SOURCE_DIR "/configs/tiny.json"
#define SMALL                                                                                      \
    " --set model.d_model=32 --set model.n_layers=1 --set model.d_ff=32 --set model.seq_len=16 "   \
    "--set train.batch_size=2 --set train.eval_every=0 --steps 1 "

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
}
END_TEST

static Suite *cli_ablate_suite(void) {
    Suite *s = suite_create("cli_ablate");
    TCase *tc = tcase_create("cli_ablate");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_cli_ablate_out_holding_an_ablation_needs_overwrite);
    tcase_add_test(tc, test_cli_ablate_grid_key_given_twice_is_exit_2);
    tcase_add_test(tc, test_cli_ablate_failed_run_is_exit_1);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    return tu_run(cli_ablate_suite());
}
