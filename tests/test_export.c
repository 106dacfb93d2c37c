// moe export --hf: Mixtral config and tensor names/shapes, tied head written
// out, features Mixtral lacks refused by name (exit 2); moe eval
// --dump-logits writes tokens and logits equal to a dropless forward; --task
// writes one task of an all task-routed model (its k experts, a zero gate,
// w2 scaled by k * w_j) and refuses what stands in the way.
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/export.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"
#include "moe/tokenizer.h"
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

START_TEST(test_export_writes_a_mixtral_folder) {
    char root[600], ck[700], out[700], p[800];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    snprintf(out, sizeof out, "%s/hf", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
    ck_assert_int_eq(moe_export_hf(ck, out), 0);
    snprintf(p, sizeof p, "%s/config.json", out);
    json_error_t err;
    json_t *cfg = json_load_file(p, 0, &err);
    ck_assert_ptr_nonnull(cfg);
    ck_assert_str_eq(json_string_value(json_object_get(cfg, "model_type")), "mixtral");
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(cfg, "architectures"), 0)),
                     "MixtralForCausalLM");
    ck_assert_int_eq(json_integer_value(json_object_get(cfg, "num_local_experts")), 4);
    ck_assert_int_eq(json_integer_value(json_object_get(cfg, "num_experts_per_tok")), 2);
    ck_assert_int_eq(json_integer_value(json_object_get(cfg, "num_key_value_heads")), 2);
    ck_assert_int_eq(json_integer_value(json_object_get(cfg, "intermediate_size")), 48);
    ck_assert_int_eq(json_integer_value(json_object_get(cfg, "vocab_size")), 256);
    json_decref(cfg);
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    ck_assert_str_eq(moe_st_meta(f, "format"), "pt");
    const moe_st_tensor *t = moe_st_find(f, "model.layers.1.block_sparse_moe.experts.3.w2.weight");
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(t->shape[0], 32);
    ck_assert_int_eq(t->shape[1], 48);
    t = moe_st_find(f, "model.layers.0.block_sparse_moe.gate.weight");
    ck_assert(t && t->shape[0] == 4 && t->shape[1] == 32);
    ck_assert_ptr_nonnull(moe_st_find(f, "model.layers.0.self_attn.k_proj.weight"));
    // tied embeddings: the head is written out and equals the embedding
    void *head, *emb;
    ck_assert_int_eq(moe_st_load(f, "lm_head.weight", MOE_ST_F32, 2, NULL, &head), 0);
    ck_assert_int_eq(moe_st_load(f, "model.embed_tokens.weight", MOE_ST_F32, 2, NULL, &emb), 0);
    ck_assert_int_eq(memcmp(head, emb, 256 * 32 * sizeof(float)), 0);
    free(head);
    free(emb);
    ck_assert_int_eq(f->n_tensors, 1 + 2 * (6 + 1 + 12) + 1 + 1);
    moe_st_close(f);
}
END_TEST

// moe export --help names what the export writes beyond the tensors:
// user-defined pieces as added tokens, and mini_seq checkpoints.
START_TEST(test_export_help_names_added_tokens_and_mini_seq) {
    const char *dir = tu_tmpdir();
    ck_assert_int_eq(tu_run_moe(dir, "export --help"), 0);
    const char *out = tu_file_text(dir, "out.txt");
    ck_assert_msg(strstr(out, "user-defined pieces (<|user|>) are non-special added tokens"), "%s",
                  out);
    ck_assert_msg(strstr(out, "memory.mini_seq"), "%s", out);
}
END_TEST

