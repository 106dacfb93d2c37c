// Task-routed inference: a partial load reads exactly the headers and the
// tensors the task needs (single file and shards), generates the same tokens
// and logits bit for bit as a full load, the KV-cache decode matches the
// training forward, and bad checkpoints or tasks fail with clear errors.
#include "kernels/cpu/nn.h"
#include "moe/checkpoint.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/infer.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"
#include "testutil.h"

#include <jansson.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char root[600], ckpt[700];

static moe_config small(void) {
    moe_config c;
    moe_config_default(&c);
    c.model.d_model = 32;
    c.model.n_layers = 3;
    c.model.n_heads = 4;
    c.model.n_kv_heads = 2;
    c.model.d_ff = 48;
    c.model.seq_len = 32;
    c.moe.n_num_experts = 1;
    c.moe.num_experts[0] = 8;
    c.moe.every = 1;
    c.moe.n_task_layers = 2;
    c.moe.task_layers[0] = 1;
    c.moe.task_layers[1] = 2;
    c.router.top_k = 2;
    c.router.capacity_factor = 0;
    c.train.batch_size = 4;
    c.train.seed = 7;
    return c;
}

// A checkpoint of freshly initialised weights with measured task shares.
static void make_ckpt(const moe_config *c, const char *dir) {
    moe_data d;
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_data_open(&d, c), 0);
    ck_assert_int_eq(moe_model_init(&m, c, d.B, d.T, d.n_tasks), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    ck_assert_int_eq(moe_task_share_measure(&m, &d, 2), 0);
    moe_train_state st = {0};
    ck_assert_int_eq(moe_ckpt_save(dir, &m, &opt, &st, NULL), 0);
    moe_adamw_free(&opt);
    moe_model_free(&m);
    moe_data_close(&d);
}

static void setup(void) {
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ckpt, sizeof ckpt, "%s/ckpt", root);
    moe_config c = small();
    make_ckpt(&c, ckpt);
}

static void copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    ck_assert(a && b);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a)) > 0)
        ck_assert_uint_eq(fwrite(buf, 1, n, b), n);
    fclose(a);
    fclose(b);
}

// A 1-D tensor rewrite_ckpt stores as [n/2, 2] (NULL: none).
static const char *reshape;
static void (*edit_f32)(const char *name, float *w, int64_t numel); // rewrites a tensor (or NULL)

// Copies the checkpoint to dst: config and task_experts.json as they are, the
// tensors without `skip` (may be NULL), in one file or in two shards with an
// index.
static void rewrite_ckpt(const char *dst, const char *skip, bool shards) {
    char p[900], q[900];
    mkdir(dst, 0755);
    const char *keep[] = {"config.json", "task_experts.json"};
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/%s", ckpt, keep[i]);
        snprintf(q, sizeof q, "%s/%s", dst, keep[i]);
        copy_file(p, q);
    }
    snprintf(p, sizeof p, "%s/model.safetensors", ckpt);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    moe_st_entry *e = calloc((size_t)f->n_tensors, sizeof *e);
    void **data = calloc((size_t)f->n_tensors, sizeof *data);
    int n = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const moe_st_tensor *t = &f->tensors[i];
        if (skip && !strcmp(t->name, skip)) continue;
        ck_assert_int_eq(moe_st_load(f, t->name, t->dtype, -1, NULL, &data[n]), 0);
        e[n] = (moe_st_entry){t->name, t->dtype, t->ndim, {0}, data[n]};
        memcpy(e[n].shape, t->shape, sizeof(int64_t) * t->ndim);
        if (edit_f32 && t->dtype == MOE_ST_F32) edit_f32(t->name, data[n], t->numel);
        if (reshape && !strcmp(t->name, reshape) && t->ndim == 1) {
            e[n].ndim = 2;
            e[n].shape[0] = t->shape[0] / 2, e[n].shape[1] = 2;
        }
        n++;
    }
    if (!shards) {
        snprintf(q, sizeof q, "%s/model.safetensors", dst);
        ck_assert_int_eq(moe_st_write(q, e, n, NULL), 0);
    } else {
        const int half = n / 2;
        snprintf(q, sizeof q, "%s/model-00001-of-00002.safetensors", dst);
        ck_assert_int_eq(moe_st_write(q, e, half, NULL), 0);
        snprintf(q, sizeof q, "%s/model-00002-of-00002.safetensors", dst);
        ck_assert_int_eq(moe_st_write(q, e + half, n - half, NULL), 0);
        snprintf(q, sizeof q, "%s/model.safetensors.index.json", dst);
        FILE *ix = fopen(q, "w");
        fprintf(ix, "{\"metadata\": {}, \"weight_map\": {");
        for (int i = 0; i < n; i++)
            fprintf(ix, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", i ? ", " : "", e[i].name,
                    i < half ? 1 : 2);
        fprintf(ix, "}}\n");
        fclose(ix);
    }
    for (int i = 0; i < n; i++)
        free(data[i]);
    free(data);
    free(e);
    moe_st_close(f);
}

static long file_size(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 ? (long)sb.st_size : -1;
}

// The bytes a load of `task` must read from one safetensors file: its 8-byte
// length and header, every non-expert tensor, and the experts it keeps (all of
// a token-routed layer, the recorded set of a task-routed one).
static uint64_t expected_bytes(const char *file, const moe_task_experts *te, int task) {
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(file, &f), 0);
    uint64_t n = f->data_start;
    for (int i = 0; i < f->n_tensors; i++) {
        const char *nm = f->tensors[i].name;
        int l, e;
        if (sscanf(nm, "model.layers.%d.block_sparse_moe.experts.%d.", &l, &e) == 2 &&
            te->kind[l] == MOE_LAYER_TASK) {
            bool in = false;
            for (int j = 0; j < te->top_k; j++)
                in |= te->set[l][task * te->top_k + j] == e;
            if (!in) continue;
        }
        n += f->tensors[i].nbytes;
    }
    moe_st_close(f);
    return n;
}

START_TEST(test_task_load_reads_exactly_the_needed_tensors) {
    char p[900];
    moe_task_experts te;
    snprintf(p, sizeof p, "%s/task_experts.json", ckpt);
    ck_assert_int_eq(moe_task_experts_read(p, &te), 0);
    ck_assert_int_eq(te.kind[0], MOE_LAYER_TOKEN);
    ck_assert_int_eq(te.kind[1], MOE_LAYER_TASK);
    snprintf(p, sizeof p, "%s/model.safetensors", ckpt);
    for (int task = 0; task < te.n_tasks; task++) {
        moe_infer m;
        moe_infer_opts o = {.task = te.task[task]};
        ck_assert_int_eq(moe_infer_open(&m, ckpt, &o), 0);
        ck_assert_uint_eq(m.stats.bytes_read, expected_bytes(p, &te, task));
        ck_assert_uint_eq(m.stats.ckpt_bytes, (uint64_t)file_size(p));
        ck_assert_int_eq(m.stats.loaded[0], 8);
        ck_assert_int_eq(m.stats.loaded[1], 2);
        ck_assert_int_eq(m.stats.loaded[2], 2);
        ck_assert(!m.stats.derived_sets);
        moe_infer_free(&m);
    }
    // full load: the whole file
    moe_infer m;
    moe_infer_opts o = {.task = "sort", .full_load = true};
    ck_assert_int_eq(moe_infer_open(&m, ckpt, &o), 0);
    ck_assert_uint_eq(m.stats.bytes_read, (uint64_t)file_size(p));
    moe_infer_free(&m);
    moe_task_experts_free(&te);
}
END_TEST

