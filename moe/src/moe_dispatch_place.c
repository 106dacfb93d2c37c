// Expert-parallel dispatch under a replicated placement (placement.mode =
// replicate, moe/placement.h): a source rank sends expert e's rows to the
// replica moe_placement_dest names, so rows leave xe (expert order) in the
// order of the destinations' slots. The expert side receives them as today,
// source by source, each source's in slot order: blocks (source, slot).
#include "moe_dispatch_place.h"
#include "moe/error.h"

#include <string.h>

// Send order: for each destination rank r, its slots j in order, the rows of
// the expert in slot j when this rank routes that expert to r.
static void send_plan(moe_place_layer *pl, const moe_plan *plan, int me) {
    const moe_placement *t = &pl->t;
    for (int r = 0; r < t->P; r++) {
        pl->send_rows[r] = 0;
        for (int j = 0; j < t->S; j++) {
            const int e = t->slot[r * t->S + j], b = r * t->S + j;
            const bool mine = e >= 0 && moe_placement_dest(t, e, me) == r;
            pl->seg[b] = mine ? plan->offsets[e] : 0;
            pl->cnt[b] = mine ? plan->kept[e] : 0;
            pl->send_rows[r] += pl->cnt[b];
        }
    }
}

// Copies the rows of every (dest, slot) block between xe order (`xe`) and
// send order (`xs`): to_send packs, else unpacks.
static void repack(const moe_place_layer *pl, float *xe, float *xs, int D, bool to_send) {
    size_t o = 0;
    for (int b = 0; b < pl->t.P * pl->t.S; b++) {
        const size_t n = (size_t)pl->cnt[b] * D;
        float *e = xe + (size_t)pl->seg[b] * D;
        if (n) memcpy(to_send ? xs + o : e, to_send ? e : xs + o, n * sizeof(float));
        o += n;
    }
}

const int *moe_place_capacity(moe_layer_acts *a, const int *capacity, int T) {
    moe_place_layer *pl = a->place;
    const int c_static = moe_capacity_static(&a->cfg.router, T, a->cfg.E);
    if (c_static < 0) return capacity;
    for (int e = 0; e < a->cfg.E; e++) {
        const int c = capacity ? capacity[e] : c_static;
        const int share = moe_placement_capacity(&pl->t, e, a->cfg.ep_rank, c);
        // A source keeps at most T rows of an expert: more only inflates padding.
        pl->cap[e] = share > c && share > T ? (c > T ? c : T) : share;
    }
    return pl->cap;
}

static size_t rows_max(const moe_layer_acts *a) {
    return (size_t)moe_router_rows_max(&a->cfg.router, a->cfg.T_max, a->cfg.E);
}

int moe_place_dispatch(moe_layer_acts *a) {
    moe_place_layer *pl = a->place;
    const moe_ep_group *g = a->ep;
    const int P = pl->t.P, S = pl->t.S, D = a->cfg.D;
    if (!g || g->size != P || g->rank != a->cfg.ep_rank)
        return moe_fail(MOE_EINVAL, "moe layer: expert-parallel group missing or not %d ranks", P);
    send_plan(pl, &a->plan, g->rank);
    int per_peer[P], got[P];
    for (int r = 0; r < P; r++)
        per_peer[r] = S;
    MOE_TRY(
        g->alltoallv(g->ctx, pl->cnt, per_peer, pl->recv_kept, got, (size_t)P * S, sizeof(int)));
    repack(pl, a->xe, pl->xs, D, true);
    MOE_TRY(g->alltoallv(g->ctx, pl->xs, pl->send_rows, a->xr, pl->recv_rows, P * rows_max(a),
                         (size_t)D * sizeof(float)));
    int off = 0;
    for (int s = 0; s < P; s++) {
        int want = 0;
        for (int j = 0; j < S; j++) {
            const int b = s * S + j, e = pl->t.slot[g->rank * S + j], n = pl->recv_kept[b];
            if (n < 0 || (n > 0 && e < 0))
                return moe_fail(MOE_EINVAL, "moe layer: rank %d sent %d rows to empty slot %d", s,
                                n, j);
            pl->blk_off[b] = off, pl->blk_n[b] = n;
            off += n, want += n;
        }
        if (want != pl->recv_rows[s])
            return moe_fail(MOE_EINVAL, "moe layer: rank %d sent %d rows but announced %d", s,
                            pl->recv_rows[s], want);
    }
    return 0;
}

int moe_place_combine(moe_layer_acts *a, const float *from, float *to) {
    moe_place_layer *pl = a->place;
    const int P = pl->t.P;
    int got[P];
    MOE_TRY(a->ep->alltoallv(a->ep->ctx, from, pl->recv_rows, pl->xs, got, rows_max(a),
                             (size_t)a->cfg.D * sizeof(float)));
    for (int r = 0; r < P; r++)
        if (got[r] != pl->send_rows[r])
            return moe_fail(MOE_EINVAL, "moe layer: rank %d returned %d rows, %d were sent", r,
                            got[r], pl->send_rows[r]);
    repack(pl, to, pl->xs, a->cfg.D, false);
    return 0;
}

int moe_place_redispatch(moe_layer_acts *a, float *from, float *to) {
    moe_place_layer *pl = a->place;
    const int P = pl->t.P;
    int got[P];
    repack(pl, from, pl->xs, a->cfg.D, true);
    MOE_TRY(a->ep->alltoallv(a->ep->ctx, pl->xs, pl->send_rows, to, got, P * rows_max(a),
                             (size_t)a->cfg.D * sizeof(float)));
    return 0;
}
