// Checked CUDA and cuBLAS calls (NCCL's NCCLCHECK habit): a failing call
// records "file:line: call: error string" as the library's last error and
// returns MOE_EDEVICE upward. Shared by every kernels/cuda/*.cu file, with the
// backend context (stream, cuBLAS handle) and launch helpers.
#ifndef MOE_KERNELS_CUDA_CHECK_CUH
#define MOE_KERNELS_CUDA_CHECK_CUH

#include "moe/error.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

const char *moe_cublas_status_string(cublasStatus_t s);

// A failed call also stays the runtime's last error: it is cleared here, once
// reported, so the next CUDA_LAUNCH_CHECK does not blame a later launch for it.
#define CUDA_TRY(x)                                                                                \
    do {                                                                                           \
        cudaError_t cu_e_ = (x);                                                                   \
        if (cu_e_ != cudaSuccess) {                                                                \
            cudaGetLastError();                                                                    \
            return moe_fail(MOE_EDEVICE, "%s:%d: %s: %s", __FILE__, __LINE__, #x,                  \
                            cudaGetErrorString(cu_e_));                                            \
        }                                                                                          \
    } while (0)

#define CUBLAS_TRY(x)                                                                              \
    do {                                                                                           \
        cublasStatus_t cb_s_ = (x);                                                                \
        if (cb_s_ != CUBLAS_STATUS_SUCCESS)                                                        \
            return moe_fail(MOE_EDEVICE, "%s:%d: %s: %s", __FILE__, __LINE__, #x,                  \
                            moe_cublas_status_string(cb_s_));                                      \
    } while (0)

// After a kernel launch: launch-configuration errors surface here; errors of
// the kernel itself surface at the next synchronising call.
#define CUDA_LAUNCH_CHECK() CUDA_TRY(cudaGetLastError())

// Stream-ordered scratch of one op call (cudaMallocAsync on the op's stream):
// a failed allocation is MOE_ENOMEM naming the op and the size. The op then
// launches its kernels, keeping the first error in e, and ends with
// moe_cuda_scratch_end, which frees the scratch in stream order (after those
// kernels) and reports e, if any, as MOE_EDEVICE naming the op.
static inline int moe_cuda_scratch(void **p, size_t bytes, cudaStream_t s, const char *op) {
    cudaError_t e = cudaMallocAsync(p, bytes, s);
    if (e == cudaSuccess) return 0;
    cudaGetLastError();
    *p = NULL;
    return moe_fail(MOE_ENOMEM, "%s: %zu bytes of device scratch: %s", op, bytes,
                    cudaGetErrorString(e));
}

static inline int moe_cuda_scratch_end(void *p, cudaStream_t s, cudaError_t e, const char *op) {
    cudaFreeAsync(p, s);
    if (e == cudaSuccess) return 0;
    cudaGetLastError();
    return moe_fail(MOE_EDEVICE, "%s: %s", op, cudaGetErrorString(e));
}

// The backend context, created on first use (moe_cuda_init).
typedef struct {
    int device;
    cudaStream_t stream;
    cublasHandle_t cublas;
} moe_cuda_ctx;

// Fills *ctx with the current context, initialising device 0 if needed.
int moe_cuda_ctx_get(moe_cuda_ctx *ctx);

// Grid size for a grid-stride loop over n items with `threads` per block.
static inline unsigned moe_cuda_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    const size_t cap = 65535u * 16u; // plenty of blocks; the loop covers the rest
    return (unsigned)(b < 1 ? 1 : (b > cap ? cap : b));
}

// Grid size for one block per row over n rows.
static inline unsigned moe_cuda_row_blocks(size_t n) {
    const size_t cap = 1u << 30;
    return (unsigned)(n < 1 ? 1 : (n > cap ? cap : n));
}

// Block-wide sum of v (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. shared must hold 32 floats.
template <typename T> __device__ inline T moe_block_sum(T v, T *shared) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    __syncthreads(); // shared may still be read by a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nwarps ? shared[lane] : T(0);
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide max, the same contract as moe_block_sum.
template <typename T> __device__ inline T moe_block_max(T v, T *shared) {
    for (int o = 16; o > 0; o >>= 1)
        v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nwarps ? shared[lane] : shared[0];
    for (int o = 16; o > 0; o >>= 1)
        v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#endif