START_TEST(test_sharded_load_reads_index_headers_and_tensors) {
    char sh[800], p[900];
    snprintf(sh, sizeof sh, "%s/sharded", root);
    rewrite_ckpt(sh, NULL, true);
    moe_task_experts te;
    snprintf(p, sizeof p, "%s/task_experts.json", ckpt);
    ck_assert_int_eq(moe_task_experts_read(p, &te), 0);
    const int task = 3;
    uint64_t want = 0, size = 0;
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", sh);
    want += (uint64_t)file_size(p), size += (uint64_t)file_size(p);
    for (int s = 1; s <= 2; s++) {
        snprintf(p, sizeof p, "%s/model-0000%d-of-00002.safetensors", sh, s);
        want += expected_bytes(p, &te, task);
        size += (uint64_t)file_size(p);
    }
    moe_infer a, b;
    moe_infer_opts o = {.task = te.task[task]};
    ck_assert_int_eq(moe_infer_open(&a, sh, &o), 0);
    ck_assert_uint_eq(a.stats.bytes_read, want);
    ck_assert_uint_eq(a.stats.ckpt_bytes, size);
    ck_assert_int_eq(moe_infer_open(&b, ckpt, &o), 0);
    int32_t tok[5] = {128 + task, 'a', 'b', 'c', '='};
    int seq[5] = {0}, pos[5] = {0, 1, 2, 3, 4};
    ck_assert_int_eq(moe_infer_forward(&a, tok, seq, pos, 5), 0);
    ck_assert_int_eq(moe_infer_forward(&b, tok, seq, pos, 5), 0);
    ck_assert_int_eq(memcmp(a.logits, b.logits, sizeof(float) * 5 * a.V), 0);
    moe_infer_free(&a);
    moe_infer_free(&b);
    moe_task_experts_free(&te);
}
END_TEST

// Generates for three prompts of `task` with the given options.
static void gen(const char *dir, const char *task, bool full, const moe_gen_opts *g, int32_t *out,
                int *n_out, float *logits) {
    moe_infer m;
    moe_infer_opts o = {.task = task, .full_load = full, .max_batch = 3};
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), 0);
    int32_t p0[] = {128, 'a', 'b', 'c', 'd', '='}, p1[] = {128, 'q', '='},
            p2[] = {128, 'x', 'y', 'z', 'w', 'v', 'u', '='};
    const int32_t *pr[3] = {p0, p1, p2};
    int np[3] = {6, 3, 8};
    moe_gen_stats st;
    ck_assert_int_eq(moe_generate(&m, 3, pr, np, g, out, n_out, &st), 0);
    ck_assert_int_eq(st.prefill_tokens, 17);
    memcpy(logits, m.logits, sizeof(float) * m.V); // the last decode step's first row
    moe_infer_free(&m);
}

START_TEST(test_partial_load_generates_the_full_load_output_bit_for_bit) {
    const char *tasks[] = {"copy", "reverse", "sort", "caesar", "add"};
    for (int t = 0; t < 5; t++) {
        for (int sampled = 0; sampled < 2; sampled++) {
            moe_gen_opts g = {.max_new = 12, .stop = -1};
            if (sampled) g.temperature = 0.8, g.top_k = 20, g.seed = 11;
            int32_t a[36], b[36];
            int na[3], nb[3];
            float la[256], lb[256];
            gen(ckpt, tasks[t], false, &g, a, na, la);
            gen(ckpt, tasks[t], true, &g, b, nb, lb);
            for (int s = 0; s < 3; s++) {
                ck_assert_int_eq(na[s], 12);
                ck_assert_int_eq(nb[s], 12);
            }
            ck_assert_int_eq(memcmp(a, b, sizeof a), 0);
            ck_assert_int_eq(memcmp(la, lb, sizeof la), 0);
        }
    }
}
END_TEST

// Max abs difference between the KV-cache decode of checkpoint dir (prefill
// 7 tokens, then one per forward) and the training forward on the same 20
// tokens of task `name`; *scale gets the largest logit.
static double kv_vs_forward(const char *dir, const char *name, double *scale) {
    moe_config c;
    ck_assert_int_eq(moe_ckpt_config(dir, &c), 0);
    const int task = moe_config_task_index(&c, name);
    ck_assert_int_ge(task, 0);
    moe_model m;
    ck_assert_int_eq(moe_model_init(&m, &c, 1, c.model.seq_len, 5), 0);
    ck_assert_int_eq(moe_ckpt_load(dir, &m, NULL, NULL), 0);
    m.dropless = true;
    const int T = 20, V = m.V;
    int32_t tok[20];
    tu_rng r;
    tu_seed(&r, 5);
    tok[0] = 128 + task;
    for (int i = 1; i < T; i++)
        tok[i] = 'a' + (int)(tu_uniform(&r) * 26);
    int32_t tid = task;
    ck_assert_int_eq(moe_model_forward(&m, tok, NULL, &tid, 1, T, false, 0), 0);
    moe_infer e;
    moe_infer_opts o = {.task = name};
    ck_assert_int_eq(moe_infer_open(&e, dir, &o), 0);
    int seq[20] = {0}, pos[20];
    for (int i = 0; i < 7; i++)
        pos[i] = i;
    ck_assert_msg(moe_infer_forward(&e, tok, seq, pos, 7) == 0, "%s", moe_last_error());
    double worst = 0;
    *scale = 0;
    for (int i = 0; i < 7 * V; i++) {
        worst = fmax(worst, fabs(e.logits[i] - m.logits[i]));
        *scale = fmax(*scale, fabs(m.logits[i]));
    }
    for (int t = 7; t < T; t++) {
        int p = t;
        ck_assert_int_eq(moe_infer_forward(&e, tok + t, seq, &p, 1), 0);
        for (int v = 0; v < V; v++) {
            worst = fmax(worst, fabs(e.logits[v] - m.logits[(size_t)t * V + v]));
            *scale = fmax(*scale, fabs(m.logits[(size_t)t * V + v]));
        }
    }
    if (getenv("MOE_TEST_VERBOSE"))
        printf("%s: kv decode vs forward: max abs %g, scale %g\n", dir, worst, *scale);
    moe_infer_free(&e);
    moe_model_free(&m);
    return worst;
}

START_TEST(test_kv_cache_decode_matches_the_training_forward) {
    double scale, worst = kv_vs_forward(ckpt, "sort", &scale);
    ck_assert_msg(worst <= 1e-6 * fmax(scale, 1.0), "max abs logit difference %g (scale %g)", worst,
                  scale);
}
END_TEST

