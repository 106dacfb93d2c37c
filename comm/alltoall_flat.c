// Flat variable all-to-all (DESIGN "Parallelism"): the counts with one
// MPI_Alltoall, an agreement that every rank can take its rows, then the
// payload exchanged with every peer over the whole communicator.
#include "comm/comm_internal.h"
#include "moe/error.h"

#ifdef MOE_HAVE_MPI

int moe_comm_mpi_alltoallv_flat(moe_comm *c, const void *send, const int *send_counts, void *recv,
                                int *recv_counts, size_t recv_cap, size_t elem_size) {
    const int P = c->size, me = c->rank;
    long stotal, rtotal;
    int status = moe_comm_check_counts(send_counts, P, "send_counts", &stotal);
    MPI_COLL_TRY(c, "all-to-all (counts)",
                 MPI_Ialltoall(send_counts, 1, MPI_INT, recv_counts, 1, MPI_INT, c->comm, MOE_REQ));
    if (status == 0) status = moe_comm_check_recv(recv_counts, P, me, recv_cap, &rtotal);
    MOE_TRY(moe_comm_mpi_agree(c, status));

    int *sd = c->iw, *rd = c->iw + P;
    sd[0] = rd[0] = 0;
    for (int r = 1; r < P; r++) {
        sd[r] = sd[r - 1] + send_counts[r - 1];
        rd[r] = rd[r - 1] + recv_counts[r - 1];
    }
    MPI_Datatype T;
    MOE_TRY(moe_comm_mpi_elem_type(c, elem_size, &T));
    MOE_TRY(moe_comm_mpi_exchange(c, c->comm, "all-to-all", send, send_counts, sd, recv,
                                  recv_counts, rd, T, elem_size));
    for (int d = 0; d < P; d++)
        if (d != me && send_counts[d] > 0) {
            c->stats.bytes_sent += (long)send_counts[d] * (long)elem_size;
            c->stats.msgs_sent++;
            if (d / c->G != me / c->G)
                c->stats.bytes_inter += (long)send_counts[d] * (long)elem_size;
        }
    return 0;
}

#else

int moe_comm_mpi_alltoallv_flat(moe_comm *c, const void *send, const int *send_counts, void *recv,
                                int *recv_counts, size_t recv_cap, size_t elem_size) {
    (void)c, (void)send, (void)send_counts, (void)recv, (void)recv_counts, (void)recv_cap;
    (void)elem_size;
    return moe_fail(MOE_EINVAL, "all-to-all: built without MPI");
}

#endif
