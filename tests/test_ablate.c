// Ablation grids: every combination runs with the same seed, a failing run
// is recorded in its row while the rest go on, results.md is sorted by loss.
#include "moe/ablate.h"
#include "moe/error.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int count_lines(const char *path, const char *needle) {
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f))
        n += !needle || strstr(line, needle) != NULL;
    fclose(f);
    return n;
}

START_TEST(test_grid_runs_every_combination) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32", "model.n_layers=2",  "model.d_ff=48",
                          "model.seq_len=32", "moe.num_experts=4", "train.batch_size=4",
                          "train.steps=6",    "train.eval_every=0"};
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i]), 0);
    moe_grid_axis ax[2];
    ck_assert_int_eq(moe_grid_axis_parse(&ax[0], "router.slot_order=position,priority"), 0);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "router.top_k=1,9"), 0); // 9 > 4 experts
    char out[700], p[800];
    snprintf(out, sizeof out, "%s/grid", tu_tmpdir());
    // A combination the config check refuses stops the grid before any run.
    ck_assert_int_eq(moe_ablate(&c, ax, 2, NULL, 0, out, NULL), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "--grid run 3: "));
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "exceeds"));
    ck_assert_int_eq(access(out, F_OK), -1);
    // A run that fails while training (lr 1e30 diverges) is a row of the
    // table, and the ablation as a whole fails (moe ablate exits 1).
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "train.lr=1e-2,1e30"), 0);
    ck_assert_int_eq(moe_ablate(&c, ax, 2, NULL, 0, out, NULL), MOE_ENUMERIC);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "2 of 4 runs failed"));
    snprintf(p, sizeof p, "%s/results.csv", out);
    ck_assert_int_eq(count_lines(p, NULL), 5); // header + 4 runs
    ck_assert_int_eq(count_lines(p, ",ok,"), 2);
    ck_assert_int_eq(count_lines(p, "step "), 2); // the divergence message names the step
    snprintf(p, sizeof p, "%s/results.md", out);
    ck_assert_int_eq(count_lines(p, "failed: "), 2);
    // sorted: the two finished runs first, ascending loss
    FILE *f = fopen(p, "r");
    char line[4096];
    double prev = -1;
    int rows = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "| ", 2) || strstr(line, "rank") || strstr(line, "failed")) continue;
        // | rank | slot_order | top_k | val loss | ...
        char *cell = line;
        for (int k = 0; k < 4; k++)
            cell = strchr(cell + 1, '|');
        double loss = strtod(cell + 1, NULL);
        ck_assert(loss >= prev);
        prev = loss;
        rows++;
    }
    fclose(f);
    ck_assert_int_eq(rows, 2);
    snprintf(p, sizeof p, "%s/run_000/config.json", out);
    ck_assert_int_gt(count_lines(p, NULL), 10);
}
END_TEST

START_TEST(test_grid_parse_and_bad_values) {
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "moe.num_experts=[4,8],8,[2,2]"), 0);
    ck_assert_int_eq(ax.n, 3);
    ck_assert_str_eq(ax.values[0], "[4,8]");
    ck_assert_str_eq(ax.values[2], "[2,2]");
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k"), MOE_EINVAL);
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,,2"), MOE_EINVAL);
    moe_config c;
    moe_config_default(&c);
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.slot_order=position,sideways"), 0);
    char out[700];
    snprintf(out, sizeof out, "%s/bad", tu_tmpdir());
    ck_assert_int_eq(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL), MOE_EINVAL); // before any training
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "sideways"));
}
END_TEST

// --grid config=A,B: each run loads its file over the base, the --set values
// win over the file (train.steps), and the other axes apply last.
START_TEST(test_grid_over_config_files) {
    char dir[600], a[700], b[700], out[700], p[800];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(a, sizeof a, "%s/a.json", dir);
    snprintf(b, sizeof b, "%s/b.json", dir);
    FILE *f = fopen(a, "w");
    fputs("{\"router\": {\"score\": \"softmax\"}, \"train\": {\"steps\": 500}}", f);
    fclose(f);
    f = fopen(b, "w");
    fputs("{\"router\": {\"score\": \"sigmoid\", \"bias_update_rate\": 0.001}}", f);
    fclose(f);
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32", "model.n_layers=2",  "model.d_ff=48",
                          "model.seq_len=32", "moe.num_experts=4", "train.batch_size=4",
                          "train.steps=3",    "train.eval_every=0"};
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i]), 0);
    moe_grid_axis ax[2];
    char spec[1500];
    snprintf(spec, sizeof spec, "config=%s,%s", a, b);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[0], spec), 0);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "router.top_k=1,2"), 0);
    snprintf(out, sizeof out, "%s/grid", dir);
    ck_assert_msg(moe_ablate(&c, ax, 2, sets, 8, out, NULL) == 0, "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/results.csv", out);
    ck_assert_int_eq(count_lines(p, ",ok,"), 4);
    // run index = config + 2 * top_k: run_001 is b.json with top_k 1
    moe_config r;
    moe_config_default(&r);
    snprintf(p, sizeof p, "%s/run_001/config.json", out);
    ck_assert_msg(moe_config_load(&r, NULL, p) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.router.score, MOE_SCORE_SIGMOID);
    ck_assert_double_eq(r.router.bias_update_rate, 0.001);
    ck_assert_int_eq(r.router.top_k, 1);
    ck_assert_int_eq(r.model.d_model, 32);
    snprintf(p, sizeof p, "%s/run_002/config.json", out);
    ck_assert_msg(moe_config_load(&r, NULL, p) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.router.score, MOE_SCORE_SOFTMAX);
    ck_assert_int_eq(r.train.steps, 3); // --set over the file's 500
    ck_assert_int_eq(r.router.top_k, 2);
    // A file that does not load stops the grid before any run.
    snprintf(spec, sizeof spec, "config=%s,%s/none.json", a, dir);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[0], spec), 0);
    snprintf(out, sizeof out, "%s/grid2", dir);
    ck_assert_int_lt(moe_ablate(&c, ax, 2, sets, 8, out, NULL), 0);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "none.json"));
    ck_assert_int_eq(access(out, F_OK), -1);
}
END_TEST

static Suite *ablate_suite(void) {
    Suite *s = suite_create("ablate");
    TCase *tc = tcase_create("ablate");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_grid_runs_every_combination);
    tcase_add_test(tc, test_grid_parse_and_bad_values);
    tcase_add_test(tc, test_grid_over_config_files);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(ablate_suite());
}
