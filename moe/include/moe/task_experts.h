// Which experts each task needs, recorded in every checkpoint as
// task_experts.json so task-routed inference can load only those. In a
// task-routed layer (moe.task_layers) the gate input is the task's embedding,
// so the task's k experts are a function of the weights: the router's top-k of
// task_embedding[task] @ gate^T (the layer's own GEMM and router, no noise).
// In a token-routed layer every expert may be used; the file records the share
// of each task's routed assignments (all k choices, before dropping) that
// each expert received on validation batches, which --expert-budget uses.
#ifndef MOE_TASK_EXPERTS_H
#define MOE_TASK_EXPERTS_H

#include "moe/config.h"
#include "moe/data.h"
#include "moe/model.h"
#include "moe/safetensors.h"

enum { MOE_LAYER_DENSE = 0, MOE_LAYER_TOKEN = 1, MOE_LAYER_TASK = 2 };

typedef struct {
    int n_tasks, top_k, L;
    char task[MOE_MAX_TASKS][MOE_NAME_MAX];
    int kind[MOE_MAX_LAYERS]; // MOE_LAYER_*
    int E[MOE_MAX_LAYERS];    // experts of each MoE layer
    // task layers: [n_tasks][top_k] experts of each task, ascending
    int *set[MOE_MAX_LAYERS];
    // token layers: [n_tasks][E] share of the task's routed assignments per
    // expert on validation data, or NULL when not measured
    double *share[MOE_MAX_LAYERS];
    long val_tokens; // validation tokens behind the shares (0: not measured)
} moe_task_experts;

// The task names of a config: data.tasks for synthetic data, else "all".
int moe_config_task_names(const moe_config *cfg, char names[][MOE_NAME_MAX]);
// Index of task `name` in cfg's tasks, or MOE_EINVAL naming the known ones.
int moe_config_task_index(const moe_config *cfg, const char *name);

// set [n_tasks * k]: each task's experts (ascending) from gate [E, D] and
// task_emb [n_tasks, D], with the layer's GEMM and router (dropless, no noise).
int moe_task_expert_set(int *set, const float *gate, const float *task_emb, int E, int D,
                        int n_tasks, const moe_router_config *router);
// The same, and weight [n_tasks * k] (may be NULL): the combine weight of each
// of those experts as the router computes it (softmax or sigmoid, top-k
// renormalisation, route_scale), so a task's layer output is
// sum_j weight[j] * FFN_set[j](x).
int moe_task_route(int *set, float *weight, const float *gate, const float *task_emb, int E, int D,
                   int n_tasks, const moe_router_config *router);

// Fills te from the model: layer kinds, the task layers' sets, and the token
// layers' shares when m->task_share holds a measurement.
int moe_task_experts_from_model(moe_task_experts *te, const moe_model *m);
// Measures the token layers' shares on n_batches validation batches into
// m->task_share (moe_model_free frees it). Collective under expert
// parallelism: every rank runs the same batches. MOE_ENUMERIC when the
// weights give a non-finite loss or logit (the trainer then keeps them out
// of its checkpoint).
int moe_task_share_measure(moe_model *m, moe_data *d, int n_batches);

int moe_task_experts_write(const char *path, const moe_task_experts *te);
// Reads path; MOE_ENOTFOUND if it does not exist, MOE_EFORMAT naming the key
// at fault otherwise.
int moe_task_experts_read(const char *path, moe_task_experts *te);
void moe_task_experts_free(moe_task_experts *te);

// The one reader of a checkpoint's task_experts.json (generate, eval, export
// and resume alike): reads dir/task_experts.json into te and checks it
// against the checkpoint's config cfg (moe_ckpt_config) and tensors s: the
// config's tasks in its order, its router.top_k, exactly its MoE layers with
// their routing and expert counts, and each task-routed layer's recorded sets
// equal to those the gate and task embeddings give. MOE_ENOTFOUND when the
// file is absent (an older checkpoint: callers derive the sets), MOE_EFORMAT
// naming the file and what disagrees otherwise (te then holds nothing).
// s NULL: the sets are left to the caller, who holds the weights already
// (moe_task_experts_check_set).
int moe_ckpt_task_experts(const char *dir, const moe_config *cfg, const moe_st_set *s,
                          moe_task_experts *te);
// Layer l's recorded sets of every task against set [n_tasks * top_k], the
// ones the weights give: MOE_EFORMAT naming the task and both full sets.
int moe_task_experts_check_set(const moe_task_experts *te, const char *path, int l, const int *set);
// Layer l's router gate [E, D] and task embeddings [n_tasks, D] (F32, in
// *gate, *emb, shapes in gs, es; the caller frees both) from checkpoint set s,
// their d_model checked against D. MOE_EFORMAT naming the tensors otherwise.
int moe_ckpt_task_router(const moe_st_set *s, int l, int D, void **gate, int64_t gs[2], void **emb,
                         int64_t es[2]);

#endif
