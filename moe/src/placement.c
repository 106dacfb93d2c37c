// Expert placement table (moe/placement.h): home blocks plus replicas of hot
// experts in spare slots, chosen greedily by load per replica (the direction
// of FlexMoE, arXiv 2304.03946, and SmartMoE, in a deliberately simple form).
#include "moe/placement.h"
#include "moe/alloc.h"
#include "moe/error.h"

#include <limits.h>
#include <string.h>

int moe_placement_init(moe_placement *t, int E, int P, int S) {
    memset(t, 0, sizeof *t);
    if (E < 1 || P < 1 || E % P || S < E / P)
        return moe_fail(MOE_EINVAL,
                        "placement: %d experts over %d ranks need E %% P = 0 and "
                        "placement.slots_per_rank = %d >= %d",
                        E, P, S, P > 0 ? E / P : 0);
    t->E = E, t->P = P, t->S = S, t->El = E / P;
    t->slot = moe_malloc(sizeof(int) * (size_t)P * S);
    t->n_hold = moe_malloc(sizeof(int) * (size_t)E);
    t->hold = moe_malloc(sizeof(int) * (size_t)E * P);
    if (!t->slot || !t->n_hold || !t->hold) {
        moe_placement_free(t);
        return moe_fail(MOE_ENOMEM, "placement table of %d experts over %d ranks", E, P);
    }
    for (int r = 0; r < P; r++) // contiguous homes
        for (int j = 0; j < S; j++)
            t->slot[r * S + j] = j < t->El ? r * t->El + j : -1;
    return moe_placement_update(t, NULL);
}

void moe_placement_free(moe_placement *t) {
    moe_mfree(t->slot);
    moe_mfree(t->n_hold);
    moe_mfree(t->hold);
    memset(t, 0, sizeof *t);
}

bool moe_placement_is_static(const moe_placement *t) {
    for (int e = 0; e < t->E; e++)
        if (t->n_hold[e] != 1 || t->hold[(size_t)e * t->P] != e / t->El) return false;
    return true;
}

// Home experts only (where they are now), every spare slot empty.
static void reset(moe_placement *t) {
    for (int r = 0; r < t->P; r++)
        for (int j = 0; j < t->S; j++) {
            int *x = &t->slot[r * t->S + j];
            if (j >= t->El)
                *x = -1;
            else
                t->n_hold[*x] = 1, t->hold[(size_t)*x * t->P] = r;
        }
}

// Swaps home experts between ranks while that lowers the largest home load
// (moe/placement.h): a hot expert's home goes to a lightly loaded rank and
// one of that rank's experts comes back.
static void swap_homes(moe_placement *t, const double *load) {
    const int P = t->P, S = t->S, El = t->El;
    double h[P];
    for (int r = 0; r < P; r++) {
        h[r] = 0;
        for (int j = 0; j < El; j++)
            h[r] += load[t->slot[r * S + j]];
    }
    for (int it = 0; it < t->E * P; it++) {
        int a = 0;
        for (int r = 1; r < P; r++)
            a = h[r] > h[a] ? r : a;
        int bi = -1, bj = -1, br = -1;
        double best = h[a];
        for (int i = 0; i < El; i++)
            for (int r = 0; r < P; r++)
                for (int j = 0; r != a && j < El; j++) {
                    const double d = load[t->slot[a * S + i]] - load[t->slot[r * S + j]];
                    const double na = h[a] - d, nr = h[r] + d, mx = na > nr ? na : nr;
                    if (d > 0 && mx < best) best = mx, bi = i, bj = j, br = r;
                }
        if (bi < 0) break;
        int *x = &t->slot[a * S + bi], *y = &t->slot[br * S + bj], ex = *x;
        const double d = load[*x] - load[*y];
        *x = *y, *y = ex, h[a] -= d, h[br] += d;
        t->hold[(size_t)*x * P] = a, t->hold[(size_t)*y * P] = br;
    }
}

// Sources the deal sends to holder i of an expert with n holders over P ranks:
// itself (every source when n = 1) and the non-holders k = i, i + n, ...
static int dealt(int P, int n, int i) {
    return 1 + (P - n) / n + (i < (P - n) % n);
}

