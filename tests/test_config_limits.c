// Limits of the run config under hostile input: every numeric key's range
// (walked from the key table, so new keys are covered), text of any length
// (no fixed buffers, nothing cut), empty list items, and sizes whose products
// overflow int before anything is allocated. Run under ASan/UBSan too.
#include "moe/ablate.h"
#include "moe/checkpoint.h"
#include "moe/config.h"
#include "moe/error.h"
#include "moe/model.h"
#include "moe/parse.h"
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Writes text to tu_dir/cfg.json and loads it over the defaults, then checks.
static int load_text(moe_config *c, const char *text) {
    const char *p = tu_in_dir("cfg.json");
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
    moe_config_default(c);
    moe_config_src *src = moe_config_src_new();
    int rc = moe_config_load(c, src, p);
    if (rc == 0) rc = moe_config_check(c, src);
    moe_config_src_free(src);
    return rc;
}

static void assert_msg_has(const char *what) {
    ck_assert_msg(strstr(moe_last_error(), what), "message '%s' lacks '%s'", moe_last_error(),
                  what);
}

// "--set key=value" must fail and name the key.
static void assert_set_refused(const char *key, const char *value) {
    moe_config c;
    moe_config_default(&c);
    size_t n = strlen(key) + strlen(value) + 2;
    char *set = malloc(n);
    snprintf(set, n, "%s=%s", key, value);
    int rc = moe_config_set(&c, NULL, set);
    ck_assert_msg(rc == MOE_EINVAL, "--set %.200s accepted", set);
    assert_msg_has(key);
    free(set);
}

// The same value in a config file ({"section": {"name": value}}) must fail,
// naming the key and the file.
static void assert_file_refused(const char *key, const char *json_value) {
    const char *dot = strchr(key, '.');
    size_t n = strlen(key) + strlen(json_value) + 32;
    char *text = malloc(n);
    snprintf(text, n, "{\"%.*s\": {\"%s\": %s}}", (int)(dot - key), key, dot + 1, json_value);
    moe_config c;
    ck_assert_msg(load_text(&c, text) == MOE_EINVAL, "file accepted: %.200s", text);
    assert_msg_has(key);
    assert_msg_has("cfg.json:1:");
    free(text);
}

static void assert_set_ok(const char *key, const char *value) {
    moe_config c;
    moe_config_default(&c);
    char set[256];
    snprintf(set, sizeof set, "%s=%s", key, value);
    ck_assert_msg(moe_config_set(&c, NULL, set) == 0, "--set %s refused: %s", set,
                  moe_last_error());
}

// v as text: integers exactly, numbers with every digit.
static void num_text(char *buf, size_t cap, double v, bool integer, bool list) {
    if (integer)
        snprintf(buf, cap, list ? "[%.0f]" : "%.0f", v);
    else
        snprintf(buf, cap, list ? "[%.17g]" : "%.17g", v);
}

