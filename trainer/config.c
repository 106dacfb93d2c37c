// Run configuration: one table of keys (type, default, meaning) drives the
// defaults, JSON loading, --set overrides, --help-config and the resolved
// config written next to a run. router.* and capacity.* values are parsed by
// the router's own setter, so both CLIs accept exactly the same text.
#include "moe/config.h"
#include "moe/error.h"
#include "moe/parse.h"
#include "trainer/json_pos.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef enum { K_INT, K_U64, K_DBL, K_BOOL, K_STR, K_ENUM, K_INTS, K_DBLS, K_STRS } kind;

typedef struct {
    const char *key;
    kind kind;
    size_t off;         // offset of the value in moe_config
    size_t count_off;   // lists: offset of the int element count
    const char *def;    // default, as --set text
    const char *values; // K_STR/K_ENUM: allowed values "a|b|c" (K_ENUM stores the index)
    const char *doc;
} key_def;

#define F(field) offsetof(moe_config, field)
#define NO 0
static const key_def keys[] = {
    {"model.vocab_size", K_INT, F(model.vocab_size), NO, "256", NULL,
     "vocabulary size (256: byte tokenizer)"},
    {"model.d_model", K_INT, F(model.d_model), NO, "128", NULL, "hidden size"},
    {"model.n_layers", K_INT, F(model.n_layers), NO, "4", NULL, "decoder layers"},
    {"model.n_heads", K_INT, F(model.n_heads), NO, "4", NULL, "attention (query) heads"},
    {"model.n_kv_heads", K_INT, F(model.n_kv_heads), NO, "2", NULL,
     "key/value heads (GQA; divides n_heads)"},
    {"model.d_ff", K_INT, F(model.d_ff), NO, "256", NULL, "dense SwiGLU hidden size"},
    {"model.seq_len", K_INT, F(model.seq_len), NO, "64", NULL, "tokens per sequence"},
    {"model.rope_theta", K_DBL, F(model.rope_theta), NO, "10000", NULL, "RoPE base"},
    {"model.norm_eps", K_DBL, F(model.norm_eps), NO, "1e-5", NULL, "RMSNorm epsilon"},
    {"model.tie_embeddings", K_BOOL, F(model.tie_embeddings), NO, "true", NULL,
     "LM head shares the embedding matrix"},
    {"moe.num_experts", K_INTS, F(moe.num_experts), F(moe.n_num_experts), "8", NULL,
     "experts per MoE layer: one number, or a list with one entry per MoE layer (pyramid)"},
    {"moe.d_expert", K_INT, F(moe.d_expert), NO, "0", NULL,
     "expert FFN hidden size (0: model.d_ff)"},
    {"moe.every", K_INT, F(moe.every), NO, "1", NULL,
     "layer i is MoE when (i+1) % every == 0; 0: dense model"},
    {"moe.shared_experts", K_INT, F(moe.shared_experts), NO, "0", NULL,
     "shared (residual) experts applied to every token: 0 or 1"},
    {"moe.task_layers", K_INTS, F(moe.task_layers), F(moe.n_task_layers), "[]", NULL,
     "MoE layers routed by task id (Task-MoE) instead of by token"},
    {"router.top_k", K_INT, F(router.top_k), NO, "2", NULL, "experts per token"},
    {"router.capacity_factor", K_DBL, F(router.capacity_factor), NO, "1.25", NULL,
     "C = max(min_capacity, ceil(k*T/E * factor)); <= 0: dropless"},
    {"router.min_capacity", K_INT, F(router.min_capacity), NO, "4", NULL,
     "lower bound of every expert's capacity"},
    {"router.slot_order", K_ENUM, F(router.slot_order), NO, "position", "position|priority",
     "position: token order; priority: Batch Prioritized Routing"},
    {"router.normalize_topk", K_BOOL, F(router.normalize_topk), NO, "true", NULL,
     "renormalise kept choices' weights to sum 1"},
    {"router.noise", K_ENUM, F(router.noise), NO, "none", "none|jitter|gumbel",
     "training noise on the routing decision"},
    {"router.noise_eps", K_DBL, F(router.noise_eps), NO, "0.01", NULL, "jitter half-width"},
    {"router.aux_loss_coef", K_DBL, F(router.aux_loss_coef), NO, "0.01", NULL,
     "load-balancing loss weight"},
    {"router.z_loss_coef", K_DBL, F(router.z_loss_coef), NO, "0.001", NULL, "z-loss weight"},
    {"router.aux_counts_all_k", K_BOOL, F(router.aux_counts_all_k), NO, "false", NULL,
     "aux loss counts all k choices (HF Mixtral) instead of the first"},
    {"router.task_priority", K_DBLS, F(router.task_priority), F(router.n_task_priority), "[]", NULL,
     "priority per task id for the priority slot order (higher first)"},
    {"router.seed", K_U64, F(router.seed), NO, "0", NULL, "seed of the routing noise"},
    {"capacity.mode", K_ENUM, F(router.capacity_mode), NO, "static", "static|dynamic",
     "dynamic: per-expert capacity from the measured load"},
    {"capacity.ema", K_DBL, F(router.ema), NO, "0.9", NULL, "EMA factor of the measured load"},
    {"capacity.headroom", K_DBL, F(router.headroom), NO, "0.1", NULL,
     "C_e = ceil(load_e * (1 + headroom))"},
    {"capacity.update_every", K_INT, F(router.update_every), NO, "1", NULL,
     "steps between capacity updates"},
    {"capacity.capacity_factor_max", K_DBL, F(router.capacity_factor_max), NO, "2.0", NULL,
     "upper bound of C_e as a capacity factor"},
    {"train.steps", K_INT, F(train.steps), NO, "300", NULL, "optimizer steps"},
    {"train.batch_size", K_INT, F(train.batch_size), NO, "16", NULL, "sequences per micro-batch"},
    {"train.lr", K_DBL, F(train.lr), NO, "3e-3", NULL, "peak learning rate"},
    {"train.min_lr_ratio", K_DBL, F(train.min_lr_ratio), NO, "0.1", NULL,
     "cosine schedule floor as a fraction of lr"},
    {"train.warmup_steps", K_INT, F(train.warmup_steps), NO, "30", NULL, "linear warmup steps"},
    {"train.weight_decay", K_DBL, F(train.weight_decay), NO, "0.1", NULL,
     "AdamW decay (not on norms and embeddings unless train.decay_all)"},
    {"train.decay_all", K_BOOL, F(train.decay_all), NO, "false", NULL,
     "apply train.weight_decay to norm weights and embeddings too"},
    {"train.beta1", K_DBL, F(train.beta1), NO, "0.9", NULL, "AdamW beta1"},
    {"train.beta2", K_DBL, F(train.beta2), NO, "0.95", NULL, "AdamW beta2"},
    {"train.grad_clip", K_DBL, F(train.grad_clip), NO, "1.0", NULL,
     "global gradient-norm clip (0: off)"},
    {"train.grad_accum", K_INT, F(train.grad_accum), NO, "1", NULL,
     "micro-batches per optimizer step"},
    {"train.seed", K_U64, F(train.seed), NO, "1337", NULL, "seed of init and data order"},
    {"train.device", K_STR, F(train.device), NO, "cpu", "cpu|cuda",
     "compute device (moe train --device); cuda needs a CUDA build and a GPU"},
    {"train.compute", K_STR, F(train.compute), NO, "fp32", "fp32|bf16",
     "GEMM precision on the GPU: bf16 tensor cores with fp32 weights and accumulation"},
    {"train.eval_every", K_INT, F(train.eval_every), NO, "100", NULL,
     "steps between validation passes (0: only at the end)"},
    {"train.ckpt_every", K_INT, F(train.ckpt_every), NO, "0", NULL,
     "steps between checkpoints (0: only at the end)"},
    {"train.log_every", K_INT, F(train.log_every), NO, "10", NULL,
     "steps between progress lines when not on a terminal"},
    {"data.kind", K_STR, F(data.kind), NO, "synthetic", "synthetic|bin|text",
     "synthetic multi-task corpus, llm.c .bin tokens, or UTF-8 text (bytes)"},
    {"data.path", K_STR, F(data.path), NO, "", NULL, "data file for bin and text"},
    {"data.tasks", K_STRS, F(data.tasks), F(data.n_tasks),
     "[\"copy\",\"reverse\",\"sort\",\"add\",\"caesar\"]", NULL, "synthetic tasks"},
    {"data.val_fraction", K_DBL, F(data.val_fraction), NO, "0.1", NULL,
     "share of the data held out for validation"},
    {"parallel.ep", K_INT, F(parallel.ep), NO, "1", NULL, "expert-parallel group size"},
    {"comm.all_to_all", K_STR, F(comm.all_to_all), NO, "flat", "flat|hierarchical",
     "all-to-all algorithm"},
    {"comm.ranks_per_node", K_INT, F(comm.ranks_per_node), NO, "0", NULL,
     "ranks per node for hierarchical all-to-all (0: detect)"},
    {"comm.timeout_s", K_DBL, F(comm.timeout_s), NO, "300", NULL,
     "seconds a collective may make no progress before the job ends naming the stuck rank "
     "(0: wait forever)"},
    {"loss.impl", K_STR, F(loss.impl), NO, "plain", "plain|cce",
     "LM-head loss: plain logits, or cut cross-entropy (no [tokens, vocab] logits)"},
    {"loss.cce_filter", K_BOOL, F(loss.cce_filter), NO, "true", NULL,
     "cce backward skips vocabulary tiles whose probabilities are below float epsilon"},
    {"memory.mini_seq", K_INT, F(memory.mini_seq), NO, "1", NULL,
     "chunks per sequence in MLP/MoE and LM head"},
    {"memory.recompute", K_STR, F(memory.recompute), NO, "none", "none|moe|all",
     "moe: FFN/MoE blocks and the LM head keep one chunk and recompute it in backward "
     "(needs memory.mini_seq > 1); all: also attention, from each layer's input"},
};
#undef F
#define N_KEYS ((int)(sizeof keys / sizeof keys[0]))

