// Checkpoint saves under injected faults, the SQLite way (moe/fsio.h): every
// counted file-system call of a save is made to fail, or to abort the process,
// twice in a row, and after each the resolver must find a complete checkpoint
// equal to a save that completed (or to the one whose swap finished), and the
// next save must succeed and leave no temp folder. Also: trainer_state.json
// validation, and the one tensor layout every reader agrees on.
#include "moe/checkpoint.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/export.h"
#include "moe/fsio.h"
#include "moe/infer.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"
#include "moe/train.h"
#include "testutil.h"

#include <dirent.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define N_TASKS 5

static moe_config tiny(void) {
    moe_config c = tu_small_config();
    c.model.d_model = 16;
    c.model.n_layers = 1;
    c.model.n_heads = 2;
    c.model.n_kv_heads = 1;
    c.model.d_ff = 16;
    c.model.seq_len = 8;
    c.train.batch_size = 2;
    c.moe.num_experts[0] = 2; // fewer tensors, fewer write calls to walk
    c.router.capacity_mode = MOE_CAPACITY_DYNAMIC;
    return c;
}

// The writer's state, and the reader's model (loads land there).
static moe_model wm, rm;
static moe_adamw wopt, ropt;
static char root[600], dir[700];
// > 0: saves go to the run folder `run` with rotation (moe_ckpt_save_run,
// keeping rot_keep), and readers read the run folder.
static int rot_keep;
static char run[700];

static void setup(void) {
    moe_config c = tiny();
    ck_assert_int_eq(moe_config_check(&c, NULL), 0);
    ck_assert_int_eq(moe_model_init(&wm, &c, 2, 8, N_TASKS), 0);
    ck_assert_int_eq(moe_adamw_init(&wopt, &wm.table, false), 0);
    ck_assert_int_eq(moe_model_init(&rm, &c, 2, 8, N_TASKS), 0);
    ck_assert_int_eq(moe_adamw_init(&ropt, &rm.table, false), 0);
    const char *t = tu_tmpdir();
    ck_assert_ptr_nonnull(t);
    snprintf(root, sizeof root, "%s", t);
    snprintf(dir, sizeof dir, "%s/checkpoint", root);
    snprintf(run, sizeof run, "%s/run", root);
    rot_keep = 0;
}

static void teardown(void) {
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    moe_fs_remove_tree(root);
    moe_adamw_free(&wopt);
    moe_adamw_free(&ropt);
    moe_model_free(&wm);
    moe_model_free(&rm);
}

// Version v of the training state: every value derived from v, so a load
// tells bitwise which save it came from.
static float value(int v, size_t i, int which) {
    return (float)v + (float)(i % 1000) * 1e-3f + (float)which * 0.5f;
}

static void make_state(int v, moe_train_state *st) {
    for (size_t i = 0; i < wm.table.numel; i++) {
        wm.params[i] = value(v, i, 0);
        wopt.m[i] = value(v, i, 1);
        wopt.v[i] = value(v, i, 2);
    }
    wopt.step = v;
    for (int l = 0; l < wm.L; l++)
        if (wm.cap[l].capacity)
            for (int e = 0; e < wm.cap[l].E; e++) {
                wm.cap[l].ema[e] = v + e * 0.25;
                wm.cap[l].capacity[e] = 4 + (v + e) % 3;
            }
    *st = (moe_train_state){.step = v, .cursor = {(uint64_t)v * 10, (uint64_t)v}};
}

static int save_version(int v) {
    moe_train_state st;
    make_state(v, &st);
    if (rot_keep > 0) {
        char saved[800];
        return moe_ckpt_save_run(run, rot_keep, &wm, &wopt, &st, NULL, saved, sizeof saved);
    }
    return moe_ckpt_save(dir, &wm, &wopt, &st, NULL);
}

