// Load-driven expert placement in the training loop (placement.mode =
// replicate): load EMA, table updates, replica gradient sums and weight copies.
// Primaries never move: replicas live in spare slots, so checkpoints, the
// optimizer state and the gradient norm see one copy per expert, the home one.
#include "moe/placement.h"
#include "moe/alloc.h"
#include "moe/error.h"
#include "moe/parallel.h"

#include <string.h>

int moe_parallel_placement_init(moe_parallel *p, moe_model *m, const moe_config *cfg) {
    if (strcmp(cfg->placement.mode, "replicate")) return 0;
    if (p->ep_size < 2)
        return moe_fail(MOE_EINVAL, "placement.mode = replicate needs parallel.ep > 1");
    const size_t n = moe_model_load_len(m);
    p->place_ema = moe_calloc(n + 1, sizeof(double));
    if (!p->place_ema) return moe_fail(MOE_ENOMEM, "placement: load EMA of %zu experts", n);
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_layer_config *c = &m->moe_cfg[l];
        struct moe_place_layer *pl = moe_calloc(1, sizeof *pl);
        if (!pl) return moe_fail(MOE_ENOMEM, "placement of layer %d", l);
        p->place[l] = pl;
        const size_t rows = (size_t)moe_router_rows_max(&c->router, c->T_max, c->E);
        MOE_TRY(moe_place_layer_init(pl, c->E, p->ep_size, cfg->placement.slots_per_rank,
                                     3 * (size_t)c->H * c->D, rows, c->D));
        m->a[l].moe.place = pl;
    }
    return 0;
}

void moe_parallel_placement_free(moe_parallel *p) {
    for (int l = 0; l < MOE_MAX_LAYERS; l++)
        if (p->place[l]) {
            moe_place_layer_free(p->place[l]);
            moe_mfree(p->place[l]);
            p->place[l] = NULL;
        }
    moe_mfree(p->place_ema);
    moe_mfree(p->place_buf);
    p->place_ema = NULL, p->place_buf = NULL, p->place_buf_n = 0;
}

static int grow(moe_parallel *p, size_t n) {
    if (n <= p->place_buf_n) return 0;
    float *q = moe_realloc(p->place_buf, n * sizeof(float));
    if (!q) return moe_fail(MOE_ENOMEM, "placement staging: %zu floats", n);
    p->place_buf = q, p->place_buf_n = n;
    return 0;
}

// The load a placement balances is the rows the experts compute: each
// expert's kept assignments of the last forward, summed over every rank (so
// every EP group computes the same tables), in an EMA with capacity.ema.
// Layers run one after the other, each exchange waiting for its slowest
// rank, so the imbalance measured is per layer: the sum over the layers of
// the largest rank's rows against the sum of the mean rows.
int moe_parallel_placement_observe(moe_parallel *p, const moe_model *m) {
    if (!p->place_ema) return 0;
    const size_t n = moe_model_load_len(m);
    const int P = p->ep_size;
    double kept[n + 1], rows[MOE_MAX_LAYERS + 1], sent = 0;
    memset(kept, 0, sizeof(double) * (n + 1));
    int n_moe = 0;
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_plan *pl = &m->a[l].moe.plan;
        for (int e = 0; e < m->moe_cfg[l].E; e++)
            kept[(size_t)n_moe * m->usage_E + e] = pl->kept[e];
        // Rows this rank's experts computed in the last forward, and the rows
        // it sent to other ranks (four times: out and back, forward and backward).
        const moe_place_layer *q = p->place[l];
        const int *rr = q->active ? q->recv_rows : m->a[l].moe.recv_rows;
        const int *sr = q->active ? q->send_rows : m->a[l].moe.send_rows;
        rows[n_moe] = 0;
        for (int s = 0; s < P; s++) {
            rows[n_moe] += rr[s];
            if (s != p->ep_rank) sent += 4.0 * sr[s] * m->moe_cfg[l].D * sizeof(float);
        }
        n_moe++;
    }
    MOE_TRY(moe_comm_allreduce_f64(p->world, kept, n));
    const double a = m->cfg.router.ema;
    for (size_t i = 0; i < n; i++)
        p->place_ema[i] = p->place_seeded ? a * p->place_ema[i] + (1 - a) * kept[i] : kept[i];
    p->place_seeded = true;
    rows[n_moe] = sent;
    double all[(size_t)P * (n_moe + 1)];
    MOE_TRY(moe_comm_allgather(p->ep, rows, all, sizeof(double) * (n_moe + 1)));
    for (int i = 0; i <= n_moe; i++) {
        double mx = 0, sum = 0;
        for (int r = 0; r < P; r++) {
            const double v = all[(size_t)r * (n_moe + 1) + i];
            mx = v > mx ? v : mx, sum += v;
        }
        if (i == n_moe) {
            p->place_a2a_bytes += sum / P;
        } else {
            p->place_rows_max += mx;
            p->place_rows_mean += sum / P;
        }
    }
    p->place_steps++;
    return 0;
}