START_TEST(test_export_refuses_what_mixtral_cannot_express) {
    char root[600], ck[700], out[700];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(out, sizeof out, "%s/hf", root);
    struct {
        const char *set[2], *word;
    } cases[] = {
        {{"moe.shared_experts=1", ""}, "shared experts"},
        {{"moe.num_experts=[4,8]", ""}, "pyramid"},
        {{"moe.task_layers=[1]", ""}, "task routing"},
        {{"moe.every=2", ""}, "dense layers"},
        {{"router.normalize_topk=false", ""}, "normalize_topk"},
        {{"router.score=sigmoid", ""}, "router.score"},
        {{"router.route_scale=2.5", ""}, "router.route_scale"},
        {{"router.n_groups=2", "router.topk_groups=1"}, "router.topk_groups = 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moe_config c = tu_ckpt_config();
        for (int j = 0; j < 2; j++)
            if (cases[i].set[j][0]) ck_assert_int_eq(moe_config_set(&c, NULL, cases[i].set[j]), 0);
        snprintf(ck, sizeof ck, "%s/ck%zu", root, i);
        tu_save_checkpoint(&c, ck);
        ck_assert_int_eq(moe_export_hf(ck, out), MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), cases[i].word), "%s", moe_last_error());
        ck_assert_ptr_nonnull(strstr(moe_last_error(), "Mixtral cannot express"));
    }
    // the binary: exit 2 with the message
    const char *bin = getenv("MOE_BIN");
    ck_assert_ptr_nonnull(bin);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' export '%s/ck2' --hf '%s' 2>'%s/err.txt'", bin, root, out,
             root);
    int st = system(cmd);
    ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2);
}
END_TEST

// Groups that leave no expert out route as Mixtral does: they export.
START_TEST(test_export_accepts_groups_without_a_limit) {
    char root[600], ck[700], out[700];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    const char *sets[][2] = {{"router.n_groups=4", "router.topk_groups=4"},
                             {"router.n_groups=4", "router.topk_groups=0"},
                             {"router.n_groups=1", "router.topk_groups=1"}};
    for (int i = 0; i < 3; i++) {
        moe_config c = tu_ckpt_config();
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i][0]), 0);
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i][1]), 0);
        snprintf(ck, sizeof ck, "%s/ck%d", root, i);
        snprintf(out, sizeof out, "%s/hf%d", root, i);
        tu_save_checkpoint(&c, ck);
        ck_assert_msg(moe_export_hf(ck, out) == 0, "%s", moe_last_error());
    }
}
END_TEST

START_TEST(test_dump_logits_matches_a_dropless_forward) {
    char root[600], ck[700], dump[800], cmd[2048];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    moe_config c = tu_ckpt_config();
    c.router.capacity_factor = 0.5; // the dump must ignore capacity
    tu_save_checkpoint(&c, ck);
    snprintf(dump, sizeof dump, "%s/logits.safetensors", root);
    snprintf(cmd, sizeof cmd,
             "'%s' eval '%s' --samples 0 --batches 1 --dump-logits '%s' >/dev/null",
             getenv("MOE_BIN"), ck, dump);
    int st = system(cmd);
    ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(dump, &f), 0);
    int64_t shape[3];
    void *tok, *lg, *task;
    ck_assert_int_eq(moe_st_load(f, "tokens", MOE_ST_I32, 2, shape, &tok), 0);
    ck_assert(shape[0] == 2 && shape[1] == 16);
    ck_assert_int_eq(moe_st_load(f, "task_ids", MOE_ST_I32, 1, NULL, &task), 0);
    ck_assert_int_eq(moe_st_load(f, "logits", MOE_ST_F32, 3, shape, &lg), 0);
    ck_assert(shape[0] == 2 && shape[1] == 16 && shape[2] == 256);
    moe_config lc;
    ck_assert_int_eq(moe_ckpt_config(ck, &lc), 0);
    moe_model m;
    ck_assert_int_eq(moe_model_init(&m, &lc, 1, 16, 5), 0);
    ck_assert_int_eq(moe_ckpt_load(ck, &m, NULL, NULL), 0);
    m.dropless = true;
    for (int r = 0; r < 2; r++) {
        ck_assert_int_eq(moe_model_forward(&m, (int32_t *)tok + r * 16, NULL, (int32_t *)task + r,
                                           1, 16, false, 0),
                         0);
        ck_assert_int_eq(memcmp(m.logits, (float *)lg + r * 16 * 256, 16 * 256 * sizeof(float)), 0);
    }
    moe_model_free(&m);
    free(tok);
    free(lg);
    free(task);
    moe_st_close(f);
}
END_TEST