// Shared expert, a pyramid of expert counts, dense layers between MoE layers,
// untied head, one kv head, Switch-style raw top-1 weights: the same checks.
START_TEST(test_other_architectures_decode_and_load_exactly) {
    moe_config c = small();
    const char *sets[] = {
        "model.n_layers=4",     "moe.every=2",         "moe.num_experts=[4,8]",
        "moe.shared_experts=1", "moe.task_layers=[3]", "model.tie_embeddings=false",
        "model.n_kv_heads=1",   "router.top_k=1",      "router.normalize_topk=false"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i]), 0);
    char dir[800];
    snprintf(dir, sizeof dir, "%s/arch", root);
    make_ckpt(&c, dir);
    double scale, worst = kv_vs_forward(dir, "caesar", &scale);
    ck_assert_msg(worst <= 1e-6 * fmax(scale, 1.0), "max abs logit difference %g (scale %g)", worst,
                  scale);
    moe_infer m;
    moe_infer_opts o = {.task = "caesar"};
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), 0);
    ck_assert_int_eq(m.stats.loaded[1], 4); // token-routed: all
    ck_assert_int_eq(m.stats.loaded[3], 1); // task-routed top-1
    ck_assert_int_eq(m.stats.experts[0], 0);
    moe_infer_free(&m);
    moe_gen_opts g = {.max_new = 10, .stop = -1, .temperature = 1.0, .seed = 4};
    int32_t a[30], b[30];
    int na[3], nb[3];
    float la[256], lb[256];
    gen(dir, "caesar", false, &g, a, na, la);
    gen(dir, "caesar", true, &g, b, nb, lb);
    ck_assert_int_eq(memcmp(a, b, sizeof a), 0);
    ck_assert_int_eq(memcmp(la, lb, sizeof la), 0);
}
END_TEST

START_TEST(test_bad_checkpoints_and_tasks_fail_clearly) {
    moe_infer m;
    moe_infer_opts o = {.task = "juggle"};
    ck_assert_int_eq(moe_infer_open(&m, ckpt, &o), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "unknown task 'juggle'"));
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "copy, reverse, sort"));
    // a missing expert tensor of the task's set
    char dir[800], p[900], q[900];
    moe_task_experts te;
    snprintf(p, sizeof p, "%s/task_experts.json", ckpt);
    ck_assert_int_eq(moe_task_experts_read(p, &te), 0);
    char name[128];
    snprintf(name, sizeof name, "model.layers.2.block_sparse_moe.experts.%d.w2.weight",
             te.set[2][0 * te.top_k + 1]);
    snprintf(dir, sizeof dir, "%s/missing", root);
    rewrite_ckpt(dir, name, false);
    o.task = "copy";
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "missing tensor"));
    ck_assert_ptr_nonnull(strstr(moe_last_error(), name));
    // a task that does not route to the missing expert still loads
    int other = -1;
    for (int t = 1; t < te.n_tasks && other < 0; t++) {
        bool uses = false;
        for (int j = 0; j < te.top_k; j++)
            uses |= te.set[2][t * te.top_k + j] == te.set[2][1];
        if (!uses) other = t;
    }
    ck_assert_int_gt(other, 0);
    o.task = te.task[other];
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), 0);
    moe_infer_free(&m);
    // truncated model file
    snprintf(dir, sizeof dir, "%s/truncated", root);
    rewrite_ckpt(dir, NULL, false);
    snprintf(q, sizeof q, "%s/model.safetensors", dir);
    ck_assert_int_eq(truncate(q, file_size(q) - 100), 0);
    o.task = "copy";
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "truncated"));
    // no checkpoint at all
    ck_assert_int_eq(moe_infer_open(&m, root, &o) < 0, 1);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "config.json"));
    // a config.json with an impossible shape is refused before anything is sized by it
    snprintf(dir, sizeof dir, "%s/badconfig", root);
    rewrite_ckpt(dir, NULL, false);
    snprintf(q, sizeof q, "%s/config.json", dir);
    FILE *f = fopen(q, "r");
    char text[8192];
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = 0;
    char *h = strstr(text, "\"n_heads\": 4");
    ck_assert_ptr_nonnull(h);
    h[strlen("\"n_heads\": ")] = '0';
    f = fopen(q, "w");
    fputs(text, f);
    fclose(f);
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "n_heads"));
    moe_task_experts_free(&te);
}
END_TEST

START_TEST(test_reshaped_vector_is_described_with_its_own_rank) {
    char dir[800];
    snprintf(dir, sizeof dir, "%s/reshaped", root);
    reshape = "model.norm.weight";
    rewrite_ckpt(dir, NULL, false);
    reshape = NULL;
    moe_infer m;
    moe_infer_opts o = {.task = "copy"};
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), "tensor 'model.norm.weight' is F32 [16, 2], the config "
                                           "expects F32 [32]"),
                  "%s", moe_last_error());
}
END_TEST

// A copy of the checkpoint whose task_experts.json edit() changed.
static void edit_task_experts(const char *dst, void (*edit)(json_t *doc)) {
    char p[900];
    rewrite_ckpt(dst, NULL, false);
    snprintf(p, sizeof p, "%s/task_experts.json", dst);
    json_t *doc = json_load_file(p, 0, NULL);
    ck_assert_ptr_nonnull(doc);
    edit(doc);
    ck_assert_int_eq(json_dump_file(doc, p, JSON_INDENT(1)), 0);
    json_decref(doc);
}

static void swap_reverse_and_sort(json_t *doc) {
    json_t *tasks = json_object_get(doc, "tasks");
    ck_assert_str_eq(json_string_value(json_array_get(tasks, 1)), "reverse");
    json_array_set_new(tasks, 1, json_string("sort"));
    json_array_set_new(tasks, 2, json_string("reverse"));
}

START_TEST(test_task_experts_with_other_tasks_names_them) {
    char dir[800];
    snprintf(dir, sizeof dir, "%s/tasks_swapped", root);
    edit_task_experts(dir, swap_reverse_and_sort);
    moe_infer m;
    moe_infer_opts o = {.task = "copy"}; // its own row is still in place
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), "task 1: 'sort' vs 'reverse'"), "%s", moe_last_error());
    ck_assert_msg(strstr(moe_last_error(), "[copy, sort, reverse"), "%s", moe_last_error());
}
END_TEST

static double bad_share;

// Layer 0 (token-routed) of task 1 (reverse): expert 0's share.
static void set_bad_share(json_t *doc) {
    json_t *l0 = json_array_get(json_object_get(doc, "layers"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(l0, "routing")), "token");
    json_t *row = json_array_get(json_object_get(l0, "share"), 1);
    ck_assert_int_eq(json_array_set_new(row, 0, json_real(bad_share)), 0);
}

START_TEST(test_task_expert_shares_outside_0_1_are_refused) {
    static const double bad[] = {-5, 5, 1.0000001};
    for (int i = 0; i < 3; i++) {
        char dir[800];
        snprintf(dir, sizeof dir, "%s/bad_share%d", root, i);
        bad_share = bad[i];
        edit_task_experts(dir, set_bad_share);
        moe_infer m;
        moe_infer_opts o = {.task = "reverse", .expert_budget = 0.2};
        ck_assert_int_eq(moe_infer_open(&m, dir, &o), MOE_EFORMAT);
        const char *e = moe_last_error();
        ck_assert_msg(strstr(e, "task_experts.json: layer 0 task 'reverse'") &&
                          strstr(e, "not in [0, 1]"),
                      "%s", e);
    }
}
END_TEST

