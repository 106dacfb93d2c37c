// The bad-input corpus: a few hundred malformed checkpoints, configs, data
// files and command lines, each run through the real `moe` binary. Every case
// must exit with its code (2 bad input, 1 runtime failure), print exactly one
// line "moe CMD: message" (or "moe: message") on stderr, leave no output behind, and finish (a
// crash shows as a signal's exit status, a hang as timeout's 124).
#include "moe/safetensors.h"
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char W[600];    // the suite's folder: fixtures and one folder per case
static char good[700]; // a valid checkpoint (2 steps, dynamic capacity)
static int n_cases, n_failed;

// The small model of the checkpoint: dynamic capacity so trainer_state.json
// carries per-expert state.
static const char *small =
    "{\"model\": {\"d_model\": 32, \"n_layers\": 2, \"d_ff\": 48, \"seq_len\": 32},\n"
    " \"moe\": {\"num_experts\": 4}, \"capacity\": {\"mode\": \"dynamic\"},\n"
    " \"train\": {\"batch_size\": 4, \"eval_every\": 0, \"steps\": 2}}\n";

static const char *in_w(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static const char *in_w(const char *fmt, ...) {
    static char buf[8][900];
    static int turn;
    char *p = buf[turn++ % 8];
    int n = snprintf(p, sizeof buf[0], "%s/", W);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p + n, sizeof buf[0] - n, fmt, ap);
    va_end(ap);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f != NULL, "cannot write %s", path);
    ck_assert(fwrite(data, 1, n, f) == n);
    ck_assert(fclose(f) == 0);
}

static void write_text(const char *path, const char *text) {
    write_bytes(path, text, strlen(text));
}

static void sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void sh(const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    ck_assert_msg(system(cmd) == 0, "fixture command failed: %s", cmd);
}

static int exists(const char *p) {
    struct stat st;
    return lstat(p, &st) == 0;
}

// Runs `moe ARGS` (a shell word list) in folder dir with a 20 s limit and
// checks the contract. must_not_exist: a path the failed command must not
// create (NULL: none). Failures are counted and printed, not asserted, so one
// run lists every failing case.
static void expect(const char *name, int code, const char *must_not_exist, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void expect(const char *name, int code, const char *must_not_exist, const char *fmt, ...) {
    char args[3000], cmd[4096], why[256] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    const char *bin = getenv("MOE_BIN");
    ck_assert_msg(bin != NULL, "MOE_BIN is not set (run under ctest)");
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout -k 5 20 '%s' %s </dev/null >out.txt 2>err.txt", W,
             bin, args);
    int st = system(cmd), got = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    const char *err = tu_file_text(W, "err.txt");
    size_t len = strlen(err);
    const char *nl = strchr(err, '\n');
    n_cases++;
    if (got == 124 || got == 137)
        snprintf(why, sizeof why, "did not finish in 20 s");
    else if (got > 128)
        snprintf(why, sizeof why, "died of signal %d", got - 128);
    else if (got != code)
        snprintf(why, sizeof why, "exit %d, expected %d", got, code);
    else if (strncmp(err, "moe", 3) || !strstr(err, ": ") || !nl || nl != err + len - 1)
        snprintf(why, sizeof why, "stderr is not one line 'moe CMD: message'");
    else if (must_not_exist && exists(must_not_exist))
        snprintf(why, sizeof why, "left %s behind", must_not_exist);
    if (!why[0]) return;
    n_failed++;
    fprintf(stderr, "FAIL %s: %s\n  moe %s\n  stderr: %.600s\n", name, why, args, err);
}

// --- the valid fixtures -------------------------------------------------------------

static void make_fixtures(void) {
    if (good[0]) return;
    snprintf(W, sizeof W, "%s", tu_tmpdir());
    write_text(in_w("small.json"), small);
    write_text(in_w("plain_file"), "not a folder\n");
    char args[2000];
    snprintf(args, sizeof args, "train '%s' --quiet --out '%s'", in_w("small.json"), in_w("run"));
    ck_assert_int_eq(tu_run_moe(W, args), 0);
    snprintf(good, sizeof good, "%s", in_w("run/checkpoint"));
    ck_assert(exists(in_w("run/checkpoint/model.safetensors")));
}

// A fresh copy of the good checkpoint in W/NAME; returns its path.
static const char *copy_ckpt(const char *name) {
    const char *dst = in_w("%s", name);
    sh("rm -rf '%s' && cp -r '%s' '%s'", dst, good, dst);
    return dst;
}

// --- checkpoint mutations -------------------------------------------------------------

static long file_size(const char *p) {
    struct stat st;
    ck_assert(stat(p, &st) == 0);
    return (long)st.st_size;
}

static void truncate_to(const char *p, long n) {
    ck_assert(truncate(p, n) == 0);
}

static void patch(const char *p, long off, const void *bytes, size_t n) {
    FILE *f = fopen(p, "r+b");
    ck_assert(f && fseek(f, off, SEEK_SET) == 0 && fwrite(bytes, 1, n, f) == n);
    fclose(f);
}

// Header of a safetensors file as JSON, and the data section's bytes.
static json_t *read_header(const char *p, char **data, size_t *n_data) {
    FILE *f = fopen(p, "rb");
    uint64_t hlen;
    ck_assert(f && fread(&hlen, 8, 1, f) == 1);
    char *h = calloc(hlen + 1, 1);
    ck_assert(fread(h, 1, hlen, f) == hlen);
    *n_data = (size_t)(file_size(p) - 8 - (long)hlen);
    *data = malloc(*n_data + 64);
    ck_assert(fread(*data, 1, *n_data, f) == *n_data);
    fclose(f);
    json_t *doc = json_loads(h, 0, NULL);
    ck_assert(doc != NULL);
    free(h);
    return doc;
}

