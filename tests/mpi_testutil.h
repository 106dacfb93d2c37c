// The opening and closing every tests/mpi_*.c program shares: MPI start-up,
// the rank count the program was written for, one scratch folder named by
// rank 0 for all ranks, and the checks summed over the ranks for the exit
// status. Header-only: testutil.c also serves the tests that have no MPI.
#ifndef MOE_MPI_TESTUTIL_H
#define MOE_MPI_TESTUTIL_H

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

#endif
