// `moe route` in-process: the plan file must equal what moe_router_forward
// returns for the same input and config, tensor by tensor; every bad input
// must exit 2 and leave no --out file; a failed write exits 1.
#include "moe/cli/cli.h"
#include "moe/error.h"
#include "moe/router.h"
#include "moe/safetensors.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int run_cli(const char **args) {
    int n = 0;
    while (args[n])
        n++;
    return moe_cli_main(n, (char **)args);
}
#define MOE(...) run_cli((const char *[]){"moe", __VA_ARGS__, NULL})

enum { T = 24, E = 4 };
static float logits[T * E];
static int32_t task[T];

// Skewed logits (expert 0 favoured) so capacity_factor 1 drops some tokens.
static void make_batch(uint64_t seed) {
    tu_rng r;
    tu_seed(&r, seed);
    tu_fill_normal(&r, logits, T * E, 1.0f);
    for (int t = 0; t < T; t++) {
        logits[t * E] += 1.5f;
        task[t] = (t * 5) % 3;
    }
}

static void write_logits(const char *path, bool with_task) {
    moe_st_entry e[2] = {{"logits", MOE_ST_F32, 2, {T, E}, logits},
                         {"task_ids", MOE_ST_I32, 1, {T}, task}};
    ck_assert_int_eq(moe_st_write(path, e, with_task ? 2 : 1, NULL), 0);
}

// Routes directly with the defaults plus sets ("key", "value", ..., NULL).
static void route_direct(moe_plan *p, const float *x, const int *tid, const char *const *sets,
                         bool train, uint64_t step) {
    moe_router_config cfg;
    moe_router_config_default(&cfg);
    for (int i = 0; sets && sets[i]; i += 2)
        ck_assert_int_eq(moe_router_config_set(&cfg, sets[i], sets[i + 1]), 0);
    float *in = malloc(sizeof logits);
    memcpy(in, x, sizeof logits);
    if (train && cfg.noise == MOE_NOISE_JITTER)
        moe_router_jitter(in, (size_t)T * E, cfg.noise_eps, cfg.seed, step);
    ck_assert_int_eq(moe_plan_alloc(p, T, E, cfg.top_k), 0);
    ck_assert_msg(moe_router_forward(p, in, tid, NULL, T, E, &cfg, train, step) == 0, "%s",
                  moe_last_error());
    free(in);
}

static void expect_tensor(moe_st_file *f, const char *name, moe_st_dtype dt, int64_t d0, int64_t d1,
                          const void *want) {
    const moe_st_tensor *t = moe_st_find(f, name);
    ck_assert_msg(t != NULL, "plan lacks '%s'", name);
    ck_assert_int_eq(t->dtype, dt);
    ck_assert_int_eq(t->ndim, d1 ? 2 : 1);
    ck_assert_int_eq(t->shape[0], d0);
    if (d1) ck_assert_int_eq(t->shape[1], d1);
    void *got = malloc(t->nbytes);
    ck_assert_int_eq(moe_st_read(f, t, got, t->nbytes), 0);
    ck_assert_msg(memcmp(got, want, t->nbytes) == 0, "tensor '%s' differs from the router's", name);
    free(got);
}

// The plan file holds exactly the router's plan: every tensor, bit for bit.
static void expect_plan_file(const char *path, const moe_plan *p) {
    moe_st_file *f;
    ck_assert_msg(moe_st_open(path, &f) == 0, "%s", moe_last_error());
    ck_assert_int_eq(f->n_tensors, 8);
    int k = p->k;
    expect_tensor(f, "expert", MOE_ST_I32, T, k, p->expert);
    expect_tensor(f, "slot", MOE_ST_I32, T, k, p->slot);
    expect_tensor(f, "weight", MOE_ST_F32, T, k, p->weight);
    expect_tensor(f, "counts", MOE_ST_I32, E, 0, p->counts);
    expect_tensor(f, "kept", MOE_ST_I32, E, 0, p->kept);
    expect_tensor(f, "capacity", MOE_ST_I32, E, 0, p->capacity);
    expect_tensor(f, "aux_loss", MOE_ST_F32, 1, 0, &p->aux_loss);
    expect_tensor(f, "z_loss", MOE_ST_F32, 1, 0, &p->z_loss);
    moe_st_close(f);
}

static int n_dropped(const moe_plan *p) {
    int n = 0;
    for (int i = 0; i < p->T * p->k; i++)
        n += p->expert[i] < 0;
    return n;
}

