// The CUDA backend context (device, one stream, one cuBLAS handle), device
// discovery, host/device copies and the memory ops of moe_ops_cuda. Out of
// memory names the request and the config keys that shrink it.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/ops_cuda.h"

#include "moe/cuda_sizes.h"

#include <mutex>
#include <stdio.h>
#include <stdlib.h>

static moe_cuda_ctx g_ctx;
static bool g_ready;
static int g_device;

const char *moe_cublas_status_string(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS:
        return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
        return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
        return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
        return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
        return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
        return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
        return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
        return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
        return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
        return "CUBLAS_STATUS_LICENSE_ERROR";
    default:
        return "unknown cuBLAS status";
    }
}

extern "C" int moe_cuda_device_count(char *why, size_t why_len) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (why && why_len) snprintf(why, why_len, "%s", cudaGetErrorString(e));
        cudaGetLastError(); // clear the sticky-free error so later calls start clean
        return 0;
    }
    if (n == 0 && why && why_len) snprintf(why, why_len, "the CUDA runtime reports 0 devices");
    return n;
}

extern "C" int moe_cuda_init(int device) {
    if (g_ready && g_ctx.device == device) return 0;
    char why[256] = "";
    int n = moe_cuda_device_count(why, sizeof why);
    if (n == 0) return moe_fail(MOE_EDEVICE, "no CUDA device: %s", why);
    if (device < 0 || device >= n)
        return moe_fail(MOE_EDEVICE, "CUDA device %d requested, %d present", device, n);
    moe_cuda_shutdown(); // switching devices: buffers of the old one stay valid there
    CUDA_TRY(cudaSetDevice(device));
    CUDA_TRY(cudaStreamCreateWithFlags(&g_ctx.stream, cudaStreamNonBlocking));
    cublasStatus_t s = cublasCreate(&g_ctx.cublas);
    if (s != CUBLAS_STATUS_SUCCESS) {
        cudaStreamDestroy(g_ctx.stream);
        return moe_fail(MOE_EDEVICE, "%s:%d: cublasCreate: %s", __FILE__, __LINE__,
                        moe_cublas_status_string(s));
    }
    // Default math: cublasSgemm stays fp32 (TF32 needs CUBLAS_TF32_TENSOR_OP_MATH);
    // the bf16 table asks for its compute type per call (matmul.cu).
    if ((s = cublasSetStream(g_ctx.cublas, g_ctx.stream)) != CUBLAS_STATUS_SUCCESS ||
        (s = cublasSetMathMode(g_ctx.cublas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS) {
        cublasDestroy(g_ctx.cublas);
        cudaStreamDestroy(g_ctx.stream);
        return moe_fail(MOE_EDEVICE, "%s:%d: cuBLAS handle setup: %s", __FILE__, __LINE__,
                        moe_cublas_status_string(s));
    }
    g_ctx.device = device;
    g_device = device;
    g_ready = true;
    return 0;
}

extern "C" void moe_cuda_shutdown(void) {
    if (!g_ready) return;
    cudaStreamSynchronize(g_ctx.stream);
    cublasDestroy(g_ctx.cublas);
    cudaStreamDestroy(g_ctx.stream);
    g_ready = false;
}

extern "C" void *moe_cuda_stream(void) {
    return g_ready ? (void *)g_ctx.stream : NULL;
}

int moe_cuda_ctx_get(moe_cuda_ctx *ctx) {
    if (!g_ready) MOE_TRY(moe_cuda_init(g_device));
    *ctx = g_ctx;
    return 0;
}

extern "C" int moe_cuda_upload(void *dst, const void *src, size_t bytes) {
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    if (!bytes) return 0;
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c.stream));
    // src may be a stack or soon-freed host buffer: pageable copies are staged,
    // but wait anyway so the caller may reuse src at once.
    CUDA_TRY(cudaStreamSynchronize(c.stream));
    return 0;
}

extern "C" int moe_cuda_download(void *dst, const void *src, size_t bytes) {
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    if (!bytes) return 0;
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c.stream));
    CUDA_TRY(cudaStreamSynchronize(c.stream));
    return 0;
}

extern "C" void *moe_cuda_host_alloc(size_t bytes) {
    moe_cuda_ctx c = {};
    if (moe_cuda_ctx_get(&c) < 0) return NULL; // the device the copies will use
    void *p = NULL;
    cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cudaGetLastError();
        moe_fail(e == cudaErrorMemoryAllocation ? MOE_ENOMEM : MOE_EDEVICE,
                 "cudaMallocHost of %zu bytes (page-locked host memory): %s", bytes,
                 cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

extern "C" void moe_cuda_host_free(void *p) {
    if (p) cudaFreeHost(p);
}

extern "C" int moe_cuda_upload_async(void *dst, const void *src, size_t bytes) {
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    if (bytes) CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c.stream));
    return 0;
}

extern "C" int moe_cuda_download_async(void *dst, const void *src, size_t bytes) {
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    if (bytes) CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c.stream));
    return 0;
}

