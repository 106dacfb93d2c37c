// Ranks that do not hold the same run are refused by moe_train before any
// collective that depends on the config (run under `mpirun -np 4`): every
// rank returns MOE_EINVAL, agreed, naming the first differing key with rank
// 0's value and the lowest differing rank's; nothing is written. Equal runs
// pass the check.
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/train.h"
#include "mpi_testutil.h"
#include "testutil.h"

#include <mpi.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { W = 4 };
static int rank;

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

static moe_config base(void) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32", "model.n_layers=2",   "model.d_ff=48",
                          "model.seq_len=16", "train.batch_size=2", "train.eval_every=0",
                          "train.steps=2",    "parallel.ep=4"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        moe_config_set(&c, NULL, sets[i]);
    return c;
}

// moe_train of c into out on every rank: must fail alike with want in the message.
static void refused(moe_comm *world, moe_config c, const char *out, const char *want) {
    moe_train_opts o = {.out_dir = out, .quiet = true, .world = world};
    moe_train_result r;
    int rc = moe_train(&c, &o, &r);
    CHECK(rc == MOE_EINVAL && r.agreed, "rank %d: expected an agreed refusal, got %d (%s)", rank,
          rc, moe_last_error());
    CHECK(strstr(moe_last_error(), want) != NULL, "rank %d: '%s' does not say '%s'", rank,
          moe_last_error(), want);
    struct stat st;
    CHECK(stat(out, &st) != 0, "a refused run created %s", out);
    MPI_Barrier(MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    char dir[512], out[700];
    int rc = mpi_test_begin(&argc, &argv, "mpi_same_run", W, &rank, dir);
    if (rc) return rc;
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 0)) {
        fprintf(stderr, "mpi_same_run: %s\n", moe_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    snprintf(out, sizeof out, "%s/run", dir);

    // ranks 2 and 3 differ: rank 2, the lowest, is named
    moe_config c = base();
    if (rank >= 2) moe_config_set(&c, NULL, "router.top_k=1");
    refused(world, c, out, "ranks disagree on router.top_k: rank 0 has 2, rank 2 has 1");

    // parallel.ep decides the groups' collectives: without the check this
    // mismatch crashed or hung in moe_parallel_init
    c = base();
    if (rank == 1) moe_config_set(&c, NULL, "parallel.ep=2");
    refused(world, c, out, "ranks disagree on parallel.ep: rank 0 has 4, rank 1 has 2");

    // the run folder: train would fail at its first save
    moe_train_opts o = {.out_dir = out, .quiet = true, .world = world};
    char other[720];
    snprintf(other, sizeof other, "%s-%d", out, rank);
    c = base();
    CHECK(moe_train_check_same(world, &c, rank == 3 ? other : out, NULL) == MOE_EINVAL &&
              strstr(moe_last_error(), "ranks disagree on --out") != NULL,
          "--out: %s", moe_last_error());
    CHECK(moe_train_check_same(world, &c, out, rank == 1 ? out : NULL) == MOE_EINVAL &&
              strstr(moe_last_error(), "ranks disagree on --resume: rank 0 has (none)") != NULL,
          "--resume: %s", moe_last_error());

    // the same glob naming files of other sizes: each rank reads it in its
    // own folder (rank 2 in another one)
    char data[760], file[820];
    snprintf(data, sizeof data, "%s/data-%d", dir, rank == 2 ? 2 : 0);
    snprintf(file, sizeof file, "%s/a.txt", data);
    if (rank == 0 || rank == 2) {
        moe_make_dirs(data);
        FILE *f = fopen(file, "w");
        fputs(rank == 2 ? "abcdefghij0123456789x" : "abcdefghij0123456789", f);
        fclose(f);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    char cwd[1024];
    CHECK(getcwd(cwd, sizeof cwd) && chdir(data) == 0, "chdir %s", data);
    c = base();
    moe_config_set(&c, NULL, "data.kind=text");
    moe_config_set(&c, NULL, "data.path=*.txt");
    CHECK(moe_train_check_same(world, &c, out, NULL) == MOE_EINVAL &&
              strstr(moe_last_error(), "ranks disagree on file 1 of data.path: rank 0 has a.txt "
                                       "(20 bytes), rank 2 has a.txt (21 bytes)") != NULL,
          "data files: %s", moe_last_error());
    CHECK(chdir(cwd) == 0, "chdir back");

    // equal runs pass, and train
    c = base();
    CHECK(moe_train_check_same(world, &c, out, NULL) == 0, "equal runs: %s", moe_last_error());
    o.out_dir = out;
    mpi_train_with(rank, c, o, NULL, "equal runs");
    moe_comm_free(world);
    return mpi_test_end("mpi_same_run", rank);
}
