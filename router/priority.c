// Slot order of the tokens. `position`: token order (GShard / DeepSpeed
// top-2). `priority`: Batch Prioritized Routing, V-MoE (arXiv 2106.05974)
// §3.3 — tokens sorted by (task priority desc, max routing prob desc, index
// asc) so that under tight capacity the confident tokens of important tasks
// keep their slots. The key ends in the token index, so the order is total and
// the sort result does not depend on qsort's stability.
#include "moe/error.h"
#include "router/internal.h"

#include <stdlib.h>

typedef struct {
    double task; // task priority (0 when none configured)
    float maxp;  // max_e p[t, e]
    int t;
} prio_key;

static int prio_cmp(const void *a, const void *b) {
    const prio_key *x = a, *y = b;
    if (x->task != y->task) return x->task > y->task ? -1 : 1;
    if (x->maxp != y->maxp) return x->maxp > y->maxp ? -1 : 1;
    return (x->t > y->t) - (x->t < y->t);
}

size_t moe_slot_order_scratch_bytes(int T) {
    return (size_t)T * sizeof(prio_key);
}

int moe_slot_order_fill(int *order, void *scratch, const float *probs, const int *task_id, int T,
                        int E, const moe_router_config *cfg) {
    if (cfg->slot_order == MOE_SLOT_POSITION || T <= 1) {
        for (int t = 0; t < T; t++)
            order[t] = t;
        return 0;
    }
    if (cfg->n_task_priority > 0 && !task_id)
        return moe_fail(MOE_EINVAL, "router.task_priority is set but no task ids were given");
    prio_key *keys = scratch;
    for (int t = 0; t < T; t++) {
        const float *p = probs + (size_t)t * E;
        float m = p[0];
        for (int e = 1; e < E; e++)
            if (p[e] > m) m = p[e];
        double tp = 0.0;
        if (cfg->n_task_priority > 0) {
            if (task_id[t] < 0 || task_id[t] >= cfg->n_task_priority) {
                return moe_fail(MOE_EINVAL,
                                "task id %d of token %d has no entry in router.task_priority "
                                "(%d entries)",
                                task_id[t], t, cfg->n_task_priority);
            }
            tp = cfg->task_priority[task_id[t]];
        }
        keys[t] = (prio_key){tp, m, t};
    }
    qsort(keys, T, sizeof *keys, prio_cmp);
    for (int i = 0; i < T; i++)
        order[i] = keys[i].t;
    return 0;
}