static void write_header(const char *p, json_t *doc, const char *data, size_t n_data) {
    char *h = json_dumps(doc, JSON_COMPACT);
    uint64_t hlen = strlen(h);
    FILE *f = fopen(p, "wb");
    ck_assert(f && fwrite(&hlen, 8, 1, f) == 1 && fwrite(h, 1, hlen, f) == hlen);
    ck_assert(fwrite(data, 1, n_data, f) == n_data && fclose(f) == 0);
    free(h);
}

// Sets field key of tensor name in the header to v (NULL: removes the tensor).
static void edit_tensor(const char *p, const char *name, const char *key, json_t *v) {
    char *data;
    size_t n;
    json_t *doc = read_header(p, &data, &n);
    if (!key)
        json_object_del(doc, name);
    else
        json_object_set_new(json_object_get(doc, name), key, v);
    write_header(p, doc, data, n);
    json_decref(doc);
    free(data);
}

// Overwrites element i of F32 tensor name with x.
static void poke_float(const char *p, const char *name, long i, float x) {
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    const moe_st_tensor *t = moe_st_find(f, name);
    ck_assert_msg(t != NULL, "no tensor %s", name);
    long off = (long)t->offset + 4 * i;
    moe_st_close(f);
    patch(p, off, &x, 4);
}

static const char *NORM = "model.norm.weight", *EMBED = "model.embed_tokens.weight",
                  *EXPERT = "model.layers.0.block_sparse_moe.experts.0.w1.weight";

typedef struct {
    const char *name;
    const char *file; // the checkpoint file it changes
    void (*apply)(const char *path);
} mutation;

static void m_trunc0(const char *p) {
    truncate_to(p, 0);
}
static void m_trunc4(const char *p) {
    truncate_to(p, 4);
}
static void m_trunc8(const char *p) {
    truncate_to(p, 8);
}
static void m_trunc_header(const char *p) {
    uint64_t hlen;
    FILE *f = fopen(p, "rb");
    ck_assert(fread(&hlen, 8, 1, f) == 1);
    fclose(f);
    truncate_to(p, 8 + (long)hlen / 2);
}
static void m_trunc_data(const char *p) {
    truncate_to(p, file_size(p) * 3 / 4);
}
static void m_trunc_last(const char *p) {
    truncate_to(p, file_size(p) - 1);
}
static void m_hlen_huge(const char *p) {
    uint64_t h = UINT64_C(1) << 62;
    patch(p, 0, &h, 8);
}
static void m_hlen_beyond(const char *p) {
    uint64_t h = (uint64_t)file_size(p);
    patch(p, 0, &h, 8);
}
static void m_not_json(const char *p) {
    patch(p, 8, "x", 1);
}
static void m_dtype_unknown(const char *p) {
    edit_tensor(p, NORM, "dtype", json_string("Q4"));
}
static void m_norm_i32(const char *p) {
    edit_tensor(p, NORM, "dtype", json_string("I32"));
}
static void m_embed_bf16(const char *p) {
    edit_tensor(p, EMBED, "dtype", json_string("BF16"));
}
static void m_shape_swapped(const char *p) {
    edit_tensor(p, EMBED, "shape", json_pack("[i, i]", 32, 256));
}
static void m_shape_negative(const char *p) {
    edit_tensor(p, NORM, "shape", json_pack("[i]", -32));
}
static void m_offsets_overlap(const char *p) {
    edit_tensor(p, NORM, "data_offsets", json_pack("[i, i]", 0, 128));
}
static void m_offsets_beyond(const char *p) {
    long n = file_size(p);
    edit_tensor(p, NORM, "data_offsets", json_pack("[I, I]", (json_int_t)n, (json_int_t)n + 128));
}
static void m_offsets_reversed(const char *p) {
    edit_tensor(p, NORM, "data_offsets", json_pack("[i, i]", 128, 0));
}
static void m_missing_tensor(const char *p) {
    edit_tensor(p, NORM, NULL, NULL);
}
static void m_extra_tensor(const char *p) {
    char *data;
    size_t n;
    json_t *doc = read_header(p, &data, &n);
    json_object_set_new(doc, "model.layers.7.mlp.extra.weight",
                        json_pack("{s:s, s:[i], s:[I, I]}", "dtype", "F32", "shape", 4,
                                  "data_offsets", (json_int_t)n, (json_int_t)n + 16));
    memset(data + n, 0, 16);
    write_header(p, doc, data, n + 16);
    json_decref(doc);
    free(data);
}
static void m_nan_norm(const char *p) {
    poke_float(p, NORM, 3, NAN);
}
static void m_inf_embed(const char *p) {
    poke_float(p, EMBED, 100, INFINITY);
}
static void m_nan_expert(const char *p) {
    poke_float(p, EXPERT, 5, -NAN);
}
static void o_negative_second_moment(const char *p) {
    char name[128];
    snprintf(name, sizeof name, "%s.exp_avg_sq", NORM);
    poke_float(p, name, 1, -1.0f);
}
static void m_fifo(const char *p) {
    ck_assert(unlink(p) == 0 && mkfifo(p, 0644) == 0);
}
static void m_dir(const char *p) {
    ck_assert(unlink(p) == 0 && mkdir(p, 0755) == 0);
}
static void m_missing(const char *p) {
    ck_assert(unlink(p) == 0);
}
static void m_garbage(const char *p) {
    write_text(p, "\x01\x02garbage\xff");
}

