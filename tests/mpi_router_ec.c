// Expert-choice routing with expert parallelism (run under `mpirun -np 4`)
// equals one process: each rank routes its own micro-batch, as the reference
// (one process, grad_accum = 4) routes micro-batch r, so the step losses and
// the final weights are bit-identical, with flat and hierarchical all-to-all.
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "mpi_testutil.h"
#include "testutil.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { STEPS = 5, W = 4 };
static int rank;

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

static moe_config base(int ep, const char *a2a) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {
        "model.d_model=32",          "model.n_layers=2",           "model.d_ff=48",
        "model.seq_len=16",          "moe.num_experts=8",          "train.batch_size=2",
        "train.eval_every=0",        "train.warmup_steps=2",       "router.noise=jitter",
        "router.type=expert_choice", "router.capacity_factor=0.75"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        CHECK(moe_config_set(&c, NULL, sets[i]) == 0, "%s: %s", sets[i], moe_last_error());
    c.train.steps = STEPS;
    c.parallel.ep = ep;
    snprintf(c.comm.all_to_all, sizeof c.comm.all_to_all, "%s", a2a);
    return c;
}

// Every tensor of two checkpoints' model.safetensors is bit-identical.
static void same_models(const char *a, const char *b, const char *what) {
    char pa[1024], pb[1024], why[1200];
    snprintf(pa, sizeof pa, "%s/checkpoint", a); // either layout: one file or shards
    snprintf(pb, sizeof pb, "%s/checkpoint", b);
    CHECK(!tu_st_dirs_differ(pa, pb, why, sizeof why), "%s: %s", what, why);
}

static void scenario(const char *dir, int ranks_per_node, const char *a2a) {
    moe_comm *world;
    if (moe_comm_mpi_world(&world, ranks_per_node)) {
        CHECK(0, "world: %s", moe_last_error());
        return;
    }
    char dist[800], ref[800];
    snprintf(dist, sizeof dist, "%s/ec-%s-dist", dir, a2a);
    snprintf(ref, sizeof ref, "%s/ec-%s-ref", dir, a2a);
    moe_config c = base(W, a2a);
    double ld[STEPS] = {0}, lr[STEPS] = {0};
    mpi_train(rank, world, c, dist, ld, NULL);
    if (rank == 0) {
        c.parallel.ep = 1;
        c.train.grad_accum = W;
        mpi_train(rank, NULL, c, ref, lr, NULL);
        for (int s = 0; s < STEPS; s++)
            CHECK(ld[s] == lr[s], "%s step %d: loss %.17g vs %.17g", a2a, s, ld[s], lr[s]);
        same_models(dist, ref, a2a);
        printf("expert choice, ep=4 %s: losses %.6f -> %.6f, equal to one process\n", a2a, ld[0],
               ld[STEPS - 1]);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    moe_comm_free(world);
}

int main(int argc, char **argv) {
    char dir[512];
    int rc = mpi_test_begin(&argc, &argv, "mpi_router_ec", W, &rank, dir);
    if (rc) return rc;
    scenario(dir, 0, "flat");
    scenario(dir, 2, "hierarchical");
    return mpi_test_end("mpi_router_ec", rank);
}