// Which version the checkpoint at dir holds (bitwise params, moments and
// step), or -1 when it does not load or matches none.
static int loaded_version(void) {
    moe_train_state st = {.step = -1};
    if (moe_ckpt_load(rot_keep > 0 ? run : dir, &rm, &ropt, &st) != 0) return -1;
    int v = (int)st.step;
    for (size_t i = 0; i < rm.table.numel; i++)
        if (rm.params[i] != value(v, i, 0) || ropt.m[i] != value(v, i, 1) ||
            ropt.v[i] != value(v, i, 2))
            return -1;
    return ropt.step == v ? v : -1;
}

// After a successful save: the checkpoint folder alone, holding its six files.
static int clean_layout(void) {
    int n = tu_count_entries(root), k = tu_count_entries(dir);
    char p[800];
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    return n == 1 && k == 6 && access(p, F_OK) == 0 && moe_ckpt_complete(dir);
}

// One save of version v with a fault at call n: in this process (fail) or in
// a child that aborts there. Returns 0 (saved), 1 (failed or crashed), 2 (the
// save finished before reaching call n).
static int faulted_save(int v, long n, moe_fault_mode mode) {
    if (mode == MOE_FAULT_FAIL) {
        moe_fs_fault_arm(n, mode);
        int rc = save_version(v);
        long seen = moe_fs_op_count();
        moe_fs_fault_arm(0, MOE_FAULT_OFF);
        return seen < n ? 2 : rc == 0 ? 0 : 1;
    }
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        struct rlimit none = {0, 0};
        setrlimit(RLIMIT_CORE, &none);
        moe_fs_fault_arm(n, mode);
        int rc = save_version(v);
        _exit(moe_fs_op_count() < n ? 2 : rc == 0 ? 0 : 1);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status)) {
        ck_assert_int_eq(WTERMSIG(status), SIGABRT);
        return 1;
    }
    ck_assert(WIFEXITED(status));
    return WEXITSTATUS(status);
}

// Calls counted by a fault-free save of version v from the current state.
static long count_calls(int v) {
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    ck_assert_int_eq(save_version(v), 0);
    return moe_fs_op_count();
}

// The walk: save 1 completes; save 2 faults at i; save 3 faults at j; save 4
// must complete cleanly. After each, the resolver's checkpoint is checked.
// Every i; j at a stride whose offset turns with i, so that every second
// point is paired with many first ones (MOE_CKPT_FAULTS_FULL=1: every pair).
static void walk(moe_fault_mode mode, long j_stride) {
    long points = 0;
    const char *full = getenv("MOE_CKPT_FAULTS_FULL");
    if (full && !strcmp(full, "1")) j_stride = 1;
    for (long i = 1;; i++) {
        int done_j = 0;
        for (long j = 1 + i % j_stride; !done_j; j += j_stride) {
            moe_fs_remove_tree(dir);
            char p[800];
            const char *sfx[] = {".tmp", ".old", ".trash"};
            for (int s = 0; s < 3; s++) {
                snprintf(p, sizeof p, "%s%s", dir, sfx[s]);
                moe_fs_remove_tree(p);
            }
            ck_assert_int_eq(save_version(1), 0);
            int b = faulted_save(2, i, mode);
            if (b == 2) { // save 2 never reached call i: every point was walked
                ck_assert_msg(points > 20, "only %ld injection points in a save", points);
                return;
            }
            int x = loaded_version();
            ck_assert_msg(x == 2 || (x == 1 && b != 0),
                          "fault at call %ld (%s): reader finds version %d, save returned %d", i,
                          mode == MOE_FAULT_FAIL ? moe_fs_fault_op() : "abort", x, b);
            int c = faulted_save(3, j, mode);
            int y = loaded_version();
            ck_assert_msg(y == 3 || (y == x && c != 0),
                          "faults at calls %ld then %ld: reader finds version %d after %d (save "
                          "returned %d)",
                          i, j, y, x, c);
            if (c == 2) done_j = 1;
            ck_assert_msg(save_version(4) == 0, "faults %ld, %ld: next save fails: %s", i, j,
                          moe_last_error());
            ck_assert_msg(loaded_version() == 4, "faults %ld, %ld: last save not found", i, j);
            ck_assert_msg(clean_layout(), "faults %ld, %ld: temp folders or files remain", i, j);
        }
        points = i;
    }
}

