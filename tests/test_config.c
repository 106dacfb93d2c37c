// Run configuration: defaults, JSON loading with file:line:col errors, typed
// --set overrides, combination checks, and the resolved-config round trip.
#include "moe/config.h"
#include "moe/error.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char path[600];

static const char *write_cfg(const char *text) {
    const char *dir = tu_tmpdir();
    ck_assert_ptr_nonnull(dir);
    snprintf(path, sizeof path, "%s/cfg.json", dir);
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
    return path;
}

// Loads text over the defaults; returns the status, message in moe_last_error().
static int load(moe_config *c, const char *text) {
    moe_config_default(c);
    moe_config_src *src = moe_config_src_new();
    int rc = moe_config_load(c, src, write_cfg(text));
    if (rc == 0) rc = moe_config_check(c, src);
    moe_config_src_free(src);
    return rc;
}

static void assert_error(const char *text, const char *where, const char *what) {
    moe_config c;
    ck_assert_msg(load(&c, text) == MOE_EINVAL, "accepted: %s", text);
    char want[700];
    snprintf(want, sizeof want, "%s%s", path, where);
    ck_assert_msg(strstr(moe_last_error(), want) && strstr(moe_last_error(), what),
                  "message '%s' lacks '%s' or '%s'", moe_last_error(), want, what);
}

START_TEST(test_defaults_are_valid) {
    moe_config c;
    moe_config_default(&c);
    ck_assert_int_eq(moe_config_check(&c, NULL), 0);
    ck_assert_int_eq(c.router.top_k, 2);
    ck_assert(c.router.capacity_factor == 1.25);
    ck_assert_int_eq(c.moe.num_experts[0], 8);
    ck_assert_int_eq(c.data.n_tasks, 5);
    ck_assert_str_eq(c.data.tasks[4], "caesar");
    ck_assert_str_eq(c.comm.all_to_all, "flat");
    ck_assert_int_eq(c.router.capacity_mode, MOE_CAPACITY_STATIC);
    // the rest of the router defaults DESIGN.md documents
    ck_assert_int_eq(c.router.min_capacity, 4);
    ck_assert_int_eq(c.router.slot_order, MOE_SLOT_POSITION);
    ck_assert(c.router.normalize_topk);
    ck_assert(c.router.noise_eps == 0.01);
    ck_assert(c.router.aux_loss_coef == 0.01);
    ck_assert(c.router.z_loss_coef == 0.001);
    ck_assert(!c.router.aux_counts_all_k);
    ck_assert_int_eq(c.router.n_task_priority, 0);
    ck_assert(c.router.ema == 0.9);
    ck_assert(c.router.headroom == 0.1);
    ck_assert_int_eq(c.router.update_every, 1);
    ck_assert(c.router.capacity_factor_max == 2.0);
}
END_TEST

START_TEST(test_load_sets_values) {
    moe_config c;
    ck_assert_int_eq(load(&c, "{\"model\": {\"n_layers\": 2, \"tie_embeddings\": false},\n"
                              " \"moe\": {\"num_experts\": [4, 8], \"task_layers\": [1]},\n"
                              " \"router\": {\"slot_order\": \"priority\", \"top_k\": 1,\n"
                              "   \"task_priority\": [1, 2, 3, 4, 5]},\n"
                              " \"capacity\": {\"mode\": \"dynamic\"}, \"train\": {\"seed\": 7}}"),
                     0);
    ck_assert_int_eq(c.model.n_layers, 2);
    ck_assert(!c.model.tie_embeddings);
    ck_assert_int_eq(c.moe.n_num_experts, 2);
    ck_assert_int_eq(moe_config_experts(&c, 1), 8);
    ck_assert_int_eq(c.moe.task_layers[0], 1);
    ck_assert_int_eq(c.router.slot_order, MOE_SLOT_PRIORITY);
    ck_assert_int_eq(c.router.n_task_priority, 5);
    ck_assert(c.router.task_priority[4] == 5.0);
    ck_assert_int_eq(c.router.capacity_mode, MOE_CAPACITY_DYNAMIC);
    ck_assert_int_eq((int)c.train.seed, 7);
}
END_TEST