// JSON files of the checkpoint: set a dotted path to a value.
static void set_json(const char *p, const char *section, const char *key, json_t *v) {
    json_t *doc = json_load_file(p, 0, NULL);
    ck_assert(doc != NULL);
    json_t *obj = section ? json_object_get(doc, section) : doc;
    ck_assert(obj != NULL);
    json_object_set_new(obj, key, v);
    ck_assert(json_dump_file(doc, p, JSON_INDENT(1)) == 0);
    json_decref(doc);
}
static void c_layers1(const char *p) {
    set_json(p, "model", "n_layers", json_integer(1));
}
static void c_layers3(const char *p) {
    set_json(p, "model", "n_layers", json_integer(3));
}
static void c_dmodel(const char *p) {
    set_json(p, "model", "d_model", json_integer(64));
}
static void c_vocab0(const char *p) {
    set_json(p, "model", "vocab_size", json_integer(0));
}
static void c_vocab_big(const char *p) {
    set_json(p, "model", "vocab_size", json_integer(512));
}
static void c_log0(const char *p) {
    set_json(p, "train", "log_every", json_integer(0));
}
static void c_seq_max(const char *p) {
    set_json(p, "model", "seq_len", json_integer(2147483647));
}
static void c_batch_max(const char *p) {
    set_json(p, "train", "batch_size", json_integer(2147483647));
}
static void c_experts3(const char *p) {
    set_json(p, "moe", "num_experts", json_integer(3));
}
static void c_experts_list(const char *p) {
    set_json(p, "moe", "num_experts", json_pack("[i, i, i]", 4, 4, 4));
}
static void c_topk9(const char *p) {
    set_json(p, "router", "top_k", json_integer(9));
}
static void c_unknown(const char *p) {
    set_json(p, "model", "n_layerz", json_integer(2));
}
static void c_type(const char *p) {
    set_json(p, "model", "d_ff", json_string("48"));
}
static void c_heads(const char *p) {
    set_json(p, "model", "n_heads", json_integer(3));
}
static void c_truncated(const char *p) {
    truncate_to(p, file_size(p) / 2);
}
static void c_not_object(const char *p) {
    write_text(p, "[1, 2, 3]\n");
}
static void c_empty(const char *p) {
    truncate_to(p, 0);
}
static void s_cap_neg(const char *p) {
    json_t *doc = json_load_file(p, 0, NULL);
    json_array_set_new(
        json_object_get(json_array_get(json_object_get(doc, "capacity"), 0), "capacity"), 0,
        json_integer(-5));
    ck_assert(json_dump_file(doc, p, 0) == 0);
    json_decref(doc);
}
// Layer 0's field key, element 0 (or the whole field when whole) set to v.
static void state_cap(const char *p, const char *key, int whole, json_t *v) {
    json_t *doc = json_load_file(p, 0, NULL);
    ck_assert(doc != NULL);
    json_t *l0 = json_array_get(json_object_get(doc, "capacity"), 0);
    ck_assert(l0 != NULL);
    if (whole)
        json_object_set_new(l0, key, v);
    else
        json_array_set_new(json_object_get(l0, key), 0, v);
    ck_assert(json_dump_file(doc, p, 0) == 0);
    json_decref(doc);
}
static void s_cap0(const char *p) {
    state_cap(p, "capacity", 0, json_integer(0));
}
static void s_cap_huge(const char *p) {
    state_cap(p, "capacity", 0, json_integer((json_int_t)1 << 40));
}
static void s_cap_str(const char *p) {
    state_cap(p, "capacity", 0, json_string("8"));
}
static void s_ema_neg(const char *p) {
    state_cap(p, "ema", 0, json_real(-3.0));
}
static void s_ema_huge(const char *p) {
    state_cap(p, "ema", 0, json_real(1e300));
}
static void s_ema_str(const char *p) {
    state_cap(p, "ema", 0, json_string("nan"));
}
static void s_layer(const char *p) {
    state_cap(p, "layer", 1, json_integer(7));
}
static void s_steps_neg(const char *p) {
    state_cap(p, "steps", 1, json_integer(-1));
}
static void s_seeded(const char *p) {
    state_cap(p, "seeded", 1, json_string("yes"));
}
static void s_short(const char *p) {
    state_cap(p, "capacity", 1, json_pack("[i]", 8));
}
static void s_step_neg(const char *p) {
    set_json(p, NULL, "step", json_integer(-4));
}
static void s_step_huge(const char *p) { // beyond train.steps' largest value
    set_json(p, NULL, "step", json_integer(1000000001));
}
static void s_step_str(const char *p) {
    set_json(p, NULL, "step", json_string("2"));
}
static void s_cursor(const char *p) {
    set_json(p, NULL, "data_cursor", json_pack("[i]", 3));
}
static void s_cursor_neg(const char *p) {
    set_json(p, NULL, "data_cursor", json_pack("[i, i]", -1, 0));
}
static void t_bad_json(const char *p) {
    write_text(p, "{\"layers\": [\n");
}
static void t_wrong_kind(const char *p) {
    write_text(p, "{\"layers\": 5}\n");
}

