// Cut cross-entropy on the GPU (Wijmans et al., arXiv 2411.09009), the twin of
// kernels/cpu/cce.c: the mean cross-entropy of logits = h @ W^T, fp32, with no
// [N, V] buffer in global memory.
//   forward:  a kernel computes [128, 128] logit tiles in registers (FMA) and
//             keeps an online (max, sum of exp) per row, each thread over its
//             own columns; S vocabulary splits leave (max, sum) partials that
//             a second kernel combines in split order: only lse [N] is kept.
//   backward: per chunk of the vocabulary, a kernel recomputes the tiles and
//             writes G = (softmax - onehot) * dloss / n_valid into an [N, chunk]
//             slab; dh += G W_chunk and dW_chunk += G^T h run through cuBLAS.
// Why a slab and not dh/dW sums inside the kernel: summing over vocabulary
// tiles in a kernel needs float atomics (run-to-run bit differences) or, to
// keep [rows, D] accumulators at D in the thousands, recomputing each tile
// D / 128 times. A ~64 MiB slab keeps memory independent of V, the sums in a
// fixed order (two identical runs give identical bits) and the products on
// cuBLAS.
#include "kernels/cpu/nn.h" // MOE_CCE_NB, MOE_CCE_VB: the CPU's filter tiles
#include "kernels/cuda/cce_cuda.h"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/ops_cuda.h"
#include "moe/cuda_sizes.h"

#include <math.h>
#include <stdlib.h>

extern "C" int moe_cuda_check_targets(const int32_t *target, int N, int V, int *n_valid,
                                      int32_t *host);

// Tile: BM x BN logits per block of 256 threads, TM x TN per thread, K in BK
// steps through shared memory. Thread (tx, ty) = (tid % 16, tid / 16) owns
// rows ty + 16 i and columns tx + 16 j: a warp reads 16 consecutive floats of
// Bs (no bank conflicts) and its rows i < 4 lie in the first 64 rows of the
// tile, i >= 4 in the second, so each thread touches exactly two of the CPU's
// [MOE_CCE_NB, MOE_CCE_VB] filter tiles.
enum { BM = 128, BN = 128, BK = 8, TM = 8, TN = 8, THREADS = 256, PAD = 4 };
static_assert(BM == BN && (BM / TM) * (BN / TN) == THREADS, "tile shape");
static_assert(BM == 2 * MOE_CCE_NB && MOE_CCE_VB % BN == 0, "GPU tiles nest in the CPU's");
// Forward: about this many blocks in the grid (row tiles x splits), enough
// for every SM of an H100 twice over.
enum { SPLIT_BLOCKS = 512 };
static_assert((int)SPLIT_BLOCKS == (int)MOE_CUDA_CCE_SPLIT_BLOCKS &&
                  (int)BM == (int)MOE_CUDA_CCE_BM,
              "moe/cuda_sizes.h sizes the scratch with these");

// acc[i][j] = h[r0 + ty + 16 i] . W[c0 + tx + 16 j], 0 for rows >= N or
// columns >= c_end. Every thread of the block must call it (it syncs).
__device__ static void logit_tile(float acc[TM][TN], const float *h, const float *W, int N,
                                  int c_end, int D, int r0, int c0, float (*As)[BM + PAD],
                                  float (*Bs)[BN + PAD]) {
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    for (int i = 0; i < TM; i++)
        for (int j = 0; j < TN; j++)
            acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < D; k0 += BK) {
        // 8 consecutive threads read one row's BK floats; stored k-major, the
        // padding keeps the 32 stores of a warp in 32 banks.
        for (int q = 0; q < BM * BK / THREADS; q++) {
            const int e = tid + q * THREADS, row = e / BK, kk = e % BK, k = k0 + kk;
            const int n = r0 + row, v = c0 + row;
            As[kk][row] = n < N && k < D ? h[(size_t)n * D + k] : 0.0f;
            Bs[kk][row] = v < c_end && k < D ? W[(size_t)v * D + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk++) {
            float a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; i++)
                a[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < TN; j++)
                b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++)
                    acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads(); // the tiles are overwritten next step
    }
}

