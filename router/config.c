// Router and capacity configuration: documented defaults, typed setting of a
// key from text (CLI --set and config files), and range checks. One table of
// numeric ranges serves the setter and the check, so a value refused by one is
// refused by the other (the run config's key table repeats these ranges).
#include "moe/error.h"
#include "moe/parse.h"
#include "moe/router.h"
#include "router/internal.h"

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
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
    cfg->score = MOE_SCORE_SOFTMAX;
    cfg->route_scale = 1.0;
    cfg->capacity_mode = MOE_CAPACITY_STATIC;
    cfg->ema = 0.9;
    cfg->headroom = 0.1;
    cfg->update_every = 1;
    cfg->capacity_factor_max = 2.0;
    cfg->n_groups = 0;    // one group per node: no limit until topk_groups is set
    cfg->topk_groups = 0; // every group
    cfg->bias_update_rate = 0.0;
    cfg->type = MOE_ROUTER_TOKEN_CHOICE;
    cfg->ec_fallback = MOE_EC_FALLBACK_NONE;
}

enum { R_INT, R_DBL, R_DBLS };
typedef struct {
    const char *key;
    int type;
    size_t off;
    double lo, hi;
    int open;
} range_def;

#define O(field) offsetof(moe_router_config, field)
static const range_def ranges[] = {
    {"router.top_k", R_INT, O(top_k), 1, 1 << 20, 0},
    {"router.capacity_factor", R_DBL, O(capacity_factor), -DBL_MAX, 1e6, 0}, // <= 0: dropless
    {"router.min_capacity", R_INT, O(min_capacity), 0, 1 << 30, 0},
    {"router.noise_eps", R_DBL, O(noise_eps), 0, 1, MOE_RANGE_HI_OPEN},
    {"router.aux_loss_coef", R_DBL, O(aux_loss_coef), 0, 1e6, 0},
    {"router.z_loss_coef", R_DBL, O(z_loss_coef), 0, 1e6, 0},
    {"router.route_scale", R_DBL, O(route_scale), 0, 1e6, MOE_RANGE_LO_OPEN},
    {"router.n_groups", R_INT, O(n_groups), 0, 1 << 16, 0},
    {"router.topk_groups", R_INT, O(topk_groups), 0, 1 << 16, 0},
    {"router.bias_update_rate", R_DBL, O(bias_update_rate), 0, 1, 0},
    {"router.task_priority", R_DBLS, O(task_priority), -DBL_MAX, DBL_MAX, 0},
    {"capacity.ema", R_DBL, O(ema), 0, 1, MOE_RANGE_HI_OPEN},
    {"capacity.headroom", R_DBL, O(headroom), 0, 1e6, 0},
    {"capacity.update_every", R_INT, O(update_every), 1, 1 << 30, 0},
    {"capacity.capacity_factor_max", R_DBL, O(capacity_factor_max), 1, 1e6, 0},
};
#undef O
#define N_RANGES ((int)(sizeof ranges / sizeof ranges[0]))

static const range_def *find_range(const char *key) {
    for (int i = 0; i < N_RANGES; i++)
        if (!strcmp(ranges[i].key, key)) return &ranges[i];
    return NULL;
}

// Matches v against names[0..n), stores the index.
static int parse_enum(const char *key, const char *v, const char *const *names, int n, int *out) {
    for (int i = 0; i < n; i++)
        if (!strcmp(v, names[i])) {
            *out = i;
            return 0;
        }
    char want[128] = ""; // built from the constant names only
    for (int i = 0; i < n; i++) {
        strncat(want, names[i], sizeof want - strlen(want) - 1);
        if (i + 1 < n) strncat(want, " | ", sizeof want - strlen(want) - 1);
    }
    const char *best = moe_nearest(v, names, n);
    char hint[96] = "";
    if (best) snprintf(hint, sizeof hint, " (did you mean %s?)", best);
    return moe_fail(MOE_EINVAL, "%s = '%.64s%s': expected %s%s", key, v,
                    strlen(v) > 64 ? "..." : "", want, hint);
}