double moe_parallel_placement_imbalance(const moe_parallel *p, double *a2a_bytes) {
    if (a2a_bytes) *a2a_bytes = p->place_steps ? p->place_a2a_bytes / p->place_steps : 0;
    return p->place_rows_mean > 0 ? p->place_rows_max / p->place_rows_mean : 0;
}

// The replicated experts of layer l, in expert order: the units of the
// gradient sums and weight copies, identical on every rank.
#define FOR_REPLICATED(pl, e)                                                                      \
    for (int e = 0; e < (pl)->t.E; e++)                                                            \
        if ((pl)->t.n_hold[e] > 1)

// Before the expert-DP all-reduce: each replicated expert's gradient summed
// over the EP group (holders contribute theirs, the rest zeros, added in rank
// order) lands in the home expert's gradient; replica gradients restart at 0.
int moe_parallel_placement_reduce_grads(moe_parallel *p, moe_model *m) {
    size_t n = 0;
    for (int l = 0; l < m->L; l++) {
        const moe_place_layer *pl = p->place[l];
        if (!pl || !pl->active) continue;
        FOR_REPLICATED(pl, e) n += pl->numel;
    }
    if (n == 0) return 0;
    MOE_TRY(grow(p, n));
    const int me = p->ep_rank;
    size_t o = 0;
    for (int pass = 0; pass < 2; pass++) {
        o = 0;
        for (int l = 0; l < m->L; l++) {
            moe_place_layer *pl = p->place[l];
            if (!pl || !pl->active) continue;
            const moe_placement *t = &pl->t;
            FOR_REPLICATED(pl, e) {
                float *buf = p->place_buf + o, *g = NULL;
                o += pl->numel;
                if (t->hold[(size_t)e * t->P] == me)
                    g = moe_layer_w13(&m->g[l].moe, e - me * t->El);
                int j = moe_placement_slot_of(t, me, e);
                if (!g && j >= t->El) g = pl->rep_g + (size_t)(j - t->El) * pl->numel;
                if (pass == 0) {
                    if (g)
                        memcpy(buf, g, pl->numel * sizeof(float));
                    else
                        memset(buf, 0, pl->numel * sizeof(float));
                } else if (t->hold[(size_t)e * t->P] == me) {
                    memcpy(g, buf, pl->numel * sizeof(float));
                }
            }
            if (pass == 1) memset(pl->rep_g, 0, (size_t)(t->S - t->El) * pl->numel * sizeof(float));
        }
        if (pass == 0) MOE_TRY(moe_comm_allreduce_f32(p->ep, p->place_buf, n));
    }
    return 0;
}

int moe_parallel_placement_step(moe_parallel *p, moe_model *m, long steps_done) {
    if (!p->place_ema) return 0;
    const int every = m->cfg.placement.update_every;
    for (int l = 0, idx = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        moe_place_layer *pl = p->place[l];
        const double *ema = p->place_ema + (size_t)idx++ * m->usage_E;
        if (p->place_seeded && steps_done % every == 0) {
            MOE_TRY(moe_placement_update(&pl->t, ema));
            pl->active = !moe_placement_is_static(&pl->t);
            // Replica gradients of the old table were summed and cleared.
            memset(pl->rep_g, 0, (size_t)(pl->t.S - pl->t.El) * pl->numel * sizeof(float));
        }
        if (!pl->active) continue;
        // Home weights (just updated by the optimizer) to every replica,
        // one broadcast per replicated expert from its home rank.
        const moe_placement *t = &pl->t;
        MOE_TRY(grow(p, pl->numel));
        FOR_REPLICATED(pl, e) {
            const int home = t->hold[(size_t)e * t->P], me = p->ep_rank;
            float *buf = p->place_buf;
            if (home == me)
                memcpy(buf, moe_layer_w13(&m->p[l].moe, e - me * t->El), pl->numel * sizeof(float));
            MOE_TRY(moe_comm_bcast(p->ep, buf, pl->numel * sizeof(float), home));
            const int j = moe_placement_slot_of(t, me, e);
            if (j >= t->El)
                memcpy(pl->rep_w + (size_t)(j - t->El) * pl->numel, buf, pl->numel * sizeof(float));
        }
    }
    return 0;
}
