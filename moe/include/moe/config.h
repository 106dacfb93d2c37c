// Run configuration: every key with a documented default (moe train
// --help-config), loaded from JSON with file:line:col errors, overridden with
// --set key=value (typed by the key), checked for impossible combinations, and
// written back as the resolved config of a run.
#ifndef MOE_CONFIG_H
#define MOE_CONFIG_H

#include "moe/router.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define MOE_MAX_LAYERS 64
#define MOE_NAME_MAX 32
#define MOE_PATH_MAX 512

// data.task_sampling: how training rows pick a file task.
enum {
    MOE_TASK_SAMPLING_PROPORTIONAL = 0,
    MOE_TASK_SAMPLING_UNIFORM,
    MOE_TASK_SAMPLING_TEMPERATURE
};

typedef struct {
    struct {
        int vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, seq_len;
        double rope_theta, norm_eps;
        bool tie_embeddings;
        char tokenizer[MOE_PATH_MAX]; // "bytes" or a SentencePiece .model (moe/tokenizer.h)
    } model;
    struct {
        int n_num_experts;               // 1: one value for every MoE layer
        int num_experts[MOE_MAX_LAYERS]; // per MoE layer (pyramid / PR-MoE)
        int d_expert;                    // expert FFN hidden size (0: model.d_ff)
        int every;                       // MoE in every n-th layer (0: none)
        int shared_experts;              // 0 or 1 shared (residual) expert
        int n_task_layers;
        int task_layers[MOE_MAX_LAYERS]; // layer indices routed by task
    } moe;
    moe_router_config router; // router.* and capacity.*
    struct {
        int steps, batch_size, warmup_steps, grad_accum, eval_every, ckpt_every, log_every;
        double lr, min_lr_ratio, weight_decay, grad_clip, beta1, beta2;
        bool decay_all; // weight decay on norm weights and embeddings too
        uint64_t seed;
        char device[MOE_NAME_MAX];  // cpu | cuda
        char compute[MOE_NAME_MAX]; // fp32 | bf16 (GEMMs on the GPU)
        bool tensorboard;           // also write TensorBoard event files into the run folder
        int keep_checkpoints;       // > 0: checkpoint-STEP/ folders kept, `latest` names one
        bool async_checkpoint;      // periodic saves written by a background thread
        char optimizer_state[MOE_NAME_MAX]; // fp32 | bf16: how AdamW stores its moments
    } train;
    struct {
        char kind[MOE_NAME_MAX]; // synthetic | bin (= llmc) | llmc | nanogpt | text
        char path[MOE_PATH_MAX]; // a file or a glob (sorted)
        int n_tasks;
        char tasks[MOE_MAX_TASKS][MOE_NAME_MAX];
        double val_fraction;
        char val_path[MOE_PATH_MAX]; // validation file or glob ("": the tail of each file)
        // File tasks (data.tasks = {name: file or glob}): one corpus per task;
        // all "" for synthetic task names.
        char task_paths[MOE_MAX_TASKS][MOE_PATH_MAX];
        int task_sampling;       // MOE_TASK_SAMPLING_*
        double task_temperature; // temperature sampling: p_i proportional to n_i^(1/T)
        bool shuffle;            // windows in a seeded order per epoch (false: file order)
    } data;
    struct {
        int ep;
    } parallel;
    struct {
        char all_to_all[MOE_NAME_MAX]; // flat | hierarchical
        int ranks_per_node;            // 0: from MPI_COMM_TYPE_SHARED
        double timeout_s;              // collective watchdog (moe_comm_set_timeout); 0: off
        bool node_dedup;               // one copy per token and node in the EP dispatch
        int overlap_degree;            // GPU EP exchange rounds overlapped with expert GEMMs
    } comm;
    struct {
        char impl[MOE_NAME_MAX]; // plain | cce
        bool cce_filter;         // skip tiles below float epsilon in the CCE backward
    } loss;
    struct {
        int mini_seq;
        char recompute[MOE_NAME_MAX]; // none | moe | all
    } memory;
    struct {
        char mode[MOE_NAME_MAX]; // static | replicate (moe/placement.h)
        int slots_per_rank;      // expert slots per rank (0: E / parallel.ep, no spare)
        int update_every;        // steps between placement updates
    } placement;
} moe_config;

// Where each key's value came from, for error messages.
typedef struct moe_config_src moe_config_src;

void moe_config_default(moe_config *cfg);
// Creates/destroys the source table (key -> file:line:col or --set).
moe_config_src *moe_config_src_new(void);
void moe_config_src_free(moe_config_src *src);

// Loads a JSON file over cfg. Errors: "path:line:col: message". Every value
// is checked against its key's range as it is set (moe_config_key_info).
int moe_config_load(moe_config *cfg, moe_config_src *src, const char *path);
// Bytes a config file's JSON starts after: 3 for a leading UTF-8 byte order
// mark (RFC 8259 §8.1 lets a parser ignore it), else 0. Every reader of a
// config file skips them, as moe_config_load does.
size_t moe_config_bom_len(const char *text, size_t len);
// Applies "key=value" (value typed by the key; lists as "1,2,3" or "[1,2,3]";
// an empty item, a trailing comma or an unpaired bracket is an error).
int moe_config_set(moe_config *cfg, moe_config_src *src, const char *assignment);
// Checks every key's range, the combinations and the sizes (below, for
// train.batch_size x model.seq_len); the message names the key at fault and
// where it was set.
int moe_config_check(const moe_config *cfg, const moe_config_src *src);
// Checks the sizes a model of B sequences of T tokens computes from the
// config, in int64 before anything is allocated: token and expert-row counts
// fit int, every buffer fits 2^40 elements. The message names the keys whose
// product is too large ("model.seq_len * train.batch_size = ... exceeds ...").
int moe_config_check_sizes(const moe_config *cfg, const moe_config_src *src, int B, int T);
// Keys the user set to a non-default value that this config then ignores
// (data.path with data.kind = synthetic, data.val_fraction beside
// data.val_path, task sampling without file tasks, data.tasks names with file
// data): one line each, naming where the key was set and why it is ignored,
// into notes (at most max); returns how many. Not refused: a run's saved
// config.json carries such keys, and resuming it must keep working.
int moe_config_ignored(const moe_config *cfg, const moe_config_src *src, char (*notes)[256],
                       int max);
// Writes the whole resolved config as JSON (sections, every key).
int moe_config_write(const moe_config *cfg, FILE *f);
// Prints every key, its type, default, range and meaning.
void moe_config_help(FILE *f);

// One key of the table, for --help-config and tests that walk every key.
typedef struct {
    const char *key;  // "train.log_every"
    const char *type; // int, number, bool, string, ints, numbers, strings
    bool numeric;     // the range below applies (lists: to every item)
    bool integer;
    bool list;
    double lo, hi; // lo = -DBL_MAX / hi = DBL_MAX: unbounded on that side
    int open;      // MOE_RANGE_LO_OPEN / MOE_RANGE_HI_OPEN (moe/parse.h): end excluded
} moe_config_key;
int moe_config_key_count(void);
int moe_config_key_info(int i, moe_config_key *out);

// Number of experts of MoE layer `layer` (0 for a dense layer).
int moe_config_experts(const moe_config *cfg, int layer);
// True if layer `layer` is an MoE layer.
bool moe_config_is_moe(const moe_config *cfg, int layer);

#endif
