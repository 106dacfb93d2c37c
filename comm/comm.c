// The public communicator API: argument checks, dispatch to the local or MPI
// backend, timing and the stats counters (see moe/comm.h).
#include "comm/comm_internal.h"
#include "moe/error.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double moe_comm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int moe_comm_alloc_work(moe_comm *c) {
    c->iw = malloc((8 * (size_t)c->size + 8) * sizeof(int));
    c->sw = malloc((size_t)c->size * sizeof(size_t));
    if (!c->iw || !c->sw) return moe_fail(MOE_ENOMEM, "communicator of %d ranks", c->size);
    return 0;
}

int moe_comm_grow(void **buf, size_t *cap, size_t bytes, const char *what) {
    if (bytes == 0) bytes = 1; // a real buffer even for empty calls: no offsets from NULL
    if (bytes <= *cap) return 0;
    void *p = realloc(*buf, bytes);
    if (!p) return moe_fail(MOE_ENOMEM, "%s: %zu bytes of staging", what, bytes);
    *buf = p;
    *cap = bytes;
    return 0;
}

int moe_comm_check_counts(const int *counts, int n, const char *what, long *total) {
    long t = 0;
    for (int i = 0; i < n; i++) {
        if (counts[i] < 0)
            return moe_fail(MOE_EINVAL, "all-to-all: %s[%d] = %d is negative", what, i, counts[i]);
        t += counts[i];
    }
    *total = t;
    if (t > INT_MAX)
        return moe_fail(MOE_EINVAL, "all-to-all: %s total %ld elements exceeds INT_MAX", what, t);
    return 0;
}

int moe_comm_check_recv(const int *recv_counts, int n, int rank, size_t recv_cap, long *total) {
    long t = 0;
    for (int i = 0; i < n; i++) {
        if (recv_counts[i] < 0)
            return moe_fail(MOE_EINVAL, "all-to-all: rank %d sends %d elements to rank %d", i,
                            recv_counts[i], rank);
        t += recv_counts[i];
    }
    *total = t;
    if (t > INT_MAX || (size_t)t > recv_cap)
        return moe_fail(MOE_EINVAL,
                        "all-to-all: rank %d receives %ld elements, its buffer holds %zu", rank, t,
                        recv_cap);
    return 0;
}

int moe_comm_local(moe_comm **out) {
    *out = NULL;
    moe_comm *c = calloc(1, sizeof *c);
    if (!c) return moe_fail(MOE_ENOMEM, "local communicator");
    c->size = 1;
    c->G = 1;
    int rc = moe_comm_alloc_work(c);
    if (rc < 0) {
        moe_comm_free(c);
        return rc;
    }
    *out = c;
    return 0;
}

int moe_comm_split(moe_comm *c, int color, int key, moe_comm **out) {
    *out = NULL;
    if (c->is_mpi) return moe_comm_mpi_split(c, color, key, out); // checks color collectively
    if (color < 0) return moe_fail(MOE_EINVAL, "comm split: color %d is negative", color);
    return moe_comm_local(out);
}

void moe_comm_free(moe_comm *c) {
    if (!c) return;
    if (c->is_mpi) moe_comm_mpi_free(c);
    free(c->iw);
    free(c->sw);
    free(c->world_of);
    free(c->a2a_buf);
    free(c->ar_buf);
    free(c);
}

int moe_comm_rank(const moe_comm *c) {
    return c->rank;
}
int moe_comm_size(const moe_comm *c) {
    return c->size;
}
int moe_comm_ranks_per_node(const moe_comm *c) {
    return c->G;
}

int moe_comm_alltoallv(moe_comm *c, moe_a2a_algo algo, const void *send, const int *send_counts,
                       void *recv, int *recv_counts, size_t recv_cap, size_t elem_size) {
    if (algo != MOE_A2A_FLAT && algo != MOE_A2A_HIERARCHICAL)
        return moe_fail(MOE_EINVAL, "all-to-all: unknown algorithm %d", (int)algo);
    if (elem_size == 0 || elem_size > INT_MAX)
        return moe_fail(MOE_EINVAL, "all-to-all: element size %zu", elem_size);
    double t0 = moe_comm_now();
    int rc;
    if (!c->is_mpi)
        rc = moe_comm_local_alltoallv(c, send, send_counts, recv, recv_counts, recv_cap, elem_size);
    else if (algo == MOE_A2A_HIERARCHICAL && c->G > 1 && c->G < c->size)
        rc = moe_comm_mpi_alltoallv_hier(c, send, send_counts, recv, recv_counts, recv_cap,
                                         elem_size);
    else
        rc = moe_comm_mpi_alltoallv_flat(c, send, send_counts, recv, recv_counts, recv_cap,
                                         elem_size);
    c->stats.a2a_calls++;
    c->stats.t_alltoall += moe_comm_now() - t0;
    return rc;
}

static int allreduce(moe_comm *c, moe_ar_type t, void *buf, size_t n) {
    double t0 = moe_comm_now();
    int rc = c->is_mpi && n > 0 ? moe_comm_mpi_allreduce(c, t, buf, n) : 0;
    c->stats.allreduce_calls++;
    c->stats.t_allreduce += moe_comm_now() - t0;
    return rc;
}

int moe_comm_allreduce_f32(moe_comm *c, float *buf, size_t n) {
    return allreduce(c, MOE_AR_F32, buf, n);
}
int moe_comm_allreduce_f64(moe_comm *c, double *buf, size_t n) {
    return allreduce(c, MOE_AR_F64, buf, n);
}
int moe_comm_allreduce_i64(moe_comm *c, int64_t *buf, size_t n) {
    return allreduce(c, MOE_AR_I64, buf, n);
}

int moe_comm_bcast(moe_comm *c, void *buf, size_t bytes, int root) {
    if (root < 0 || root >= c->size)
        return moe_fail(MOE_EINVAL, "broadcast: root %d not in [0, %d)", root, c->size);
    return c->is_mpi ? moe_comm_mpi_bcast(c, buf, bytes, root) : 0;
}

int moe_comm_allgather(moe_comm *c, const void *send, void *recv, size_t bytes_each) {
    if (bytes_each > INT_MAX)
        return moe_fail(MOE_EINVAL, "all-gather: %zu bytes per rank exceeds INT_MAX", bytes_each);
    if (c->is_mpi) return moe_comm_mpi_allgather(c, send, recv, bytes_each);
    if (bytes_each) memmove(recv, send, bytes_each);
    return 0;
}

int moe_comm_barrier(moe_comm *c) {
    return c->is_mpi ? moe_comm_mpi_barrier(c) : 0;
}

int moe_comm_set_timeout(moe_comm *c, double seconds) {
    if (!isfinite(seconds) || seconds < 0)
        return moe_fail(MOE_EINVAL, "comm.timeout_s = %g: expected seconds >= 0 (0: no timeout)",
                        seconds);
    c->timeout_s = seconds;
    return 0;
}

int moe_comm_agree(moe_comm *c, int status) {
    return c->is_mpi ? moe_comm_mpi_agree(c, status) : status;
}

void moe_comm_abort(moe_comm *c, int code) {
    if (c->is_mpi) moe_comm_mpi_abort(c, code);
}

void moe_comm_stats_get(const moe_comm *c, moe_comm_stats *s) {
    *s = c->stats;
}

void moe_comm_stats_reset(moe_comm *c) {
    memset(&c->stats, 0, sizeof c->stats);
}