START_TEST(test_older_checkpoint_without_task_experts_derives_the_sets) {
    char dir[800], p[900];
    snprintf(dir, sizeof dir, "%s/old", root);
    rewrite_ckpt(dir, NULL, false);
    snprintf(p, sizeof p, "%s/task_experts.json", dir);
    ck_assert_int_eq(unlink(p), 0);
    moe_gen_opts g = {.max_new = 8, .stop = -1};
    int32_t a[24], b[24];
    int na[3], nb[3];
    float la[256], lb[256];
    gen(dir, "reverse", false, &g, a, na, la);
    gen(ckpt, "reverse", false, &g, b, nb, lb);
    ck_assert_int_eq(memcmp(a, b, sizeof a), 0);
    moe_infer m;
    moe_infer_opts o = {.task = "reverse"};
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), 0);
    ck_assert(m.stats.derived_sets);
    ck_assert_int_eq(m.stats.loaded[1], 2);
    moe_infer_free(&m);
    o.expert_budget = 0.1; // needs the recorded shares
    ck_assert_int_eq(moe_infer_open(&m, dir, &o), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "task_experts.json"));
}
END_TEST

START_TEST(test_expert_budget_and_int8_load_less) {
    moe_infer full, bud, q8;
    moe_infer_opts o = {.task = "add"};
    ck_assert_int_eq(moe_infer_open(&full, ckpt, &o), 0);
    o.expert_budget = 0.2;
    ck_assert_int_eq(moe_infer_open(&bud, ckpt, &o), 0);
    ck_assert_int_lt(bud.stats.loaded[0], 8);
    ck_assert_int_ge(bud.stats.loaded[0], 2);
    ck_assert_uint_lt(bud.stats.bytes_read, full.stats.bytes_read);
    o.expert_budget = 0;
    o.quantize_int8 = true;
    ck_assert_int_eq(moe_infer_open(&q8, ckpt, &o), 0);
    ck_assert_uint_eq(q8.stats.bytes_read, full.stats.bytes_read);
    ck_assert_uint_lt(q8.stats.expert_bytes * 3, full.stats.expert_bytes);
    int32_t tok[6] = {131, 'k', 'l', 'm', 'n', '='};
    int seq[6] = {0}, pos[6] = {0, 1, 2, 3, 4, 5};
    ck_assert_int_eq(moe_infer_forward(&full, tok, seq, pos, 6), 0);
    ck_assert_int_eq(moe_infer_forward(&q8, tok, seq, pos, 6), 0);
    ck_assert_int_eq(moe_infer_forward(&bud, tok, seq, pos, 6), 0);
    double diff = 0;
    for (int i = 0; i < 6 * full.V; i++)
        diff = fmax(diff, fabs(full.logits[i] - q8.logits[i]));
    ck_assert_msg(diff > 0 && diff < 1e-2, "int8 logit difference %g", diff);
    // a decode step: int8 rows go through the int8 GEMV
    int32_t next = 'o';
    int p6 = 6;
    ck_assert_int_eq(moe_infer_forward(&full, &next, seq, &p6, 1), 0);
    ck_assert_int_eq(moe_infer_forward(&q8, &next, seq, &p6, 1), 0);
    diff = 0;
    for (int i = 0; i < full.V; i++)
        diff = fmax(diff, fabs(full.logits[i] - q8.logits[i]));
    ck_assert_msg(diff > 0 && diff < 1e-2, "int8 decode logit difference %g", diff);
    moe_infer_free(&full);
    moe_infer_free(&bud);
    moe_infer_free(&q8);
}
END_TEST

// Task reverse's shares in every layer: experts 0, 2, 3 above a budget of
// 0.2, expert 1 (group 0's other expert) below it.
// Rows of layer 0's expert 0 w1 [H, D] at the edges of symmetric int8: zeros,
// one huge value among tiny ones, identical values, subnormal maxima (whose
// max / 127 rounds on the coarse subnormal grid), a negative extreme and
// halves at scale 1 (ties to even).
enum { EDGE_ROWS = 9 };
static float edge[EDGE_ROWS][32];
static void fill_edge_rows(void) {
    const float t = ldexpf(1, -149); // the smallest subnormal
    const float maxima[4] = {190 * t, 128 * t, 50 * t, 1e-39f};
    for (int c = 0; c < 32; c++) {
        edge[0][c] = 0;
        edge[1][c] = c ? (c % 2 ? 1e-30f : -1e-30f) : 1e30f;
        edge[2][c] = 0.3f;
        for (int i = 0; i < 4; i++) // the max first, then fractions of it of both signs
            edge[3 + i][c] = c ? maxima[i] * (float)(c % 7) / 7 * (c % 2 ? 1 : -1) : maxima[i];
        edge[7][c] = c ? (float)(c % 5) / 5 : -1; // the max is negative: q = -127, never -128
        edge[8][c] = c ? (float)(c - 16) + 0.5f : 127;
    }
}
static void edit_edge_rows(const char *name, float *w, int64_t numel) {
    if (strcmp(name, "model.layers.0.block_sparse_moe.experts.0.w1.weight")) return;
    ck_assert_int_ge(numel, EDGE_ROWS * 32);
    memcpy(w, edge, sizeof edge);
}

START_TEST(test_int8_rows_at_the_edges_dequantise_within_half_a_step) {
    char dir[800];
    snprintf(dir, sizeof dir, "%s/int8_edges", root);
    fill_edge_rows();
    edit_f32 = edit_edge_rows;
    rewrite_ckpt(dir, NULL, false);
    edit_f32 = NULL;
    moe_infer f32, q8;
    moe_infer_opts o = {.task = "add", .full_load = true};
    ck_assert_int_eq(moe_infer_open(&f32, dir, &o), 0);
    o.quantize_int8 = true;
    ck_assert_int_eq(moe_infer_open(&q8, dir, &o), 0);
    // every row of every loaded expert: q in [-127, 127], |q s - w| <= s / 2
    for (int l = 0; l < f32.L; l++) {
        const moe_infer_layer *a = &f32.layer[l], *b = &q8.layer[l];
        if (!a->is_moe) continue;
        const size_t D = f32.D, H = a->H, blk = 3 * H * D, nrow = 2 * H + D;
        for (int e = 0; e < a->E; e++) {
            if (a->slot[e] < 0) continue;
            const float *w = a->experts + (size_t)a->slot[e] * blk;
            const int8_t *q = b->q + (size_t)b->slot[e] * blk;
            const float *sc = b->q_scale + (size_t)b->slot[e] * nrow;
            size_t off = 0;
            for (size_t r = 0; r < nrow; r++) {
                const size_t n = r < 2 * H ? D : H;
                ck_assert(sc[r] > 0 && isfinite(sc[r]));
                for (size_t c = 0; c < n; c++) {
                    const int v = q[off + c];
                    const double err = fabs((double)v * sc[r] - w[off + c]);
                    ck_assert_msg(v >= -127 && v <= 127 && err <= 0.5 * sc[r],
                                  "layer %d expert %d row %zu col %zu: w %g q %d scale %g", l, e, r,
                                  c, w[off + c], v, sc[r]);
                }
                off += n;
            }
        }
    }
    // the edge rows themselves
    const moe_infer_layer *y = &q8.layer[0];
    const size_t D = q8.D;
    const int8_t *q = y->q + (size_t)y->slot[0] * 3 * y->H * D;
    const float *sc = y->q_scale + (size_t)y->slot[0] * (2 * y->H + D);
    for (int c = 0; c < 32; c++)
        ck_assert_int_eq(q[c], 0); // a zero row: scale 1, no division by zero
    ck_assert_int_eq(q[32], 127);
    ck_assert_float_eq(sc[1], 1e30f / 127);
    for (int c = 1; c < 32; c++)
        ck_assert_int_eq(q[32 + c], 0);
    for (int c = 0; c < 32; c++)
        ck_assert_int_eq(q[2 * 32 + c], 127);
    // subnormal maxima: 190 t / 127 rounds to the scale t, and 190 wrapped to
    // -66 in int8; 128 t gave 128, which wrapped to -128. Both take 2 t.
    ck_assert_int_eq(q[3 * 32], 95);
    ck_assert_float_eq(sc[3], ldexpf(1, -148));
    ck_assert_int_eq(q[4 * 32], 64);
    ck_assert_float_eq(sc[4], ldexpf(1, -148));
    ck_assert_int_eq(q[5 * 32], 50); // 50 t: exact at the smallest subnormal scale
    ck_assert_float_eq(sc[5], ldexpf(1, -149));
    ck_assert_int_eq(q[7 * 32], -127);
    ck_assert_float_eq(sc[8], 1);
    ck_assert_int_eq(q[8 * 32 + 1], -14); // -14.5 -> -14, ties to even
    ck_assert_int_eq(q[8 * 32 + 2], -14); // -13.5 -> -14
    ck_assert_int_eq(q[8 * 32 + 19], 4);  // 3.5 -> 4
    ck_assert_int_eq(q[8 * 32 + 20], 4);  // 4.5 -> 4
    moe_infer_free(&f32);
    moe_infer_free(&q8);
}
END_TEST

