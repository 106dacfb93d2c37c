// The decoder (Mixtral semantics): embedding; per layer RMSNorm -> causal
// GQA attention with RoPE -> residual -> RMSNorm -> dense SwiGLU or MoE ->
// residual; final RMSNorm; LM head (tied or not). Parameters and gradients
// are two flat buffers described by one table with Hugging Face names.
#ifndef MOE_MODEL_H
#define MOE_MODEL_H

#include "kernels/ops.h"
#include "moe/config.h"
#include "moe/moe_layer.h"
#include "moe/params.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    float *ln1, *wq, *wk, *wv, *wo, *ln2; // attention block
    float *w13, *w2;                      // dense SwiGLU: [2F, D] (gate then up), [D, F]
    moe_layer_params moe;                 // MoE block (is_moe)
} moe_block_params;

typedef struct {
    // saved activations [N, *] with N = B*T tokens
    float *x;           // [N, D] layer input (residual stream)
    float *ln1, *rstd1; // [N, D], [N]
    float *q, *k, *v;   // [N, Hq*hd], [N, Hkv*hd] x2, q and k after RoPE
    float *att;         // backend-sized saved state (ops->attention_state_floats)
    float *atty;        // [N, Hq*hd]
    float *mid;         // [N, D] after the attention residual
    float *ln2, *rstd2; // [N, D], [N]
    float *ab, *h;      // dense FFN: [N, 2F], [N, F]
    moe_layer_acts moe; // MoE block
} moe_block_acts;

// Seconds per phase, ADDED by forward and backward when m->timing is set.
// MoE blocks report through their layer timing (moe_layer_timing), which the
// model points at `moe` here.
typedef struct {
    double attention; // norms, q/k/v/o projections, RoPE, attention
    double ffn;       // dense SwiGLU blocks
    double moe;       // MoE blocks (split in moe_layer below)
    double head;      // final norm, LM head and cross-entropy
    double embed;     // embedding lookup and its gradient
    moe_layer_timing moe_layer;
} moe_model_timing;

typedef struct {
    moe_config cfg;
    const moe_ops *ops;
    int V, D, L, Hq, Hkv, hd, F, B, T, n_tasks;
    const moe_ep_group *ep; // expert-parallel group, NULL in a single process
    int chunks;             // memory.mini_seq: FFN, MoE and LM head run in this many chunks
    bool recompute_attn;    // memory.recompute = all: one set of attention buffers, recomputed
    moe_param_table table;
    float *params, *grads;
    float *embed, *norm, *lm_head;       // into params
    float *d_embed, *d_norm, *d_lm_head; // into grads
    bool is_moe[MOE_MAX_LAYERS];
    moe_layer_config moe_cfg[MOE_MAX_LAYERS];
    moe_block_params p[MOE_MAX_LAYERS], g[MOE_MAX_LAYERS];
    moe_block_acts a[MOE_MAX_LAYERS];
    moe_capacity_ctl cap[MOE_MAX_LAYERS]; // dynamic capacity per MoE layer
    // pre-drop load summed over the training forwards since the last
    // capacity update: [n MoE layers][usage_E], and the number of forwards
    double *load;
    long load_calls;
    // auxiliary-loss-free balancing (router/bias.c): the selection bias of
    // each MoE layer, [n MoE layers][usage_E] (zeros until moved or loaded);
    // bias_on: attached to the layers' plans (router.bias_update_rate > 0, or
    // a bias loaded from a checkpoint). max_vio: MaxVio of the last step's
    // global load per layer (moe_model_bias_step)
    float *bias;
    bool bias_on;
    double max_vio[MOE_MAX_LAYERS];
    // whole-model activations and scratch
    float *xf, *lnf, *rstdf, *logits, *losses; // [N, D], [N, D], [N], [N or T, V], [N]
    float *lse, *cce_scratch;
    float *ffn_ab, *ffn_h; // chunks > 1: one chunk's dense-FFN intermediates, all layers //
                           // loss.impl = cce: [N], one tile
    int32_t *task_tok;     // [N] task id of every token
    float *dres, *dln, *dq, *dk, *dv, *dqr, *dkr, *datty, *datt, *dab, *dh, *dlogits;
    // results of the last forward
    double ce, aux, z, loss;
    int cur_B, cur_T;
    // inference: route without capacity limits (Mixtral-style dropless
    // decoding); capacity limits are a training-time load-balancing device
    bool dropless;
    // built by moe_model_init_eval: no gradients (grads and the d* buffers
    // NULL), moe_model_backward refuses it
    bool forward_only;
    int *cap_all;             // [max E] scratch capacities for dropless calls
    moe_model_timing *timing; // optional, set by the caller
    // eval: expert-usage counts [layer][task][expert] of first choices when set
    long *usage;
    int usage_E; // experts per row of usage (max over layers)
    // checkpoints: share of each task's routed assignments per expert in the
    // token-routed layers [n MoE layers][n_tasks][usage_E], measured on
    // validation batches before a save (moe/task_experts.h); NULL: none
    double *task_share;
    long task_share_tokens;
    // checkpoints: the tokenizer whose .model bytes every save copies, opened
    // once by the caller (the trainer, when the run starts) and owned by it,
    // so a model.tokenizer file replaced or removed mid-run changes no
    // checkpoint; NULL: each save opens model.tokenizer itself
    const struct moe_tokenizer *tokenizer;
    // a device copy made by moe_model_gpu_init: its MoE layers' CUDA state;
    // NULL for a host model
    struct moe_model_gpu *gpu;
} moe_model;

