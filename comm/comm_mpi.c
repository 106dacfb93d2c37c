// The MPI communicator: world and split construction (node of every rank,
// the intra-node and cross-node sub-communicators the hierarchical
// all-to-all uses), error agreement, abort, broadcast, all-gather, barrier.
// Communicators return MPI errors (MPI_ERRORS_RETURN) so that MPI_TRY can
// report them with the MPI error string; without MPI every entry point
// returns MOE_EINVAL ("built without MPI").
#include "comm/comm_internal.h"
#include "moe/error.h"

#ifdef MOE_HAVE_MPI

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MSG_BYTES = 512 }; // moe_last_error()'s capacity

int moe_comm_mpi_fail(int mpi_rc, const char *call, const char *file, int line) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(mpi_rc, s, &len) != MPI_SUCCESS)
        snprintf(s, sizeof s, "MPI error %d", mpi_rc);
    // "comm/alltoall_flat.c:42: MPI_Alltoallv: <string>": the last two path
    // components and the called function's name.
    const char *f = file + strlen(file);
    for (int slashes = 0; f > file; f--)
        if (f[-1] == '/' && ++slashes == 2) break;
    return moe_fail(MOE_EIO, "%s:%d: %.*s: %s", f, line, (int)strcspn(call, "("), call, s);
}

int moe_comm_mpi_elem_type(moe_comm *c, size_t es, MPI_Datatype *t) {
    for (int i = 0; i < MOE_COMM_TYPE_SLOTS; i++)
        if (c->elem[i] != MPI_DATATYPE_NULL && c->elem_bytes[i] == es) {
            *t = c->elem[i];
            return 0;
        }
    int i = c->elem_next;
    c->elem_next = (i + 1) % MOE_COMM_TYPE_SLOTS;
    if (c->elem[i] != MPI_DATATYPE_NULL) MPI_Type_free(&c->elem[i]);
    c->elem[i] = MPI_DATATYPE_NULL;
    MPI_Datatype e;
    MPI_TRY(MPI_Type_contiguous((int)es, MPI_BYTE, &e));
    MPI_TRY(MPI_Type_commit(&e));
    c->elem[i] = e;
    c->elem_bytes[i] = es;
    *t = e;
    return 0;
}

// The first failing rank's status and message, on every rank of comm: one
// small all-reduce when all is well, a broadcast of the message otherwise.
static int agree_on(MPI_Comm comm, int rank, int size, int status) {
    int mine = status ? rank : size, first = size;
    MPI_TRY(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm));
    if (first == size) return 0;
    struct {
        int code;
        char msg[MSG_BYTES];
    } m;
    memset(&m, 0, sizeof m);
    if (rank == first) {
        m.code = status;
        snprintf(m.msg, sizeof m.msg, "%s", moe_last_error());
    }
    MPI_TRY(MPI_Bcast(&m, (int)sizeof m, MPI_BYTE, first, comm));
    if (rank != first) moe_fail(m.code, "%s", m.msg);
    return m.code;
}

int moe_comm_mpi_agree(moe_comm *c, int status) {
    return agree_on(c->comm, c->rank, c->size, status);
}

// Takes ownership of comm (every rank of it calls this): ranks, node ids,
// G, and the sub-communicators of the hierarchical all-to-all.
static int make(moe_comm **out, MPI_Comm comm, int node) {
    int rc = 0, rank, size;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    moe_comm *c = calloc(1, sizeof *c);
    rc = agree_on(comm, rank, size, c ? 0 : moe_fail(MOE_ENOMEM, "communicator"));
    if (rc < 0) {
        free(c);
        MPI_Comm_free(&comm);
        return rc;
    }
    c->is_mpi = true;
    c->comm = comm;
    c->local = c->cross = MPI_COMM_NULL;
    for (int i = 0; i < MOE_COMM_TYPE_SLOTS; i++)
        c->elem[i] = MPI_DATATYPE_NULL;
    c->rank = rank;
    c->size = size;
    c->node = node;
    MOE_TRY_GOTO(agree_on(comm, rank, size, moe_comm_alloc_work(c)), rc);
    MPI_TRY_GOTO(MPI_Allgather(&node, 1, MPI_INT, c->iw, 1, MPI_INT, comm), rc);
    c->G = moe_comm_layout_ranks_per_node(c->iw, size);
    if (c->G > 1 && c->G < size) {
        MPI_TRY_GOTO(MPI_Comm_split(comm, rank / c->G, rank, &c->local), rc);
        MPI_TRY_GOTO(MPI_Comm_split(comm, rank % c->G, rank, &c->cross), rc);
    }
    *out = c;
    return 0;
fail:
    moe_comm_free(c);
    return rc;
}