static const mutation model_mutations[] = {
    {"trunc0", "model.safetensors", m_trunc0},
    {"trunc4", "model.safetensors", m_trunc4},
    {"trunc8", "model.safetensors", m_trunc8},
    {"trunc_header", "model.safetensors", m_trunc_header},
    {"trunc_data", "model.safetensors", m_trunc_data},
    {"trunc_last_byte", "model.safetensors", m_trunc_last},
    {"header_len_huge", "model.safetensors", m_hlen_huge},
    {"header_len_beyond", "model.safetensors", m_hlen_beyond},
    {"header_not_json", "model.safetensors", m_not_json},
    {"dtype_unknown", "model.safetensors", m_dtype_unknown},
    {"norm_as_i32", "model.safetensors", m_norm_i32},
    {"embed_as_bf16", "model.safetensors", m_embed_bf16},
    {"shape_swapped", "model.safetensors", m_shape_swapped},
    {"shape_negative", "model.safetensors", m_shape_negative},
    {"offsets_overlap", "model.safetensors", m_offsets_overlap},
    {"offsets_beyond", "model.safetensors", m_offsets_beyond},
    {"offsets_reversed", "model.safetensors", m_offsets_reversed},
    {"tensor_missing", "model.safetensors", m_missing_tensor},
    {"tensor_extra", "model.safetensors", m_extra_tensor},
    {"nan_in_norm", "model.safetensors", m_nan_norm},
    {"inf_in_embedding", "model.safetensors", m_inf_embed},
    {"nan_in_expert", "model.safetensors", m_nan_expert},
    {"model_fifo", "model.safetensors", m_fifo},
    {"model_is_dir", "model.safetensors", m_dir},
    {"model_missing", "model.safetensors", m_missing},
    {"model_garbage", "model.safetensors", m_garbage},
    {"config_fewer_layers", "config.json", c_layers1},
    {"config_more_layers", "config.json", c_layers3},
    {"config_d_model", "config.json", c_dmodel},
    {"config_vocab0", "config.json", c_vocab0},
    {"config_vocab_other", "config.json", c_vocab_big},
    {"config_log_every0", "config.json", c_log0},
    {"config_seq_len_max", "config.json", c_seq_max},
    {"config_batch_max", "config.json", c_batch_max},
    {"config_experts3", "config.json", c_experts3},
    {"config_experts_list", "config.json", c_experts_list},
    {"config_top_k9", "config.json", c_topk9},
    {"config_unknown_key", "config.json", c_unknown},
    {"config_type", "config.json", c_type},
    {"config_heads", "config.json", c_heads},
    {"config_truncated", "config.json", c_truncated},
    {"config_not_object", "config.json", c_not_object},
    {"config_empty", "config.json", c_empty},
    {"config_fifo", "config.json", m_fifo},
    {"config_missing", "config.json", m_missing},
    {"config_is_dir", "config.json", m_dir},
};

// trainer_state.json: read by everything that loads the model state.
static const mutation state_mutations[] = {
    {"state_capacity_negative", "trainer_state.json", s_cap_neg},
    {"state_capacity_zero", "trainer_state.json", s_cap0},
    {"state_capacity_2p40", "trainer_state.json", s_cap_huge},
    {"state_capacity_string", "trainer_state.json", s_cap_str},
    {"state_ema_negative", "trainer_state.json", s_ema_neg},
    {"state_ema_huge", "trainer_state.json", s_ema_huge},
    {"state_ema_string", "trainer_state.json", s_ema_str},
    {"state_wrong_layer", "trainer_state.json", s_layer},
    {"state_steps_negative", "trainer_state.json", s_steps_neg},
    {"state_seeded_string", "trainer_state.json", s_seeded},
    {"state_capacity_short", "trainer_state.json", s_short},
    {"state_step_negative", "trainer_state.json", s_step_neg},
    {"state_step_string", "trainer_state.json", s_step_str},
    {"state_step_huge", "trainer_state.json", s_step_huge},
    {"state_cursor_short", "trainer_state.json", s_cursor},
    {"state_cursor_negative", "trainer_state.json", s_cursor_neg},
    {"state_truncated", "trainer_state.json", c_truncated},
    {"state_fifo", "trainer_state.json", m_fifo},
    {"state_missing", "trainer_state.json", m_missing},
    {"optimizer_truncated", "optimizer.safetensors", m_trunc_data},
    {"optimizer_header_not_json", "optimizer.safetensors", m_not_json},
    {"optimizer_missing", "optimizer.safetensors", m_missing},
    {"optimizer_fifo", "optimizer.safetensors", m_fifo},
    {"optimizer_negative_second_moment", "optimizer.safetensors", o_negative_second_moment},
};

static const mutation task_expert_mutations[] = {
    {"task_experts_bad_json", "task_experts.json", t_bad_json},
    {"task_experts_wrong_kind", "task_experts.json", t_wrong_kind},
    {"task_experts_fifo", "task_experts.json", m_fifo},
    {"task_experts_is_dir", "task_experts.json", m_dir},
};

static const char *prepare(const mutation *m) {
    const char *dir = copy_ckpt(m->name);
    char p[1000];
    snprintf(p, sizeof p, "%s/%s", dir, m->file);
    m->apply(p);
    return dir;
}

// Every command that reads a checkpoint refuses the broken one with exit 2.
static void readers_refuse(const mutation *m, int eval, int generate, int export, int resume) {
    const char *dir = prepare(m);
    char name[200], out[900];
    if (eval) {
        snprintf(name, sizeof name, "eval/%s", m->name);
        expect(name, 2, NULL, "eval '%s' --batches 1", dir);
    }
    if (generate) {
        snprintf(name, sizeof name, "generate/%s", m->name);
        expect(name, 2, NULL, "generate '%s' --task copy --prompt abcd --max-new 4", dir);
    }
    if (export) {
        snprintf(name, sizeof name, "export/%s", m->name);
        snprintf(out, sizeof out, "%s", in_w("hf_%s", m->name));
        expect(name, 2, out, "export '%s' --hf '%s'", dir, out);
    }
    if (resume) {
        snprintf(name, sizeof name, "resume/%s", m->name);
        snprintf(out, sizeof out, "%s", in_w("resumed_%s/checkpoint", m->name));
        expect(name, 2, out, "train '%s' --resume '%s' --steps 3 --quiet --out '%s'",
               in_w("small.json"), dir, in_w("resumed_%s", m->name));
    }
}