// A non-finite expert weight is refused under --quantize as in fp32, naming
// the tensor and the element.
static void edit_nan_expert(const char *name, float *w, int64_t numel) {
    if (strcmp(name, "model.layers.2.block_sparse_moe.experts.3.w2.weight")) return;
    ck_assert_int_gt(numel, 40);
    w[40] = NAN;
}

START_TEST(test_int8_refuses_non_finite_expert_weights_naming_the_tensor) {
    char dir[800];
    snprintf(dir, sizeof dir, "%s/int8_nan", root);
    edit_f32 = edit_nan_expert;
    rewrite_ckpt(dir, NULL, false);
    edit_f32 = NULL;
    const char *want = "tensor 'model.layers.2.block_sparse_moe.experts.3.w2.weight' has a "
                       "non-finite value at element 40";
    for (int i = 0; i < 2; i++) {
        moe_infer m;
        moe_infer_opts o = {.task = "add", .full_load = true, .quantize_int8 = i};
        ck_assert_int_eq(moe_infer_open(&m, dir, &o), MOE_EFORMAT);
        ck_assert_msg(strstr(moe_last_error(), want), "%s", moe_last_error());
    }
}
END_TEST

// Rewrites the task_experts.json of checkpoint folder dir: task 1's shares in
// every layer become 0.5, 0.01, 0.25, 0.24, 0, 0, 0, 0. The manifest, which
// lists the old size, is removed.
static void set_lonely_group_shares(const char *dir) {
    static const double sh[8] = {0.5, 0.01, 0.25, 0.24, 0, 0, 0, 0};
    char p[900];
    snprintf(p, sizeof p, "%s/task_experts.json", dir);
    json_t *doc = json_load_file(p, 0, NULL);
    ck_assert_ptr_nonnull(doc);
    json_t *layers = json_object_get(doc, "layers");
    for (size_t l = 0; l < json_array_size(layers); l++) {
        json_t *row = json_array_get(json_object_get(json_array_get(layers, l), "share"), 1);
        for (int e = 0; e < 8; e++)
            ck_assert_int_eq(json_array_set_new(row, (size_t)e, json_real(sh[e])), 0);
    }
    ck_assert_int_eq(json_dump_file(doc, p, JSON_INDENT(1)), 0);
    json_decref(doc);
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    ck_assert_int_eq(unlink(p), 0);
}

// Greedy and sampled answers to the 3 prompts, and the last logits, of a
// budget load equal those of a full load routed with the same experts left out.
static void expect_same_answers(moe_infer *bud, moe_infer *full, const int32_t *const *pr,
                                const int *np, double budget) {
    for (int sampled = 0; sampled < 2; sampled++) {
        moe_gen_opts g = {.max_new = 12, .stop = -1};
        if (sampled) g.temperature = 0.9, g.top_k = 30, g.seed = 5;
        int32_t a[36], b[36];
        int na[3], nb[3];
        moe_gen_stats st;
        ck_assert_msg(moe_generate(bud, 3, pr, np, &g, a, na, &st) == 0, "budget %g: %s", budget,
                      moe_last_error());
        ck_assert_int_eq(moe_generate(full, 3, pr, np, &g, b, nb, &st), 0);
        ck_assert_int_eq(memcmp(na, nb, sizeof na), 0);
        ck_assert_int_eq(memcmp(a, b, sizeof a), 0);
        ck_assert_int_eq(memcmp(bud->logits, full->logits, sizeof(float) * bud->V), 0);
    }
}

// Group-limited routing (4 groups of 2 experts, one group a token, top-2)
// under --expert-budget: every routed expert is loaded and within one group,
// and the tokens and logits are those of a full load routed with the same
// experts left out. Shares that keep experts 0, 2, 3 would leave group 0 one
// expert short of top_k: expert 1 is kept too.
START_TEST(test_expert_budget_with_group_limited_routing_routes_to_loaded_experts) {
    char dir[800];
    snprintf(dir, sizeof dir, "%s/groups", root);
    moe_config c = small();
    c.moe.n_task_layers = 0; // every layer token-routed: the budget applies to all
    c.router.n_groups = 4;
    c.router.topk_groups = 1;
    make_ckpt(&c, dir);
    const double budgets[] = {0.2, 0.05, 0.1, 0.2, 0.3}; // the first on the edited shares
    int partial = 0;
    for (int bi = 0; bi < 5; bi++) {
        if (bi == 1) { // the measured shares
            snprintf(dir, sizeof dir, "%s/groups_measured", root);
            make_ckpt(&c, dir);
        } else if (bi == 0) {
            set_lonely_group_shares(dir);
        }
        moe_infer bud, full;
        moe_infer_opts o = {.task = "reverse", .max_batch = 3, .expert_budget = budgets[bi]};
        ck_assert_msg(moe_infer_open(&bud, dir, &o) == 0, "%s", moe_last_error());
        o.expert_budget = 0, o.full_load = true;
        ck_assert_int_eq(moe_infer_open(&full, dir, &o), 0);
        for (int l = 0; l < bud.L; l++) { // the full load routes as the budget does
            moe_infer_layer *b = &bud.layer[l], *f = &full.layer[l];
            if (bi == 0) {
                ck_assert_int_eq(bud.stats.loaded[l], 4);
                for (int e = 0; e < 8; e++)
                    ck_assert_int_eq(b->allowed[e], e < 4);
            }
            if (!b->allowed) continue;
            partial++;
            ck_assert_ptr_eq(b->plan.usable, b->allowed);
            f->allowed = malloc(sizeof(bool) * f->E);
            memcpy(f->allowed, b->allowed, sizeof(bool) * f->E);
            f->plan.usable = f->allowed;
            ck_assert_ptr_null(f->bias);
        }
        int32_t p0[] = {129, 'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', '='},
                p1[] = {129, 'q', 'z', '='}, p2[] = {129, 'x', 'y', 'z', 'w', 'v', 'u', '='};
        const int32_t *pr[3] = {p0, p1, p2};
        int np[3] = {10, 4, 8};
        // a prefill: every token's experts are loaded and in one group
        int seq[10] = {0}, pos[10];
        for (int i = 0; i < 10; i++)
            pos[i] = i;
        ck_assert_msg(moe_infer_forward(&bud, p0, seq, pos, 10) == 0, "%s", moe_last_error());
        for (int l = 0; l < bud.L; l++) {
            const moe_plan *pl = &bud.layer[l].plan;
            for (int t = 0; t < 10; t++) {
                const int *ex = pl->expert + (size_t)t * bud.k;
                for (int j = 0; j < bud.k; j++) {
                    ck_assert_int_ge(ex[j], 0);
                    ck_assert_msg(bud.layer[l].slot[ex[j]] >= 0,
                                  "budget %g layer %d token %d: expert %d not loaded", budgets[bi],
                                  l, t, ex[j]);
                    ck_assert_int_eq(ex[j] / 2, ex[0] / 2); // topk_groups = 1
                }
            }
        }
        expect_same_answers(&bud, &full, pr, np, budgets[bi]);
        moe_infer_free(&bud);
        moe_infer_free(&full);
    }
    ck_assert_int_gt(partial, 0);
}
END_TEST

