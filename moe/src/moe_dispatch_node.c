// Node-deduplicated expert-parallel dispatch (comm.node_dedup; DeepSeek-V3,
// arXiv 2412.19437 sec 3.2.2): a token's row crosses to a node once, to the
// rank there with the sender's local index, with an index of the ranks and
// rows that want it; that rank copies it to them inside the node. Built from
// the group's all-to-all with sparse counts, so the comm counters see it.
//
// Ranks r = n G + l on N nodes of G. Per forward, with this rank (n, l):
//   counts   per (rank, local expert), to every rank, as the per-choice dispatch
//   index    to (m, l) for each node m: G row counts (one per rank of m), then
//            per row of m's ranks, in the order those rows have in xe: the
//            position of its token among the rows sent to m, and its weight
//   rows     to (m, l): the distinct tokens of m's rows, first use order
//   in node  (m, l) builds each local rank's per-choice rows, source node by
//            source node, and sends them; the receiver reorders them by
//            source rank into xr: the same rows, in the same order, as today.
// The backward of the combine repeats rows and in-node with dy: the
// forwarder forms weight * dy per choice exactly as the token side would.
// Return paths (the combine, the dispatch's backward) stay one row per choice:
// adding them up on a node would change the order of the sums.
#include "moe_dispatch_node.h"
#include "moe/alloc.h"
#include "moe/error.h"

#include <string.h>

struct moe_node_state {
    int P, G, N;
    int *choice_of_row, *pos_of_tok; // [rows] (t k + j of each row), [T]
    int *u_tok, *u_cnt;              // distinct tokens per destination node, [N]
    int *sidx, *ridx;                // index sent, received (kept for the backward)
    int *sidx_n, *ridx_n;            // [P] ints to/from each rank
    int *rrows_n, *fwd_n, *stage_n;  // [P] rows from, to, from each rank
    float *srows, *rrows, *fwd, *stage;
    size_t cap[5];  // bytes of choice_of_row, pos_of_tok, u_tok, sidx, ridx
    size_t fcap[4]; // bytes of srows, rrows, fwd, stage
};

void moe_node_state_free(moe_layer_acts *a) {
    struct moe_node_state *s = a->node;
    if (!s) return;
    void *p[] = {s->choice_of_row, s->pos_of_tok, s->u_tok,  s->u_cnt,   s->sidx,
                 s->ridx,          s->sidx_n,     s->ridx_n, s->rrows_n, s->fwd_n,
                 s->stage_n,       s->srows,      s->rrows,  s->fwd,     s->stage};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        moe_mfree(p[i]);
    moe_mfree(s);
    a->node = NULL;
}

// *q = p grown to at least bytes (contents kept), *cap updated.
static int grow_to(void *p, size_t *cap, size_t bytes, void **q) {
    *q = p;
    if (bytes == 0) bytes = 1;
    if (bytes <= *cap) return 0;
    if (!(*q = moe_realloc(p, bytes)))
        return moe_fail(MOE_ENOMEM, "node-deduplicated dispatch: %zu bytes", bytes);
    *cap = bytes;
    return 0;
}
#define grow(pp, cap, bytes)                                                                       \
    __extension__({                                                                                \
        void *q_;                                                                                  \
        int rc_ = grow_to(*(pp), (cap), (bytes), &q_);                                             \
        if (rc_ == 0) *(pp) = q_;                                                                  \
        rc_;                                                                                       \
    })

// Nodes of G consecutive ranks in a group of P (one node per rank when G
// does not divide P).
static int node_size(int P, int dedup_G) {
    return dedup_G > 0 && P % dedup_G == 0 ? dedup_G : 1;
}