// A node: the ranks sharing memory with this one, named by its lowest rank.
static int shared_node(MPI_Comm comm, int rank, int *node) {
    MPI_Comm shm;
    MPI_TRY(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shm));
    int rc = MPI_Allreduce(&rank, node, 1, MPI_INT, MPI_MIN, shm);
    MPI_Comm_free(&shm);
    MPI_TRY(rc);
    return 0;
}

int moe_comm_mpi_world(moe_comm **out, int ranks_per_node) {
    *out = NULL;
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin)
        return moe_fail(MOE_EINVAL, "MPI communicator: MPI is not initialised (call MPI_Init)");
    if (ranks_per_node < 0)
        return moe_fail(MOE_EINVAL, "comm.ranks_per_node = %d is negative", ranks_per_node);
    MPI_Comm comm;
    MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    int rank, size, node = 0, rc = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    if (ranks_per_node > 0 && size % ranks_per_node)
        rc = moe_fail(MOE_EINVAL, "comm.ranks_per_node = %d does not divide the %d ranks",
                      ranks_per_node, size);
    else if (ranks_per_node > 0)
        node = rank / ranks_per_node;
    else
        rc = shared_node(comm, rank, &node);
    if (rc < 0) {
        MPI_Comm_free(&comm);
        return rc;
    }
    return make(out, comm, node);
}

int moe_comm_mpi_split(moe_comm *c, int color, int key, moe_comm **out) {
    MPI_Comm nc;
    MPI_TRY(MPI_Comm_split(c->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc));
    if (color < 0) return moe_fail(MOE_EINVAL, "comm split: color %d is negative", color);
    return make(out, nc, c->node);
}

void moe_comm_mpi_free(moe_comm *c) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return; // too late to free; the MPI library released everything
    for (int i = 0; i < MOE_COMM_TYPE_SLOTS; i++)
        if (c->elem[i] != MPI_DATATYPE_NULL) MPI_Type_free(&c->elem[i]);
    if (c->local != MPI_COMM_NULL) MPI_Comm_free(&c->local);
    if (c->cross != MPI_COMM_NULL) MPI_Comm_free(&c->cross);
    if (c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
}

void moe_comm_mpi_abort(moe_comm *c, int code) {
    MPI_Abort(c->comm, code);
}

int moe_comm_mpi_bcast(moe_comm *c, void *buf, size_t bytes, int root) {
    for (size_t o = 0; o < bytes; o += 1u << 30) {
        size_t n = bytes - o < (1u << 30) ? bytes - o : (1u << 30);
        MPI_TRY(MPI_Bcast((char *)buf + o, (int)n, MPI_BYTE, root, c->comm));
    }
    return 0;
}

int moe_comm_mpi_allgather(moe_comm *c, const void *send, void *recv, size_t bytes_each) {
    const void *s = send == (char *)recv + (size_t)c->rank * bytes_each ? MPI_IN_PLACE : send;
    MPI_TRY(MPI_Allgather(s, (int)bytes_each, MPI_BYTE, recv, (int)bytes_each, MPI_BYTE, c->comm));
    return 0;
}

int moe_comm_mpi_barrier(moe_comm *c) {
    MPI_TRY(MPI_Barrier(c->comm));
    return 0;
}

#else // built without MPI

static int no_mpi(const char *what) {
    return moe_fail(MOE_EINVAL, "%s: moe was built without MPI (install libopenmpi-dev, rebuild)",
                    what);
}

int moe_comm_mpi_world(moe_comm **out, int ranks_per_node) {
    (void)ranks_per_node;
    *out = NULL;
    return no_mpi("MPI communicator");
}
int moe_comm_mpi_split(moe_comm *c, int color, int key, moe_comm **out) {
    (void)c, (void)color, (void)key;
    *out = NULL;
    return no_mpi("comm split");
}
void moe_comm_mpi_free(moe_comm *c) {
    (void)c;
}
int moe_comm_mpi_agree(moe_comm *c, int status) {
    (void)c;
    return status;
}
void moe_comm_mpi_abort(moe_comm *c, int code) {
    (void)c, (void)code;
}
int moe_comm_mpi_bcast(moe_comm *c, void *buf, size_t bytes, int root) {
    (void)c, (void)buf, (void)bytes, (void)root;
    return no_mpi("broadcast");
}
int moe_comm_mpi_allgather(moe_comm *c, const void *send, void *recv, size_t bytes_each) {
    (void)c, (void)send, (void)recv, (void)bytes_each;
    return no_mpi("all-gather");
}
int moe_comm_mpi_barrier(moe_comm *c) {
    (void)c;
    return no_mpi("barrier");
}

#endif