START_TEST(test_save_survives_a_failed_call_at_every_point_twice) {
    walk(MOE_FAULT_FAIL, 10);
}
END_TEST

START_TEST(test_save_survives_a_crash_at_every_point_twice) {
#ifdef __SANITIZE_ADDRESS__
    walk(MOE_FAULT_ABORT, 60); // fork copies the sanitizer's large mappings: slow
#else
    walk(MOE_FAULT_ABORT, 20);
#endif
}
END_TEST

START_TEST(test_save_counts_its_calls_and_hook_is_off_by_default) {
    ck_assert_int_eq(save_version(1), 0);
    long n = count_calls(2);
    ck_assert_int_gt(n, 20);
    ck_assert_int_eq(count_calls(3), n); // the same protocol from the same state
    ck_assert_int_eq(loaded_version(), 3);
    ck_assert(clean_layout());
}
END_TEST

// Issue 18 item 5: a stray temp file of any name, in the checkpoint or beside
// it, never blocks a later save and is gone after it.
START_TEST(test_stray_temp_files_do_not_block_saves) {
    ck_assert_int_eq(save_version(1), 0);
    char p[800];
    snprintf(p, sizeof p, "%s/model.safetensors.tmp.AbC123", dir);
    FILE *f = fopen(p, "w");
    fputs("partial", f);
    fclose(f);
    snprintf(p, sizeof p, "%s.old", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s.old/optimizer.safetensors.tmp.zz9", dir);
    f = fopen(p, "w");
    fclose(f);
    snprintf(p, sizeof p, "%s.trash", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s.trash/junk", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    ck_assert_int_eq(save_version(2), 0);
    ck_assert_int_eq(save_version(3), 0);
    ck_assert_int_eq(loaded_version(), 3);
    ck_assert(clean_layout());
}
END_TEST

// Issue 18 item 6: DIR gone, DIR.old and a complete DIR.tmp present (a crash
// between the renames of a swap). The reader takes the newer DIR.tmp; a save
// that then crashes must not lose it.
START_TEST(test_complete_tmp_is_found_and_kept_through_a_second_crash) {
    ck_assert_int_eq(save_version(1), 0);
    char old[800], tmp[800];
    snprintf(old, sizeof old, "%s.old", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    ck_assert_int_eq(rename(dir, old), 0);
    char other[800]; // version 2, saved elsewhere, stands in for the complete DIR.tmp
    snprintf(other, sizeof other, "%s/other", root);
    moe_train_state st;
    make_state(2, &st);
    ck_assert_int_eq(moe_ckpt_save(other, &wm, &wopt, &st, NULL), 0);
    ck_assert_int_eq(rename(other, tmp), 0);
    char out[800];
    moe_ckpt_layout lay;
    ck_assert_int_eq(moe_ckpt_resolve(dir, out, sizeof out, &lay), 0);
    ck_assert_str_eq(out, tmp);
    ck_assert_int_eq(lay, MOE_CKPT_SINGLE);
    ck_assert_int_eq(loaded_version(), 2);
    // a manifest naming a file that is missing: not complete, DIR.old is read
    char p[900];
    snprintf(p, sizeof p, "%s/trainer_state.json", tmp);
    char q[900];
    snprintf(q, sizeof q, "%s/ts.bak", root);
    ck_assert_int_eq(rename(p, q), 0);
    ck_assert_int_eq(moe_ckpt_complete(tmp), 0);
    ck_assert_int_eq(moe_ckpt_resolve(dir, out, sizeof out, NULL), 0);
    ck_assert_str_eq(out, old);
    // with DIR.old gone too, nothing resolves, and the message says the .tmp is cut off
    char old2[900];
    snprintf(old2, sizeof old2, "%s/old.bak", root);
    ck_assert_int_eq(rename(old, old2), 0);
    ck_assert_int_eq(moe_ckpt_resolve(dir, out, sizeof out, NULL), MOE_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "its .tmp is incomplete: a save was cut off"));
    ck_assert_int_eq(rename(old2, old), 0);
    ck_assert_int_eq(rename(q, p), 0);
    // the second crash, at every point of the next save: version 2 survives
    for (long n = 1;; n++) {
        int r = faulted_save(3, n, MOE_FAULT_ABORT);
        int v = loaded_version();
        ck_assert_msg(v == 2 || v == 3, "crash at call %ld: version %d found", n, v);
        if (r == 2 || v == 3) break;
    }
}
END_TEST

// --- run folders: step-numbered checkpoints, `latest`, rotation ----------------------

// The run folder holds exactly keep checkpoint-S folders (the newest being
// checkpoint-newest, which `latest` names) and `latest`: no temp folder or file.
static void assert_rotated(int keep, int newest) {
    char p[1100], want[64];
    ck_assert_int_eq(tu_count_entries(run), keep + 1);
    snprintf(want, sizeof want, "checkpoint-%d\n", newest);
    ck_assert_str_eq(tu_file_text(run, "latest"), want);
    DIR *d = opendir(run);
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)) != NULL) {
        long s;
        int sfx;
        if (!moe_ckpt_step_name(e->d_name, &s, &sfx)) continue;
        ck_assert_int_eq(sfx, MOE_CKPT_NAME_PLAIN);
        ck_assert_int_le(s, newest);
        snprintf(p, sizeof p, "%s/%s", run, e->d_name);
        ck_assert(moe_ckpt_complete(p));
        n++;
    }
    closedir(d);
    ck_assert_int_eq(n, keep);
}