START_TEST(test_every_numeric_key_refuses_values_outside_its_range) {
    int checked = 0;
    for (int i = 0; i < moe_config_key_count(); i++) {
        moe_config_key k;
        ck_assert_int_eq(moe_config_key_info(i, &k), 0);
        if (!k.numeric) continue;
        char below[64] = "", above[64] = "", edge[64];
        if (k.lo > -DBL_MAX) {
            double v = k.integer ? k.lo - 1 : k.open & MOE_RANGE_LO_OPEN ? k.lo : k.lo - 1;
            num_text(below, sizeof below, v, k.integer, k.list);
            if (!(k.open & MOE_RANGE_LO_OPEN)) {
                num_text(edge, sizeof edge, k.lo, k.integer, k.list);
                assert_set_ok(k.key, edge);
            }
        }
        if (k.hi < DBL_MAX) {
            double v = k.integer ? k.hi + 1 : k.open & MOE_RANGE_HI_OPEN ? k.hi : k.hi * 2 + 1;
            if (k.integer && k.hi >= (double)INT64_MAX) // seeds: one past 2^63 - 1
                snprintf(above, sizeof above, "9223372036854775808");
            else
                num_text(above, sizeof above, v, k.integer, k.list);
            if (!(k.open & MOE_RANGE_HI_OPEN) && k.hi < (double)INT64_MAX) {
                num_text(edge, sizeof edge, k.hi, k.integer, k.list);
                assert_set_ok(k.key, edge);
            }
        }
        // 1e20 is out of range of every integer key and of the bounded numbers
        const char *huge = k.integer || k.hi < 1e20 ? "99999999999999999999" : "";
        const char *neg_huge = k.integer || k.lo > -1e20 ? "-99999999999999999999" : "";
        const char *bad[] = {below, above,    "nan", "inf", "-inf", "1e999",
                             huge,  neg_huge, "",    "1x",  "0x"};
        for (size_t j = 0; j < sizeof bad / sizeof bad[0]; j++) {
            if (!bad[j][0] && (j != 8 || k.list)) continue; // no bound there; "" is an empty list
            assert_set_refused(k.key, bad[j]);
            checked++;
        }
        if (below[0] && !strchr(below, '[') && strcmp(k.type, "int") == 0 && k.hi < INT64_MAX)
            assert_file_refused(k.key, below);
        if (above[0] && !strstr(k.key, "seed")) {
            char json[80];
            snprintf(json, sizeof json, "%s", above);
            assert_file_refused(k.key, json);
        }
    }
    ck_assert_int_gt(checked, 200);
}
END_TEST

START_TEST(test_zero_divisors_are_refused_by_the_check) {
    // Values put straight into the struct (library callers) meet the same ranges.
    moe_config c = tu_small_config();
    ck_assert_int_eq(moe_config_check(&c, NULL), 0);
    c.train.log_every = 0;
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("train.log_every = 0");
    c = tu_small_config();
    c.router.update_every = 0;
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("capacity.update_every");
    c = tu_small_config();
    c.train.grad_accum = -3;
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("train.grad_accum");
    c = tu_small_config();
    c.router.ema = NAN;
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("capacity.ema");
    c = tu_small_config();
    c.moe.num_experts[0] = 0;
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("moe.num_experts item 0 = 0");
}
END_TEST

// comm.overlap_degree pipelines the GPU layer's exchange: more than one round
// needs train.device = cuda and at most parallel.ep rounds.
START_TEST(test_overlap_degree_needs_cuda_and_ep_rounds) {
    moe_config c = tu_small_config();
    ck_assert_int_eq(moe_config_set(&c, NULL, "comm.overlap_degree=2"), 0);
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("comm.overlap_degree = 2 needs train.device = cuda");
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.device=cuda"), 0);
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL); // parallel.ep = 1
    assert_msg_has("at most parallel.ep (1) rounds");
    c.parallel.ep = 2;
    ck_assert_msg(moe_config_check(&c, NULL) == 0, "%s", moe_last_error());
    c.comm.overlap_degree = 3;
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    c.comm.overlap_degree = 0; // below the key's range
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("comm.overlap_degree");
}
END_TEST

