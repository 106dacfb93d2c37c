// All-to-all bandwidth of moe_comm_alltoallv, flat vs hierarchical, one JSON
// line per (algo, size) with nccl-tests' columns: algbw = bytes a rank sends
// (bytes_per_peer x ranks) / time, busbw = algbw (n-1)/n. Time per call is
// the slowest rank's mean, counts exchange and agreement included.
//   mpirun -np 4 build/bench/alltoall [--ranks-per-node 2] [--max-bytes 16777216]
#include "moe/comm.h"
#include "moe/error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOE_HAVE_MPI
#include <mpi.h>

enum { ELEM = 256 }; // bytes per row (64 floats)

static double time_calls(moe_comm *c, moe_a2a_algo algo, const char *send, const int *counts,
                         char *recv, int *rcounts, size_t cap, int iters) {
    moe_comm_barrier(c);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++)
        if (moe_comm_alltoallv(c, algo, send, counts, recv, rcounts, cap, ELEM)) {
            fprintf(stderr, "alltoall: %s\n", moe_last_error());
            moe_comm_abort(c, 1);
        }
    double t = (MPI_Wtime() - t0) / iters, worst;
    MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rpn = 0;
    long max_bytes = 16L << 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks-per-node") && i + 1 < argc)
            rpn = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--max-bytes") && i + 1 < argc)
            max_bytes = atol(argv[++i]);
        else {
            fprintf(stderr, "usage: alltoall [--ranks-per-node G] [--max-bytes B]\n");
            MPI_Finalize();
            return 2;
        }
    }
    moe_comm *c;
    if (moe_comm_mpi_world(&c, rpn)) {
        fprintf(stderr, "alltoall: %s\n", moe_last_error());
        MPI_Finalize();
        return 1;
    }
    const int P = moe_comm_size(c), rank = moe_comm_rank(c), G = moe_comm_ranks_per_node(c);
    int *counts = malloc(sizeof(int) * P), *rcounts = malloc(sizeof(int) * P);
    size_t total = (size_t)max_bytes * P;
    char *send = malloc(total), *recv = malloc(total);
    for (size_t i = 0; i < total; i++)
        send[i] = (char)(i * 131 + rank);
    const char *names[] = {"flat", "hierarchical"};
    for (long bytes = 1024; bytes <= max_bytes; bytes *= 4) {
        for (int r = 0; r < P; r++)
            counts[r] = (int)(bytes / ELEM);
        // About 256 MiB sent per rank and case, 5..200 calls after 2..20 warm-up calls.
        long iters = (256L << 20) / (bytes * P);
        iters = iters < 5 ? 5 : iters > 200 ? 200 : iters;
        for (int a = 0; a < 2; a++) {
            moe_a2a_algo algo = a ? MOE_A2A_HIERARCHICAL : MOE_A2A_FLAT;
            time_calls(c, algo, send, counts, recv, rcounts, total / ELEM, (int)(iters / 10 + 2));
            moe_comm_stats_reset(c);
            double t = time_calls(c, algo, send, counts, recv, rcounts, total / ELEM, (int)iters);
            moe_comm_stats s;
            moe_comm_stats_get(c, &s);
            double algbw = (double)bytes * P / t / 1e9;
            if (rank == 0)
                printf("{\"bench\":\"alltoall\",\"algo\":\"%s\",\"ranks\":%d,\"ranks_per_node\":%d,"
                       "\"bytes_per_peer\":%ld,\"elem_bytes\":%d,\"msgs_per_call\":%ld,"
                       "\"iters\":%ld,\"time_us\":%.2f,\"algbw_GBps\":%.3f,\"busbw_GBps\":%.3f}\n",
                       names[a], P, G, bytes, ELEM, s.msgs_sent / iters, iters, t * 1e6, algbw,
                       algbw * (P - 1) / P);
            fflush(stdout);
        }
    }
    free(counts);
    free(rcounts);
    free(send);
    free(recv);
    moe_comm_free(c);
    MPI_Finalize();
    return 0;
}

#else

int main(void) {
    printf("{\"bench\":\"alltoall\",\"skipped\":\"built without MPI\"}\n");
    return 0;
}

#endif
