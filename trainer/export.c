// Export to a Hugging Face MixtralForCausalLM folder: config.json with
// model_type "mixtral" and model.safetensors with the checkpoint's tensors,
// whose names and shapes are already Mixtral's. Byte vocabulary, no tokenizer
// files. What Mixtral cannot express is refused, naming the feature: shared
// experts, per-layer expert counts (pyramid), task-routed layers, dense
// layers between MoE layers, unnormalised top-k weights.
#include "moe/export.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/model.h"
#include "moe/safetensors.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// The features of cfg Mixtral lacks, as one message (empty: none).
static void unsupported(const moe_config *c, char *msg, size_t cap) {
    msg[0] = 0;
#define ADD(...)                                                                                   \
    do {                                                                                           \
        size_t n = strlen(msg);                                                                    \
        snprintf(msg + n, cap - n, "%s", n ? "; " : "");                                           \
        n = strlen(msg);                                                                           \
        snprintf(msg + n, cap - n, __VA_ARGS__);                                                   \
    } while (0)
    if (c->moe.shared_experts)
        ADD("shared experts (moe.shared_experts = %d)", c->moe.shared_experts);
    bool pyramid = false;
    for (int i = 1; i < c->moe.n_num_experts; i++)
        pyramid |= c->moe.num_experts[i] != c->moe.num_experts[0];
    if (pyramid) ADD("a pyramid of expert counts (moe.num_experts is a per-layer list)");
    if (c->moe.n_task_layers) ADD("task routing (moe.task_layers)");
    if (c->moe.every != 1)
        ADD("dense layers between MoE layers (moe.every = %d; Mixtral has MoE in every layer)",
            c->moe.every);
    if (!c->router.normalize_topk)
        ADD("raw top-k weights (router.normalize_topk = false; Mixtral renormalises)");
#undef ADD
}

