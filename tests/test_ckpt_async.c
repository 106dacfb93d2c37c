// Asynchronous checkpoints (train.async_checkpoint, moe/checkpoint.h): the
// folder equals a synchronous save's byte for byte, is taken from a snapshot
// at the step that triggers it, resumes bit-identically, reports a failed
// write with the file's name, is completed when training stops on a
// non-finite value, and its snapshot is part of the memory plan. The previous
// checkpoints a commit drops are renamed to trash names (never resolved) and
// removed by a background thread.
#include "../trainer/checkpoint_internal.h"
#include "moe/alloc.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/fsio.h"
#include "moe/plan.h"
#include "moe/train.h"
#include "testutil.h"

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static moe_config cfg(bool async) {
    moe_config c = tu_small_config();
    c.train.steps = 6;
    c.train.ckpt_every = 2;
    c.train.keep_checkpoints = 3;
    c.router.capacity_mode = MOE_CAPACITY_DYNAMIC; // trainer_state.json carries more state
    ck_assert_int_eq(
        moe_config_set(&c, NULL,
                       async ? "train.async_checkpoint=true" : "train.async_checkpoint=false"),
        0);
    return c;
}

// Every periodic save of an async run (steps 2, 4 and 6, written while
// training went on) holds the bytes of the synchronous run's.
START_TEST(test_async_checkpoints_equal_sync_byte_for_byte) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    moe_config cs = cfg(false), ca = cfg(true);
    // step 6, the last, is saved once: by its periodic save, not again at the end
    ck_assert_int_eq(tu_train(&cs, tu_path(dir, "sync", ""), NULL, NULL, 0), 3);
    ck_assert_int_eq(tu_train(&ca, tu_path(dir, "async", ""), NULL, NULL, 0), 3);
    static const char *const names[] = {"checkpoint-2", "checkpoint-4", "checkpoint-6"};
    for (int i = 0; i < 3; i++) {
        char a[1200], b[1200];
        snprintf(a, sizeof a, "%s", tu_path(dir, "sync", names[i]));
        snprintf(b, sizeof b, "%s", tu_path(dir, "async", names[i]));
        ck_assert_msg(moe_ckpt_complete(b), "%s is not complete", b);
        tu_assert_same_checkpoint(a, b);
        tu_assert_same_file(tu_path(a, "task_experts.json", ""),
                            tu_path(b, "task_experts.json", ""));
    }
}
END_TEST

// The folder holds the state of the step that began the save, although the
// model and the optimizer change before the thread is done: a snapshot. The
// biases change right after begin (small state, copied there), the
// parameters and moments right after the wait for the thread's copy.
START_TEST(test_async_save_writes_the_state_at_begin) {
    moe_config c = tu_ckpt_config();
    c.router.bias_update_rate = 1e-3; // the selection biases are saved too
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    tu_rng g;
    tu_seed(&g, 7);
    size_t n = moe_model_numel(&m);
    tu_fill_normal(&g, opt.m, n, 1e-2f);
    tu_fill_normal(&g, opt.v, n, 1e-2f);
    for (int l = 0; l < m.L; l++)
        if (moe_model_bias(&m, l)) tu_fill_normal(&g, moe_model_bias(&m, l), 4, 1.0f);
    moe_train_state st = {.step = 3, .cursor = {12, 0}, .tokens = 1e3, .seconds = 1.5};
    char dir[600], ref[700], run[700], saved[800];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(ref, sizeof ref, "%s/ref", dir);
    snprintf(run, sizeof run, "%s/run", dir);
    mkdir(run, 0755);
    ck_assert_int_eq(moe_ckpt_save(ref, &m, &opt, &st, NULL), 0);
    moe_ckpt_async *a;
    ck_assert_int_eq(moe_ckpt_async_init(&a, &m, NULL), 0);
    ck_assert_int_eq(moe_ckpt_async_begin(a, run, 0, &m, &opt, &st, NULL, saved, sizeof saved), 0);
    ck_assert_int_eq(moe_ckpt_async_pending(a), 3);
    for (int l = 0; l < m.L; l++) // the next step's bias update comes before its optimizer's
        if (moe_model_bias(&m, l)) moe_model_bias(&m, l)[0] += 1;
    ck_assert_int_eq(moe_ckpt_async_wait_snapshot(a), 1);
    for (size_t i = 0; i < n; i++) // what the next steps' updates do to the live buffers
        m.params[i] += 1, opt.m[i] += 1, opt.v[i] += 1;
    ck_assert_msg(moe_ckpt_async_wait(a, NULL) == 0, "%s", moe_last_error());
    ck_assert_int_eq(moe_ckpt_async_pending(a), -1);
    moe_ckpt_async_free(a);
    ck_assert_str_eq(saved, tu_path(run, "checkpoint", ""));
    tu_assert_same_checkpoint(ref, saved);
    moe_adamw_free(&opt);
    moe_model_free(&m);
}
END_TEST

