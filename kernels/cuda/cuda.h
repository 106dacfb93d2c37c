// Host-side API of the CUDA backend, callable from C: device discovery, the
// backend context (device, stream, cuBLAS handle), copies between host and
// device memory, and synchronisation. The ops themselves are moe_ops_cuda
// (kernels/ops.h). Compiled only when MOE_HAVE_CUDA.
#ifndef MOE_KERNELS_CUDA_H
#define MOE_KERNELS_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Number of CUDA devices, 0 when there is none or no driver: then why (when
// not NULL) gets the reason, e.g. "no CUDA-capable device is detected". Never
// fails; the runtime's answer is the result.
int moe_cuda_device_count(char *why, size_t why_len);

// Selects the device used by every later op (default 0) and creates the
// stream and cuBLAS handle. Ops call it lazily with the current choice.
int moe_cuda_init(int device);
// Releases the stream and the cuBLAS handle (tests and the CLI at exit).
void moe_cuda_shutdown(void);

// The backend stream every op runs on (a cudaStream_t), for callers that
// order other work after the ops (moe_nccl_* take it); NULL before init.
void *moe_cuda_stream(void);

// Copies on the backend stream; download and synchronize wait for it.
int moe_cuda_upload(void *dst_device, const void *src_host, size_t bytes);
int moe_cuda_download(void *dst_host, const void *src_device, size_t bytes);
int moe_cuda_synchronize(void);

// Pipelining a host exchange with device work (the overlapped expert-parallel
// exchange of moe/src/moe_layer_cuda_ep.c): page-locked host memory, copies
// queued on the backend stream without waiting (the host buffer must be
// page-locked and stay untouched until the stream has passed the copy), and
// events marking a point of the stream that the host can wait for.
void *moe_cuda_host_alloc(size_t bytes); // NULL with the error set
void moe_cuda_host_free(void *p);        // NULL is fine
int moe_cuda_upload_async(void *dst_device, const void *src_pinned, size_t bytes);
int moe_cuda_download_async(void *dst_pinned, const void *src_device, size_t bytes);
int moe_cuda_event_create(void **event);
void moe_cuda_event_destroy(void *event); // NULL is fine
int moe_cuda_event_record(void *event);   // at the stream's current end
int moe_cuda_event_wait(void *event);     // the host waits until the stream passed it

// Device memory of the backend's allocations (moe_cuda_alloc, which the op
// tables, the CUDA MoE layer and the router plan use): bytes reserved now
// (each request rounded to cudaMalloc's 256-byte granule), the high-water
// mark since the last reset, and a reset to the current figure. The
// stream-ordered scratch of single ops (cudaMallocAsync in rmsnorm.cu,
// scatter_add.cu, matmul.cu, crossentropy.cu, elementwise.cu: freed within
// the op), the CUDA context, cuBLAS's workspace and NCCL are not counted;
// moe_cuda_mem_info's cudaMemGetInfo sees them all.
size_t moe_cuda_mem_in_use(void);
size_t moe_cuda_mem_peak(void);
void moe_cuda_mem_reset_peak(void);
// Grouped GEMM calls that ran as one cuBLAS GEMM per segment (cuBLAS refused
// the grouped call for its compute type) since start-up.
long moe_cuda_grouped_fallbacks(void);
// cudaMemGetInfo of the backend's device.
int moe_cuda_mem_info(size_t *free_bytes, size_t *total_bytes);

// The device's name, SM count and peak DRAM bandwidth in GB/s (from memory
// clock and bus width), for benchmarks.
int moe_cuda_device_info(char *name, size_t name_len, int *sm_count, double *peak_gbps);

#ifdef __cplusplus
}
#endif

#endif