// train.compute = bf16 picks the CUDA bf16 op table: the CPU trainer has none
// and would train in fp32 under a config that says bf16.
START_TEST(test_bf16_compute_needs_cuda) {
    moe_config c;
    ck_assert_int_eq(load_text(&c, "{\"train\": {\"steps\": 2,\n  \"compute\": \"bf16\"}}"),
                     MOE_EINVAL);
    assert_msg_has("cfg.json:2:3: train.compute = bf16 needs --device cuda");
    ck_assert_int_eq(load_text(&c, "{\"train\": {\"compute\": \"bf16\", \"device\": \"cuda\"}}"),
                     0);
    // a --device cpu (its --set) over a GPU config is where it broke
    moe_config_src *src = moe_config_src_new();
    ck_assert_int_eq(moe_config_set(&c, src, "train.device=cpu"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    assert_msg_has("--set train.device: train.compute = bf16 needs --device cuda");
    moe_config_src_free(src);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.compute=fp32"), 0);
    ck_assert_int_eq(moe_config_check(&c, NULL), 0);
}
END_TEST

START_TEST(test_router_setter_and_check_apply_the_same_ranges) {
    // The router's own setter (moe route --set) agrees with the key table.
    for (int i = 0; i < moe_config_key_count(); i++) {
        moe_config_key k;
        moe_config_key_info(i, &k);
        if (!k.numeric || k.list ||
            (strncmp(k.key, "router.", 7) && strncmp(k.key, "capacity.", 9)))
            continue;
        if (!strcmp(k.key, "router.seed")) continue;
        char txt[64];
        moe_router_config r;
        moe_router_config_default(&r);
        if (k.lo > -DBL_MAX && !(k.open & MOE_RANGE_LO_OPEN)) {
            num_text(txt, sizeof txt, k.lo, k.integer, false);
            ck_assert_msg(moe_router_config_set(&r, k.key, txt) == 0, "%s=%s", k.key, txt);
            num_text(txt, sizeof txt, k.integer ? k.lo - 1 : k.lo - 0.5, k.integer, false);
            ck_assert_msg(moe_router_config_set(&r, k.key, txt) == MOE_EINVAL, "%s=%s", k.key, txt);
        }
        if (k.hi < DBL_MAX) {
            num_text(txt, sizeof txt, k.hi, k.integer, false);
            ck_assert_int_eq(moe_router_config_set(&r, k.key, txt),
                             k.open & MOE_RANGE_HI_OPEN ? MOE_EINVAL : 0);
            num_text(txt, sizeof txt, k.integer ? k.hi + 1 : k.hi * 2, k.integer, false);
            ck_assert_msg(moe_router_config_set(&r, k.key, txt) == MOE_EINVAL, "%s=%s", k.key, txt);
        }
        ck_assert_int_eq(moe_router_config_set(&r, k.key, "nan"), MOE_EINVAL);
    }
    moe_router_config r;
    moe_router_config_default(&r);
    r.ema = 1.0; // static mode: still out of range
    ck_assert_int_eq(moe_router_config_check(&r, 8), MOE_EINVAL);
    assert_msg_has("capacity.ema");
    moe_router_config_default(&r);
    r.capacity_factor_max = 0.5;
    ck_assert_int_eq(moe_router_config_check(&r, 8), MOE_EINVAL);
    assert_msg_has("capacity.capacity_factor_max");
}
END_TEST

// A value strtod underflows (ERANGE) is still a finite number: it is taken
// as the nearest double and the key's range decides; overflow stays refused.
START_TEST(test_underflowing_numbers_are_taken_and_range_checked) {
    moe_config c;
    moe_config_default(&c);
    ck_assert_msg(moe_config_set(&c, NULL, "data.task_temperature=1e-320") == 0, "%s",
                  moe_last_error());
    ck_assert(c.data.task_temperature > 0 && c.data.task_temperature < 1e-300);
    ck_assert_msg(moe_config_set(&c, NULL, "data.val_fraction=1e-320") == 0, "%s",
                  moe_last_error());
    ck_assert(c.data.val_fraction > 0 && c.data.val_fraction < 1e-300);
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.task_temperature=1e-400"), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "data.task_temperature") &&
                      !strstr(moe_last_error(), "finite"),
                  "%s", moe_last_error()); // 0: the range (0, ...] refuses it
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.task_temperature=1e999"), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "expected a finite decimal number"));
    // hex floats, which strtod reads and a config file refuses
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.lr=0x10"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.lr=0x1p-3"), MOE_EINVAL);
    ck_assert_ptr_nonnull(
        strstr(moe_last_error(), "train.lr = '0x1p-3': expected a finite decimal"));
}
END_TEST

START_TEST(test_help_config_shows_ranges) {
    FILE *f = tmpfile();
    ck_assert_ptr_nonnull(f);
    moe_config_help(f);
    rewind(f);
    char line[512];
    int found = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, "train.log_every") && strstr(line, "range 1.."))
            found++;
        else if (strstr(line, "capacity.ema") && strstr(line, "range [0, 1)"))
            found++;
    fclose(f);
    ck_assert_int_eq(found, 2);
}
END_TEST

