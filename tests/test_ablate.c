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
    ck_assert_int_eq(moe_ablate(&c, ax, 2, out, NULL), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "--grid run 3: "));
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "exceeds"));
    ck_assert_int_eq(access(out, F_OK), -1);
    // A run that fails while training (lr 1e30 diverges) is a row of the
    // table, and the ablation as a whole fails (moe ablate exits 1).
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "train.lr=1e-2,1e30"), 0);
    ck_assert_int_eq(moe_ablate(&c, ax, 2, out, NULL), MOE_ENUMERIC);
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
    ck_assert_int_eq(moe_ablate(&c, &ax, 1, out, NULL), MOE_EINVAL); // before any training
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "sideways"));
}
END_TEST

static Suite *ablate_suite(void) {
    Suite *s = suite_create("ablate");
    TCase *tc = tcase_create("ablate");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_grid_runs_every_combination);
    tcase_add_test(tc, test_grid_parse_and_bad_values);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(ablate_suite());
}