// An expert-choice model with router.ec_fallback = token_choice is routed by
// token choice at inference: under --expert-budget that choice must never
// reach an expert left unloaded, and the tokens and logits are those of a
// full load routed with the same experts left out.
START_TEST(test_expert_budget_on_expert_choice_model_routes_to_loaded_experts) {
    char dir[800];
    snprintf(dir, sizeof dir, "%s/ec_budget", root);
    moe_config c = small();
    c.moe.n_task_layers = 0; // every layer token-routed at inference: the budget applies to all
    c.router.type = MOE_ROUTER_EXPERT_CHOICE;
    c.router.ec_fallback = MOE_EC_FALLBACK_TOKEN_CHOICE;
    c.router.capacity_factor = 1.0;
    ck_assert_msg(moe_config_check(&c, NULL) == 0, "%s", moe_last_error());
    make_ckpt(&c, dir);
    const double budgets[] = {0.05, 0.1, 0.2, 0.3};
    int partial = 0;
    for (int bi = 0; bi < 4; bi++) {
        moe_infer bud, full;
        moe_infer_opts o = {.task = "reverse", .max_batch = 3, .expert_budget = budgets[bi]};
        ck_assert_msg(moe_infer_open(&bud, dir, &o) == 0, "%s", moe_last_error());
        o.expert_budget = 0, o.full_load = true;
        ck_assert_int_eq(moe_infer_open(&full, dir, &o), 0);
        ck_assert_int_eq(bud.cfg.router.type, MOE_ROUTER_TOKEN_CHOICE);
        for (int l = 0; l < bud.L; l++) {
            moe_infer_layer *b = &bud.layer[l], *f = &full.layer[l];
            if (!b->allowed) continue;
            partial++;
            ck_assert_int_lt(bud.stats.loaded[l], b->E);
            ck_assert_ptr_eq(b->plan.usable, b->allowed);
            f->allowed = malloc(sizeof(bool) * f->E);
            memcpy(f->allowed, b->allowed, sizeof(bool) * f->E);
            f->plan.usable = f->allowed;
            for (int e = 0; f->bias && e < f->E; e++)
                if (!f->allowed[e]) f->bias[e] = -1e30f;
        }
        int32_t p0[] = {129, 'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', '='},
                p1[] = {129, 'q', 'z', '='}, p2[] = {129, 'x', 'y', 'z', 'w', 'v', 'u', '='};
        const int32_t *pr[3] = {p0, p1, p2};
        int np[3] = {10, 4, 8};
        int seq[10] = {0}, pos[10];
        for (int i = 0; i < 10; i++)
            pos[i] = i;
        ck_assert_msg(moe_infer_forward(&bud, p0, seq, pos, 10) == 0, "%s", moe_last_error());
        for (int l = 0; l < bud.L; l++)
            for (int t = 0; t < 10; t++)
                for (int j = 0; j < bud.k; j++) {
                    const int e = bud.layer[l].plan.expert[(size_t)t * bud.k + j];
                    ck_assert_int_ge(e, 0);
                    ck_assert_msg(bud.layer[l].slot[e] >= 0,
                                  "budget %g layer %d token %d: expert %d not loaded", budgets[bi],
                                  l, t, e);
                }
        expect_same_answers(&bud, &full, pr, np, budgets[bi]);
        moe_infer_free(&bud);
        moe_infer_free(&full);
    }
    ck_assert_int_gt(partial, 0);
}
END_TEST

// moe_generate equals a hand-driven loop over one sequence at a time: each
// prompt prefilled into its own engine, the first token drawn from the
// prompt's last row with draw index 0, then token i fed at position
// n_prompt + i - 1 and drawn with index i. Decode steps of at most 4 rows are
// GEMVs, so the batched logits are those of a single row, bit for bit: a
// shared cache row, a position off by one, the wrong prefill row or draw
// index changes the tokens.
START_TEST(test_generate_equals_one_sequence_at_a_time) {
    int32_t p0[] = {129, 'a', 'b', 'c', 'd', '='}, p1[] = {129, 'q', '='},
            p2[] = {129, 'x', 'y', 'z', 'w', 'v', 'u', '='};
    const int32_t *pr[3] = {p0, p1, p2};
    int np[3] = {6, 3, 8};
    enum { MAX_NEW = 10 };
    for (int sampled = 0; sampled < 2; sampled++) {
        moe_gen_opts g = {.max_new = MAX_NEW, .stop = -1, .first = 5};
        if (sampled) g.temperature = 1.5, g.top_k = 40, g.seed = 9;
        moe_infer m;
        moe_infer_opts o = {.task = "reverse", .max_batch = 3};
        ck_assert_int_eq(moe_infer_open(&m, ckpt, &o), 0);
        int32_t out[3 * MAX_NEW];
        int n_out[3];
        moe_gen_stats st;
        ck_assert_int_eq(moe_generate(&m, 3, pr, np, &g, out, n_out, &st), 0);
        moe_infer_free(&m);
        int *idx = malloc(sizeof(int) * 256);
        for (int b = 0; b < 3; b++) {
            moe_infer one;
            o.max_batch = 1;
            ck_assert_int_eq(moe_infer_open(&one, ckpt, &o), 0);
            int seq[8] = {0}, pos[8];
            for (int i = 0; i < np[b]; i++)
                pos[i] = i;
            ck_assert_int_eq(moe_infer_forward(&one, pr[b], seq, pos, np[b]), 0);
            int32_t want[MAX_NEW];
            want[0] = moe_sample_token(one.logits + (size_t)(np[b] - 1) * one.V, one.V, &g,
                                       g.first + b, 0, idx);
            for (int i = 1; i < MAX_NEW; i++) {
                int p = np[b] + i - 1;
                ck_assert_int_eq(moe_infer_forward(&one, &want[i - 1], seq, &p, 1), 0);
                want[i] = moe_sample_token(one.logits, one.V, &g, g.first + b, (uint64_t)i, idx);
            }
            ck_assert_int_eq(n_out[b], MAX_NEW);
            for (int i = 0; i < MAX_NEW; i++)
                ck_assert_msg(out[b * MAX_NEW + i] == want[i],
                              "sampled %d prompt %d token %d: %d, one at a time %d", sampled, b, i,
                              out[b * MAX_NEW + i], want[i]);
            moe_infer_free(&one);
        }
        free(idx);
    }
}
END_TEST

