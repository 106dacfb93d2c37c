// What readers accept from checkpoints and files: a FIFO in place of any input
// is refused at once, non-finite weights are refused naming the tensor, an
// expert-parallel checkpoint works with every single-process command, export
// and generate hold the tensor set to config.json, and export never writes
// into a checkpoint folder.
#include "kernels/cpu/cpu.h"
#include "moe/checkpoint.h"
#include "moe/config.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/export.h"
#include "moe/file.h"
#include "moe/infer.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// A hang is the failure these tests look for: the alarm turns it into one.
enum { HANG_GUARD_S = 120 };

static const char *join(const char *dir, const char *name) {
    static char buf[4][1024];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, 1024, "%s/%s", dir, name);
    return p;
}

static void write_config(const moe_config *c, const char *path) {
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(moe_config_write(c, f), 0);
    ck_assert_int_eq(fclose(f), 0);
}

// Rewrites dir/model.safetensors through edit(entries, n, data) with every
// tensor loaded as it is; edit may change dtypes, shapes, data or the count.
typedef void (*edit_fn)(moe_st_entry *e, int *n, void **data);
static void rewrite_model(const char *dir, edit_fn edit) {
    const char *p = join(dir, "model.safetensors");
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    int n = f->n_tensors;
    moe_st_entry *e = calloc((size_t)n + 1, sizeof *e);
    void **data = calloc((size_t)n + 1, sizeof *data);
    char **names = calloc((size_t)n + 1, sizeof *names);
    for (int i = 0; i < n; i++) {
        const moe_st_tensor *t = &f->tensors[i];
        ck_assert_int_eq(moe_st_load(f, t->name, t->dtype, -1, NULL, &data[i]), 0);
        names[i] = strdup(t->name);
        e[i] = (moe_st_entry){names[i], t->dtype, t->ndim, {0}, data[i]};
        memcpy(e[i].shape, t->shape, sizeof(int64_t) * t->ndim);
    }
    moe_st_close(f);
    const int n0 = n;
    edit(e, &n, data);
    ck_assert_int_eq(moe_st_write(p, e, n, NULL), 0);
    tu_refresh_manifest(dir);
    for (int i = 0; i < n0 + 1; i++)
        free(data[i]), free(names[i]);
    free(data);
    free(names);
    free(e);
}

static int find(const moe_st_entry *e, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(e[i].name, name)) return i;
    ck_abort_msg("no tensor %s", name);
    return -1;
}

static void nan_in_norm(moe_st_entry *e, int *n, void **data) {
    ((float *)data[find(e, *n, "model.layers.1.post_attention_layernorm.weight")])[7] = NAN;
}

static void inf_in_expert(moe_st_entry *e, int *n, void **data) {
    ((float *)data[find(e, *n, "model.layers.0.block_sparse_moe.experts.2.w1.weight")])[33] =
        -INFINITY;
}

static void norm_as_i32(moe_st_entry *e, int *n, void **data) {
    e[find(e, *n, "model.norm.weight")].dtype = MOE_ST_I32;
}

static void extra_tensor(moe_st_entry *e, int *n, void **data) {
    int i = find(e, *n, "model.norm.weight");
    e[*n] = e[i];
    e[*n].name = "model.layers.0.block_sparse_moe.experts.4.w9.weight";
    (*n)++;
}

static void expect(int rc, int code, const char *word) {
    ck_assert_msg(rc == code, "rc %d, want %d: %s", rc, code, moe_last_error());
    ck_assert_msg(strstr(moe_last_error(), word), "message '%s' lacks '%s'", moe_last_error(),
                  word);
}

// --- 10: non-regular files ---------------------------------------------------------

static void make_fifo(const char *path) {
    unlink(path);
    ck_assert_int_eq(mkfifo(path, 0644), 0);
}