// The copy of the parameters and moments runs on the save thread, after
// begin returns: wait_snapshot waits for it once per save (1), later calls
// and calls with no save begun return 0 at once. Modifying the model right
// after each wait, over three saves, leaves each checkpoint holding its own
// begin's state (a wait that returned early would let the thread, which
// starts copying only after begin returned, read the modified values).
START_TEST(test_model_changed_right_after_the_snapshot_wait_is_not_saved) {
    moe_config c = tu_ckpt_config();
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    size_t n = moe_model_numel(&m);
    char dir[600], run[700], ref[800], saved[800];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(run, sizeof run, "%s/run", dir);
    mkdir(run, 0755);
    ck_assert_int_eq(moe_ckpt_async_wait_snapshot(NULL), 0);
    moe_ckpt_async *a;
    ck_assert_int_eq(moe_ckpt_async_init(&a, &m, NULL), 0);
    ck_assert_int_eq(moe_ckpt_async_wait_snapshot(a), 0); // nothing begun
    for (long step = 1; step <= 3; step++) {
        moe_train_state st = {.step = step, .cursor = {(uint64_t)step, 0}, .seconds = 1};
        snprintf(ref, sizeof ref, "%s/ref-%ld", dir, step);
        ck_assert_int_eq(moe_ckpt_save(ref, &m, &opt, &st, NULL), 0);
        ck_assert_int_eq(moe_ckpt_async_begin(a, run, 3, &m, &opt, &st, NULL, saved, sizeof saved),
                         0);
        ck_assert_int_eq(moe_ckpt_async_wait_snapshot(a), 1);
        for (size_t i = 0; i < n; i++)
            m.params[i] = 2 * m.params[i] + 1, opt.m[i] -= 0.5f, opt.v[i] += 0.25f;
        ck_assert_int_eq(moe_ckpt_async_wait_snapshot(a), 0); // once per save
        if (step == 2) { // the commit of a save never waited for by the caller
            ck_assert_msg(moe_ckpt_async_wait(a, NULL) == 0, "%s", moe_last_error());
            ck_assert_int_eq(moe_ckpt_async_wait_snapshot(a), 0);
        }
    }
    ck_assert_msg(moe_ckpt_async_wait(a, NULL) == 0, "%s", moe_last_error());
    moe_ckpt_async_free(a);
    for (long step = 1; step <= 3; step++) {
        char got[800];
        snprintf(ref, sizeof ref, "%s/ref-%ld", dir, step);
        snprintf(got, sizeof got, "%s/checkpoint-%ld", run, step);
        tu_assert_same_checkpoint(ref, got);
    }
    moe_adamw_free(&opt);
    moe_model_free(&m);
}
END_TEST