struct moe_config_src {
    int n;
    struct {
        char key[JSON_POS_KEY];
        char where[MOE_PATH_MAX + 32];
    } e[N_KEYS];
};

static const key_def *find_key(const char *key) {
    for (int i = 0; i < N_KEYS; i++)
        if (!strcmp(keys[i].key, key)) return &keys[i];
    return NULL;
}

moe_config_src *moe_config_src_new(void) {
    return calloc(1, sizeof(moe_config_src));
}
void moe_config_src_free(moe_config_src *src) {
    free(src);
}

static void src_note(moe_config_src *src, const char *key, const char *where) {
    if (!src) return;
    int i = 0;
    while (i < src->n && strcmp(src->e[i].key, key))
        i++;
    if (i == N_KEYS) return;
    if (i == src->n) src->n++;
    snprintf(src->e[i].key, sizeof src->e[i].key, "%s", key);
    snprintf(src->e[i].where, sizeof src->e[i].where, "%s", where);
}

// "file:line:col" or "--set key" or "default" for error messages.
static const char *src_where(const moe_config_src *src, const char *key) {
    if (src)
        for (int i = 0; i < src->n; i++)
            if (!strcmp(src->e[i].key, key)) return src->e[i].where;
    return "default";
}

// Where a combination of two keys went wrong: a's location, or b's when only
// b was set (a file that sets n_heads = 3 against the default n_kv_heads is
// at fault where it sets n_heads).
static const char *src_where2(const moe_config_src *src, const char *a, const char *b) {
    const char *w = src_where(src, a);
    return strcmp(w, "default") ? w : src_where(src, b);
}