// 50 numbers of 300 digits each: the list that overflowed a 1024-byte buffer.
static char *long_numbers(int n, int digits, const char *open, const char *close) {
    size_t cap = (size_t)n * (digits + 4) + 16;
    char *s = malloc(cap), *p = s;
    p += sprintf(p, "%s", open);
    for (int i = 0; i < n; i++) {
        if (i) *p++ = ',';
        *p++ = '1' + i % 9, *p++ = '.';
        for (int d = 0; d < digits; d++)
            *p++ = '0' + (d + i) % 10;
    }
    sprintf(p, "%s", close);
    return s;
}

START_TEST(test_long_priority_list_is_parsed_whole_from_set_and_file) {
    moe_config c;
    moe_config_default(&c);
    char *list = long_numbers(50, 300, "router.task_priority=[", "]");
    ck_assert_int_eq(moe_config_set(&c, NULL, list), 0);
    ck_assert_int_eq(c.router.n_task_priority, 50);
    ck_assert(fabs(c.router.task_priority[49] - 5.9012345678) < 1e-9);
    free(list);
    // 70 items: more than MOE_MAX_TASKS, refused with a message
    list = long_numbers(70, 300, "router.task_priority=", "");
    ck_assert_int_eq(moe_config_set(&c, NULL, list), MOE_EINVAL);
    assert_msg_has("router.task_priority");
    free(list);
    // from a file: the same 50 numbers load, and the check names the mismatch
    char *nums = long_numbers(50, 300, "", "");
    size_t n = strlen(nums) + 64;
    char *text = malloc(n);
    snprintf(text, n, "{\"router\": {\"task_priority\": [%s]}}", nums);
    ck_assert_int_eq(load_text(&c, text), MOE_EINVAL);
    assert_msg_has("router.task_priority has 50 entries for 5 tasks");
    ck_assert_int_eq(c.router.n_task_priority, 50);
    free(nums);
    free(text);
}
END_TEST

START_TEST(test_long_text_is_refused_not_cut) {
    size_t n = 100000;
    char *big = malloc(n + 1);
    memset(big, 'a', n);
    big[n] = 0;
    assert_set_refused("data.path", big);
    assert_msg_has("longer than 511 characters");
    assert_set_refused("data.tasks", big);
    assert_msg_has("longer than 31 characters");
    assert_set_refused("train.device", big);
    assert_set_refused("router.slot_order", big);
    assert_set_refused("model.d_model", big);
    // an unknown key of any length, on the command line and in a file
    moe_config c;
    moe_config_default(&c);
    char *set = malloc(n + 8);
    snprintf(set, n + 8, "%s=1", big);
    ck_assert_int_eq(moe_config_set(&c, NULL, set), MOE_EINVAL);
    assert_msg_has("unknown key");
    char *text = malloc(2 * n + 64);
    snprintf(text, 2 * n + 64, "{\"model\": {\"%s\": 1}}", big);
    ck_assert_int_eq(load_text(&c, text), MOE_EINVAL);
    assert_msg_has("cfg.json:1:12: unknown key");
    snprintf(text, 2 * n + 64, "{\"data\": {\"path\": \"%s\"}}", big);
    ck_assert_int_eq(load_text(&c, text), MOE_EINVAL);
    assert_msg_has("data.path: value longer than 511 characters");
    snprintf(text, 2 * n + 64, "{\"data\": {\"tasks\": [\"copy\", \"%s\"]}}", big);
    ck_assert_int_eq(load_text(&c, text), MOE_EINVAL);
    assert_msg_has("data.tasks item 1");
    free(set);
    free(text);
    free(big);
}
END_TEST

START_TEST(test_nul_in_a_json_string_is_refused) {
    // C text would end at the NUL and the value would be cut silently.
    moe_config c;
    ck_assert_int_eq(load_text(&c, "{\"data\": {\"kind\": \"bin\", \"path\": \"a\\u0000b\"}}"),
                     MOE_EINVAL);
    assert_msg_has("cfg.json:1:");
    assert_msg_has("u0000");
    ck_assert_int_eq(load_text(&c, "{\"data\": {\"tasks\": [\"copy\\u0000\"]}}"), MOE_EINVAL);
    assert_msg_has("u0000");
}
END_TEST

