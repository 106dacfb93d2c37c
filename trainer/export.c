// Export to a Hugging Face MixtralForCausalLM folder: config.json with
// model_type "mixtral" and model.safetensors with the checkpoint's tensors,
// whose names and shapes are already Mixtral's. A byte vocabulary has no
// tokenizer files; a SentencePiece one (model.tokenizer) is written as
// transformers' LlamaTokenizer reads it: tokenizer.model, tokenizer.json (BPE
// models; trainer/export_tokenizer.c), tokenizer_config.json and
// special_tokens_map.json, so AutoTokenizer loads the folder. What Mixtral
// cannot express is refused, naming the feature: shared experts, per-layer
// expert counts (pyramid), task-routed layers, dense layers between MoE
// layers, unnormalised top-k weights, sigmoid scores, route_scale != 1,
// group-limited routing, a non-zero expert selection bias (a zero one is left
// out), expert choice without a token-choice fallback.
//
// One task of a model whose every layer is task-routed exports exactly
// (--task): the task embedding is only the gate input, so each layer sends
// all of the task's tokens to the same k experts c_j with the same weights
// w_j (the layer's own router on the task's logits, so softmax or sigmoid,
// renormalisation and route_scale are all in w_j), y = sum_j w_j FFN_c_j(x).
// The Mixtral written has k experts (c_1..c_k), top-k = k and an all-zero
// gate: softmax of equal logits gives each expert 1/k, so expert j's w2 is
// scaled by k * w_j. Equal up to float rounding (the scale is folded into w2).
// Capacity cannot drop tokens there: moe's inference (generate, eval
// --dump-logits) routes dropless, as Mixtral does.
#include "moe/export.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/model.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"
#include "moe/tokenizer.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// Every layer routes by task (MoE in every layer): one task is a Mixtral.
static bool all_task_routed(const moe_config *c) {
    if (c->moe.every != 1) return false;
    for (int l = 0; l < c->model.n_layers; l++) {
        bool in = false;
        for (int i = 0; i < c->moe.n_task_layers; i++)
            in |= c->moe.task_layers[i] == l;
        if (!in) return false;
    }
    return true;
}

// "copy, reverse": the config's task names for messages.
static void task_list(const moe_config *c, char *buf, size_t cap) {
    char names[MOE_MAX_TASKS][MOE_NAME_MAX];
    int n = moe_config_task_names(c, names);
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        size_t len = strlen(buf);
        snprintf(buf + len, cap - len, "%s%s", i ? ", " : "", names[i]);
    }
}

#define ADD(...)                                                                                   \
    do {                                                                                           \
        size_t n_ = strlen(msg);                                                                   \
        snprintf(msg + n_, cap - n_, "%s", n_ ? "; " : "");                                        \
        n_ = strlen(msg);                                                                          \
        snprintf(msg + n_, cap - n_, __VA_ARGS__);                                                 \
    } while (0)

// Shared experts, a pyramid of expert counts and dense layers between MoE
// layers: no export can write them. Adds them to msg; true if any.
static bool layout_unsupported(const moe_config *c, char *msg, size_t cap) {
    size_t before = strlen(msg);
    if (c->moe.shared_experts)
        ADD("shared experts (moe.shared_experts = %d)", c->moe.shared_experts);
    bool pyramid = false;
    for (int i = 1; i < c->moe.n_num_experts; i++)
        pyramid |= c->moe.num_experts[i] != c->moe.num_experts[0];
    if (pyramid) ADD("a pyramid of expert counts (moe.num_experts is a per-layer list)");
    if (c->moe.every != 1)
        ADD("dense layers between MoE layers (moe.every = %d; Mixtral has MoE in every layer)",
            c->moe.every);
    return strlen(msg) > before;
}