START_TEST(test_errors_name_file_line_col) {
    assert_error("{\"router\": {\n    \"top_kk\": 2}}", ":2:5:", "unknown key 'router.top_kk'");
    assert_error("{\"routerz\": {}}", ":1:2:", "unknown section");
    assert_error("{\"router\": {\"top_k\": \"two\"}}", ":1:13:", "router.top_k must be an integer");
    assert_error("{\"model\": {\"tie_embeddings\": 1}}", ":1:12:", "true or false");
    assert_error("{\"router\": {\"slot_order\": \"random\"}}", ":1:13:", "position | priority");
    assert_error("{\"model\": {\"n_heads\": 4,\n \"n_kv_heads\": 3}}",
                 ":2:2:", "n_heads = 4 is not a multiple of model.n_kv_heads = 3");
    // the other key at its default: the one the file sets is at fault
    assert_error("{\"model\": {\"n_heads\": 3}}", ":1:12:", "n_heads = 3 is not a multiple");
    assert_error("{\"memory\": {\"mini_seq\": 2}}", ":1:13:", "mini_seq = 2 with memory.recompute");
    // the router's own checks: the place of the key they name
    assert_error("{\"router\": {\"n_groups\": 3}}", ":1:13:", "n_groups = 3 does not divide");
    assert_error("{\"moe\": {\"num_experts\": 1}}",
                 ":1:10:", "top_k = 2 exceeds moe.num_experts = 1");
    assert_error("{\"moe\": {\"num_experts\": 8},\n\"router\": {\"top_k\": 9}}",
                 ":2:12:", "router.top_k = 9 exceeds moe.num_experts = 8");
    assert_error("{\"moe\": {\"num_experts\": [8, 8, 8]}}",
                 ":1:10:", "3 entries but the model has 4 MoE layers");
    assert_error("{\"parallel\": {\"ep\": 3}}", ":1:15:", "not divisible by parallel.ep = 3");
    assert_error("{\"moe\": {\"every\": 2, \"task_layers\": [0]}}", ":1:22:", "not an MoE layer");
    assert_error(
        "{\"router\": {\"slot_order\": \"position\",\n  \"task_priority\": [1, 2, 3, 4, 5]}}",
        ":2:3:", "router.task_priority is set with router.slot_order = position");
    assert_error("{\"moe\": {\"task_layers\": [1, 3,\n 1]}}",
                 ":1:10:", "moe.task_layers lists layer 1 twice");
    assert_error("{\"model\": {\"d_model\": 64,}}", ":1:", ""); // syntax error, jansson position
    assert_error("[1, 2]", ":1:1:", "must be a JSON object");
    assert_error("{\"model\": 3}", ":1:2:", "must be an object");
}
END_TEST

// RFC 8259 lets a parser ignore a leading UTF-8 byte order mark: the config
// loads, and errors keep the positions an editor shows (the mark takes no
// column), for the key scan and jansson's syntax errors alike.
#define BOM "\xEF\xBB\xBF"
START_TEST(test_leading_bom_is_ignored_and_positions_hold) {
    moe_config c;
    ck_assert_msg(load(&c, BOM "{\"router\": {\"top_k\": 1}}") == 0, "%s", moe_last_error());
    ck_assert_int_eq(c.router.top_k, 1);
    assert_error(BOM "{\"routerz\": {}}", ":1:2:", "unknown section");
    assert_error(BOM "{\"router\": {\n    \"top_kk\": 2}}", ":2:5:", "unknown key 'router.top_kk'");
    assert_error(BOM "{\"model\": {\"d_model\": 64,}}", ":1:26:", "string or '}' expected");
    assert_error(BOM "{\"model\": {\n  \"d_model\": 64 x}}", ":2:17:", "'}' expected near 'x'");
    // only a leading mark: one inside the text is not JSON
    assert_error("{\"model\": " BOM "{}}", ":1:", "");
    // columns count characters, as jansson's do: two-byte e-acute is one column
    assert_error("{\"data\": {\"path\": \"\xC3\xA9\xC3\xA9\", \"foo\": 1}}",
                 ":1:25:", "unknown key 'data.foo'");
}
END_TEST

// A file with no JSON at all (empty, or only a byte order mark or white
// space) is refused as empty, by name, not at jansson's "column 0"; an end of
// input after a newline is at column 1 of the last line (columns count from 1).
START_TEST(test_empty_file_is_named_and_columns_count_from_1) {
    const struct {
        const char *text, *where;
    } empty[] = {
        {"", ": the file is empty;"},
        {BOM, ": the file is empty (only a UTF-8 byte order mark);"},
        {"\n \t\r\n", ": the file is empty (only white space);"},
        {BOM "\n\n", ": the file is empty (only a UTF-8 byte order mark and white space);"}};
    for (size_t i = 0; i < sizeof empty / sizeof *empty; i++) {
        assert_error(empty[i].text, empty[i].where, "a config is a JSON object ({} keeps every");
        ck_assert_msg(!strstr(moe_last_error(), ":0"), "%s", moe_last_error());
    }
    assert_error("{\n", ":2:1:", "expected near end of file");
    assert_error(BOM "{\"model\": {\n\n", ":3:1:", "expected near end of file");
    assert_error("{", ":1:1:", "expected near end of file");
}
END_TEST