START_TEST(test_plan_equals_router_forward) {
    make_batch(1);
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    write_logits(in, true);
    ck_assert_int_eq(MOE("route", "--logits", in, "--set", "router.capacity_factor=1",
                         "--set=router.slot_order=priority", "--set", "router.task_priority=1,3,2",
                         "--out", out),
                     0);
    const char *sets[] = {"router.capacity_factor",
                          "1",
                          "router.slot_order",
                          "priority",
                          "router.task_priority",
                          "1,3,2",
                          NULL};
    moe_plan p;
    route_direct(&p, logits, task, sets, false, 0);
    ck_assert_int_gt(n_dropped(&p), 0); // the case exercises dropping
    expect_plan_file(out, &p);
    moe_plan_free(&p);

    // The resolved config travels in the metadata.
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(out, &f), 0);
    ck_assert_str_eq(moe_st_meta(f, "router.slot_order"), "priority");
    ck_assert_str_eq(moe_st_meta(f, "router.capacity_factor"), "1");
    ck_assert_str_eq(moe_st_meta(f, "router.task_priority"), "1,3,2");
    ck_assert_str_eq(moe_st_meta(f, "router.noise_eps"), "0.01");
    ck_assert_str_eq(moe_st_meta(f, "capacity.mode"), "static");
    ck_assert_str_eq(moe_st_meta(f, "router.n_groups"), "0");
    ck_assert_str_eq(moe_st_meta(f, "router.topk_groups"), "0");
    // the project's version (CMake's project()), not the headers' fallback
    ck_assert_ptr_nonnull(moe_st_meta(f, "moe.version"));
    ck_assert_str_ne(moe_st_meta(f, "moe.version"), "0.0.0");
    moe_st_close(f);
    ck_assert_int_eq(tu_count_entries(tu_dir), 2); // input and plan, no temp file
}
END_TEST

// router.task_priority of MOE_MAX_TASKS entries travels whole in the
// metadata (values were cut at 64 characters).
START_TEST(test_plan_metadata_holds_a_full_task_priority_list) {
    make_batch(1);
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    write_logits(in, true);
    char list[MOE_MAX_TASKS * 25 + 1] = "", set[sizeof list + 32];
    for (int i = 0, len = 0; i < MOE_MAX_TASKS; i++)
        len += snprintf(list + len, sizeof list - (size_t)len, "%s%lld", i ? "," : "",
                        123456789012341LL + 2 * i); // odd, 15 digits: shortest as written
    snprintf(set, sizeof set, "router.task_priority=%s", list);
    ck_assert_int_eq(MOE("route", "--logits", in, "--set", "router.slot_order=priority", "--set",
                         set, "--out", out),
                     0);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(out, &f), 0);
    ck_assert_str_eq(moe_st_meta(f, "router.task_priority"), list);
    moe_st_close(f);
}
END_TEST

// Sigmoid scores and route_scale through --set: the plan equals the router's,
// normalised weights sum to the scale, and the metadata records both keys.
START_TEST(test_sigmoid_route_scale_through_set) {
    make_batch(5);
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    write_logits(in, false);
    ck_assert_int_eq(MOE("route", "--logits", in, "--set", "router.score=sigmoid", "--set",
                         "router.route_scale=2", "--set", "router.capacity_factor=1", "--out", out),
                     0);
    const char *sets[] = {
        "router.score", "sigmoid", "router.route_scale", "2", "router.capacity_factor", "1", NULL};
    moe_plan p;
    route_direct(&p, logits, NULL, sets, false, 0);
    ck_assert_int_gt(n_dropped(&p), 0);
    for (int t = 0; t < T; t++) {
        double s = 0;
        for (int j = 0; j < p.k; j++)
            s += p.weight[t * p.k + j];
        if (p.expert[t * p.k] >= 0 || p.expert[t * p.k + 1] >= 0)
            ck_assert_double_eq_tol(s, 2.0, 1e-5);
    }
    expect_plan_file(out, &p);
    moe_plan_free(&p);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(out, &f), 0);
    ck_assert_str_eq(moe_st_meta(f, "router.score"), "sigmoid");
    ck_assert_str_eq(moe_st_meta(f, "router.route_scale"), "2");
    moe_st_close(f);
    ck_assert_int_eq(MOE("route", "--logits", in, "--set", "router.route_scale=0", "--out", out),
                     2);
}
END_TEST

START_TEST(test_defaults_top1_and_dropless) {
    make_batch(2);
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    write_logits(in, false);
    // Defaults (k=2, factor 1.25, position).
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", out), 0);
    moe_plan p;
    route_direct(&p, logits, NULL, NULL, false, 0);
    expect_plan_file(out, &p);
    moe_plan_free(&p);
    // Switch top-1 without renormalisation, dropless.
    ck_assert_int_eq(MOE("route", "--logits", in, "--set", "router.top_k=1", "--set",
                         "router.normalize_topk=false", "--set", "router.capacity_factor=0",
                         "--out", out),
                     0);
    const char *sets[] = {
        "router.top_k", "1", "router.normalize_topk", "false", "router.capacity_factor", "0", NULL};
    route_direct(&p, logits, NULL, sets, false, 0);
    ck_assert_int_eq(n_dropped(&p), 0);
    expect_plan_file(out, &p);
    moe_plan_free(&p);
}
END_TEST