START_TEST(test_broken_checkpoints_are_refused_by_every_reader) {
    make_fixtures();
    n_cases = n_failed = 0;
    for (size_t i = 0; i < sizeof model_mutations / sizeof *model_mutations; i++)
        // train --resume takes the model from its CONFIG argument, not from
        // the checkpoint's config.json: those mutations concern the readers.
        readers_refuse(&model_mutations[i], 1, 1, 1,
                       strcmp(model_mutations[i].file, "config.json") != 0);
    for (size_t i = 0; i < sizeof state_mutations / sizeof *state_mutations; i++) {
        int state = strstr(state_mutations[i].name, "state_") == state_mutations[i].name;
        readers_refuse(&state_mutations[i], state, 0, 0, 1);
    }
    for (size_t i = 0; i < sizeof task_expert_mutations / sizeof *task_expert_mutations; i++)
        readers_refuse(&task_expert_mutations[i], 0, 1, 0, 0);
    fprintf(stderr, "checkpoints: %d cases, %d failed\n", n_cases, n_failed);
    ck_assert_int_eq(n_failed, 0);
}
END_TEST

// --- configs ---------------------------------------------------------------------------

typedef struct {
    const char *name;
    const char *json; // the file (NULL: small.json)
    const char *sets; // --set words
} config_case;

static const config_case config_cases[] = {
    {"log_every_0", NULL, "--set train.log_every=0"},
    {"log_every_negative", NULL, "--set train.log_every=-3"},
    {"eval_every_negative", NULL, "--set train.eval_every=-1"},
    {"ckpt_every_negative", NULL, "--set train.ckpt_every=-1"},
    {"steps_0", NULL, "--set train.steps=0"},
    {"batch_0", NULL, "--set train.batch_size=0"},
    {"batch_max", NULL, "--set train.batch_size=2147483647"},
    {"seq_len_max", NULL, "--set model.seq_len=2147483647"},
    {"seq_len_big_product", NULL, "--set model.seq_len=1000000 --set train.batch_size=100000"},
    {"seq_len_overflow", NULL, "--set model.seq_len=2147483648"},
    {"seq_len_before_any_answer", NULL, "--set model.seq_len=5"},
    {"moe_every_beyond_layers", NULL, "--set moe.every=9"},
    {"synthetic_without_tasks", NULL, "--set data.tasks=[]"},
    {"vocab_0", NULL, "--set model.vocab_size=0"},
    {"vocab_huge", NULL, "--set model.vocab_size=2000000000"},
    {"d_model_odd_head", NULL, "--set model.d_model=36"},
    {"heads_0", NULL, "--set model.n_heads=0"},
    {"kv_heads_not_divisor", NULL, "--set model.n_kv_heads=3"},
    {"d_ff_negative", NULL, "--set model.d_ff=-48"},
    {"d_expert_negative", NULL, "--set moe.d_expert=-1"},
    {"experts_0", NULL, "--set moe.num_experts=0"},
    {"experts_empty_item", NULL, "--set moe.num_experts=[4,,8]"},
    {"experts_trailing_comma", NULL, "--set moe.num_experts=[4,]"},
    {"tasks_empty_item", NULL, "--set data.tasks=[copy,,sort]"},
    {"tasks_unknown", NULL, "--set data.tasks=[copy,fly]"},
    {"top_k_0", NULL, "--set router.top_k=0"},
    {"top_k_too_big", NULL, "--set router.top_k=5"},
    {"min_capacity_negative", NULL, "--set router.min_capacity=-1"},
    {"update_every_0", NULL, "--set capacity.update_every=0"},
    {"ema_1", NULL, "--set capacity.ema=1.5"},
    {"capacity_factor_nan", NULL, "--set router.capacity_factor=nan"},
    {"capacity_factor_inf", NULL, "--set router.capacity_factor=inf"},
    {"lr_nan", NULL, "--set train.lr=nan"},
    {"lr_negative", NULL, "--set train.lr=-1"},
    {"noise_eps_nan", NULL, "--set router.noise_eps=nan"},
    {"mini_seq_0", NULL, "--set memory.mini_seq=0"},
    {"ranks_per_node_negative", NULL, "--set comm.ranks_per_node=-2"},
    {"warmup_negative", NULL, "--set train.warmup_steps=-5"},
    {"grad_accum_0", NULL, "--set train.grad_accum=0"},
    {"ep_not_divisor", NULL, "--set parallel.ep=3"},
    {"task_priority_50_long", NULL,
     "--set router.task_priority=[1.00000000000000000001,2.00000000000000000002,"
     "3.00000000000000000003,4.00000000000000000004,5.00000000000000000005,"
     "6.00000000000000000006,7.00000000000000000007,8.00000000000000000008,"
     "9.00000000000000000009,10.0000000000000000001,11.0000000000000000001,"
     "12.0000000000000000001,13.0000000000000000001,14.0000000000000000001,"
     "15.0000000000000000001,16.0000000000000000001,17.0000000000000000001,"
     "18.0000000000000000001,19.0000000000000000001,20.0000000000000000001,"
     "21.0000000000000000001,22.0000000000000000001,23.0000000000000000001,"
     "24.0000000000000000001,25.0000000000000000001,26.0000000000000000001,"
     "27.0000000000000000001,28.0000000000000000001,29.0000000000000000001,"
     "30.0000000000000000001,31.0000000000000000001,32.0000000000000000001,"
     "33.0000000000000000001,34.0000000000000000001,35.0000000000000000001,"
     "36.0000000000000000001,37.0000000000000000001,38.0000000000000000001,"
     "39.0000000000000000001,40.0000000000000000001,41.0000000000000000001,"
     "42.0000000000000000001,43.0000000000000000001,44.0000000000000000001,"
     "45.0000000000000000001,46.0000000000000000001,47.0000000000000000001,"
     "48.0000000000000000001,49.0000000000000000001,50.0000000000000000001]"},
    {"unknown_key", NULL, "--set model.n_layerz=3"},
    {"set_without_value", NULL, "--set model.n_layers"},
    {"bool_junk", NULL, "--set model.tie_embeddings=yes"},
    {"enum_junk", NULL, "--set router.slot_order=random"},
    {"int_junk", NULL, "--set model.n_layers=4x"},
    {"recompute_without_chunks", NULL, "--set memory.recompute=moe"},
    {"file_malformed", "{\"model\": {\"d_model\": 32,}\n", ""},
    {"file_truncated", "{\"model\": {\"d_model\": 3", ""},
    {"file_empty", "", ""},
    {"file_not_object", "[]\n", ""},
    {"file_unknown_section", "{\"modle\": {}}\n", ""},
    {"file_section_not_object", "{\"model\": 5}\n", ""},
    {"file_type_error", "{\"model\": {\"d_model\": \"32\"}}\n", ""},
    {"file_float_for_int", "{\"model\": {\"d_model\": 32.5}}\n", ""},
    {"file_duplicate_key", "{\"model\": {\"d_model\": 32, \"d_model\": 64}}\n", ""},
    {"file_log_every_0", "{\"train\": {\"log_every\": 0}}\n", ""},
    {"file_empty_list_item", "{\"data\": {\"tasks\": [\"copy\", \"\", \"sort\"]}}\n", ""},
    {"file_int_overflow", "{\"model\": {\"n_layers\": 99999999999999999999}}\n", ""},
    {"file_nul_byte", "{\"model\": {\"d_model\": 32}}\n\0", ""},
    {"file_deep_nesting", "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", ""},
    {"file_long_key",
     "{\"model\": "
     "{\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
     "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
     "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
     "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\": 1}}\n",
     ""},
};

