// Expert capacity: the static GShard/Switch formula
//   C = max(min_capacity, ceil(k*T/E * capacity_factor))
// and the dynamic controller (EMA of measured per-expert load, DynaMoE-style
// run-time adjustment): C_e = clamp(ceil(m_e*(1+headroom)), min_capacity,
// ceil(k*T/E * capacity_factor_max)).
#include "moe/alloc.h"
#include "moe/error.h"
#include "moe/router.h"
#include "router/internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int moe_capacity_static(const moe_router_config *cfg, int T, int E) {
    if (cfg->capacity_factor <= 0) return -1;
    int c = moe_ceil_tol((double)cfg->top_k * T * cfg->capacity_factor / E);
    return c > cfg->min_capacity ? c : cfg->min_capacity;
}

int moe_capacity_ctl_init(moe_capacity_ctl *ctl, const moe_router_config *cfg, int T, int E) {
    memset(ctl, 0, sizeof *ctl);
    if (E < 1) return moe_fail(MOE_EINVAL, "capacity controller: E = %d", E);
    int c0 = moe_capacity_static(cfg, T, E);
    if (c0 < 0)
        return moe_fail(MOE_EINVAL, "capacity.mode = dynamic needs router.capacity_factor > 0");
    ctl->ema = moe_calloc(E, sizeof *ctl->ema);
    ctl->capacity = moe_calloc(E, sizeof *ctl->capacity);
    if (!ctl->ema || !ctl->capacity) {
        moe_capacity_ctl_free(ctl);
        return moe_fail(MOE_ENOMEM, "capacity controller for %d experts: out of memory", E);
    }
    ctl->E = E;
    // Until the first measurement, every expert gets the static capacity.
    for (int e = 0; e < E; e++) {
        ctl->ema[e] = (double)cfg->top_k * T / E;
        ctl->capacity[e] = c0;
    }
    return 0;
}

void moe_capacity_ctl_free(moe_capacity_ctl *ctl) {
    moe_mfree(ctl->ema);
    moe_mfree(ctl->capacity);
    memset(ctl, 0, sizeof *ctl);
}

void moe_capacity_ctl_update(moe_capacity_ctl *ctl, const moe_router_config *cfg, const int *counts,
                             int T) {
    double load[ctl->E > 0 ? ctl->E : 1];
    for (int e = 0; e < ctl->E; e++)
        load[e] = counts[e];
    moe_capacity_ctl_update_mean(ctl, cfg, load, T);
}

void moe_capacity_ctl_update_mean(moe_capacity_ctl *ctl, const moe_router_config *cfg,
                                  const double *load, int T) {
    // The first measurement seeds the average: starting from the uniform
    // guess would bias C_e towards balance for ~1/(1-ema) steps.
    for (int e = 0; e < ctl->E; e++)
        ctl->ema[e] = ctl->seeded ? cfg->ema * ctl->ema[e] + (1.0 - cfg->ema) * load[e] : load[e];
    ctl->seeded = true;
    ctl->steps++;
    if (ctl->steps % cfg->update_every) return;
    int hi = moe_ceil_tol((double)cfg->top_k * T * cfg->capacity_factor_max / ctl->E);
    if (hi < cfg->min_capacity) hi = cfg->min_capacity;
    for (int e = 0; e < ctl->E; e++) {
        int c = moe_ceil_tol(ctl->ema[e] * (1.0 + cfg->headroom));
        ctl->capacity[e] = c < cfg->min_capacity ? cfg->min_capacity : c > hi ? hi : c;
    }
}