START_TEST(test_task_ids_from_separate_file) {
    make_batch(3);
    const char *in = tu_in_dir("in.safetensors"), *tf = tu_in_dir("tasks.safetensors"),
               *out = tu_in_dir("plan.safetensors");
    write_logits(in, false);
    moe_st_entry e = {"task_ids", MOE_ST_I32, 1, {T}, task};
    ck_assert_int_eq(moe_st_write(tf, &e, 1, NULL), 0);
    // Without ids, task priorities cannot be applied: bad input.
    ck_assert_int_eq(MOE("route", "--logits", in, "--set", "router.slot_order=priority", "--set",
                         "router.task_priority=0,5,1", "--set", "router.capacity_factor=1", "--out",
                         out),
                     2);
    ck_assert_int_eq(access(out, F_OK), -1);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "--task-ids"));
    ck_assert_int_eq(MOE("route", "--logits", in, "--task-ids", tf, "--set",
                         "router.slot_order=priority", "--set", "router.task_priority=0,5,1",
                         "--set", "router.capacity_factor=1", "--out", out),
                     0);
    const char *sets[] = {"router.slot_order",
                          "priority",
                          "router.task_priority",
                          "0,5,1",
                          "router.capacity_factor",
                          "1",
                          NULL};
    moe_plan p;
    route_direct(&p, logits, task, sets, false, 0);
    expect_plan_file(out, &p);
    // Task 1 has top priority: none of its first choices may drop while another task's do.
    for (int t = 0; t < T; t++)
        if (task[t] == 1) ck_assert_int_ge(p.expert[t * p.k], 0);
    moe_plan_free(&p);
}
END_TEST

START_TEST(test_train_applies_seeded_jitter) {
    make_batch(4);
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    write_logits(in, false);
    const char *sets[] = {
        "router.noise", "jitter", "router.noise_eps", "0.9", "router.seed", "7", NULL};
    ck_assert_int_eq(MOE("route", "--logits", in, "--set", "router.noise=jitter", "--set",
                         "router.noise_eps=0.9", "--set", "router.seed=7", "--train", "--step", "3",
                         "--out", out),
                     0);
    moe_plan p, q;
    route_direct(&p, logits, NULL, sets, true, 3);
    expect_plan_file(out, &p);
    // The noise changed the routing (else this test would prove nothing).
    route_direct(&q, logits, NULL, sets, false, 0);
    ck_assert_int_ne(memcmp(p.weight, q.weight, (size_t)T * p.k * sizeof(float)), 0);
    // Without --train the same config routes the clean logits.
    ck_assert_int_eq(MOE("route", "--logits", in, "--set", "router.noise=jitter", "--set",
                         "router.noise_eps=0.9", "--set", "router.seed=7", "--out", out),
                     0);
    expect_plan_file(out, &q);
    moe_plan_free(&p);
    moe_plan_free(&q);
}
END_TEST

// Runs a failing command: it must exit `code`, leave no file at out and no
// temp file, and record a message containing word.
static void expect_fails(int rc, int code, const char *out, int files_before, const char *word) {
    ck_assert_msg(rc == code, "exit %d, want %d (%s)", rc, code, moe_last_error());
    ck_assert_int_eq(access(out, F_OK), -1);
    ck_assert_int_eq(tu_count_entries(tu_dir), files_before);
    ck_assert_msg(strstr(moe_last_error(), word), "message '%s' lacks '%s'", moe_last_error(),
                  word);
}

