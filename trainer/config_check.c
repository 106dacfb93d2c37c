// Whole-config checks: every key's range (the key table, trainer/config.c),
// the combinations of keys that cannot work together, and the sizes the model
// derives from the config, checked in int64 before anything is allocated.
#include "moe/config.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/parse.h"
#include "trainer/config_internal.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

// Largest element count of one buffer: far beyond any machine, small enough
// that sums of a model's buffers in size_t and bytes in size_t never overflow.
#define MAX_ELEMS ((int64_t)1 << 40)

// Where a combination of two keys went wrong: a's location, or b's when only
// b was set (a file that sets n_heads = 3 against the default n_kv_heads is
// at fault where it sets n_heads) or b came from --set and a did not.
static const char *src_where2(const moe_config_src *src, const char *a, const char *b) {
    const char *w = moe_config_where(src, a), *wb = moe_config_where(src, b);
    if (!strncmp(wb, "--", 2) && strncmp(w, "--", 2)) return wb; // --set or --grid (ablate)
    return strcmp(w, "default") ? w : wb;
}

// Where a message of the router's own check (which knows no sources) went
// wrong: the place of a router key it names that a --set gave, else of one a
// file gave, else "config".
static const char *where_named(const moe_config_src *src, const char *msg) {
    const char *file = NULL;
    for (const char *p = msg; (p = strstr(p, "router.")) != NULL;) {
        char key[64];
        size_t n = strspn(p, "abcdefghijklmnopqrstuvwxyz_.");
        snprintf(key, sizeof key, "%.*s", (int)(n < sizeof key ? n : sizeof key - 1), p);
        const char *w = moe_config_where(src, key);
        if (!strncmp(w, "--", 2)) return w;
        if (!file && strcmp(w, "default")) file = w;
        p += n;
    }
    return file ? file : "config";
}