// What stands in the way of exporting one task (--task) as an exact Mixtral
// (empty: nothing). The router's options need no check: they are all in the
// task's fixed weights.
static void task_unsupported(const moe_config *c, char *msg, size_t cap) {
    msg[0] = 0;
    layout_unsupported(c, msg, cap);
    char list[256] = "";
    for (int l = 0; l < c->model.n_layers; l++) {
        bool in = false;
        for (int i = 0; i < c->moe.n_task_layers; i++)
            in |= c->moe.task_layers[i] == l;
        if (!in && moe_config_is_moe(c, l)) {
            size_t n = strlen(list);
            snprintf(list + n, sizeof list - n, "%s%d", n ? ", " : "", l);
        }
    }
    if (list[0])
        ADD("token-routed MoE layers (layer %s; --task needs every layer in moe.task_layers)",
            list);
}

// The features of cfg Mixtral lacks, as one message (empty: none).
static void unsupported(const moe_config *c, char *msg, size_t cap) {
    msg[0] = 0;
    const bool layout = layout_unsupported(c, msg, cap);
    if (c->moe.n_task_layers && all_task_routed(c) && !layout) {
        char tasks[MOE_MAX_TASKS * (MOE_NAME_MAX + 2)];
        task_list(c, tasks, sizeof tasks);
        ADD("task routing (moe.task_layers; every layer routes by task, so one task exports "
            "exactly: --task NAME, NAME one of %s)",
            tasks);
        return; // the router options below are folded into the task's weights
    }
    if (c->moe.n_task_layers) ADD("task routing (moe.task_layers)");
    if (!c->router.normalize_topk)
        ADD("raw top-k weights (router.normalize_topk = false; Mixtral renormalises)");
    if (c->router.score != MOE_SCORE_SOFTMAX)
        ADD("sigmoid routing scores (router.score = sigmoid; Mixtral uses softmax)");
    if (c->router.type == MOE_ROUTER_EXPERT_CHOICE &&
        c->router.ec_fallback != MOE_EC_FALLBACK_TOKEN_CHOICE)
        ADD("expert-choice routing (router.type = expert_choice; Mixtral routes token choice, "
            "allowed with router.ec_fallback = token_choice)");
    if (c->router.route_scale != 1.0)
        ADD("scaled routing weights (router.route_scale = %g; Mixtral has no scale)",
            c->router.route_scale);
    if (moe_router_groups_active(&c->router))
        ADD("group-limited routing (router.n_groups = %d, router.topk_groups = %d; Mixtral "
            "picks its top-k among all experts, allowed with topk_groups = 0 or n_groups)",
            c->router.n_groups, c->router.topk_groups);
}
#undef ADD

