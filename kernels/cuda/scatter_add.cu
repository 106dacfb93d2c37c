// Deterministic scatter-add on the GPU: out[idx[i]] += in[i] for every row i
// with idx[i] >= 0, with no floating-point atomics. The (idx, i) pairs are
// sorted stably by idx (cub's radix sort is stable), then one block per run of
// equal indices adds its rows in ascending i: the order of the CPU's loop
// (kernels/cpu/embedding.c, kernels/cpu/permute.c), so the sums equal the
// CPU's bit for bit and two runs give the same bits. The embedding backward
// (kernels/cuda/embedding.cu) is this op with the token ids as indices.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"

#include <cub/device/device_radix_sort.cuh>

__global__ static void iota_rows_kernel(int *x, int n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = (int)i;
}

// Block i handles the run of equal keys that starts at i (other blocks have
// nothing to do): its threads split the D columns, each adding the run's rows
// in order onto the row's current value.
__global__ static void run_add_kernel(float *out, const float *in, const int *key, const int *row,
                                      int n, int D) {
    for (size_t i = blockIdx.x; i < (size_t)n; i += gridDim.x) {
        const int t = key[i];
        if (t < 0 || (i > 0 && key[i - 1] == t)) continue; // skipped row, or not a run's start
        float *o = out + (size_t)t * D;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float acc = o[d];
            for (size_t j = i; j < (size_t)n && key[j] == t; j++)
                acc += in[(size_t)row[j] * D + d];
            o[d] = acc;
        }
    }
}

extern "C" int moe_cuda_scatter_add_rows(float *out, const float *in, const int *idx, int n,
                                         int D) {
    if (n < 0 || D < 0) return moe_fail(MOE_EINVAL, "scatter_add_rows: n=%d D=%d", n, D);
    if (!n || !D) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    size_t tmp_bytes = 0;
    CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, tmp_bytes, (const int *)nullptr,
                                             (int *)nullptr, (const int *)nullptr, (int *)nullptr,
                                             n, 0, 32, c.stream));
    // cub's scratch first (the allocation's alignment), then keys out, rows
    // in and rows out: one allocation
    const size_t tmp_room = (tmp_bytes + 255) / 256 * 256;
    const size_t bytes = tmp_room + 3 * (size_t)n * sizeof(int);
    char *buf = NULL;
    MOE_TRY(moe_cuda_scratch((void **)&buf, bytes, c.stream, "scatter_add_rows"));
    void *tmp = buf;
    int *key = (int *)(buf + tmp_room), *row_in = key + n, *row = key + 2 * (size_t)n;
    iota_rows_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(row_in, n);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        e = cub::DeviceRadixSort::SortPairs(tmp, tmp_bytes, idx, key, row_in, row, n, 0, 32,
                                            c.stream);
    if (e == cudaSuccess) {
        const unsigned threads = D >= 256 ? 256 : (unsigned)((D + 31) / 32 * 32);
        run_add_kernel<<<moe_cuda_row_blocks(n), threads, 0, c.stream>>>(out, in, key, row, n, D);
        e = cudaGetLastError();
    }
    return moe_cuda_scratch_end(buf, c.stream, e, "scatter_add_rows");
}