START_TEST(test_fifo_in_place_of_any_input_is_refused_without_blocking) {
    alarm(HANG_GUARD_S);
    char root[600], ck[700];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
    moe_st_file *f;
    moe_st_set *s;
    // the helper itself: FIFO and folder refused, a regular file opened
    make_fifo(join(root, "fifo"));
    expect(moe_check_regular_file(join(root, "fifo")), MOE_EFORMAT, "fifo: not a regular file");
    expect(moe_check_regular_file(root), MOE_EFORMAT, "not a regular file");
    ck_assert_int_eq(moe_check_regular_file(join(ck, "config.json")), 0);
    // model.safetensors
    char p[1024];
    snprintf(p, sizeof p, "%s", join(ck, "model.safetensors"));
    rename(p, join(root, "model.keep"));
    make_fifo(p);
    expect(moe_st_open(p, &f), MOE_EFORMAT, "model.safetensors: not a regular file");
    expect(moe_st_set_open(ck, &s), MOE_EFORMAT, "not a regular file");
    moe_infer m;
    moe_infer_opts o = {.task = "copy"};
    expect(moe_infer_open(&m, ck, &o), MOE_EFORMAT, "not a regular file");
    expect(moe_export_hf(ck, join(root, "hf")), MOE_EFORMAT, "not a regular file");
    // a shard and the index, assembled by hand (no manifest lists them)
    unlink(p);
    rename(join(ck, "manifest.json"), join(root, "manifest.keep"));
    rename(join(root, "model.keep"), join(ck, "model-00001-of-00001.safetensors"));
    FILE *ix = fopen(join(ck, "model.safetensors.index.json"), "w");
    fprintf(ix, "{\"weight_map\": {\"model.norm.weight\": \"model-00001-of-00001.safetensors\"}}");
    fclose(ix);
    ck_assert_int_eq(moe_st_set_open(ck, &s), 0);
    moe_st_set_close(s);
    rename(join(ck, "model-00001-of-00001.safetensors"), join(root, "model.keep"));
    make_fifo(join(ck, "model-00001-of-00001.safetensors"));
    expect(moe_st_set_open(ck, &s), MOE_EFORMAT, "model-00001-of-00001.safetensors: not a regular");
    unlink(join(ck, "model-00001-of-00001.safetensors"));
    make_fifo(join(ck, "model.safetensors.index.json"));
    expect(moe_st_set_open(ck, &s), MOE_EFORMAT, "index.json: not a regular file");
    unlink(join(ck, "model.safetensors.index.json"));
    rename(join(root, "model.keep"), p);
    rename(join(root, "manifest.keep"), join(ck, "manifest.json"));
    // config.json
    rename(join(ck, "config.json"), join(root, "config.keep"));
    make_fifo(join(ck, "config.json"));
    moe_config cc;
    expect(moe_ckpt_config(ck, &cc), MOE_EFORMAT, "config.json: not a regular file");
    unlink(join(ck, "config.json"));
    rename(join(root, "config.keep"), join(ck, "config.json"));
    // task_experts.json and trainer_state.json
    make_fifo(join(root, "task_experts.json"));
    moe_task_experts te;
    expect(moe_task_experts_read(join(root, "task_experts.json"), &te), MOE_EFORMAT,
           "not a regular file");
    rename(join(ck, "trainer_state.json"), join(root, "state.keep"));
    make_fifo(join(ck, "trainer_state.json"));
    moe_model mm;
    ck_assert_int_eq(moe_model_init(&mm, &c, 2, 16, 5), 0);
    expect(moe_ckpt_load(ck, &mm, NULL, NULL), MOE_EFORMAT,
           "trainer_state.json: not a regular file");
    moe_model_free(&mm);
    unlink(join(ck, "trainer_state.json"));
    rename(join(root, "state.keep"), join(ck, "trainer_state.json"));
    // a data file
    moe_config dc = tu_ckpt_config();
    snprintf(dc.data.kind, sizeof dc.data.kind, "bin");
    snprintf(dc.data.path, sizeof dc.data.path, "%s", join(root, "fifo"));
    moe_data d;
    expect(moe_data_open(&d, &dc), MOE_EFORMAT, "not a regular file");
    // the CLI: generate --input FIFO, eval of a checkpoint whose weights are a FIFO
    char args[2048];
    snprintf(args, sizeof args, "generate '%s' --task copy --input '%s'", ck, join(root, "fifo"));
    ck_assert_int_ne(tu_run_moe(root, args), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), "not a regular file"));
    alarm(0);
}
END_TEST

// --- 4: non-finite weights ---------------------------------------------------------

