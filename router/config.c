// Router and capacity configuration: documented defaults, typed setting of a
// key from text (CLI --set and config files), and range checks.
#include "moe/error.h"
#include "moe/parse.h"
#include "moe/router.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void moe_router_config_default(moe_router_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->top_k = 2;
    cfg->capacity_factor = 1.25;
    cfg->min_capacity = 4;
    cfg->slot_order = MOE_SLOT_POSITION;
    cfg->normalize_topk = true;
    cfg->noise = MOE_NOISE_NONE;
    cfg->noise_eps = 0.01;
    cfg->aux_loss_coef = 0.01;
    cfg->z_loss_coef = 0.001;
    cfg->aux_counts_all_k = false;
    cfg->n_task_priority = 0;
    cfg->seed = 0;
    cfg->capacity_mode = MOE_CAPACITY_STATIC;
    cfg->ema = 0.9;
    cfg->headroom = 0.1;
    cfg->update_every = 1;
    cfg->capacity_factor_max = 2.0;
}

// Matches v against names[0..n), stores the index.
static int parse_enum(const char *key, const char *v, const char *const *names, int n, int *out) {
    for (int i = 0; i < n; i++)
        if (!strcmp(v, names[i])) {
            *out = i;
            return 0;
        }
    char want[128] = "";
    for (int i = 0; i < n; i++) {
        strncat(want, names[i], sizeof want - strlen(want) - 1);
        if (i + 1 < n) strncat(want, " | ", sizeof want - strlen(want) - 1);
    }
    return moe_fail(MOE_EINVAL, "%s = '%s': expected %s", key, v, want);
}

static int parse_priorities(const char *key, const char *v, moe_router_config *cfg) {
    cfg->n_task_priority = 0;
    const char *p = v;
    while (*p) {
        if (cfg->n_task_priority == MOE_MAX_TASKS)
            return moe_fail(MOE_EINVAL, "%s: more than %d tasks", key, MOE_MAX_TASKS);
        char *end;
        double d = strtod(p, &end);
        if (end == p || !isfinite(d) || (*end && *end != ','))
            return moe_fail(MOE_EINVAL, "%s = '%s': expected comma-separated numbers", key, v);
        cfg->task_priority[cfg->n_task_priority++] = d;
        if (*end == ',' && !end[1])
            return moe_fail(MOE_EINVAL, "%s = '%s': trailing comma", key, v);
        p = *end ? end + 1 : end;
    }
    return 0;
}

int moe_router_config_set(moe_router_config *cfg, const char *key, const char *v) {
    static const char *const orders[] = {"position", "priority"};
    static const char *const noises[] = {"none", "jitter", "gumbel"};
    static const char *const modes[] = {"static", "dynamic"};
    int e = 0;
    if (!strcmp(key, "router.top_k")) return moe_parse_int(key, v, 1, 1 << 20, &cfg->top_k);
    if (!strcmp(key, "router.capacity_factor")) return moe_parse_double(key, v, &cfg->capacity_factor);
    if (!strcmp(key, "router.min_capacity"))
        return moe_parse_int(key, v, 0, 1 << 30, &cfg->min_capacity);
    if (!strcmp(key, "router.slot_order")) {
        MOE_TRY(parse_enum(key, v, orders, 2, &e));
        cfg->slot_order = (moe_slot_order)e;
        return 0;
    }
    if (!strcmp(key, "router.normalize_topk")) return moe_parse_bool(key, v, &cfg->normalize_topk);
    if (!strcmp(key, "router.noise")) {
        MOE_TRY(parse_enum(key, v, noises, 3, &e));
        cfg->noise = (moe_noise)e;
        return 0;
    }
    if (!strcmp(key, "router.noise_eps")) return moe_parse_double(key, v, &cfg->noise_eps);
    if (!strcmp(key, "router.aux_loss_coef")) return moe_parse_double(key, v, &cfg->aux_loss_coef);
    if (!strcmp(key, "router.z_loss_coef")) return moe_parse_double(key, v, &cfg->z_loss_coef);
    if (!strcmp(key, "router.aux_counts_all_k")) return moe_parse_bool(key, v, &cfg->aux_counts_all_k);
    if (!strcmp(key, "router.task_priority")) return parse_priorities(key, v, cfg);
    if (!strcmp(key, "router.seed")) return moe_parse_u64(key, v, &cfg->seed);
    if (!strcmp(key, "capacity.mode")) {
        MOE_TRY(parse_enum(key, v, modes, 2, &e));
        cfg->capacity_mode = (moe_capacity_mode)e;
        return 0;
    }
    if (!strcmp(key, "capacity.ema")) return moe_parse_double(key, v, &cfg->ema);
    if (!strcmp(key, "capacity.headroom")) return moe_parse_double(key, v, &cfg->headroom);
    if (!strcmp(key, "capacity.update_every"))
        return moe_parse_int(key, v, 1, 1 << 30, &cfg->update_every);
    if (!strcmp(key, "capacity.capacity_factor_max"))
        return moe_parse_double(key, v, &cfg->capacity_factor_max);
    return moe_fail(MOE_EINVAL, "unknown key '%s'", key);
}

int moe_router_config_check(const moe_router_config *cfg, int E) {
    if (E < 1) return moe_fail(MOE_EINVAL, "number of experts is %d, expected >= 1", E);
    if (cfg->top_k < 1 || cfg->top_k > E)
        return moe_fail(MOE_EINVAL, "router.top_k = %d exceeds the number of experts %d",
                        cfg->top_k, E);
    if (cfg->min_capacity < 0)
        return moe_fail(MOE_EINVAL, "router.min_capacity = %d, expected >= 0", cfg->min_capacity);
    if (cfg->noise_eps < 0 || cfg->noise_eps >= 1)
        return moe_fail(MOE_EINVAL, "router.noise_eps = %g, expected 0 <= eps < 1", cfg->noise_eps);
    if (cfg->capacity_mode == MOE_CAPACITY_DYNAMIC) {
        if (cfg->capacity_factor <= 0)
            return moe_fail(MOE_EINVAL,
                            "capacity.mode = dynamic needs router.capacity_factor > 0 "
                            "(it is %g: dropless)",
                            cfg->capacity_factor);
        if (cfg->ema < 0 || cfg->ema >= 1)
            return moe_fail(MOE_EINVAL, "capacity.ema = %g, expected 0 <= ema < 1", cfg->ema);
        if (cfg->headroom < 0)
            return moe_fail(MOE_EINVAL, "capacity.headroom = %g, expected >= 0", cfg->headroom);
        if (cfg->capacity_factor_max <= 0)
            return moe_fail(MOE_EINVAL, "capacity.capacity_factor_max = %g, expected > 0",
                            cfg->capacity_factor_max);
        if (cfg->update_every < 1)
            return moe_fail(MOE_EINVAL, "capacity.update_every = %d, expected >= 1",
                            cfg->update_every);
    }
    return 0;
}
