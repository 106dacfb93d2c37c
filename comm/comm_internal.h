// Private to comm/: the communicator struct both backends share, the MPI
// checked-call macros, and the index math of the hierarchical all-to-all
// (pure functions, tested without MPI in tests/test_comm.c).
#ifndef MOE_COMM_INTERNAL_H
#define MOE_COMM_INTERNAL_H

#include "moe/comm.h"
#include "moe/error.h"

#include <stdbool.h>
#include <stddef.h>
#ifdef MOE_HAVE_MPI
#include <mpi.h>
#endif

enum { MOE_COMM_TYPE_SLOTS = 4 };

struct moe_comm {
    int rank, size;
    int G;       // ranks per node in this communicator (1: no node structure)
    bool is_mpi; // false: the local communicator
    int node;    // this rank's node id (world rank / ranks_per_node, or the
                 // lowest world rank sharing its memory)
    moe_comm_stats stats;
    int *iw;          // [8 size + 8] counts and displacements of one call
    size_t *sw;       // [size] block offsets for moe_comm_block_transpose
    void *a2a_buf;    // staging of the hierarchical all-to-all
    size_t a2a_cap;   // bytes
    void *ar_buf;     // slices of the all-reduce; grows identically on every rank
    size_t ar_cap;    // bytes
    double timeout_s; // collective watchdog (0: off)
    long calls;       // collectives started on this communicator (names them in reports)
    bool broken;      // a collective timed out: the communicator cannot be used again
    int *world_of;    // [size] world rank of each rank (MPI)
    bool owns_watch;  // a world communicator: holds a reference to the watchdog channel
#ifdef MOE_HAVE_MPI
    MPI_Comm comm;  // owned duplicate / split
    MPI_Comm local; // ranks of this rank's node (size G), MPI_COMM_NULL unless 1 < G < size
    MPI_Comm cross; // ranks with this local index on every node (size N), idem
    // Contiguous types of elem_bytes[i] bytes (MPI_DATATYPE_NULL: a free slot);
    // a MoE layer alternates rows and counts, so a few are kept.
    MPI_Datatype elem[MOE_COMM_TYPE_SLOTS];
    size_t elem_bytes[MOE_COMM_TYPE_SLOTS];
    int elem_next; // slot to replace next
#endif
};

// Monotonic wall clock in seconds.
double moe_comm_now(void);
// Allocates the work arrays of a communicator of c->size ranks.
int moe_comm_alloc_work(moe_comm *c);
// Grows *buf to at least bytes (contents not kept). MOE_ENOMEM with a message.
int moe_comm_grow(void **buf, size_t *cap, size_t bytes, const char *what);

// G of a communicator from the node id of each of its size ranks: the common
// node size when every node's ranks are consecutive and nodes equally large,
// else 1.
int moe_comm_layout_ranks_per_node(const int *node_of, int size);

// Rearranges A x B blocks stored in row order [a][b] into column order
// [b][a]. Block (a, b) holds len[a * B + b] elements of es bytes (len NULL:
// one element each). work: [A * B] offsets, needed only with len.
void moe_comm_block_transpose(void *out, const void *in, const int *len, int A, int B, size_t es,
                              size_t *work);

// Sum of len elements of c->size rows in rank order: out[i] = ((row_0[i] +
// row_1[i]) + row_2[i]) + ...; rows[s] starts at rows + s * stride bytes.
typedef enum { MOE_AR_F32, MOE_AR_F64, MOE_AR_I64 } moe_ar_type;
void moe_comm_sum_rows(moe_ar_type t, void *out, const void *rows, int nrows, size_t len,
                       size_t stride);

// Checks a rank's counts: none negative, total <= INT_MAX. Returns 0 or
// MOE_EINVAL with a message naming what; *total gets the sum.
int moe_comm_check_counts(const int *counts, int n, const char *what, long *total);
// Checks the counts rank `rank` receives against its capacity; *total = sum.
int moe_comm_check_recv(const int *recv_counts, int n, int rank, size_t recv_cap, long *total);

// The copies, sends and receives of one variable all-to-all on a
// point-to-point transport (comm/a2a_schedule.c; NCCL runs them). Buffers:
// the caller's send and recv, and a staging buffer of *stage_bytes.
// Operations of one phase are independent; phases run in order. A send and a
// receive between two ranks in one phase pair up (one each per peer and phase).
typedef enum { MOE_A2A_BUF_SEND, MOE_A2A_BUF_RECV, MOE_A2A_BUF_STAGE } moe_a2a_buf;
enum { MOE_A2A_COPY, MOE_A2A_SEND, MOE_A2A_RECV };
typedef struct {
    int phase, kind, peer; // peer -1 for copies
    moe_a2a_buf src;       // copy and send
    size_t src_off;        // bytes
    moe_a2a_buf dst;       // copy and recv
    size_t dst_off, bytes;
} moe_a2a_op;
// Room for every schedule of P ranks.
static inline int moe_a2a_schedule_max_ops(int P) {
    return 4 * P + 4;
}
// C [P * P]: C[s * P + d] elements of es bytes from rank s to rank d.
// Hierarchical with G == 1 or G == P is flat. MOE_EINVAL on bad sizes.
int moe_a2a_schedule(moe_a2a_op *ops, int *n_ops, size_t *stage_bytes, const int *C, int P, int G,
                     int me, size_t es, bool hierarchical);