// The bytes of each buffer at its largest, allocated once with the state so
// the memory peak is the same whatever the routing (moe plan counts exactly
// these): choice_of_row, pos_of_tok, u_tok, sidx, ridx, then srows, rrows,
// fwd, stage. A source sends at most `rows` rows (the token side's xe) and
// T_max distinct tokens to each node; a forwarder passes on at most its N
// sources' rows; the expert side receives at most P * rows (its xr).
enum { NODE_BUFS = 9 };
static void node_bytes(const moe_layer_config *cfg, int P, int G, size_t b[NODE_BUFS]) {
    const size_t N = (size_t)(P / G), T = (size_t)cfg->T_max, rows = moe_layer_expert_rows(cfg);
    const size_t rb = (size_t)cfg->D * sizeof(float);
    const size_t n[NODE_BUFS] = {rows * sizeof(int),
                                 T * sizeof(int),
                                 N * T * sizeof(int),
                                 ((size_t)P + 2 * rows) * sizeof(int),
                                 N * ((size_t)G + 2 * rows) * sizeof(int),
                                 N * T * rb,
                                 N * T * rb,
                                 N * rows * rb,
                                 (size_t)P * rows * rb};
    for (int i = 0; i < NODE_BUFS; i++)
        b[i] = n[i] ? n[i] : 1;
}

size_t moe_layer_node_dedup_bytes(const moe_layer_config *cfg, int dedup_G) {
    if (cfg->ep_size < 2 || dedup_G <= 0) return 0;
    const int P = cfg->ep_size;
    size_t b[NODE_BUFS], total = sizeof(struct moe_node_state) + 6 * (size_t)P * sizeof(int);
    node_bytes(cfg, P, node_size(P, dedup_G), b);
    for (int i = 0; i < NODE_BUFS; i++)
        total += b[i];
    return total;
}

// The state of a group of P ranks in nodes of G, allocated on first use.
static int state(moe_layer_acts *a, struct moe_node_state **out) {
    const moe_ep_group *g = a->ep;
    if (!g || g->size != a->cfg.ep_size || g->rank != a->cfg.ep_rank)
        return moe_fail(MOE_EINVAL, "moe layer: expert-parallel group missing or not %d ranks",
                        a->cfg.ep_size);
    if (!a->node) {
        struct moe_node_state *s = moe_calloc(1, sizeof *s);
        if (!s) return moe_fail(MOE_ENOMEM, "node-deduplicated dispatch state");
        a->node = s;
        s->P = g->size;
        s->G = node_size(g->size, g->dedup_G);
        s->N = s->P / s->G;
        int **arr[] = {&s->u_cnt, &s->sidx_n, &s->ridx_n, &s->rrows_n, &s->fwd_n, &s->stage_n};
        for (size_t i = 0; i < sizeof arr / sizeof arr[0]; i++)
            if (!(*arr[i] = moe_calloc((size_t)s->P, sizeof(int))))
                return moe_fail(MOE_ENOMEM, "node-deduplicated dispatch state");
        size_t b[NODE_BUFS];
        node_bytes(&a->cfg, s->P, s->G, b);
        void **buf[NODE_BUFS] = {
            (void **)&s->choice_of_row, (void **)&s->pos_of_tok, (void **)&s->u_tok,
            (void **)&s->sidx,          (void **)&s->ridx,       (void **)&s->srows,
            (void **)&s->rrows,         (void **)&s->fwd,        (void **)&s->stage};
        size_t *cap[NODE_BUFS] = {&s->cap[0],  &s->cap[1],  &s->cap[2],  &s->cap[3], &s->cap[4],
                                  &s->fcap[0], &s->fcap[1], &s->fcap[2], &s->fcap[3]};
        for (int i = 0; i < NODE_BUFS; i++) {
            if (!(*buf[i] = moe_malloc(b[i])))
                return moe_fail(MOE_ENOMEM, "node-deduplicated dispatch: %zu bytes", b[i]);
            *cap[i] = b[i];
        }
    }
    *out = a->node;
    return 0;
}