// pm/ps[s * N + n]: max and sum of exp(logit - max) of row n over the
// vocabulary tiles s, s + S, s + 2 S, ... (S = gridDim.y, blockIdx.y = s).
__global__ static void __launch_bounds__(THREADS)
    cce_fwd_kernel(float *pm, float *ps, const float *h, const float *W, int N, int D, int V) {
    __shared__ float As[BK][BM + PAD], Bs[BK][BN + PAD];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, r0 = blockIdx.x * BM;
    float m[TM], s[TM];
    for (int i = 0; i < TM; i++)
        m[i] = -INFINITY, s[i] = 0.0f;
    for (int c0 = blockIdx.y * BN; c0 < V; c0 += gridDim.y * BN) {
        float acc[TM][TN];
        logit_tile(acc, h, W, N, V, D, r0, c0, As, Bs);
        for (int i = 0; i < TM; i++) {
            float bm = -INFINITY;
            for (int j = 0; j < TN; j++)
                if (c0 + tx + 16 * j < V) bm = fmaxf(bm, acc[i][j]);
            if (bm == -INFINITY) continue; // this thread's columns are all past V
            const float nm = fmaxf(m[i], bm);
            float sum = s[i] * expf(m[i] - nm); // 0 while m[i] = -inf
            for (int j = 0; j < TN; j++)
                if (c0 + tx + 16 * j < V) sum += expf(acc[i][j] - nm);
            m[i] = nm, s[i] = sum;
        }
    }
    // The 16 threads of a row are the lanes of one half-warp (same ty): a
    // butterfly over lane bits 3..0. Paired lanes may end a last bit apart
    // (the compiler fuses one of the two products into the add, which does
    // not commute); only lane tx = 0 writes, so the result is still one fixed
    // function of the inputs.
    for (int i = 0; i < TM; i++) {
        for (int o = 8; o > 0; o >>= 1) {
            const float om = __shfl_xor_sync(0xffffffffu, m[i], o);
            const float os = __shfl_xor_sync(0xffffffffu, s[i], o);
            const float nm = fmaxf(m[i], om);
            if (nm != -INFINITY) s[i] = s[i] * expf(m[i] - nm) + os * expf(om - nm);
            m[i] = nm;
        }
        const int n = r0 + ty + 16 * i;
        if (tx == 0 && n < N) {
            pm[(size_t)blockIdx.y * N + n] = m[i];
            ps[(size_t)blockIdx.y * N + n] = s[i];
        }
    }
}

// One warp per row: lse from the S partials (in split order, in double, as
// the CPU sums), the target's logit by a warp dot product, the row's loss.
__global__ static void cce_lse_kernel(float *losses, float *lse, const float *pm, const float *ps,
                                      int S, const float *h, const float *W, const int32_t *target,
                                      int N, int D) {
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (n >= N) return; // the whole warp
    const int t = target[n];
    float dot = 0.0f;
    if (t >= 0) {
        const float *hn = h + (size_t)n * D, *wt = W + (size_t)t * D;
        for (int d = lane; d < D; d += 32)
            dot = fmaf(hn[d], wt[d], dot);
        for (int o = 16; o > 0; o >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
    }
    if (lane) return;
    float M = -INFINITY;
    for (int k = 0; k < S; k++)
        M = fmaxf(M, pm[(size_t)k * N + n]);
    double sum = 0.0;
    for (int k = 0; k < S; k++)
        sum += (double)ps[(size_t)k * N + n] * exp((double)pm[(size_t)k * N + n] - M);
    const float l = (float)(M + log(sum));
    lse[n] = l;
    losses[n] = t >= 0 ? l - dot : 0.0f;
}

// G[n, v - v0] for the columns [v0, v_end) of the chunk (slab row length
// v_end - v0), as kernels/cpu/cce.c forms it; 0 on rows with target -1.
// live (when not NULL) gets 1 for each CPU tile (row n / MOE_CCE_NB, column
// (v - v0) / MOE_CCE_VB of n_vt) with a probability >= eps or a target.
__global__ static void __launch_bounds__(THREADS)
    cce_grad_kernel(float *G, int *live, const float *h, const float *W, const int32_t *target,
                    const float *lse, int N, int D, int v0, int v_end, int n_vt, float scale,
                    float eps) {
    __shared__ float As[BK][BM + PAD], Bs[BK][BN + PAD];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int r0 = blockIdx.x * BM, c0 = v0 + blockIdx.y * BN;
    const size_t ld = (size_t)(v_end - v0);
    float acc[TM][TN];
    logit_tile(acc, h, W, N, v_end, D, r0, c0, As, Bs);
    int alive[2] = {0, 0}; // rows [r0, r0 + 64) and [r0 + 64, r0 + 128)
    for (int i = 0; i < TM; i++) {
        const int n = r0 + ty + 16 * i;
        if (n >= N) break; // rows grow with i
        const int t = target[n];
        const float l = lse[n];
        for (int j = 0; j < TN; j++) {
            const int v = c0 + tx + 16 * j;
            if (v >= v_end) break;
            float g = 0.0f;
            if (t >= 0) {
                const float p = expf(acc[i][j] - l);
                alive[i / 4] |= p >= eps;
                g = p * scale;
                if (v == t) {
                    g -= scale;
                    alive[i / 4] = 1;
                }
            }
            G[(size_t)n * ld + (v - v0)] = g;
        }
    }
    if (!live) return;
    for (int half = 0; half < 2; half++)
        if (alive[half]) // OR: the same result whatever the order of the writers
            atomicOr(&live[(size_t)((r0 + half * MOE_CCE_NB) / MOE_CCE_NB) * n_vt +
                           (c0 - v0) / MOE_CCE_VB],
                     1);
}

// Zeroes G in the tiles nothing kept alive: the CPU skips them.
__global__ static void cce_drop_kernel(float *G, const int *live, int N, int ld, int n_vt) {
    const size_t total = (size_t)N * ld;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t n = i / ld, c = i % ld;
        if (!live[(n / MOE_CCE_NB) * n_vt + c / MOE_CCE_VB]) G[i] = 0.0f;
    }
}

