// Token permutation of the MoE layer on the GPU, the CUDA twin of
// kernels/cpu/permute.c: gather tokens into the expert-contiguous buffer and
// back with the weighted combine, plus the generic row gather (the scatter-add
// is kernels/cuda/scatter_add.cu). Kept rows are distinct, so every kernel
// writes each output row from one block and needs no atomics; a token's k
// choices are summed in j order, as on the CPU.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"

#define ROWS(p, n) for (size_t p = blockIdx.x; p < (size_t)(n); p += gridDim.x)
#define COLS(d, D) for (int d = threadIdx.x; d < (D); d += blockDim.x)

__global__ static void dispatch_rows_kernel(int *row, const int *expert, const int *slot,
                                            const int *offsets, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        row[i] = expert[i] >= 0 ? offsets[expert[i]] + slot[i] : -1;
}

// One block numbers a mini-sequence chunk's entries (moe_ops.chunk_rows).
// Thread e owns expert e (e0 + e past 1024 experts); the entries pass through
// shared memory in tiles, twice: the owners count, thread 0 turns the counts
// into offsets, then each owner numbers its expert's entries in entry order.
// No atomics, so the rows are the CPU's; O(E n / blockDim) compares, about
// tens of microseconds for 8192 entries.
#define CHUNK_TILE 1024
__global__ static void chunk_rows_kernel(int *crow, int *coff, const int *expert, int n, int E) {
    __shared__ int tile[CHUNK_TILE];
    for (int pass = 0; pass < 2; pass++) {
        for (int e0 = 0; e0 < E; e0 += blockDim.x) {
            const int e = e0 + threadIdx.x;
            int c = pass && e < E ? coff[e] : 0;
            for (int i0 = 0; i0 < n; i0 += CHUNK_TILE) {
                const int m = n - i0 < CHUNK_TILE ? n - i0 : CHUNK_TILE;
                __syncthreads(); // the last tile is read
                for (int i = threadIdx.x; i < m; i += blockDim.x)
                    tile[i] = expert[i0 + i];
                __syncthreads();
                for (int i = 0; e < E && i < m; i++)
                    if (tile[i] == e) {
                        if (pass) crow[i0 + i] = c;
                        c++;
                    }
            }
            if (!pass && e < E) coff[e + 1] = c;
        }
        __syncthreads(); // counts (pass 0) in global memory, visible to the block
        if (!pass && threadIdx.x == 0) {
            coff[0] = 0;
            for (int e = 0; e < E; e++)
                coff[e + 1] += coff[e];
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (expert[i] < 0 || expert[i] >= E) crow[i] = -1;
}

// One block per (t, j) pair: xe[row] = x[t].
__global__ static void permute_fwd_kernel(float *xe, const float *x, const int *row, int T, int k,
                                          int D) {
    ROWS(p, (size_t)T * k) {
        int r = row[p];
        if (r < 0) continue;
        const float *src = x + (p / k) * D;
        float *dst = xe + (size_t)r * D;
        COLS(d, D) dst[d] = src[d];
    }
}

// One block per token: dx[t] += sum_j dxe[row[t, j]].
__global__ static void permute_bwd_kernel(float *dx, const float *dxe, const int *row, int T, int k,
                                          int D) {
    ROWS(t, T) {
        const int *rt = row + t * k;
        COLS(d, D) {
            float acc = dx[t * D + d];
            for (int j = 0; j < k; j++)
                if (rt[j] >= 0) acc += dxe[(size_t)rt[j] * D + d];
            dx[t * D + d] = acc;
        }
    }
}

// One block per token: y[t] = sum_j weight[t, j] * ye[row[t, j]] (0 if all dropped).
__global__ static void unpermute_fwd_kernel(float *y, const float *ye, const int *row,
                                            const float *weight, int T, int k, int D) {
    ROWS(t, T) {
        const int *rt = row + t * k;
        const float *wt = weight + t * k;
        COLS(d, D) {
            float acc = 0.0f;
            for (int j = 0; j < k; j++)
                if (rt[j] >= 0) acc += wt[j] * ye[(size_t)rt[j] * D + d];
            y[t * D + d] = acc;
        }
    }
}

// One block per kept (t, j): dye[row] += w * dy[t]; dweight[t, j] += dot(dy[t], ye[row]).
__global__ static void unpermute_bwd_kernel(float *dye, float *dweight, const float *dy,
                                            const float *ye, const int *row, const float *weight,
                                            int T, int k, int D) {
    __shared__ float sh[32];
    ROWS(p, (size_t)T * k) {
        int r = row[p]; // uniform across the block: the whole block skips or none
        if (r < 0) continue;
        const float *g = dy + (p / k) * D, *yr = ye + (size_t)r * D;
        float *o = dye + (size_t)r * D, w = weight[p], dot = 0.0f;
        COLS(d, D) {
            o[d] += w * g[d];
            dot += g[d] * yr[d];
        }
        dot = moe_block_sum(dot, sh);
        if (threadIdx.x == 0) dweight[p] += dot;
    }
}

__global__ static void gather_rows_kernel(float *out, const float *in, const int *idx, int n,
                                          int D) {
    ROWS(i, n) {
        int s = idx[i];
        float *o = out + i * D;
        if (s >= 0) {
            const float *src = in + (size_t)s * D;
            COLS(d, D) o[d] = src[d];
        } else {
            COLS(d, D) o[d] = 0.0f;
        }
    }
}

static int threads_for(int D) {
    return D >= 256 ? 256 : (D + 31) / 32 * 32; // a multiple of 32 (block reductions)
}

static int check_tkd(const char *op, int T, int k, int D) {
    if (T < 0 || k < 1 || D < 0) return moe_fail(MOE_EINVAL, "%s: T=%d k=%d D=%d", op, T, k, D);
    return 0;
}

extern "C" int moe_cuda_dispatch_rows(int *row, const int *expert, const int *slot,
                                      const int *offsets, int T, int k) {
    MOE_TRY(check_tkd("dispatch_rows", T, k, 0));
    size_t n = (size_t)T * k;
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    dispatch_rows_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(row, expert, slot, offsets,
                                                                        n);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_chunk_rows(int *crow, int *coff, const int *expert, int n, int E) {
    if (n < 0 || E < 1) return moe_fail(MOE_EINVAL, "chunk_rows: n=%d E=%d", n, E);
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    const int threads = E >= 1024 ? 1024 : (E + 31) / 32 * 32;
    chunk_rows_kernel<<<1, threads, 0, c.stream>>>(crow, coff, expert, n, E);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_permute_forward(float *xe, const float *x, const int *row, int T, int k,
                                        int D) {
    MOE_TRY(check_tkd("permute_forward", T, k, D));
    if (!T || !D) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    permute_fwd_kernel<<<moe_cuda_row_blocks((size_t)T * k), threads_for(D), 0, c.stream>>>(
        xe, x, row, T, k, D);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_permute_backward(float *dx, const float *dxe, const int *row, int T, int k,
                                         int D) {
    MOE_TRY(check_tkd("permute_backward", T, k, D));
    if (!T || !D) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    permute_bwd_kernel<<<moe_cuda_row_blocks(T), threads_for(D), 0, c.stream>>>(dx, dxe, row, T, k,
                                                                                D);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_unpermute_forward(float *y, const float *ye, const int *row,
                                          const float *weight, int T, int k, int D) {
    MOE_TRY(check_tkd("unpermute_forward", T, k, D));
    if (!T || !D) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    unpermute_fwd_kernel<<<moe_cuda_row_blocks(T), threads_for(D), 0, c.stream>>>(y, ye, row,
                                                                                  weight, T, k, D);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_unpermute_backward(float *dye, float *dweight, const float *dy,
                                           const float *ye, const int *row, const float *weight,
                                           int T, int k, int D) {
    MOE_TRY(check_tkd("unpermute_backward", T, k, D));
    if (!T) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    // D = 0 still launches 32 threads: dweight gets += 0 like the CPU.
    unpermute_bwd_kernel<<<moe_cuda_row_blocks((size_t)T * k), D ? threads_for(D) : 32, 0,
                           c.stream>>>(dye, dweight, dy, ye, row, weight, T, k, D);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_gather_rows(float *out, const float *in, const int *idx, int n, int D) {
    if (n < 0 || D < 0) return moe_fail(MOE_EINVAL, "gather_rows: n=%d D=%d", n, D);
    if (!n || !D) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    gather_rows_kernel<<<moe_cuda_row_blocks(n), threads_for(D), 0, c.stream>>>(out, in, idx, n, D);
    CUDA_LAUNCH_CHECK();
    return 0;
}
