// Dispatch-plan storage (one allocation, sized once) and load statistics.
#include "moe/alloc.h"
#include "moe/error.h"
#include "moe/router.h"
#include "router/internal.h"

#include <stdlib.h>
#include <string.h>

// Ints then floats (both 4 bytes: no alignment gaps) in one block, plus the
// priority-sort scratch.
static size_t plan_words(int T_max, int E, int k) {
    size_t tk = (size_t)T_max * k, te = (size_t)T_max * E;
    size_t n_int = 3 * tk + 3 * (size_t)E + (E + 1) + T_max;
    size_t n_float = tk + 2 * te + T_max + E;
    return n_int + n_float + 1;
}

// Per-token scratch of the router's parallel parts (top-k heap, group masks,
// backward dp): heap, not stack, since E and k reach 65536.
static int rows_parts(int T_max) {
    int parts = moe_router_token_parts(T_max);
    return parts > 1 ? parts : 1;
}

size_t moe_plan_bytes(int T_max, int E, int k) {
    return 4 * plan_words(T_max, E, k) + moe_slot_order_scratch_bytes(T_max) + 1 +
           (size_t)rows_parts(T_max) * moe_router_rows_bytes(E, k);
}

int moe_plan_alloc(moe_plan *plan, int T_max, int E, int k) {
    memset(plan, 0, sizeof *plan);
    if (T_max < 0 || E < 1 || k < 1 || k > E)
        return moe_fail(MOE_EINVAL, "plan sizes T=%d E=%d k=%d invalid", T_max, E, k);
    size_t tk = (size_t)T_max * k, te = (size_t)T_max * E;
    char *b = moe_calloc(plan_words(T_max, E, k), 4);
    plan->scratch = moe_malloc(moe_slot_order_scratch_bytes(T_max) + 1);
    plan->rows_parts = rows_parts(T_max);
    plan->rows_bytes = moe_router_rows_bytes(E, k);
    plan->rows = moe_malloc((size_t)plan->rows_parts * plan->rows_bytes);
    if (!b || !plan->scratch || !plan->rows) {
        moe_mfree(b);
        moe_mfree(plan->scratch);
        moe_mfree(plan->rows);
        memset(plan, 0, sizeof *plan);
        return moe_fail(MOE_ENOMEM, "plan for T=%d E=%d k=%d: out of memory", T_max, E, k);
    }
    int *ip = (int *)b;
    plan->expert = ip, ip += tk;
    plan->choice = ip, ip += tk;
    plan->slot = ip, ip += tk;
    plan->counts = ip, ip += E;
    plan->kept = ip, ip += E;
    plan->capacity = ip, ip += E;
    plan->offsets = ip, ip += E + 1;
    plan->order = ip, ip += T_max;
    float *fp = (float *)ip;
    plan->weight = fp, fp += tk;
    plan->probs = fp, fp += te;
    plan->softmax = fp, fp += te;
    plan->lse = fp, fp += T_max;
    plan->aux_f = fp;
    plan->block = b;
    plan->T_max = T_max;
    plan->E = E;
    plan->k = k;
    return 0;
}

void moe_plan_free(moe_plan *plan) {
    moe_mfree(plan->block);
    moe_mfree(plan->scratch);
    moe_mfree(plan->rows);
    memset(plan, 0, sizeof *plan);
}

void moe_plan_stats(const moe_plan *plan, moe_load_stats *st) {
    memset(st, 0, sizeof *st);
    st->min_count = plan->E > 0 ? plan->counts[0] : 0;
    for (int e = 0; e < plan->E; e++) {
        st->assigned += plan->counts[e];
        st->kept += plan->kept[e];
        st->capacity += plan->capacity[e];
        if (plan->counts[e] > st->max_count) st->max_count = plan->counts[e];
        if (plan->counts[e] < st->min_count) st->min_count = plan->counts[e];
    }
    st->dropped = st->assigned - st->kept;
    st->drop_rate = st->assigned ? (double)st->dropped / st->assigned : 0.0;
    if (plan->expert_choice) { // no assignment drops; a token can go without an expert
        st->dropped = plan->unrouted;
        st->drop_rate = plan->T ? (double)plan->unrouted / plan->T : 0.0;
    }
    st->padding = st->capacity ? (double)(st->capacity - st->kept) / st->capacity : 0.0;
}