// A JSON document to path through the counted calls (moe/fsio.h), so a
// test can fail any write of an export.
static int dump_json(const char *path, json_t *o) {
    int rc =
        moe_fs_write_json(path, o, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
    json_decref(o);
    return rc;
}

// The piece of id as a JSON string, or null when the tokenizer has no such token.
static json_t *piece_json(const moe_tokenizer *t, int id) {
    char *piece;
    if (id < 0 || moe_tok_piece_dup(t, id, &piece) < 0) return json_null();
    json_t *j = json_string(piece);
    free(piece);
    return j ? j : json_null();
}

// tokenizer_config.json's added_tokens_decoder ({"id": {"content": ...}}), as
// transformers saves it: the control and unknown pieces, special, and the
// user-defined ones (spm_train --user_defined_symbols), not special: both are
// matched whole, never normalized, as in tokenizer.json's added_tokens.
static json_t *added_tokens_decoder(const moe_tokenizer *t) {
    json_t *o = json_object();
    for (int id = 0; o && id < moe_tok_vocab_size(t); id++) {
        const bool user = moe_tok_piece_type(t, id) == MOE_TOK_USER_DEFINED;
        if (!user && !moe_tok_is_special(t, id)) continue;
        char key[16];
        snprintf(key, sizeof key, "%d", id);
        json_object_set_new(o, key,
                            json_pack("{s:o, s:b, s:b, s:b, s:b, s:b}", "content",
                                      piece_json(t, id), "lstrip", 0, "normalized", 0, "rstrip", 0,
                                      "single_word", 0, "special", !user));
    }
    return o;
}

// The files an export writes. Each is written under a temp name first
// (NAME.export-tmp) and renamed into place only when all are written, so a
// failed export over an earlier one leaves the earlier one as it was.
enum { F_MODEL, F_CONFIG, F_TOK_MODEL, F_TOK_JSON, F_TOK_CONFIG, F_TOK_MAP, N_OUT_FILES };
static const char *const out_files[N_OUT_FILES] = {
    "model.safetensors", "config.json",           "tokenizer.model",
    "tokenizer.json",    "tokenizer_config.json", "special_tokens_map.json"};

#define TMP ".export-tmp"
#define OLD ".export-old" // an earlier export's file, moved aside while the new one goes in

// out/NAME plus suffix ("", TMP or OLD); moe_export_hf_task checks the length.
static void out_path(char *p, size_t cap, const char *out, int f, const char *suffix) {
    snprintf(p, cap, "%s/%s%s", out, out_files[f], suffix);
}

// tokenizer.model, tokenizer_config.json (LlamaTokenizer: BOS added before
// the text, no EOS, the SentencePiece model's own pieces for the specials)
// and special_tokens_map.json, under their temp names; wrote[f] marks each.
static int write_tokenizer(const char *out, const moe_tokenizer *t, int seq_len, bool *wrote) {
    char p[PATH_MAX];
    size_t len;
    const void *bytes = moe_tok_model_bytes(t, &len);
    out_path(p, sizeof p, out, F_TOK_MODEL, TMP);
    wrote[F_TOK_MODEL] = true; // a failed write removes its file itself; cleanup is harmless
    MOE_TRY(moe_fs_write_file(p, bytes, len));
    if (moe_tok_model_type(t) == 2) { // BPE; transformers converts the others itself
        out_path(p, sizeof p, out, F_TOK_JSON, TMP);
        wrote[F_TOK_JSON] = true;
        MOE_TRY(moe_export_tokenizer_json(p, t));
    }
    const int bos = moe_tok_bos_id(t), eos = moe_tok_eos_id(t);
    json_t *o = json_object();
    json_object_set_new(o, "tokenizer_class", json_string("LlamaTokenizer"));
    json_object_set_new(o, "add_bos_token", json_boolean(bos >= 0));
    json_object_set_new(o, "add_eos_token", json_false());
    json_object_set_new(o, "bos_token", piece_json(t, bos));
    json_object_set_new(o, "eos_token", piece_json(t, eos));
    json_object_set_new(o, "unk_token", piece_json(t, 0));
    json_object_set_new(o, "pad_token", json_null());
    json_object_set_new(o, "added_tokens_decoder", added_tokens_decoder(t));
    // legacy: text encodes exactly as SentencePiece encodes it (what moe does)
    json_object_set_new(o, "legacy", json_true());
    json_object_set_new(o, "clean_up_tokenization_spaces", json_false());
    json_object_set_new(o, "model_max_length", json_integer(seq_len));
    out_path(p, sizeof p, out, F_TOK_CONFIG, TMP);
    wrote[F_TOK_CONFIG] = true;
    MOE_TRY(dump_json(p, o));
    o = json_object();
    json_object_set_new(o, "bos_token", piece_json(t, bos));
    json_object_set_new(o, "eos_token", piece_json(t, eos));
    json_object_set_new(o, "unk_token", piece_json(t, 0));
    out_path(p, sizeof p, out, F_TOK_MAP, TMP);
    wrote[F_TOK_MAP] = true;
    return dump_json(p, o);
}

// task: the exported task (NULL: the whole model), whose k experts are the
// Mixtral's num_local_experts.
static int write_config(const char *path, const moe_config *c, const moe_tokenizer *t,
                        const char *task) {
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
    json_object_set_new(o, "num_local_experts",
                        json_integer(task ? c->router.top_k : c->moe.num_experts[0]));
    json_object_set_new(o, "num_experts_per_tok", json_integer(c->router.top_k));
    json_object_set_new(o, "output_router_logits", json_false());
    json_object_set_new(o, "router_aux_loss_coef", json_real(c->router.aux_loss_coef));
    json_object_set_new(o, "router_jitter_noise", json_real(0.0));
    // lm_head.weight is written out even when tied: the folder is self-contained
    json_object_set_new(o, "tie_word_embeddings", json_false());
    if (t) { // the SentencePiece model's BOS and EOS (-1: it has none)
        const int bos = moe_tok_bos_id(t), eos = moe_tok_eos_id(t);
        json_object_set_new(o, "bos_token_id", bos >= 0 ? json_integer(bos) : json_null());
        json_object_set_new(o, "eos_token_id", eos >= 0 ? json_integer(eos) : json_null());
    } else { // bytes (0..255; synthetic task markers 128 + task id); no tokenizer
        json_object_set_new(o, "bos_token_id", json_null());
        json_object_set_new(o, "eos_token_id", json_integer('\n'));
    }
    json_object_set_new(o, "torch_dtype", json_string("float32"));
    json_object_set_new(o, "moe_tokenizer", json_string(t ? "sentencepiece" : "bytes"));
    if (task) { // what scripts/hf_check.py selects the task's rows of a logits dump by
        json_object_set_new(o, "moe_task", json_string(task));
        json_object_set_new(o, "moe_task_id", json_integer(moe_config_task_index(c, task)));
    }
    return dump_json(path, o);
}

// The checkpoint must hold exactly the tensors of the model its config
// describes, each F32 with the view's shape (what moe_ckpt_load demands): a
// folder eval refuses, or a config.json edited to fewer layers than the
// weights hold, is not exported as a different model.
static int check_tensors(const char *ckpt, const moe_config *c, const moe_st_set *s) {
    // The model's parameter table lists the views: training's memory savings
    // (memory.mini_seq chunks, memory.recompute) change no weight, and chunks
    // need at least as many tokens as chunks, so they are off here, as
    // moe_model_init_table turns the parallel settings off.
    moe_config one = *c;
    one.memory.mini_seq = 1;
    snprintf(one.memory.recompute, sizeof one.memory.recompute, "none");
    moe_model m;
    MOE_TRY(moe_model_init_table(&m, &one, c->data.n_tasks));
    int rc = 0;
    char have[160], want[160];
    for (int i = 0; i < m.table.count; i++) {
        const moe_param_view *v = &m.table.views[i];
        moe_st_file *f = NULL;
        const moe_st_tensor *t = moe_st_set_find(s, v->name, &f);
        if (!t) MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: missing tensor '%s'", ckpt, v->name), rc);
        int same = t->dtype == MOE_ST_F32 && t->ndim == v->ndim;
        for (int d = 0; same && d < v->ndim; d++)
            same = t->shape[d] == v->shape[d];
        if (same) continue;
        moe_st_describe(have, sizeof have, t->dtype, t->ndim, t->shape);
        moe_st_describe(want, sizeof want, MOE_ST_F32, v->ndim, v->shape);
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: tensor '%s' is %s, the config expects %s", f->path,
                              v->name, have, want),
                     rc);
    }
    for (int i = 0; i < s->n_files; i++)
        for (int j = 0; j < s->files[i]->n_tensors; j++) {
            const char *name = s->files[i]->tensors[j].name;
            int bl = moe_ckpt_bias_layer(name); // checked and handled by check_bias
            if (!moe_param_table_find(&m.table, name) && !(bl >= 0 && bl < m.L && m.is_moe[bl]))
                MOE_TRY_GOTO(moe_fail(MOE_EFORMAT,
                                      "%s: tensor '%s' does not belong to the model of config.json "
                                      "(%d layers, %d experts)",
                                      s->files[i]->path, name, c->model.n_layers,
                                      c->moe.num_experts[0]),
                             rc);
        }