// A list may hold exactly its maximum of items (MOE_MAX_LAYERS for moe.*
// lists), from a file as from --set; one more is refused by both.
START_TEST(test_a_list_of_exactly_its_maximum_is_taken) {
    char json[1024], set[1024];
    for (int extra = 0; extra < 2; extra++) {
        const int n = MOE_MAX_LAYERS + extra;
        int jl = snprintf(json, sizeof json, "{\"moe\": {\"task_layers\": [");
        int sl = snprintf(set, sizeof set, "moe.task_layers=[");
        for (int i = 0; i < n; i++) {
            jl += snprintf(json + jl, sizeof json - jl, "%s%d", i ? ", " : "", i % MOE_MAX_LAYERS);
            sl += snprintf(set + sl, sizeof set - sl, "%s%d", i ? "," : "", i % MOE_MAX_LAYERS);
        }
        snprintf(json + jl, sizeof json - jl, "]}}");
        snprintf(set + sl, sizeof set - sl, "]");
        const char *p = tu_in_dir("cfg.json");
        FILE *f = fopen(p, "w");
        ck_assert_ptr_nonnull(f);
        fputs(json, f);
        fclose(f);
        moe_config c;
        moe_config_default(&c); // loaded, not checked: no model has 64 task layers
        int rc = moe_config_load(&c, NULL, p);
        ck_assert_msg(rc == (extra ? MOE_EINVAL : 0), "%d items: %s", n, moe_last_error());
        if (!extra) ck_assert_int_eq(c.moe.n_task_layers, MOE_MAX_LAYERS);
        if (!extra) ck_assert_int_eq(c.moe.task_layers[MOE_MAX_LAYERS - 1], MOE_MAX_LAYERS - 1);
        moe_config_default(&c);
        ck_assert_int_eq(moe_config_set(&c, NULL, set), extra ? MOE_EINVAL : 0);
        if (!extra) ck_assert_int_eq(c.moe.n_task_layers, MOE_MAX_LAYERS);
    }
}
END_TEST

START_TEST(test_empty_list_items_are_errors) {
    const char *cases[][3] = {
        {"data.tasks", "[copy,,sort]", "item 1 is empty"},
        {"data.tasks", "copy,sort,", "item 2 is empty"},
        {"data.tasks", ",copy", "item 0 is empty"},
        {"data.tasks", "[copy, \"\"]", "item 1 is empty"},
        {"moe.num_experts", "[4,,8]", "item 1 is empty"},
        {"moe.num_experts", "[4,8", "unbalanced"},
        {"moe.num_experts", "4,8]", "unbalanced"},
        {"moe.num_experts", "[[4],8]", "nested"},
        {"moe.task_layers", "[1, ]", "item 1 is empty"},
        {"router.task_priority", "[1,,2]", "item 1 is empty"},
        {"router.task_priority", "1,2,", "item 2 is empty"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_set_refused(cases[i][0], cases[i][1]);
        assert_msg_has(cases[i][2]);
    }
    // the router's own setter too (moe route --set)
    moe_router_config r;
    moe_router_config_default(&r);
    ck_assert_int_eq(moe_router_config_set(&r, "router.task_priority", "1,,2"), MOE_EINVAL);
    assert_msg_has("item 1 is empty");
    // a refused list leaves the previous value
    moe_config c;
    moe_config_default(&c);
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.tasks=[copy,,sort]"), MOE_EINVAL);
    ck_assert_int_eq(c.data.n_tasks, 5);
    // and in a file
    ck_assert_int_eq(load_text(&c, "{\"data\": {\"tasks\": [\"copy\", \"\", \"sort\"]}}"),
                     MOE_EINVAL);
    assert_msg_has("data.tasks: item 1 is empty");
    // what stays valid: spaces, quotes, the empty list
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.tasks=[ \"copy\" , sort ]"), 0);
    ck_assert_int_eq(c.data.n_tasks, 2);
    ck_assert_str_eq(c.data.tasks[0], "copy");
    ck_assert_int_eq(moe_config_set(&c, NULL, "moe.task_layers=[]"), 0);
    ck_assert_int_eq(c.moe.n_task_layers, 0);
}
END_TEST

