// libFuzzer target: task_experts.json of a checkpoint, read by a task-routed
// load (moe_infer_open). The folder holds a valid checkpoint of a tiny model
// with one task-routed and one token-routed MoE layer and measured shares; the
// input replaces its task_experts.json. A load that succeeds, with and without
// an expert budget, must leave every MoE layer a consistent set of experts.
#include "fuzz_util.h"
#include "moe/checkpoint.h"
#include "moe/config.h"
#include "moe/data.h"
#include "moe/infer.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/task_experts.h"

static char ckpt[700];

static void setup(void) {
    const char *sets[] = {"model.d_model=16",   "model.n_layers=2",    "model.n_heads=2",
                          "model.n_kv_heads=1", "model.d_ff=16",       "model.seq_len=8",
                          "moe.num_experts=4",  "moe.task_layers=[1]", "train.batch_size=2"};
    moe_config cfg;
    moe_model model;
    moe_adamw opt;
    moe_data d;
    moe_config_default(&cfg);
    for (size_t i = 0; i < sizeof sets / sizeof *sets; i++)
        if (moe_config_set(&cfg, NULL, sets[i]) < 0) abort();
    if (moe_config_check(&cfg, NULL) < 0 || moe_data_open(&d, &cfg) < 0 ||
        moe_model_init(&model, &cfg, d.B, d.T, d.n_tasks) < 0 ||
        moe_adamw_init(&opt, &model.table, false) < 0 || moe_task_share_measure(&model, &d, 2) < 0)
        abort();
    snprintf(ckpt, sizeof ckpt, "%s", fuzz_path("checkpoint"));
    moe_train_state st = {0};
    if (moe_ckpt_save(ckpt, &model, &opt, &st, NULL) < 0) abort();
    moe_adamw_free(&opt);
    moe_model_free(&model);
    moe_data_close(&d);
}

// Every MoE layer keeps at least top_k experts, numbered 0.. in expert order.
static void check(const moe_infer *m) {
    for (int l = 0; l < m->L; l++) {
        const moe_infer_layer *y = &m->layer[l];
        if (!y->is_moe) continue;
        if (y->n_loaded < m->k || y->n_loaded > y->E) abort();
        int next = 0;
        for (int e = 0; e < y->E; e++)
            if (y->slot[e] >= 0 && y->slot[e] != next++) abort();
        if (next != y->n_loaded) abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!ckpt[0]) setup();
    char p[760];
    snprintf(p, sizeof p, "%s/task_experts.json", ckpt);
    fuzz_write(p, data, size);
    const double budgets[] = {0.0, 0.2};
    for (int i = 0; i < 2; i++) {
        moe_infer_opts o = {.task = "sort", .expert_budget = budgets[i]};
        moe_infer m;
        if (moe_infer_open(&m, ckpt, &o) == 0) {
            check(&m);
            moe_infer_free(&m);
        }
    }
    return 0;
}
