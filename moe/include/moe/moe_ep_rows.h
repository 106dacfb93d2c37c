// The expert side of an expert-parallel MoE layer on a backend whose buffers
// the host cannot read (moe/src/moe_ep_rows.c): the exchange of
// moe/src/moe_layer.c and the expert GEMMs on the received rows, with the
// backend's transfers given as functions. The CUDA layer uses it with
// moe_cuda_download/upload; tests run it on moe_ops_cpu with memcpy against
// the CPU layer.
#ifndef MOE_MOE_EP_ROWS_H
#define MOE_MOE_EP_ROWS_H

#include "moe/moe_layer.h"

#include <stddef.h>

typedef int (*moe_ep_copy_fn)(void *dst, const void *src, size_t bytes);

typedef struct {
    const moe_ops *ops;
    moe_layer_config cfg;
    const moe_ep_group *ep;  // set by the caller before the first forward
    moe_ep_copy_fn down, up; // backend -> host, host -> backend
    // backend buffers for the rows this rank's experts process, R = ep_size *
    // T_max * k at most, source by source, each source's in local-expert
    // order (moe_layer.c); yr and dyr share memory
    float *xr, *abr, *hr, *yr, *dyr, *dxr, *dhr, *dabr; // [R, D | 2H | H | D | D | D | H | 2H]
    float *stage_send, *stage_recv;                     // host [R, D]: the exchange's staging
    int *send_rows, *recv_rows;                         // host [ep_size] rows to and from each rank
    int *recv_kept, *blk_off; // host [ep_size * E_local] rows of (source, local expert), prefix
} moe_ep_rows;

// Buffers for cfg (ep_size > 1) on ops, sized by moe_cuda_layer_ep_sizes's
// formulas (moe/cuda_sizes.h); free is safe after a failed alloc.
int moe_ep_rows_alloc(moe_ep_rows *r, const moe_layer_config *cfg, const moe_ops *ops,
                      moe_ep_copy_fn down, moe_ep_copy_fn up);
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