START_TEST(test_non_finite_weights_are_refused_by_every_loader) {
    char root[600], ck[700], args[2048];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
    rewrite_model(ck, nan_in_norm);
    const char *word = "tensor 'model.layers.1.post_attention_layernorm.weight' has a non-finite "
                       "value at element 7 [7]";
    moe_model m;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
    expect(moe_ckpt_load(ck, &m, NULL, NULL), MOE_EFORMAT, word);
    moe_model_free(&m);
    moe_infer inf;
    moe_infer_opts o = {.task = "copy"};
    expect(moe_infer_open(&inf, ck, &o), MOE_EFORMAT, word);
    expect(moe_export_hf(ck, join(root, "hf")), MOE_EFORMAT, word);
    snprintf(args, sizeof args, "eval '%s' --batches 1 --samples 0", ck);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), word));
    ck_assert_ptr_null(strstr(tu_file_text(root, "out.txt"), "loss"));
    snprintf(args, sizeof args, "generate '%s' --task copy --prompt abc", ck);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), word));
    // an expert weight, -Inf, in a fresh checkpoint (training resume reads it the same way)
    tu_save_checkpoint(&c, ck);
    rewrite_model(ck, inf_in_expert);
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
    expect(moe_ckpt_load(ck, &m, NULL, NULL), MOE_EFORMAT,
           "'model.layers.0.block_sparse_moe.experts.2.w1.weight' has a non-finite value at "
           "element 33 [1, 1]");
    moe_model_free(&m);
}
END_TEST

START_TEST(test_swiglu_carries_nan_and_inf_without_undefined_behaviour) {
    // a: NaN, +Inf, -Inf, a huge and a tiny value; b = 1. Under UBSan the old
    // exp_clamped overflowed a signed multiply on NaN and aborted here.
    enum { H = 5 };
    float ab[2 * H] = {NAN, INFINITY, -INFINITY, 1e30f, -1e30f, 1, 1, 1, 1, 1};
    float h[H], dh[H] = {1, 1, 1, 1, 1}, dab[2 * H] = {0};
    ck_assert_int_eq(moe_cpu_swiglu_forward(h, ab, 1, H), 0);
    ck_assert(isnan(h[0]));
    ck_assert(h[3] == 1e30f);              // silu(x) = x for large x
    ck_assert(fabsf(h[4]) < 1e-6f);        // and about 0 for very negative x
    ck_assert(isinf(h[1]) || isnan(h[1])); // inf / (1 + e^-88)
    ck_assert_int_eq(moe_cpu_swiglu_backward(dab, dh, ab, 1, H), 0);
    ck_assert(isnan(dab[0]) && isnan(dab[H]));
}
END_TEST

// --- 7: expert-parallel checkpoints in one process ---------------------------------

START_TEST(test_expert_parallel_checkpoint_evaluates_and_exports_in_one_process) {
    char root[600], ck[700], args[2048];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
    // rank 0 of an ep = 2 run writes every expert: the files differ only in config.json
    moe_config ep = c;
    ep.parallel.ep = 2;
    write_config(&ep, join(ck, "config.json"));
    moe_config back;
    ck_assert_int_eq(moe_ckpt_config(ck, &back), 0);
    ck_assert_int_eq(back.parallel.ep, 2);
    moe_model m;
    ck_assert_msg(moe_model_init(&m, &back, 2, 16, 5) == 0, "%s", moe_last_error());
    ck_assert_msg(moe_ckpt_load(ck, &m, NULL, NULL) == 0, "%s", moe_last_error());
    moe_model_free(&m);
    ck_assert_msg(moe_export_hf(ck, join(root, "hf")) == 0, "%s", moe_last_error());
    snprintf(args, sizeof args, "eval '%s' --batches 1 --samples 1", ck);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "out.txt"), "validation: loss"));
    snprintf(args, sizeof args, "export '%s' --hf '%s/hf2'", ck, root);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    snprintf(args, sizeof args, "generate '%s' --task copy --prompt abc --max-new 2", ck);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
}
END_TEST

// --- 9: export and generate hold the tensors to config.json ------------------------

START_TEST(test_export_refuses_a_tensor_of_the_wrong_dtype) {
    char root[600], ck[700];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
    rewrite_model(ck, norm_as_i32);
    expect(moe_export_hf(ck, join(root, "hf")), MOE_EFORMAT,
           "tensor 'model.norm.weight' is I32 [32], the config expects F32 [32]");
    ck_assert_int_ne(access(join(root, "hf"), F_OK), 0); // nothing written
}
END_TEST

