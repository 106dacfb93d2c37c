// The opening and closing every tests/mpi_*.c program shares: MPI start-up,
// the rank count the program was written for, one scratch folder named by
// rank 0 for all ranks, and the checks summed over the ranks for the exit
// status; and the training call and checkpoint comparison most of them make.
// Header-only: testutil.c also serves the tests that have no MPI.
#ifndef MOE_MPI_TESTUTIL_H
#define MOE_MPI_TESTUTIL_H

#include "moe/error.h"
#include "moe/train.h"
#include "testutil.h"

#include <mpi.h>
#include <stdio.h>

// 0, or the exit status (2: run with the wrong number of ranks; MPI is
// finalised then).
static inline int mpi_test_begin(int *argc, char ***argv, const char *name, int want, int *rank,
                                 char dir[512]) {
    MPI_Init(argc, argv);
    int size;
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    dir[0] = '\0';
    if (*rank == 0) snprintf(dir, 512, "%s", tu_tmpdir());
    MPI_Bcast(dir, 512, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (size != want) {
        if (*rank == 0) fprintf(stderr, "%s: run with mpirun -np %d\n", name, want);
        MPI_Finalize();
        return 2;
    }
    return 0;
}

// Prints the totals on rank 0, finalises MPI and returns the exit status.
static inline int mpi_test_end(const char *name, int rank) {
    int total[2] = {tu_failures, tu_checks};
    MPI_Allreduce(MPI_IN_PLACE, total, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("%s: %d passed, %d failed\n", name, total[1] - total[0], total[0]);
    MPI_Finalize();
    return total[0] ? 1 : 0;
}

// moe_train of c under o, quietly: a failure is counted on this rank with
// `what` and the library's message. The result's evaluation is freed; *r (r
// may be NULL) gets the rest of the result.
static inline int mpi_train_with(int rank, moe_config c, moe_train_opts o, moe_train_result *r,
                                 const char *what) {
    moe_train_result res;
    o.quiet = true;
    int rc = moe_train(&c, &o, &res);
    TU_MPI_CHECK(rank, rc == 0, "%s: %s", what, moe_last_error());
    if (rc == 0 && !res.interrupted) moe_eval_result_free(&res.eval);
    if (r) *r = res;
    return rc;
}

// The common case: every rank of world (NULL: this process alone) trains c
// into out; losses (NULL: none) gets each step's loss.
static inline int mpi_train(int rank, struct moe_comm *world, moe_config c, const char *out,
                            double *losses, moe_train_result *r) {
    return mpi_train_with(
        rank, c, (moe_train_opts){.out_dir = out, .losses = losses, .world = world}, r, out);
}

// Counts a failure unless the checkpoints of runs a and b (their checkpoint/
// folders, one file or shards) hold the same tensors byte for byte.
static inline void mpi_same_weights(int rank, const char *a, const char *b) {
    char pa[1024], pb[1024], why[1200];
    snprintf(pa, sizeof pa, "%s/checkpoint", a);
    snprintf(pb, sizeof pb, "%s/checkpoint", b);
    TU_MPI_CHECK(rank, !tu_st_dirs_differ(pa, pb, why, sizeof why), "%s", why);
}

#endif
