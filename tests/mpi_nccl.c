// The NCCL communicator under `mpirun -np 4`: flat and hierarchical (2 ranks
// per simulated node) all-to-all of device buffers deliver exactly the rows
// every rank is known to send (uneven and zero counts), the all-reduce sums
// device buffers, and a receive buffer too small fails on every rank. Needs
// one GPU per rank on each node: otherwise every rank prints why and the job
// exits 77 (ctest: skipped).
#include "moe/comm.h"
#include "moe/comm_nccl.h"
#include "moe/error.h"
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOE_HAVE_NCCL
#include "kernels/cuda/cuda.h"
#include "kernels/ops.h"
#endif

static int wrank;

#define CHECK(cond, ...) TU_MPI_CHECK(wrank, cond, __VA_ARGS__)

#ifdef MOE_HAVE_NCCL
// Count of rows rank s sends to rank d in trial t (some zero).
static int count_of(int t, int s, int d) {
    int v = (s * 7 + d * 3 + t * 5) % 6;
    return v == 4 ? 0 : v * (1 + t);
}

// (moe_cuda_download waits on the backend stream, which waits for the NCCL op.)

// Value of element i of row r that rank s sends to rank d.
static float value_of(int t, int s, int d, int r, int i) {
    return (float)(t * 100000 + s * 10000 + d * 1000 + r * 10 + i);
}

static void alltoall_trial(moe_nccl_comm *nc, moe_a2a_algo algo, int P, int t, int D) {
    int send_counts[64], recv_counts[64], stotal = 0, rtotal = 0;
    for (int d = 0; d < P; d++)
        stotal += send_counts[d] = count_of(t, wrank, d);
    for (int s = 0; s < P; s++)
        rtotal += count_of(t, s, wrank);
    float *hs = malloc(sizeof(float) * ((size_t)stotal * D + 1));
    float *hr = malloc(sizeof(float) * ((size_t)rtotal * D + 1));
    size_t o = 0;
    for (int d = 0; d < P; d++)
        for (int r = 0; r < send_counts[d]; r++)
            for (int i = 0; i < D; i++)
                hs[o++] = value_of(t, wrank, d, r, i);
    float *ds = moe_ops_cuda.alloc(sizeof(float) * ((size_t)stotal * D + 1));
    float *dr = moe_ops_cuda.alloc(sizeof(float) * ((size_t)rtotal * D + 1));
    CHECK(ds && dr, "alloc: %s", moe_last_error());
    CHECK(moe_cuda_upload(ds, hs, sizeof(float) * stotal * D) == 0, "%s", moe_last_error());
    int rc = moe_nccl_alltoallv(nc, algo, ds, send_counts, dr, recv_counts, (size_t)rtotal,
                                sizeof(float) * D, moe_cuda_stream());
    CHECK(rc == 0, "alltoallv (algo %d, trial %d): %s", algo, t, moe_last_error());
    CHECK(moe_cuda_download(hr, dr, sizeof(float) * rtotal * D) == 0, "%s", moe_last_error());
    o = 0;
    for (int s = 0; s < P; s++) {
        CHECK(recv_counts[s] == count_of(t, s, wrank), "recv_counts[%d] = %d, expected %d", s,
              recv_counts[s], count_of(t, s, wrank));
        for (int r = 0; r < count_of(t, s, wrank); r++)
            for (int i = 0; i < D; i++, o++)
                if (hr[o] != value_of(t, s, wrank, r, i)) {
                    CHECK(0, "algo %d trial %d: row %d of rank %d elem %d: %g, expected %g", algo,
                          t, r, s, i, hr[o], value_of(t, s, wrank, r, i));
                    r = 1 << 30;
                    break;
                }
    }
    moe_ops_cuda.free(ds), moe_ops_cuda.free(dr);
    free(hs), free(hr);
}
#endif

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int P;
    MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
#ifndef MOE_HAVE_NCCL
    if (wrank == 0) printf("SKIP: built without NCCL (needs CUDA, NCCL and MPI)\n");
    MPI_Finalize();
    return 77;
#else
    // One GPU per rank of a node: NCCL refuses two ranks on one device.
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, wrank, MPI_INFO_NULL, &node);
    int local, nlocal;
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &nlocal);
    MPI_Comm_free(&node);
    char why[256] = "";
    int ndev = moe_cuda_device_count(why, sizeof why), ok = ndev >= nlocal, all_ok;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok) {
        if (wrank == 0)
            printf("SKIP: NCCL test needs one CUDA device per rank (%d ranks on a node, %d "
                   "devices%s%s)\n",
                   nlocal, ndev, ndev ? "" : ": ", why);
        MPI_Finalize();
        return 77;
    }
    moe_comm *flat = NULL, *hier = NULL;
    moe_nccl_comm *nf = NULL, *nh = NULL;
    CHECK(moe_cuda_init(local) == 0, "%s", moe_last_error());
    CHECK(moe_comm_mpi_world(&flat, 0) == 0, "%s", moe_last_error());
    CHECK(moe_comm_mpi_world(&hier, P % 2 == 0 ? 2 : 1) == 0, "%s", moe_last_error());
    CHECK(moe_nccl_comm_init(&nf, flat, local) == 0, "%s", moe_last_error());
    CHECK(moe_nccl_comm_init(&nh, hier, local) == 0, "%s", moe_last_error());
    if (!tu_failures) {
        for (int t = 0; t < 4; t++) {
            alltoall_trial(nf, MOE_A2A_FLAT, P, t, 3);
            alltoall_trial(nh, MOE_A2A_HIERARCHICAL, P, t, 5);
        }
        // all-reduce: rank r contributes (r + 1) * (i % 7); the sum is exact in fp32
        const size_t n = 100003;
        float *h = malloc(sizeof(float) * n), *d = moe_ops_cuda.alloc(sizeof(float) * n);
        for (size_t i = 0; i < n; i++)
            h[i] = (float)((wrank + 1) * (int)(i % 7));
        moe_cuda_upload(d, h, sizeof(float) * n);
        CHECK(moe_nccl_allreduce_f32(nf, d, n, moe_cuda_stream()) == 0, "%s", moe_last_error());
        moe_cuda_download(h, d, sizeof(float) * n);
        for (size_t i = 0; i < n; i++)
            if (h[i] != (float)(P * (P + 1) / 2 * (int)(i % 7))) {
                CHECK(0, "allreduce[%zu] = %g", i, h[i]);
                break;
            }
        // a receive buffer too small on rank 0: every rank gets the error
        int sc[64], rcv[64];
        for (int r = 0; r < P; r++)
            sc[r] = 2;
        float *buf = moe_ops_cuda.alloc(sizeof(float) * 4 * P);
        int rc =
            moe_nccl_alltoallv(nf, MOE_A2A_FLAT, buf, sc, buf + 2 * P, rcv,
                               wrank == 0 ? 1 : (size_t)(2 * P), sizeof(float), moe_cuda_stream());
        CHECK(rc == MOE_EINVAL, "too small a buffer on rank 0 gave %d", rc);
        moe_ops_cuda.free(buf), moe_ops_cuda.free(d);
        free(h);
    }
    moe_nccl_comm_free(nf), moe_nccl_comm_free(nh);
    moe_comm_free(flat), moe_comm_free(hier);
    moe_cuda_shutdown();
    int total;
    MPI_Allreduce(&tu_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (wrank == 0) printf("mpi_nccl: %s (%d failures)\n", total ? "FAILED" : "ok", total);
    MPI_Finalize();
    return total ? 1 : 0;
#endif
}