// Rank r's modelled load: per slot, the sources dealt to it times load / P.
// pos [P * S]: each slot's index in its expert's holder list.
static double rank_load(const moe_placement *t, const double *load, const int *pos, int r) {
    double sum = 0;
    for (int j = 0; j < t->S; j++) {
        const int e = t->slot[r * t->S + j];
        if (e >= 0) sum += dealt(t->P, t->n_hold[e], pos[r * t->S + j]) * (load[e] / t->P);
    }
    return sum;
}

static double max_of(const double *x, int n) {
    double mx = 0;
    for (int i = 0; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    return mx;
}

int moe_placement_update(moe_placement *t, const double *load) {
    for (int e = 0; load && e < t->E; e++)
        if (!(load[e] >= 0 && load[e] < 1e300))
            return moe_fail(MOE_EINVAL, "placement: load[%d] = %g", e, load[e]);
    reset(t);
    if (load && t->moves && t->P > 1) swap_homes(t, load);
    if (!load || t->S == t->El || t->P == 1) return 0;
    const int E = t->E, P = t->P, S = t->S;
    // Fill every spare slot the rule can, then keep the prefix of additions
    // with the lowest largest rank load (the fewest on ties): one replica
    // alone may not lower the maximum where two do.
    // A replica changes only its expert's deal, so only that expert's holders'
    // loads are summed again: O(S (E + P S)) per added replica, not O(P E).
    double tok[P];
    int *pos = moe_malloc(sizeof(int) * (size_t)P * S);
    if (!pos) return moe_fail(MOE_ENOMEM, "placement: scratch for %d x %d slots", P, S);
    for (int j = 0; j < P * S; j++)
        pos[j] = 0; // homes lead their holder lists; spare slots are empty
    for (int r = 0; r < P; r++)
        tok[r] = rank_load(t, load, pos, r);
    double best_max = max_of(tok, P);
    int n_add = 0, keep = 0, add_r[P * (S - t->El)], add_j[P * (S - t->El)], add_e[P * (S - t->El)];
    for (int spare = P * (S - t->El); spare > 0; spare--) {
        int best = -1;
        double best_l = 0;
        for (int e = 0; e < E; e++) {
            double l = load[e] / t->n_hold[e];
            if (t->n_hold[e] < P && l > best_l) best = e, best_l = l;
        }
        if (best < 0) break;
        int to = -1, to_j = -1; // least loaded rank with a free spare slot, lacking best
        for (int r = 0; r < P; r++) {
            int free_j = -1, has = 0;
            for (int j = 0; j < S; j++) {
                int e = t->slot[r * S + j];
                if (e < 0 && free_j < 0) free_j = j;
                has |= e == best;
            }
            if (free_j >= 0 && !has && (to < 0 || tok[r] < tok[to])) to = r, to_j = free_j;
        }
        if (to < 0) break;
        t->slot[to * S + to_j] = best;
        pos[to * S + to_j] = t->n_hold[best];
        t->hold[(size_t)best * P + t->n_hold[best]++] = to;
        add_r[n_add] = to, add_j[n_add] = to_j, add_e[n_add++] = best;
        for (int i = 0; i < t->n_hold[best]; i++)
            tok[t->hold[(size_t)best * P + i]] =
                rank_load(t, load, pos, t->hold[(size_t)best * P + i]);
        double mx = max_of(tok, P);
        if (mx < best_max) best_max = mx, keep = n_add;
    }
    while (n_add > keep) { // undo, newest first
        n_add--;
        t->slot[add_r[n_add] * S + add_j[n_add]] = -1;
        t->n_hold[add_e[n_add]]--;
    }
    moe_mfree(pos);
    return 0;
}

// Index of rank r in expert e's holder list, -1 when r does not hold e.
static int holder_index(const moe_placement *t, int e, int r) {
    const int *h = t->hold + (size_t)e * t->P;
    for (int i = 0; i < t->n_hold[e]; i++)
        if (h[i] == r) return i;
    return -1;
}

// Non-holders of e among ranks 0 .. s-1: s minus the holders below s. O(n_hold), so
// that the plan and the update, which ask for every (source, expert), stay O(P E).
static int non_holders_below(const moe_placement *t, int e, int s) {
    const int *h = t->hold + (size_t)e * t->P;
    int below = s;
    for (int i = 0; i < t->n_hold[e]; i++)
        below -= h[i] < s;
    return below;
}

int moe_placement_dest(const moe_placement *t, int e, int s) {
    const int n = t->n_hold[e];
    const int *h = t->hold + (size_t)e * t->P;
    if (n == 1) return h[0];
    if (holder_index(t, e, s) >= 0) return s;
    return h[non_holders_below(t, e, s) % n];
}

int moe_placement_slot_of(const moe_placement *t, int r, int e) {
    for (int j = 0; j < t->S; j++)
        if (t->slot[r * t->S + j] == e) return j;
    return -1;
}

int moe_placement_capacity(const moe_placement *t, int e, int s, int c) {
    const int n = t->n_hold[e];
    if (n == 1 || c <= 0) return c;
    // The deal in closed form: holder h[i] serves itself and the non-holders
    // k = i, i + n, ... (k counts non-holders in rank order), so m sources in
    // all, and idx of them rank before s: h[i] itself when below s, and the
    // non-holders k < (non-holders below s) with k % n == i.
    const int h = moe_placement_dest(t, e, s), i = holder_index(t, e, h);
    const int rest = t->P - n, below = non_holders_below(t, e, s);
    const int m = 1 + rest / n + (i < rest % n);
    const int idx = (h < s) + below / n + (i < below % n);
    const long budget = (long)t->P * c, share = budget / m + (idx < budget % m);
    return share > INT_MAX ? INT_MAX : (int)share;
}

void moe_placement_rank_tokens(const moe_placement *t, const double *load, double *rank_tokens) {
    // the closed form moe_placement_update compares (rank_load), each slot's
    // holder index looked up
    for (int r = 0; r < t->P; r++) {
        rank_tokens[r] = 0;
        for (int j = 0; j < t->S; j++) {
            const int e = t->slot[r * t->S + j];
            if (e >= 0)
                rank_tokens[r] +=
                    dealt(t->P, t->n_hold[e], holder_index(t, e, r)) * (load[e] / t->P);
        }
    }
}

int moe_place_layer_init(moe_place_layer *pl, int E, int P, int S, size_t numel, size_t rows_max,
                         int D) {
    memset(pl, 0, sizeof *pl);
    MOE_TRY(moe_placement_init(&pl->t, E, P, S));
    const size_t X = (size_t)(S - E / P), PS = (size_t)P * S;
    pl->numel = numel;
    pl->rep_w = moe_calloc(X * numel + 1, sizeof(float));
    pl->rep_g = moe_calloc(X * numel + 1, sizeof(float));
    pl->xs = moe_malloc((rows_max * D + 1) * sizeof(float));
    int **ip[] = {&pl->seg, &pl->cnt, &pl->recv_kept, &pl->blk_off, &pl->blk_n};
    for (size_t i = 0; i < sizeof ip / sizeof ip[0]; i++)
        *ip[i] = moe_malloc(PS * sizeof(int));
    pl->cap = moe_malloc((size_t)E * sizeof(int));
    pl->send_rows = moe_malloc((size_t)P * sizeof(int));
    pl->recv_rows = moe_malloc((size_t)P * sizeof(int));
    if (!pl->rep_w || !pl->rep_g || !pl->xs || !pl->seg || !pl->cnt || !pl->recv_kept ||
        !pl->blk_off || !pl->blk_n || !pl->send_rows || !pl->recv_rows || !pl->cap) {
        moe_place_layer_free(pl);
        return moe_fail(MOE_ENOMEM, "placement of %d experts over %d ranks x %d slots", E, P, S);
    }
    return 0;
}

void moe_place_layer_free(moe_place_layer *pl) {
    moe_placement_free(&pl->t);
    void *p[] = {pl->rep_w,   pl->rep_g, pl->xs,        pl->seg,       pl->cnt, pl->recv_kept,
                 pl->blk_off, pl->blk_n, pl->send_rows, pl->recv_rows, pl->cap};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        moe_mfree(p[i]);
    memset(pl, 0, sizeof *pl);
}