START_TEST(test_set_is_typed_by_key) {
    moe_config c;
    moe_config_default(&c);
    moe_config_src *src = moe_config_src_new();
    ck_assert_int_eq(moe_config_set(&c, src, "router.top_k=1"), 0);
    ck_assert_int_eq(c.router.top_k, 1);
    ck_assert_int_eq(moe_config_set(&c, src, "moe.num_experts=[4,8,8,16]"), 0);
    ck_assert_int_eq(c.moe.n_num_experts, 4);
    ck_assert_int_eq(moe_config_experts(&c, 3), 16);
    ck_assert_int_eq(moe_config_set(&c, src, "data.tasks=copy,sort"), 0);
    ck_assert_int_eq(c.data.n_tasks, 2);
    ck_assert_str_eq(c.data.tasks[1], "sort");
    ck_assert_int_eq(moe_config_set(&c, src, "router.capacity_factor=0.5"), 0);
    ck_assert(c.router.capacity_factor == 0.5);
    ck_assert_int_eq(moe_config_set(&c, src, "router.top_k=x"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, src, "train.lr=fast"), MOE_EINVAL);
    // a blank on either side of a number is refused alike
    ck_assert_int_eq(moe_config_set(&c, src, "model.d_model= 32"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, src, "model.d_model=32 "), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, src, "train.lr= 1e-3"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, src, "train.seed= 7"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, src, "nokey=1"), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "unknown key 'nokey'"));
    ck_assert_int_eq(moe_config_set(&c, src, "router.top_k"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, src, "loss.impl=fancy"), MOE_EINVAL);
    // a bool takes true or false only: "yes" is no silent false
    ck_assert_int_eq(moe_config_set(&c, src, "model.tie_embeddings=yes"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, src, "train.decay_all=True"), MOE_EINVAL);
    ck_assert(c.model.tie_embeddings && !c.train.decay_all);
    ck_assert_int_eq(moe_config_set(&c, src, "model.tie_embeddings=false"), 0);
    ck_assert(!c.model.tie_embeddings);
    // the --set that broke a file's priority order is where the error is
    ck_assert_int_eq(moe_config_set(&c, src, "router.task_priority=1,2"), 0); // copy, sort
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(),
                                 "--set router.task_priority: router.task_priority "
                                 "is set with router.slot_order = position"));
    ck_assert_int_eq(moe_config_set(&c, src, "router.slot_order=priority"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), 0);
    ck_assert_int_eq(moe_config_set(&c, src, "router.top_k=5"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL); // 5 > 4 experts
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "--set router.top_k"));
    moe_config_src_free(src);
}
END_TEST