// Training resumed from a checkpoint an async save wrote continues bit for
// bit: the losses of steps 3-6 and the final checkpoint equal the straight run's.
START_TEST(test_resume_from_async_checkpoint_is_bit_identical) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    moe_config c = cfg(true);
    double straight[6] = {0}, resumed[6] = {0};
    tu_train(&c, tu_path(dir, "straight", ""), NULL, straight, 0);
    tu_train(&c, tu_path(dir, "resumed", ""), tu_path(dir, "straight", "checkpoint-2"), resumed, 0);
    for (int i = 2; i < 6; i++)
        ck_assert_msg(straight[i] == resumed[i], "step %d: %.9g vs %.9g", i + 1, straight[i],
                      resumed[i]);
    tu_assert_same_checkpoint(tu_path(dir, "straight", "checkpoint-6"),
                              tu_path(dir, "resumed", "checkpoint-6"));
}
END_TEST

// A write that fails on the save thread is returned by the commit with the
// file's name, and the previous checkpoint stays the one that resolves.
START_TEST(test_async_write_failure_names_the_file) {
    moe_config c = tu_ckpt_config();
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    char run[600], saved[800], ref[800];
    snprintf(run, sizeof run, "%s", tu_tmpdir());
    moe_train_state st = {.step = 1, .seconds = 1};
    moe_ckpt_async *a;
    ck_assert_int_eq(moe_ckpt_async_init(&a, &m, NULL), 0);
    ck_assert_int_eq(moe_ckpt_async_begin(a, run, 0, &m, &opt, &st, NULL, saved, sizeof saved), 0);
    ck_assert_int_eq(moe_ckpt_async_wait(a, NULL), 0);
    snprintf(ref, sizeof ref, "%s/ref", run);
    ck_assert_int_eq(moe_ckpt_save(ref, &m, &opt, &st, NULL), 0);
    st.step = 2;
    m.params[0] += 1;
    // The second save's calls: mkdir of checkpoint.tmp (this thread), then
    // the model file's temp file (the save thread): that one fails.
    moe_fs_fault_arm(2, MOE_FAULT_FAIL);
    int rc = moe_ckpt_async_begin(a, run, 0, &m, &opt, &st, NULL, saved, sizeof saved);
    ck_assert_msg(rc == 0, "%s", moe_last_error());
    rc = moe_ckpt_async_wait(a, NULL);
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    ck_assert_int_eq(rc, MOE_EIO);
    ck_assert_msg(strstr(moe_last_error(), "checkpoint.tmp/model.safetensors"), "message: %s",
                  moe_last_error());
    ck_assert_int_eq(moe_ckpt_async_pending(a), -1);
    moe_ckpt_async_free(a);
    tu_assert_same_checkpoint(ref, tu_path(run, "checkpoint", ""));
    moe_adamw_free(&opt);
    moe_model_free(&m);
}
END_TEST

