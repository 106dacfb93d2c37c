// Group-limited routing under expert parallelism (run under `mpirun -np 4`,
// two simulated nodes of 2 ranks):
//   ep=4, router.n_groups = 4, router.topk_groups = 2, Gumbel noise, flat and
//   hierarchical: losses and final weights bit-identical to one process
//   (grad_accum = 4: micro-batch r is rank r's batch);
//   router.n_groups = 0 (one group per node) resolves to 2 groups, recorded
//   in the run's config;
//   the measured inter-node all-to-all bytes equal `moe plan`'s when every
//   expert overflows; with and without grouping they are printed (dropless).
#include "moe/checkpoint.h"
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/plan.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "mpi_testutil.h"
#include "testutil.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { STEPS = 4, W = 4 };
static int rank;

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

static moe_config base(const char *a2a) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32",   "model.n_layers=2",     "model.d_ff=48",
                          "model.seq_len=16",   "moe.num_experts=8",    "train.batch_size=2",
                          "train.eval_every=0", "train.warmup_steps=2", "router.noise=gumbel",
                          "router.n_groups=4",  "router.topk_groups=2"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        moe_config_set(&c, NULL, sets[i]);
    c.train.steps = STEPS;
    c.parallel.ep = 4;
    snprintf(c.comm.all_to_all, sizeof c.comm.all_to_all, "%s", a2a);
    return c;
}

static void equals_one_process(moe_comm *world, const char *dir, const char *a2a) {
    char dist[800], ref[800];
    snprintf(dist, sizeof dist, "%s/%s-dist", dir, a2a);
    snprintf(ref, sizeof ref, "%s/%s-ref", dir, a2a);
    moe_config c = base(a2a);
    double ld[STEPS] = {0}, lr[STEPS] = {0};
    moe_train_result r;
    mpi_train(rank, world, c, dist, ld, &r);
    if (rank == 0) {
        moe_config one = c;
        one.parallel.ep = 1;
        one.train.grad_accum = W;
        mpi_train(rank, NULL, one, ref, lr, NULL);
        for (int s = 0; s < STEPS; s++)
            CHECK(ld[s] == lr[s], "%s step %d: loss %.17g vs %.17g", a2a, s, ld[s], lr[s]);
        mpi_same_weights(rank, dist, ref);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

// n_groups = 0 on 2 nodes: 2 groups, written into the run's config.json.
static void node_default(moe_comm *world, const char *dir) {
    char out[800];
    snprintf(out, sizeof out, "%s/nodes", dir);
    moe_config c = base("hierarchical");
    c.router.n_groups = 0, c.router.topk_groups = 1;
    moe_train_result r;
    mpi_train(rank, world, c, out, NULL, &r);
    if (rank == 0) {
        char p[900];
        snprintf(p, sizeof p, "%s/config.json", out);
        moe_config got;
        moe_config_default(&got);
        CHECK(moe_config_load(&got, NULL, p) == 0, "%s", moe_last_error());
        CHECK(got.router.n_groups == 2 && got.router.topk_groups == 1,
              "n_groups = 0 on 2 nodes resolved to %d groups, topk %d", got.router.n_groups,
              got.router.topk_groups);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

// Measured inter-node bytes: equal to the plan's when every expert overflows;
// printed with and without groups (one group per node, one node per token).
static void inter_node_bytes(moe_comm *world, const char *dir, moe_a2a_algo algo) {
    const char *name = algo == MOE_A2A_FLAT ? "flat" : "hierarchical";
    moe_config c = base(name); // Gumbel second choices: every expert overflows
    moe_config_set(&c, NULL, "train.batch_size=4");
    moe_config_set(&c, NULL, "router.capacity_factor=0.05"); // C = 1 of ~16 per expert
    moe_config_set(&c, NULL, "router.min_capacity=1");
    moe_config_set(&c, NULL, "router.n_groups=2");
    moe_config_set(&c, NULL, "router.topk_groups=1");
    c.train.steps = 3;
    char out[800];
    snprintf(out, sizeof out, "%s/inter-%s", dir, name);
    moe_train_result r;
    if (mpi_train(rank, world, c, out, NULL, &r)) return;
    moe_machine mc = {4, 2, 2, {400, 100}, {2, 5}};
    moe_a2a_plan p;
    CHECK(moe_plan_a2a(&c, &mc, algo, &p) == 0, "plan: %s", moe_last_error());
    CHECK(r.a2a_inter_bytes == 3 * p.bytes_inter && r.a2a_inter_bytes > 0,
          "%s: measured %ld inter-node bytes over 3 steps, plan %ld per step", name,
          r.a2a_inter_bytes, p.bytes_inter);
    // dropless, as routed: with and without the node limit
    const long measured = r.a2a_inter_bytes;
    long got[2];
    for (int g = 0; g < 2; g++) {
        moe_config d = base(name);
        moe_config_set(&d, NULL, "router.noise=none");
        moe_config_set(&d, NULL, "router.capacity_factor=0");
        moe_config_set(&d, NULL, g ? "router.n_groups=2" : "router.n_groups=1");
        moe_config_set(&d, NULL, g ? "router.topk_groups=1" : "router.topk_groups=0");
        d.train.steps = 3;
        snprintf(out, sizeof out, "%s/dropless-%s-%d", dir, name, g);
        if (mpi_train(rank, world, d, out, NULL, &r)) return;
        got[g] = r.a2a_inter_bytes;
    }
    if (rank == 0)
        printf("%s, rank 0, 3 steps: inter-node bytes %ld measured = %ld planned at capacity; "
               "dropless %ld without groups, %ld with 2 groups (one per node), topk_groups 1\n",
               name, measured, 3 * p.bytes_inter, got[0], got[1]);
}

int main(int argc, char **argv) {
    char dir[512];
    int rc = mpi_test_begin(&argc, &argv, "mpi_router_groups", W, &rank, dir);
    if (rc) return rc;
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 2)) { // two simulated nodes of 2 ranks
        fprintf(stderr, "world: %s\n", moe_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    equals_one_process(world, dir, "flat");
    equals_one_process(world, dir, "hierarchical");
    node_default(world, dir);
    inter_node_bytes(world, dir, MOE_A2A_FLAT);
    inter_node_bytes(world, dir, MOE_A2A_HIERARCHICAL);
    moe_comm_free(world);
    return mpi_test_end("mpi_router_groups", rank);
}