// Same expression as the token side's unpermute backward on a zeroed row
// (kernels/cpu/permute.c), so the product rounds, and signs its zeros, alike.
static void weighted(float *restrict o, const float *restrict s, float w, int n) {
    for (int i = 0; i < n; i++)
        o[i] = 0.0f;
    for (int i = 0; i < n; i++)
        o[i] += w * s[i];
}

// The in-node step and the reorder into the expert side: stage holds, from
// local peer j, source node by source node, the rows of source n' G + j;
// they go to `to` in source-rank order (recv_rows per source).
static int in_node(moe_layer_acts *a, struct moe_node_state *s, float *to) {
    const moe_ep_group *g = a->ep;
    const int P = s->P, G = s->G, N = s->N, D = a->cfg.D, me = g->rank, n = me / G;
    const size_t rb = (size_t)D * sizeof(float);
    long want = 0;
    for (int r = 0; r < P; r++)
        want += a->recv_rows[r];
    MOE_TRY(grow(&s->stage, &s->fcap[3], (size_t)want * rb));
    MOE_TRY(g->alltoallv(g->ctx, s->fwd, s->fwd_n, s->stage, s->stage_n, (size_t)want, rb));
    int src_off[P];
    for (int r = 0, o = 0; r < P; r++)
        src_off[r] = o, o += a->recv_rows[r];
    size_t pos = 0;
    for (int j = 0; j < P; j++) { // the stage is in sending-rank order: own node only
        if (s->stage_n[j] == 0) continue;
        if (j / G != n)
            return moe_fail(MOE_EINVAL, "moe layer: rank %d forwarded rows from another node", j);
        long sum = 0;
        for (int m = 0; m < N; m++) {
            const int src = m * G + j % G, c = a->recv_rows[src];
            memcpy(to + (size_t)src_off[src] * D, s->stage + pos * D, (size_t)c * rb);
            pos += (size_t)c, sum += c;
        }
        if (sum != s->stage_n[j])
            return moe_fail(MOE_EINVAL,
                            "moe layer: rank %d forwarded %d rows, its sources announced %ld", j,
                            s->stage_n[j], sum);
    }
    for (int j = 0; j < P; j++) // a forwarder that sent nothing owes nothing
        if (s->stage_n[j] == 0)
            for (int m = 0; m < N && j / G == n; m++)
                if (a->recv_rows[m * G + j % G])
                    return moe_fail(MOE_EINVAL, "moe layer: rank %d forwarded no rows of rank %d",
                                    j, m * G + j % G);
    return 0;
}

// Builds the per-choice rows each local rank gets from this forwarder, from
// the distinct rows received (rows: from source node n', at rrows offsets),
// times their weights when `weigh` (the combine's backward).
static int forward_rows(moe_layer_acts *a, struct moe_node_state *s, bool weigh) {
    const int P = s->P, G = s->G, N = s->N, D = a->cfg.D, me = a->ep->rank, n = me / G;
    long total = 0;
    for (int r = 0; r < P; r++)
        s->fwd_n[r] = 0;
    // ridx from source node m (rank m G + l): G counts, then (pos, weight) per row.
    int ioff[N], roff[N];
    for (int r = 0, io = 0, ro = 0; r < P; r++) {
        if (r % G == me % G) ioff[r / G] = io, roff[r / G] = ro;
        io += s->ridx_n[r], ro += s->rrows_n[r];
    }
    for (int m = 0; m < N; m++) {
        const int src = m * G + me % G;
        if (s->ridx_n[src] == 0) continue;
        const int *ix = s->ridx + ioff[m];
        long rows = 0;
        for (int lp = 0; lp < G; lp++) {
            if (ix[lp] < 0)
                return moe_fail(MOE_EINVAL, "moe layer: rank %d sent a negative row count", src);
            rows += ix[lp];
        }
        if (s->ridx_n[src] != G + 2 * rows)
            return moe_fail(MOE_EINVAL, "moe layer: rank %d sent an index of %d ints for %ld rows",
                            src, s->ridx_n[src], rows);
        for (int lp = 0; lp < G; lp++)
            s->fwd_n[n * G + lp] += ix[lp];
        total += rows;
    }
    MOE_TRY(grow(&s->fwd, &s->fcap[2], (size_t)total * D * sizeof(float)));
    // Rows to local rank lp: source node by source node.
    size_t o = 0;
    for (int lp = 0; lp < G; lp++)
        for (int m = 0; m < N; m++) {
            const int src = m * G + me % G;
            if (s->ridx_n[src] == 0) continue;
            const int *ix = s->ridx + ioff[m], *row = ix + G;
            for (int q = 0; q < lp; q++)
                row += 2 * ix[q];
            for (int i = 0; i < ix[lp]; i++, o++) {
                const int p = row[2 * i];
                if (p < 0 || p >= s->rrows_n[src])
                    return moe_fail(MOE_EINVAL,
                                    "moe layer: rank %d indexes row %d of the %d it sent", src, p,
                                    s->rrows_n[src]);
                const float *x = s->rrows + ((size_t)roff[m] + p) * D;
                if (weigh) {
                    float w;
                    memcpy(&w, &row[2 * i + 1], sizeof w);
                    weighted(s->fwd + o * D, x, w, D);
                } else {
                    memcpy(s->fwd + o * D, x, (size_t)D * sizeof(float));
                }
            }
        }
    return 0;
}