// Local backend (size 1).
int moe_comm_local_alltoallv(moe_comm *c, const void *send, const int *send_counts, void *recv,
                             int *recv_counts, size_t recv_cap, size_t elem_size);

// MPI backend; every function is defined (returning MOE_EINVAL) without MPI.
int moe_comm_mpi_split(moe_comm *c, int color, int key, moe_comm **out);
void moe_comm_mpi_free(moe_comm *c);
int moe_comm_mpi_agree(moe_comm *c, int status);
void moe_comm_mpi_abort(moe_comm *c, int code);
int moe_comm_mpi_bcast(moe_comm *c, void *buf, size_t bytes, int root);
int moe_comm_mpi_allgather(moe_comm *c, const void *send, void *recv, size_t bytes_each);
int moe_comm_mpi_barrier(moe_comm *c);
int moe_comm_mpi_alltoallv_flat(moe_comm *c, const void *send, const int *send_counts, void *recv,
                                int *recv_counts, size_t recv_cap, size_t elem_size);
int moe_comm_mpi_alltoallv_hier(moe_comm *c, const void *send, const int *send_counts, void *recv,
                                int *recv_counts, size_t recv_cap, size_t elem_size);
int moe_comm_mpi_allreduce(moe_comm *c, moe_ar_type t, void *buf, size_t n);

#ifdef MOE_HAVE_MPI
// Records "file:line: call: <MPI error string>" and returns MOE_EIO.
int moe_comm_mpi_fail(int mpi_rc, const char *call, const char *file, int line);
#define MPI_TRY(x)                                                                                 \
    do {                                                                                           \
        int mpi_rc_ = (x);                                                                         \
        if (mpi_rc_ != MPI_SUCCESS) return moe_comm_mpi_fail(mpi_rc_, #x, __FILE__, __LINE__);     \
    } while (0)
#define MPI_TRY_GOTO(x, rc)                                                                        \
    do {                                                                                           \
        int mpi_rc_ = (x);                                                                         \
        if (mpi_rc_ != MPI_SUCCESS) {                                                              \
            (rc) = moe_comm_mpi_fail(mpi_rc_, #x, __FILE__, __LINE__);                             \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)
// Waits for the nonblocking collective *req of c under the watchdog (c's
// timeout_s): MOE_EIO with the report when it does not complete in time or a
// peer reports a timeout. what names the collective ("all-reduce"). While
// waiting it answers the status queries of peers that timed out.
int moe_comm_mpi_wait(moe_comm *c, MPI_Request *req, const char *what);
int moe_comm_mpi_waitall(moe_comm *c, int n, MPI_Request *reqs, const char *what);
// Variable all-to-all over comm (c's, or its local/cross part) by
// point-to-point messages, waited for under c's watchdog: to each peer d,
// sc[d] elements of T (es bytes) from send + sd[d]; from each peer s, rc[s]
// into recv + rd[s]; the own block is copied. sc NULL: all-gather in place
// (each peer gets block rc[me] at rd[me] of recv). Used instead of
// MPI_Ialltoallv/MPI_Iallgatherv: Open MPI's libnbc lets their tags drift
// apart between ranks when one rank's part is empty, and the job hangs.
int moe_comm_mpi_exchange(moe_comm *c, MPI_Comm comm, const char *what, const void *send,
                          const int *sc, const int *sd, void *recv, const int *rc, const int *rd,
                          MPI_Datatype T, size_t es);
// Starts a nonblocking collective (`call`, which takes MOE_REQ as its request)
// and waits for it under the watchdog; returns the error upward.
#define MOE_REQ (&moe_req_)
#define MPI_COLL_TRY(c, what, call)                                                                \
    do {                                                                                           \
        MPI_Request moe_req_;                                                                      \
        int mpi_rc_ = (call);                                                                      \
        if (mpi_rc_ != MPI_SUCCESS) return moe_comm_mpi_fail(mpi_rc_, #call, __FILE__, __LINE__);  \
        MOE_TRY(moe_comm_mpi_wait((c), &moe_req_, (what)));                                        \
    } while (0)
#define MPI_COLL_TRY_GOTO(c, what, call, rc)                                                       \
    do {                                                                                           \
        MPI_Request moe_req_;                                                                      \
        int mpi_rc_ = (call);                                                                      \
        if (mpi_rc_ != MPI_SUCCESS) {                                                              \
            (rc) = moe_comm_mpi_fail(mpi_rc_, #call, __FILE__, __LINE__);                          \
            goto fail;                                                                             \
        }                                                                                          \
        MOE_TRY_GOTO(moe_comm_mpi_wait((c), &moe_req_, (what)), rc);                               \
    } while (0)
// The contiguous datatype of es bytes (cached in c, freed with it).
int moe_comm_mpi_elem_type(moe_comm *c, size_t es, MPI_Datatype *t);
#endif

#endif