static int write_config(const char *path, const moe_config *c) {
    const int H = c->moe.d_expert ? c->moe.d_expert : c->model.d_ff;
    json_t *o = json_object();
    json_object_set_new(o, "architectures", json_pack("[s]", "MixtralForCausalLM"));
    json_object_set_new(o, "model_type", json_string("mixtral"));
    json_object_set_new(o, "vocab_size", json_integer(c->model.vocab_size));
    json_object_set_new(o, "hidden_size", json_integer(c->model.d_model));
    json_object_set_new(o, "intermediate_size", json_integer(H));
    json_object_set_new(o, "num_hidden_layers", json_integer(c->model.n_layers));
    json_object_set_new(o, "num_attention_heads", json_integer(c->model.n_heads));
    json_object_set_new(o, "num_key_value_heads", json_integer(c->model.n_kv_heads));
    json_object_set_new(o, "head_dim", json_integer(c->model.d_model / c->model.n_heads));
    json_object_set_new(o, "hidden_act", json_string("silu"));
    json_object_set_new(o, "max_position_embeddings", json_integer(c->model.seq_len));
    json_object_set_new(o, "initializer_range", json_real(0.02));
    json_object_set_new(o, "rms_norm_eps", json_real(c->model.norm_eps));
    json_object_set_new(o, "rope_theta", json_real(c->model.rope_theta));
    json_object_set_new(o, "use_cache", json_true());
    json_object_set_new(o, "sliding_window", json_null());
    json_object_set_new(o, "attention_dropout", json_real(0.0));
    json_object_set_new(o, "num_local_experts", json_integer(c->moe.num_experts[0]));
    json_object_set_new(o, "num_experts_per_tok", json_integer(c->router.top_k));
    json_object_set_new(o, "output_router_logits", json_false());
    json_object_set_new(o, "router_aux_loss_coef", json_real(c->router.aux_loss_coef));
    json_object_set_new(o, "router_jitter_noise", json_real(0.0));
    // lm_head.weight is written out even when tied: the folder is self-contained
    json_object_set_new(o, "tie_word_embeddings", json_false());
    // tokens are bytes (0..255; synthetic task markers 128 + task id); no tokenizer
    json_object_set_new(o, "bos_token_id", json_null());
    json_object_set_new(o, "eos_token_id", json_integer('\n'));
    json_object_set_new(o, "torch_dtype", json_string("float32"));
    json_object_set_new(o, "moe_tokenizer", json_string("bytes"));
    FILE *f = fopen(path, "w");
    int rc = 0;
    if (!f) {
        rc = moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
    } else {
        int bad = json_dumpf(o, f, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
        bad |= fputc('\n', f) == EOF;
        bad |= fclose(f) != 0;
        if (bad) rc = moe_fail(MOE_EIO, "%s: write failed", path);
    }
    json_decref(o);
    return rc;
}

// Every tensor the config's model has must be in the checkpoint with its
// shape: a folder transformers cannot load is not an export.
static int check_tensors(const char *ckpt, const moe_config *c, const moe_st_set *s) {
    moe_model m;
    MOE_TRY(moe_model_init(&m, c, 1, 1, c->data.n_tasks));
    int rc = 0;
    for (int i = 0; i < m.table.count && rc == 0; i++) {
        const moe_param_view *v = &m.table.views[i];
        const moe_st_tensor *t = moe_st_set_find(s, v->name, NULL);
        if (!t) {
            rc = moe_fail(MOE_ENOTFOUND, "%s: missing tensor '%s'", ckpt, v->name);
            break;
        }
        int same = t->ndim == v->ndim;
        for (int d = 0; same && d < v->ndim; d++)
            same = t->shape[d] == v->shape[d];
        if (!same) rc = moe_fail(MOE_EFORMAT, "%s: tensor '%s' has the wrong shape", ckpt, v->name);
    }
    moe_model_free(&m);
    return rc;
}

int moe_export_hf(const char *ckpt, const char *out) {
    moe_config c;
    char rdir[PATH_MAX - 64]; // the resolved folder; room left for the file names below
    MOE_TRY(moe_ckpt_resolve(ckpt, rdir, sizeof rdir, NULL));
    ckpt = rdir;
    MOE_TRY(moe_ckpt_config(ckpt, &c));
    char msg[1024];
    unsupported(&c, msg, sizeof msg);
    if (msg[0])
        return moe_fail(MOE_EINVAL, "%s: Mixtral cannot express %s; not exported", ckpt, msg);
    moe_st_set *s;
    MOE_TRY(moe_st_set_open(ckpt, &s));
    int n = 0, m = 0, rc = 0;
    moe_st_entry *e = NULL;
    void **data = NULL;
    MOE_TRY_GOTO(check_tensors(ckpt, &c, s), rc);
    if (mkdir(out, 0755) != 0 && errno != EEXIST)
        MOE_TRY_GOTO(moe_fail(MOE_EIO, "%s: cannot create: %s", out, strerror(errno)), rc);
    for (int i = 0; i < s->n_files; i++)
        n += s->files[i]->n_tensors;
    e = calloc((size_t)n + 1, sizeof *e);
    data = calloc((size_t)n + 1, sizeof *data);
    if (!e || !data) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "export: out of memory"), rc);
    const moe_st_tensor *embed = NULL;
    for (int i = 0; i < s->n_files; i++)
        for (int j = 0; j < s->files[i]->n_tensors; j++) {
            const moe_st_tensor *t = &s->files[i]->tensors[j];
            MOE_TRY_GOTO(moe_st_load(s->files[i], t->name, t->dtype, -1, NULL, &data[m]), rc);
            e[m] = (moe_st_entry){t->name, t->dtype, t->ndim, {0}, data[m]};
            memcpy(e[m].shape, t->shape, sizeof(int64_t) * t->ndim);
            if (!strcmp(t->name, "model.embed_tokens.weight")) embed = t;
            if (!strcmp(t->name, "lm_head.weight")) embed = NULL, c.model.tie_embeddings = false;
            m++;
        }
    if (c.model.tie_embeddings) { // the tied head as its own tensor
        if (!embed)
            MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: no model.embed_tokens.weight", ckpt), rc);
        for (int i = 0; i < m; i++)
            if (!strcmp(e[i].name, "model.embed_tokens.weight"))
                e[m] = (moe_st_entry){
                    "lm_head.weight", e[i].dtype, 2, {e[i].shape[0], e[i].shape[1]}, e[i].data};
        m++;
    }
    char p[PATH_MAX];
    const char *meta[] = {"format", "pt", NULL};
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    MOE_TRY_GOTO(moe_st_write(p, e, m, meta), rc);
    snprintf(p, sizeof p, "%s/config.json", out);
    MOE_TRY_GOTO(write_config(p, &c), rc);
fail:
    for (int i = 0; data && i < n; i++)
        free(data[i]);
    free(data);
    free(e);
    moe_st_set_close(s);
    return rc;
}
