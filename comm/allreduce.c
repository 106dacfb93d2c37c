// Deterministic all-reduce: every element is summed in rank order,
// ((x_0 + x_1) + x_2) + ..., so the bits are the same on every rank and equal
// a single process adding the same buffers (MPI_Allreduce promises neither).
// Small buffers are all-gathered and summed everywhere; large ones are
// reduce-scattered (rank r sums slice r) and all-gathered, the bandwidth-
// optimal pattern (each rank sends about 2 (P-1)/P of the buffer).
#include "comm/comm_internal.h"
#include "moe/error.h"

#include <stdlib.h>
#include <string.h>

void moe_comm_sum_rows(moe_ar_type t, void *out, const void *rows, int nrows, size_t len,
                       size_t stride) {
    const char *r = rows;
    if (t == MOE_AR_F32) {
        float *o = out;
        memmove(o, r, len * sizeof(float));
        for (int s = 1; s < nrows; s++) {
            const float *x = (const float *)(r + s * stride);
            for (size_t i = 0; i < len; i++)
                o[i] += x[i];
        }
    } else if (t == MOE_AR_F64) {
        double *o = out;
        memmove(o, r, len * sizeof(double));
        for (int s = 1; s < nrows; s++) {
            const double *x = (const double *)(r + s * stride);
            for (size_t i = 0; i < len; i++)
                o[i] += x[i];
        }
    } else { // unsigned: wraps instead of overflowing
        uint64_t *o = out;
        memmove(o, r, len * sizeof(uint64_t));
        for (int s = 1; s < nrows; s++) {
            const uint64_t *x = (const uint64_t *)(r + s * stride);
            for (size_t i = 0; i < len; i++)
                o[i] += x[i];
        }
    }
}

// Slice of rank r in a segment of m elements over P ranks: [lo(r), lo(r+1)).
static size_t slice_lo(size_t m, int r, int P) {
    return m * (size_t)r / (size_t)P;
}

int moe_comm_allreduce_predict(int size, int rank, size_t n, size_t elem_size, long *bytes) {
    if (size < 1 || rank < 0 || rank >= size)
        return moe_fail(MOE_EINVAL, "all-reduce predict: rank %d of %d", rank, size);
    size_t P = (size_t)size, b = 0;
    if (size == 1) {
        b = 0;
    } else if (n * elem_size * P <= MOE_COMM_AR_GATHER_BYTES) {
        b = n * elem_size * (P - 1);
    } else {
        for (size_t o = 0; o < n; o += MOE_COMM_AR_SEGMENT) {
            size_t m = n - o < MOE_COMM_AR_SEGMENT ? n - o : MOE_COMM_AR_SEGMENT;
            size_t s = slice_lo(m, rank + 1, size) - slice_lo(m, rank, size);
            b += elem_size * (m - s + (P - 1) * s);
        }
    }
    *bytes = (long)b;
    return 0;
}

#ifdef MOE_HAVE_MPI

static size_t type_size(moe_ar_type t) {
    return t == MOE_AR_F32 ? sizeof(float) : t == MOE_AR_F64 ? sizeof(double) : sizeof(int64_t);
}

static MPI_Datatype mpi_type(moe_ar_type t) {
    return t == MOE_AR_F32 ? MPI_FLOAT : t == MOE_AR_F64 ? MPI_DOUBLE : MPI_INT64_T;
}

// The largest staging any call of n elements needs; a function of (n, P, es)
// only, so every rank grows ar_buf at the same calls and can agree on an
// allocation failure without an extra collective in the common case.
static size_t staging_bytes(size_t n, int P, size_t es) {
    if (n * es * (size_t)P <= MOE_COMM_AR_GATHER_BYTES) return n * es * (size_t)P;
    size_t m = n < MOE_COMM_AR_SEGMENT ? n : MOE_COMM_AR_SEGMENT;
    return ((m + (size_t)P - 1) / (size_t)P) * (size_t)P * es;
}

int moe_comm_mpi_allreduce(moe_comm *c, moe_ar_type t, void *buf, size_t n) {
    const int P = c->size, me = c->rank;
    const size_t es = type_size(t);
    if (P == 1) return 0;
    size_t need = staging_bytes(n, P, es);
    if (need > c->ar_cap) {
        int rc = moe_comm_mpi_agree(c, moe_comm_grow(&c->ar_buf, &c->ar_cap, need, "all-reduce"));
        if (rc < 0) { // keep the capacity the same on every rank
            free(c->ar_buf);
            c->ar_buf = NULL, c->ar_cap = 0;
            return rc;
        }
    }
    MPI_Datatype T = mpi_type(t);
    char *x = buf;
    if (n * es * (size_t)P <= MOE_COMM_AR_GATHER_BYTES) {
        MPI_COLL_TRY(c, "all-reduce",
                     MPI_Iallgather(x, (int)n, T, c->ar_buf, (int)n, T, c->comm, MOE_REQ));
        moe_comm_sum_rows(t, x, c->ar_buf, P, n, n * es);
        c->stats.allreduce_bytes_sent += (long)(n * es * (size_t)(P - 1));
        return 0;
    }
    int *len = c->iw, *lo = c->iw + P, *rlen = c->iw + 2 * P, *rlo = c->iw + 3 * P;
    for (size_t o = 0; o < n; o += MOE_COMM_AR_SEGMENT) {
        size_t m = n - o < MOE_COMM_AR_SEGMENT ? n - o : MOE_COMM_AR_SEGMENT;
        for (int r = 0; r < P; r++) {
            lo[r] = (int)slice_lo(m, r, P);
            len[r] = (int)(slice_lo(m, r + 1, P) - slice_lo(m, r, P));
        }
        // Reduce-scatter: slice me of every rank arrives as row s of ar_buf.
        for (int s = 0; s < P; s++)
            rlen[s] = len[me], rlo[s] = s * len[me];
        char *seg = x + o * es;
        MOE_TRY(moe_comm_mpi_exchange(c, c->comm, "all-reduce (reduce-scatter)", seg, len, lo,
                                      c->ar_buf, rlen, rlo, T, es));
        moe_comm_sum_rows(t, seg + (size_t)lo[me] * es, c->ar_buf, P, (size_t)len[me],
                          (size_t)len[me] * es);
        MOE_TRY(moe_comm_mpi_exchange(c, c->comm, "all-reduce (all-gather)", seg, NULL, NULL, seg,
                                      len, lo, T, es));
        c->stats.allreduce_bytes_sent +=
            (long)(es * (m - (size_t)len[me] + (size_t)(P - 1) * (size_t)len[me]));
    }
    return 0;
}

#else

int moe_comm_mpi_allreduce(moe_comm *c, moe_ar_type t, void *buf, size_t n) {
    (void)c, (void)t, (void)buf, (void)n;
    return moe_fail(MOE_EINVAL, "all-reduce: built without MPI");
}

#endif