// placement.* (moe/placement.h): slots hold at least the home experts and at
// most every expert; replicas need spare slots, an EP group, and the CPU
// token-choice exchange (the GPU path, expert choice and the node-deduplicated
// dispatch do not route through the placement table).
static int check_placement(const moe_config *c, const moe_config_src *src, int n_moe) {
    const int S = c->placement.slots_per_rank, ep = c->parallel.ep;
    const bool rep = !strcmp(c->placement.mode, "replicate"),
               move = !strcmp(c->placement.mode, "move");
    for (int i = 0; n_moe > 0 && S > 0 && i < c->moe.n_num_experts; i++) {
        const int E = c->moe.num_experts[i];
        if (S < E / ep || S > E)
            return moe_fail(MOE_EINVAL,
                            "%s: placement.slots_per_rank = %d must be between E/parallel.ep = %d "
                            "and moe.num_experts = %d",
                            src_where2(src, "placement.slots_per_rank", "parallel.ep"), S, E / ep,
                            E);
        if (rep && S == E / ep)
            return moe_fail(MOE_EINVAL,
                            "%s: placement.mode = replicate needs spare slots: "
                            "placement.slots_per_rank = %d is E/parallel.ep",
                            moe_config_where(src, "placement.slots_per_rank"), S);
    }
    if (!rep && !move) return 0;
    // Each reason names the other key, so the location is the --set that broke the pair.
    const char *why = ep < 2                             ? "parallel.ep > 1"
                      : S == 0 && rep                    ? "placement.slots_per_rank above E/ep"
                      : !strcmp(c->train.device, "cuda") ? "train.device = cpu"
                      : c->router.type == MOE_ROUTER_EXPERT_CHOICE ? "router.type = token_choice"
                      : c->comm.node_dedup                         ? "comm.node_dedup = false"
                      : n_moe == 0                                 ? "MoE layers"
                                                                   : NULL;
    if (why) {
        char other[64];
        snprintf(other, sizeof other, "%.*s", (int)strcspn(why, " "), why);
        const char *where = strchr(other, '.') ? src_where2(src, "placement.mode", other)
                                               : moe_config_where(src, "placement.mode");
        return moe_fail(MOE_EINVAL, "%s: placement.mode = %s needs %s", where, c->placement.mode,
                        why);
    }
    return 0;
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

typedef struct {
    const char *name; // a key, or a constant factor such as "2"
    int64_t v;
} factor;

// Checks that the product of n factors is at most limit, in int64 with
// overflow detection; the message names every factor and where the one set
// last on the command line (--set, --grid) was set: that is what pushed a
// product the file allowed past the limit. Without one, the first factor
// the file gave.
static int product_max(const moe_config_src *src, int64_t limit, const char *why, int n,
                       const factor *f) {
    int64_t p = 1;
    bool over = false;
    for (int i = 0; i < n && !over; i++)
        over = __builtin_mul_overflow(p, f[i].v, &p);
    if (!over && p <= limit) return 0;
    char names[256] = "", value[32]; // key names and numbers: bounded
    const char *where = "config";
    unsigned last = 0;
    for (int i = 0; i < n; i++) {
        size_t used = strlen(names);
        snprintf(names + used, sizeof names - used, "%s%s", i ? " * " : "", f[i].name);
        const char *w = moe_config_where(src, f[i].name);
        unsigned order = moe_config_order(src, f[i].name);
        if (!strncmp(w, "--", 2) && order > last) {
            where = w;
            last = order;
        } else if (!last && !strcmp(where, "config") && strcmp(w, "default")) {
            where = w;
        }
    }
    if (over)
        snprintf(value, sizeof value, "more than 2^63");
    else
        snprintf(value, sizeof value, "%lld", (long long)p);
    return moe_fail(MOE_EINVAL, "%s: %s = %s exceeds %lld (%s)", where, names, value,
                    (long long)limit, why);
}

int moe_config_check_sizes(const moe_config *c, const moe_config_src *src, int B, int T) {
    const int64_t D = c->model.d_model, V = c->model.vocab_size, F = c->model.d_ff;
    const factor seq = {"model.seq_len", T}, batch = {"train.batch_size", B};
    const factor d = {"model.d_model", D}, v = {"model.vocab_size", V}, two = {"2", 2};
    if (B < 1 || T < 1)
        return moe_fail(MOE_EINVAL, "config: batch of %d sequences of %d tokens", B, T);
    MOE_TRY(product_max(src, INT_MAX, "token indices are int", 2, (factor[]){seq, batch}));
    int e_max = 0;
    for (int l = 0; l < c->model.n_layers && l < MOE_MAX_LAYERS; l++) {
        int e = moe_config_experts(c, l);
        if (e > e_max) e_max = e;
    }
    // The MoE layer indexes expert rows and its [rows, H] buffers with int.
    const factor h =
        c->moe.d_expert ? (factor){"moe.d_expert", c->moe.d_expert} : (factor){"model.d_ff", F};
    const factor e = {"moe.num_experts", e_max}, k = {"router.top_k", c->router.top_k};
    if (e_max > 0) {
        MOE_TRY(product_max(src, INT_MAX / 2, "expert rows are int", 3, (factor[]){seq, batch, k}));
        MOE_TRY(product_max(src, INT_MAX, "router logits are indexed by int", 3,
                            (factor[]){seq, batch, e}));
        MOE_TRY(product_max(src, INT_MAX, "expert activations are indexed by int", 4,
                            (factor[]){seq, batch, two, h}));
        MOE_TRY(product_max(src, INT_MAX, "expert weights are indexed by int", 3,
                            (factor[]){two, h, d}));
        MOE_TRY(product_max(src, MAX_ELEMS, "elements of one layer's expert weights", 4,
                            (factor[]){e, {"3", 3}, h, d}));
    }
    MOE_TRY(product_max(src, MAX_ELEMS, "elements of the embedding", 2, (factor[]){v, d}));
    MOE_TRY(product_max(src, MAX_ELEMS, "elements of the logits", 3, (factor[]){seq, batch, v}));
    MOE_TRY(
        product_max(src, MAX_ELEMS, "elements of the activations", 3, (factor[]){seq, batch, d}));
    MOE_TRY(product_max(src, MAX_ELEMS, "elements of the dense FFN activations", 4,
                        (factor[]){seq, batch, two, {"model.d_ff", F}}));
    MOE_TRY(product_max(src, MAX_ELEMS, "elements of the attention probabilities", 4,
                        (factor[]){batch, {"model.n_heads", c->model.n_heads}, seq, seq}));
    return 0;
}

// A key the user set to a value other than its default: only those get a
// note, since a run's saved config.json sets every key, defaults included.
static bool user_set(const moe_config_src *src, const char *key, bool differs) {
    return differs && strcmp(moe_config_where(src, key), "default") != 0;
}

int moe_config_ignored(const moe_config *c, const moe_config_src *src, char (*notes)[256],
                       int max) {
    moe_config d;
    moe_config_default(&d);
    int n = 0;
#define NOTE(...) (n < max ? snprintf(notes[n++], 256, __VA_ARGS__) : 0)
    const bool synth = !strcmp(c->data.kind, "synthetic");
    const bool file_tasks = c->data.n_tasks > 0 && c->data.task_paths[0][0];
    if (synth && user_set(src, "data.path", c->data.path[0]))
        NOTE("%s: data.path is ignored: data.kind = synthetic generates its data (set data.kind "
             "to llmc, nanogpt or text to read the file)",
             moe_config_where(src, "data.path"));
    if (c->data.val_path[0] &&
        user_set(src, "data.val_fraction", c->data.val_fraction != d.data.val_fraction))
        NOTE("%s: data.val_fraction = %g is ignored: data.val_path holds the validation data",
             moe_config_where(src, "data.val_fraction"), c->data.val_fraction);
    if (!file_tasks &&
        user_set(src, "data.task_sampling", c->data.task_sampling != d.data.task_sampling))
        NOTE("%s: data.task_sampling is ignored: it weighs file tasks (data.tasks = {name: "
             "glob}), and this config has none",
             moe_config_where(src, "data.task_sampling"));
    if (user_set(src, "data.task_temperature",
                 c->data.task_temperature != d.data.task_temperature) &&
        (!file_tasks || c->data.task_sampling != MOE_TASK_SAMPLING_TEMPERATURE))
        NOTE("%s: data.task_temperature = %g is ignored: it applies to file tasks with "
             "data.task_sampling = temperature",
             moe_config_where(src, "data.task_temperature"), c->data.task_temperature);
    // The default tasks in any order (configs/tiny.json's) count as the
    // default: a config made for synthetic data, switched with --set data.kind.
    bool tasks_differ = c->data.n_tasks != d.data.n_tasks;
    for (int i = 0; !tasks_differ && i < c->data.n_tasks; i++) {
        tasks_differ = true;
        for (int j = 0; j < d.data.n_tasks; j++)
            if (!strcmp(c->data.tasks[i], d.data.tasks[j])) tasks_differ = false;
    }
    if (!synth && !file_tasks && user_set(src, "data.tasks", tasks_differ))
        NOTE("%s: data.tasks is ignored: with data.kind = %s it names synthetic tasks, and the "
             "data is one corpus (file tasks are name=glob pairs)",
             moe_config_where(src, "data.tasks"), c->data.kind);
#undef NOTE
    return n;
}

int moe_config_check(const moe_config *c, const moe_config_src *src) {
    MOE_TRY(moe_config_check_keys(c, src));
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
    int n_moe = 0, e_min = 0;
    for (int l = 0; l < c->model.n_layers; l++)
        n_moe += moe_config_is_moe(c, l);
    if (c->moe.every > 0 && n_moe == 0)
        return moe_fail(MOE_EINVAL,
                        "%s: moe.every = %d leaves no MoE layer in model.n_layers = %d "
                        "(moe.every = 0 makes a dense model)",
                        src_where2(src, "moe.every", "model.n_layers"), c->moe.every,
                        c->model.n_layers);
    // Before the router's own check (moe_router_config_check), which refuses task
    // priorities under position order: a list of the wrong length is the first fault.
    if (c->router.n_task_priority > 0 &&
        (!strcmp(c->data.kind, "synthetic") || c->data.task_paths[0][0]) &&
        c->router.n_task_priority != c->data.n_tasks)
        return moe_fail(MOE_EINVAL, "%s: router.task_priority has %d entries for %d tasks",
                        moe_config_where(src, "router.task_priority"), c->router.n_task_priority,
                        c->data.n_tasks);
    if (n_moe > 0) {
        if (c->moe.n_num_experts != 1 && c->moe.n_num_experts != n_moe)
            return moe_fail(MOE_EINVAL,
                            "%s: moe.num_experts has %d entries but the model has %d "
                            "MoE layers",
                            moe_config_where(src, "moe.num_experts"), c->moe.n_num_experts, n_moe);
        for (int i = 0; i < c->moe.n_num_experts; i++) {
            int e = c->moe.num_experts[i];
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
        for (int i = 0; rc == 0 && i < c->moe.n_num_experts; i++) // every layer's groups
            rc = moe_router_config_check(&c->router, c->moe.num_experts[i]);
        if (rc < 0) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", moe_last_error());
            return moe_fail(rc, "%s: %s", where_named(src, msg), msg);
        }
    }
    if (c->router.type == MOE_ROUTER_EXPERT_CHOICE && c->moe.n_task_layers > 0)
        return moe_fail(MOE_EINVAL,
                        "%s: router.type = expert_choice with moe.task_layers: task-routed layers "
                        "send every token of a task to the same top_k experts (token choice)",
                        src_where2(src, "router.type", "moe.task_layers"));
    for (int i = 0; i < c->moe.n_task_layers; i++) {
        int l = c->moe.task_layers[i];
        if (l >= c->model.n_layers || !moe_config_is_moe(c, l))
            return moe_fail(MOE_EINVAL, "%s: moe.task_layers entry %d is not an MoE layer",
                            moe_config_where(src, "moe.task_layers"), l);
        // A layer is task-routed or not: a second entry would be dead text.
        for (int j = 0; j < i; j++)
            if (c->moe.task_layers[j] == l)
                return moe_fail(MOE_EINVAL, "%s: moe.task_layers lists layer %d twice",
                                moe_config_where(src, "moe.task_layers"), l);
    }
    // A task-routed layer picks k experts per task (moe/task_experts.h derives
    // them from the gate alone): a token-load bias has nothing to balance there.
    if (c->router.bias_update_rate > 0 && c->moe.n_task_layers > 0)
        return moe_fail(
            MOE_EINVAL,
            "%s: router.bias_update_rate = %g with moe.task_layers: auxiliary-loss-free "
            "balancing needs token-routed layers (set one of them to 0 / [])",
            src_where2(src, "router.bias_update_rate", "moe.task_layers"),
            c->router.bias_update_rate);
    // A synthetic sample scores nothing before its answer: the task marker, 4
    // input letters and '=' come first, so shorter sequences of the letter
    // tasks hold no target and every loss would be 0 / 0.
    if (!strcmp(c->data.kind, "synthetic") && !c->data.task_paths[0][0] && c->model.seq_len < 6)
        return moe_fail(MOE_EINVAL,
                        "%s: model.seq_len = %d is too short for synthetic data: a sample's "
                        "answer starts at position 6 (task marker, 4 input tokens, '=')",
                        moe_config_where(src, "model.seq_len"), c->model.seq_len);
    // Synthetic data is samples of its tasks: no task, nothing to train on.
    if (!strcmp(c->data.kind, "synthetic") && c->data.n_tasks < 1)
        return moe_fail(MOE_EINVAL,
                        "%s: data.tasks is empty: synthetic data needs at least one of copy, "
                        "reverse, sort, caesar, add",
                        moe_config_where(src, "data.tasks"));
    // Synthetic task names: known generators, each once (generate --task and
    // the checkpoint's task records look tasks up by name).
    const bool synth_names = !strcmp(c->data.kind, "synthetic") && !c->data.task_paths[0][0];
    for (int i = 0; synth_names && i < c->data.n_tasks; i++) {
        if (moe_synth_task_index(c->data.tasks[i]) < 0) {
            static const char *const known[] = {"copy", "reverse", "sort", "caesar", "add"};
            const char *best = moe_nearest(c->data.tasks[i], known, 5);
            char hint[64] = "";
            if (best) snprintf(hint, sizeof hint, " (did you mean %s?)", best);
            return moe_fail(MOE_EINVAL,
                            "%s: data.tasks entry %d is '%s', expected one of copy, reverse, "
                            "sort, caesar, add%s",
                            moe_config_where(src, "data.tasks"), i, c->data.tasks[i], hint);
        }
        for (int j = 0; j < i; j++)
            if (!strcmp(c->data.tasks[i], c->data.tasks[j]))
                return moe_fail(MOE_EINVAL, "%s: data.tasks lists '%s' twice",
                                moe_config_where(src, "data.tasks"), c->data.tasks[i]);
    }
    // File tasks (data.tasks = {name: glob}): one corpus per task, read in the
    // format data.kind names; data.path and data.val_path would be a second
    // corpus, so they stay empty.
    const bool file_tasks = c->data.n_tasks > 0 && c->data.task_paths[0][0];
    if (file_tasks && !strcmp(c->data.kind, "synthetic"))
        return moe_fail(MOE_EINVAL,
                        "%s: data.tasks maps tasks to files: set data.kind to llmc, nanogpt or "
                        "text",
                        moe_config_where(src, "data.tasks"));
    if (file_tasks && (c->data.path[0] || c->data.val_path[0]))
        return moe_fail(MOE_EINVAL,
                        "%s: data.%s is set with file tasks in data.tasks: each task's files "
                        "hold its training and validation data (the tail of each file)",
                        moe_config_where(src, c->data.path[0] ? "data.path" : "data.val_path"),
                        c->data.path[0] ? "path" : "val_path");
    for (int i = 0; file_tasks && i < c->data.n_tasks; i++)
        for (int j = 0; j < i; j++)
            if (!strcmp(c->data.tasks[i], c->data.tasks[j]))
                return moe_fail(MOE_EINVAL, "%s: data.tasks lists '%s' twice",
                                moe_config_where(src, "data.tasks"), c->data.tasks[i]);
    if (strcmp(c->data.kind, "synthetic") && !file_tasks && !c->data.path[0])
        return moe_fail(MOE_EINVAL,
                        "%s: data.kind = %s needs data.path (or file tasks in "
                        "data.tasks)",
                        moe_config_where(src, "data.kind"), c->data.kind);
    if (!strcmp(c->data.kind, "synthetic") && c->data.val_path[0])
        return moe_fail(MOE_EINVAL, "%s: data.val_path is for file data (data.kind = synthetic)",
                        moe_config_where(src, "data.val_path"));
    if (!c->model.tokenizer[0])
        return moe_fail(MOE_EINVAL, "%s: model.tokenizer is empty: bytes or a .model file",
                        moe_config_where(src, "model.tokenizer"));
    // The synthetic tasks and text files are byte tokens: another tokenizer
    // would decode them into nonsense. Token files come from moe prepare.
    if (strcmp(c->model.tokenizer, "bytes") &&
        (!strcmp(c->data.kind, "synthetic") || !strcmp(c->data.kind, "text")))
        return moe_fail(MOE_EINVAL,
                        "%s: model.tokenizer = %s with data.kind = %s, which is byte tokens: use "
                        "model.tokenizer = bytes, or token files written with that tokenizer",
                        src_where2(src, "model.tokenizer", "data.kind"), c->model.tokenizer,
                        c->data.kind);
    int chunked = c->memory.mini_seq > 1, recompute = strcmp(c->memory.recompute, "none") != 0;
    if (chunked != recompute)
        return moe_fail(MOE_EINVAL,
                        "%s: memory.mini_seq = %d with memory.recompute = %s: chunks are "
                        "recomputed in backward, so mini_seq > 1 goes with recompute = moe or all, "
                        "and recompute = moe or all with mini_seq > 1",
                        src_where2(src, chunked ? "memory.mini_seq" : "memory.recompute",
                                   chunked ? "memory.recompute" : "memory.mini_seq"),
                        c->memory.mini_seq, c->memory.recompute);
    if (chunked && (c->memory.mini_seq > c->model.seq_len || c->parallel.ep > 1))
        return moe_fail(MOE_EINVAL,
                        "%s: memory.mini_seq = %d needs at most model.seq_len (%d) chunks and "
                        "parallel.ep = 1",
                        src_where2(src, "memory.mini_seq", "model.seq_len"), c->memory.mini_seq,
                        c->model.seq_len);
    // The GPU trainer keeps fp32 moments on the device (trainer/train_gpu.c).
    if (!strcmp(c->train.device, "cuda") && !strcmp(c->train.optimizer_state, "bf16"))
        return moe_fail(
            MOE_EINVAL,
            "%s: train.optimizer_state = bf16 with train.device = cuda: bf16 "
            "optimizer states are CPU-only; use train.optimizer_state = fp32 on the GPU",
            src_where2(src, "train.optimizer_state", "train.device"));
    // bf16 tensor-core GEMMs exist only in the CUDA op table (trainer/train_gpu.c
    // picks it); the CPU trainer would run fp32 under a config that says bf16.
    if (strcmp(c->train.device, "cuda") && !strcmp(c->train.compute, "bf16"))
        return moe_fail(MOE_EINVAL,
                        "%s: train.compute = bf16 needs --device cuda (train.device = cuda): the "
                        "CPU trainer computes in fp32; use train.compute = fp32 on the CPU",
                        src_where2(src, "train.compute", "train.device"));
    // The overlapped exchange pipelines host transfers with device GEMMs
    // (moe/src/moe_layer_cuda_ep.c); the CPU layer has nothing to overlap with.
    const int od = c->comm.overlap_degree;
    if (od > 1 && (strcmp(c->train.device, "cuda") || od > c->parallel.ep))
        return moe_fail(
            MOE_EINVAL,
            "%s: comm.overlap_degree = %d needs train.device = cuda and at most "
            "parallel.ep (%d) rounds",
            src_where2(src, "comm.overlap_degree",
                       strcmp(c->train.device, "cuda") ? "train.device" : "parallel.ep"),
            od, c->parallel.ep);
    MOE_TRY(check_placement(c, src, n_moe));
    return moe_config_check_sizes(c, src, c->train.batch_size, c->model.seq_len);
}