fail:
    moe_model_free(&m);
    return rc;
}

// The selection bias of auxiliary-loss-free balancing shifts which experts
// Mixtral's router would pick; only an all-zero bias (or none) exports.
static int check_bias(const char *ckpt, const moe_config *c, const moe_st_set *s) {
    const int E = c->moe.num_experts[0];
    float *b = malloc(sizeof(float) * (size_t)E);
    if (!b) return moe_fail(MOE_ENOMEM, "export: out of memory");
    int rc = 0;
    for (int l = 0; l < c->model.n_layers && rc == 0; l++) {
        bool found = false;
        rc = moe_ckpt_bias_read(s, ckpt, l, E, b, &found);
        for (int e = 0; rc == 0 && found && e < E; e++)
            if (b[e] != 0.0f)
                rc = moe_fail(MOE_EINVAL,
                              "%s: Mixtral cannot express an expert selection bias (tensor "
                              "'" MOE_CKPT_BIAS_FMT
                              "' is non-zero: trained with router.bias_update_rate = %g); not "
                              "exported",
                              ckpt, l, c->router.bias_update_rate);
    }
    free(b);
    return rc;
}

static bool has_file(const char *dir, const char *name) {
    char p[PATH_MAX];
    struct stat sb;
    return snprintf(p, sizeof p, "%s/%s", dir, name) < (int)sizeof p && lstat(p, &sb) == 0;
}

