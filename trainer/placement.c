// Load-driven expert placement in the training loop (placement.mode =
// replicate | move): load EMA, table updates, replica gradient sums and weight
// copies, and under move the migration of home experts. Replicas live in spare
// slots, so checkpoints, the optimizer state and the gradient norm see one
// copy per expert, the home one, wherever it lives.
#include "moe/placement.h"
#include "checkpoint_internal.h"
#include "moe/alloc.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/json_error.h"
#include "moe/log.h"
#include "moe/parallel.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int moe_parallel_placement_init(moe_parallel *p, moe_model *m, const moe_config *cfg) {
    if (!strcmp(cfg->placement.mode, "static")) return 0;
    if (p->ep_size < 2)
        return moe_fail(MOE_EINVAL, "placement.mode = %s needs parallel.ep > 1",
                        cfg->placement.mode);
    const size_t n = moe_model_load_len(m);
    p->place_ema = moe_calloc(n + 1, sizeof(double));
    p->place_acc = moe_calloc(n + MOE_MAX_LAYERS + 1, sizeof(double));
    if (!p->place_ema || !p->place_acc)
        return moe_fail(MOE_ENOMEM, "placement: load EMA of %zu experts", n);
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_layer_config *c = &m->moe_cfg[l];
        struct moe_place_layer *pl = moe_calloc(1, sizeof *pl);
        if (!pl) return moe_fail(MOE_ENOMEM, "placement of layer %d", l);
        p->place[l] = pl;
        const size_t rows = (size_t)moe_router_rows_max(&c->router, c->T_max, c->E);
        const int El = c->E / p->ep_size, S = cfg->placement.slots_per_rank;
        MOE_TRY(moe_place_layer_init(pl, c->E, p->ep_size, S > El ? S : El, 3 * (size_t)c->H * c->D,
                                     rows, c->D));
        pl->t.moves = !strcmp(cfg->placement.mode, "move");
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
    moe_mfree(p->place_acc);
    moe_mfree(p->place_buf);
    p->place_ema = NULL, p->place_acc = NULL, p->place_buf = NULL, p->place_buf_n = 0;
    p->place_acc_calls = 0;
}

static const char *view_name(const void *views, uint32_t i) {
    return ((const moe_param_view *)views)[i].name;
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
int moe_parallel_placement_accumulate(moe_parallel *p, const moe_model *m) {
    if (!p->place_ema) return 0;
    const size_t n = moe_model_load_len(m);
    const int P = p->ep_size;
    double *kept = p->place_acc, *rows = p->place_acc + n;
    int n_moe = 0;
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_plan *pl = &m->a[l].moe.plan;
        for (int e = 0; e < m->moe_cfg[l].E; e++)
            kept[(size_t)n_moe * m->usage_E + e] += pl->kept[e];
        // Rows this rank's experts computed, and the rows it sent to other
        // ranks (four times: out and back, forward and backward).
        const moe_place_layer *q = p->place[l];
        const int *rr = q->active ? q->recv_rows : m->a[l].moe.recv_rows;
        const int *sr = q->active ? q->send_rows : m->a[l].moe.send_rows;
        for (int s = 0; s < P; s++) {
            rows[n_moe] += rr[s];
            if (s != p->ep_rank)
                rows[MOE_MAX_LAYERS] += 4.0 * sr[s] * m->moe_cfg[l].D * sizeof(float);
        }
        n_moe++;
    }
    p->place_acc_calls++;
    return 0;
}

