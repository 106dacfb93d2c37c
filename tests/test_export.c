// moe export --hf: Mixtral config and tensor names/shapes, tied head written
// out, features Mixtral lacks refused by name (exit 2); moe eval
// --dump-logits writes tokens and logits equal to a dropless forward.
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/export.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/safetensors.h"
#include "testutil.h"

#include <jansson.h>
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

int main(void) {
    Suite *s = suite_create("export");
    TCase *tc = tcase_create("export");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_export_writes_a_mixtral_folder);
    tcase_add_test(tc, test_export_refuses_what_mixtral_cannot_express);
    tcase_add_test(tc, test_dump_logits_matches_a_dropless_forward);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