// Training stopped by a non-finite loss completes the save in flight (the
// last good step's), which then loads: nothing commits it but the stop.
START_TEST(test_nonfinite_stop_completes_the_pending_save) {
    moe_config c = cfg(true);
    c.train.lr = 1e4; // step 1 saves finite state, a later update overflows
    c.train.warmup_steps = 0;
    c.train.grad_clip = 0;
    c.train.ckpt_every = 1;
    c.train.keep_checkpoints = 0;
    char out[600];
    snprintf(out, sizeof out, "%s/nan", tu_tmpdir());
    moe_train_opts o = {.out_dir = out, .quiet = true};
    moe_train_result r;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_ENUMERIC);
    ck_assert_msg(strstr(moe_last_error(), "step "), "message: %s", moe_last_error());
    const char *ck = tu_path(out, "checkpoint", "");
    ck_assert_msg(moe_ckpt_complete(ck), "%s: no complete checkpoint", ck);
    moe_model m;
    moe_adamw opt;
    moe_train_state st;
    ck_assert_int_eq(moe_model_init(&m, &c, 4, 32, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    ck_assert_msg(moe_ckpt_load(ck, &m, &opt, &st) == 0, "%s", moe_last_error());
    ck_assert_int_ge(st.step, 1); // a step that finished (r.steps is not set on a failure)
    moe_adamw_free(&opt);
    moe_model_free(&m);
}
END_TEST

// The memory plan adds a copy of the parameters and both moments on the ranks
// that write tensor files (rank 0; with ep > 1 the first EP group), else nothing.
START_TEST(test_plan_counts_the_snapshot_on_writing_ranks) {
    moe_config c = tu_small_config();
    ck_assert_int_eq(moe_config_set(&c, NULL, "parallel.ep=2"), 0);
    for (int rank = 0; rank < 4; rank++) {
        moe_mem_plan off, on;
        c.train.async_checkpoint = false;
        ck_assert_int_eq(moe_plan_memory(&c, 4, rank, &off), 0);
        c.train.async_checkpoint = true;
        ck_assert_int_eq(moe_plan_memory(&c, 4, rank, &on), 0);
        size_t want = rank < 2 ? 3 * on.n_params * sizeof(float) : 0;
        ck_assert_uint_eq(on.ckpt_snapshot, want);
        ck_assert_uint_eq(on.total - off.total, want);
    }
}
END_TEST

// Measured: a run with async saves peaks where the plan says (test_memory's
// 3% standard), the snapshot included.
START_TEST(test_plan_matches_measured_peak_with_async_saves) {
    moe_config c = cfg(true);
    c.train.keep_checkpoints = 0;
    moe_mem_plan plan;
    ck_assert_int_eq(moe_plan_memory(&c, 1, 0, &plan), 0);
    ck_assert_uint_gt(plan.ckpt_snapshot, 0);
    char out[600];
    snprintf(out, sizeof out, "%s/mem", tu_tmpdir());
    size_t before = moe_mem_in_use();
    moe_mem_reset_peak();
    moe_train_opts o = {.out_dir = out, .quiet = true, .stop_after = 5};
    moe_train_result r;
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
    size_t measured = moe_mem_peak() - before;
    ck_assert_int_eq(moe_mem_in_use(), before);
    double err = ((double)plan.total - (double)measured) / (double)measured;
    ck_assert_msg(err <= 0.03 && err >= -0.03, "predicted %zu, measured %zu", plan.total, measured);
}
END_TEST

// The names of dir's checkpoint family (checkpoint*), sorted, joined by ' '.
static const char *ckpt_names(const char *dir) {
    static char out[1024];
    char names[16][256];
    int n = 0;
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, "checkpoint", 10) && n < 16)
            snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    out[0] = 0;
    for (int i = 0; i < n; i++)
        snprintf(out + strlen(out), sizeof out - strlen(out), "%s%s", i ? " " : "", names[i]);
    return out;
}

// With rotation, the commits' pruned folders are gone once training returns
// (the cleaner thread was joined): the two kept, nothing renamed left over.
START_TEST(test_async_rotation_leaves_only_the_kept_checkpoints) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    moe_config c = cfg(true);
    c.train.steps = 8;
    c.train.keep_checkpoints = 2;
    tu_train(&c, tu_path(dir, "run", ""), NULL, NULL, 0);
    ck_assert_str_eq(ckpt_names(tu_path(dir, "run", "")), "checkpoint-6 checkpoint-8");
    char got[1200];
    ck_assert_int_eq(moe_ckpt_resolve(tu_path(dir, "run", ""), got, sizeof got, NULL), 0);
    ck_assert_str_eq(got, tu_path(dir, "run", "checkpoint-8"));
}
END_TEST

// A last step that is not a periodic one gets its own save after the loop.
START_TEST(test_last_step_off_the_period_is_saved_at_the_end) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    moe_config c = cfg(true);
    c.train.steps = 5;
    ck_assert_int_eq(tu_train(&c, tu_path(dir, "run", ""), NULL, NULL, 0), 3);
    ck_assert_str_eq(ckpt_names(tu_path(dir, "run", "")), "checkpoint-2 checkpoint-4 checkpoint-5");
    ck_assert(moe_ckpt_complete(tu_path(dir, "run", "checkpoint-5")));
}
END_TEST

