// NCCL communicator (moe/comm_nccl.h): unique id over the host communicator,
// all-to-all as grouped ncclSend/ncclRecv (flat: one send and one receive per
// peer; hierarchical: the two steps and block transposes of
// comm/alltoall_hier.c with device copies), all-reduce with ncclAllReduce.
// The full count matrix is all-gathered over the host communicator, so every
// rank derives the sizes of both hierarchical steps locally.
#include "moe/comm_nccl.h"
#include "moe/error.h"

#ifdef MOE_HAVE_NCCL

#include <cuda_runtime_api.h>
#include <limits.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_TRY(x)                                                                                \
    do {                                                                                           \
        cudaError_t cu_e_ = (x);                                                                   \
        if (cu_e_ != cudaSuccess)                                                                  \
            return moe_fail(MOE_EDEVICE, "%s:%d: %s: %s", __FILE__, __LINE__, #x,                  \
                            cudaGetErrorString(cu_e_));                                            \
    } while (0)

#define NCCL_TRY(x)                                                                                \
    do {                                                                                           \
        ncclResult_t nc_r_ = (x);                                                                  \
        if (nc_r_ != ncclSuccess)                                                                  \
            return moe_fail(MOE_EDEVICE, "%s:%d: %s: %s", __FILE__, __LINE__, #x,                  \
                            ncclGetErrorString(nc_r_));                                            \
    } while (0)

struct moe_nccl_comm {
    moe_comm *host;
    ncclComm_t nccl;
    int rank, size, G, device;
    cudaStream_t a2a, ar;            // communication streams
    cudaEvent_t ready, done_a2a, done_ar;
    int *C;                          // [size * size] count matrix of one call
    size_t *displ;                   // [size + 1] work offsets
    char *stage;                     // device staging of the hierarchical all-to-all
    size_t stage_cap;                // bytes
};

int moe_nccl_comm_init(moe_nccl_comm **out, moe_comm *host, int device) {
    *out = NULL;
    moe_nccl_comm *c = calloc(1, sizeof *c);
    if (!c) return moe_fail(MOE_ENOMEM, "NCCL communicator");
    c->host = host;
    c->rank = moe_comm_rank(host);
    c->size = moe_comm_size(host);
    c->G = moe_comm_ranks_per_node(host);
    c->device = device;
    int rc = 0;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    int status = 0;
    if (cudaSetDevice(device) != cudaSuccess)
        status = moe_fail(MOE_EDEVICE, "rank %d: cudaSetDevice(%d) failed", c->rank, device);
    else if (c->rank == 0 && ncclGetUniqueId(&id) != ncclSuccess)
        status = moe_fail(MOE_EDEVICE, "ncclGetUniqueId failed");
    MOE_TRY_GOTO(moe_comm_agree(host, status), rc);
    MOE_TRY_GOTO(moe_comm_bcast(host, &id, sizeof id, 0), rc);
    ncclResult_t nr = ncclCommInitRank(&c->nccl, c->size, id, c->rank);
    if (nr != ncclSuccess) {
        c->nccl = NULL;
        status = moe_fail(MOE_EDEVICE, "rank %d: ncclCommInitRank on device %d: %s", c->rank,
                          device, ncclGetErrorString(nr));
    }
    MOE_TRY_GOTO(moe_comm_agree(host, status), rc);
    c->C = malloc(sizeof(int) * (size_t)c->size * c->size);
    c->displ = malloc(sizeof(size_t) * ((size_t)c->size + 1));
    if (!c->C || !c->displ) {
        rc = moe_fail(MOE_ENOMEM, "NCCL communicator of %d ranks", c->size);
        goto fail;
    }
    if (cudaStreamCreateWithFlags(&c->a2a, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&c->ar, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&c->done_a2a, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&c->done_ar, cudaEventDisableTiming) != cudaSuccess) {
        rc = moe_fail(MOE_EDEVICE, "NCCL communicator: creating streams and events failed");
        goto fail;
    }
    *out = c;
    return 0;
fail:
    moe_nccl_comm_free(c);
    return rc;
}

void moe_nccl_comm_free(moe_nccl_comm *c) {
    if (!c) return;
    if (c->a2a) cudaStreamSynchronize(c->a2a);
    if (c->ar) cudaStreamSynchronize(c->ar);
    if (c->nccl) ncclCommDestroy(c->nccl);
    if (c->a2a) cudaStreamDestroy(c->a2a);
    if (c->ar) cudaStreamDestroy(c->ar);
    if (c->ready) cudaEventDestroy(c->ready);
    if (c->done_a2a) cudaEventDestroy(c->done_a2a);
    if (c->done_ar) cudaEventDestroy(c->done_ar);
    if (c->stage) cudaFree(c->stage);
    free(c->C);
    free(c->displ);
    free(c);
}

