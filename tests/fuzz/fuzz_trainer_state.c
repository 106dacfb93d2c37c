// libFuzzer target: trainer_state.json of a checkpoint (step, data cursors,
// dynamic-capacity state). The folder holds a valid checkpoint of a tiny model
// with dynamic capacity; the input replaces its trainer_state.json. A state
// that loads must leave every capacity and EMA usable by the router.
#include "fuzz_util.h"
#include "moe/checkpoint.h"
#include "moe/config.h"
#include "moe/model.h"
#include "moe/optim.h"

#include <math.h>

static moe_config cfg;
static moe_model model;
static moe_adamw opt;
static char ckpt[700];

static void setup(void) {
    const char *sets[] = {"model.d_model=16",   "model.n_layers=2",     "model.n_heads=2",
                          "model.n_kv_heads=1", "model.d_ff=16",        "model.seq_len=8",
                          "moe.num_experts=4",  "capacity.mode=dynamic"};
    moe_config_default(&cfg);
    for (size_t i = 0; i < sizeof sets / sizeof *sets; i++)
        if (moe_config_set(&cfg, NULL, sets[i]) < 0) abort();
    if (moe_config_check(&cfg, NULL) < 0 || moe_model_init(&model, &cfg, 2, 8, 5) < 0 ||
        moe_adamw_init(&opt, &model.table, false) < 0)
        abort();
    snprintf(ckpt, sizeof ckpt, "%s", fuzz_path("checkpoint"));
    moe_train_state st = {.step = 3, .cursor = {7, 1}};
    if (moe_ckpt_save(ckpt, &model, &opt, &st, NULL) < 0) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!ckpt[0]) setup();
    char p[760];
    snprintf(p, sizeof p, "%s/trainer_state.json", ckpt);
    fuzz_write(p, data, size);
    moe_train_state st;
    if (moe_ckpt_load(ckpt, &model, &opt, &st) < 0) return 0;
    for (int l = 0; l < model.L; l++) {
        const moe_capacity_ctl *c = &model.cap[l];
        for (int e = 0; c->capacity && e < c->E; e++)
            if (c->capacity[e] < 1 || !isfinite(c->ema[e]) || c->ema[e] < 0) abort();
    }
    if (st.step < 0 || opt.step < 0) abort();
    return 0;
}