// CUDA_LAUNCH_CHECK for functions with a cleanup label.
static int launched(const char *what, int line) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return 0;
    return moe_fail(MOE_EDEVICE, "%s:%d: %s: %s", __FILE__, line, what, cudaGetErrorString(e));
}

static int cdiv(int a, int b) {
    return (a + b - 1) / b;
}

static int n_splits(int N, int V) {
    const int s = cdiv(SPLIT_BLOCKS, cdiv(N, BM)), vt = cdiv(V, BN);
    return s < 1 ? 1 : s > vt ? vt : s;
}

// Columns per backward chunk: a multiple of MOE_CCE_VB, so chunks start on
// the CPU's tile boundaries, and at most 65535 column tiles (grid y).
static int chunk_cols(int N, int V) {
    const size_t grid_max = (size_t)65535 * BN / MOE_CCE_VB * MOE_CCE_VB;
    size_t vmax = (size_t)cdiv(V, MOE_CCE_VB) * MOE_CCE_VB;
    if (vmax > grid_max) vmax = grid_max;
    size_t vc = moe_cuda_cce_slab_floats() / (size_t)(N > 0 ? N : 1) / MOE_CCE_VB * MOE_CCE_VB;
    if (vc < MOE_CCE_VB) vc = MOE_CCE_VB;
    return (int)(vc > vmax ? vmax : vc);
}

// The scratch bound (moe_cuda_cce_scratch_floats) and the slab size live in
// moe/src/cuda_sizes.c, plain C, so the planner computes them without CUDA.

extern "C" int moe_cuda_cce_forward(float *losses, float *lse, double *mean, const float *h,
                                    const float *W, const int32_t *target, int N, int D, int V,
                                    float *scratch) {
    if (N < 0 || D < 1 || V < 1) return moe_fail(MOE_EINVAL, "cce: N=%d D=%d V=%d", N, D, V);
    *mean = 0.0;
    if (!N) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    int rc = 0, n_valid = 0;
    const int S = n_splits(N, V);
    float *pm = scratch, *ps = scratch + (size_t)S * N, *host = (float *)malloc(N * sizeof(float));
    int32_t *tgt = (int32_t *)malloc(N * sizeof(int32_t));
    double sum = 0.0;
    if (!host || !tgt) {
        rc = moe_fail(MOE_ENOMEM, "cce: host buffers for %d rows", N);
        goto fail;
    }
    MOE_TRY_GOTO(moe_cuda_check_targets(target, N, V, &n_valid, tgt), rc);
    cce_fwd_kernel<<<dim3(cdiv(N, BM), S), THREADS, 0, c.stream>>>(pm, ps, h, W, N, D, V);
    cce_lse_kernel<<<cdiv(N, 8), 256, 0, c.stream>>>(losses, lse, pm, ps, S, h, W, target, N, D);
    MOE_TRY_GOTO(launched("cce forward", __LINE__), rc);
    // The mean as the CPU forms it: float per-row losses summed in row order in double.
    MOE_TRY_GOTO(moe_cuda_download(host, losses, N * sizeof(float)), rc);
    for (int n = 0; n < N; n++)
        sum += host[n];
    *mean = n_valid ? sum / n_valid : 0.0;
fail:
    free(host);
    free(tgt);
    return rc;
}

