// A job where rank 1 stops answering (run under mpirun -np 3 by tests/mpi_watchdog.cmake):
//   stop   rank 1 raises SIGSTOP before an all-reduce
//   sleep  rank 1 sleeps forever before it (a livelocked or deadlocked rank)
// The others must come back from the all-reduce with MOE_EIO and a message
// naming rank 1 and the collective (comm.timeout_s = 1 s), print it and end
// the job with moe_comm_abort; without the watchdog they would wait forever.
#include "moe/comm.h"
#include "moe/error.h"

#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    const char *mode = argc > 1 ? argv[1] : "stop";
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 0) || moe_comm_set_timeout(world, 1.0)) {
        fprintf(stderr, "mpi_watchdog: %s\n", moe_last_error());
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    int rank = moe_comm_rank(world);
    float x[16] = {1};
    // Healthy collectives first: the watchdog must not fire on them.
    for (int i = 0; i < 20; i++)
        if (moe_comm_allreduce_f32(world, x, 16) || moe_comm_barrier(world)) {
            fprintf(stderr, "mpi_watchdog: rank %d: healthy call failed: %s\n", rank,
                    moe_last_error());
            moe_comm_abort(world, 3);
        }
    if (rank == 1) {
        if (strcmp(mode, "stop") == 0) raise(SIGSTOP);
        for (;;)
            pause(); // the launcher's abort ends this process
    }
    int rc = moe_comm_allreduce_f32(world, x, 16);
    if (rc == 0) {
        fprintf(stderr, "mpi_watchdog: rank %d: the all-reduce completed without rank 1\n", rank);
        moe_comm_abort(world, 3);
    }
    fprintf(stderr, "mpi_watchdog: rank %d: %s (code %d)\n", rank, moe_last_error(), rc);
    // The communicator is unusable now: a further call fails at once.
    if (moe_comm_barrier(world) == 0) fprintf(stderr, "mpi_watchdog: barrier after timeout ok\n");
    fflush(stderr);
    moe_comm_abort(world, 1); // does not return
    return 1;
}
