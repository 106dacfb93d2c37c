// Hierarchical variable all-to-all (DeepSpeed-MoE arXiv 2201.05596 §5.3,
// Tutel arXiv 2206.03382 "2DH"): ranks r = n G + l on N nodes of G. Step 1
// (inside a node) sends local peer l' everything bound for ranks (m, l') on
// every node m; step 2 (across nodes, between ranks of one local index)
// delivers it. Messages per rank: G-1 + N-1 instead of N G - 1, at the cost
// of two local block transposes and of sending rows that cross both a local
// and a node boundary twice. Counts take the same two steps first.
//
// Layouts (blocks of rows; [x][y] = x-major):
//   send      [m][l']  as the caller gives it (destination rank m G + l')
//   pack      [l'][m]  step-1 send buffer, one contiguous run per local peer
//   fwd       [j][m]   step-1 receive: from local peer j, for ranks (m, l)
//   fwd2      [m][j]   step-2 send buffer, one run per node
//   recv      [m][j]   from source rank m G + j: source-rank order, as flat
#include "comm/comm_internal.h"
#include "moe/error.h"

#ifdef MOE_HAVE_MPI

// Sums runs of `width` counts: out[i] = sum_k in[i * width + k], with
// prefix offsets in displ.
static void run_sums(int *out, int *displ, const int *in, int runs, int width) {
    int off = 0;
    for (int i = 0; i < runs; i++) {
        int s = 0;
        for (int k = 0; k < width; k++)
            s += in[i * width + k];
        out[i] = s;
        displ[i] = off;
        off += s;
    }
}

int moe_comm_mpi_alltoallv_hier(moe_comm *c, const void *send, const int *send_counts, void *recv,
                                int *recv_counts, size_t recv_cap, size_t elem_size) {
    const int P = c->size, G = c->G, N = P / G, me = c->rank, n = me / G, l = me % G;
    const size_t es = elem_size;
    // Work arrays: 3 P + 4 G + 4 N <= 8 P + 8 ints (G N = P, so G + N <= P + 1).
    int *cs1 = c->iw, *cr1 = cs1 + P, *cs2 = cr1 + P;               // [G][N] [G][N] [N][G]
    int *s1 = cs2 + P, *sd1 = s1 + G, *r1 = sd1 + G, *rd1 = r1 + G; // per local peer
    int *s2 = rd1 + G, *sd2 = s2 + N, *r2 = sd2 + N, *rd2 = r2 + N; // per node

    long stotal = 0, ftotal = 0, rtotal = 0;
    int status = moe_comm_check_counts(send_counts, P, "send_counts", &stotal);
    // Counts, step 1: cr1[j][m] = C[(n, j)][(m, l)], the rows this rank forwards.
    moe_comm_block_transpose(cs1, send_counts, NULL, N, G, sizeof(int), NULL);
    MPI_COLL_TRY(c, "all-to-all (node counts)",
                 MPI_Ialltoall(cs1, N, MPI_INT, cr1, N, MPI_INT, c->local, MOE_REQ));
    // Counts, step 2: recv_counts[m G + j] = C[(m, j)][me].
    moe_comm_block_transpose(cs2, cr1, NULL, G, N, sizeof(int), NULL);
    MPI_COLL_TRY(c, "all-to-all (cross counts)",
                 MPI_Ialltoall(cs2, G, MPI_INT, recv_counts, G, MPI_INT, c->cross, MOE_REQ));
    if (!status) status = moe_comm_check_recv(recv_counts, P, me, recv_cap, &rtotal);
    if (!status) status = moe_comm_check_counts(cr1, P, "forwarded counts", &ftotal);
    if (!status)
        status = moe_comm_grow(&c->a2a_buf, &c->a2a_cap, ((size_t)stotal + 2 * (size_t)ftotal) * es,
                               "hierarchical all-to-all");
    MOE_TRY(moe_comm_mpi_agree(c, status));

    MPI_Datatype T;
    MOE_TRY(moe_comm_mpi_elem_type(c, es, &T));
    char *pack = c->a2a_buf, *fwd = pack + (size_t)stotal * es, *fwd2 = fwd + (size_t)ftotal * es;
    // Step 1, inside the node.
    moe_comm_block_transpose(pack, send, send_counts, N, G, es, c->sw);
    run_sums(s1, sd1, cs1, G, N);
    run_sums(r1, rd1, cr1, G, N);
    MOE_TRY(moe_comm_mpi_exchange(c, c->local, "all-to-all (in node)", pack, s1, sd1, fwd, r1, rd1,
                                  T, es));
    // Step 2, across nodes.
    moe_comm_block_transpose(fwd2, fwd, cr1, G, N, es, c->sw);
    run_sums(s2, sd2, cs2, N, G);
    run_sums(r2, rd2, recv_counts, N, G);
    MOE_TRY(moe_comm_mpi_exchange(c, c->cross, "all-to-all (across nodes)", fwd2, s2, sd2, recv, r2,
                                  rd2, T, es));

    for (int j = 0; j < G; j++)
        if (j != l && s1[j] > 0)
            c->stats.bytes_sent += (long)s1[j] * (long)es, c->stats.msgs_sent++;
    for (int m = 0; m < N; m++)
        if (m != n && s2[m] > 0) {
            c->stats.bytes_sent += (long)s2[m] * (long)es, c->stats.msgs_sent++;
            c->stats.bytes_inter += (long)s2[m] * (long)es;
        }
    return 0;
}

#else

int moe_comm_mpi_alltoallv_hier(moe_comm *c, const void *send, const int *send_counts, void *recv,
                                int *recv_counts, size_t recv_cap, size_t elem_size) {
    (void)c, (void)send, (void)send_counts, (void)recv, (void)recv_counts, (void)recv_cap;
    (void)elem_size;
    return moe_fail(MOE_EINVAL, "all-to-all: built without MPI");
}

#endif
