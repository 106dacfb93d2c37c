// `moe plan` as a user runs it: a refused plan prints nothing and one line
// naming the fault once ("moe plan: ..."), whatever parallel.ep; the
// placement table follows placement.mode = replicate and move alike.
#include "testutil.h"

#include <stdio.h>
#include <string.h>

static char dir[600];

#define TINY MOE_SOURCE_DIR "/configs/tiny.json"

static int plan(const char *args) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "plan " TINY " %s", args);
    return tu_run_moe(dir, cmd);
}

// stderr, whole: one line, the prefix once.
static void assert_error(const char *want) {
    ck_assert_str_eq(tu_file_text(dir, "err.txt"), want);
    ck_assert_str_eq(tu_file_text(dir, "out.txt"), "");
}

START_TEST(test_cli_plan_zero_load_is_refused_before_printing_for_every_ep) {
    static const char *const eps[] = {"1", "2", "4"};
    for (int i = 0; i < 3; i++) {
        char args[256];
        snprintf(args, sizeof args, "--load 0,0,0,0,0,0,0,0 --set parallel.ep=%s", eps[i]);
        ck_assert_int_eq(plan(args), 2);
        assert_error("moe plan: --load: the weights sum to 0; give some expert a weight > 0\n");
    }
}
END_TEST

START_TEST(test_cli_plan_library_refusal_is_named_once) {
    // 3 ranks cannot hold groups of parallel.ep = 2
    ck_assert_int_eq(plan("--set parallel.ep=2 --ranks-per-node 3 --nodes 1"), 2);
    assert_error("moe plan: 3 ranks cannot hold expert-parallel groups of 2\n");
    ck_assert_int_eq(plan("--set parallel.ep=2 --ranks-per-node 1 --nodes 1"), 2);
    assert_error("moe plan: 1 rank cannot hold expert-parallel groups of 2\n");
}
END_TEST

// --ranks-per-node without --nodes is one node of those ranks: a refusal names
// the --nodes that fits, the fewest nodes whose ranks the EP groups fill.
START_TEST(test_cli_plan_one_node_too_small_names_the_nodes_that_fit) {
    ck_assert_int_eq(plan("--set parallel.ep=8 --ranks-per-node 4"), 2);
    assert_error("moe plan: 4 ranks (one node of --ranks-per-node 4) cannot hold expert-parallel "
                 "groups of 8: give --nodes 2 for 8 ranks\n");
    ck_assert_int_eq(plan("--set parallel.ep=2 --ranks-per-node 3"), 2);
    assert_error("moe plan: 3 ranks (one node of --ranks-per-node 3) cannot hold expert-parallel "
                 "groups of 2: give --nodes 2 for 6 ranks\n");
    ck_assert_int_eq(plan("--set parallel.ep=4 --ranks-per-node 6"), 2); // 2 x 6 = 3 groups
    assert_error("moe plan: 6 ranks (one node of --ranks-per-node 6) cannot hold expert-parallel "
                 "groups of 4: give --nodes 2 for 12 ranks\n");
    ck_assert_int_eq(plan("--set parallel.ep=8 --ranks-per-node 4 --nodes 2"), 0); // as advised
    const char *out = tu_file_text(dir, "out.txt");
    ck_assert_msg(strstr(out, "plan: 2 nodes x 4 ranks = 8 ranks") != NULL, "%s", out);
}
END_TEST

// A run with comm.ranks_per_node = G simulates nodes of G ranks: the plan
// models that machine unless told another.
START_TEST(test_cli_plan_takes_the_node_shape_from_comm_ranks_per_node) {
    ck_assert_int_eq(plan("--set parallel.ep=4 --set comm.ranks_per_node=2"), 0);
    const char *out = tu_file_text(dir, "out.txt");
    ck_assert_msg(strstr(out, "plan: 2 nodes x 2 ranks = 4 ranks") != NULL, "%s", out);
    ck_assert_int_eq(plan("--set parallel.ep=4"), 0);
    out = tu_file_text(dir, "out.txt");
    ck_assert_msg(strstr(out, "plan: 1 node x 4 ranks = 4 ranks") != NULL, "%s", out);
}
END_TEST

START_TEST(test_cli_plan_refuses_ranks_per_node_that_cannot_hold_the_ranks) {
    ck_assert_int_eq(plan("--set parallel.ep=4 --set comm.ranks_per_node=3"), 2);
    assert_error("moe plan: comm.ranks_per_node = 3 does not divide parallel.ep = 4 ranks (moe "
                 "plan --nodes N models N nodes of 3 ranks)\n");
    ck_assert_int_eq(plan("--set parallel.ep=4 --set comm.ranks_per_node=2 --ranks-per-node 4"), 2);
    assert_error("moe plan: --ranks-per-node 4 disagrees with comm.ranks_per_node = 2 (the node "
                 "size a run of this config simulates): give one\n");
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "train " TINY " --set parallel.ep=4 --set comm.ranks_per_node=3 --dry-run");
    ck_assert_int_eq(tu_run_moe(dir, cmd), 2);
    assert_error("moe train: comm.ranks_per_node = 3 does not divide parallel.ep = 4 ranks (moe "
                 "plan --nodes N models N nodes of 3 ranks)\n");
}
END_TEST

