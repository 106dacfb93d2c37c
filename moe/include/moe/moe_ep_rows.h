// The expert side of an expert-parallel MoE layer on a backend whose buffers
// the host cannot read (moe/src/moe_ep_rows.c): the exchange of
// moe/src/moe_layer.c and the expert GEMMs on the received rows, with the
// backend's transfers given as functions. The CUDA layer uses it with
// moe_cuda_download/upload; tests run it on moe_ops_cpu with memcpy against
// the CPU layer.
#ifndef MOE_MOE_EP_ROWS_H
#define MOE_MOE_EP_ROWS_H

#include "moe/moe_layer.h"

#include <stdbool.h>
#include <stddef.h>

typedef int (*moe_ep_copy_fn)(void *dst, const void *src, size_t bytes);

// The backend's transfers. down and up block. The rest is optional and used
// by the overlapped exchange (cfg.overlap_degree > 1; NULL: the blocking
// copies, malloc and no events): copies queued on the backend's stream whose
// host side comes from host_alloc (page-locked) and stays untouched until an
// event recorded after them has been waited for, and events marking a point
// of that stream.
typedef struct {
    moe_ep_copy_fn down, up;             // backend -> host, host -> backend
    moe_ep_copy_fn down_async, up_async; // queued
    void *(*host_alloc)(size_t bytes);
    void (*host_free)(void *p);
    int (*event_create)(void **event);
    void (*event_destroy)(void *event);
    int (*event_record)(void *event); // at the end of the work queued so far
    int (*event_wait)(void *event);   // the host waits until the backend passed it
} moe_ep_backend;

typedef struct {
    const moe_ops *ops;
    moe_layer_config cfg;
    const moe_ep_group *ep; // set by the caller before the first forward
    moe_ep_backend be;
    // backend buffers for the rows this rank's experts process, R = ep_size *
    // T_max * k at most, source by source, each source's in local-expert
    // order (moe_layer.c); yr and dyr share memory
    float *xr, *abr, *hr, *yr, *dyr, *dxr, *dhr, *dabr; // [R, D | 2H | H | D | D | D | H | 2H]
    float *stage_send, *stage_recv;                     // host [R, D]: the exchange's staging
    int *send_rows, *recv_rows;                         // host [ep_size] rows to and from each rank
    int *recv_kept, *blk_off; // host [ep_size * E_local] rows of (source, local expert), prefix
    int *send_off, *recv_off; // host [ep_size + 1], [ep_size]: each peer's first row on either side
    // the overlapped exchange (cfg.overlap_degree > 1): results read back per
    // round (host [R, D]), a round's rows packed for its peers (host [R, D]),
    // the round's send counts, one event per round
    float *stage_ret, *stage_pack;
    int *cnt;
    void **events;
    int rounds;
} moe_ep_rows;

// Buffers for cfg (ep_size > 1) on ops, sized by moe_cuda_layer_ep_sizes's
// formulas (moe/cuda_sizes.h); free is safe after a failed alloc.
int moe_ep_rows_alloc(moe_ep_rows *r, const moe_layer_config *cfg, const moe_ops *ops,
                      const moe_ep_backend *be);

// Round q of rank me's exchange among n ranks sends to (me + q) % n and
// receives from (me - q) % n, so every round is a permutation (round 0: the
// rank's own rows). Of d rounds of the overlapped exchange, number c holds
// the peer rounds [c n / d, (c + 1) n / d). Whether peer is, in exchange round
// c, a destination of me (to = true) or a source.
bool moe_ep_round_has(int n, int d, int c, int me, int peer, bool to);
void moe_ep_rows_free(moe_ep_rows *r);

// Forward of the experts: xe [rows, D] (backend) holds this rank's tokens in
// expert order, segment e = [offsets[e], offsets[e + 1]) (host, E + 1, the
// exclusive sum of the kept rows); ye [rows, D] (backend) gets the experts'
// outputs in the same order. Collective over the EP group.
int moe_ep_rows_forward(moe_ep_rows *r, float *ye, const float *xe, const int *offsets,
                        const moe_layer_params *p);
// Backward of the last forward: dye [rows, D] in, dxe [rows, D] out
// (overwritten); the local experts' weight gradients ADD into dp.
int moe_ep_rows_backward(moe_ep_rows *r, float *dxe, const float *dye, const moe_layer_params *dp,
                         const moe_layer_params *p);

#endif