// Builds the model for cfg (checked) with room for B sequences of T tokens,
// n_tasks task ids; parameters initialised from cfg->train.seed. One process
// holds every expert: cfg->parallel.ep is taken as 1.
int moe_model_init(moe_model *m, const moe_config *cfg, int B, int T, int n_tasks);
// The same on a rank of an expert-parallel group of cfg->parallel.ep ranks:
// the model holds this rank's expert shard and exchanges rows through ep
// (which must outlive the model). ep NULL: a single process, parallel.ep 1.
int moe_model_init_ep(moe_model *m, const moe_config *cfg, int B, int T, int n_tasks,
                      const moe_ep_group *ep);
// The same model for evaluation (moe eval): forward only, without the
// gradients and the backward's buffers, and its parameters zero, to be read
// from a checkpoint (moe_ckpt_load, which demands every tensor).
int moe_model_init_eval(moe_model *m, const moe_config *cfg, int B, int T, int n_tasks);
// Only the parameter table, sizes and layer kinds of moe_model_init's model
// (one sequence of one token): no buffers, nothing initialised. For readers
// that check a checkpoint's tensor names and shapes; moe_model_free frees it.
int moe_model_init_table(moe_model *m, const moe_config *cfg, int n_tasks);
void moe_model_free(moe_model *m);

// Forward on inputs [B, T] (B <= allocated B, T <= allocated T). targets may
// be NULL (no loss; logits only). task [B] per sequence or NULL (all 0).
// Sets m->ce, aux, z and loss = ce + aux_coef*aux + z_coef*z (aux and z summed
// over MoE layers). training enables router noise (seeded by step) and adds
// the routing load to m->load for moe_model_capacity_step.
int moe_model_forward(moe_model *m, const int32_t *inputs, const int32_t *targets,
                      const int32_t *task, int B, int T, bool training, uint64_t step);
// Backward of the last forward with targets: ADDS into m->grads.
int moe_model_backward(moe_model *m, const int32_t *inputs, const int32_t *targets,
                       const int32_t *task);

// Bytes a model would take, computed from the same layout the model
// allocates, without allocating: the memory estimator (moe plan) uses it.
typedef struct {
    size_t params, grads; // flat parameter and gradient buffers
    size_t activations;   // saved activations and backward scratch (dense part)
    size_t moe;           // MoE layers: routing plans, expert buffers, capacity state
    size_t n_params;      // floats on this rank
} moe_model_mem;
// dedup_G: the ranks per node of the expert-parallel group when its exchange
// is node-deduplicated (comm.node_dedup; moe_ep_group.dedup_G), else 0.
int moe_model_memory(const moe_config *cfg, int B, int T, int n_tasks, int ep_size, int ep_rank,
                     int dedup_G, moe_model_mem *out);
// The device copy's buffers (moe_model_gpu_init) on the table ops (NULL: the
// CUDA table's sizes, moe_ops_cuda_sizes, in any build), each request rounded
// as ops->alloc_size: params, grads, activations (the activation block and
// the device task ids), moe (the CUDA MoE layers with their router plans; 0
// on the CPU table, whose copy uses the host model's layers). Configurations
// the device path refuses fail with its message.
int moe_model_device_memory(const moe_config *cfg, int B, int T, int n_tasks, const moe_ops *ops,
                            moe_model_mem *out);

// A device copy of host model h for training on the GPU: the same sizes and
// config, parameters copied from h, buffers from ops. On a CUDA table
// (moe_ops_cuda, moe_ops_cuda_bf16) the MoE layers run on the CUDA router and
// grouped GEMMs and write their routing statistics into the host arrays g
// shares with h (load, capacities, plan counts); forward and backward then
// take device token arrays. On moe_ops_cpu the same code makes a host copy
// (tests check the device path with it). Single process, plain loss, no task
// routing, router noise or chunking: others fail with MOE_EINVAL naming the
// key. h must outlive g.
int moe_model_gpu_init(moe_model *g, const moe_model *h, const moe_ops *ops);
void moe_model_gpu_free(moe_model *g);
// Copies g's parameters into h (before checkpoints and evaluation on the host).
int moe_model_gpu_download(moe_model *h, const moe_model *g);

// Doubles in m->load (MoE layers x usage_E).
size_t moe_model_load_len(const moe_model *m);
// Once per optimizer step: feeds the mean load per forward (m->load /
// m->load_calls, which the caller may first sum over ranks) to each layer's
// dynamic-capacity controller, then clears the accumulators.
void moe_model_capacity_step(moe_model *m);

// Once per optimizer step, before moe_model_capacity_step and after the
// caller summed m->load over ranks: MaxVio of each MoE layer's load into
// m->max_vio, then the bias update of router.bias_update_rate (if > 0).
void moe_model_bias_step(moe_model *m);
// Layer l's selection bias [E] (NULL for a dense layer).
float *moe_model_bias(const moe_model *m, int l);
// Attaches the bias to every MoE layer's routing (after a checkpoint
// brought a non-zero one into a model that would not move it).
void moe_model_bias_attach(moe_model *m);

// Floats in the model's parameter buffer.
static inline size_t moe_model_numel(const moe_model *m) {
    return m->table.numel;
}

#endif