START_TEST(test_rotation_keeps_exactly_n_and_latest_names_the_newest) {
    ck_assert_int_eq(mkdir(run, 0755), 0);
    rot_keep = 3;
    for (int v = 1; v <= 6; v++) {
        ck_assert_int_eq(save_version(v), 0);
        ck_assert_int_eq(loaded_version(), v); // the run folder resolves to the newest
        assert_rotated(v < 3 ? v : 3, v);
    }
    char p[800];
    snprintf(p, sizeof p, "%s/checkpoint-4", run); // the oldest kept, readable by name
    moe_train_state st = {.step = -1};
    ck_assert_int_eq(moe_ckpt_load(p, &rm, &ropt, &st), 0);
    ck_assert_int_eq(st.step, 4);
    // without `latest` (removed by hand), the highest-numbered checkpoint is read
    snprintf(p, sizeof p, "%s/latest", run);
    ck_assert_int_eq(unlink(p), 0);
    ck_assert_int_eq(loaded_version(), 6);
    // a `latest` naming something else is refused, naming the file
    FILE *f = fopen(p, "w");
    fputs("../elsewhere\n", f);
    fclose(f);
    ck_assert_int_eq(moe_ckpt_load(run, &rm, &ropt, &st), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "latest"));
}
END_TEST

// A save with rotation cut at every counted call (failed, or the process
// aborted there): the run folder still resolves to a complete checkpoint, the
// new one or the one before; the next save completes and leaves exactly keep
// checkpoints and `latest`.
static void rotation_walk(moe_fault_mode mode) {
    rot_keep = 2;
    long points = 0;
    for (long i = 1;; i++) {
        moe_fs_remove_tree(run);
        ck_assert_int_eq(mkdir(run, 0755), 0);
        for (int v = 1; v <= 3; v++)
            ck_assert_int_eq(save_version(v), 0);
        int b = faulted_save(4, i, mode);
        if (b == 2) {
            ck_assert_msg(points > 30, "only %ld injection points in a rotating save", points);
            return;
        }
        int x = loaded_version();
        ck_assert_msg(x == 4 || (x == 3 && b != 0),
                      "fault at call %ld (%s): the run folder resolves to version %d, save "
                      "returned %d",
                      i, mode == MOE_FAULT_FAIL ? moe_fs_fault_op() : "abort", x, b);
        ck_assert_msg(save_version(5) == 0, "fault %ld: next save fails: %s", i, moe_last_error());
        ck_assert_int_eq(loaded_version(), 5);
        assert_rotated(2, 5);
        points = i;
    }
}

START_TEST(test_rotating_save_survives_a_failed_call_at_every_point) {
    rotation_walk(MOE_FAULT_FAIL);
}
END_TEST