extern "C" int moe_cuda_event_create(void **event) {
    cudaEvent_t e;
    CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *event = (void *)e;
    return 0;
}

extern "C" void moe_cuda_event_destroy(void *event) {
    if (event) cudaEventDestroy((cudaEvent_t)event);
}

extern "C" int moe_cuda_event_record(void *event) {
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    CUDA_TRY(cudaEventRecord((cudaEvent_t)event, c.stream));
    return 0;
}

extern "C" int moe_cuda_event_wait(void *event) {
    CUDA_TRY(cudaEventSynchronize((cudaEvent_t)event));
    return 0;
}

extern "C" int moe_cuda_synchronize(void) {
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    CUDA_TRY(cudaStreamSynchronize(c.stream));
    return 0;
}

extern "C" int moe_cuda_device_info(char *name, size_t name_len, int *sm_count, double *peak_gbps) {
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    cudaDeviceProp p;
    CUDA_TRY(cudaGetDeviceProperties(&p, c.device));
    int clock_khz = 0, bus_bits = 0;
    CUDA_TRY(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, c.device));
    CUDA_TRY(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, c.device));
    if (name && name_len) snprintf(name, name_len, "%s", p.name);
    if (sm_count) *sm_count = p.multiProcessorCount;
    // DDR: two transfers per clock.
    if (peak_gbps) *peak_gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
    return 0;
}

// ---- memory ops of the table -------------------------------------------------------

size_t moe_cuda_alloc_size(size_t bytes) {
    return moe_cuda_granule(bytes); // cudaMalloc's alignment granule
}

// Tracking: a dense array of live (pointer, reserved bytes) pairs under a
// mutex, like moe/src/alloc.c on the host. Device buffers are few and large
// (sized once per run), so the linear search on free costs nothing.
namespace {
struct live_buf {
    void *p;
    size_t bytes;
};
std::mutex g_mem_mu;
live_buf *g_live;
size_t g_n_live, g_cap_live, g_in_use, g_peak;
} // namespace

static bool track(void *p, size_t bytes) {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    if (g_n_live == g_cap_live) {
        size_t cap = g_cap_live ? 2 * g_cap_live : 256;
        live_buf *q = (live_buf *)realloc(g_live, cap * sizeof *q);
        if (!q) return false;
        g_live = q, g_cap_live = cap;
    }
    g_live[g_n_live++] = {p, bytes};
    g_in_use += bytes;
    if (g_in_use > g_peak) g_peak = g_in_use;
    return true;
}

static void untrack(void *p) {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    for (size_t i = g_n_live; i-- > 0;)
        if (g_live[i].p == p) {
            g_in_use -= g_live[i].bytes;
            g_live[i] = g_live[--g_n_live];
            return;
        }
}

extern "C" size_t moe_cuda_mem_in_use(void) {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    return g_in_use;
}

extern "C" size_t moe_cuda_mem_peak(void) {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    return g_peak;
}

extern "C" void moe_cuda_mem_reset_peak(void) {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    g_peak = g_in_use;
}

void *moe_cuda_alloc(size_t bytes) {
    moe_cuda_ctx c = {};
    if (moe_cuda_ctx_get(&c) < 0) return NULL;
    void *p = NULL;
    const size_t reserved = moe_cuda_alloc_size(bytes);
    cudaError_t e = cudaMalloc(&p, reserved);
    if (e == cudaSuccess) {
        if (track(p, reserved)) return p;
        cudaFree(p);
        moe_fail(MOE_ENOMEM, "device allocation table: out of host memory");
        return NULL;
    }
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    if (e == cudaErrorMemoryAllocation)
        moe_fail(MOE_ENOMEM,
                 "CUDA out of memory allocating %zu bytes (%.2f GiB) on device %d (%.2f GiB free "
                 "of %.2f GiB): reduce train.batch_size (train.grad_accum keeps the tokens per "
                 "step) or model.seq_len, or raise memory.mini_seq with memory.recompute = moe "
                 "or all",
                 bytes, bytes / 1073741824.0, c.device, free_b / 1073741824.0,
                 total_b / 1073741824.0);
    else
        moe_fail(MOE_EDEVICE, "cudaMalloc of %zu bytes: %s", bytes, cudaGetErrorString(e));
    return NULL;
}

void moe_cuda_free(void *p) {
    if (!p) return;
    untrack(p);
    cudaFree(p);
}

extern "C" int moe_cuda_mem_info(size_t *free_bytes, size_t *total_bytes) {
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    CUDA_TRY(cudaMemGetInfo(free_bytes, total_bytes));
    return 0;
}

int moe_cuda_zero(float *x, size_t n) {
    if (n && !x) return moe_fail(MOE_EINVAL, "zero: NULL buffer of %zu floats", n);
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    CUDA_TRY(cudaMemsetAsync(x, 0, n * sizeof *x, c.stream));
    return 0;
}