// A model whose two layers both route by task (tasks copy and reverse),
// trained a few steps by the binary; its run folder in dir/run.
static void train_task_model(const char *dir) {
    char args[1200];
    snprintf(args, sizeof args,
             "train %s/configs/tiny.json --set model.d_model=32 --set model.n_layers=2 "
             "--set model.d_ff=48 --set model.seq_len=32 --set train.batch_size=4 "
             "--set train.eval_every=0 --set 'moe.task_layers=[0,1]' "
             "--set 'data.tasks=[copy,reverse]' --steps 5 --quiet --out '%s/run'",
             MOE_SOURCE_DIR, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
}

static float *load_f32(moe_st_file *f, const char *name, int64_t *shape) {
    void *d = NULL;
    ck_assert_msg(moe_st_load(f, name, MOE_ST_F32, -1, shape, &d) == 0, "%s", moe_last_error());
    return d;
}

START_TEST(test_task_export_writes_the_tasks_experts_with_scaled_w2) {
    const char *root = tu_tmpdir();
    char run[700], ck[700], out[800], p[900], name[160];
    train_task_model(root);
    snprintf(run, sizeof run, "%s/run", root);
    ck_assert_int_eq(moe_ckpt_resolve(run, ck, sizeof ck, NULL), 0);
    moe_st_set *s;
    ck_assert_int_eq(moe_st_set_open(ck, &s), 0);
    const int E = 8, k = 2, D = 32;
    const char *tasks[] = {"copy", "reverse"};
    moe_router_config rc;
    moe_router_config_default(&rc);
    for (int t = 0; t < 2; t++) {
        snprintf(out, sizeof out, "%s/hf-%s", root, tasks[t]);
        ck_assert_msg(moe_export_hf_task(run, out, tasks[t]) == 0, "%s", moe_last_error());
        snprintf(p, sizeof p, "%s/config.json", out);
        json_error_t err;
        json_t *cfg = json_load_file(p, 0, &err);
        ck_assert_ptr_nonnull(cfg);
        ck_assert_int_eq(json_integer_value(json_object_get(cfg, "num_local_experts")), k);
        ck_assert_int_eq(json_integer_value(json_object_get(cfg, "num_experts_per_tok")), k);
        ck_assert_str_eq(json_string_value(json_object_get(cfg, "moe_task")), tasks[t]);
        json_decref(cfg);
        snprintf(p, sizeof p, "%s/model.safetensors", out);
        moe_st_file *x;
        ck_assert_int_eq(moe_st_open(p, &x), 0);
        for (int l = 0; l < 2; l++) {
            moe_st_file *f;
            int64_t sh[4];
            snprintf(name, sizeof name, "model.layers.%d.block_sparse_moe.gate.weight", l);
            ck_assert_ptr_nonnull(moe_st_set_find(s, name, &f));
            float *gate = load_f32(f, name, sh);
            float *zg = load_f32(x, name, sh);
            ck_assert(sh[0] == k && sh[1] == D);
            for (int i = 0; i < k * D; i++)
                ck_assert(zg[i] == 0.0f);
            snprintf(name, sizeof name, "model.layers.%d.block_sparse_moe.task_embedding.weight",
                     l);
            ck_assert_ptr_nonnull(moe_st_set_find(s, name, &f));
            ck_assert_ptr_null(moe_st_find(x, name));
            float *emb = load_f32(f, name, sh);
            int set[2 * 2];
            ck_assert_int_eq(moe_task_expert_set(set, gate, emb, E, D, 2, &rc), 0);
            // the router's weights by hand: softmax over E, renormalised over the top k
            double lg[8], mx = -1e300, z = 0, pk = 0;
            for (int e = 0; e < E; e++) {
                lg[e] = 0;
                for (int d = 0; d < D; d++)
                    lg[e] += (double)emb[t * D + d] * gate[e * D + d];
                mx = fmax(mx, lg[e]);
            }
            for (int e = 0; e < E; e++)
                z += exp(lg[e] - mx);
            for (int j = 0; j < k; j++)
                pk += exp(lg[set[t * k + j]] - mx) / z;
            for (int j = 0; j < k; j++) {
                const int c = set[t * k + j];
                const double factor = k * (exp(lg[c] - mx) / z) / pk;
                for (int w = 1; w <= 3; w++) {
                    snprintf(name, sizeof name,
                             "model.layers.%d.block_sparse_moe.experts.%d.w%d.weight", l, c, w);
                    ck_assert_ptr_nonnull(moe_st_set_find(s, name, &f));
                    int64_t n0[4], n1[4];
                    float *src = load_f32(f, name, n0);
                    snprintf(name, sizeof name,
                             "model.layers.%d.block_sparse_moe.experts.%d.w%d.weight", l, j, w);
                    float *dst = load_f32(x, name, n1);
                    ck_assert(n0[0] == n1[0] && n0[1] == n1[1]);
                    const size_t n = (size_t)n0[0] * n0[1];
                    if (w != 2) {
                        ck_assert_int_eq(memcmp(src, dst, n * sizeof(float)), 0);
                    } else {
                        for (size_t i = 0; i < n; i++)
                            ck_assert_msg(fabs(dst[i] - src[i] * factor) <=
                                              1e-6 * fabs(src[i] * factor) + 1e-12,
                                          "layer %d expert %d w2[%zu]: %g, expected %g", l, j, i,
                                          dst[i], src[i] * factor);
                    }
                    free(src);
                    free(dst);
                }
            }
            snprintf(name, sizeof name, "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l,
                     k);
            ck_assert_ptr_null(moe_st_find(x, name)); // only the task's k experts
            free(gate);
            free(zg);
            free(emb);
        }
        moe_st_close(x);
    }
    moe_st_set_close(s);
}
END_TEST

// memory.mini_seq (with recompute) only saves activation memory in training:
// such a checkpoint exports, every tensor byte-equal to the checkpoint's.
START_TEST(test_export_of_a_mini_seq_checkpoint_writes_its_tensors) {
    const char *root = tu_tmpdir();
    char args[2400], run[700], ck[700], out[800], p[900];
    snprintf(args, sizeof args,
             "train %s/configs/tiny.json --set model.d_model=32 --set model.n_layers=2 "
             "--set model.d_ff=48 --set model.seq_len=32 --set train.batch_size=4 "
             "--set train.eval_every=0 --set memory.mini_seq=2 --set memory.recompute=moe "
             "--steps 3 --quiet --out '%s/run'",
             MOE_SOURCE_DIR, root);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    snprintf(run, sizeof run, "%s/run", root);
    snprintf(out, sizeof out, "%s/hf", root);
    snprintf(args, sizeof args, "export '%s' --hf '%s'", run, out);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    ck_assert_int_eq(moe_ckpt_resolve(run, ck, sizeof ck, NULL), 0);
    moe_st_set *s;
    ck_assert_int_eq(moe_st_set_open(ck, &s), 0);
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    moe_st_file *x;
    ck_assert_int_eq(moe_st_open(p, &x), 0);
    int same = 0;
    for (int i = 0; i < x->n_tensors; i++) {
        const char *name = x->tensors[i].name;
        moe_st_file *f;
        // the tied head is written out: it equals the embedding
        const char *src = strcmp(name, "lm_head.weight") || moe_st_set_find(s, name, &f)
                              ? name
                              : "model.embed_tokens.weight";
        ck_assert_msg(moe_st_set_find(s, src, &f) != NULL, "%s: not in the checkpoint", src);
        int64_t a[4], b[4];
        float *want = load_f32(f, src, a), *got = load_f32(x, name, b);
        ck_assert(a[0] == b[0] && a[1] == b[1]);
        const size_t n = (size_t)a[0] * (x->tensors[i].ndim > 1 ? (size_t)a[1] : 1);
        ck_assert_msg(memcmp(want, got, n * sizeof(float)) == 0, "%s differs", name);
        same++;
        free(want);
        free(got);
    }
    ck_assert_int_eq(same, 1 + 2 * (6 + 1 + 3 * 8) + 1 + 1);
    moe_st_close(x);
    moe_st_set_close(s);
}
END_TEST

// A SentencePiece BPE model with two user-defined symbols (ids 3 and 4 after
// <unk>, <s>, </s>): "<|user|>" and a piece of 1000 bytes (500 x U+00E9);
// a checkpoint of the tiny model with it as model.tokenizer, exported to
// root/hf. The long piece into long_piece (1001 bytes).
static void export_user_symbols(const char *root, char *long_piece) {
    char cmd[4000], model[500], ck[700], out[700];
    for (int i = 0; i < 500; i++)
        memcpy(long_piece + 2 * i, "\xc3\xa9", 2);
    long_piece[1000] = 0;
    snprintf(model, sizeof model, "%s/ud.model", root);
    snprintf(cmd, sizeof cmd,
             "spm_train --input=" MOE_SOURCE_DIR "/README.md --model_prefix='%s/ud' "
             "--vocab_size=400 --model_type=bpe --byte_fallback=true "
             "'--user_defined_symbols=<|user|>,%s' >/dev/null 2>&1",
             root, long_piece);
    ck_assert_int_eq(system(cmd), 0);
    moe_config c = tu_ckpt_config();
    ck_assert_int_eq(moe_config_set(&c, NULL, "model.vocab_size=512"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.kind=bin"), 0); // token files, not bytes
    snprintf(c.data.path, sizeof c.data.path, "%s/unused.bin", root);
    snprintf(c.model.tokenizer, sizeof c.model.tokenizer, "%s", model);
    snprintf(ck, sizeof ck, "%s/ck", root);
    snprintf(out, sizeof out, "%s/hf", root);
    ck_assert_msg(moe_config_check(&c, NULL) == 0, "%s", moe_last_error());
    tu_save_checkpoint(&c, ck);
    ck_assert_msg(moe_export_hf(ck, out) == 0, "%s", moe_last_error());
}

static json_t *load_json(const char *root, const char *name) {
    char p[900];
    json_error_t je;
    snprintf(p, sizeof p, "%s/hf/%s", root, name);
    json_t *j = json_load_file(p, 0, &je);
    ck_assert_msg(j != NULL, "%s: %s", p, je.text);
    return j;
}

// The added token of id in added_tokens: its content and special flag;
// never normalized (the text is matched as written).
static void assert_added(json_t *added, int id, const char *content, bool special) {
    for (size_t i = 0; i < json_array_size(added); i++) {
        json_t *a = json_array_get(added, i);
        if (json_integer_value(json_object_get(a, "id")) != id) continue;
        ck_assert_str_eq(json_string_value(json_object_get(a, "content")), content);
        ck_assert(json_is_boolean(json_object_get(a, "special")));
        ck_assert_int_eq(json_is_true(json_object_get(a, "special")), special);
        ck_assert(json_is_false(json_object_get(a, "normalized")));
        return;
    }
    ck_abort_msg("no added token %d", id);
}

// User-defined pieces stay whole in transformers as in SentencePiece: added
// tokens, not special, at their ids in the vocabulary; a control piece stays
// special. Each piece, 1000 bytes long too, is written whole.
START_TEST(test_export_writes_user_defined_pieces_as_added_tokens) {
    if (!moe_tok_have_sentencepiece()) return; // the build reads no .model
    const char *root = tu_tmpdir();
    char long_piece[1001];
    export_user_symbols(root, long_piece);
    json_t *tj = load_json(root, "tokenizer.json");
    json_t *added = json_object_get(tj, "added_tokens");
    ck_assert_int_eq(json_array_size(added), 5);
    assert_added(added, 0, "<unk>", true);
    assert_added(added, 1, "<s>", true);
    assert_added(added, 2, "</s>", true);
    assert_added(added, 3, "<|user|>", false);
    assert_added(added, 4, long_piece, false);
    json_t *model = json_object_get(tj, "model");
    json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    ck_assert_int_eq(json_object_size(vocab), 400);
    ck_assert_int_eq(json_integer_value(json_object_get(vocab, "<|user|>")), 3);
    ck_assert_int_eq(json_integer_value(json_object_get(vocab, long_piece)), 4);
    for (size_t i = 0; i < json_array_size(merges); i++) { // none builds an added token
        json_t *m = json_array_get(merges, i);
        char joined[2048];
        snprintf(joined, sizeof joined, "%s%s", json_string_value(json_array_get(m, 0)),
                 json_string_value(json_array_get(m, 1)));
        ck_assert_str_ne(joined, "<|user|>");
    }
    json_decref(tj);
    json_t *tc = load_json(root, "tokenizer_config.json");
    json_t *dec = json_object_get(tc, "added_tokens_decoder");
    ck_assert_int_eq(json_object_size(dec), 5);
    json_t *user = json_object_get(dec, "3"), *lp = json_object_get(dec, "4");
    ck_assert_str_eq(json_string_value(json_object_get(user, "content")), "<|user|>");
    ck_assert(json_is_false(json_object_get(user, "special")));
    ck_assert(json_is_false(json_object_get(user, "normalized")));
    ck_assert_str_eq(json_string_value(json_object_get(lp, "content")), long_piece);
    ck_assert(json_is_true(json_object_get(json_object_get(dec, "1"), "special")));
    ck_assert_str_eq(json_string_value(json_object_get(tc, "bos_token")), "<s>");
    json_decref(tc);
}
END_TEST

START_TEST(test_task_export_refuses_a_token_routed_layer) {
    char ck[700], out[700];
    snprintf(ck, sizeof ck, "%s/ck", tu_tmpdir());
    snprintf(out, sizeof out, "%s/hf", tu_tmpdir());
    moe_config c = tu_ckpt_config();
    ck_assert_int_eq(moe_config_set(&c, NULL, "moe.task_layers=[1]"), 0);
    tu_save_checkpoint(&c, ck);
    ck_assert_int_eq(moe_export_hf_task(ck, out, "copy"), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "token-routed MoE layers (layer 0;"), "%s",
                  moe_last_error());
}
END_TEST

START_TEST(test_task_export_refuses_an_unknown_task_with_a_suggestion) {
    const char *root = tu_tmpdir();
    char run[700], args[2000];
    train_task_model(root);
    snprintf(run, sizeof run, "%s/run", root);
    char out[800];
    snprintf(out, sizeof out, "%s/hf", root);
    ck_assert_int_eq(moe_export_hf_task(run, out, "revers"), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "did you mean reverse?"), "%s", moe_last_error());
    snprintf(args, sizeof args, "export '%s' --hf '%s' --task revers", run, out);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(root, "err.txt"), "unknown task 'revers'"));
}
END_TEST