// The links are printed as given: 0.5 Gb/s showed as "0 Gb/s" and 0.05 us
// as "0.0 us" (fixed decimals); the refusal of a value out of range names the
// range, not only "finite numbers > 0" (1e13 is one).
START_TEST(test_cli_plan_prints_the_links_as_given) {
    ck_assert_int_eq(plan("--set parallel.ep=2 --link-gbps 0.5,0.25 --latency-us 0.05,1e-3"), 0);
    ck_assert_msg(strstr(tu_file_text(dir, "out.txt"),
                         "(links: intra 0.5 Gb/s 0.05 us, inter 0.25 Gb/s 0.001 us):\n") != NULL,
                  "%s", tu_file_text(dir, "out.txt"));
    ck_assert_int_eq(plan("--link-gbps 400,1e13"), 2);
    assert_error("moe plan: --link-gbps needs INTRA,INTER, numbers in (0, 1e12]\n");
    ck_assert_int_eq(plan("--latency-us 0,5"), 2);
    assert_error("moe plan: --latency-us needs INTRA,INTER, numbers in (0, 1e12]\n");
}
END_TEST

START_TEST(test_cli_plan_option_given_twice_says_only_that) {
    static const char *const cases[][2] = {
        {"--nodes 1 --nodes 2", "moe plan: --nodes given twice\n"},
        {"--ranks-per-node 1 --ranks-per-node 2", "moe plan: --ranks-per-node given twice\n"},
        {"--skew 0.1 --skew 0.2", "moe plan: --skew given twice\n"},
        {"--link-gbps 1,2 --link-gbps 1,2", "moe plan: --link-gbps given twice\n"},
        {"--latency-us 1,2 --latency-us 1,2", "moe plan: --latency-us given twice\n"},
        {"--load 1 --load 1", "moe plan: --load given twice\n"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ck_assert_int_eq(plan(cases[i][0]), 2);
        assert_error(cases[i][1]);
    }
}
END_TEST

// --help promises the table for placement.mode = replicate or move.
START_TEST(test_cli_plan_prints_placement_for_replicate_and_move) {
    static const char *const modes[][2] = {{"replicate", "replicate"}, {"move", "move"}};
    for (int i = 0; i < 2; i++) {
        char args[256], head[128];
        snprintf(args, sizeof args,
                 "--set parallel.ep=4 --set placement.mode=%s --set placement.slots_per_rank=3",
                 modes[i][0]);
        ck_assert_int_eq(plan(args), 0);
        const char *out = tu_file_text(dir, "out.txt");
        ck_assert_msg(strstr(out, "expert placement over the EP group of 4 ranks") != NULL, "%s",
                      out);
        snprintf(head, sizeof head, "static %14s", modes[i][1]);
        ck_assert_msg(strstr(out, head) != NULL, "no '%s' in %s", head, out);
    }
    ck_assert_int_eq(plan("--set parallel.ep=4"), 0); // static: no table unless asked
    ck_assert_ptr_null(strstr(tu_file_text(dir, "out.txt"), "expert placement"));
}
END_TEST

// Counts of one read in the singular: the header said "1 node x 1 ranks = 1
// ranks", the all-to-all "a token's 1 choices reach".
START_TEST(test_cli_plan_counts_of_one_are_singular) {
    ck_assert_int_eq(plan(""), 0);
    const char *out = tu_file_text(dir, "out.txt");
    const char *head = "plan: 1 node x 1 rank = 1 rank; expert parallel 1 x data parallel 1\n";
    ck_assert_msg(!strncmp(out, head, strlen(head)), "%s", out);
    ck_assert_int_eq(plan("--set parallel.ep=2 --set router.top_k=1 --nodes 2 --ranks-per-node 1"),
                     0);
    out = tu_file_text(dir, "out.txt");
    head = "plan: 2 nodes x 1 rank = 2 ranks; expert parallel 2 x data parallel 1\n";
    ck_assert_msg(!strncmp(out, head, strlen(head)), "%s", out);
    ck_assert_msg(strstr(out, "a token's 1 choice reaches 0.50 other nodes") != NULL, "%s", out);
    ck_assert_int_eq(plan("--set parallel.ep=4 --nodes 2 --ranks-per-node 2"), 0);
    out = tu_file_text(dir, "out.txt");
    head = "plan: 2 nodes x 2 ranks = 4 ranks; expert parallel 4 x data parallel 1\n";
    ck_assert_msg(!strncmp(out, head, strlen(head)), "%s", out);
    ck_assert_msg(strstr(out, "a token's 2 choices reach ") != NULL, "%s", out);
}
END_TEST

static Suite *cli_plan_suite(void) {
    Suite *s = suite_create("cli_plan");
    TCase *tc = tcase_create("cli_plan");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_cli_plan_zero_load_is_refused_before_printing_for_every_ep);
    tcase_add_test(tc, test_cli_plan_library_refusal_is_named_once);
    tcase_add_test(tc, test_cli_plan_one_node_too_small_names_the_nodes_that_fit);
    tcase_add_test(tc, test_cli_plan_takes_the_node_shape_from_comm_ranks_per_node);
    tcase_add_test(tc, test_cli_plan_refuses_ranks_per_node_that_cannot_hold_the_ranks);
    tcase_add_test(tc, test_cli_plan_option_given_twice_says_only_that);
    tcase_add_test(tc, test_cli_plan_prints_the_links_as_given);
    tcase_add_test(tc, test_cli_plan_prints_placement_for_replicate_and_move);
    tcase_add_test(tc, test_cli_plan_counts_of_one_are_singular);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    return tu_run(cli_plan_suite());
}
