// A job where rank 2 fails (run under `mpirun -np 4` by tests/mpi_expect_fail.cmake):
//   agree  every rank agrees on rank 2's status and message (moe_comm_agree),
//          rank 0 prints it, every rank exits 2
//   abort  rank 2 prints its message and calls moe_comm_abort while its peers
//          wait in an all-reduce it never joins: the job must end, not hang
#include "moe/comm.h"
#include "moe/error.h"

#include <mpi.h>
#include <stdio.h>
#include <string.h>

#define FAILURE "rank 2: simulated failure (parallel.ep = 3 does not divide 4 ranks)"

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    const char *mode = argc > 1 ? argv[1] : "agree";
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 0)) {
        fprintf(stderr, "mpi_fail: %s\n", moe_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int rank = moe_comm_rank(world), status = 0;
    if (rank == 2) status = moe_fail(MOE_EINVAL, "%s", FAILURE);
    if (strcmp(mode, "abort") == 0) {
        if (rank == 2) {
            fprintf(stderr, "mpi_fail: %s\n", moe_last_error());
            moe_comm_abort(world, 1); // does not return
        }
        float x[4] = {1, 2, 3, 4};
        for (;;)
            moe_comm_allreduce_f32(world, x, 4);
    }
    int rc = moe_comm_agree(world, status);
    int ok = rc == MOE_EINVAL && strcmp(moe_last_error(), FAILURE) == 0, all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!ok) fprintf(stderr, "mpi_fail: rank %d got %d \"%s\"\n", rank, rc, moe_last_error());
    if (rank == 0 && all_ok) fprintf(stderr, "mpi_fail: every rank got: %s\n", moe_last_error());
    moe_comm_free(world);
    MPI_Finalize();
    return all_ok ? 2 : 1;
}