// Every config case through train (no run folder may appear), plan and ablate.
START_TEST(test_bad_configs_are_refused_before_anything_is_written) {
    make_fixtures();
    n_cases = n_failed = 0;
    for (size_t i = 0; i < sizeof config_cases / sizeof *config_cases; i++) {
        const config_case *c = &config_cases[i];
        const char *cfg = in_w("small.json");
        char path[900], name[200], out[900];
        if (c->json) {
            snprintf(path, sizeof path, "%s", in_w("cfg_%s.json", c->name));
            write_bytes(path, c->json, strlen(c->json) + !strcmp(c->name, "file_nul_byte"));
            cfg = path;
        }
        snprintf(name, sizeof name, "train/%s", c->name);
        snprintf(out, sizeof out, "%s", in_w("run_%s", c->name));
        expect(name, 2, out, "train '%s' %s --quiet --out '%s'", cfg, c->sets, out);
        snprintf(name, sizeof name, "dry-run/%s", c->name);
        expect(name, 2, NULL, "train '%s' %s --dry-run", cfg, c->sets);
        snprintf(name, sizeof name, "plan/%s", c->name);
        expect(name, 2, NULL, "plan '%s' %s", cfg, c->sets);
        snprintf(name, sizeof name, "ablate/%s", c->name);
        snprintf(out, sizeof out, "%s", in_w("ablate_%s", c->name));
        expect(name, 2, out, "ablate '%s' %s --grid router.top_k=1,2 --steps 2 --out '%s'", cfg,
               c->sets, out);
    }
    // The config file itself is not a readable JSON file.
    ck_assert(mkfifo(in_w("fifo.json"), 0644) == 0);
    ck_assert(mkdir(in_w("dir.json"), 0755) == 0);
    const char *files[] = {"fifo.json", "dir.json", "missing.json"};
    for (int i = 0; i < 3; i++) {
        char name[100];
        snprintf(name, sizeof name, "train/%s", files[i]);
        expect(name, 2, in_w("run_%s", files[i]), "train '%s' --quiet --out '%s'",
               in_w("%s", files[i]), in_w("run_%s", files[i]));
        snprintf(name, sizeof name, "plan/%s", files[i]);
        expect(name, 2, NULL, "plan '%s'", in_w("%s", files[i]));
    }
    fprintf(stderr, "configs: %d cases, %d failed\n", n_cases, n_failed);
    ck_assert_int_eq(n_failed, 0);
}
END_TEST

// --- data files ------------------------------------------------------------------------

// An llm.c token file: header fields (magic, version, count), then n tokens.
static void write_bin(const char *path, int32_t magic, int32_t version, int32_t count, long n,
                      uint16_t token) {
    int32_t hdr[256] = {magic, version, count};
    uint16_t *tok = malloc(sizeof *tok * (size_t)(n + 1));
    for (long i = 0; i < n; i++)
        tok[i] = (uint16_t)(i % 200);
    if (n > 0) tok[n / 2] = token;
    FILE *f = fopen(path, "wb");
    ck_assert(f && fwrite(hdr, sizeof hdr, 1, f) == 1);
    ck_assert(fwrite(tok, sizeof *tok, (size_t)n, f) == (size_t)n && fclose(f) == 0);
    free(tok);
}