START_TEST(test_rotating_save_survives_a_crash_at_every_point) {
    rotation_walk(MOE_FAULT_ABORT);
}
END_TEST

// --- item 8: trainer_state.json ----------------------------------------------------

// Rewrites field path (a small path language: keys and [index]) of
// trainer_state.json with the JSON text value, then loads: must be refused
// with MOE_EFORMAT naming the file and want.
static void refuse_edit(const char *edit_json, const char *want) {
    char p[800];
    snprintf(p, sizeof p, "%s/trainer_state.json", dir);
    json_t *doc = json_load_file(p, 0, NULL);
    ck_assert_ptr_nonnull(doc);
    json_t *patch = json_loads(edit_json, JSON_DECODE_ANY, NULL);
    ck_assert_ptr_nonnull(patch);
    // patch: {"top": value} or {"capacity.FIELD": value} (layer 0's entry) or
    // {"capacity.FIELD[e]": value}
    const char *key;
    json_t *val;
    json_object_foreach(patch, key, val) {
        if (strncmp(key, "capacity.", 9)) {
            json_object_set(doc, key, val);
            continue;
        }
        json_t *o = json_array_get(json_object_get(doc, "capacity"), 0);
        char field[64];
        int e = -1;
        snprintf(field, sizeof field, "%s", key + 9);
        char *br = strchr(field, '[');
        if (br) e = atoi(br + 1), *br = 0;
        ck_assert_int_eq(e < 0 ? json_object_set(o, field, val)
                               : json_array_set(json_object_get(o, field), (size_t)e, val),
                         0);
    }
    char bak[800];
    snprintf(bak, sizeof bak, "%s/state.bak", root);
    ck_assert_int_eq(json_dump_file(doc, bak, 0), 0);
    json_decref(doc);
    json_decref(patch);
    char orig[800];
    snprintf(orig, sizeof orig, "%s/state.orig", root);
    ck_assert_int_eq(rename(p, orig), 0);
    ck_assert_int_eq(rename(bak, p), 0);
    tu_refresh_manifest(dir); // past the manifest's size check, to the field checks
    moe_train_state st = {.step = -7};
    double ema0 = rm.cap[0].ema[0];
    int rc = moe_ckpt_load(dir, &rm, &ropt, &st);
    const char *msg = moe_last_error();
    ck_assert_msg(rc == MOE_EFORMAT, "%s: accepted (rc %d)", edit_json, rc);
    ck_assert_msg(strstr(msg, "trainer_state.json") && strstr(msg, want),
                  "%s: message '%s' does not name '%s'", edit_json, msg, want);
    ck_assert_int_eq(st.step, -7);       // nothing applied
    ck_assert(rm.cap[0].ema[0] == ema0); // not even the capacity state
    ck_assert_int_eq(rename(orig, p), 0);
    tu_refresh_manifest(dir);
}

