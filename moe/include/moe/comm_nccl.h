// NCCL communicator for device buffers, bootstrapped from a host communicator
// (moe/comm.h): rank 0 makes the NCCL unique id, the host communicator
// broadcasts it, every rank joins on its CUDA device. Variable all-to-all as
// grouped ncclSend/ncclRecv, flat or hierarchical (the two steps of
// comm/alltoall_hier.c: inside the node, then across nodes between ranks of
// one local index), and a sum all-reduce. Built only with CUDA, NCCL and MPI
// (MOE_HAVE_NCCL); every function fails with MOE_EINVAL otherwise.
//
// Streams: each communicator owns two streams, one for all-to-all and one for
// all-reduce, so a gradient all-reduce can run beside an expert all-to-all.
// Every op takes the caller's stream: the op starts after the work already
// queued there and the caller's stream waits for the op's result, so the host
// never blocks and work on other streams overlaps with the communication.
// Counts are host memory and exchanged over the host communicator.
//
// Unlike moe_comm_allreduce_f32, the NCCL sum is not in rank order: results
// may differ from rank to rank order in the last bits (NCCL's reduction
// order), identical on every rank.
#ifndef MOE_COMM_NCCL_H
#define MOE_COMM_NCCL_H

#include "moe/comm.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_nccl_comm moe_nccl_comm; // opaque

// Collective over host: one NCCL rank per host rank, on CUDA device `device`
// (which this rank must have made current or not: it is set here). The host
// communicator must outlive the NCCL one (counts travel over it).
int moe_nccl_comm_init(moe_nccl_comm **out, moe_comm *host, int device);
void moe_nccl_comm_free(moe_nccl_comm *c); // NULL is fine

// As moe_comm_alltoallv with send and recv in device memory; send_counts and
// recv_counts in host memory. stream: a cudaStream_t (NULL: the legacy
// default stream).
int moe_nccl_alltoallv(moe_nccl_comm *c, moe_a2a_algo algo, const void *send,
                       const int *send_counts, void *recv, int *recv_counts, size_t recv_cap,
                       size_t elem_size, void *stream);

// In-place sum of n floats of device memory over all ranks.
int moe_nccl_allreduce_f32(moe_nccl_comm *c, float *buf, size_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif
