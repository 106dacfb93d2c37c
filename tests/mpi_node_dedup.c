// Node-deduplicated expert-parallel dispatch (comm.node_dedup), under
// `mpirun -np 4` as two simulated nodes of 2 ranks:
//   a hand-made layer case (every token's 4 choices on the other node): the
//   measured inter-node bytes of one forward and backward equal the count by
//   hand, below the per-choice exchange's, and y, dx and every gradient are
//   bit-identical to it (flat and hierarchical);
//   training (ep = 4, group-limited top-4, Gumbel noise, drops): losses and
//   weights bit-identical with and without node_dedup and to one process;
//   dropless training: inter-node bytes (all ranks) with node_dedup below
//   those without, and falling with router.topk_groups = 1, 2, 4 (printed);
//   every rank's allocation peak equal to moe plan's figure for it.
#include "kernels/ops.h"
#include "moe/alloc.h"
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/moe_layer.h"
#include "moe/parallel.h"
#include "moe/plan.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "mpi_testutil.h"
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { STEPS = 3, W = 4 };
static int rank;

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

// ---- one layer, forced routing -----------------------------------------------------------

enum { LT = 4, LD = 8, LH = 4, LE = 8, LK = 4 };

typedef struct {
    float y[LT * LD], dx[LT * LD];
    float *grads;
    size_t n;
    long inter;
} layer_out;

// One forward and backward of the layer on this rank's LT tokens, each of
// which prefers the 4 experts of the other node (logits = x: gate = I).
static void layer_run(moe_parallel *par, const moe_router_config *rc, int dedup_G, layer_out *out) {
    moe_layer_config lc = {
        .T_max = LT, .D = LD, .H = LH, .E = LE, .router = *rc, .ep_size = W, .ep_rank = rank};
    const size_t n = moe_layer_num_params(&lc);
    float *w = calloc(n, sizeof(float)), *g = calloc(n, sizeof(float));
    moe_layer_params p, dp;
    moe_layer_params_view(&p, w, &lc);
    moe_layer_params_view(&dp, g, &lc);
    for (int e = 0; e < LE; e++)
        p.gate[e * LD + e] = 1.0f;
    const int e0 = moe_layer_first_expert(&lc);
    for (int le = 0; le < moe_layer_local_experts(&lc); le++)
        for (size_t i = 0; i < p.expert_numel; i++)
            moe_layer_w13(&p, le)[i] = 0.3f * sinf(0.37f * (float)i + 1.3f * (float)(e0 + le));
    float x[LT * LD], dy[LT * LD];
    const int other = 1 - rank / 2;
    for (int t = 0; t < LT; t++)
        for (int d = 0; d < LD; d++) {
            x[t * LD + d] = d / 4 == other ? 1.0f + 0.1f * (float)((d + t) % 4) : -1.0f;
            dy[t * LD + d] = 0.05f * cosf((float)(rank * 31 + t * LD + d));
        }
    moe_ep_group grp = par->group;
    grp.dedup_G = dedup_G;
    moe_layer_acts a;
    CHECK(moe_layer_acts_alloc(&a, &lc, &moe_ops_cpu) == 0, "acts: %s", moe_last_error());
    a.ep = &grp;
    moe_comm_stats_reset(par->ep);
    memset(out->dx, 0, sizeof out->dx);
    CHECK(moe_layer_forward(out->y, x, NULL, NULL, LT, &p, &a, true, 1) == 0, "forward: %s",
          moe_last_error());
    CHECK(moe_layer_backward(out->dx, &dp, dy, x, NULL, LT, &p, &a, 0.0f, 0.0f) == 0,
          "backward: %s", moe_last_error());
    for (int i = 0; i < LT * LK; i++) // the routing the byte count assumes
        CHECK(a.plan.expert[i] / 4 == other, "token %d choice %d: expert %d", i / LK, i % LK,
              a.plan.expert[i]);
    moe_comm_stats s;
    moe_comm_stats_get(par->ep, &s);
    out->inter = s.bytes_inter;
    out->grads = g, out->n = n;
    moe_layer_acts_free(&a);
    free(w);
}