// One checkpoint/ folder (keep_checkpoints = 0): each commit swaps the
// previous one out to checkpoint.trash, removed in the background; none is
// left and the folder holds the last save.
START_TEST(test_async_saves_into_one_folder_leave_no_trash) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    moe_config c = cfg(true);
    c.train.keep_checkpoints = 0;
    tu_train(&c, tu_path(dir, "run", ""), NULL, NULL, 0);
    ck_assert_str_eq(ckpt_names(tu_path(dir, "run", "")), "checkpoint");
    ck_assert(moe_ckpt_complete(tu_path(dir, "run", "checkpoint")));
}
END_TEST

// The deferred pruning of a commit: the dropped folders are renamed to their
// trash names at once (a reader resolves the new checkpoint, never those),
// and only removing the trash list deletes them.
START_TEST(test_deferred_prune_renames_to_trash_and_resolves_the_new) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    moe_config c = cfg(false); // checkpoint-2, -4, -6
    tu_train(&c, tu_path(dir, "run", ""), NULL, NULL, 0);
    const char *run = tu_path(dir, "run", "");
    moe_ckpt_trash later = {0};
    ck_assert_int_eq(moe_ckpt_run_finish(run, 1, 6, &later), 0);
    ck_assert_int_eq(later.n, 2);
    ck_assert_str_eq(ckpt_names(run), "checkpoint-2.trash checkpoint-4.trash checkpoint-6");
    char got[1200];
    ck_assert_int_eq(moe_ckpt_resolve(run, got, sizeof got, NULL), 0);
    ck_assert_str_eq(got, tu_path(dir, "run", "checkpoint-6"));
    ck_assert_int_eq(moe_ckpt_trash_empty(&later), 0);
    ck_assert_int_eq(later.n, 0);
    ck_assert_str_eq(ckpt_names(run), "checkpoint-6");
    moe_ckpt_trash_free(&later);
}
END_TEST

// Without a latest file a reader takes the highest checkpoint-STEP, never a
// folder being pruned: checkpoint-6.trash does not make -6 the newest.
START_TEST(test_resolve_without_latest_skips_trash) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    moe_config c = cfg(false); // checkpoint-2, -4, -6
    tu_train(&c, tu_path(dir, "run", ""), NULL, NULL, 0);
    char run[1200], from[1200], to[1200];
    snprintf(run, sizeof run, "%s", tu_path(dir, "run", ""));
    snprintf(from, sizeof from, "%s", tu_path(dir, "run", "checkpoint-6"));
    snprintf(to, sizeof to, "%s", tu_path(dir, "run", "checkpoint-6.trash"));
    ck_assert_int_eq(rename(from, to), 0);
    unlink(tu_path(dir, "run", "latest"));
    char got[1200];
    ck_assert_msg(moe_ckpt_resolve(run, got, sizeof got, NULL) == 0, "%s", moe_last_error());
    ck_assert_str_eq(got, tu_path(dir, "run", "checkpoint-4"));
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("ckpt_async");
    TCase *tc = tcase_create("async");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_async_checkpoints_equal_sync_byte_for_byte);
    tcase_add_test(tc, test_async_save_writes_the_state_at_begin);
    tcase_add_test(tc, test_model_changed_right_after_the_snapshot_wait_is_not_saved);
    tcase_add_test(tc, test_resume_from_async_checkpoint_is_bit_identical);
    tcase_add_test(tc, test_async_write_failure_names_the_file);
    tcase_add_test(tc, test_nonfinite_stop_completes_the_pending_save);
    tcase_add_test(tc, test_plan_counts_the_snapshot_on_writing_ranks);
    tcase_add_test(tc, test_plan_matches_measured_peak_with_async_saves);
    tcase_add_test(tc, test_async_rotation_leaves_only_the_kept_checkpoints);
    tcase_add_test(tc, test_last_step_off_the_period_is_saved_at_the_end);
    tcase_add_test(tc, test_async_saves_into_one_folder_leave_no_trash);
    tcase_add_test(tc, test_deferred_prune_renames_to_trash_and_resolves_the_new);
    tcase_add_test(tc, test_resolve_without_latest_skips_trash);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
