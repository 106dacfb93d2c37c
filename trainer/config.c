// Run configuration: one table of keys (type, default, range, meaning) drives
// the defaults, JSON loading, --set overrides, range checks, --help-config and
// the resolved config written next to a run. router.* and capacity.* values
// are parsed by the router's own setter, so both CLIs accept the same text.
#include "moe/config.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/json_error.h"
#include "moe/parse.h"
#include "moe/shards.h"
#include "trainer/config_internal.h"
#include "trainer/json_pos.h"

#include <errno.h>
#include <float.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
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
    double lo, hi;      // numeric keys (lists: every item): the accepted range
    int open;           // MOE_RANGE_LO_OPEN / MOE_RANGE_HI_OPEN: that end excluded
    const char *doc;
} key_def;

// Ranges: RI integers lo..hi, RD numbers with open ends, RU64 seeds (below
// 2^63: the resolved config stores them as JSON integers), R0 not numeric.
#define RI(lo, hi) (lo), (hi), 0
#define RD(lo, hi, open) (lo), (hi), (open)
#define RU64 0, 0, 0
#define R0 0, 0, 0
#define LO_OPEN MOE_RANGE_LO_OPEN
#define HI_OPEN MOE_RANGE_HI_OPEN
#define F(field) offsetof(moe_config, field)
#define NO 0
#define MOE_STR_(x) #x
#define MOE_STR(x) MOE_STR_(x)
static const key_def keys[] = {
    {"model.vocab_size", K_INT, F(model.vocab_size), NO, "256", NULL, RI(1, 1 << 24),
     "vocabulary size (256: byte tokenizer)"},
    {"model.d_model", K_INT, F(model.d_model), NO, "128", NULL, RI(2, 1 << 16), "hidden size"},
    {"model.n_layers", K_INT, F(model.n_layers), NO, "4", NULL, RI(1, MOE_MAX_LAYERS),
     "decoder layers"},
    {"model.n_heads", K_INT, F(model.n_heads), NO, "4", NULL, RI(1, 4096),
     "attention (query) heads"},
    {"model.n_kv_heads", K_INT, F(model.n_kv_heads), NO, "2", NULL, RI(1, 4096),
     "key/value heads (GQA; divides n_heads)"},
    {"model.d_ff", K_INT, F(model.d_ff), NO, "256", NULL, RI(1, 1 << 20),
     "dense SwiGLU hidden size"},
    {"model.seq_len", K_INT, F(model.seq_len), NO, "64", NULL, RI(1, 1 << 20),
     "tokens per sequence"},
    {"model.rope_theta", K_DBL, F(model.rope_theta), NO, "10000", NULL, RD(0, 1e12, LO_OPEN),
     "RoPE base"},
    {"model.norm_eps", K_DBL, F(model.norm_eps), NO, "1e-5", NULL, RD(0, 1, LO_OPEN),
     "RMSNorm epsilon"},
    {"model.tie_embeddings", K_BOOL, F(model.tie_embeddings), NO, "true", NULL, R0,
     "LM head shares the embedding matrix"},
    {"model.tokenizer", K_STR, F(model.tokenizer), NO, "bytes", NULL, R0,
     "bytes, or a SentencePiece .model file (train one with spm_train; model.vocab_size must "
     "be at least its vocabulary); checkpoints keep a copy"},
    {"moe.num_experts", K_INTS, F(moe.num_experts), F(moe.n_num_experts), "8", NULL,
     RI(1, MOE_MAX_EXPERTS),
     "experts per MoE layer: one number, or a list with one entry per MoE layer (pyramid)"},
    {"moe.d_expert", K_INT, F(moe.d_expert), NO, "0", NULL, RI(0, 1 << 20),
     "expert FFN hidden size (0: model.d_ff)"},
    {"moe.every", K_INT, F(moe.every), NO, "1", NULL, RI(0, MOE_MAX_LAYERS),
     "layer i is MoE when (i+1) % every == 0; 0: dense model"},
    {"moe.shared_experts", K_INT, F(moe.shared_experts), NO, "0", NULL, RI(0, 1),
     "shared (residual) experts applied to every token: 0 or 1"},
    {"moe.task_layers", K_INTS, F(moe.task_layers), F(moe.n_task_layers), "[]", NULL,
     RI(0, MOE_MAX_LAYERS - 1), "MoE layers routed by task id (Task-MoE) instead of by token"},
    {"router.top_k", K_INT, F(router.top_k), NO, "2", NULL, RI(1, 1 << 20), "experts per token"},
    {"router.capacity_factor", K_DBL, F(router.capacity_factor), NO, "1.25", NULL,
     RD(-DBL_MAX, 1e6, 0), "C = max(min_capacity, ceil(k*T/E * factor)); <= 0: dropless"},
    {"router.min_capacity", K_INT, F(router.min_capacity), NO, "4", NULL, RI(0, 1 << 30),
     "lower bound of every expert's capacity"},
    {"router.slot_order", K_ENUM, F(router.slot_order), NO, "position", "position|priority", R0,
     "position: token order; priority: Batch Prioritized Routing"},
    {"router.normalize_topk", K_BOOL, F(router.normalize_topk), NO, "true", NULL, R0,
     "renormalise kept choices' weights to sum 1"},
    {"router.noise", K_ENUM, F(router.noise), NO, "none", "none|jitter|gumbel", R0,
     "training noise on the routing decision"},
    {"router.noise_eps", K_DBL, F(router.noise_eps), NO, "0.01", NULL, RD(0, 1, HI_OPEN),
     "jitter half-width"},
    {"router.score", K_ENUM, F(router.score), NO, "softmax", "softmax|sigmoid", R0,
     "routing scores: softmax over the experts, or sigmoid per expert (DeepSeek-V3: top-k on "
     "the scores, weights = chosen scores, over their sum when normalize_topk)"},
    {"router.type", K_ENUM, F(router.type), NO, "token_choice", "token_choice|expert_choice", R0,
     "token_choice: each token takes its top_k experts; expert_choice (training only): each "
     "expert takes its top C = capacity_factor*T*top_k/E tokens, weights = softmax scores"},
    {"router.ec_fallback", K_ENUM, F(router.ec_fallback), NO, "none", "none|token_choice", R0,
     "inference (generate) of an expert_choice model: none refuses; token_choice routes top_k "
     "by token with the same gate"},
    {"router.route_scale", K_DBL, F(router.route_scale), NO, "1.0", NULL, RD(0, 1e6, LO_OPEN),
     "routed scaling factor: multiplies every combine weight (DeepSeek-V3 uses 2.5)"},
    {"router.n_groups", K_INT, F(router.n_groups), NO, "0", NULL, RI(0, 1 << 16),
     "expert groups for group-limited routing, consecutive experts each, dividing "
     "moe.num_experts (0: one group per node of the expert-parallel group, 1 when "
     "parallel.ep = 1)"},
    {"router.topk_groups", K_INT, F(router.topk_groups), NO, "0", NULL, RI(0, 1 << 16),
     "groups a token may route to, the best by their top-2 (biased) or top-1 score "
     "(0: every group; with n_groups = 0 capped at the node count)"},
    {"router.bias_update_rate", K_DBL, F(router.bias_update_rate), NO, "0", NULL, RD(0, 1, 0),
     "auxiliary-loss-free balancing (DeepSeek-V3): after each step, expert bias += rate * "
     "sign(mean load - load); the bias shifts top-k selection only, never the weights (0: off)"},
    {"router.aux_loss_coef", K_DBL, F(router.aux_loss_coef), NO, "0.01", NULL, RD(0, 1e6, 0),
     "load-balancing loss weight"},
    {"router.z_loss_coef", K_DBL, F(router.z_loss_coef), NO, "0.001", NULL, RD(0, 1e6, 0),
     "z-loss weight"},
    {"router.aux_counts_all_k", K_BOOL, F(router.aux_counts_all_k), NO, "false", NULL, R0,
     "aux loss counts all k choices (HF Mixtral) instead of the first"},
    {"router.task_priority", K_DBLS, F(router.task_priority), F(router.n_task_priority), "[]", NULL,
     RD(-DBL_MAX, DBL_MAX, 0), "priority per task id for the priority slot order (higher first)"},
    {"router.seed", K_U64, F(router.seed), NO, "0", NULL, RU64, "seed of the routing noise"},
    {"capacity.mode", K_ENUM, F(router.capacity_mode), NO, "static", "static|dynamic", R0,
     "dynamic: per-expert capacity from the measured load"},
    {"capacity.ema", K_DBL, F(router.ema), NO, "0.9", NULL, RD(0, 1, HI_OPEN),
     "EMA factor of the measured load"},
    {"capacity.headroom", K_DBL, F(router.headroom), NO, "0.1", NULL, RD(0, 1e6, 0),
     "C_e = ceil(load_e * (1 + headroom))"},
    {"capacity.update_every", K_INT, F(router.update_every), NO, "1", NULL, RI(1, 1 << 30),
     "steps between capacity updates"},
    {"capacity.capacity_factor_max", K_DBL, F(router.capacity_factor_max), NO, "2.0", NULL,
     RD(1, 1e6, 0), "upper bound of C_e as a capacity factor"},
    {"train.steps", K_INT, F(train.steps), NO, "300", NULL, RI(1, 1000000000), "optimizer steps"},
    {"train.batch_size", K_INT, F(train.batch_size), NO, "16", NULL, RI(1, 1 << 20),
     "sequences per micro-batch"},
    {"train.lr", K_DBL, F(train.lr), NO, "3e-3", NULL, RD(0, FLT_MAX, LO_OPEN),
     "peak learning rate"},
    {"train.min_lr_ratio", K_DBL, F(train.min_lr_ratio), NO, "0.1", NULL, RD(0, 1, 0),
     "cosine schedule floor as a fraction of lr"},
    {"train.warmup_steps", K_INT, F(train.warmup_steps), NO, "30", NULL, RI(0, 1000000000),
     "linear warmup steps"},
    {"train.weight_decay", K_DBL, F(train.weight_decay), NO, "0.1", NULL, RD(0, 1e6, 0),
     "AdamW decay (not on norms and embeddings unless train.decay_all)"},
    {"train.decay_all", K_BOOL, F(train.decay_all), NO, "false", NULL, R0,
     "apply train.weight_decay to norm weights and embeddings too"},
    {"train.optimizer_state", K_STR, F(train.optimizer_state), NO, "fp32", "fp32|bf16", R0,
     "how AdamW stores its moments: bf16 halves their memory (4 instead of 8 bytes per "
     "parameter) and the update's traffic; arithmetic stays float, stores round to nearest even; "
     "checkpoints hold F32 either way (CPU training only)"},
    {"train.beta1", K_DBL, F(train.beta1), NO, "0.9", NULL, RD(0, 1, HI_OPEN), "AdamW beta1"},
    {"train.beta2", K_DBL, F(train.beta2), NO, "0.95", NULL, RD(0, 1, HI_OPEN), "AdamW beta2"},
    {"train.grad_clip", K_DBL, F(train.grad_clip), NO, "1.0", NULL, RD(0, DBL_MAX, 0),
     "global gradient-norm clip (0: off)"},
    {"train.grad_accum", K_INT, F(train.grad_accum), NO, "1", NULL, RI(1, 1 << 16),
     "micro-batches per optimizer step"},
    {"train.seed", K_U64, F(train.seed), NO, "1337", NULL, RU64, "seed of init and data order"},
    {"train.device", K_STR, F(train.device), NO, "cpu", "cpu|cuda", R0,
     "compute device (moe train --device); cuda needs a CUDA build and a GPU"},
    {"train.compute", K_STR, F(train.compute), NO, "fp32", "fp32|bf16", R0,
     "GEMM precision on the GPU: bf16 tensor cores with fp32 weights and accumulation"},
    {"train.eval_every", K_INT, F(train.eval_every), NO, "100", NULL, RI(0, 1000000000),
     "steps between validation passes (0: only at the end)"},
    {"train.ckpt_every", K_INT, F(train.ckpt_every), NO, "0", NULL, RI(0, 1000000000),
     "steps between checkpoints (0: only at the end)"},
    {"train.keep_checkpoints", K_INT, F(train.keep_checkpoints), NO, "0", NULL, RI(0, 1000000),
     "N > 0: each save writes checkpoint-STEP/ and the file `latest` naming it, and keeps the N "
     "newest; 0: one checkpoint/ folder, replaced at each save"},
    {"train.async_checkpoint", K_BOOL, F(train.async_checkpoint), NO, "false", NULL, R0,
     "periodic saves (train.ckpt_every) copy this rank's tensors to a snapshot and write it on a "
     "background thread while training goes on (3 x the rank's parameters of memory more, 2 x "
     "with train.optimizer_state = bf16); the "
     "save at the end or on a stop stays synchronous"},
    {"train.log_every", K_INT, F(train.log_every), NO, "10", NULL, RI(1, 1000000000),
     "steps between progress lines when not on a terminal"},
    {"train.tensorboard", K_BOOL, F(train.tensorboard), NO, "false", NULL, R0,
     "also write the step and eval figures as TensorBoard events into the run folder"},
    {"data.kind", K_STR, F(data.kind), NO, "synthetic", "synthetic|bin|llmc|nanogpt|text", R0,
     "synthetic multi-task corpus; llm.c shards (header + uint16/uint32 tokens, moe prepare "
     "writes them; bin is the old name); nanoGPT raw uint16 train.bin/val.bin; UTF-8 text (bytes)"},
    {"data.path", K_STR, F(data.path), NO, "", NULL, R0,
     "token file or glob (\"dir/train_*.bin\", sorted) for llmc, nanogpt and text"},
    {"data.val_path", K_STR, F(data.val_path), NO, "", NULL, R0,
     "validation file or glob (\"\": the last data.val_fraction of each file)"},
    {"data.tasks", K_STRS, F(data.tasks), F(data.n_tasks),
     "[\"copy\",\"reverse\",\"sort\",\"add\",\"caesar\"]", NULL, R0,
     "synthetic tasks, or one corpus per task: {\"name\": \"file or glob\", ...} in JSON, "
     "name=glob,name=glob with --set (validation: the tail of each task's files)"},
    {"data.task_sampling", K_ENUM, F(data.task_sampling), NO, "proportional",
     "proportional|uniform|temperature", R0,
     "file tasks: a training row's task is drawn with p_i proportional to the task's windows "
     "n_i, uniform, or n_i^(1/data.task_temperature)"},
    {"data.task_temperature", K_DBL, F(data.task_temperature), NO, "5", NULL, RD(0, 1e6, LO_OPEN),
     "T of data.task_sampling = temperature (1: proportional, large: uniform)"},
    {"data.shuffle", K_BOOL, F(data.shuffle), NO, "true", NULL, R0,
     "file data: windows in a seeded order, a new permutation each epoch (false: file order)"},
    {"data.val_fraction", K_DBL, F(data.val_fraction), NO, "0.1", NULL, RD(0, 1, LO_OPEN | HI_OPEN),
     "share of the data held out for validation"},
    {"parallel.ep", K_INT, F(parallel.ep), NO, "1", NULL, RI(1, 1 << 16),
     "expert-parallel group size"},
    {"placement.mode", K_STR, F(placement.mode), NO, "static", "static|replicate|move", R0,
     "static: each rank holds its E/ep experts; replicate: every placement.update_every steps "
     "the hottest experts (by the global load EMA) get replicas in spare slots of other ranks; "
     "move: replicate, and first hot experts swap homes with cold ones of lightly loaded ranks "
     "(weights and AdamW moments move with them; spare slots optional)"},
    {"placement.slots_per_rank", K_INT, F(placement.slots_per_rank), NO, "0", NULL, RI(0, 1 << 16),
     "expert slots per rank, >= E/parallel.ep; the spare ones hold replicas "
     "(0: E/parallel.ep, no spare slot)"},
    {"placement.update_every", K_INT, F(placement.update_every), NO, "10", NULL, RI(1, 1 << 30),
     "steps between placement updates (replicate, move)"},
    {"comm.all_to_all", K_STR, F(comm.all_to_all), NO, "flat", "flat|hierarchical", R0,
     "all-to-all algorithm"},
    {"comm.ranks_per_node", K_INT, F(comm.ranks_per_node), NO, "0", NULL, RI(0, 1 << 16),
     "ranks per node for hierarchical all-to-all (0: detect)"},
    {"comm.timeout_s", K_DBL, F(comm.timeout_s), NO, "300", NULL, RD(0, 1e9, 0),
     "seconds a collective may make no progress before the job ends naming the stuck rank "
     "(0: wait forever)"},
    {"comm.node_dedup", K_BOOL, F(comm.node_dedup), NO, "false", NULL, R0,
     "expert-parallel dispatch sends a token's row once per destination node, copied to "
     "that node's ranks inside it (DeepSeek-V3); return paths stay one row per choice"},
    {"comm.overlap_degree", K_INT, F(comm.overlap_degree), NO, "1", NULL, RI(1, 1 << 16),
     "GPU expert parallelism: the all-to-all in this many rounds of peers, expert GEMMs "
     "of a round's rows running while the next round travels (Tutel's overlap degree; "
     "1: one exchange; at most parallel.ep rounds; same bits as 1)"},
    {"loss.impl", K_STR, F(loss.impl), NO, "plain", "plain|cce", R0,
     "LM-head loss: plain logits, or cut cross-entropy (no [tokens, vocab] logits)"},
    {"loss.cce_filter", K_BOOL, F(loss.cce_filter), NO, "true", NULL, R0,
     "cce backward skips vocabulary tiles whose probabilities are below float epsilon"},
    {"memory.mini_seq", K_INT, F(memory.mini_seq), NO, "1", NULL, RI(1, 1 << 20),
     "chunks per sequence in MLP/MoE and LM head"},
    {"memory.recompute", K_STR, F(memory.recompute), NO, "none", "none|moe|all", R0,
     "moe: FFN/MoE blocks and the LM head keep one chunk and recompute it in backward "
     "(needs memory.mini_seq > 1); all: also attention, from each layer's input"},
};
#undef F
#define N_KEYS ((int)(sizeof keys / sizeof keys[0]))