// comm waits for the work queued on the caller's stream so far.
static int follow(moe_nccl_comm *c, cudaStream_t caller, cudaStream_t comm) {
    CUDA_TRY(cudaEventRecord(c->ready, caller));
    CUDA_TRY(cudaStreamWaitEvent(comm, c->ready, 0));
    return 0;
}

// The caller's stream waits for the op queued on comm.
static int join(cudaEvent_t done, cudaStream_t comm, cudaStream_t caller) {
    CUDA_TRY(cudaEventRecord(done, comm));
    CUDA_TRY(cudaStreamWaitEvent(caller, done, 0));
    return 0;
}

static int grow_stage(moe_nccl_comm *c, size_t bytes) {
    if (bytes <= c->stage_cap) return 0;
    if (c->stage) {
        CUDA_TRY(cudaStreamSynchronize(c->a2a)); // the old staging may still be in use
        cudaFree(c->stage);
        c->stage = NULL, c->stage_cap = 0;
    }
    cudaError_t e = cudaMalloc((void **)&c->stage, bytes);
    if (e != cudaSuccess) {
        c->stage = NULL;
        return moe_fail(e == cudaErrorMemoryAllocation ? MOE_ENOMEM : MOE_EDEVICE,
                        "hierarchical all-to-all: %zu bytes of device staging: %s", bytes,
                        cudaGetErrorString(e));
    }
    c->stage_cap = bytes;
    return 0;
}

// Rows of elem_size bytes from `from` to `to` (skipped when empty). A
// self-block is a device copy: no NCCL message to oneself.
static int exchange(moe_nccl_comm *c, const char *sbuf, size_t sbytes, char *rbuf, size_t rbytes,
                    int peer) {
    if (peer == c->rank) {
        if (sbytes) CUDA_TRY(cudaMemcpyAsync(rbuf, sbuf, sbytes, cudaMemcpyDeviceToDevice, c->a2a));
        return 0;
    }
    if (sbytes) NCCL_TRY(ncclSend(sbuf, sbytes, ncclChar, peer, c->nccl, c->a2a));
    if (rbytes) NCCL_TRY(ncclRecv(rbuf, rbytes, ncclChar, peer, c->nccl, c->a2a));
    return 0;
}

// Flat: send block d to rank d, receive block s from rank s (source order).
static int a2a_flat(moe_nccl_comm *c, const char *send, char *recv, size_t es) {
    const int P = c->size, me = c->rank;
    const int *C = c->C;
    size_t soff = 0, roff = 0;
    int rc = 0;
    NCCL_TRY(ncclGroupStart());
    for (int p = 0; p < P && !rc; p++) {
        size_t sb = (size_t)C[me * P + p] * es, rb = (size_t)C[p * P + me] * es;
        rc = exchange(c, send + soff, sb, recv + roff, rb, p);
        soff += sb, roff += rb;
    }
    ncclResult_t nr = ncclGroupEnd();
    MOE_TRY(rc);
    NCCL_TRY(nr);
    return 0;
}

// Hierarchical, ranks r = n G + l on N nodes (layouts as comm/alltoall_hier.c):
//   step 1, local peer l': pack[l'] = blocks send[(m, l')] over m; receive
//           fwd[j] = blocks C[(n, j)][(m, l)] over m from local peer j
//   step 2, node m: fwd2[m] = blocks fwd[j][m] over j, to rank (m, l); receive
//           from rank (m, l) the blocks C[(m, j)][me] over j: recv in source order
static int a2a_hier(moe_nccl_comm *c, const char *send, char *recv, size_t es) {
    const int P = c->size, G = c->G, N = P / G, me = c->rank, n = me / G, l = me % G;
    const int *C = c->C;
    size_t stotal = 0, ftotal = 0;
    for (int d = 0; d < P; d++)
        stotal += (size_t)C[me * P + d];
    for (int j = 0; j < G; j++)
        for (int m = 0; m < N; m++)
            ftotal += (size_t)C[(n * G + j) * P + m * G + l];
    MOE_TRY(grow_stage(c, (stotal + 2 * ftotal) * es + 1));
    char *pack = c->stage, *fwd = pack + stotal * es, *fwd2 = fwd + ftotal * es;

    // send offsets of the caller's blocks, destination order
    size_t *sd = c->displ;
    sd[0] = 0;
    for (int d = 0; d < P; d++)
        sd[d + 1] = sd[d] + (size_t)C[me * P + d] * es;
    // pack [l'][m] from send [m][l']
    size_t off = 0;
    for (int lp = 0; lp < G; lp++)
        for (int m = 0; m < N; m++) {
            int d = m * G + lp;
            size_t b = sd[d + 1] - sd[d];
            if (b) CUDA_TRY(cudaMemcpyAsync(pack + off, send + sd[d], b, cudaMemcpyDeviceToDevice,
                                            c->a2a));
            off += b;
        }
    // step 1
    int rc = 0;
    size_t soff = 0, roff = 0;
    NCCL_TRY(ncclGroupStart());
    for (int lp = 0; lp < G && !rc; lp++) {
        size_t sb = 0, rb = 0;
        for (int m = 0; m < N; m++) {
            sb += (size_t)C[me * P + m * G + lp] * es;
            rb += (size_t)C[(n * G + lp) * P + m * G + l] * es;
        }
        rc = exchange(c, pack + soff, sb, fwd + roff, rb, n * G + lp);
        soff += sb, roff += rb;
    }
    ncclResult_t nr = ncclGroupEnd();
    MOE_TRY(rc);
    NCCL_TRY(nr);
    // fwd [j][m] -> fwd2 [m][j]: offsets of fwd blocks first
    size_t *fd = c->displ; // [G * N + 1] fits: G N = P
    fd[0] = 0;
    for (int j = 0; j < G; j++)
        for (int m = 0; m < N; m++)
            fd[j * N + m + 1] = fd[j * N + m] + (size_t)C[(n * G + j) * P + m * G + l] * es;
    off = 0;
    for (int m = 0; m < N; m++)
        for (int j = 0; j < G; j++) {
            size_t b = fd[j * N + m + 1] - fd[j * N + m];
            if (b) CUDA_TRY(cudaMemcpyAsync(fwd2 + off, fwd + fd[j * N + m], b,
                                            cudaMemcpyDeviceToDevice, c->a2a));
            off += b;
        }
    // step 2
    soff = 0, roff = 0;
    NCCL_TRY(ncclGroupStart());
    for (int m = 0; m < N && !rc; m++) {
        size_t sb = 0, rb = 0;
        for (int j = 0; j < G; j++) {
            sb += (size_t)C[(n * G + j) * P + m * G + l] * es;
            rb += (size_t)C[(m * G + j) * P + me] * es;
        }
        rc = exchange(c, fwd2 + soff, sb, recv + roff, rb, m * G + l);
        soff += sb, roff += rb;
    }
    nr = ncclGroupEnd();
    MOE_TRY(rc);
    NCCL_TRY(nr);
    return 0;
}