int moe_node_dispatch(moe_layer_acts *a) {
    const moe_layer_config *cfg = &a->cfg;
    struct moe_node_state *s = NULL;
    MOE_TRY(state(a, &s));
    const moe_ep_group *g = a->ep;
    const moe_plan *pl = &a->plan;
    const int P = s->P, G = s->G, N = s->N, El = moe_layer_local_experts(cfg), D = cfg->D;
    const int T = pl->T, k = pl->k, rows = pl->offsets[pl->E], me = g->rank;
    const size_t rb = (size_t)D * sizeof(float);

    // Counts per (source, local expert), as the per-choice dispatch sends them.
    int per_peer[P], got[P];
    for (int r = 0; r < P; r++) {
        per_peer[r] = El;
        a->send_rows[r] = pl->offsets[(r + 1) * El] - pl->offsets[r * El];
    }
    MOE_TRY(
        g->alltoallv(g->ctx, pl->kept, per_peer, a->recv_kept, got, (size_t)P * El, sizeof(int)));
    for (int r = 0; r < P; r++) {
        a->recv_rows[r] = 0;
        for (int le = 0; le < El; le++)
            a->recv_rows[r] += a->recv_kept[r * El + le];
    }

    // Choice of every row of xe; then per destination node its distinct
    // tokens (first use order) and the index.
    MOE_TRY(grow(&s->choice_of_row, &s->cap[0], (size_t)rows * sizeof(int)));
    MOE_TRY(grow(&s->pos_of_tok, &s->cap[1], (size_t)T * sizeof(int)));
    for (int i = 0; i < rows; i++)
        s->choice_of_row[i] = -1;
    for (int i = 0; i < T * k; i++) {
        const int r = a->row[i];
        if (r >= 0 && r < rows) s->choice_of_row[r] = i;
    }
    for (int i = 0; i < rows; i++)
        if (s->choice_of_row[i] < 0)
            return moe_fail(MOE_EINVAL, "moe layer: expert row %d of %d holds no token", i, rows);
    MOE_TRY(grow(&s->u_tok, &s->cap[2], (size_t)N * T * sizeof(int)));
    MOE_TRY(grow(&s->sidx, &s->cap[3], ((size_t)N * G + 2 * (size_t)rows) * sizeof(int)));
    MOE_TRY(grow(&s->srows, &s->fcap[0], (size_t)N * T * rb));
    size_t nu = 0, ni = 0;
    for (int r = 0; r < P; r++)
        s->sidx_n[r] = 0, s->rrows_n[r] = 0;
    for (int m = 0; m < N; m++) {
        const size_t u0 = nu, i0 = ni;
        for (int t = 0; t < T; t++)
            s->pos_of_tok[t] = -1;
        for (int lp = 0; lp < G; lp++)
            s->sidx[ni++] = a->send_rows[m * G + lp];
        const int r0 = pl->offsets[m * G * El], r1 = pl->offsets[(m + 1) * G * El];
        for (int i = r0; i < r1; i++) {
            const int c = s->choice_of_row[i], t = c / k;
            if (s->pos_of_tok[t] < 0) {
                s->pos_of_tok[t] = (int)(nu - u0);
                s->u_tok[nu] = t;
                memcpy(s->srows + nu * D, a->xe + (size_t)i * D, rb);
                nu++;
            }
            s->sidx[ni++] = s->pos_of_tok[t];
            memcpy(&s->sidx[ni++], &pl->weight[c], sizeof(int)); // the choice's weight, bits
        }
        s->u_cnt[m] = (int)(nu - u0);
        const int dst = m * G + me % G;
        s->sidx_n[dst] = r1 > r0 ? (int)(ni - i0) : 0;
        if (r1 == r0) ni = i0; // nothing for that node: no index either
        s->rrows_n[dst] = s->u_cnt[m];
    }
    // Index and distinct rows to (m, l); receive from (m', l).
    const size_t icap = s->cap[4] / sizeof(int); // every source's counts and index
    MOE_TRY(grow(&s->ridx, &s->cap[4], icap * sizeof(int)));
    MOE_TRY(g->alltoallv(g->ctx, s->sidx, s->sidx_n, s->ridx, s->ridx_n, icap, sizeof(int)));
    MOE_TRY(grow(&s->rrows, &s->fcap[1], (size_t)N * cfg->T_max * rb));
    int sent_rows[P];
    memcpy(sent_rows, s->rrows_n, sizeof sent_rows);
    MOE_TRY(g->alltoallv(g->ctx, s->srows, sent_rows, s->rrows, s->rrows_n, (size_t)N * cfg->T_max,
                         rb));

    MOE_TRY(forward_rows(a, s, false));
    MOE_TRY(in_node(a, s, a->xr));
    // Blocks: source by source, each source's rows in local-expert order.
    int off = 0;
    for (int src = 0; src < P; src++)
        for (int le = 0; le < El; le++) {
            a->blk_off[src * El + le] = off;
            a->blk_n[src * El + le] = a->recv_kept[src * El + le];
            off += a->recv_kept[src * El + le];
        }
    return 0;
}