// A config.json written by a previous export (it carries moe_tokenizer): the
// only config.json an export may replace.
static bool is_export(const char *dir) {
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s/config.json", dir) >= (int)sizeof p) return false;
    FILE *f;
    if (moe_fopen_regular(p, &f) < 0) return false;
    json_error_t jerr;
    json_t *doc = json_loadf(f, 0, &jerr);
    fclose(f);
    bool yes = json_is_string(json_object_get(doc, "moe_tokenizer"));
    json_decref(doc);
    return yes;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

// "a, b, c and 2 more": the entries of dir in name order (an unreadable folder
// lists nothing; the caller only asks about a folder that exists).
static int list_entries(const char *dir, char *buf, size_t cap) {
    buf[0] = 0;
    DIR *d = opendir(dir);
    if (!d) return moe_fail(MOE_EIO, "%s: cannot read the folder: %s", dir, strerror(errno));
    char *names[3];
    int n = 0, total = 0;
    for (struct dirent *de; (de = readdir(d));) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        total++;
        if (n < 3) {
            names[n] = strdup(de->d_name);
            if (names[n]) n++;
        } else { // keep the three first in name order
            qsort(names, 3, sizeof *names, cmp_name);
            if (strcmp(de->d_name, names[2]) < 0) {
                char *c = strdup(de->d_name);
                if (c) free(names[2]), names[2] = c;
            }
        }
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_name);
    for (int i = 0; i < n; i++) {
        size_t len = strlen(buf);
        snprintf(buf + len, cap - len, "%s%s", i ? ", " : "", names[i]);
        free(names[i]);
    }
    if (total > n) {
        size_t len = strlen(buf);
        snprintf(buf + len, cap - len, " and %d more", total - n);
    }
    return total;
}

// The export writes out/config.json, out/model.safetensors and the tokenizer
// files. It may not land in the checkpoint it reads (or a folder inside it),
// and an existing out must be empty or a previous export (its config.json
// carries moe_tokenizer): a user's files, a training checkpoint, or foreign
// tokenizer files AutoTokenizer would load beside a byte model's export are
// never replaced or mixed in.
static int check_out_dir(const char *ckpt, const char *out) {
    struct stat sb;
    bool exists = stat(out, &sb) == 0;
    if (!exists && errno != ENOENT) // a link loop: mkdir would find it there
        return moe_fail(MOE_EINVAL, "%s: cannot use: %s", out, strerror(errno));
    if (!exists && lstat(out, &sb) == 0)
        return moe_fail(MOE_EINVAL, "%s: a symbolic link to nothing: export to a folder", out);
    if (exists && !S_ISDIR(sb.st_mode))
        return moe_fail(MOE_EINVAL, "%s: exists and is not a folder", out);
    int within = moe_path_within(out, ckpt);
    if (within)
        return moe_fail(MOE_EINVAL, "%s: %s the checkpoint %s; export to a folder outside it", out,
                        within == 2 ? "is inside" : "is", ckpt);
    if (!exists) return 0;
    // A training checkpoint, single-file or sharded (its optimizer index).
    static const char *const ckpt_files[] = {"trainer_state.json", "optimizer.safetensors",
                                             "optimizer.safetensors.index.json"};
    for (int i = 0; i < 3; i++)
        if (has_file(out, ckpt_files[i]))
            return moe_fail(MOE_EINVAL, "%s: holds a checkpoint (%s); export to another folder",
                            out, ckpt_files[i]);
    if (is_export(out)) return 0;
    char list[1024];
    int n = list_entries(out, list, sizeof list);
    if (n < 0) return n;
    if (n > 0)
        return moe_fail(MOE_EINVAL,
                        "%s: holds files no export wrote (%s); export to a new or empty folder "
                        "or over an earlier export",
                        out, list);
    return 0;
}

