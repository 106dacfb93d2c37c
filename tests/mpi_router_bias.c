// Auxiliary-loss-free balancing under MPI (run with `mpirun -np 4`): the bias
// moves on the load of the whole global batch (all ranks, all micro-batches),
// so 4 ranks, expert parallel (ep 4) or data parallel (ep 1), equal one
// process with grad_accum = 4 bit for bit: losses, weights and the bias
// tensors of the checkpoint. A rank whose bias drifted would route its
// micro-batch differently from the reference's micro-batch of the same index.
#include "moe/checkpoint.h"
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "mpi_testutil.h"
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { STEPS = 6, W = 4, E = 8 };
static int rank;

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

static moe_config base(int ep) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {
        "model.d_model=32",       "model.n_layers=2",           "model.d_ff=48",
        "model.seq_len=16",       "moe.num_experts=8",          "train.batch_size=2",
        "train.eval_every=0",     "train.warmup_steps=2",       "router.score=sigmoid",
        "router.aux_loss_coef=0", "router.capacity_factor=1.0", "router.bias_update_rate=0.01"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        CHECK(moe_config_set(&c, NULL, sets[i]) == 0, "%s: %s", sets[i], moe_last_error());
    c.train.steps = STEPS;
    c.parallel.ep = ep;
    return c;
}

// Every tensor of a's model.safetensors equals b's, bit for bit; returns how
// many bias tensors were compared and whether one was non-zero.
static int compare_models(const char *a, const char *b, const char *what, bool *moved) {
    char pa[1024], pb[1024];
    snprintf(pa, sizeof pa, "%s", a); // either layout: one file or shards
    snprintf(pb, sizeof pb, "%s", b);
    moe_st_set *sa = NULL, *sb = NULL;
    int n_bias = 0;
    if (moe_st_set_open(pa, &sa) || moe_st_set_open(pb, &sb)) {
        CHECK(0, "%s: %s", what, moe_last_error());
        moe_st_set_close(sa);
        return 0;
    }
    CHECK(sa->n_refs + (sa->n_refs ? 0 : (size_t)sa->files[0]->n_tensors) ==
              sb->n_refs + (sb->n_refs ? 0 : (size_t)sb->files[0]->n_tensors),
          "%s: tensor counts differ", what);
    for (int k = 0; k < sa->n_files; k++)
        for (int i = 0; i < sa->files[k]->n_tensors; i++) {
            moe_st_file *fa = sa->files[k], *fb = NULL;
            const moe_st_tensor *ta = &fa->tensors[i], *tb = moe_st_set_find(sb, ta->name, &fb);
            CHECK(tb && tb->nbytes == ta->nbytes, "%s: tensor %s", what, ta->name);
            if (!tb || tb->nbytes != ta->nbytes) continue;
            float *x = malloc(ta->nbytes), *y = malloc(tb->nbytes);
            moe_st_read(fa, ta, x, ta->nbytes);
            moe_st_read(fb, tb, y, tb->nbytes);
            CHECK(!memcmp(x, y, ta->nbytes), "%s: %s differs", what, ta->name);
            if (moe_ckpt_bias_layer(ta->name) >= 0) {
                n_bias++;
                for (size_t j = 0; j < ta->nbytes / 4; j++)
                    *moved |= x[j] != 0.0f;
            }
            free(x);
            free(y);
        }
    moe_st_set_close(sa);
    moe_st_set_close(sb);
    return n_bias;
}

static int train(moe_comm *world, moe_config c, const char *out, const char *resume,
                 long stop_after, double *losses) {
    moe_train_opts o = {.out_dir = out,
                        .resume_dir = resume,
                        .losses = losses,
                        .stop_after = stop_after,
                        .world = world};
    return mpi_train_with(rank, c, o, NULL, out);
}

static void scenario(const char *dir, int ep) {
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 0)) {
        CHECK(0, "world: %s", moe_last_error());
        return;
    }
    char dist[800], ref[800], half[800], ck[900], resumed[800];
    snprintf(dist, sizeof dist, "%s/ep%d-dist", dir, ep);
    snprintf(ref, sizeof ref, "%s/ep%d-ref", dir, ep);
    snprintf(half, sizeof half, "%s/ep%d-half", dir, ep);
    snprintf(resumed, sizeof resumed, "%s/ep%d-resumed", dir, ep);
    moe_config c = base(ep);
    double ld[STEPS] = {0}, lr[STEPS] = {0};
    train(world, c, dist, NULL, 0, ld);
    // 4 ranks stop halfway; one process resumes their checkpoint
    train(world, c, half, NULL, STEPS / 2, NULL);
    if (rank == 0) {
        moe_config r = c;
        r.parallel.ep = 1;
        r.train.grad_accum = W;
        train(NULL, r, ref, NULL, 0, lr);
        for (int s = 0; s < STEPS; s++)
            CHECK(ld[s] == lr[s], "ep %d step %d: loss %.17g vs %.17g", ep, s, ld[s], lr[s]);
        char a[900], b[900];
        snprintf(a, sizeof a, "%s/checkpoint", dist);
        snprintf(b, sizeof b, "%s/checkpoint", ref);
        bool moved = false;
        int n = compare_models(a, b, ep > 1 ? "ep 4 vs 1 process" : "dp 4 vs 1 process", &moved);
        CHECK(n == 2 && moved, "ep %d: %d bias tensors in the checkpoint, moved %d", ep, n, moved);
        snprintf(ck, sizeof ck, "%s/checkpoint", half);
        train(NULL, r, resumed, ck, 0, NULL);
        snprintf(a, sizeof a, "%s/checkpoint", resumed);
        compare_models(a, b, "4 ranks -> 1 process", &moved);
        printf("ep %d: %d steps equal to one process with grad_accum %d, bias included\n", ep,
               STEPS, W);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    moe_comm_free(world);
}

int main(int argc, char **argv) {
    char dir[512];
    int rc = mpi_test_begin(&argc, &argv, "mpi_router_bias", W, &rank, dir);
    if (rc) return rc;
    scenario(dir, 4); // expert parallel
    scenario(dir, 1); // data parallel
    return mpi_test_end("mpi_router_bias", rank);
}
