// MPI launches of the CLI: the environment of mpirun (Open MPI), PMI/PMIx
// (MPICH, srun) tells that this process is one rank of a job.
#include "moe/cli/cli.h"
#include "moe/comm.h"
#include "moe/error.h"

#include <stdlib.h>
#ifdef MOE_HAVE_MPI
#include <mpi.h>
#endif

bool moe_cli_mpi_launched(void) {
    static const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return true;
    return false;
}

int moe_cli_mpi_rank(void) {
    static const char *vars[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}

int moe_cli_mpi_world(struct moe_comm **world, int ranks_per_node) {
#ifdef MOE_HAVE_MPI
    int done = 0;
    MPI_Initialized(&done);
    if (!done && MPI_Init(NULL, NULL) != MPI_SUCCESS) return moe_fail(MOE_EIO, "MPI_Init failed");
    int rc = moe_comm_mpi_world(world, ranks_per_node);
    if (rc == MOE_EINVAL) MPI_Finalize(); // refused alike on every rank: none is left waiting
    return rc;
#else
    (void)world;
    (void)ranks_per_node;
    return moe_fail(MOE_EINVAL, "launched by mpirun/srun but this moe was built without MPI "
                                "(apt-get install libopenmpi-dev, rebuild)");
#endif
}

void moe_cli_mpi_finalize(struct moe_comm *world) {
    if (!world) return;
    moe_comm_free(world);
#ifdef MOE_HAVE_MPI
    MPI_Finalize();
#endif
}