START_TEST(test_grid_values_refuse_empty_and_unpaired) {
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "moe.num_experts=[4,8],8"), 0);
    ck_assert_int_eq(ax.n, 2);
    ck_assert_str_eq(ax.values[0], "[4,8]");
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,2,"), MOE_EINVAL);
    assert_msg_has("value 3 is empty"); // values count from 1
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,,2"), MOE_EINVAL);
    assert_msg_has("value 2 is empty");
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "moe.num_experts=[4,8"), MOE_EINVAL);
    assert_msg_has("unpaired");
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "moe.num_experts=4],8"), MOE_EINVAL);
    assert_msg_has("unpaired");
    char big[300];
    memset(big, '1', sizeof big - 1);
    big[sizeof big - 1] = 0;
    memcpy(big, "router.top_k=", 13);
    ck_assert_int_eq(moe_grid_axis_parse(&ax, big), MOE_EINVAL);
    assert_msg_has("longer than 63 characters");
}
END_TEST

START_TEST(test_sizes_overflowing_int_are_refused_before_allocation) {
    moe_config c;
    moe_config_default(&c);
    // each alone is in range; the product is not
    ck_assert_int_eq(moe_config_set(&c, NULL, "model.seq_len=1048576"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.batch_size=1048576"), 0);
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("model.seq_len * train.batch_size = 1099511627776 exceeds 2147483647");
    // near INT_MAX: refused by the key's range, before any product
    assert_set_refused("model.seq_len", "2147483647");
    assert_set_refused("train.batch_size", "2147483647");
    // the model refuses its own batch the same way, without allocating
    moe_config_default(&c);
    moe_model m;
    ck_assert_int_eq(moe_model_init(&m, &c, 65536, 65536, 1), MOE_EINVAL);
    assert_msg_has("model.seq_len * train.batch_size = 4294967296 exceeds");
    // expert rows: tokens * top_k fit half of int
    moe_config_default(&c);
    moe_config_set(&c, NULL, "model.seq_len=1048576");
    moe_config_set(&c, NULL, "train.batch_size=1024");
    moe_config_set(&c, NULL, "router.top_k=8");
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("model.seq_len * train.batch_size * router.top_k");
    // attention probabilities B * H * T * T: far past any memory
    moe_config_default(&c);
    moe_config_set(&c, NULL, "model.seq_len=1048576");
    moe_config_set(&c, NULL, "train.batch_size=2");
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    assert_msg_has("train.batch_size * model.n_heads * model.seq_len * model.seq_len");
    // from a checkpoint's or a user's config.json: named where the file sets it
    ck_assert_int_eq(
        load_text(&c, "{\"model\": {\"seq_len\": 1048576}, \"train\": {\"batch_size\": 4096}}"),
        MOE_EINVAL);
    assert_msg_has("cfg.json:1:12: model.seq_len * train.batch_size = 4294967296 exceeds");
}
END_TEST

// A product the file allows, pushed past the limit by a --set, is named at that
// --set (the file's line is not at fault); of several --sets, the last one.
START_TEST(test_overflowing_product_names_the_last_set_factor) {
    const char *p = tu_in_dir("cfg.json");
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs("{\"model\": {\"seq_len\": 64, \"d_ff\": 256}}", f);
    fclose(f);
    moe_config c;
    moe_config_default(&c);
    moe_config_src *src = moe_config_src_new();
    ck_assert_int_eq(moe_config_load(&c, src, p), 0);
    ck_assert_int_eq(moe_config_check(&c, src), 0);
    ck_assert_int_eq(moe_config_set(&c, src, "model.d_ff=16384"), 0);
    ck_assert_int_eq(moe_config_set(&c, src, "train.batch_size=100000"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    assert_msg_has("--set train.batch_size: model.seq_len * train.batch_size * 2 * model.d_ff");
    // set again in the other order: the later --set is named
    ck_assert_int_eq(moe_config_set(&c, src, "model.d_ff=16384"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    assert_msg_has("--set model.d_ff: model.seq_len * train.batch_size * 2 * model.d_ff");
    moe_config_src_free(src);
}
END_TEST

// Readers of a checkpoint size their arrays by its config.json: an edited
// config with a zero divisor or an overflowing product is refused on load.
START_TEST(test_checkpoint_config_is_range_and_size_checked) {
    const char *cases[][2] = {
        {"{\"model\": {\"seq_len\": 1048576}, \"train\": {\"batch_size\": 4096}}",
         "model.seq_len * train.batch_size = 4294967296 exceeds"},
        {"{\"train\": {\"log_every\": 0}}", "train.log_every = 0"},
        {"{\"moe\": {\"num_experts\": [8, 0, 8, 8]}}", "moe.num_experts item 1 = 0"},
        {"{\"router\": {\"seed\": -1}}", "router.seed"},
    };
    FILE *w = fopen(tu_in_dir("model.safetensors"), "w"); // the resolver wants a layout
    ck_assert_ptr_nonnull(w);
    fclose(w);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        FILE *f = fopen(tu_in_dir("config.json"), "w");
        ck_assert_ptr_nonnull(f);
        fputs(cases[i][0], f);
        fclose(f);
        moe_config c;
        ck_assert_int_eq(moe_ckpt_config(tu_dir, &c), MOE_EINVAL);
        assert_msg_has("config.json");
        assert_msg_has(cases[i][1]);
    }
}
END_TEST

// Random text for every key: nothing crashes or overflows (ASan), and every
// value is either taken or refused with the key in the message.
START_TEST(test_random_text_for_every_key_is_taken_or_refused) {
    static const char alphabet[] = "0123456789-+.,[] \"eEaxn";
    tu_rng r;
    tu_seed(&r, 18);
    char *v = malloc(5000);
    for (int iter = 0; iter < 3000; iter++) {
        moe_config_key k;
        moe_config_key_info(iter % moe_config_key_count(), &k);
        int len = (int)(tu_uniform(&r) * (iter % 10 ? 40 : 4000));
        for (int i = 0; i < len; i++)
            v[i] = alphabet[(int)(tu_uniform(&r) * (sizeof alphabet - 1))];
        v[len] = 0;
        moe_config c;
        moe_config_default(&c);
        char *set = malloc(strlen(k.key) + len + 2);
        sprintf(set, "%s=%s", k.key, v);
        if (moe_config_set(&c, NULL, set) != 0) assert_msg_has(k.key);
        free(set);
    }
    free(v);
}
END_TEST

static Suite *limits_suite(void) {
    Suite *s = suite_create("config_limits");
    TCase *tc = tcase_create("config_limits");
    tcase_add_checked_fixture(tc, tu_dir_setup, tu_dir_teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_every_numeric_key_refuses_values_outside_its_range);
    tcase_add_test(tc, test_zero_divisors_are_refused_by_the_check);
    tcase_add_test(tc, test_overlap_degree_needs_cuda_and_ep_rounds);
    tcase_add_test(tc, test_bf16_compute_needs_cuda);
    tcase_add_test(tc, test_router_setter_and_check_apply_the_same_ranges);
    tcase_add_test(tc, test_help_config_shows_ranges);
    tcase_add_test(tc, test_underflowing_numbers_are_taken_and_range_checked);
    tcase_add_test(tc, test_long_priority_list_is_parsed_whole_from_set_and_file);
    tcase_add_test(tc, test_long_text_is_refused_not_cut);
    tcase_add_test(tc, test_nul_in_a_json_string_is_refused);
    tcase_add_test(tc, test_empty_list_items_are_errors);
    tcase_add_test(tc, test_grid_values_refuse_empty_and_unpaired);
    tcase_add_test(tc, test_sizes_overflowing_int_are_refused_before_allocation);
    tcase_add_test(tc, test_overflowing_product_names_the_last_set_factor);
    tcase_add_test(tc, test_checkpoint_config_is_range_and_size_checked);
    tcase_add_test(tc, test_random_text_for_every_key_is_taken_or_refused);
    tcase_add_test(tc, test_a_list_of_exactly_its_maximum_is_taken);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(limits_suite());
}