int moe_parallel_placement_observe(moe_parallel *p, const moe_model *m) {
    if (!p->place_ema) return 0;
    if (p->place_acc_calls == 0) MOE_TRY(moe_parallel_placement_accumulate(p, m));
    const size_t n = moe_model_load_len(m);
    const int P = p->ep_size;
    int n_moe = 0;
    for (int l = 0; l < m->L; l++)
        n_moe += m->is_moe[l];
    double kept[n + 1], rows[MOE_MAX_LAYERS + 1];
    memcpy(kept, p->place_acc, sizeof(double) * n);
    memcpy(rows, p->place_acc + n, sizeof(double) * (size_t)n_moe);
    rows[n_moe] = p->place_acc[n + MOE_MAX_LAYERS];
    memset(p->place_acc, 0, sizeof(double) * (n + MOE_MAX_LAYERS + 1));
    p->place_acc_calls = 0;
    MOE_TRY(moe_comm_allreduce_f64(p->world, kept, n));
    const double a = m->cfg.router.ema;
    for (size_t i = 0; i < n; i++)
        p->place_ema[i] = p->place_seeded ? a * p->place_ema[i] + (1 - a) * kept[i] : kept[i];
    p->place_seeded = true;
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
                int j = moe_placement_slot_of(t, me, e);
                if (t->hold[(size_t)e * t->P] == me) g = moe_layer_w13(&m->g[l].moe, j);
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

// Home weights (just updated by the optimizer, or loaded) to every replica
// of layer l, one broadcast per replicated expert from its home rank.
static int sync_replicas(moe_parallel *p, moe_model *m, int l) {
    moe_place_layer *pl = p->place[l];
    const moe_placement *t = &pl->t;
    MOE_TRY(grow(p, pl->numel));
    FOR_REPLICATED(pl, e) {
        const int home = t->hold[(size_t)e * t->P], me = p->ep_rank;
        float *buf = p->place_buf;
        if (home == me)
            memcpy(buf, moe_layer_w13(&m->p[l].moe, moe_placement_slot_of(t, me, e)),
                   pl->numel * sizeof(float));
        MOE_TRY(moe_comm_bcast(p->ep, buf, pl->numel * sizeof(float), home));
        const int j = moe_placement_slot_of(t, me, e);
        if (j >= t->El)
            memcpy(pl->rep_w + (size_t)(j - t->El) * pl->numel, buf, pl->numel * sizeof(float));
    }
    return 0;
}

// Local expert views of layer l renamed after this rank's home slots (the
// views of a layer's experts are consecutive, w1 w3 w2 per expert), and the
// name index rebuilt, so checkpoints write and load each expert by its name.
static int rename_experts(moe_parallel *p, moe_model *m, int l) {
    const moe_placement *t = &p->place[l]->t;
    char pre[MOE_PARAM_NAME_MAX];
    int i0 = -1, n = snprintf(pre, sizeof pre, "model.layers.%d.", l);
    for (int i = 0; i0 < 0 && i < m->table.count; i++)
        if (!strncmp(m->table.views[i].name, pre, (size_t)n) &&
            strstr(m->table.views[i].name, ".experts."))
            i0 = i;
    if (i0 < 0) return moe_fail(MOE_EINVAL, "placement: layer %d has no expert tensors", l);
    n = (int)(strstr(m->table.views[i0].name, ".experts.") - m->table.views[i0].name);
    static const char *const w[3] = {"w1", "w3", "w2"};
    for (int j = 0; j < t->El; j++)
        for (int k = 0; k < 3; k++) {
            moe_param_view *v = &m->table.views[i0 + 3 * j + k];
            snprintf(v->name + n, sizeof v->name - (size_t)n, ".experts.%d.%s.weight",
                     t->slot[p->ep_rank * t->S + j], w[k]);
        }
    moe_name_map_free(&m->table.index);
    MOE_TRY(moe_name_map_reserve(&m->table.index, (size_t)m->table.count));
    for (int i = 0; i < m->table.count; i++) {
        long dup;
        MOE_TRY(moe_name_map_add(&m->table.index, m->table.views, view_name, (size_t)i, &dup));
        if (dup >= 0)
            return moe_fail(MOE_EINVAL, "placement: parameter %s named twice after a move",
                            m->table.views[i].name);
    }
    return 0;
}

// Moves the home experts whose home slot changed from old [P * S] to the
// table: each rank packs the experts leaving its slots (weights, then both
// moments), in expert order per new home, one all-to-all in the EP group
// delivers them, each lands in its new slot. Local reorders go through the
// same buffers (sent to itself).
static int migrate(moe_parallel *p, moe_model *m, moe_adamw *opt, int l, const int *old) {
    moe_place_layer *pl = p->place[l];
    const moe_placement *t = &pl->t;
    const int P = t->P, S = t->S, El = t->El, me = p->ep_rank;
    int old_slot[t->E], old_home[t->E], moved = 0;
    for (int r = 0; r < P; r++)
        for (int j = 0; j < El; j++)
            old_home[old[r * S + j]] = r, old_slot[old[r * S + j]] = j;
    for (int e = 0; e < t->E; e++)
        moved += old_home[e] != moe_placement_home(t, e) ||
                 old_slot[e] != moe_placement_slot_of(t, old_home[e], e);
    if (!moved) return 0;
    // An expert's unit: its weights, then both moments as stored (bf16
    // moments: the pair fills numel floats), moved as bytes, so bit-exact.
    const size_t es = moe_adamw_state_size(opt->state), mb = pl->numel * es;
    const size_t unit = pl->numel + 2 * mb / sizeof(float);
    unsigned char *const mom[2] = {moe_adamw_moment(opt, 0), moe_adamw_moment(opt, 1)};
    MOE_TRY(grow(p, 2 * (size_t)El * unit + 1));
    float *out = p->place_buf, *in = p->place_buf + (size_t)El * unit;
    const float *base = m->params;
    int sc[P], rc[P];
    size_t o = 0;
    for (int r = 0; r < P; r++) {
        sc[r] = 0;
        for (int e = 0; e < t->E; e++) {
            const int j = moe_placement_slot_of(t, r, e);
            if (old_home[e] != me || moe_placement_home(t, e) != r || (r == me && j == old_slot[e]))
                continue;
            const size_t off = (size_t)(moe_layer_w13(&m->p[l].moe, old_slot[e]) - base);
            memcpy(out + o, m->params + off, pl->numel * sizeof(float));
            memcpy((unsigned char *)(out + o + pl->numel), mom[0] + off * es, mb);
            memcpy((unsigned char *)(out + o + pl->numel) + mb, mom[1] + off * es, mb);
            o += unit, sc[r]++;
        }
    }
    MOE_TRY(moe_comm_alltoallv(p->ep, p->algo, out, sc, in, rc, (size_t)El, unit * sizeof(float)));
    o = 0;
    for (int s = 0; s < P; s++) {
        int got = 0;
        for (int e = 0; e < t->E; e++) {
            const int j = moe_placement_slot_of(t, me, e);
            if (old_home[e] != s || moe_placement_home(t, e) != me || (s == me && j == old_slot[e]))
                continue;
            const size_t off = (size_t)(moe_layer_w13(&m->p[l].moe, j) - base);
            memcpy(m->params + off, in + o, pl->numel * sizeof(float));
            memcpy(mom[0] + off * es, (const unsigned char *)(in + o + pl->numel), mb);
            memcpy(mom[1] + off * es, (const unsigned char *)(in + o + pl->numel) + mb, mb);
            o += unit, got++;
        }
        if (got != rc[s])
            return moe_fail(MOE_EINVAL, "placement: rank %d sent %d moved experts, %d expected", s,
                            rc[s], got);
    }
    return rename_experts(p, m, l);
}

int moe_parallel_placement_step(moe_parallel *p, moe_model *m, moe_adamw *opt, long steps_done) {
    if (!p->place_ema) return 0;
    const int every = m->cfg.placement.update_every;
    for (int l = 0, idx = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        moe_place_layer *pl = p->place[l];
        const double *ema = p->place_ema + (size_t)idx++ * m->usage_E;
        if (p->place_seeded && steps_done % every == 0) {
            const size_t PS = (size_t)pl->t.P * pl->t.S;
            int old[PS];
            memcpy(old, pl->t.slot, sizeof old);
            MOE_TRY(moe_placement_update(&pl->t, ema));
            pl->active = !moe_placement_is_static(&pl->t);
            if (pl->t.moves) MOE_TRY(migrate(p, m, opt, l, old));
            // Replica gradients of the old table were summed and cleared.
            memset(pl->rep_g, 0, (size_t)(pl->t.S - pl->t.El) * pl->numel * sizeof(float));
        }
        if (pl->active) MOE_TRY(sync_replicas(p, m, l));
    }
    return 0;
}

int moe_parallel_expert_of(const moe_parallel *p, const moe_model *m, int l, int j) {
    const moe_place_layer *pl = p ? p->place[l] : NULL;
    if (pl) return pl->t.slot[p->ep_rank * pl->t.S + j];
    return moe_layer_first_expert(&m->moe_cfg[l]) + j;
}

int moe_parallel_expert_home(const moe_parallel *p, const moe_model *m, int l, int x) {
    const moe_place_layer *pl = p ? p->place[l] : NULL;
    if (pl) return moe_placement_home(&pl->t, x);
    return x / moe_layer_local_experts(&m->moe_cfg[l]);
}

// --- the placement state in trainer_state.json ------------------------------------
// {"ep": P, "slots_per_rank": S, "seeded": b, "layers": [{"layer": l, "ema":
// [E], "slots": [P*S], "holders": [[home, replica ranks in deal order], ...]}]}:
// the EMA the next tables come from and the current tables (the holders'
// order is the deal's, so it is kept rather than derived from the slots).

int moe_parallel_placement_state(const moe_parallel *p, const moe_model *m, json_t **out) {
    *out = NULL;
    if (!p || !p->place_ema) return 0;
    // Each container joins its parent as soon as it exists (the parent owns
    // it from then on), so a failure frees everything with doc.
    json_t *doc = json_object(), *layers = json_array();
    int ok = doc && !json_object_set_new(doc, "layers", layers);
    ok = ok && !json_object_set_new(doc, "ep", json_integer(p->ep_size));
    ok = ok && !json_object_set_new(doc, "seeded", json_boolean(p->place_seeded));
    for (int l = 0, idx = 0; ok && l < m->L; l++) {
        const moe_place_layer *pl = p->place[l];
        if (!pl) continue;
        const moe_placement *t = &pl->t;
        const double *ema = p->place_ema + (size_t)idx++ * m->usage_E;
        json_t *o = json_object(), *je = json_array(), *js = json_array(), *jh = json_array();
        ok = !json_array_append_new(layers, o) && !json_object_set_new(o, "ema", je) &&
             !json_object_set_new(o, "slots", js) && !json_object_set_new(o, "holders", jh) &&
             !json_object_set_new(o, "layer", json_integer(l)) &&
             !json_object_set_new(doc, "slots_per_rank", json_integer(t->S));
        for (int e = 0; ok && e < t->E; e++) {
            json_t *h = json_array();
            ok = !json_array_append_new(je, json_real(ema[e])) && !json_array_append_new(jh, h);
            for (int i = 0; ok && i < t->n_hold[e]; i++)
                ok = !json_array_append_new(h, json_integer(t->hold[(size_t)e * t->P + i]));
        }
        for (int j = 0; ok && j < t->P * t->S; j++)
            ok = !json_array_append_new(js, json_integer(t->slot[j]));
    }
    if (!ok) {
        json_decref(doc);
        return moe_fail(MOE_ENOMEM, "checkpoint: trainer_state.json placement: out of memory");
    }
    *out = doc;
    return 0;
}

static int bad(const char *path, const char *field, int l, const char *want) {
    return moe_fail(MOE_EFORMAT, "%s: 'placement.layers[layer %d].%s' must be %s", path, l, field,
                    want);
}

// Layer l's state (object o) into t and ema, every field checked: the table
// must be one moe_placement_update could build (the home slots hold every
// expert once (moved by placement.mode = move or not), each holder
// list starting at the home rank and naming distinct ranks that hold the
// expert in one slot each, no other copy).
static int read_layer(const char *path, json_t *o, int l, moe_placement *t, double *ema) {
    const int E = t->E, P = t->P, S = t->S, El = t->El;
    json_t *jl = json_object_get(o, "layer"), *je = json_object_get(o, "ema"),
           *js = json_object_get(o, "slots"), *jh = json_object_get(o, "holders");
    char want[192];
    if (!json_is_object(o)) return bad(path, "(entry)", l, "an object");
    snprintf(want, sizeof want, "%d (the next MoE layer)", l);
    if (!json_is_integer(jl) || json_integer_value(jl) != l) return bad(path, "layer", l, want);
    snprintf(want, sizeof want, "an array of %d finite numbers >= 0", E);
    if (!json_is_array(je) || json_array_size(je) != (size_t)E) return bad(path, "ema", l, want);
    for (int e = 0; e < E; e++) {
        json_t *v = json_array_get(je, e);
        ema[e] = json_is_number(v) ? json_number_value(v) : -1;
        if (!(ema[e] >= 0 && ema[e] < 1e300)) return bad(path, "ema", l, want);
    }
    snprintf(want, sizeof want,
             "an array of %d x %d expert indices (-1: empty), the home slots j < %d of the "
             "ranks holding every expert once",
             P, S, El);
    if (!json_is_array(js) || json_array_size(js) != (size_t)P * S)
        return bad(path, "slots", l, want);
    int home[E];
    for (int e = 0; e < E; e++)
        home[e] = -1;
    for (int j = 0; j < P * S; j++) {
        json_t *v = json_array_get(js, j);
        const long long x = json_is_integer(v) ? json_integer_value(v) : -2;
        const int r = j / S, k = j % S;
        if (x < -1 || x >= E || (k < El && (x < 0 || home[x] >= 0)))
            return bad(path, "slots", l, want);
        if (k < El) home[x] = r;
        t->slot[j] = (int)x;
    }
    snprintf(want, sizeof want,
             "an array of %d lists of distinct ranks, the home rank first, each rank "
             "holding the expert in its slots, every copy listed",
             E);
    if (!json_is_array(jh) || json_array_size(jh) != (size_t)E)
        return bad(path, "holders", l, want);
    for (int e = 0; e < E; e++) {
        json_t *h = json_array_get(jh, e);
        const size_t n = json_is_array(h) ? json_array_size(h) : 0;
        int copies = 0;
        for (int j = 0; j < P * S; j++)
            copies += t->slot[j] == e;
        if (n < 1 || n != (size_t)copies) return bad(path, "holders", l, want);
        t->n_hold[e] = (int)n;
        for (size_t i = 0; i < n; i++) {
            json_t *v = json_array_get(h, i);
            const long long r = json_is_integer(v) ? json_integer_value(v) : -1;
            if (r < 0 || r >= P || (i == 0 && r != home[e]) ||
                moe_placement_slot_of(t, (int)r, e) < 0)
                return bad(path, "holders", l, want);
            for (size_t q = 0; q < i; q++)
                if (t->hold[(size_t)e * P + q] == r) return bad(path, "holders", l, want);
            t->hold[(size_t)e * P + i] = (int)r;
        }
    }
    return 0;
}

// The whole state checked into copies, then applied (nothing changes on a
// failure). Absent, or written under another EP size or slot count: logged,
// and the run starts from the static table.
static int read_state(moe_parallel *p, moe_model *m, const char *path, json_t *doc) {
    json_t *ps = json_object_get(doc, "placement");
    if (!ps) {
        if (p->rank == 0)
            moe_log(MOE_LOG_INFO, "%s: no placement state: placement starts from the static table",
                    path);
        return 0;
    }
    json_t *jep = json_object_get(ps, "ep"), *jS = json_object_get(ps, "slots_per_rank"),
           *jseed = json_object_get(ps, "seeded"), *jl = json_object_get(ps, "layers");
    if (!json_is_object(ps) || !json_is_integer(jep) || !json_is_integer(jS) ||
        !json_is_boolean(jseed) || !json_is_array(jl))
        return moe_fail(MOE_EFORMAT,
                        "%s: 'placement' must be an object with integers 'ep' and "
                        "'slots_per_rank', a boolean 'seeded' and an array 'layers'",
                        path);
    // A layout no run could have written is a damaged file, not another layout.
    if (json_integer_value(jep) < 1 || json_integer_value(jep) > 1 << 16 ||
        json_integer_value(jS) < 1 || json_integer_value(jS) > 1 << 16)
        return moe_fail(MOE_EFORMAT,
                        "%s: 'placement' has ep = %lld and slots_per_rank = %lld: expected "
                        "1..65536 each",
                        path, (long long)json_integer_value(jep),
                        (long long)json_integer_value(jS));
    int n_moe = 0, S = 0;
    for (int l = 0; l < m->L; l++)
        if (p->place[l]) n_moe++, S = p->place[l]->t.S;
    if (json_integer_value(jep) != p->ep_size || json_integer_value(jS) != S) {
        if (p->rank == 0)
            moe_log(MOE_LOG_WARN,
                    "%s: placement state of parallel.ep = %lld with %lld slots per rank, this run "
                    "has %d with %d: placement starts from the static table",
                    path, (long long)json_integer_value(jep), (long long)json_integer_value(jS),
                    p->ep_size, S);
        return 0;
    }
    if (json_array_size(jl) != (size_t)n_moe)
        return moe_fail(MOE_EFORMAT, "%s: 'placement.layers' must hold the %d MoE layers", path,
                        n_moe);
    moe_placement tab[MOE_MAX_LAYERS];
    const size_t n = moe_model_load_len(m);
    double *ema = moe_calloc(n + 1, sizeof(double));
    int rc = ema ? 0 : moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    memset(tab, 0, sizeof tab);
    for (int l = 0, idx = 0; rc == 0 && l < m->L; l++) {
        if (!p->place[l]) continue;
        const moe_placement *t = &p->place[l]->t;
        rc = moe_placement_init(&tab[l], t->E, t->P, t->S);
        if (rc == 0)
            rc = read_layer(path, json_array_get(jl, idx), l, &tab[l],
                            ema + (size_t)idx * m->usage_E);
        idx++;
    }
    if (rc == 0) { // all valid
        memcpy(p->place_ema, ema, n * sizeof(double));
        p->place_seeded = json_is_true(jseed);
        for (int l = 0; l < m->L; l++) {
            moe_place_layer *pl = p->place[l];
            if (!pl) continue;
            const moe_placement *t = &tab[l];
            memcpy(pl->t.slot, t->slot, sizeof(int) * (size_t)t->P * t->S);
            memcpy(pl->t.n_hold, t->n_hold, sizeof(int) * (size_t)t->E);
            memcpy(pl->t.hold, t->hold, sizeof(int) * (size_t)t->E * t->P);
            pl->active = !moe_placement_is_static(&pl->t);
            if (rc == 0) rc = rename_experts(p, m, l); // homes moved: views follow
        }
    }
    for (int l = 0; l < MOE_MAX_LAYERS; l++)
        if (tab[l].slot) moe_placement_free(&tab[l]);
    moe_mfree(ema);
    return rc;
}

int moe_parallel_placement_resume(moe_parallel *p, moe_model *m, const char *dir) {
    if (!p->place_ema) return 0;
    char rdir[PATH_MAX], path[PATH_MAX + 32];
    MOE_TRY(moe_ckpt_resolve(dir, rdir, sizeof rdir, NULL));
    snprintf(path, sizeof path, "%s/trainer_state.json", rdir);
    FILE *f;
    MOE_TRY(moe_fopen_regular(path, &f));
    json_error_t jerr;
    json_t *doc = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!doc) return moe_json_fail(MOE_EFORMAT, path, &jerr);
    int rc = read_state(p, m, path, doc);
    json_decref(doc);
    return rc;
}

int moe_parallel_placement_sync(moe_parallel *p, moe_model *m) {
    for (int l = 0; p->place_ema && l < m->L; l++)
        if (p->place[l] && p->place[l]->active) MOE_TRY(sync_replicas(p, m, l));
    return 0;
}
