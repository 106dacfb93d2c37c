// NCCL communicator (moe/comm_nccl.h): unique id over the host communicator,
// all-to-all as grouped ncclSend/ncclRecv following the schedule of
// comm/a2a_schedule.c (flat: one send and one receive per peer; hierarchical:
// the two steps and block transposes of comm/alltoall_hier.c with device
// copies), all-reduce with ncclAllReduce. The full count matrix is
// all-gathered over the host communicator, so every rank derives its schedule
// locally.
#include "moe/comm_nccl.h"
#include "comm/comm_internal.h"
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
        if (cu_e_ != cudaSuccess) {                                                                \
            cudaGetLastError(); /* reported here: do not blame the next call */                    \
            return moe_fail(MOE_EDEVICE, "%s:%d: %s: %s", __FILE__, __LINE__, #x,                  \
                            cudaGetErrorString(cu_e_));                                            \
        }                                                                                          \
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
    cudaStream_t a2a, ar; // communication streams
    cudaEvent_t ready, done_a2a, done_ar;
    int *C;           // [size * size] count matrix of one call
    moe_a2a_op *ops;  // one call's schedule
    char *stage;      // device staging of the hierarchical all-to-all
    size_t stage_cap; // bytes
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
    cudaError_t ce = cudaSetDevice(device);
    ncclResult_t nr = ncclSuccess;
    if (ce != cudaSuccess)
        status = moe_fail(MOE_EDEVICE, "rank %d: cudaSetDevice(%d): %s", c->rank, device,
                          cudaGetErrorString(ce));
    else if (c->rank == 0 && (nr = ncclGetUniqueId(&id)) != ncclSuccess)
        status = moe_fail(MOE_EDEVICE, "ncclGetUniqueId: %s", ncclGetErrorString(nr));
    MOE_TRY_GOTO(moe_comm_agree(host, status), rc);
    MOE_TRY_GOTO(moe_comm_bcast(host, &id, sizeof id, 0), rc);
    nr = ncclCommInitRank(&c->nccl, c->size, id, c->rank);
    if (nr != ncclSuccess) {
        c->nccl = NULL;
        status = moe_fail(MOE_EDEVICE, "rank %d: ncclCommInitRank on device %d: %s", c->rank,
                          device, ncclGetErrorString(nr));
    }
    MOE_TRY_GOTO(moe_comm_agree(host, status), rc);
    c->C = malloc(sizeof(int) * (size_t)c->size * c->size);
    c->ops = malloc(sizeof(moe_a2a_op) * moe_a2a_schedule_max_ops(c->size));
    if (!c->C || !c->ops) {
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
    free(c->ops);
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

// Runs one rank's schedule (comm/a2a_schedule.c): each phase is one NCCL
// group (copies are device copies enqueued before the group's transfers);
// phases run in stream order.
static int run_schedule(moe_nccl_comm *c, const moe_a2a_op *ops, int n, const char *send,
                        char *recv) {
    char *bufs[3] = {(char *)send, recv, c->stage};
    for (int i = 0; i < n;) {
        const int phase = ops[i].phase;
        int rc = 0;
        NCCL_TRY(ncclGroupStart());
        for (; i < n && ops[i].phase == phase && !rc; i++) {
            const moe_a2a_op *o = &ops[i];
            cudaError_t e = cudaSuccess;
            ncclResult_t r = ncclSuccess;
            if (o->kind == MOE_A2A_COPY)
                e = cudaMemcpyAsync(bufs[o->dst] + o->dst_off, bufs[o->src] + o->src_off, o->bytes,
                                    cudaMemcpyDeviceToDevice, c->a2a);
            else if (o->kind == MOE_A2A_SEND)
                r = ncclSend(bufs[o->src] + o->src_off, o->bytes, ncclChar, o->peer, c->nccl,
                             c->a2a);
            else
                r = ncclRecv(bufs[o->dst] + o->dst_off, o->bytes, ncclChar, o->peer, c->nccl,
                             c->a2a);
            if (e != cudaSuccess)
                rc = moe_fail(MOE_EDEVICE, "%s:%d: cudaMemcpyAsync: %s", __FILE__, __LINE__,
                              cudaGetErrorString(e));
            else if (r != ncclSuccess)
                rc = moe_fail(MOE_EDEVICE, "%s:%d: %s to/from rank %d: %s", __FILE__, __LINE__,
                              o->kind == MOE_A2A_SEND ? "ncclSend" : "ncclRecv", o->peer,
                              ncclGetErrorString(r));
        }
        ncclResult_t end = ncclGroupEnd();
        MOE_TRY(rc);
        NCCL_TRY(end);
    }
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
                status = moe_fail(MOE_EINVAL, "all-to-all: rank %d sends %d elements to rank %d", s,
                                  c->C[s * P + d], d);
    for (int s = 0; s < P && !status; s++) {
        recv_counts[s] = c->C[s * P + me];
        total += recv_counts[s];
    }
    if (!status && (total > INT_MAX || (size_t)total > recv_cap))
        status =
            moe_fail(MOE_EINVAL, "all-to-all: rank %d receives %ld elements, its buffer holds %zu",
                     me, total, recv_cap);
    MOE_TRY(moe_comm_agree(c->host, status));

    int n = 0;
    size_t stage = 0;
    MOE_TRY(moe_a2a_schedule(c->ops, &n, &stage, c->C, P, c->G, me, elem_size,
                             algo == MOE_A2A_HIERARCHICAL));
    // Staging sizes differ by rank: one rank out of device memory must stop
    // every rank before the transfers, or its peers wait on it forever.
    MOE_TRY(moe_comm_agree(c->host, grow_stage(c, stage + 1)));
    cudaStream_t caller = (cudaStream_t)stream;
    MOE_TRY(follow(c, caller, c->a2a));
    MOE_TRY(run_schedule(c, c->ops, n, send, recv));
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

void moe_nccl_comm_free(moe_nccl_comm *c) {}

int moe_nccl_alltoallv(moe_nccl_comm *c, moe_a2a_algo algo, const void *send,
                       const int *send_counts, void *recv, int *recv_counts, size_t recv_cap,
                       size_t elem_size, void *stream) {
    return moe_fail(MOE_EINVAL, "built without NCCL (needs CUDA, NCCL and MPI)");
}

int moe_nccl_allreduce_f32(moe_nccl_comm *c, float *buf, size_t n, void *stream) {
    return moe_fail(MOE_EINVAL, "built without NCCL (needs CUDA, NCCL and MPI)");
}

#endif