static int in_values(const char *values, const char *v) {
    size_t n = strlen(v);
    for (const char *p = values; p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, v, n)) return 1;
        p = bar ? bar + 1 : NULL;
    }
    return 0;
}

// Splits "[a, b]" or "a,b" into items; item i is copied into item.
static int list_item(const char *v, int i, char *item, size_t cap) {
    while (*v == ' ' || *v == '[')
        v++;
    for (int k = 0; k < i; k++) {
        v = strchr(v, ',');
        if (!v) return 0;
        v++;
    }
    while (*v == ' ' || *v == '"')
        v++;
    size_t n = 0;
    while (*v && *v != ',' && *v != ']' && *v != '"' && n + 1 < cap)
        item[n++] = *v++;
    while (n && item[n - 1] == ' ')
        n--;
    item[n] = 0;
    return n > 0;
}

// Sets one key from text. Router keys go through the router's setter.
static int set_text(moe_config *cfg, const key_def *k, const char *v) {
    char *base = (char *)cfg;
    if (!strncmp(k->key, "router.", 7) || !strncmp(k->key, "capacity.", 9)) {
        char flat[1024];
        if (k->kind == K_DBLS) { // router's setter takes "1,2,3"
            size_t n = 0;
            char item[64];
            flat[0] = 0;
            for (int i = 0; list_item(v, i, item, sizeof item); i++)
                n += snprintf(flat + n, sizeof flat - n, "%s%s", i ? "," : "", item);
            v = flat;
        }
        return moe_router_config_set(&cfg->router, k->key, v);
    }
    switch (k->kind) {
    case K_INT:
        MOE_TRY(moe_parse_int(k->key, v, INT32_MIN, INT32_MAX, (int *)(base + k->off)));
        return 0;
    case K_U64:
        return moe_parse_u64(k->key, v, (uint64_t *)(base + k->off));
    case K_DBL:
        MOE_TRY(moe_parse_double(k->key, v, (double *)(base + k->off)));
        return 0;
    case K_BOOL:
        if (strcmp(v, "true") && strcmp(v, "false"))
            return moe_fail(MOE_EINVAL, "%s = '%s': expected true or false", k->key, v);
        *(bool *)(base + k->off) = !strcmp(v, "true");
        return 0;
    case K_STR: {
        size_t cap = !strcmp(k->key, "data.path") ? MOE_PATH_MAX : MOE_NAME_MAX;
        if (strlen(v) >= cap)
            return moe_fail(MOE_EINVAL, "%s: value longer than %zu characters", k->key, cap - 1);
        if (k->values && !in_values(k->values, v))
            return moe_fail(MOE_EINVAL, "%s = '%s': expected one of %s", k->key, v, k->values);
        snprintf(base + k->off, cap, "%s", v);
        return 0;
    }
    case K_INTS:
    case K_STRS: {
        char item[MOE_NAME_MAX + 8]; // longer names are cut here and rejected below
        int count = 0, max = k->kind == K_INTS ? MOE_MAX_LAYERS : MOE_MAX_TASKS;
        for (; list_item(v, count, item, sizeof item); count++) {
            if (count == max) return moe_fail(MOE_EINVAL, "%s: more than %d entries", k->key, max);
            if (k->kind == K_INTS) {
                MOE_TRY(moe_parse_int(k->key, item, INT32_MIN, INT32_MAX,
                                      (int *)(base + k->off) + count));
            } else {
                if (strlen(item) >= MOE_NAME_MAX)
                    return moe_fail(MOE_EINVAL, "%s: name '%s' too long", k->key, item);
                memcpy(base + k->off + (size_t)count * MOE_NAME_MAX, item, strlen(item) + 1);
            }
        }
        *(int *)(base + k->count_off) = count;
        return 0;
    }
    default:
        return moe_fail(MOE_EINVAL, "%s: cannot be set", k->key);
    }
}