// --expert-budget P keeps the experts whose share is >= P (one exactly at P
// included), and always the task's k most used. Shares of task reverse in
// every layer: 0.5, 0.01, 0.25, 0.24, 0, 0, 0, 0 (top-2: experts 0 and 2).
START_TEST(test_expert_budget_keeps_shares_at_p_and_the_k_most_used) {
    char dir[800];
    snprintf(dir, sizeof dir, "%s/budget_edges", root);
    moe_config c = small();
    c.moe.n_task_layers = 0; // every layer token-routed: the budget applies to all
    make_ckpt(&c, dir);
    set_lonely_group_shares(dir);
    static const struct {
        double budget;
        bool keep[8];
    } cases[] = {
        {0.24, {1, 0, 1, 1, 0, 0, 0, 0}}, // 0.24 == P: kept
        {0.25, {1, 0, 1, 0, 0, 0, 0, 0}}, // 0.25 == P kept, 0.24 < P not
        {0.3, {1, 0, 1, 0, 0, 0, 0, 0}},  // only expert 0 >= P: the top-2 add expert 2
        {0.9, {1, 0, 1, 0, 0, 0, 0, 0}},  // none >= P: the top-2
        {0.01, {1, 1, 1, 1, 0, 0, 0, 0}}, // 0.01 == P: kept
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moe_infer m;
        moe_infer_opts o = {.task = "reverse", .expert_budget = cases[i].budget};
        ck_assert_msg(moe_infer_open(&m, dir, &o) == 0, "%s", moe_last_error());
        for (int l = 0; l < m.L; l++) {
            int n = 0;
            for (int e = 0; e < 8; e++) {
                n += cases[i].keep[e];
                ck_assert_msg(m.layer[l].allowed[e] == cases[i].keep[e] &&
                                  (m.layer[l].slot[e] >= 0) == cases[i].keep[e],
                              "budget %g layer %d expert %d: kept %d", cases[i].budget, l, e,
                              m.layer[l].allowed[e]);
            }
            ck_assert_int_eq(m.stats.loaded[l], n);
        }
        moe_infer_free(&m);
    }
}
END_TEST

// Rounds every expert row to the int8 grid of its own scale (max |w| / 127).
static void edit_int8_grid(const char *name, float *w, int64_t numel) {
    if (!strstr(name, ".experts.")) return;
    const int64_t cols = strstr(name, ".w2.") ? 48 : 32; // w2 [D, H], w1 and w3 [H, D]
    for (int64_t r = 0; r < numel / cols; r++) {
        float *x = w + r * cols, amax = 0;
        for (int64_t c = 0; c < cols; c++)
            amax = fmaxf(amax, fabsf(x[c]));
        const float s = amax / 127;
        for (int64_t c = 0; c < cols && s > 0; c++)
            x[c] = rintf(x[c] / s) * s;
    }
}

// Expert weights already on the grid of per-row int8 scales quantise without
// loss: the int8 load (dequantised GEMM rows of a prefill, int8 GEMV rows of a
// decode step) gives the fp32 logits up to rounding. A scale of another row,
// another expert's block or a per-tensor scale is off by percents.
START_TEST(test_int8_of_weights_on_the_int8_grid_gives_the_fp32_logits) {
    char dir[800];
    snprintf(dir, sizeof dir, "%s/int8_grid", root);
    edit_f32 = edit_int8_grid;
    rewrite_ckpt(dir, NULL, false);
    edit_f32 = NULL;
    moe_infer f32, q8;
    moe_infer_opts o = {.task = "caesar"};
    ck_assert_int_eq(moe_infer_open(&f32, dir, &o), 0);
    o.quantize_int8 = true;
    ck_assert_int_eq(moe_infer_open(&q8, dir, &o), 0);
    ck_assert_uint_lt(q8.stats.expert_bytes * 3, f32.stats.expert_bytes);
    int32_t tok[12] = {131, 'k', 'l', 'm', 'n', 'o', 'p', 'q', 'r', 's', 't', '='};
    int seq[12] = {0}, pos[12];
    for (int i = 0; i < 12; i++)
        pos[i] = i;
    double diff = 0, scale = 0;
    ck_assert_int_eq(moe_infer_forward(&f32, tok, seq, pos, 12), 0);
    ck_assert_int_eq(moe_infer_forward(&q8, tok, seq, pos, 12), 0);
    for (int i = 0; i < 12 * f32.V; i++) {
        diff = fmax(diff, fabs(f32.logits[i] - q8.logits[i]));
        scale = fmax(scale, fabs(f32.logits[i]));
    }
    for (int t = 0; t < 6; t++) { // decode steps: int8 GEMVs
        int32_t next = 'a' + t;
        int p = 12 + t;
        ck_assert_int_eq(moe_infer_forward(&f32, &next, seq, &p, 1), 0);
        ck_assert_int_eq(moe_infer_forward(&q8, &next, seq, &p, 1), 0);
        for (int i = 0; i < f32.V; i++) {
            diff = fmax(diff, fabs(f32.logits[i] - q8.logits[i]));
            scale = fmax(scale, fabs(f32.logits[i]));
        }
    }
    ck_assert_msg(diff <= 1e-5 * fmax(scale, 1.0), "int8 logit difference %g (scale %g)", diff,
                  scale);
    moe_infer_free(&f32);
    moe_infer_free(&q8);
}
END_TEST

// The moe binary: answers on stdout, what it loaded on stderr, exit 2 on bad input.
static int run_moe(const char *args) {
    return tu_run_moe(root, args);
}

static const char *text(const char *name) {
    return tu_file_text(root, name);
}

// Decode GEMVs of at least 128K multiply-adds split their output rows over
// the thread pool (d_model 128, expert width 512: the experts' gate/up GEMV
// is 1024 x 128); sampled answers, fp32 and int8, must not depend on the
// thread count. On a one-core machine both runs use one thread.
START_TEST(test_decode_is_the_same_for_any_thread_count) {
    moe_config c = small();
    c.model.d_model = 128;
    c.model.d_ff = 512;
    c.model.n_layers = 2;
    c.moe.n_task_layers = 0;
    char dir[800], p[900], args[2048];
    static char one[65536];
    snprintf(dir, sizeof dir, "%s/wide", root);
    make_ckpt(&c, dir);
    snprintf(p, sizeof p, "%s/wide_prompts.txt", root);
    FILE *f = fopen(p, "w");
    fputs("abcd=\nzz=\nqwerty=\n", f);
    fclose(f);
    const char *modes[] = {"", "--quantize int8"};
    for (int i = 0; i < 2; i++) {
        for (int t = 1; t <= 2; t++) {
            setenv("MOE_NUM_THREADS", t == 1 ? "1" : "2", 1);
            snprintf(args, sizeof args,
                     "generate '%s' --task sort --input '%s' --max-new 24 --temperature 1 "
                     "--seed 3 %s",
                     dir, p, modes[i]);
            ck_assert_int_eq(run_moe(args), 0);
            if (t == 1)
                snprintf(one, sizeof one, "%s", text("out.txt"));
            else
                ck_assert_str_eq(text("out.txt"), one);
        }
    }
    unsetenv("MOE_NUM_THREADS");
}
END_TEST