START_TEST(test_bad_inputs_exit_2_and_write_nothing) {
    make_batch(5);
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    write_logits(in, true);
    int n = 1;

    expect_fails(MOE("route", "--logits", tu_in_dir("missing.safetensors"), "--out", out), 2, out,
                 n, "missing.safetensors: cannot open");

    const char *bad = tu_in_dir("bad.safetensors");
    static int32_t ints_data[T * E];
    moe_st_entry ints = {"logits", MOE_ST_I32, 2, {T, E}, ints_data};
    ck_assert_int_eq(moe_st_write(bad, &ints, 1, NULL), 0);
    n++;
    expect_fails(MOE("route", "--logits", bad, "--out", out), 2, out, n,
                 "tensor 'logits' has dtype I32, expected F32");

    moe_st_entry flat = {"logits", MOE_ST_F32, 1, {T * E}, logits};
    ck_assert_int_eq(moe_st_write(bad, &flat, 1, NULL), 0);
    expect_fails(MOE("route", "--logits", bad, "--out", out), 2, out, n,
                 "tensor 'logits' has rank 1, expected 2");
    moe_st_entry cube = {"logits", MOE_ST_F32, 3, {2, T / 2, E}, logits};
    ck_assert_int_eq(moe_st_write(bad, &cube, 1, NULL), 0);
    expect_fails(MOE("route", "--logits", bad, "--out", out), 2, out, n, "rank 3");

    moe_st_entry other = {"scores", MOE_ST_F32, 2, {T, E}, logits};
    ck_assert_int_eq(moe_st_write(bad, &other, 1, NULL), 0);
    expect_fails(MOE("route", "--logits", bad, "--out", out), 2, out, n, "no tensor 'logits'");

    // Header lying about sizes: a valid file cut short.
    {
        FILE *fp = fopen(in, "rb");
        char buf[4096];
        size_t len = fread(buf, 1, sizeof buf, fp);
        fclose(fp);
        fp = fopen(bad, "wb");
        fwrite(buf, 1, len - 10, fp);
        fclose(fp);
    }
    expect_fails(MOE("route", "--logits", bad, "--out", out), 2, out, n, "beyond the data section");

    expect_fails(MOE("route", "--logits", in, "--set", "router.top_k=9", "--out", out), 2, out, n,
                 "router.top_k = 9 exceeds the number of experts 4");
    expect_fails(MOE("route", "--logits", in, "--set", "router.bogus=1", "--out", out), 2, out, n,
                 "router.bogus");
    expect_fails(MOE("route", "--logits", in, "--set", "router.top_k=two", "--out", out), 2, out, n,
                 "router.top_k");
    expect_fails(MOE("route", "--logits", in, "--set", "router.top_k", "--out", out), 2, out, n,
                 "KEY=VALUE");
    expect_fails(MOE("route", "--logits", in, "--set", "capacity.mode=dynamic", "--out", out), 2,
                 out, n, "dynamic");

    float nan_logits[T * E];
    memcpy(nan_logits, logits, sizeof nan_logits);
    nan_logits[5 * E + 2] = NAN;
    nan_logits[7 * E + 1] = INFINITY;
    moe_st_entry nan_e = {"logits", MOE_ST_F32, 2, {T, E}, nan_logits};
    ck_assert_int_eq(moe_st_write(bad, &nan_e, 1, NULL), 0);
    expect_fails(MOE("route", "--logits", bad, "--out", out), 2, out, n,
                 "tensor 'logits' has a non-finite value at element 22 [5, 2]");

    // task_ids: wrong length (in the logits file or a separate one), negative, wrong dtype.
    moe_st_entry mis[2] = {{"logits", MOE_ST_F32, 2, {T, E}, logits},
                           {"task_ids", MOE_ST_I32, 1, {T - 1}, task}};
    ck_assert_int_eq(moe_st_write(bad, mis, 2, NULL), 0);
    expect_fails(MOE("route", "--logits", bad, "--out", out), 2, out, n,
                 "'task_ids' has 23 entries, logits have 24 tokens");
    const char *tf = tu_in_dir("tasks.safetensors");
    ck_assert_int_eq(moe_st_write(tf, &mis[1], 1, NULL), 0);
    n++;
    expect_fails(MOE("route", "--logits", in, "--task-ids", tf, "--out", out), 2, out, n,
                 "tasks.safetensors: tensor 'task_ids' has 23 entries");
    int32_t neg[T];
    memcpy(neg, task, sizeof neg);
    neg[3] = -1;
    moe_st_entry neg_e = {"task_ids", MOE_ST_I32, 1, {T}, neg};
    ck_assert_int_eq(moe_st_write(tf, &neg_e, 1, NULL), 0);
    expect_fails(MOE("route", "--logits", in, "--task-ids", tf, "--out", out), 2, out, n,
                 "task_ids[3] = -1");
    moe_st_entry f_e = {"task_ids", MOE_ST_F32, 1, {T}, logits};
    ck_assert_int_eq(moe_st_write(tf, &f_e, 1, NULL), 0);
    expect_fails(MOE("route", "--logits", in, "--task-ids", tf, "--out", out), 2, out, n,
                 "has dtype F32, expected I32");
    // Task priorities under position order would be ignored: refused, naming both keys.
    expect_fails(MOE("route", "--logits", in, "--set", "router.task_priority=1,2", "--out", out), 2,
                 out, n, "router.task_priority is set with router.slot_order = position");
    // A task id with no priority entry.
    expect_fails(MOE("route", "--logits", in, "--set", "router.slot_order=priority", "--set",
                     "router.task_priority=1,2", "--out", out),
                 2, out, n, "in.safetensors: task_ids[1] = 2 but router.task_priority lists 2");

    // Usage errors.
    expect_fails(MOE("route", "--logits", in), 2, out, n, "--out");
    expect_fails(MOE("route", "--out", out), 2, out, n, "--logits");
    expect_fails(MOE("route", "--logits", in, "--out"), 2, out, n, "--out needs a value");
    expect_fails(MOE("route", "--logits", in, "--step", "3", "--out", out), 2, out, n, "--train");
    expect_fails(MOE("route", "--logits", in, "--train", "--step", "-1", "--out", out), 2, out, n,
                 "--step");
    // --step is a whole number as written: no blank on either side, no junk, in range
    expect_fails(MOE("route", "--logits", in, "--train", "--step", " 5", "--out", out), 2, out, n,
                 "--step expects a non-negative integer, got ' 5'");
    expect_fails(MOE("route", "--logits", in, "--train", "--step", "5 ", "--out", out), 2, out, n,
                 "--step expects a non-negative integer, got '5 '");
    expect_fails(MOE("route", "--logits", in, "--train", "--step=5x", "--out", out), 2, out, n,
                 "--step expects a non-negative integer, got '5x'");
    expect_fails(
        MOE("route", "--logits", in, "--train", "--step", "99999999999999999999", "--out", out), 2,
        out, n, "--step 99999999999999999999 is out of range: expected 0..9223372036854775807");
    expect_fails(MOE("route", "--logits", in, "--frobnicate", "--out", out), 2, out, n,
                 "--frobnicate");
    expect_fails(MOE("route", "--example", "--logits", in, "--out", out), 2, out, n, "--example");
}
END_TEST

