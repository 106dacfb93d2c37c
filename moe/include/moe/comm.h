// Communicators: a local one (one process, every op a copy) and one over MPI.
// Variable all-to-all, flat or hierarchical (DeepSpeed-MoE arXiv 2201.05596
// §5, Tutel arXiv 2206.03382 "2DH"); all-reduce summed in rank order, so the
// bits are the same on every rank and for every grid; error agreement; and
// the traffic model that `moe plan` uses (it reproduces the stats exactly).
//
// Collectives are called by every rank of the communicator with the same
// algo, elem_size, n, root and bytes (programming errors otherwise: MPI
// would hang or mismatch). Data errors (negative counts, a receive buffer too
// small, out of memory) are agreed inside the op: every rank returns the
// same code, so no rank is left waiting. An MPI error returns MOE_EIO with
// "file:line: MPI_Call: <MPI_Error_string>"; peers may then be waiting in
// the collective, so the caller ends the job with moe_comm_abort unless it
// agrees the status first (DESIGN: "a failed rank aborts the job").
#ifndef MOE_COMM_H
#define MOE_COMM_H

#include <stddef.h>
#include <stdint.h>

typedef struct moe_comm moe_comm; // opaque

typedef enum { MOE_A2A_FLAT = 0, MOE_A2A_HIERARCHICAL } moe_a2a_algo;

// Cumulative counters of one communicator (moe_comm_stats_reset zeroes them).
// Traffic is the logical payload of the algorithm, counted from the sizes it
// hands to MPI and reproducible from counts alone (moe_comm_a2a_predict,
// moe_comm_allreduce_predict):
//  - bytes_sent, msgs_sent: all-to-all payload only. A message is a non-empty
//    payload transfer to another rank: flat sends one per peer it has rows
//    for; hierarchical one per step-1 local peer and per step-2 node peer
//    whose aggregated block is non-empty. Self-copies and empty blocks are not
//    counted, nor is the count exchange that precedes every payload (flat:
//    P-1 messages of 4 bytes; hierarchical: G-1 of 4N bytes, then N-1 of 4G).
//  - allreduce_bytes_sent: all-reduce payload (reduce-scatter + all-gather,
//    or the all-gather of small buffers), to other ranks.
// The local communicator sends nothing: its bytes and messages stay 0.
typedef struct {
    long bytes_sent;
    long msgs_sent;
    long a2a_calls, allreduce_calls;
    double t_alltoall, t_allreduce; // seconds, wall clock inside the ops
    long allreduce_bytes_sent;
    // The part of bytes_sent that went to ranks on other nodes (flat: rows
    // for ranks of other nodes; hierarchical: step 2). With no usable node
    // structure (moe_comm_ranks_per_node 1) every peer counts as another node.
    long bytes_inter;
} moe_comm_stats;

// All-reduce algorithm constants (the predictions depend on them). A buffer
// with n * elem_size * size <= MOE_COMM_AR_GATHER_BYTES is all-gathered and
// summed on every rank; larger ones are cut into segments of
// MOE_COMM_AR_SEGMENT elements, each reduce-scattered (rank r sums slice
// [m*r/P, m*(r+1)/P) of an m-element segment, in rank order) and all-gathered.
enum { MOE_COMM_AR_GATHER_BYTES = 65536, MOE_COMM_AR_SEGMENT = 1 << 22 };

// Size 1, rank 0: every op is a copy (or nothing); no MPI needed.
int moe_comm_local(moe_comm **out);
// Wraps (a duplicate of) MPI_COMM_WORLD; the caller did MPI_Init and calls
// MPI_Finalize after moe_comm_free. ranks_per_node 0: nodes are the groups of
// ranks sharing memory (MPI_COMM_TYPE_SHARED); > 0 simulates nodes of that
// many consecutive ranks (size % ranks_per_node must be 0). MOE_EINVAL when
// built without MPI.
int moe_comm_mpi_world(moe_comm **out, int ranks_per_node);
// Sub-communicator of the ranks passing the same color (>= 0), ordered by
// key then parent rank (MPI_Comm_split). Collective over c. Ranks keep the
// node they had in the world. The local communicator splits into another.
int moe_comm_split(moe_comm *c, int color, int key, moe_comm **out);
void moe_comm_free(moe_comm *c); // NULL is fine; before MPI_Finalize
int moe_comm_rank(const moe_comm *c);
int moe_comm_size(const moe_comm *c);
// G: ranks of this communicator per node. When every node holds the same
// number of its ranks, consecutive in rank order, that number; otherwise 1
// (no usable node structure: hierarchical then runs as flat).
int moe_comm_ranks_per_node(const moe_comm *c);