START_TEST(test_task_routed_export_without_task_suggests_it) {
    const char *root = tu_tmpdir();
    char run[700], out[800];
    train_task_model(root);
    snprintf(run, sizeof run, "%s/run", root);
    snprintf(out, sizeof out, "%s/hf", root);
    ck_assert_int_eq(moe_export_hf(run, out), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "--task NAME, NAME one of copy, reverse"), "%s",
                  moe_last_error());
}
END_TEST

int main(void) {
    Suite *s = suite_create("export");
    TCase *tc = tcase_create("export");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_export_writes_a_mixtral_folder);
    tcase_add_test(tc, test_export_refuses_what_mixtral_cannot_express);
    tcase_add_test(tc, test_export_help_names_added_tokens_and_mini_seq);
    tcase_add_test(tc, test_export_accepts_groups_without_a_limit);
    tcase_add_test(tc, test_dump_logits_matches_a_dropless_forward);
    tcase_add_test(tc, test_task_export_writes_the_tasks_experts_with_scaled_w2);
    tcase_add_test(tc, test_task_export_refuses_a_token_routed_layer);
    tcase_add_test(tc, test_task_export_refuses_an_unknown_task_with_a_suggestion);
    tcase_add_test(tc, test_task_routed_export_without_task_suggests_it);
    tcase_add_test(tc, test_export_of_a_mini_seq_checkpoint_writes_its_tensors);
    tcase_add_test(tc, test_export_writes_user_defined_pieces_as_added_tokens);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