START_TEST(test_trainer_state_fields_are_validated) {
    ck_assert_int_eq(save_version(1), 0);
    ck_assert_int_eq(loaded_version(), 1);
    rm.cap[0].ema[0] = 123.0; // so "nothing applied" can be seen
    refuse_edit("{\"capacity.capacity[0]\": -1}", "capacity[layer 0].capacity[0]");
    refuse_edit("{\"capacity.capacity[0]\": 0}", "capacity[layer 0].capacity[0]");
    refuse_edit("{\"capacity.capacity[1]\": 1099511627776}", "capacity[layer 0].capacity[1]");
    refuse_edit("{\"capacity.capacity[0]\": \"4\"}", "capacity[layer 0].capacity[0]");
    refuse_edit("{\"capacity.capacity[0]\": 4.5}", "capacity[layer 0].capacity[0]");
    refuse_edit("{\"capacity.ema[0]\": -0.5}", "capacity[layer 0].ema[0]");
    refuse_edit("{\"capacity.ema[1]\": 1e300}", "capacity[layer 0].ema[1]");
    refuse_edit("{\"capacity.ema[0]\": \"nan\"}", "capacity[layer 0].ema[0]");
    refuse_edit("{\"capacity.ema\": [1, 2, 3]}", "capacity[layer 0].ema");
    refuse_edit("{\"capacity.capacity\": 4}", "capacity[layer 0].capacity");
    refuse_edit("{\"capacity.layer\": 3}", "capacity[layer 0].layer");
    refuse_edit("{\"capacity.layer\": \"0\"}", "capacity[layer 0].layer");
    refuse_edit("{\"capacity.steps\": -1}", "capacity[layer 0].steps");
    refuse_edit("{\"capacity.steps\": 1.5}", "capacity[layer 0].steps");
    refuse_edit("{\"capacity.seeded\": 1}", "capacity[layer 0].seeded");
    refuse_edit("{\"capacity\": []}", "'capacity'");
    refuse_edit("{\"capacity\": [7]}", "capacity state of layer 0");
    refuse_edit("{\"step\": -3}", "'step'");
    refuse_edit("{\"step\": \"12\"}", "'step'");
    refuse_edit("{\"adam_step\": 1e3}", "'adam_step'");
    refuse_edit("{\"step\": 5, \"adam_step\": 6}", "'adam_step' must be at most"); // more updates
    refuse_edit("{\"data_cursor\": [-1, 0]}", "data_cursor[0]");
    refuse_edit("{\"data_cursor\": [0, \"x\"]}", "data_cursor[1]");
    refuse_edit("{\"data_cursor\": [0]}", "data_cursor");
    refuse_edit("{\"drop_rate_sum\": -1}", "drop_rate_sum");
    refuse_edit("{\"mfu_sum\": \"x\"}", "mfu_sum");
    refuse_edit("{\"summed_steps\": 99}", "'summed_steps'"); // more steps than the state's
    refuse_edit("{\"mfu_steps\": 0.5}", "'mfu_steps'");
    // the untouched file still loads
    ck_assert_int_eq(loaded_version(), 1);
}
END_TEST

// --- item 16: one layout for every reader -------------------------------------------

// A checkpoint made by the trainer's own save (with task shares), for readers.
static void save_real(const char *d) {
    moe_config c = tiny();
    c.router.capacity_mode = MOE_CAPACITY_STATIC;
    moe_data data;
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_data_open(&data, &c), 0);
    ck_assert_int_eq(moe_model_init(&m, &c, data.B, data.T, data.n_tasks), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    ck_assert_int_eq(moe_task_share_measure(&m, &data, 1), 0);
    moe_train_state st = {.step = 0};
    ck_assert_int_eq(moe_ckpt_save(d, &m, &opt, &st, NULL), 0);
    moe_adamw_free(&opt);
    moe_model_free(&m);
    moe_data_close(&data);
}

// Every reader on d: 0 or the same error code and message for all.
static void readers_agree(const char *d, int want_rc, const char *want_msg) {
    moe_config c;
    int rc = moe_ckpt_config(d, &c);
    ck_assert_msg(rc == want_rc, "config: %d %s", rc, moe_last_error());
    if (want_msg) ck_assert_ptr_nonnull(strstr(moe_last_error(), want_msg));
    moe_st_set *s = NULL;
    rc = moe_st_set_open(d, &s);
    ck_assert_msg(rc == want_rc, "set_open: %d %s", rc, moe_last_error());
    if (want_msg) ck_assert_ptr_nonnull(strstr(moe_last_error(), want_msg));
    moe_st_set_close(s);
    moe_config t = tiny();
    t.router.capacity_mode = MOE_CAPACITY_STATIC;
    moe_model m;
    ck_assert_int_eq(moe_model_init(&m, &t, 2, 8, N_TASKS), 0);
    rc = moe_ckpt_load(d, &m, NULL, NULL);
    moe_model_free(&m);
    ck_assert_msg(rc == want_rc, "load: %d %s", rc, moe_last_error());
    if (want_msg) ck_assert_ptr_nonnull(strstr(moe_last_error(), want_msg));
    moe_infer inf;
    moe_infer_opts o = {0};
    o.task = "copy";
    rc = moe_infer_open(&inf, d, &o);
    if (rc == 0) moe_infer_free(&inf);
    ck_assert_msg(rc == want_rc, "infer: %d %s", rc, moe_last_error());
    if (want_msg) ck_assert_ptr_nonnull(strstr(moe_last_error(), want_msg));
    char out[800];
    snprintf(out, sizeof out, "%s/hf", root);
    rc = moe_export_hf(d, out);
    ck_assert_msg(rc == want_rc, "export: %d %s", rc, moe_last_error());
    if (want_msg) ck_assert_ptr_nonnull(strstr(moe_last_error(), want_msg));
}