START_TEST(test_write_failure_exits_1) {
    make_batch(6);
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("no/such/dir/plan.safetensors");
    write_logits(in, false);
    int rc = MOE("route", "--logits", in, "--out", out);
    ck_assert_int_eq(rc, 1);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "no/such/dir/plan.safetensors"));
    ck_assert_int_eq(tu_count_entries(tu_dir), 1);
}
END_TEST

START_TEST(test_example_writes_position_plan) {
    const char *out = tu_in_dir("example.safetensors");
    ck_assert_int_eq(MOE("route", "--example", "--out", out), 0);
    moe_st_file *f;
    ck_assert_msg(moe_st_open(out, &f) == 0, "%s", moe_last_error());
    ck_assert_str_eq(moe_st_meta(f, "router.slot_order"), "position");
    ck_assert_str_eq(moe_st_meta(f, "router.capacity_factor"), "1");
    int64_t shape[2];
    int32_t *ex;
    ck_assert_int_eq(moe_st_load(f, "expert", MOE_ST_I32, 2, shape, (void **)&ex), 0);
    ck_assert_int_eq(shape[0], 16);
    ck_assert_int_eq(shape[1], 2);
    int dropped = 0;
    for (int i = 0; i < 32; i++)
        dropped += ex[i] < 0;
    ck_assert_int_gt(dropped, 0); // the example is meant to show drops
    free(ex);
    moe_st_close(f);
    ck_assert_int_eq(MOE("route", "--example"), 0); // --out is optional
}
END_TEST

START_TEST(test_dispatch_help_and_version) {
    ck_assert_int_eq(run_cli((const char *[]){"moe", NULL}), 2);
    ck_assert_int_eq(MOE("frobnicate"), 2);
    ck_assert_int_eq(MOE("--help"), 0);
    ck_assert_int_eq(MOE("help"), 0);
    ck_assert_int_eq(MOE("help", "route"), 0);
    ck_assert_int_eq(MOE("help", "nope"), 2);
    ck_assert_int_eq(MOE("--version"), 0);
    ck_assert_int_eq(MOE("route", "--help"), 0);
    ck_assert_int_eq(MOE("route", "-h"), 0);
}
END_TEST

static long file_size(const char *path) {
    struct stat st;
    ck_assert_int_eq(stat(path, &st), 0);
    return (long)st.st_size;
}

// --out is replaced by a rename: a FIFO or folder there is refused (it would
// become a regular file), and so is an --out that is one of the inputs (by
// device and inode, whatever the path), which would be lost.
START_TEST(test_out_not_a_regular_file_or_an_input_is_refused) {
    make_batch(6);
    const char *in = tu_in_dir("in.safetensors"), *ids = tu_in_dir("ids.safetensors");
    const char *fifo = tu_in_dir("fifo"), *sub = tu_in_dir("sub"), *link = tu_in_dir("link");
    write_logits(in, false);
    moe_st_entry te = {"task_ids", MOE_ST_I32, 1, {T}, task};
    ck_assert_int_eq(moe_st_write(ids, &te, 1, NULL), 0);
    ck_assert_int_eq(mkfifo(fifo, 0644), 0);
    ck_assert_int_eq(mkdir(sub, 0755), 0);
    ck_assert_int_eq(symlink(in, link), 0);
    const long in_size = file_size(in), ids_size = file_size(ids);
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", fifo), 2);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "not a regular file"));
    struct stat st;
    ck_assert_int_eq(lstat(fifo, &st), 0);
    ck_assert(S_ISFIFO(st.st_mode));
    ck_assert_int_eq(MOE("route", "--example", "--out", sub), 2);
    ck_assert_int_eq(lstat(sub, &st), 0);
    ck_assert(S_ISDIR(st.st_mode));
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", in), 2);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "same file as --logits"));
    ck_assert_int_eq(MOE("route", "--logits", link, "--out", in), 2);
    ck_assert_int_eq(MOE("route", "--logits", in, "--task-ids", ids, "--out", ids), 2);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "same file as --task-ids"));
    ck_assert_int_eq(file_size(in), in_size);
    ck_assert_int_eq(file_size(ids), ids_size);
    ck_assert_int_eq(tu_count_entries(tu_dir), 5); // no plan, no temp file
    // an existing regular file that is no input is replaced, as before
    const char *out = tu_in_dir("plan.safetensors");
    FILE *f = fopen(out, "w");
    fputs("old", f);
    fclose(f);
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", out), 0);
    ck_assert_int_gt(file_size(out), 3);
}
END_TEST