// printf into a new allocation (NULL when out of memory).
static char *xprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xprintf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *s = n < 0 ? NULL : malloc((size_t)n + 1);
    if (!s) return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return s;
}

// Where each key was set (allocated: paths have any length), indexed like keys[],
// and when: order[i] counts the keys noted before it (0: never set), so checks of
// several keys can name the one a later --set changed over the file's.
struct moe_config_src {
    char *where[N_KEYS];
    unsigned order[N_KEYS];
    unsigned n_noted;
};

static const key_def *find_key_n(const char *key, size_t len) {
    for (int i = 0; i < N_KEYS; i++)
        if (strlen(keys[i].key) == len && !strncmp(keys[i].key, key, len)) return &keys[i];
    return NULL;
}

static const key_def *find_key(const char *key) {
    return find_key_n(key, strlen(key));
}

moe_config_src *moe_config_src_new(void) {
    return calloc(1, sizeof(moe_config_src));
}

void moe_config_src_free(moe_config_src *src) {
    if (!src) return;
    for (int i = 0; i < N_KEYS; i++)
        free(src->where[i]);
    free(src);
}

// Records where k was set; takes ownership of where (NULL: out of memory, the
// location is then reported as "config").
static void src_note(moe_config_src *src, const key_def *k, char *where) {
    if (!src) {
        free(where);
        return;
    }
    free(src->where[k - keys]);
    src->where[k - keys] = where ? where : xprintf("config");
    src->order[k - keys] = ++src->n_noted;
}