int moe_nccl_alltoallv(moe_nccl_comm *c, moe_a2a_algo algo, const void *send,
                       const int *send_counts, void *recv, int *recv_counts, size_t recv_cap,
                       size_t elem_size, void *stream) {
    const int P = c->size, me = c->rank;
    // Counts: every rank learns the whole matrix; errors are agreed.
    MOE_TRY(moe_comm_allgather(c->host, send_counts, c->C, sizeof(int) * P));
    int status = 0;
    long total = 0;
    for (int s = 0; s < P && !status; s++)
        for (int d = 0; d < P && !status; d++)
            if (c->C[s * P + d] < 0)
                status = moe_fail(MOE_EINVAL, "all-to-all: rank %d sends %d elements to rank %d",
                                  s, c->C[s * P + d], d);
    for (int s = 0; s < P && !status; s++) {
        recv_counts[s] = c->C[s * P + me];
        total += recv_counts[s];
    }
    if (!status && (total > INT_MAX || (size_t)total > recv_cap))
        status = moe_fail(MOE_EINVAL,
                          "all-to-all: rank %d receives %ld elements, its buffer holds %zu", me,
                          total, recv_cap);
    MOE_TRY(moe_comm_agree(c->host, status));

    cudaStream_t caller = (cudaStream_t)stream;
    MOE_TRY(follow(c, caller, c->a2a));
    int G = c->G;
    if (algo == MOE_A2A_HIERARCHICAL && G > 1 && G < P)
        MOE_TRY(a2a_hier(c, send, recv, elem_size));
    else
        MOE_TRY(a2a_flat(c, send, recv, elem_size));
    return join(c->done_a2a, c->a2a, caller);
}

int moe_nccl_allreduce_f32(moe_nccl_comm *c, float *buf, size_t n, void *stream) {
    if (!n) return 0;
    cudaStream_t caller = (cudaStream_t)stream;
    MOE_TRY(follow(c, caller, c->ar));
    NCCL_TRY(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c->nccl, c->ar));
    return join(c->done_ar, c->ar, caller);
}

#else // built without NCCL

int moe_nccl_comm_init(moe_nccl_comm **out, moe_comm *host, int device) {
    *out = NULL;
    return moe_fail(MOE_EINVAL, "built without NCCL (needs CUDA, NCCL and MPI)");
}

void moe_nccl_comm_free(moe_nccl_comm *c) {
}

int moe_nccl_alltoallv(moe_nccl_comm *c, moe_a2a_algo algo, const void *send,
                       const int *send_counts, void *recv, int *recv_counts, size_t recv_cap,
                       size_t elem_size, void *stream) {
    return moe_fail(MOE_EINVAL, "built without NCCL (needs CUDA, NCCL and MPI)");
}

int moe_nccl_allreduce_f32(moe_nccl_comm *c, float *buf, size_t n, void *stream) {
    return moe_fail(MOE_EINVAL, "built without NCCL (needs CUDA, NCCL and MPI)");
}

#endif