// "3,1.5,2" or "[3, 1.5, 2]": every item a finite number; an empty item, a
// trailing comma or an unmatched bracket is an error naming the item.
static int parse_priorities(const range_def *r, const char *v, moe_router_config *cfg) {
    double vals[MOE_MAX_TASKS];
    int n = 0;
    size_t len = strlen(v);
    while (len && v[len - 1] == ' ')
        len--;
    while (len && *v == ' ')
        v++, len--;
    if (len && (v[0] == '[') != (v[len - 1] == ']'))
        return moe_fail(MOE_EINVAL, "%s: unbalanced '[' ']'", r->key);
    if (len && v[0] == '[') v++, len -= 2;
    const char *p = v, *stop = v + len;
    while (p < stop && *p == ' ')
        p++;
    if (p == stop) { // empty list: no priorities
        cfg->n_task_priority = 0;
        return 0;
    }
    for (p = v;; n++) {
        if (n == MOE_MAX_TASKS)
            return moe_fail(MOE_EINVAL, "%s: more than %d tasks", r->key, MOE_MAX_TASKS);
        const char *comma = memchr(p, ',', (size_t)(stop - p));
        const char *end_item = comma ? comma : stop, *q = p;
        while (q < end_item && *q == ' ')
            q++;
        if (q == end_item) return moe_fail(MOE_EINVAL, "%s: item %d is empty", r->key, n);
        char *end;
        double d = strtod(q, &end);
        while (end < end_item && *end == ' ')
            end++;
        if (end == q || end != end_item || !isfinite(d))
            return moe_fail(MOE_EINVAL, "%s item %d = '%.*s': expected a finite number", r->key, n,
                            (int)(end_item - q > 64 ? 64 : end_item - q), q);
        MOE_TRY(moe_check_range(r->key, n, d, r->lo, r->hi, r->open, false));
        vals[n] = d;
        if (!comma) break;
        p = comma + 1;
    }
    memcpy(cfg->task_priority, vals, sizeof(double) * (size_t)(n + 1));
    cfg->n_task_priority = n + 1;
    return 0;
}

// Numeric keys: parsed into a temporary, range-checked, then stored.
static int set_number(moe_router_config *cfg, const range_def *r, const char *v) {
    char *base = (char *)cfg;
    if (r->type == R_DBLS) return parse_priorities(r, v, cfg);
    if (r->type == R_INT)
        return moe_parse_int(r->key, v, (long)r->lo, (long)r->hi, (int *)(base + r->off));
    double d;
    MOE_TRY(moe_parse_double(r->key, v, &d));
    MOE_TRY(moe_check_range(r->key, -1, d, r->lo, r->hi, r->open, false));
    *(double *)(base + r->off) = d;
    return 0;
}

int moe_router_config_set(moe_router_config *cfg, const char *key, const char *v) {
    static const char *const orders[] = {"position", "priority"};
    static const char *const noises[] = {"none", "jitter", "gumbel"};
    static const char *const modes[] = {"static", "dynamic"};
    static const char *const scores[] = {"softmax", "sigmoid"};
    static const char *const types[] = {"token_choice", "expert_choice"};
    static const char *const fallbacks[] = {"none", "token_choice"};
    int e = 0;
    const range_def *r = find_range(key);
    if (r) return set_number(cfg, r, v);
    if (!strcmp(key, "router.slot_order")) {
        MOE_TRY(parse_enum(key, v, orders, 2, &e));
        cfg->slot_order = (moe_slot_order)e;
        return 0;
    }
    if (!strcmp(key, "router.score")) {
        MOE_TRY(parse_enum(key, v, scores, 2, &e));
        cfg->score = (moe_score)e;
        return 0;
    }
    if (!strcmp(key, "router.type")) {
        MOE_TRY(parse_enum(key, v, types, 2, &e));
        cfg->type = (moe_router_type)e;
        return 0;
    }
    if (!strcmp(key, "router.ec_fallback")) {
        MOE_TRY(parse_enum(key, v, fallbacks, 2, &e));
        cfg->ec_fallback = (moe_ec_fallback)e;
        return 0;
    }
    if (!strcmp(key, "router.normalize_topk")) return moe_parse_bool(key, v, &cfg->normalize_topk);
    if (!strcmp(key, "router.noise")) {
        MOE_TRY(parse_enum(key, v, noises, 3, &e));
        cfg->noise = (moe_noise)e;
        return 0;
    }
    if (!strcmp(key, "router.aux_counts_all_k"))
        return moe_parse_bool(key, v, &cfg->aux_counts_all_k);
    if (!strcmp(key, "router.seed")) return moe_parse_u64(key, v, &cfg->seed);
    if (!strcmp(key, "capacity.mode")) {
        MOE_TRY(parse_enum(key, v, modes, 2, &e));
        cfg->capacity_mode = (moe_capacity_mode)e;
        return 0;
    }
    return moe_fail(MOE_EINVAL, "unknown key '%.64s%s'", key, strlen(key) > 64 ? "..." : "");
}