START_TEST(test_bad_data_files_are_refused) {
    make_fixtures();
    n_cases = n_failed = 0;
    const int32_t M = 20240520;
    struct {
        const char *name;
        int32_t magic, version, count;
        long n;
        uint16_t token;
    } bins[] = {
        {"bad_magic", 1234, 1, 4000, 4000, 5},
        {"bad_version", M, 7, 4000, 4000, 5},
        {"count_beyond_file", M, 1, 9000, 4000, 5},
        {"count_negative", M, 1, -1, 4000, 5},
        {"count_zero", M, 1, 0, 0, 5},
        {"too_few_tokens", M, 1, 10, 10, 5},
        {"token_beyond_vocab", M, 1, 4000, 4000, 300},
        {"version_3", M, 3, 4000, 4000, 5},
        {"v2_count_of_uint16_file", M, 2, 4000, 4000, 5},
    };
    for (size_t i = 0; i < sizeof bins / sizeof *bins; i++) {
        char path[900], name[200], out[900];
        snprintf(path, sizeof path, "%s", in_w("%s.bin", bins[i].name));
        write_bin(path, bins[i].magic, bins[i].version, bins[i].count, bins[i].n, bins[i].token);
        snprintf(name, sizeof name, "data/%s", bins[i].name);
        snprintf(out, sizeof out, "%s", in_w("run_data_%s", bins[i].name));
        expect(name, 2, out,
               "train '%s' --set data.kind=bin --set data.path='%s' --quiet --out '%s'",
               in_w("small.json"), path, out);
    }
    write_bytes(in_w("short_header.bin"), "\x28\xd6\x34\x01", 4);
    write_text(in_w("empty.txt"), "");
    write_text(in_w("tiny.txt"), "abc");
    ck_assert(mkfifo(in_w("fifo.bin"), 0644) == 0);
    ck_assert(mkdir(in_w("dir.bin"), 0755) == 0);
    struct {
        const char *name, *kind, *file;
    } files[] = {
        {"short_header", "bin", "short_header.bin"},
        {"fifo_bin", "bin", "fifo.bin"},
        {"dir_bin", "bin", "dir.bin"},
        {"missing_bin", "bin", "missing.bin"},
        {"empty_text", "text", "empty.txt"},
        {"tiny_text", "text", "tiny.txt"},
        {"fifo_text", "text", "fifo.bin"},
        {"dir_text", "text", "dir.bin"},
        {"no_path", "bin", ""},
        {"empty_llmc", "llmc", "empty.txt"},
        {"empty_nanogpt", "nanogpt", "empty.txt"},
        {"odd_nanogpt", "nanogpt", "tiny.txt"},
        {"glob_no_match", "llmc", "nothing_*.bin"},
    };
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        char name[200], out[900];
        snprintf(name, sizeof name, "data/%s", files[i].name);
        snprintf(out, sizeof out, "%s", in_w("run_data_%s", files[i].name));
        const char *path = files[i].file[0] ? in_w("%s", files[i].file) : "";
        expect(name, 2, out,
               "train '%s' --set data.kind=%s --set data.path='%s' --quiet --out '%s'",
               in_w("small.json"), files[i].kind, path, out);
    }
    fprintf(stderr, "data: %d cases, %d failed\n", n_cases, n_failed);
    ck_assert_int_eq(n_failed, 0);
}
END_TEST

// --- command lines ---------------------------------------------------------------------