START_TEST(test_export_and_generate_refuse_tensors_the_config_lacks) {
    char root[600], ck[700], args[2048];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
    rewrite_model(ck, extra_tensor);
    expect(moe_export_hf(ck, join(root, "hf")), MOE_EFORMAT,
           "tensor 'model.layers.0.block_sparse_moe.experts.4.w9.weight' does not belong");
    moe_infer inf;
    moe_infer_opts o = {.task = "copy"};
    expect(moe_infer_open(&inf, ck, &o), MOE_EFORMAT, "experts.4.w9.weight' does not belong");
    // config.json edited to one layer: the weights of layer 1 are extra
    tu_save_checkpoint(&c, ck);
    moe_config one = c;
    one.model.n_layers = 1;
    write_config(&one, join(ck, "config.json"));
    expect(moe_export_hf(ck, join(root, "hf")), MOE_EFORMAT,
           "tensor 'model.layers.1.input_layernorm.weight' does not belong");
    expect(moe_infer_open(&inf, ck, &o), MOE_EFORMAT, "model.layers.1.");
    snprintf(args, sizeof args, "export '%s' --hf '%s/hf'", ck, root);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    snprintf(args, sizeof args, "generate '%s' --task copy --prompt abc", ck);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), "does not belong"));
    ck_assert_int_ne(access(join(root, "hf"), F_OK), 0);
}
END_TEST

static long size_of(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 ? (long)sb.st_size : -1;
}

START_TEST(test_export_never_writes_into_a_checkpoint_folder) {
    char root[600], ck[700], other[700], args[2048];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    snprintf(other, sizeof other, "%s/other", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
    tu_save_checkpoint(&c, other);
    long before = size_of(join(ck, "model.safetensors"));
    const char *cfg_before = strdup(tu_file_text(ck, "config.json"));
    expect(moe_export_hf(ck, ck), MOE_EINVAL, "is the checkpoint");
    char trailing[800];
    snprintf(trailing, sizeof trailing, "%s/", ck);
    expect(moe_export_hf(ck, trailing), MOE_EINVAL, "is the checkpoint");
    expect(moe_export_hf(ck, join(ck, "hf")), MOE_EINVAL, "is inside the checkpoint");
    expect(moe_export_hf(ck, join(ck, "a/b")), MOE_EINVAL, "");
    expect(moe_export_hf(ck, other), MOE_EINVAL, "holds a checkpoint");
    // a run folder: its config.json is not an export's
    char run[800];
    snprintf(run, sizeof run, "%s/run", root);
    mkdir(run, 0755);
    write_config(&c, join(run, "config.json"));
    expect(moe_export_hf(ck, run), MOE_EINVAL, "config.json");
    // the CLI, with the checkpoint as its own destination: exit 2, checkpoint untouched
    snprintf(args, sizeof args, "export '%s' --hf '%s'", ck, ck);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), "is the checkpoint"));
    ck_assert_int_eq(size_of(join(ck, "model.safetensors")), before);
    ck_assert_str_eq(tu_file_text(ck, "config.json"), cfg_before);
    free((void *)cfg_before);
    // a new folder, then the same folder again (a previous export is replaced)
    ck_assert_msg(moe_export_hf(ck, join(root, "hf")) == 0, "%s", moe_last_error());
    ck_assert_msg(moe_export_hf(ck, join(root, "hf")) == 0, "%s", moe_last_error());
}
END_TEST

static Suite *read_guard_suite(void) {
    Suite *s = suite_create("read_guard");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_fifo_in_place_of_any_input_is_refused_without_blocking);
    tcase_add_test(tc, test_non_finite_weights_are_refused_by_every_loader);
    tcase_add_test(tc, test_swiglu_carries_nan_and_inf_without_undefined_behaviour);
    tcase_add_test(tc, test_expert_parallel_checkpoint_evaluates_and_exports_in_one_process);
    tcase_add_test(tc, test_export_refuses_a_tensor_of_the_wrong_dtype);
    tcase_add_test(tc, test_export_and_generate_refuse_tensors_the_config_lacks);
    tcase_add_test(tc, test_export_never_writes_into_a_checkpoint_folder);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(read_guard_suite());
}