static void layer_case(moe_comm *world, const char *a2a) {
    moe_config c;
    moe_config_default(&c);
    moe_config_set(&c, NULL, "moe.num_experts=8");
    moe_config_set(&c, NULL, "parallel.ep=4");
    moe_config_set(&c, NULL, "comm.node_dedup=true");
    snprintf(c.comm.all_to_all, sizeof c.comm.all_to_all, "%s", a2a);
    moe_parallel par;
    CHECK(moe_parallel_init(&par, world, &c) == 0, "parallel: %s", moe_last_error());
    CHECK(par.group.dedup_G == 2, "%s: dedup over %d ranks per node, expected 2", a2a,
          par.group.dedup_G);
    moe_router_config rc;
    moe_router_config_default(&rc);
    rc.top_k = LK;
    rc.capacity_factor = 0; // dropless
    layer_out on, off;
    layer_run(&par, &rc, 2, &on);
    layer_run(&par, &rc, 0, &off);
    // By hand, per rank: expert counts (2 ints to each of 2 remote ranks); the
    // index (2 counts, then position and weight per choice) and LT distinct
    // rows forward; LT dy rows backward; LT * LK rows back in the combine and
    // in the dispatch's backward. Per choice: LT * LK rows four times.
    const long row = LD * sizeof(float), counts = 2 * 2 * sizeof(int);
    const long dedup =
        counts + (2 + 2 * LT * LK) * (long)sizeof(int) + 2 * LT * row + 2 * LT * LK * row;
    const long per_choice = counts + 4 * LT * LK * row;
    CHECK(on.inter == dedup, "%s: node_dedup sent %ld inter-node bytes, by hand %ld", a2a, on.inter,
          dedup);
    CHECK(off.inter == per_choice, "%s: per choice %ld inter-node bytes, by hand %ld", a2a,
          off.inter, per_choice);
    CHECK(!memcmp(on.y, off.y, sizeof on.y), "%s: y differs with node_dedup", a2a);
    CHECK(!memcmp(on.dx, off.dx, sizeof on.dx), "%s: dx differs with node_dedup", a2a);
    CHECK(on.n == off.n && !memcmp(on.grads, off.grads, on.n * sizeof(float)),
          "%s: gradients differ with node_dedup", a2a);
    if (rank == 0)
        printf("layer case (%s): inter-node bytes per rank %ld with node_dedup, %ld without\n", a2a,
               on.inter, off.inter);
    free(on.grads);
    free(off.grads);
    moe_parallel_free(&par);
}

// ---- training ----------------------------------------------------------------------------

static moe_config base(const char *a2a, bool dedup) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32",   "model.n_layers=2",     "model.d_ff=48",
                          "model.seq_len=16",   "moe.num_experts=16",   "train.batch_size=2",
                          "train.eval_every=0", "train.warmup_steps=2", "router.noise=gumbel",
                          "router.top_k=4",     "router.n_groups=4",    "router.topk_groups=2"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        moe_config_set(&c, NULL, sets[i]);
    c.train.steps = STEPS;
    c.parallel.ep = 4;
    c.comm.node_dedup = dedup;
    snprintf(c.comm.all_to_all, sizeof c.comm.all_to_all, "%s", a2a);
    return c;
}