// "file:line:col" or "--set key" or "default" for error messages.
static const char *src_where(const moe_config_src *src, const char *key) {
    const key_def *k = find_key(key);
    if (src && k && src->where[k - keys]) return src->where[k - keys];
    return "default";
}

// "did you mean router.top_k? " when key is a likely typo of a table key
// (moe_nearest), else ""; hint has cap bytes. Sections alone when section.
static const char *key_hint(const char *key, bool section, char *hint, size_t cap) {
    const char *cands[N_KEYS];
    char secs[N_KEYS][32];
    int n = 0;
    for (int i = 0; i < N_KEYS; i++) {
        if (!section) {
            cands[n++] = keys[i].key;
            continue;
        }
        snprintf(secs[n], sizeof secs[n], "%.*s", (int)strcspn(keys[i].key, "."), keys[i].key);
        if (n == 0 || strcmp(secs[n], secs[n - 1])) cands[n] = secs[n], n++;
    }
    const char *best = moe_nearest(key, cands, n);
    if (best)
        snprintf(hint, cap, "did you mean %s? ", best);
    else
        hint[0] = 0;
    return hint;
}

// " (did you mean jitter?)" when v is a likely typo of one of values, else "".
static const char *value_hint(const char *v, const char *values, char *hint, size_t cap) {
    char best[64];
    if (moe_nearest_value(v, values, best, sizeof best))
        snprintf(hint, cap, " (did you mean %s?)", best);
    else
        hint[0] = 0;
    return hint;
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

static bool is_router_key(const key_def *k) {
    return !strncmp(k->key, "router.", 7) || !strncmp(k->key, "capacity.", 9);
}

static size_t str_cap(const key_def *k) {
    return !strcmp(k->key, "data.path") || !strcmp(k->key, "data.val_path") ||
                   !strcmp(k->key, "model.tokenizer")
               ? MOE_PATH_MAX
               : MOE_NAME_MAX;
}

static bool is_tasks_key(const key_def *k) {
    return !strcmp(k->key, "data.tasks");
}

static int list_max(const key_def *k) {
    return k->kind == K_INTS ? MOE_MAX_LAYERS : MOE_MAX_TASKS;
}

// The one range check of every key, for set values and whole configs alike:
// the value(s) stored for k are inside k's range (lists: every item).
// A config is JSON, whose strings are UTF-8: a value that is not (a file
// name's bytes through --set) could not be written to the run's config.json,
// and the run could not be resumed or read.
static int check_utf8(const char *key, int item, const char *s) {
    long bad = moe_utf8_bad((const unsigned char *)s, (long)strlen(s));
    if (bad < 0) return 0;
    char it[32] = "";
    if (item >= 0) snprintf(it, sizeof it, " item %d", item);
    return moe_fail(MOE_EINVAL,
                    "%s%s: byte %ld is not UTF-8, and a config (JSON) holds UTF-8 text only: "
                    "rename the file, or name it by a glob",
                    key, it, bad);
}

static int check_key(const moe_config *cfg, const key_def *k) {
    const char *base = (const char *)cfg;
    switch (k->kind) {
    case K_INT:
        return moe_check_range(k->key, -1, *(const int *)(base + k->off), k->lo, k->hi, k->open,
                               true);
    case K_DBL:
        return moe_check_range(k->key, -1, *(const double *)(base + k->off), k->lo, k->hi, k->open,
                               false);
    case K_U64: {
        uint64_t u = *(const uint64_t *)(base + k->off);
        if (u > (uint64_t)INT64_MAX)
            return moe_fail(MOE_EINVAL, "%s = %llu: expected 0..%lld", k->key,
                            (unsigned long long)u, (long long)INT64_MAX);
        return 0;
    }
    case K_STR: {
        const char *s = base + k->off;
        if (!memchr(s, 0, str_cap(k)))
            return moe_fail(MOE_EINVAL, "%s: value longer than %zu characters", k->key,
                            str_cap(k) - 1);
        if (k->values && !in_values(k->values, s))
            return moe_fail(MOE_EINVAL, "%s = '%.64s': expected one of %s", k->key, s, k->values);
        return check_utf8(k->key, -1, s);
    }
    case K_INTS:
    case K_DBLS:
    case K_STRS: {
        int n = *(const int *)(base + k->count_off);
        if (n < 0 || n > list_max(k))
            return moe_fail(MOE_EINVAL, "%s has %d items, expected 0..%d", k->key, n, list_max(k));
        for (int i = 0; i < n; i++) {
            if (k->kind == K_INTS)
                MOE_TRY(moe_check_range(k->key, i, ((const int *)(base + k->off))[i], k->lo, k->hi,
                                        k->open, true));
            if (k->kind == K_DBLS)
                MOE_TRY(moe_check_range(k->key, i, ((const double *)(base + k->off))[i], k->lo,
                                        k->hi, k->open, false));
            const char *s = base + k->off + (size_t)i * MOE_NAME_MAX;
            if (k->kind == K_STRS && (!memchr(s, 0, MOE_NAME_MAX) || !s[0]))
                return moe_fail(MOE_EINVAL, "%s item %d: expected 1..%d characters", k->key, i,
                                MOE_NAME_MAX - 1);
            if (k->kind == K_STRS && is_tasks_key(k) &&
                !memchr(cfg->data.task_paths[i], 0, MOE_PATH_MAX))
                return moe_fail(MOE_EINVAL, "%s item %d: file longer than %d characters", k->key, i,
                                MOE_PATH_MAX - 1);
            if (k->kind == K_STRS) MOE_TRY(check_utf8(k->key, i, s));
            if (k->kind == K_STRS && is_tasks_key(k))
                MOE_TRY(check_utf8(k->key, i, cfg->data.task_paths[i]));
        }
        return 0;
    }
    default:
        return 0;
    }
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = 0;
    return s;
}

// Splits list text "[a, b]", "a,b", "[]" or "" into items: pointers into *buf
// (a copy of v); the caller frees *buf and *items, also on error. Brackets
// must pair; an empty item (",," or a trailing comma) is an error naming its
// index, never the silent end of the list; "quoted" items lose their quotes.
static int split_list(const key_def *k, const char *v, char **buf, char ***items, int *n) {
    size_t len = strlen(v), commas = 0;
    for (size_t i = 0; i < len; i++)
        commas += v[i] == ',';
    *n = 0;
    *buf = malloc(len + 1);
    *items = malloc(sizeof **items * (commas + 1));
    if (!*buf || !*items) return moe_fail(MOE_ENOMEM, "%s: out of memory", k->key);
    memcpy(*buf, v, len + 1);
    char *p = trim(*buf);
    size_t pl = strlen(p);
    if (pl && (p[0] == '[') != (p[pl - 1] == ']'))
        return moe_fail(MOE_EINVAL, "%s: unbalanced '[' ']' in the list", k->key);
    if (pl && p[0] == '[') p[pl - 1] = 0, p++;
    if (strpbrk(p, "[]"))
        return moe_fail(MOE_EINVAL, "%s: nested or unbalanced '[' ']' in the list", k->key);
    p = trim(p);
    if (!*p) return 0; // the empty list
    for (int i = 0;; i++) {
        char *comma = strchr(p, ',');
        if (comma) *comma = 0;
        char *item = trim(p);
        size_t il = strlen(item);
        if (il >= 2 && item[0] == '"' && item[il - 1] == '"') item[il - 1] = 0, item++, il -= 2;
        if (!il) return moe_fail(MOE_EINVAL, "%s: item %d is empty", k->key, i);
        if (strchr(item, '"'))
            return moe_fail(MOE_EINVAL, "%s: item %d has an unmatched '\"'", k->key, i);
        (*items)[(*n)++] = item;
        if (!comma) return 0;
        p = comma + 1;
    }
}

// Sets list key k from its items (each non-empty text); nothing is stored
// unless every item is valid.
static int set_list(moe_config *cfg, const key_def *k, const char *const *items, int n) {
    char *base = (char *)cfg;
    for (int i = 0; i < n; i++)
        if (!items[i][0]) return moe_fail(MOE_EINVAL, "%s: item %d is empty", k->key, i);
    if (k->kind == K_DBLS) { // the router's setter parses "1,2,3"
        size_t len = 1;
        for (int i = 0; i < n; i++)
            len += strlen(items[i]) + 1;
        char *flat = malloc(len), *q = flat;
        if (!flat) return moe_fail(MOE_ENOMEM, "%s: out of memory", k->key);
        for (int i = 0; i < n; i++) {
            size_t il = strlen(items[i]);
            if (i) *q++ = ',';
            memcpy(q, items[i], il);
            q += il;
        }
        *q = 0;
        int rc = moe_router_config_set(&cfg->router, k->key, flat);
        free(flat);
        return rc;
    }
    if (n > list_max(k))
        return moe_fail(MOE_EINVAL, "%s: %d items, at most %d", k->key, n, list_max(k));
    int vals[MOE_MAX_LAYERS];
    for (int i = 0; i < n; i++) {
        if (k->kind == K_INTS) {
            char label[96]; // a table key and an index: bounded
            snprintf(label, sizeof label, "%s item %d", k->key, i);
            MOE_TRY(moe_parse_int(label, items[i], (long)k->lo, (long)k->hi, &vals[i]));
        } else {
            // data.tasks items are task names, or name=path (one corpus per task)
            const char *eq = is_tasks_key(k) ? strchr(items[i], '=') : NULL;
            size_t nl = eq ? (size_t)(eq - items[i]) : strlen(items[i]);
            if (is_tasks_key(k) && !eq != !strchr(items[0], '='))
                return moe_fail(MOE_EINVAL,
                                "%s: item %d: either every item is a task name or every item is "
                                "name=file",
                                k->key, i);
            if (nl >= MOE_NAME_MAX)
                return moe_fail(MOE_EINVAL, "%s item %d: value longer than %d characters", k->key,
                                i, MOE_NAME_MAX - 1);
            if (!nl) return moe_fail(MOE_EINVAL, "%s item %d: empty task name", k->key, i);
            for (size_t j = 0; j < nl; j++)
                if (strchr(",\"[]", items[i][j]))
                    return moe_fail(MOE_EINVAL,
                                    "%s item %d: names may not contain ',', '\"', '[' or ']'",
                                    k->key, i);
            if (eq && (!eq[1] || strlen(eq + 1) >= MOE_PATH_MAX))
                return moe_fail(MOE_EINVAL, "%s item %d: the file of task '%.*s' %s", k->key, i,
                                (int)nl, items[i],
                                eq[1] ? "is longer than " MOE_STR(MOE_PATH_MAX) " characters"
                                      : "is empty");
        }
    }
    if (is_tasks_key(k)) memset(cfg->data.task_paths, 0, sizeof cfg->data.task_paths);
    for (int i = 0; i < n; i++) {
        if (k->kind == K_INTS) {
            ((int *)(base + k->off))[i] = vals[i];
            continue;
        }
        const char *eq = is_tasks_key(k) ? strchr(items[i], '=') : NULL;
        size_t nl = eq ? (size_t)(eq - items[i]) : strlen(items[i]);
        char *name = base + k->off + (size_t)i * MOE_NAME_MAX;
        memcpy(name, items[i], nl);
        name[nl] = 0;
        if (eq) snprintf(cfg->data.task_paths[i], MOE_PATH_MAX, "%s", eq + 1);
    }
    *(int *)(base + k->count_off) = n;
    return 0;
}

// Sets one key from text (--set, defaults, JSON scalars), then checks its range.
static int set_text(moe_config *cfg, const key_def *k, const char *v) {
    char *base = (char *)cfg;
    if (k->kind == K_INTS || k->kind == K_DBLS || k->kind == K_STRS) {
        char *buf = NULL, **items = NULL;
        int n = 0, rc = split_list(k, v, &buf, &items, &n);
        if (rc == 0) rc = set_list(cfg, k, (const char *const *)items, n);
        free(buf);
        free(items);
        return rc < 0 ? rc : check_key(cfg, k);
    }
    if (is_router_key(k)) {
        MOE_TRY(moe_router_config_set(&cfg->router, k->key, v));
        return check_key(cfg, k);
    }
    switch (k->kind) {
    case K_INT:
        MOE_TRY(moe_parse_int(k->key, v, (long)k->lo, (long)k->hi, (int *)(base + k->off)));
        break;
    case K_U64: {
        uint64_t u;
        MOE_TRY(moe_parse_u64(k->key, v, &u));
        if (u > (uint64_t)INT64_MAX)
            return moe_fail(MOE_EINVAL, "%s = %.64s: expected 0..%lld", k->key, v,
                            (long long)INT64_MAX);
        *(uint64_t *)(base + k->off) = u;
        break;
    }
    case K_DBL: {
        double d;
        MOE_TRY(moe_parse_double(k->key, v, &d));
        MOE_TRY(moe_check_range(k->key, -1, d, k->lo, k->hi, k->open, false));
        *(double *)(base + k->off) = d;
        break;
    }
    case K_BOOL:
        if (strcmp(v, "true") && strcmp(v, "false"))
            return moe_fail(MOE_EINVAL, "%s = '%.64s%s': expected true or false", k->key, v,
                            strlen(v) > 64 ? "..." : "");
        *(bool *)(base + k->off) = !strcmp(v, "true");
        break;
    case K_STR: {
        size_t cap = str_cap(k);
        if (strlen(v) >= cap)
            return moe_fail(MOE_EINVAL, "%s: value longer than %zu characters", k->key, cap - 1);
        char hint[96];
        if (k->values && !in_values(k->values, v))
            return moe_fail(MOE_EINVAL, "%s = '%s': expected one of %s%s", k->key, v, k->values,
                            value_hint(v, k->values, hint, sizeof hint));
        memset(base + k->off, 0, cap);
        memcpy(base + k->off, v, strlen(v));
        break;
    }
    case K_ENUM: { // outside router.*: the index of v in k->values
        if (!in_values(k->values, v))
            return moe_fail(MOE_EINVAL, "%s = '%.64s': expected one of %s", k->key, v, k->values);
        int idx = 0;
        for (const char *p = k->values;
             strncmp(p, v, strlen(v)) || (p[strlen(v)] && p[strlen(v)] != '|');
             p = strchr(p, '|') + 1)
            idx++;
        *(int *)(base + k->off) = idx;
        break;
    }
    default:
        return moe_fail(MOE_EINVAL, "%s: cannot be set", k->key);
    }
    return check_key(cfg, k);
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
    if (!eq)
        return moe_fail(MOE_EINVAL, "--set %.64s%s: expected key=value", assignment,
                        strlen(assignment) > 64 ? "..." : "");
    size_t len = (size_t)(eq - assignment);
    const key_def *k = find_key_n(assignment, len);
    if (!k) {
        char name[128], hint[160];
        snprintf(name, sizeof name, "%.*s", (int)(len > 100 ? 100 : len), assignment);
        return moe_fail(MOE_EINVAL,
                        "--set: unknown key '%.64s%s' (%smoe train --help-config lists the keys)",
                        name, len > 64 ? "..." : "", key_hint(name, false, hint, sizeof hint));
    }
    int rc = set_text(cfg, k, eq + 1);
    if (rc < 0)
        return moe_fail(rc, "--set: %s (moe train --help-config lists the keys and their values)",
                        moe_last_error());
    src_note(src, k, xprintf("--set %s", k->key));
    return 0;
}

static int want_type(const key_def *k, const char *want) {
    return moe_fail(MOE_EINVAL, "%s must be %s", k->key, want);
}

// A JSON string as C text: refused when it holds a NUL (C would cut it there).
static int json_text(const key_def *k, int item, json_t *v, const char **out) {
    *out = json_string_value(v);
    if (strlen(*out) != json_string_length(v)) {
        if (item >= 0)
            return moe_fail(MOE_EINVAL, "%s item %d contains a NUL character", k->key, item);
        return moe_fail(MOE_EINVAL, "%s contains a NUL character", k->key);
    }
    return 0;
}

// data.tasks as {"name": "file or glob", ...}: items "name=path" for set_list.
static int set_tasks_json(moe_config *cfg, const key_def *k, json_t *v) {
    size_t n = json_object_size(v);
    if (n > MOE_MAX_TASKS)
        return moe_fail(MOE_EINVAL, "%s: %zu tasks, at most %d", k->key, n, MOE_MAX_TASKS);
    char *items[MOE_MAX_TASKS];
    int m = 0, rc = 0;
    const char *name;
    json_t *path;
    json_object_foreach(v, name, path) {
        const char *p;
        if (!json_is_string(path)) {
            rc = moe_fail(MOE_EINVAL, "%s: task '%.32s' must map to a file or glob (a string)",
                          k->key, name);
            break;
        }
        if ((rc = json_text(k, m, path, &p)) < 0) break;
        if (strchr(name, '=') || !name[0]) {
            rc = moe_fail(MOE_EINVAL, "%s: task name '%.32s' is empty or holds '='", k->key, name);
            break;
        }
        if (!(items[m] = xprintf("%s=%s", name, p))) {
            rc = moe_fail(MOE_ENOMEM, "%s: out of memory", k->key);
            break;
        }
        m++;
    }
    if (rc == 0 && m == 0) rc = moe_fail(MOE_EINVAL, "%s: the task map is empty", k->key);
    if (rc == 0) rc = set_list(cfg, k, (const char *const *)items, m);
    for (int i = 0; i < m; i++)
        free(items[i]);
    return rc < 0 ? rc : check_key(cfg, k);
}

// Sets key k from a JSON value, checking the JSON type against the key's kind.
// Numbers are formatted (bounded text, not user text) and go through the same
// setter as --set, so both paths apply the same parsing and ranges.
static int set_json(moe_config *cfg, const key_def *k, json_t *v) {
    char num[64];
    const char *s;
    switch (k->kind) {
    case K_INT:
    case K_U64:
        if (!json_is_integer(v)) return want_type(k, "an integer");
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        return set_text(cfg, k, num);
    case K_DBL:
        if (!json_is_number(v)) return want_type(k, "a number");
        snprintf(num, sizeof num, "%.17g", json_number_value(v));
        return set_text(cfg, k, num);
    case K_BOOL:
        if (!json_is_boolean(v)) return want_type(k, "true or false");
        return set_text(cfg, k, json_is_true(v) ? "true" : "false");
    case K_STR:
    case K_ENUM:
        if (!json_is_string(v)) return want_type(k, "a string");
        MOE_TRY(json_text(k, -1, v, &s));
        return set_text(cfg, k, s);
    default:
        break;
    }
    const int max = list_max(k);
    if (is_tasks_key(k) && json_is_object(v)) return set_tasks_json(cfg, k, v);
    const char *items[MOE_MAX_TASKS > MOE_MAX_LAYERS ? MOE_MAX_TASKS : MOE_MAX_LAYERS];
    char nums[sizeof items / sizeof items[0]][32];
    size_t n = 1;
    if (k->kind == K_INTS && json_is_integer(v)) { // one number for every MoE layer
        snprintf(nums[0], sizeof nums[0], "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        items[0] = nums[0];
    } else {
        if (!json_is_array(v))
            return want_type(k, k->kind == K_INTS ? "an integer or a list of integers" : "a list");
        n = json_array_size(v);
        if (n > (size_t)max)
            return moe_fail(MOE_EINVAL, "%s: %zu items, at most %d", k->key, n, max);
        for (size_t i = 0; i < n; i++) {
            json_t *item = json_array_get(v, i);
            int ok = k->kind == K_INTS   ? json_is_integer(item)
                     : k->kind == K_DBLS ? json_is_number(item)
                                         : json_is_string(item);
            if (!ok)
                return want_type(k, k->kind == K_INTS   ? "a list of integers"
                                    : k->kind == K_DBLS ? "a list of numbers"
                                                        : "a list of strings");
            if (k->kind == K_STRS) {
                MOE_TRY(json_text(k, (int)i, item, &items[i]));
                continue;
            }
            if (k->kind == K_INTS)
                snprintf(nums[i], sizeof nums[i], "%" JSON_INTEGER_FORMAT,
                         json_integer_value(item));
            else
                snprintf(nums[i], sizeof nums[i], "%.17g", json_number_value(item));
            items[i] = nums[i];
        }
    }
    MOE_TRY(set_list(cfg, k, items, (int)n));
    return check_key(cfg, k);
}

size_t moe_config_bom_len(const char *text, size_t len) {
    return len >= 3 && !memcmp(text, "\xEF\xBB\xBF", 3) ? 3 : 0;
}

int moe_config_load(moe_config *cfg, moe_config_src *src, const char *path) {
    // Read once through moe_fopen_regular (a FIFO would block): jansson parses
    // the text, json_pos_scan finds each key's line and column in it (jansson
    // keeps none; without them, out of memory, messages fall back to 1:1).
    FILE *f;
    MOE_TRY(moe_fopen_regular(path, &f));
    long len = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    char *text = len >= 0 && fseek(f, 0, SEEK_SET) == 0 ? malloc((size_t)len + 1) : NULL;
    int unread = !text || fread(text, 1, (size_t)len, f) != (size_t)len;
    fclose(f);
    if (unread) {
        int code = text || len < 0 ? MOE_EIO : MOE_ENOMEM;
        free(text);
        return moe_fail(code, "%s: cannot read", path);
    }
    text[len] = 0;
    // A leading UTF-8 byte order mark (editors on Windows write one) is not
    // JSON, and RFC 8259 §8.1 lets a parser ignore it: both passes start after
    // it, so positions are those an editor shows (the mark takes no column).
    const size_t bom = moe_config_bom_len(text, (size_t)len);
    const char *json = text + bom;
    // Nothing but the mark and white space: jansson would report its end of
    // input at column 0, but the fault is the whole file. (strspn stops at a
    // NUL byte, which jansson reports where it is.)
    const size_t blank = strspn(json, " \t\r\n");
    if (bom + blank == (size_t)len) {
        const char *what = !bom && !blank ? ""
                           : !blank       ? " (only a UTF-8 byte order mark)"
                           : !bom         ? " (only white space)"
                                          : " (only a UTF-8 byte order mark and white space)";
        free(text);
        return moe_fail(MOE_EINVAL,
                        "%s: the file is empty%s; a config is a JSON object ({} keeps every "
                        "default)",
                        path, what);
    }
    json_error_t jerr;
    json_t *root = json_loadb(json, (size_t)len - bom, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        free(text);
        return moe_fail(MOE_EINVAL, "%s:%d:%d: %s", path, jerr.line, moe_json_column(&jerr),
                        jerr.text);
    }
    int rc = 0;
    json_pos *pos = NULL;
    char *key = NULL, *where = NULL;
    int npos = json_pos_scan(json, &pos);
    if (npos < 0) npos = 0;
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
        size_t sl = strlen(section);
        int known = 0;
        for (int i = 0; i < N_KEYS && !known; i++)
            known = !strncmp(keys[i].key, section, sl) && keys[i].key[sl] == '.';
        if (!known) {
            char hint[160];
            rc = moe_fail(MOE_EINVAL,
                          "%s:%d:%d: unknown section '%.64s%s' (%smoe train --help-config "
                          "lists the keys)",
                          path, WHERE(section), section, sl > 64 ? "..." : "",
                          key_hint(section, true, hint, sizeof hint));
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
            key = xprintf("%s.%s", section, name);
            where = key ? xprintf("%s:%d:%d", path, WHERE(key)) : NULL;
            if (!where) {
                rc = moe_fail(MOE_ENOMEM, "%s: out of memory", path);
                goto fail;
            }
            const key_def *k = find_key(key);
            if (!k) {
                char hint[160];
                rc = moe_fail(MOE_EINVAL,
                              "%s: unknown key '%.64s%s' (%smoe train --help-config lists "
                              "the keys)",
                              where, key, strlen(key) > 64 ? "..." : "",
                              key_hint(key, false, hint, sizeof hint));
                goto fail;
            }
            rc = set_json(cfg, k, v);
            if (rc < 0) {
                rc = moe_fail(rc, "%s: %s", where, moe_last_error());
                goto fail;
            }
            src_note(src, k, where);
            where = NULL;
            free(key);
            key = NULL;
        }
    }
#undef WHERE
fail:
    json_decref(root);
    json_pos_free(pos, npos);
    free(text);
    free(key);
    free(where);
    return rc;
}

int moe_config_check_keys(const moe_config *c, const moe_config_src *src) {
    for (int i = 0; i < N_KEYS; i++) {
        int rc = check_key(c, &keys[i]);
        if (rc < 0) return moe_fail(rc, "%s: %s", src_where(src, keys[i].key), moe_last_error());
    }
    return 0;
}

const char *moe_config_where(const moe_config_src *src, const char *key) {
    return src_where(src, key);
}

unsigned moe_config_order(const moe_config_src *src, const char *key) {
    const key_def *k = find_key(key);
    return src && k && src->where[k - keys] ? src->order[k - keys] : 0;
}

void moe_config_src_mark(moe_config_src *src, const char *key, const char *where) {
    const key_def *k = find_key(key);
    if (k) src_note(src, k, xprintf("%s", where));
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
    int n = *(const int *)(base + k->count_off);
    if (is_tasks_key(k) && n > 0 && cfg->data.task_paths[0][0]) { // file tasks: the map
        json_t *o = json_object();
        for (int i = 0; o && i < n; i++)
            if (json_object_set_new(o, cfg->data.tasks[i], json_string(cfg->data.task_paths[i])))
                json_decref(o), o = NULL;
        return o;
    }
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++) {
        json_t *v = NULL;
        if (k->kind == K_INTS) v = json_integer(((const int *)(base + k->off))[i]);
        if (k->kind == K_DBLS) v = json_real(((const double *)(base + k->off))[i]);
        if (k->kind == K_STRS) v = json_string(base + k->off + (size_t)i * MOE_NAME_MAX);
        if (json_array_append_new(a, v)) json_decref(a), a = NULL;
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
        // a value jansson refuses (not UTF-8) fails the write, never drops the key
        if (json_object_set_new(obj, dot + 1, value_json(cfg, &keys[i])) < 0) {
            json_decref(root);
            return moe_fail(MOE_EINVAL, "writing the config: %s: no JSON value (not UTF-8?)",
                            keys[i].key);
        }
    }
    int rc = json_dumpf(root, f, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
    json_decref(root);
    if (rc || fputc('\n', f) == EOF) return moe_fail(MOE_EIO, "writing the config failed");
    return 0;
}

static const char *const kind_names[] = {"int",    "int",  "number",  "bool",   "string",
                                         "string", "ints", "numbers", "strings"};

static bool is_numeric(const key_def *k) {
    return k->kind == K_INT || k->kind == K_DBL || k->kind == K_INTS || k->kind == K_DBLS;
}

int moe_config_key_count(void) {
    return N_KEYS;
}

int moe_config_key_info(int i, moe_config_key *out) {
    if (i < 0 || i >= N_KEYS) return moe_fail(MOE_EINVAL, "config key %d of %d", i, N_KEYS);
    const key_def *k = &keys[i];
    *out = (moe_config_key){k->key,
                            kind_names[k->kind],
                            is_numeric(k),
                            k->kind == K_INT || k->kind == K_INTS,
                            k->kind == K_INTS || k->kind == K_DBLS || k->kind == K_STRS,
                            k->lo,
                            k->hi,
                            k->open};
    if (k->kind == K_U64) { // seeds: JSON integers are signed 64-bit
        out->numeric = out->integer = true;
        out->lo = 0, out->hi = (double)INT64_MAX;
    }
    return 0;
}

void moe_config_help(FILE *f) {
    fprintf(f, "Config keys (JSON sections; override with --set key=value):\n\n");
    for (int i = 0; i < N_KEYS; i++) {
        const key_def *k = &keys[i];
        char range[96] = "";
        if (is_numeric(k))
            moe_range_text(range, sizeof range, k->lo, k->hi, k->open,
                           k->kind == K_INT || k->kind == K_INTS);
        if (k->kind == K_U64) snprintf(range, sizeof range, "0..2^63-1");
        fprintf(f, "  %-30s %-7s default %s%s%s%s\n", k->key, kind_names[k->kind],
                k->def[0] ? k->def : "\"\"", range[0] ? ", range " : "", range,
                k->kind == K_INTS || k->kind == K_DBLS ? " each" : "");
        fprintf(f, "  %-30s %s", "", k->doc);
        if (k->values) fprintf(f, " (%s)", k->values);
        fputc('\n', f);
    }
}