// Finite logits near the F32 limit square past it in the z-loss: refused
// (exit 2, no file), not a plan with z_loss = inf.
START_TEST(test_logits_whose_z_loss_overflows_are_refused) {
    make_batch(7);
    logits[3 * E + 1] = 3e38f;
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    write_logits(in, false);
    expect_fails(MOE("route", "--logits", in, "--out", out), 2, out, 1, "z_loss");
    // 1e19 squares to 1e38, still an F32: routed, finite losses
    logits[3 * E + 1] = 1e19f;
    write_logits(in, false);
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", out), 0);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(out, &f), 0);
    float *z;
    int64_t shape[1];
    ck_assert_int_eq(moe_st_load(f, "z_loss", MOE_ST_F32, 1, shape, (void **)&z), 0);
    ck_assert(isfinite(z[0]) && z[0] > 1e36f);
    free(z);
    moe_st_close(f);
}
END_TEST

// Keys that cannot change a route are named in one note on stderr; --help
// counts the keys --example fixes as it refuses them.
START_TEST(test_ignored_keys_are_noted_once) {
    make_batch(8);
    const char *in = tu_in_dir("in.safetensors");
    write_logits(in, false);
    char args[2048];
    snprintf(args, sizeof args,
             "route --logits '%s' --out '%s/p.st' --set router.noise=jitter "
             "--set router.bias_update_rate=0.01 --set router.ec_fallback=token_choice",
             in, tu_dir);
    ck_assert_int_eq(tu_run_moe(tu_dir, args), 0);
    const char *err = tu_file_text(tu_dir, "err.txt");
    ck_assert_msg(!strncmp(err, "moe route: note: ignored: router.noise", 38), "%s", err);
    ck_assert_ptr_nonnull(strstr(err, "router.bias_update_rate"));
    ck_assert_ptr_nonnull(strstr(err, "router.ec_fallback"));
    ck_assert_ptr_eq(strchr(err, '\n'), err + strlen(err) - 1);
    snprintf(args, sizeof args,
             "route --logits '%s' --out '%s/p.st' --set router.noise=jitter --train", in, tu_dir);
    ck_assert_int_eq(tu_run_moe(tu_dir, args), 0);
    ck_assert_str_eq(tu_file_text(tu_dir, "err.txt"), "");
    ck_assert_int_eq(tu_run_moe(tu_dir, "route --help"), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(tu_dir, "out.txt"), "the five it fixes"));
}
END_TEST

// Jitter can carry finite logits past the F32 limit of the z-loss: the
// message says the jittered logits reach the value, which is not in the file.
START_TEST(test_jitter_overflow_names_the_jittered_logits) {
    const float big[8] = {1.8e19f, 0, 1.8e19f, 0, 1.8e19f, 0, 1.8e19f, 0};
    const char *in = tu_in_dir("big.safetensors"), *out = tu_in_dir("plan.safetensors");
    moe_st_entry e = {"logits", MOE_ST_F32, 2, {4, 2}, big};
    ck_assert_int_eq(moe_st_write(in, &e, 1, NULL), 0);
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", out), 0); // plain: finite
    unlink(out);
    expect_fails(MOE("route", "--logits", in, "--out", out, "--set", "router.noise=jitter", "--set",
                     "router.noise_eps=0.5", "--train"),
                 2, out, 1, "jittered by router.noise = jitter");
}
END_TEST