static void equals_one_process(moe_comm *world, const char *dir, const char *a2a) {
    char on[800], off[800], ref[800];
    snprintf(on, sizeof on, "%s/%s-dedup", dir, a2a);
    snprintf(off, sizeof off, "%s/%s-per-choice", dir, a2a);
    snprintf(ref, sizeof ref, "%s/%s-ref", dir, a2a);
    double lon[STEPS] = {0}, loff[STEPS] = {0}, lref[STEPS] = {0};
    moe_train_result r;
    mpi_train(rank, world, base(a2a, true), on, lon, &r);
    mpi_train(rank, world, base(a2a, false), off, loff, &r);
    if (rank == 0) {
        moe_config one = base(a2a, false);
        one.parallel.ep = 1;
        one.train.grad_accum = W; // micro-batch r is rank r's batch
        mpi_train(rank, NULL, one, ref, lref, NULL);
        for (int s = 0; s < STEPS; s++)
            CHECK(lon[s] == loff[s] && lon[s] == lref[s],
                  "%s step %d: loss %.17g node_dedup, %.17g per choice, %.17g one process", a2a, s,
                  lon[s], loff[s], lref[s]);
        mpi_same_weights(rank, on, off);
        mpi_same_weights(rank, on, ref);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

// Dropless, no noise: inter-node bytes with and without node_dedup for
// topk_groups = 1, 2, 4 (4 groups, 2 per node).
static void bytes_fall(moe_comm *world, const char *dir, const char *a2a) {
    static const int tg[3] = {1, 2, 4};
    long b[3][2];
    for (int i = 0; i < 3; i++)
        for (int d = 0; d < 2; d++) {
            moe_config c = base(a2a, d);
            moe_config_set(&c, NULL, "router.noise=none");
            moe_config_set(&c, NULL, "router.capacity_factor=0");
            c.router.topk_groups = tg[i];
            char out[800];
            snprintf(out, sizeof out, "%s/bytes-%s-%d-%d", dir, a2a, tg[i], d);
            moe_train_result r;
            if (mpi_train(rank, world, c, out, NULL, &r)) return;
            b[i][d] = r.a2a_inter_bytes;
        }
    // Summed over the ranks: which rank carries a row across differs between
    // the algorithms, the total does not.
    MPI_Allreduce(MPI_IN_PLACE, b, 6, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    for (int i = 0; i < 3; i++)
        CHECK(b[i][1] < b[i][0],
              "%s topk_groups %d: %ld inter-node bytes with node_dedup, %ld without", a2a, tg[i],
              b[i][1], b[i][0]);
    CHECK(b[0][1] < b[1][1] && b[1][1] < b[2][1],
          "%s: node_dedup inter-node bytes %ld, %ld, %ld for topk_groups 1, 2, 4 do not fall", a2a,
          b[0][1], b[1][1], b[2][1]);
    if (rank == 0)
        for (int i = 0; i < 3; i++)
            printf("%s, all ranks, %d steps, topk_groups %d: inter-node bytes %ld with "
                   "node_dedup, %ld without\n",
                   a2a, STEPS, tg[i], b[i][1], b[i][0]);
}

// Every rank's allocation peak over a run equals moe plan's figure for it:
// the exchange's buffers are allocated at their largest (the plan ignored
// them: 8 MiB short on configs/tiny.json). ep = 4 spans both nodes (N = 2),
// ep = 2 stays on one (N = 1); world's nodes hold ranks_per_node ranks.
static void plan_matches_peak(moe_comm *world, const char *dir, int ranks_per_node) {
    for (int ep = 4; ep >= 2; ep /= 2) {
        moe_config c = base("flat", true);
        c.parallel.ep = ep;
        c.comm.ranks_per_node = ranks_per_node;
        moe_mem_plan plan;
        CHECK(moe_plan_memory(&c, W, rank, &plan) == 0, "plan: %s", moe_last_error());
        char out[800];
        snprintf(out, sizeof out, "%s/peak-%d-%d", dir, ep, ranks_per_node);
        MPI_Barrier(MPI_COMM_WORLD);
        const size_t before = moe_mem_in_use();
        moe_mem_reset_peak();
        moe_train_result r;
        if (mpi_train_with(rank, c,
                           (moe_train_opts){.out_dir = out, .world = world, .stop_after = STEPS},
                           &r, out))
            return;
        const size_t measured = moe_mem_peak() - before;
        CHECK(measured == plan.total,
              "rank %d, ep %d, %d ranks per node: allocation peak %zu bytes, plan %zu", rank, ep,
              ranks_per_node, measured, plan.total);
    }
}

int main(int argc, char **argv) {
    char dir[512];
    int rc = mpi_test_begin(&argc, &argv, "mpi_node_dedup", W, &rank, dir);
    if (rc) return rc;
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 2)) { // two simulated nodes of 2 ranks
        fprintf(stderr, "world: %s\n", moe_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    layer_case(world, "flat");
    layer_case(world, "hierarchical");
    equals_one_process(world, dir, "flat");
    equals_one_process(world, dir, "hierarchical");
    bytes_fall(world, dir, "flat");
    bytes_fall(world, dir, "hierarchical");
    plan_matches_peak(world, dir, 2);
    moe_comm_free(world);
    if (moe_comm_mpi_world(&world, 1) == 0) { // four nodes of one rank
        plan_matches_peak(world, dir, 1);
        moe_comm_free(world);
    } else {
        CHECK(0, "world of one rank per node: %s", moe_last_error());
    }
    return mpi_test_end("mpi_node_dedup", rank);
}