// A pair of keys made wrong by a --set of the second one points at the --set,
// not at the file's first key (the file alone was valid).
START_TEST(test_pair_error_points_at_the_set_that_broke_it) {
    moe_config c;
    moe_config_default(&c);
    moe_config_src *src = moe_config_src_new();
    ck_assert_int_eq(
        moe_config_load(&c, src, write_cfg("{\"model\": {\"n_heads\": 4, \"n_kv_heads\": 2}}")), 0);
    ck_assert_int_eq(moe_config_check(&c, src), 0);
    ck_assert_int_eq(moe_config_set(&c, src, "model.n_kv_heads=3"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    ck_assert_msg(!strncmp(moe_last_error(), "--set model.n_kv_heads", 22), "%s", moe_last_error());
    // The placement keys: a --set of parallel.ep or of the slots breaks the file's table.
    ck_assert_int_eq(moe_config_set(&c, src, "model.n_kv_heads=2"), 0);
    ck_assert_int_eq(
        moe_config_load(&c, src,
                        write_cfg("{\"parallel\": {\"ep\": 4}, \"placement\": "
                                  "{\"mode\": \"replicate\", \"slots_per_rank\": 3}}")),
        0);
    ck_assert_int_eq(moe_config_check(&c, src), 0);
    ck_assert_int_eq(moe_config_set(&c, src, "parallel.ep=1"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    ck_assert_msg(!strncmp(moe_last_error(), "--set parallel.ep", 17), "%s", moe_last_error());
    ck_assert_int_eq(moe_config_set(&c, src, "parallel.ep=4"), 0);
    ck_assert_int_eq(moe_config_set(&c, src, "placement.slots_per_rank=0"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    ck_assert_msg(!strncmp(moe_last_error(), "--set placement.slots_per_rank", 30), "%s",
                  moe_last_error());
    moe_config_src_free(src);
}
END_TEST

START_TEST(test_resolved_config_round_trip) {
    moe_config a, b;
    moe_config_default(&a);
    ck_assert_int_eq(moe_config_set(&a, NULL, "router.slot_order=priority"), 0);
    ck_assert_int_eq(moe_config_set(&a, NULL, "router.task_priority=1,2.5,3,4,5"), 0);
    ck_assert_int_eq(moe_config_set(&a, NULL, "train.lr=0.00123"), 0);
    ck_assert_int_eq(moe_config_set(&a, NULL, "moe.task_layers=[0,2]"), 0);
    const char *p = write_cfg("");
    FILE *f = fopen(p, "w");
    ck_assert_int_eq(moe_config_write(&a, f), 0);
    fclose(f);
    moe_config_default(&b);
    ck_assert_int_eq(moe_config_load(&b, NULL, p), 0);
    ck_assert_mem_eq(&a, &b, sizeof a);
}
END_TEST

// A string that is not UTF-8 (a file name's bytes through --set) cannot be
// written to a JSON config: --set refuses it, naming the key and the byte, and
// the writer fails rather than leave the key out (a run's config.json without
// its data.path could not be resumed).
START_TEST(test_a_value_that_is_not_utf8_is_refused_never_dropped) {
    static const char *const sets[] = {"data.path=d/t\xff.txt", "data.val_path=\xc3(",
                                       "model.tokenizer=tok\xed\xa0\x80.model",
                                       "data.tasks=en=a.bin,de=b\xfe.bin", "data.tasks=c\xff,d"};
    for (int i = 0; i < 5; i++) {
        moe_config c;
        moe_config_default(&c);
        ck_assert_msg(moe_config_set(&c, NULL, sets[i]) == MOE_EINVAL, "accepted %s", sets[i]);
        ck_assert_msg(strstr(moe_last_error(), "is not UTF-8"), "%s", moe_last_error());
    }
    moe_config c;
    moe_config_default(&c);
    snprintf(c.data.path, sizeof c.data.path, "t\xff.txt"); // past the checks
    FILE *f = fopen(write_cfg(""), "w");
    ck_assert_int_eq(moe_config_write(&c, f), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "data.path"), "%s", moe_last_error());
    fclose(f);
}
END_TEST

// The inclusive ends of the checks of key pairs: each bound itself is valid,
// one past it is refused (defaults: 8 experts, seq_len 64).
START_TEST(test_pair_bounds_are_inclusive) {
    moe_config c;
    // placement.slots_per_rank may reach moe.num_experts (every expert on every rank)
    ck_assert_int_eq(load(&c, "{\"parallel\": {\"ep\": 2}, \"placement\": "
                              "{\"mode\": \"replicate\", \"slots_per_rank\": 8}}"),
                     0);
    assert_error("{\"parallel\": {\"ep\": 2}, \"placement\": {\"slots_per_rank\": 9}}",
                 ":1:", "must be between E/parallel.ep = 4 and moe.num_experts = 8");
    // and E/ep is the least: exactly the home experts, valid for static placement,
    // but replicate has no spare slot there
    ck_assert_int_eq(
        load(&c, "{\"parallel\": {\"ep\": 4}, \"placement\": {\"slots_per_rank\": 2}}"), 0);
    assert_error("{\"parallel\": {\"ep\": 4}, \"placement\": "
                 "{\"mode\": \"replicate\", \"slots_per_rank\": 2}}",
                 ":1:", "needs spare slots");
    // memory.mini_seq may split a sequence into single tokens, not more chunks
    ck_assert_int_eq(load(&c, "{\"memory\": {\"mini_seq\": 64, \"recompute\": \"moe\"}}"), 0);
    assert_error("{\"memory\": {\"mini_seq\": 65, \"recompute\": \"moe\"}}",
                 ":1:", "needs at most model.seq_len (64) chunks");
    // router.top_k may equal the smallest expert count
    ck_assert_int_eq(load(&c, "{\"router\": {\"top_k\": 8}}"), 0);
    assert_error("{\"router\": {\"top_k\": 9}}", ":1:", "exceeds moe.num_experts = 8");
}
END_TEST

static Suite *config_suite(void) {
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, test_defaults_are_valid);
    tcase_add_test(tc, test_load_sets_values);
    tcase_add_test(tc, test_errors_name_file_line_col);
    tcase_add_test(tc, test_leading_bom_is_ignored_and_positions_hold);
    tcase_add_test(tc, test_empty_file_is_named_and_columns_count_from_1);
    tcase_add_test(tc, test_set_is_typed_by_key);
    tcase_add_test(tc, test_pair_error_points_at_the_set_that_broke_it);
    tcase_add_test(tc, test_resolved_config_round_trip);
    tcase_add_test(tc, test_a_value_that_is_not_utf8_is_refused_never_dropped);
    tcase_add_test(tc, test_pair_bounds_are_inclusive);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(config_suite());
}