// Keys that mean nothing when experts pick tokens are refused by name rather
// than ignored, except the two a token-choice base config sets by default
// (normalize_topk, aux_loss_coef): README "Expert-choice routing" says why
// those are ignored.
static int check_expert_choice(const moe_router_config *cfg) {
    static const char *const pre = "router.type = expert_choice";
    if (cfg->score != MOE_SCORE_SOFTMAX)
        return moe_fail(MOE_EINVAL,
                        "%s uses softmax scores; router.score = sigmoid is not "
                        "supported with it",
                        pre);
    if (cfg->capacity_factor <= 0)
        return moe_fail(MOE_EINVAL,
                        "%s needs router.capacity_factor > 0 (it is %g): every expert takes "
                        "C = capacity_factor * T * top_k / E tokens, there is no dropless mode",
                        pre, cfg->capacity_factor);
    if (cfg->capacity_mode != MOE_CAPACITY_STATIC)
        return moe_fail(MOE_EINVAL,
                        "%s balances the load by construction; capacity.mode must be "
                        "static (not dynamic)",
                        pre);
    if (cfg->slot_order != MOE_SLOT_POSITION || cfg->n_task_priority > 0)
        return moe_fail(MOE_EINVAL,
                        "%s has no token-choice slot order: router.slot_order = "
                        "priority and router.task_priority (Batch Prioritized "
                        "Routing) do not apply",
                        pre);
    if (cfg->noise == MOE_NOISE_GUMBEL)
        return moe_fail(MOE_EINVAL,
                        "%s: router.noise = gumbel perturbs token choices 2..k and "
                        "does not apply (use none or jitter)",
                        pre);
    // Both act on a token's choice of experts, which expert choice does not make.
    if (cfg->bias_update_rate > 0 || moe_router_groups_active(cfg))
        return moe_fail(MOE_EINVAL,
                        "%s: router.bias_update_rate and router.topk_groups shape token "
                        "choices and do not apply (set them to 0)",
                        pre);
    return 0;
}

int moe_router_config_check(const moe_router_config *cfg, int E) {
    if (E < 1) return moe_fail(MOE_EINVAL, "number of experts is %d, expected >= 1", E);
    const char *base = (const char *)cfg;
    for (int i = 0; i < N_RANGES; i++) {
        const range_def *r = &ranges[i];
        if (r->type == R_DBLS) {
            if (cfg->n_task_priority < 0 || cfg->n_task_priority > MOE_MAX_TASKS)
                return moe_fail(MOE_EINVAL, "%s has %d entries, expected 0..%d", r->key,
                                cfg->n_task_priority, MOE_MAX_TASKS);
            for (int j = 0; j < cfg->n_task_priority; j++)
                MOE_TRY(moe_check_range(r->key, j, cfg->task_priority[j], r->lo, r->hi, r->open,
                                        false));
            continue;
        }
        double v =
            r->type == R_INT ? *(const int *)(base + r->off) : *(const double *)(base + r->off);
        MOE_TRY(moe_check_range(r->key, -1, v, r->lo, r->hi, r->open, r->type == R_INT));
    }
    if (cfg->top_k > E)
        return moe_fail(MOE_EINVAL, "router.top_k = %d exceeds the number of experts %d",
                        cfg->top_k, E);
    if ((unsigned)cfg->slot_order > MOE_SLOT_PRIORITY || (unsigned)cfg->noise > MOE_NOISE_GUMBEL ||
        (unsigned)cfg->capacity_mode > MOE_CAPACITY_DYNAMIC ||
        (unsigned)cfg->score > MOE_SCORE_SIGMOID ||
        (unsigned)cfg->type > MOE_ROUTER_EXPERT_CHOICE ||
        (unsigned)cfg->ec_fallback > MOE_EC_FALLBACK_TOKEN_CHOICE)
        return moe_fail(MOE_EINVAL, "router: slot_order, noise, score, type, ec_fallback or "
                                    "capacity.mode out of range");
    MOE_TRY(moe_router_groups_check(cfg, E));
    if (cfg->bias_update_rate > 0 && cfg->noise == MOE_NOISE_GUMBEL)
        return moe_fail(MOE_EINVAL,
                        "router.bias_update_rate = %g with router.noise = gumbel: gumbel picks "
                        "choices 2..k on noisy logits, where the balancing bias cannot act "
                        "(use noise none or jitter)",
                        cfg->bias_update_rate);
    if (cfg->type == MOE_ROUTER_EXPERT_CHOICE) MOE_TRY(check_expert_choice(cfg));
    // Task priorities are the first key of the priority slot order (router/priority.c);
    // position order hands out slots by token index and never reads them.
    if (cfg->n_task_priority > 0 && cfg->slot_order == MOE_SLOT_POSITION)
        return moe_fail(MOE_EINVAL,
                        "router.task_priority is set with router.slot_order = position, which "
                        "never reads it: task priorities order tokens under router.slot_order = "
                        "priority (set it, or router.task_priority = [])");
    if (cfg->capacity_mode == MOE_CAPACITY_DYNAMIC && cfg->capacity_factor <= 0)
        return moe_fail(MOE_EINVAL,
                        "capacity.mode = dynamic needs router.capacity_factor > 0 "
                        "(it is %g: dropless)",
                        cfg->capacity_factor);
    return 0;
}