int moe_node_redispatch(moe_layer_acts *a, const float *dy, float *to) {
    struct moe_node_state *s = a->node;
    if (!s) return moe_fail(MOE_EINVAL, "moe layer: node-deduplicated backward before a forward");
    const moe_ep_group *g = a->ep;
    const int P = s->P, N = s->N, G = s->G, D = a->cfg.D, me = g->rank;
    const size_t rb = (size_t)D * sizeof(float);
    // dy of each node's distinct tokens, in the order the forward sent them.
    int sent_rows[P];
    for (int r = 0; r < P; r++)
        sent_rows[r] = 0;
    size_t nu = 0;
    for (int m = 0; m < N; m++) {
        for (int u = 0; u < s->u_cnt[m]; u++, nu++)
            memcpy(s->srows + nu * D, dy + (size_t)s->u_tok[nu] * D, rb);
        sent_rows[m * G + me % G] = s->u_cnt[m];
    }
    int got[P];
    MOE_TRY(g->alltoallv(g->ctx, s->srows, sent_rows, s->rrows, got, (size_t)N * a->cfg.T_max, rb));
    for (int r = 0; r < P; r++)
        if (got[r] != s->rrows_n[r])
            return moe_fail(MOE_EINVAL, "moe layer: rank %d sent %d gradient rows for %d tokens", r,
                            got[r], s->rrows_n[r]);
    MOE_TRY(forward_rows(a, s, true));
    return in_node(a, s, to);
}