// The per-task expert sets of a task-routed layer (written at the end of every
// run) route one row per task with room for all: with BPR task priorities the
// row of task t is task t, so the sets are those of plain position order
// (before, the router refused the priorities for lack of task ids and the run
// failed at its final save).
START_TEST(test_task_route_with_task_priorities_equals_position_order) {
    enum { E = 8, D = 16, N_TASKS = 5, K = 2 };
    tu_rng g;
    tu_seed(&g, 31);
    float gate[E * D], emb[N_TASKS * D], w_pos[N_TASKS * K], w_pri[N_TASKS * K];
    tu_fill_normal(&g, gate, E * D, 1.0f);
    tu_fill_normal(&g, emb, N_TASKS * D, 1.0f);
    moe_router_config pos, pri;
    moe_router_config_default(&pos);
    pos.top_k = K;
    pri = pos;
    pri.slot_order = MOE_SLOT_PRIORITY;
    pri.n_task_priority = N_TASKS;
    for (int t = 0; t < N_TASKS; t++)
        pri.task_priority[t] = N_TASKS - t;
    int s_pos[N_TASKS * K], s_pri[N_TASKS * K];
    ck_assert_int_eq(moe_task_route(s_pos, w_pos, gate, emb, E, D, N_TASKS, &pos), 0);
    ck_assert_msg(moe_task_route(s_pri, w_pri, gate, emb, E, D, N_TASKS, &pri) == 0, "%s",
                  moe_last_error());
    ck_assert_mem_eq(s_pri, s_pos, sizeof s_pos);
    ck_assert_mem_eq(w_pri, w_pos, sizeof w_pos);
}
END_TEST

START_TEST(test_cli_generate) {
    char args[2048], p[900];
    static char out1[65536];
    snprintf(p, sizeof p, "%s/prompts.txt", root);
    FILE *f = fopen(p, "w");
    fputs("abcd=\nzz=\nqwerty=\n", f);
    fclose(f);
    snprintf(args, sizeof args, "generate '%s' --task sort --input '%s' --max-new 6", ckpt, p);
    ck_assert_int_eq(run_moe(args), 0);
    snprintf(out1, sizeof out1, "%s", text("out.txt"));
    int lines = 0;
    for (const char *s = out1; *s; s++)
        lines += *s == '\n';
    ck_assert_int_eq(lines, 3);
    ck_assert_ptr_nonnull(strstr(text("err.txt"), "1: 2/8 (task)"));
    ck_assert_ptr_nonnull(strstr(text("err.txt"), "checkpoint bytes"));
    ck_assert_ptr_nonnull(strstr(text("err.txt"), "peak RSS"));
    snprintf(args, sizeof args, "generate '%s' --task sort --input '%s' --max-new 6 --full-load",
             ckpt, p);
    ck_assert_int_eq(run_moe(args), 0);
    ck_assert_str_eq(text("out.txt"), out1);
    ck_assert_ptr_nonnull(strstr(text("err.txt"), "1: 8/8 (task)"));

    snprintf(args, sizeof args, "generate '%s' --task nosuch --prompt abc=", ckpt);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_ptr_nonnull(strstr(text("err.txt"), "unknown task 'nosuch'"));
    char dir[800];
    snprintf(dir, sizeof dir, "%s/cli_trunc", root);
    rewrite_ckpt(dir, NULL, false);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    ck_assert_int_eq(truncate(p, file_size(p) / 2), 0);
    snprintf(args, sizeof args, "generate '%s' --task sort --prompt abc=", dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_ptr_nonnull(strstr(text("err.txt"), "truncated"));
    snprintf(dir, sizeof dir, "%s/cli_missing", root);
    rewrite_ckpt(dir, "model.layers.0.block_sparse_moe.experts.5.w1.weight", false);
    snprintf(args, sizeof args, "generate '%s' --task sort --prompt abc=", dir);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_ptr_nonnull(strstr(text("err.txt"), "missing tensor"));
    snprintf(args, sizeof args, "generate '%s' --prompt abc=", ckpt);
    ck_assert_int_eq(run_moe(args), 2);
    ck_assert_ptr_nonnull(strstr(text("err.txt"), "--task"));
    snprintf(args, sizeof args,
             "eval '%s' --samples 0 --batches 2 --expert-budget 0.2 --quantize int8", ckpt);
    ck_assert_int_eq(run_moe(args), 0);
    ck_assert_ptr_nonnull(strstr(text("out.txt"), "expert budget + int8 experts"));
    ck_assert_ptr_nonnull(strstr(text("out.txt"), "caesar"));
    ck_assert_int_eq(run_moe("generate --help"), 0);
    ck_assert_ptr_nonnull(strstr(text("out.txt"), "usage: moe generate"));
}
END_TEST

int main(void) {
    Suite *s = suite_create("infer");
    TCase *tc = tcase_create("infer");
    tcase_add_unchecked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_task_load_reads_exactly_the_needed_tensors);
    tcase_add_test(tc, test_sharded_load_reads_index_headers_and_tensors);
    tcase_add_test(tc, test_partial_load_generates_the_full_load_output_bit_for_bit);
    tcase_add_test(tc, test_kv_cache_decode_matches_the_training_forward);
    tcase_add_test(tc, test_other_architectures_decode_and_load_exactly);
    tcase_add_test(tc, test_bad_checkpoints_and_tasks_fail_clearly);
    tcase_add_test(tc, test_reshaped_vector_is_described_with_its_own_rank);
    tcase_add_test(tc, test_task_experts_with_other_tasks_names_them);
    tcase_add_test(tc, test_task_expert_shares_outside_0_1_are_refused);
    tcase_add_test(tc, test_older_checkpoint_without_task_experts_derives_the_sets);
    tcase_add_test(tc, test_expert_budget_and_int8_load_less);
    tcase_add_test(tc, test_int8_rows_at_the_edges_dequantise_within_half_a_step);
    tcase_add_test(tc, test_int8_refuses_non_finite_expert_weights_naming_the_tensor);
    tcase_add_test(tc, test_expert_budget_with_group_limited_routing_routes_to_loaded_experts);
    tcase_add_test(tc, test_expert_budget_on_expert_choice_model_routes_to_loaded_experts);
    tcase_add_test(tc, test_task_route_with_task_priorities_equals_position_order);
    tcase_add_test(tc, test_cli_generate);
    tcase_add_test(tc, test_decode_is_the_same_for_any_thread_count);
    tcase_add_test(tc, test_generate_equals_one_sequence_at_a_time);
    tcase_add_test(tc, test_expert_budget_keeps_shares_at_p_and_the_k_most_used);
    tcase_add_test(tc, test_int8_of_weights_on_the_int8_grid_gives_the_fp32_logits);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