// The task's experts (ascending) and weights in every layer, set and w
// [L * k]: the layer's own GEMM and router on the checkpoint's gate and task
// embeddings, as training and moe generate compute them.
static int task_routes(const moe_config *c, moe_st_set *s, int task, int *set, float *w) {
    const int L = c->model.n_layers, k = c->router.top_k, D = c->model.d_model;
    int rc = 0;
    for (int l = 0; l < L && rc == 0; l++) {
        void *gate = NULL, *emb = NULL;
        int64_t gs[2], es[2];
        int *all = NULL;
        float *wall = NULL;
        rc = moe_ckpt_task_router(s, l, D, &gate, gs, &emb, es);
        if (rc == 0 && es[0] <= task)
            rc = moe_fail(MOE_EFORMAT, "layer %d: %lld task embeddings, task %d expected", l,
                          (long long)es[0], task);
        if (rc == 0) {
            all = malloc(sizeof(int) * (size_t)es[0] * k);
            wall = malloc(sizeof(float) * (size_t)es[0] * k);
            if (!all || !wall) rc = moe_fail(MOE_ENOMEM, "export: out of memory");
        }
        if (rc == 0)
            rc = moe_task_route(all, wall, gate, emb, (int)gs[0], D, (int)es[0], &c->router);
        if (rc == 0) {
            memcpy(set + (size_t)l * k, all + (size_t)task * k, sizeof(int) * k);
            memcpy(w + (size_t)l * k, wall + (size_t)task * k, sizeof(float) * k);
        }
        free(gate);
        free(emb);
        free(all);
        free(wall);
    }
    return rc;
}

// The tensor name under which the task export writes checkpoint tensor
// name (Mixtral expert j for the task's j-th expert), into buf; the factor
// *scale its data is multiplied by (k * w_j for w2, else 1); *zero: written as
// zeros (the gate). Returns false for a tensor left out (other experts, the
// task embeddings).
static bool task_tensor(const char *name, int k, const int *set, const float *w, char *buf,
                        size_t cap, float *scale, bool *zero) {
    int l, e, len = 0, len2 = 0;
    *scale = 1.0f, *zero = false;
    snprintf(buf, cap, "%s", name);
    if (sscanf(name, "model.layers.%d.block_sparse_moe.%n", &l, &len) != 1 || len == 0) return true;
    const char *rest = name + len;
    if (!strcmp(rest, "task_embedding.weight")) return false;
    if (!strcmp(rest, "gate.weight")) {
        *zero = true;
        return true;
    }
    if (sscanf(rest, "experts.%d.%n", &e, &len2) != 1 || len2 == 0) return true;
    for (int j = 0; j < k; j++)
        if (set[(size_t)l * k + j] == e) {
            snprintf(buf, cap, "model.layers.%d.block_sparse_moe.experts.%d.%s", l, j, rest + len2);
            if (!strncmp(rest + len2, "w2.", 3)) *scale = (float)k * w[(size_t)l * k + j];
            return true;
        }
    return false;
}

int moe_export_hf(const char *ckpt, const char *out) {
    return moe_export_hf_task(ckpt, out, NULL);
}

struct export_args {
    const char *out, *task;
};

static int export_read(const char *ckpt, void *ctx);