// A 'bias' of zeros routes as none (README "Router semantics"): with two
// groups of two experts, one kept, logits [3, -5, 2.5, 2.5] go to expert 0 (a
// group scores its best) rather than 2 (top-2 sums), and the plan records no
// bias in use.
START_TEST(test_zero_bias_routes_as_none_and_is_recorded_unused) {
    const float x[4] = {3, -5, 2.5f, 2.5f}, zero[4] = {0};
    const char *in = tu_in_dir("zb.safetensors"), *out = tu_in_dir("plan.safetensors");
    moe_st_entry e[2] = {{"logits", MOE_ST_F32, 2, {1, 4}, x}, {"bias", MOE_ST_F32, 1, {4}, zero}};
    ck_assert_int_eq(moe_st_write(in, e, 2, NULL), 0);
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", out, "--set", "router.top_k=1", "--set",
                         "router.n_groups=2", "--set", "router.topk_groups=1"),
                     0);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(out, &f), 0);
    int32_t *ex;
    int64_t shape[2];
    ck_assert_int_eq(moe_st_load(f, "expert", MOE_ST_I32, 2, shape, (void **)&ex), 0);
    ck_assert_int_eq(ex[0], 0);
    ck_assert_str_eq(moe_st_meta(f, "route.bias"), "false");
    // the group settings travel with the other router keys
    ck_assert_str_eq(moe_st_meta(f, "router.n_groups"), "2");
    ck_assert_str_eq(moe_st_meta(f, "router.topk_groups"), "1");
    free(ex);
    moe_st_close(f);
}
END_TEST

// Expert choice orders tokens by the unbiased scores: a 'bias' tensor would
// change nothing, so it is refused (exit 2, no plan) rather than reported used.
START_TEST(test_expert_choice_refuses_a_bias_tensor) {
    make_batch(9);
    const float b[E] = {0.5f, 0, 0, 0};
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    moe_st_entry e[2] = {{"logits", MOE_ST_F32, 2, {T, E}, logits},
                         {"bias", MOE_ST_F32, 1, {E}, b}};
    ck_assert_int_eq(moe_st_write(in, e, 2, NULL), 0);
    expect_fails(MOE("route", "--logits", in, "--out", out, "--set", "router.type=expert_choice"),
                 2, out, 1, "'bias'");
    write_logits(in, false); // without the bias: routed
    ck_assert_int_eq(
        MOE("route", "--logits", in, "--out", out, "--set", "router.type=expert_choice"), 0);
}
END_TEST

// A refused config is the only stderr line: no note that a key is ignored
// before the refusal of that key (with --logits and with --example).
START_TEST(test_refused_config_prints_no_note) {
    make_batch(10);
    const char *in = tu_in_dir("in.safetensors");
    write_logits(in, false);
    char args[2048];
    const char *sets[] = {"--set router.type=expert_choice --set router.noise=gumbel",
                          "--set router.type=expert_choice --set router.bias_update_rate=0.01"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "route --logits '%s' --out '%s/p.st' %s", in, tu_dir, sets[i]);
        ck_assert_int_eq(tu_run_moe(tu_dir, args), 2);
        const char *err = tu_file_text(tu_dir, "err.txt");
        ck_assert_msg(!strstr(err, "note:"), "%s", err);
        ck_assert_ptr_eq(strchr(err, '\n'), err + strlen(err) - 1);
    }
    ck_assert_int_eq(tu_run_moe(tu_dir, "route --example --set router.noise=gumbel "
                                        "--set router.bias_update_rate=0.01"),
                     2);
    const char *err = tu_file_text(tu_dir, "err.txt");
    ck_assert_msg(!strstr(err, "note:"), "%s", err);
    ck_assert_ptr_nonnull(strstr(err, "router.bias_update_rate"));
    ck_assert_ptr_eq(strchr(err, '\n'), err + strlen(err) - 1);
    ck_assert_str_eq(tu_file_text(tu_dir, "out.txt"), ""); // refused before the example prints
}
END_TEST

// Logits wider than moe.num_experts allows ([1, 1100000]: the router's stack
// arrays of E and k entries overflowed) exit 2 naming the tensor and the
// limit, through the binary, with and without a top_k that large.
START_TEST(test_logits_wider_than_the_expert_limit_exit_2) {
    enum { WIDE = 1100000 };
    float *x = calloc(WIDE, sizeof(float));
    const char *in = tu_in_dir("wide.safetensors");
    moe_st_entry e[1] = {{"logits", MOE_ST_F32, 2, {1, WIDE}, x}};
    ck_assert_int_eq(moe_st_write(in, e, 1, NULL), 0);
    free(x);
    const char *sets[] = {"", "--set router.top_k=1048576"};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(tu_run_moe_in(tu_dir, "route --logits '%s' --out p.st %s", in, sets[i]),
                         2);
        const char *err = tu_file_text(tu_dir, "err.txt");
        ck_assert_msg(strstr(err, "'logits'") && strstr(err, "65536") && strstr(err, "1100000"),
                      "%s", err);
        ck_assert_int_eq(access(tu_in_dir("p.st"), F_OK), -1);
    }
}
END_TEST