START_TEST(test_both_tensor_layouts_are_refused_by_every_reader) {
    save_real(dir);
    readers_agree(dir, 0, NULL);
    char p[800];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(p, "w");
    fputs("{\"weight_map\": {\"model.norm.weight\": \"model.safetensors\"}}", f);
    fclose(f);
    readers_agree(dir, MOE_EFORMAT, "both model.safetensors and model.safetensors.index.json");
    // the CLI commands exit alike, with the one message
    char args[2400];
    int codes[3];
    snprintf(args, sizeof args, "eval %s", dir);
    codes[0] = tu_run_moe(root, args);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), "both model.safetensors"));
    snprintf(args, sizeof args, "generate %s --task copy --prompt ab", dir);
    codes[1] = tu_run_moe(root, args);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), "both model.safetensors"));
    snprintf(args, sizeof args, "export %s --hf %s/hf2", dir, root);
    codes[2] = tu_run_moe(root, args);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), "both model.safetensors"));
    ck_assert_int_ne(codes[0], 0);
    ck_assert_int_eq(codes[1], codes[0]);
    ck_assert_int_eq(codes[2], codes[0]);
}
END_TEST

// The sharded layout alone is read by every reader, resume included.
START_TEST(test_sharded_layout_alone_is_read_by_every_reader) {
    save_real(dir);
    char p[800], q[800];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    snprintf(q, sizeof q, "%s/model-00001-of-00001.safetensors", dir);
    ck_assert_int_eq(rename(p, q), 0);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(q, &f), 0);
    json_t *map = json_object();
    for (int i = 0; i < f->n_tensors; i++)
        json_object_set_new(map, f->tensors[i].name,
                            json_string("model-00001-of-00001.safetensors"));
    moe_st_close(f);
    json_t *doc = json_pack("{s:o}", "weight_map", map);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    ck_assert_int_eq(json_dump_file(doc, p, 0), 0);
    json_decref(doc);
    tu_refresh_manifest(dir); // model.safetensors is gone
    readers_agree(dir, 0, NULL);
}
END_TEST

int main(void) {
    // Thousands of saves: on tmpfs their fsyncs cost nothing. What is tested
    // is the order of the calls and what a crash between two of them leaves,
    // which an abort() shows the same on any filesystem.
    struct stat sb;
    if (!getenv("TMPDIR") && stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) &&
        access("/dev/shm", W_OK) == 0)
        setenv("TMPDIR", "/dev/shm", 1);
    Suite *s = suite_create("ckpt_faults");
    TCase *tc = tcase_create("faults");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_save_counts_its_calls_and_hook_is_off_by_default);
    tcase_add_test(tc, test_stray_temp_files_do_not_block_saves);
    tcase_add_test(tc, test_complete_tmp_is_found_and_kept_through_a_second_crash);
    tcase_add_test(tc, test_save_survives_a_failed_call_at_every_point_twice);
    tcase_add_test(tc, test_save_survives_a_crash_at_every_point_twice);
    tcase_add_test(tc, test_rotation_keeps_exactly_n_and_latest_names_the_newest);
    tcase_add_test(tc, test_rotating_save_survives_a_failed_call_at_every_point);
    tcase_add_test(tc, test_rotating_save_survives_a_crash_at_every_point);
    tcase_add_test(tc, test_trainer_state_fields_are_validated);
    tcase_add_test(tc, test_both_tensor_layouts_are_refused_by_every_reader);
    tcase_add_test(tc, test_sharded_layout_alone_is_read_by_every_reader);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