extern "C" int moe_cuda_cce_backward(float *dh, float *dW, const float *h, const float *W,
                                     const int32_t *target, const float *lse, int N, int D, int V,
                                     float dloss, float filter_eps, float *scratch, long *skipped) {
    if (N < 0 || D < 1 || V < 1) return moe_fail(MOE_EINVAL, "cce: N=%d D=%d V=%d", N, D, V);
    if (!N) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    const int VC = chunk_cols(N, V), n_rt = cdiv(N, MOE_CCE_NB);
    // Tiles are tracked when they can matter: dropped ones (filter_eps > 0) or
    // counted ones. Without either, a tile the CPU would skip (every target
    // ignored) holds zeros here and adds nothing.
    const bool track = filter_eps > 0.0f || skipped;
    float *G = scratch;
    int *live = (int *)(scratch + (size_t)N * VC);
    int *host_live = (int *)malloc(sizeof(int) * n_rt * (VC / MOE_CCE_VB));
    int32_t *tgt = (int32_t *)malloc(N * sizeof(int32_t));
    int rc = 0, n_valid = 0;
    float scale = 0.0f;
    if (!host_live || !tgt) {
        rc = moe_fail(MOE_ENOMEM, "cce: host buffers for %d rows", N);
        goto fail;
    }
    MOE_TRY_GOTO(moe_cuda_check_targets(target, N, V, &n_valid, tgt), rc);
    if (!n_valid) goto fail; // nothing to learn from: rc = 0
    scale = dloss / (float)n_valid;
    for (int v0 = 0; v0 < V; v0 += VC) {
        const int vc = V - v0 < VC ? V - v0 : VC, n_vt = cdiv(vc, MOE_CCE_VB);
        const size_t n_flags = (size_t)n_rt * n_vt;
        if (track && cudaMemsetAsync(live, 0, n_flags * sizeof(int), c.stream) != cudaSuccess) {
            cudaGetLastError();
            rc = moe_fail(MOE_EDEVICE, "%s:%d: cce: clearing tile flags", __FILE__, __LINE__);
            goto fail;
        }
        cce_grad_kernel<<<dim3(cdiv(N, BM), cdiv(vc, BN)), THREADS, 0, c.stream>>>(
            G, track ? live : NULL, h, W, target, lse, N, D, v0, v0 + vc, n_vt, scale, filter_eps);
        MOE_TRY_GOTO(launched("cce backward", __LINE__), rc);
        if (track) {
            MOE_TRY_GOTO(moe_cuda_download(host_live, live, n_flags * sizeof(int)), rc);
            long dead = 0;
            for (size_t i = 0; i < n_flags; i++)
                dead += !host_live[i];
            if (skipped) *skipped += dead;
            if (dead == (long)n_flags) continue; // the whole chunk adds nothing
            if (dead && filter_eps > 0.0f) {
                cce_drop_kernel<<<moe_cuda_blocks((size_t)N * vc, 256), 256, 0, c.stream>>>(
                    G, live, N, vc, n_vt);
                MOE_TRY_GOTO(launched("cce drop", __LINE__), rc);
            }
        }
        // dh [N, D] += G [N, vc] W[v0:v0+vc] and dW[v0:v0+vc] [vc, D] += G^T h.
        MOE_TRY_GOTO(moe_cuda_matmul(dh, G, W + (size_t)v0 * D, N, D, vc, false, false, 1.0f, 1.0f),
                     rc);
        MOE_TRY_GOTO(moe_cuda_matmul(dW + (size_t)v0 * D, G, h, vc, D, N, true, false, 1.0f, 1.0f),
                     rc);
    }
fail:
    free(host_live);
    free(tgt);
    return rc;
}