void moe_config_default(moe_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    moe_router_config_default(&cfg->router);
    for (int i = 0; i < N_KEYS; i++) {
        int rc = set_text(cfg, &keys[i], keys[i].def);
        (void)rc; // defaults are constants the tests load; they cannot fail
    }
}

int moe_config_set(moe_config *cfg, moe_config_src *src, const char *assignment) {
    const char *eq = strchr(assignment, '=');
    if (!eq) return moe_fail(MOE_EINVAL, "--set %s: expected key=value", assignment);
    char key[JSON_POS_KEY];
    snprintf(key, sizeof key, "%.*s", (int)(eq - assignment), assignment);
    const key_def *k = find_key(key);
    if (!k) return moe_fail(MOE_EINVAL, "--set %s: unknown key '%s'", assignment, key);
    int rc = set_text(cfg, k, eq + 1);
    if (rc < 0) return moe_fail(rc, "--set: %s", moe_last_error());
    char where[JSON_POS_KEY + 8];
    snprintf(where, sizeof where, "--set %s", key);
    src_note(src, key, where);
    return 0;
}

// JSON value -> --set text, checking the JSON type against the key's kind.
static int json_text(const key_def *k, json_t *v, char *out, size_t cap) {
    const char *want = NULL;
    switch (k->kind) {
    case K_INT:
    case K_U64:
        if (!json_is_integer(v))
            want = "an integer";
        else
            snprintf(out, cap, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        break;
    case K_DBL:
        if (!json_is_number(v))
            want = "a number";
        else
            snprintf(out, cap, "%.17g", json_number_value(v));
        break;
    case K_BOOL:
        if (!json_is_boolean(v))
            want = "true or false";
        else
            snprintf(out, cap, "%s", json_is_true(v) ? "true" : "false");
        break;
    case K_STR:
    case K_ENUM:
        if (!json_is_string(v))
            want = "a string";
        else
            snprintf(out, cap, "%s", json_string_value(v));
        break;
    case K_INTS:
    case K_DBLS:
    case K_STRS: {
        if (k->kind == K_INTS && json_is_integer(v)) {
            snprintf(out, cap, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
            break;
        }
        if (!json_is_array(v)) {
            want = k->kind == K_INTS ? "an integer or a list of integers" : "a list";
            break;
        }
        size_t i, n = 0;
        json_t *item;
        out[0] = 0;
        json_array_foreach(v, i, item) {
            int ok = k->kind == K_INTS   ? json_is_integer(item)
                     : k->kind == K_DBLS ? json_is_number(item)
                                         : json_is_string(item);
            if (!ok) {
                want = k->kind == K_INTS   ? "a list of integers"
                       : k->kind == K_DBLS ? "a list of numbers"
                                           : "a list of strings";
                break;
            }
            if (k->kind == K_STRS && strchr(json_string_value(item), ','))
                return moe_fail(MOE_EINVAL, "%s: names may not contain ','", k->key);
            if (k->kind == K_STRS)
                n += snprintf(out + n, cap - n, "%s%s", i ? "," : "", json_string_value(item));
            else
                n += snprintf(out + n, cap - n, "%s%.17g", i ? "," : "", json_number_value(item));
            if (n >= cap) return moe_fail(MOE_EINVAL, "%s: list too long", k->key);
        }
        break;
    }
    }
    if (want) return moe_fail(MOE_EINVAL, "%s must be %s", k->key, want);
    return 0;
}

int moe_config_load(moe_config *cfg, moe_config_src *src, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return moe_fail(MOE_EIO, "%s: cannot open: %s", path, strerror(errno));
    fclose(f);
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) return moe_fail(MOE_EINVAL, "%s:%d:%d: %s", path, jerr.line, jerr.column, jerr.text);
    int rc = 0, npos = 0;
    json_pos *pos = NULL;
    char *text = NULL;
    // Re-read the text for key positions (jansson keeps none).
    f = fopen(path, "rb");
    if (f && fseek(f, 0, SEEK_END) == 0) {
        long len = ftell(f);
        rewind(f);
        text = len >= 0 ? calloc((size_t)len + 1, 1) : NULL;
        if (text && fread(text, 1, (size_t)len, f) == (size_t)len) {
            pos = calloc(2 * N_KEYS + 64, sizeof *pos);
            if (pos) npos = json_pos_scan(text, pos, 2 * N_KEYS + 64);
        }
    }
    if (f) fclose(f);
#define WHERE(key)                                                                                 \
    (json_pos_find(pos, npos, key) ? json_pos_find(pos, npos, key)->line : 1),                     \
        (json_pos_find(pos, npos, key) ? json_pos_find(pos, npos, key)->col : 1)
    if (!json_is_object(root)) {
        rc = moe_fail(MOE_EINVAL, "%s:1:1: the config must be a JSON object", path);
        goto fail;
    }
    const char *section;
    json_t *obj;
    json_object_foreach(root, section, obj) {
        int known = 0;
        for (int i = 0; i < N_KEYS && !known; i++)
            known = !strncmp(keys[i].key, section, strlen(section)) &&
                    keys[i].key[strlen(section)] == '.';
        if (!known) {
            rc = moe_fail(MOE_EINVAL,
                          "%s:%d:%d: unknown section '%s' (moe train --help-config "
                          "lists the keys)",
                          path, WHERE(section), section);
            goto fail;
        }
        if (!json_is_object(obj)) {
            rc = moe_fail(MOE_EINVAL, "%s:%d:%d: '%s' must be an object of keys", path,
                          WHERE(section), section);
            goto fail;
        }
        const char *name;
        json_t *v;
        json_object_foreach(obj, name, v) {
            char key[JSON_POS_KEY], text_v[2048], where[MOE_PATH_MAX + 32];
            snprintf(key, sizeof key, "%s.%s", section, name);
            snprintf(where, sizeof where, "%s:%d:%d", path, WHERE(key));
            const key_def *k = find_key(key);
            if (!k) {
                rc = moe_fail(MOE_EINVAL,
                              "%s: unknown key '%s' (moe train --help-config lists "
                              "the keys)",
                              where, key);
                goto fail;
            }
            rc = json_text(k, v, text_v, sizeof text_v);
            if (rc == 0) rc = set_text(cfg, k, text_v);
            if (rc < 0) {
                rc = moe_fail(rc, "%s: %s", where, moe_last_error());
                goto fail;
            }
            src_note(src, key, where);
        }
    }
#undef WHERE
fail:
    json_decref(root);
    free(pos);
    free(text);
    return rc;
}

bool moe_config_is_moe(const moe_config *cfg, int layer) {
    return cfg->moe.every > 0 && (layer + 1) % cfg->moe.every == 0;
}

int moe_config_experts(const moe_config *cfg, int layer) {
    if (!moe_config_is_moe(cfg, layer)) return 0;
    if (cfg->moe.n_num_experts == 1) return cfg->moe.num_experts[0];
    int idx = 0;
    for (int i = 0; i < layer; i++)
        idx += moe_config_is_moe(cfg, i);
    return idx < cfg->moe.n_num_experts ? cfg->moe.num_experts[idx] : 0;
}

static int positive(const moe_config_src *src, const char *key, long v) {
    if (v < 1)
        return moe_fail(MOE_EINVAL, "%s: %s = %ld, expected >= 1", src_where(src, key), key, v);
    return 0;
}

int moe_config_check(const moe_config *c, const moe_config_src *src) {
    MOE_TRY(positive(src, "model.vocab_size", c->model.vocab_size));
    MOE_TRY(positive(src, "model.d_model", c->model.d_model));
    MOE_TRY(positive(src, "model.n_layers", c->model.n_layers));
    MOE_TRY(positive(src, "model.n_heads", c->model.n_heads));
    MOE_TRY(positive(src, "model.n_kv_heads", c->model.n_kv_heads));
    MOE_TRY(positive(src, "model.d_ff", c->model.d_ff));
    MOE_TRY(positive(src, "model.seq_len", c->model.seq_len));
    MOE_TRY(positive(src, "train.steps", c->train.steps));
    MOE_TRY(positive(src, "train.batch_size", c->train.batch_size));
    MOE_TRY(positive(src, "train.grad_accum", c->train.grad_accum));
    MOE_TRY(positive(src, "parallel.ep", c->parallel.ep));
    MOE_TRY(positive(src, "memory.mini_seq", c->memory.mini_seq));
    if (c->model.n_layers > MOE_MAX_LAYERS)
        return moe_fail(MOE_EINVAL, "%s: model.n_layers = %d exceeds %d",
                        src_where(src, "model.n_layers"), c->model.n_layers, MOE_MAX_LAYERS);
    if (c->model.n_heads % c->model.n_kv_heads)
        return moe_fail(MOE_EINVAL,
                        "%s: model.n_heads = %d is not a multiple of "
                        "model.n_kv_heads = %d",
                        src_where2(src, "model.n_kv_heads", "model.n_heads"), c->model.n_heads,
                        c->model.n_kv_heads);
    if (c->model.d_model % c->model.n_heads || (c->model.d_model / c->model.n_heads) % 2)
        return moe_fail(MOE_EINVAL,
                        "%s: model.d_model = %d must be n_heads (%d) times an even "
                        "head size",
                        src_where2(src, "model.d_model", "model.n_heads"), c->model.d_model,
                        c->model.n_heads);
    if (c->moe.every < 0)
        return moe_fail(MOE_EINVAL, "%s: moe.every = %d, expected >= 0",
                        src_where(src, "moe.every"), c->moe.every);
    int n_moe = 0, e_min = 0;
    for (int l = 0; l < c->model.n_layers; l++)
        n_moe += moe_config_is_moe(c, l);
    if (n_moe > 0) {
        if (c->moe.n_num_experts != 1 && c->moe.n_num_experts != n_moe)
            return moe_fail(MOE_EINVAL,
                            "%s: moe.num_experts has %d entries but the model has %d "
                            "MoE layers",
                            src_where(src, "moe.num_experts"), c->moe.n_num_experts, n_moe);
        for (int i = 0; i < c->moe.n_num_experts; i++) {
            int e = c->moe.num_experts[i];
            if (e < 1)
                return moe_fail(MOE_EINVAL, "%s: moe.num_experts entry %d is %d, expected >= 1",
                                src_where(src, "moe.num_experts"), i, e);
            if (e % c->parallel.ep)
                return moe_fail(MOE_EINVAL,
                                "%s: moe.num_experts = %d is not divisible by "
                                "parallel.ep = %d",
                                src_where2(src, "parallel.ep", "moe.num_experts"), e,
                                c->parallel.ep);
            if (!e_min || e < e_min) e_min = e;
        }
        if (c->router.top_k > e_min)
            return moe_fail(MOE_EINVAL, "%s: router.top_k = %d exceeds moe.num_experts = %d",
                            src_where2(src, "router.top_k", "moe.num_experts"), c->router.top_k,
                            e_min);
        int rc = moe_router_config_check(&c->router, e_min);
        if (rc < 0) return moe_fail(rc, "config: %s", moe_last_error());
    }
    if (c->moe.d_expert < 0 || c->moe.shared_experts < 0 || c->moe.shared_experts > 1)
        return moe_fail(MOE_EINVAL, "%s: moe.d_expert >= 0 and moe.shared_experts in 0..1",
                        src_where(src, "moe.shared_experts"));
    for (int i = 0; i < c->moe.n_task_layers; i++) {
        int l = c->moe.task_layers[i];
        if (l < 0 || l >= c->model.n_layers || !moe_config_is_moe(c, l))
            return moe_fail(MOE_EINVAL, "%s: moe.task_layers entry %d is not an MoE layer",
                            src_where(src, "moe.task_layers"), l);
    }
    if (c->router.n_task_priority > 0 && !strcmp(c->data.kind, "synthetic") &&
        c->router.n_task_priority != c->data.n_tasks)
        return moe_fail(MOE_EINVAL, "%s: router.task_priority has %d entries for %d tasks",
                        src_where(src, "router.task_priority"), c->router.n_task_priority,
                        c->data.n_tasks);
    if (strcmp(c->data.kind, "synthetic") && !c->data.path[0])
        return moe_fail(MOE_EINVAL, "%s: data.kind = %s needs data.path",
                        src_where(src, "data.kind"), c->data.kind);
    if (c->train.lr <= 0 || c->train.beta1 < 0 || c->train.beta1 >= 1 || c->train.beta2 < 0 ||
        c->train.beta2 >= 1 || c->train.grad_clip < 0 || c->train.weight_decay < 0)
        return moe_fail(MOE_EINVAL,
                        "%s: train.lr > 0, betas in [0, 1), grad_clip and "
                        "weight_decay >= 0",
                        src_where(src, "train.lr"));
    int chunked = c->memory.mini_seq > 1, recompute = strcmp(c->memory.recompute, "none") != 0;
    if (chunked != recompute)
        return moe_fail(MOE_EINVAL,
                        "%s: memory.mini_seq = %d with memory.recompute = %s: chunks are "
                        "recomputed in backward, so mini_seq > 1 goes with recompute = moe or all, "
                        "and recompute = moe or all with mini_seq > 1",
                        src_where(src, chunked ? "memory.recompute" : "memory.mini_seq"),
                        c->memory.mini_seq, c->memory.recompute);
    if (chunked && (c->memory.mini_seq > c->model.seq_len || c->parallel.ep > 1))
        return moe_fail(MOE_EINVAL,
                        "%s: memory.mini_seq = %d needs at most model.seq_len (%d) chunks and "
                        "parallel.ep = 1",
                        src_where2(src, "memory.mini_seq", "model.seq_len"), c->memory.mini_seq,
                        c->model.seq_len);
    if (c->data.val_fraction <= 0 || c->data.val_fraction >= 1)
        return moe_fail(MOE_EINVAL, "%s: data.val_fraction = %g, expected 0 < f < 1",
                        src_where(src, "data.val_fraction"), c->data.val_fraction);
    return 0;
}

// Adds key `k`'s value to its section object.
static json_t *value_json(const moe_config *cfg, const key_def *k) {
    const char *base = (const char *)cfg;
    switch (k->kind) {
    case K_INT:
        return json_integer(*(const int *)(base + k->off));
    case K_U64:
        return json_integer((json_int_t) * (const uint64_t *)(base + k->off));
    case K_DBL:
        return json_real(*(const double *)(base + k->off));
    case K_BOOL:
        return json_boolean(*(const bool *)(base + k->off));
    case K_STR:
        return json_string(base + k->off);
    case K_ENUM: {
        int idx = *(const int *)(base + k->off);
        const char *p = k->values;
        for (int i = 0; i < idx && p; i++)
            p = strchr(p, '|') ? strchr(p, '|') + 1 : NULL;
        return p ? json_stringn(p, strchr(p, '|') ? (size_t)(strchr(p, '|') - p) : strlen(p))
                 : json_null();
    }
    default:
        break;
    }
    json_t *a = json_array();
    int n = *(const int *)(base + k->count_off);
    for (int i = 0; i < n; i++) {
        if (k->kind == K_INTS)
            json_array_append_new(a, json_integer(((const int *)(base + k->off))[i]));
        if (k->kind == K_DBLS)
            json_array_append_new(a, json_real(((const double *)(base + k->off))[i]));
        if (k->kind == K_STRS)
            json_array_append_new(a, json_string(base + k->off + (size_t)i * MOE_NAME_MAX));
    }
    return a;
}

int moe_config_write(const moe_config *cfg, FILE *f) {
    json_t *root = json_object();
    for (int i = 0; i < N_KEYS; i++) {
        const char *dot = strchr(keys[i].key, '.');
        char section[32];
        snprintf(section, sizeof section, "%.*s", (int)(dot - keys[i].key), keys[i].key);
        json_t *obj = json_object_get(root, section);
        if (!obj) json_object_set_new(root, section, obj = json_object());
        json_object_set_new(obj, dot + 1, value_json(cfg, &keys[i]));
    }
    int rc = json_dumpf(root, f, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
    json_decref(root);
    if (rc || fputc('\n', f) == EOF) return moe_fail(MOE_EIO, "writing the config failed");
    return 0;
}

void moe_config_help(FILE *f) {
    static const char *kinds[] = {"int",    "int",  "number",  "bool",   "string",
                                  "string", "ints", "numbers", "strings"};
    fprintf(f, "Config keys (JSON sections; override with --set key=value):\n\n");
    for (int i = 0; i < N_KEYS; i++) {
        const key_def *k = &keys[i];
        fprintf(f, "  %-30s %-7s default %s\n", k->key, kinds[k->kind],
                k->def[0] ? k->def : "\"\"");
        fprintf(f, "  %-30s %s", "", k->doc);
        if (k->values) fprintf(f, " (%s)", k->values);
        fputc('\n', f);
    }
}