START_TEST(test_bad_command_lines_are_refused) {
    make_fixtures();
    n_cases = n_failed = 0;
    const char *cfg = in_w("small.json");
    char ck[800], out[900], prompts[900];
    snprintf(ck, sizeof ck, "%s", good);
    snprintf(out, sizeof out, "%s", in_w("cli_out"));
    snprintf(prompts, sizeof prompts, "%s", in_w("nul_prompts.txt"));
    write_bytes(prompts, "abcd\nab\0cd\n", 11);
    // logits for route: a NaN among them, and a valid file
    float lg[8 * 4];
    for (int i = 0; i < 32; i++)
        lg[i] = (float)(i % 7) * 0.25f;
    moe_st_entry e = {"logits", MOE_ST_F32, 2, {8, 4}, lg};
    ck_assert_int_eq(moe_st_write(in_w("logits.safetensors"), &e, 1, NULL), 0);
    lg[5] = NAN;
    ck_assert_int_eq(moe_st_write(in_w("nan_logits.safetensors"), &e, 1, NULL), 0);
    struct {
        const char *name;
        int code;
        const char *args;
    } cases[] = {
        {"no_command", 2, ""},
        {"unknown_command", 2, "trian"},
        {"train_no_config", 2, "train"},
        {"train_two_configs", 2, "train @cfg @cfg --out @out"},
        {"train_unknown_option", 2, "train @cfg --stepz 3 --out @out"},
        {"train_steps_junk", 2, "train @cfg --steps 3x --out @out"},
        {"train_steps_negative", 2, "train @cfg --steps -3 --out @out"},
        {"train_steps_missing_value", 2, "train @cfg --out @out --steps"},
        {"train_device_junk", 2, "train @cfg --device tpu --out @out"},
        {"train_resume_missing", 2, "train @cfg --resume @ck/nothing --out @out"},
        {"train_out_is_file", 2, "train @cfg --quiet --out @w/plain_file"},
        {"eval_two_folders", 2, "eval @ck @ck"},
        {"eval_no_folder", 2, "eval"},
        {"eval_batches_0", 2, "eval @ck --batches 0"},
        {"eval_batches_junk", 2, "eval @ck --batches many"},
        {"eval_budget_nan", 2, "eval @ck --expert-budget nan"},
        {"eval_quantize_junk", 2, "eval @ck --quantize int3"},
        {"eval_unknown_option", 2, "eval @ck --fast"},
        {"eval_missing_folder", 2, "eval @ck/nothing"},
        {"eval_file_as_folder", 2, "eval @cfg"},
        {"generate_no_task", 2, "generate @ck --prompt abcd"},
        {"generate_unknown_task", 2, "generate @ck --task fly --prompt abcd"},
        {"generate_no_prompt", 2, "generate @ck --task copy"},
        {"generate_input_dir", 2, "generate @ck --task copy --input @ck"},
        {"generate_input_missing", 2, "generate @ck --task copy --input @ck/none.txt"},
        {"generate_input_dev_zero", 2, "generate @ck --task copy --input /dev/zero"},
        {"generate_input_nul", 2, "generate @ck --task copy --input @prompts"},
        {"generate_temperature_nan", 2, "generate @ck --task copy --prompt ab --temperature nan"},
        {"generate_temperature_neg", 2, "generate @ck --task copy --prompt ab --temperature -1"},
        {"generate_max_new_neg", 2, "generate @ck --task copy --prompt ab --max-new -1"},
        {"generate_top_k_junk", 2, "generate @ck --task copy --prompt ab --top-k x"},
        {"generate_two_folders", 2, "generate @ck @ck --task copy --prompt ab"},
        {"export_no_hf", 2, "export @ck"},
        {"export_into_itself", 2, "export @ck --hf @ck"},
        {"export_into_parent_run", 2, "export @ck --hf @ck/.."},
        {"export_two_folders", 2, "export @ck @ck --hf @out"},
        {"plan_latency_nan", 2, "plan @cfg --latency-us nan"},
        {"plan_latency_negative", 2, "plan @cfg --latency-us -1,2"},
        {"plan_link_zero", 2, "plan @cfg --link-gbps 0,0"},
        {"plan_link_inf", 2, "plan @cfg --link-gbps inf,100"},
        {"plan_nodes_0", 2, "plan @cfg --nodes 0"},
        {"plan_ranks_junk", 2, "plan @cfg --ranks-per-node x"},
        {"plan_nodes_huge", 2, "plan @cfg --nodes 99999999999"},
        {"route_no_logits", 2, "route --out @out"},
        {"route_missing_logits", 2, "route --logits @ck/none.safetensors --out @out"},
        {"route_nan_logits", 2, "route --logits @w/nan_logits.safetensors --out @out"},
        {"route_logits_is_checkpoint", 2, "route --logits @ck/model.safetensors --out @out"},
        {"route_bad_set", 2,
         "route --logits @w/logits.safetensors --set router.top_k=9 --out @out"},
        {"route_unknown_key", 2,
         "route --logits @w/logits.safetensors --set model.d_model=3 --out @out"},
        {"route_example_bad_set", 2, "route --example --set router.top_k=0 --out @out"},
        {"route_out_in_missing_dir", 1, "route --logits @w/logits.safetensors --out @w/no/dir/p"},
        {"ablate_no_grid", 2, "ablate @cfg --out @out"},
        {"ablate_grid_unknown_key", 2, "ablate @cfg --grid model.n_layerz=1,2 --out @out"},
        {"ablate_grid_empty_value", 2, "ablate @cfg --grid router.top_k=1,,2 --out @out"},
        {"ablate_grid_bad_value", 2, "ablate @cfg --grid router.top_k=1,9 --steps 2 --out @out"},
        {"ablate_out_is_file", 2,
         "ablate @cfg --grid router.top_k=1,2 --steps 2 --out @w/plain_file"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        // expand @cfg @ck @out @prompts @w
        char args[3000] = "";
        size_t n = 0;
        for (const char *a = cases[i].args; *a && n < sizeof args - 1000;) {
            const char *sub = NULL;
            int skip = 0;
            if (!strncmp(a, "@cfg", 4)) sub = cfg, skip = 4;
            if (!strncmp(a, "@ck", 3)) sub = ck, skip = 3;
            if (!strncmp(a, "@out", 4)) sub = out, skip = 4;
            if (!strncmp(a, "@prompts", 8)) sub = prompts, skip = 8;
            if (!strncmp(a, "@w", 2) && !sub) sub = W, skip = 2;
            if (sub) {
                n += (size_t)snprintf(args + n, sizeof args - n, "%s", sub);
                a += skip;
            } else {
                args[n++] = *a++;
                args[n] = 0;
            }
        }
        char name[200];
        snprintf(name, sizeof name, "cli/%s", cases[i].name);
        sh("rm -rf '%s'", out);
        expect(name, cases[i].code, out, "%s", args);
    }
    fprintf(stderr, "command lines: %d cases, %d failed\n", n_cases, n_failed);
    ck_assert_int_eq(n_failed, 0);
}
END_TEST

int main(void) {
    Suite *s = suite_create("bad_inputs");
    // One case per kind of input: CK_RUN_CASE=configs runs one of them.
    const char *names[] = {"checkpoints", "configs", "data", "cli"};
    const TTest *tests[] = {test_broken_checkpoints_are_refused_by_every_reader,
                            test_bad_configs_are_refused_before_anything_is_written,
                            test_bad_data_files_are_refused, test_bad_command_lines_are_refused};
    for (int i = 0; i < 4; i++) {
        TCase *tc = tcase_create(names[i]);
        tcase_set_timeout(tc, 1200);
        tcase_add_test(tc, tests[i]);
        suite_add_tcase(s, tc);
    }
    return tu_run(s);
}