// Variable all-to-all of elements of elem_size bytes. send holds, in rank
// order, send_counts[r] elements for rank r. Counts are exchanged first
// (recv_counts[r] = what rank r sends here), then the payload into recv, in
// source-rank order. recv_cap is recv's capacity in elements; if some rank's
// total exceeds its capacity (or a count is negative, or a total exceeds
// INT_MAX elements) every rank returns MOE_EINVAL with that rank's message.
// Flat and hierarchical deliver the same recv and recv_counts. Hierarchical
// with G == 1 or G == size is flat.
int moe_comm_alltoallv(moe_comm *c, moe_a2a_algo algo, const void *send, const int *send_counts,
                       void *recv, int *recv_counts, size_t recv_cap, size_t elem_size);

// In-place sum over all ranks, result on every rank, element by element
// equal to ((x_0 + x_1) + x_2) + ... in rank order (bit-identical on every
// rank and to a single process adding the same buffers in that order). The
// integer sum is exact (wraps modulo 2^64 on overflow).
int moe_comm_allreduce_f32(moe_comm *c, float *buf, size_t n);
int moe_comm_allreduce_f64(moe_comm *c, double *buf, size_t n);
int moe_comm_allreduce_i64(moe_comm *c, int64_t *buf, size_t n);
int moe_comm_bcast(moe_comm *c, void *buf, size_t bytes, int root);
// recv = concatenation over ranks of bytes_each bytes (send may be recv's own
// slot, recv + rank * bytes_each). bytes_each <= INT_MAX.
int moe_comm_allgather(moe_comm *c, const void *send, void *recv, size_t bytes_each);
int moe_comm_barrier(moe_comm *c);

// Collective watchdog (like NCCL's): an MPI collective of c that does not
// complete within `seconds` (comm.timeout_s; 0, the default, waits forever)
// returns MOE_EIO on every live rank, with a message naming the collective,
// the ranks that did not answer (a stopped, deadlocked or livelocked rank) and
// where the others wait. Live ranks learn of the first timeout from each other,
// so they all report. Afterwards the communicator is unusable (every call fails
// at once): the caller ends the job with moe_comm_abort. Splits made later
// inherit the timeout; the local communicator ignores it. MOE_EINVAL on a
// negative or non-finite value.
int moe_comm_set_timeout(moe_comm *c, double seconds);

// Error agreement: every rank passes its local status; all return the status
// of the lowest rank whose status is non-zero (0 if none), and that rank's
// moe_last_error() message becomes the message on every rank. Lets an invalid
// config on one rank end the whole job cleanly.
int moe_comm_agree(moe_comm *c, int status);
// MPI: MPI_Abort(code) on the communicator, ending every rank of the job;
// does not return. Local: returns at once (the library never exits; the
// caller returns its exit code).
void moe_comm_abort(moe_comm *c, int code);

void moe_comm_stats_get(const moe_comm *c, moe_comm_stats *s);
void moe_comm_stats_reset(moe_comm *c);

// The all-to-all traffic of `rank` in one call, as the stats count it.
// counts[s * size + d] = elements rank s sends to rank d; ranks_per_node is
// G of the communicator (moe_comm_ranks_per_node). With N = size / G, rank
// r = n G + l:
//   flat:          bytes = es * sum_{d != r} C[r][d],       msgs = #{d != r : C[r][d] > 0}
//   hierarchical:  step 1, to local peer l' != l: S1 = sum_m C[r][m G + l']
//                  step 2, to node m != n:        S2 = sum_j C[n G + j][m G + l]
//                  bytes = es * (sum S1 + sum S2), msgs = #{S1 > 0} + #{S2 > 0}
// (hierarchical with G == 1 or G == size is flat; the formulas agree).
// MOE_EINVAL on a negative count or size % ranks_per_node != 0.
int moe_comm_a2a_predict(int size, int ranks_per_node, moe_a2a_algo algo, const int *counts,
                         size_t elem_size, int rank, long *bytes, long *msgs);
// The all-reduce bytes `rank` sends in one call of n elements of elem_size:
// gathered: es n (P-1); otherwise per segment of m elements, with
// s = |slice of rank| = floor(m(r+1)/P) - floor(m r/P): es (m - s + (P-1) s).
int moe_comm_allreduce_predict(int size, int rank, size_t n, size_t elem_size, long *bytes);

#endif