// Through moe_ckpt_read_retry: a train.keep_checkpoints = 0 save that
// replaces the folder between the resolve and the reads exports the new one.
// Every read comes before out is touched, and a failed export leaves out as
// it was, so a retry starts clean.
int moe_export_hf_task(const char *ckpt, const char *out, const char *task) {
    struct export_args a = {out, task};
    return moe_ckpt_read_retry(ckpt, export_read, &a);
}

// moe_export_hf_task of the resolved folder ckpt.
static int export_read(const char *ckpt, void *ctx) {
    const char *out = ((struct export_args *)ctx)->out, *task = ((struct export_args *)ctx)->task;
    moe_config c;
    // room left for the file names below
    if (strlen(ckpt) >= PATH_MAX - 64) return moe_fail(MOE_EINVAL, "%s: path too long", ckpt);
    MOE_TRY(moe_ckpt_config(ckpt, &c));
    char msg[4096];
    int task_id = -1;
    if (task) {
        task_unsupported(&c, msg, sizeof msg);
        if (msg[0])
            return moe_fail(MOE_EINVAL,
                            "%s: --task %s exports one task only when every layer routes by "
                            "task; in the way: %s; not exported",
                            ckpt, task, msg);
        MOE_TRY(task_id = moe_config_task_index(&c, task));
    } else {
        unsupported(&c, msg, sizeof msg);
        if (msg[0])
            return moe_fail(MOE_EINVAL, "%s: Mixtral cannot express %s; not exported", ckpt, msg);
    }
    const int k = c.router.top_k, D = c.model.d_model;
    moe_tokenizer *tok = NULL; // opened (and checked) before anything is written
    MOE_TRY(moe_ckpt_tokenizer(ckpt, &c, &tok));
    moe_st_set *s = NULL;
    int n = 0, m = 0, rc = 0;
    bool created = false;
    // per file: temp written, final moved aside, new one in place
    bool wrote[N_OUT_FILES] = {false}, moved[N_OUT_FILES] = {false}, placed[N_OUT_FILES] = {false};
    char p[PATH_MAX];
    moe_st_entry *e = NULL;
    void **data = NULL;
    int *set = NULL;
    float *w = NULL;
    char(*names)[160] = NULL;
    MOE_TRY_GOTO(moe_st_set_open(ckpt, &s), rc);
    MOE_TRY_GOTO(check_tensors(ckpt, &c, s), rc);
    MOE_TRY_GOTO(check_bias(ckpt, &c, s), rc);
    moe_task_experts te; // checked as every reader checks it; absent in older checkpoints
    rc = moe_ckpt_task_experts(ckpt, &c, s, &te);
    if (rc == 0) moe_task_experts_free(&te);
    if (rc == MOE_ENOTFOUND) rc = 0;
    if (rc < 0) goto fail;
    if (task) {
        set = malloc(sizeof(int) * (size_t)c.model.n_layers * k);
        w = malloc(sizeof(float) * (size_t)c.model.n_layers * k);
        if (!set || !w) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "export: out of memory"), rc);
        MOE_TRY_GOTO(task_routes(&c, s, task_id, set, w), rc);
    }
    if (strlen(out) + sizeof "/special_tokens_map.json" OLD > PATH_MAX)
        MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: path too long", out), rc);
    MOE_TRY_GOTO(check_out_dir(ckpt, out), rc);
    for (int i = 0; i < s->n_files; i++)
        n += s->files[i]->n_tensors;
    e = calloc((size_t)n + 1, sizeof *e);
    data = calloc((size_t)n + 1, sizeof *data);
    names = calloc((size_t)n + 1, sizeof *names);
    if (!e || !data || !names) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "export: out of memory"), rc);
    const moe_st_tensor *embed = NULL;
    for (int i = 0; i < s->n_files; i++)
        for (int j = 0; j < s->files[i]->n_tensors; j++) {
            const moe_st_tensor *t = &s->files[i]->tensors[j];
            if (moe_ckpt_bias_layer(t->name) >= 0) continue; // all zero (check_bias)
            float scale = 1.0f;
            bool zero = false;
            snprintf(names[m], sizeof names[m], "%s", t->name);
            if (task && !task_tensor(t->name, k, set, w, names[m], sizeof names[m], &scale, &zero))
                continue;
            e[m] = (moe_st_entry){names[m], t->dtype, t->ndim, {0}, NULL};
            memcpy(e[m].shape, t->shape, sizeof(int64_t) * t->ndim);
            if (zero) { // the task export's gate: k equal logits
                data[m] = calloc((size_t)k * D, sizeof(float));
                if (!data[m]) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "export: out of memory"), rc);
                e[m].shape[0] = k;
            } else {
                MOE_TRY_GOTO(moe_st_load(s->files[i], t->name, t->dtype, -1, NULL, &data[m]), rc);
            }
            if (scale != 1.0f) { // w_j folded into expert j's w2 (Mixtral weighs each 1/k)
                float *x = data[m];
                for (int64_t r = 0; r < t->shape[0] * t->shape[1]; r++)
                    x[r] *= scale;
            }
            e[m].data = data[m];
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
    // Every tensor is read (and checked finite) before out is touched: a
    // checkpoint that cannot be exported leaves no folder behind.
    if (mkdir(out, 0755) == 0)
        created = true;
    else if (errno != EEXIST)
        MOE_TRY_GOTO(moe_fail(MOE_EIO, "%s: cannot create: %s", out, strerror(errno)), rc);
    const char *meta[] = {"format", "pt", NULL};
    out_path(p, sizeof p, out, F_MODEL, TMP);
    wrote[F_MODEL] = true;
    MOE_TRY_GOTO(moe_st_write(p, e, m, meta), rc);
    out_path(p, sizeof p, out, F_CONFIG, TMP);
    wrote[F_CONFIG] = true;
    MOE_TRY_GOTO(write_config(p, &c, tok, task), rc);
    if (tok) MOE_TRY_GOTO(write_tokenizer(out, tok, c.model.seq_len, wrote), rc);
    // All written: into place. The earlier export's files are first moved
    // aside (NAME.export-old) so that a failed rename puts them back; those
    // this export does not write (a tokenizer.json AutoTokenizer would load)
    // go with them.
    for (int f = 0; f < N_OUT_FILES; f++) {
        char old[PATH_MAX];
        out_path(p, sizeof p, out, f, "");
        out_path(old, sizeof old, out, f, OLD);
        struct stat sb;
        if (lstat(p, &sb) != 0) continue;
        if (moe_fs_rename(p, old) != 0)
            MOE_TRY_GOTO(moe_fail(MOE_EIO, "%s: cannot move the earlier export's file aside: %s", p,
                                  strerror(errno)),
                         rc);
        moved[f] = true;
    }
    for (int f = 0; f < N_OUT_FILES; f++) {
        char tmp[PATH_MAX];
        out_path(tmp, sizeof tmp, out, f, TMP);
        out_path(p, sizeof p, out, f, "");
        if (!wrote[f]) continue;
        if (moe_fs_rename(tmp, p) != 0)
            MOE_TRY_GOTO(
                moe_fail(MOE_EIO, "%s: cannot rename %s into place: %s", p, tmp, strerror(errno)),
                rc);
        wrote[f] = false, placed[f] = true;
    }
    moe_fs_fsync_dir(out); // best effort: the files are in place by then
fail:
    // Not counted below: the failure being handled may be an injected one.
    for (int f = 0; f < N_OUT_FILES; f++) {
        char old[PATH_MAX];
        out_path(p, sizeof p, out, f, "");
        out_path(old, sizeof old, out, f, OLD);
        if (rc < 0 && placed[f]) unlink(p);
        if (rc < 0 && moved[f]) rename(old, p); // the earlier export back
        if (rc == 0 && moved[f]) unlink(old);
        out_path(p, sizeof p, out, f, TMP);
        if (wrote[f]) unlink(p); // this call's temp files
    }
    if (rc < 0 && created) rmdir(out);
    for (int i = 0; data && i < n; i++)
        free(data[i]);
    free(data);
    free(e);
    free(names);
    free(set);
    free(w);
    if (s) moe_st_set_close(s);
    moe_tok_free(tok);
    return rc;
}
