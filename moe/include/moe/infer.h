// Task-routed inference: a decoder loaded from a checkpoint for one task,
// reading only the experts that task routes to (task-routed layers: its k
// experts; token-routed layers: all, or those above --expert-budget), with a
// KV cache for incremental decoding (GQA: one cache row per kv head), greedy
// or sampled generation over a batch of prompts, and optional int8 experts.
// The math is the training forward's (moe/model.h): the same RMSNorm, RoPE,
// attention softmax, gate GEMM, router (dropless, no noise) and expert GEMMs.
#ifndef MOE_INFER_H
#define MOE_INFER_H

#include "moe/config.h"
#include "moe/router.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *task;     // task name (the checkpoint's data.tasks; "all" for bin/text data)
    bool full_load;       // load every expert (the reference for partial loads)
    double expert_budget; // > 0: token-routed layers keep only experts with at least this
                          // share of the task's routed assignments (task_experts.json)
    bool quantize_int8;   // experts stored int8 (per-output-channel symmetric scales)
    int max_batch;        // sequences decoded together (KV cache rows), default 1
    int max_seq;          // positions per sequence, default model.seq_len
} moe_infer_opts;

typedef struct {
    uint64_t bytes_read;      // safetensors bytes read: index, headers and the tensors loaded
    uint64_t ckpt_bytes;      // size of the checkpoint's safetensors files (and index)
    size_t dense_bytes;       // resident non-expert weights
    size_t expert_bytes;      // resident expert weights (int8 + scales when quantized)
    size_t expert_bytes_fp32; // the same experts in fp32
    size_t cache_bytes;       // KV cache and scratch
    int n_moe, loaded[MOE_MAX_LAYERS], experts[MOE_MAX_LAYERS]; // per layer (0 for dense)
    bool task_routed[MOE_MAX_LAYERS];
    bool derived_sets; // no task_experts.json: task sets derived from the weights
} moe_infer_stats;

// One layer's weights and KV cache.
typedef struct {
    float *ln1, *wq, *wk, *wv, *wo, *ln2;
    float *w13, *w2; // dense SwiGLU [2F, D], [D, F]
    bool is_moe, task_routed;
    int E, H, Hs;
    float *gate, *task_emb, *shared_w13, *shared_w2;
    int *slot;     // [E] loaded slot of each expert, -1 when not loaded
    bool *allowed; // [E] experts the router may pick (NULL: all)
    int n_loaded;
    float *experts; // [n_loaded][3 H D] fp32 blocks ([w1; w3] then w2), or NULL
    int8_t *q;      // int8: [n_loaded][3 H D]
    float *q_scale; // int8: [n_loaded][2H + D] one scale per output row
    float *kc, *vc; // [max_batch, max_seq, Hkv * hd]
    moe_plan plan;  // routing of the last forward (MoE layers)
    float *bias;    // [E] the checkpoint's non-zero selection bias, or NULL
} moe_infer_layer;

typedef struct {
    moe_config cfg;
    int V, D, L, Hq, Hkv, hd, F, k, n_tasks, task;
    int max_batch, max_seq, N_max; // N_max: rows per forward
    float *embed, *norm, *lm_head;
    moe_infer_layer layer[MOE_MAX_LAYERS];
    // scratch for N_max rows
    float *x, *ln, *rstd, *q, *kk, *vv, *atty, *mid, *ab, *h, *logits, *scores;
    float *mlogits, *xe, *eab, *eh, *ye, *deq;
    int *row, *cap, *task_tok;
    void *dense_block, *expert_block, *scratch_block;
    moe_infer_stats stats;
} moe_infer;

// Loads checkpoint folder dir for o->task. Errors (message names the file,
// tensor or task): MOE_EINVAL unknown task or bad option, MOE_ENOTFOUND no
// checkpoint, MOE_EFORMAT truncated file or missing/mis-shaped tensor or a
// task_experts.json that contradicts the weights, MOE_EIO, MOE_ENOMEM.
int moe_infer_open(moe_infer *m, const char *dir, const moe_infer_opts *o);
void moe_infer_free(moe_infer *m);

// One forward over N new tokens: token n belongs to cache row seq[n] at
// position pos[n] (a sequence's tokens in position order; positions below
// pos[n] of that row must be filled). Writes their keys/values into the cache
// and their logits into m->logits [N, V].
int moe_infer_forward(moe_infer *m, const int32_t *tok, const int *seq, const int *pos, int N);

typedef struct {
    int max_new;        // tokens to generate per prompt at most
    double temperature; // <= 0: greedy (ties to the lower token id)
    int top_k;          // > 0: sample among the k most likely tokens
    uint64_t seed;      // sampling: token i of prompt b draws from hash(seed, first + b, i)
    int stop;           // token that ends a sequence (kept in the output), -1: none
    int n_vocab;        // > 0: only ids below it are produced (those the tokenizer can decode)
    uint64_t first;     // the index of prompt 0 of this call among all prompts (--input line)
} moe_gen_opts;

typedef struct {
    long prefill_tokens, decode_tokens;
    double prefill_s, decode_s;
} moe_gen_stats;

// Generates for B <= max_batch prompts: prefill each prompt (one forward per
// prompt), then decode all unfinished sequences together, one token each per
// forward. out [B, max_new], n_out [B] tokens produced. A sequence stops at
// o->stop, after max_new tokens, or when it reaches max_seq positions.
int moe_generate(moe_infer *m, int B, const int32_t *const *prompt, const int *n_prompt,
                 const moe_gen_opts *o, int32_t *out, int *n_out, moe_gen_stats *st);

// Picks the next token from logits [V] (greedy or sampled, see moe_gen_opts;
// ids >= o->n_vocab when it is set are never picked); idx: scratch of V ints.
int moe_sample_token(const float *logits, int V, const moe_gen_opts *o, uint64_t b, uint64_t i,
                     int *idx);

// Mean cross-entropy of m's task on n_batches validation batches of d (the
// scored tokens of the sequences of that task; each sequence is one prefill).
// *n gets the number of scored tokens. The inference engine's counterpart of
// moe_eval's per-task loss, so partial, budgeted and int8 loads can be
// compared with the full load.
int moe_infer_val_loss(moe_infer *m, void *data, int n_batches, double *loss, long *n);

#endif