// The noise generator exactly as README "Router semantics" writes it, apart
// from the code: splitmix64's finaliser chained over (seed, step, stream, i).
static uint64_t doc_mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double doc_u(uint64_t seed, uint64_t step, uint64_t stream, uint64_t i) {
    uint64_t h = doc_mix(doc_mix(doc_mix(doc_mix(seed) ^ step) ^ stream) ^ i);
    return (double)(h >> 11) * ldexp(1.0, -53);
}

static int32_t *load_i32(const char *path, const char *name) {
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(path, &f), 0);
    int32_t *v;
    int64_t shape[2];
    ck_assert_int_eq(moe_st_load(f, name, MOE_ST_I32, 2, shape, (void **)&v), 0);
    moe_st_close(f);
    return v;
}

// README's formulas reproduce --train noise bit for bit: jitter is the plan
// of the logits the documented factors jitter (routed without noise); gumbel's
// second choices are the argmax of logit + -log(-log(U + 2^-54)).
START_TEST(test_noise_follows_the_documented_generator) {
    make_batch(11);
    const char *in = tu_in_dir("in.safetensors"), *out = tu_in_dir("plan.safetensors");
    write_logits(in, false);
    const uint64_t seed = 1234, step = 5;
    const double eps = 0.3;
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", out, "--set", "router.noise=jitter",
                         "--set", "router.noise_eps=0.3", "--set", "router.seed=1234", "--train",
                         "--step", "5"),
                     0);
    static float jit[T * E];
    for (int i = 0; i < T * E; i++)
        jit[i] = (float)((double)logits[i] * ((1.0 - eps) + (2.0 * eps) * doc_u(seed, step, 1, i)));
    ck_assert(memcmp(jit, logits, sizeof jit) != 0);
    moe_plan p;
    route_direct(&p, jit, NULL, NULL, false, 0);
    expect_plan_file(out, &p);
    moe_plan_free(&p);

    ck_assert_int_eq(MOE("route", "--logits", in, "--out", out, "--set", "router.noise=gumbel",
                         "--set", "router.capacity_factor=0", "--set", "router.seed=1234",
                         "--train", "--step", "5"),
                     0);
    int32_t *ex = load_i32(out, "expert");
    int moved = 0;
    for (int t = 0; t < T; t++) {
        int c0 = 0; // the argmax logit is the argmax probability
        for (int e = 1; e < E; e++)
            if (logits[t * E + e] > logits[t * E + c0]) c0 = e;
        int best = -1;
        double bs = 0;
        for (int e = 0; e < E; e++) {
            if (e == c0) continue;
            double u = doc_u(seed, step, 2, (uint64_t)t * E + e) + ldexp(1.0, -54);
            double v = (double)logits[t * E + e] - log(-log(u));
            if (best < 0 || v > bs) best = e, bs = v;
        }
        ck_assert_int_eq(ex[t * 2], c0);
        ck_assert_int_eq(ex[t * 2 + 1], best);
        int second = -1; // the clean second choice, to see that the noise moves some
        for (int e = 0; e < E; e++)
            if (e != c0 && (second < 0 || logits[t * E + e] > logits[t * E + second])) second = e;
        moved += best != second;
    }
    ck_assert_int_gt(moved, 0);
    free(ex);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("cli_route");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, tu_dir_setup, tu_dir_teardown);
    tcase_add_test(tc, test_plan_equals_router_forward);
    tcase_add_test(tc, test_plan_metadata_holds_a_full_task_priority_list);
    tcase_add_test(tc, test_sigmoid_route_scale_through_set);
    tcase_add_test(tc, test_defaults_top1_and_dropless);
    tcase_add_test(tc, test_task_ids_from_separate_file);
    tcase_add_test(tc, test_train_applies_seeded_jitter);
    tcase_add_test(tc, test_bad_inputs_exit_2_and_write_nothing);
    tcase_add_test(tc, test_write_failure_exits_1);
    tcase_add_test(tc, test_example_writes_position_plan);
    tcase_add_test(tc, test_dispatch_help_and_version);
    tcase_add_test(tc, test_out_not_a_regular_file_or_an_input_is_refused);
    tcase_add_test(tc, test_logits_whose_z_loss_overflows_are_refused);
    tcase_add_test(tc, test_ignored_keys_are_noted_once);
    tcase_add_test(tc, test_jitter_overflow_names_the_jittered_logits);
    tcase_add_test(tc, test_zero_bias_routes_as_none_and_is_recorded_unused);
    tcase_add_test(tc, test_expert_choice_refuses_a_bias_tensor);
    tcase_add_test(tc, test_refused_config_prints_no_note);
    tcase_add_test(tc, test_logits_wider_than_the_expert_limit_exit_2);
    tcase_add_test(tc, test_noise_follows_the_documented_generator);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
