// Token-choice top-k routing on the GPU, the twin of router/router.c and
// router/priority.c (kernels/cuda/router_cuda.h):
//   1. one thread per token: softmax (double sum, as the CPU), lse, top-k with
//      ties to the lower expert; with Gumbel noise choices 2..k maximise
//      logit + Gumbel(seed, step, t E + e) as router/router.c topk_row
//   2. slot order: position, or BPR keys (task rank, max prob desc) sorted by
//      a stable radix sort, so equal keys keep token order as the CPU's index
//      tie-break does
//   3. slots: the CPU visits (choice rank j, token in slot order) and gives a
//      pair the next slot of its expert while slots last, so a pair's slot is
//      its rank among the pairs of the same expert in that sequence, and it is
//      kept iff that rank < C_e. Ranks come from per-chunk expert histograms,
//      a per-expert scan over the chunks and a per-chunk pass (see below);
//      the pre-drop counts and the capacity (static, dropless = max count, or
//      given) fall out of the scan.
//   4. offsets, combine weights, aux (E * sum f_e P_e) and z-loss sums in a
//      fixed order (deterministic).
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/noise.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/router_cuda.h"
#include "moe/cuda_sizes.h"

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <math.h>
#include <stdio.h>
#include <string.h>

// ---- 1. softmax, top-k ----------------------------------------------------------------

// gumbel: choice 0 is argmax p, choices j > 0 maximise x_e + g_e in double
// over the experts not yet taken (strictly larger wins: ties to the lower
// expert), g_e = moe_noise_gumbel(seed, step, t E + e) as topk_row. The
// weights still come from p (weights_kernel).
__global__ static void softmax_topk_kernel(float *probs, float *lse, int *choice, int *flags,
                                           const float *logits, int T, int E, int k, int gumbel,
                                           uint64_t seed, uint64_t step) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        const float *x = logits + (size_t)t * E;
        float *p = probs + (size_t)t * E;
        int *ch = choice + (size_t)t * k;
        bool finite = true;
        float m = x[0];
        for (int e = 0; e < E; e++) {
            finite &= isfinite(x[e]);
            if (x[e] > m) m = x[e];
        }
        if (!finite) {
            atomicMin(&flags[0], t);
            for (int e = 0; e < E; e++)
                p[e] = 0.0f;
            for (int j = 0; j < k; j++)
                ch[j] = j; // keeps later kernels in bounds; the call fails
            lse[t] = 0.0f;
            continue;
        }
        double s = 0.0;
        for (int e = 0; e < E; e++) {
            double v = exp((double)x[e] - m);
            s += v;
            p[e] = (float)v;
        }
        double inv = 1.0 / s;
        for (int e = 0; e < E; e++)
            p[e] = (float)(p[e] * inv);
        lse[t] = (float)(m + log(s));
        if (gumbel) {
            for (int j = 0; j < k; j++) {
                int best = -1;
                double best_s = 0.0;
                for (int e = 0; e < E; e++) {
                    bool taken = false;
                    for (int i = 0; i < j; i++)
                        taken |= ch[i] == e;
                    if (taken) continue;
                    double v =
                        j > 0 ? __dadd_rn((double)x[e],
                                          moe_dev_noise_gumbel(seed, step, (uint64_t)t * E + e))
                              : (double)p[e];
                    if (best < 0 || v > best_s) best = e, best_s = v;
                }
                ch[j] = best;
            }
            continue;
        }
        for (int j = 0; j < k; j++) {
            int best = -1;
            float best_s = 0.0f;
            for (int e = 0; e < E; e++) {
                bool taken = false;
                for (int i = 0; i < j; i++)
                    taken |= ch[i] == e;
                if (taken) continue;
                if (best < 0 || p[e] > best_s) best = e, best_s = p[e];
            }
            ch[j] = best;
        }
    }
}

// ---- 3. slot order ---------------------------------------------------------------------

// Ascending key = (task rank: 0 for the highest priority) << 32 | ~bits(max p).
// max p >= 0, so its float bits order like the values; inverting them sorts
// the most confident first.
__global__ static void priority_keys_kernel(uint64_t *keys, int *idx, int *flags,
                                            const float *probs, const int *task_id,
                                            const int *task_rank, int n_tasks, int T, int E) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        const float *p = probs + (size_t)t * E;
        float m = p[0];
        for (int e = 1; e < E; e++)
            if (p[e] > m) m = p[e];
        uint64_t rank = 0;
        if (n_tasks > 0) {
            int id = task_id[t];
            if (id < 0 || id >= n_tasks) {
                atomicMin(&flags[1], t);
                id = 0;
            }
            rank = (uint64_t)task_rank[id];
        }
        keys[t] = rank << 32 | (uint64_t)(0xffffffffu - __float_as_uint(m));
        idx[t] = t;
    }
}

__global__ static void iota_kernel(int *order, int T) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x)
        order[t] = t;
}

// ---- 4. counts, capacity and slots ----------------------------------------------------
// The sequence s = j * T + i (pair order[i], choice j), n = T k entries, is cut
// into chunks of CHUNK. (a) per chunk, how many entries choose each expert
// (all, and among the first choices s < T for the aux loss); (b) per expert,
// an exclusive scan over the chunks gives each chunk's first rank, the totals
// are the pre-drop counts; (c) per chunk, an entry's rank is its chunk's base
// plus the entries of the same expert before it in the chunk (warp match +
// per-warp counts, in sequence order). Integer counts: exact and deterministic.

enum { CHUNK_THREADS = 256, CHUNK_ITEMS = 4, CHUNK = CHUNK_THREADS * CHUNK_ITEMS };
enum { CHUNK_WARPS = CHUNK_THREADS / 32 };

__device__ static inline int seq_choice(const int *choice, const int *order, long s, int T, int k,
                                        size_t *a) {
    int j = (int)(s / T), i = (int)(s % T);
    *a = (size_t)order[i] * k + j;
    return choice[*a];
}

// hist [C, E] and hist1 [C, E] (first choices only); shared: 2E ints.
__global__ static void chunk_hist_kernel(int *hist, int *hist1, const int *choice, const int *order,
                                         int T, int k, int E) {
    extern __shared__ int sh[];
    int *h = sh, *h1 = sh + E;
    for (int e = threadIdx.x; e < 2 * E; e += blockDim.x)
        sh[e] = 0;
    __syncthreads();
    const long n = (long)T * k, c = blockIdx.x;
    for (int r = 0; r < CHUNK_ITEMS; r++) {
        long s = c * CHUNK + (long)r * CHUNK_THREADS + threadIdx.x;
        if (s >= n) break;
        size_t a;
        int e = seq_choice(choice, order, s, T, k, &a);
        atomicAdd(&h[e], 1);
        if (s < T) atomicAdd(&h1[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        hist[c * E + e] = h[e];
        hist1[c * E + e] = h1[e];
    }
}

// One block per expert: base [C, E] = exclusive scan over chunks, counts[e]
// = total, aux_f[e] = (first choices or all) / T.
__global__ static void chunk_scan_kernel(int *base, int *counts, float *aux_f, const int *hist,
                                         const int *hist1, int C, int E, int T, int all_k) {
    typedef cub::BlockScan<int, CHUNK_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    __shared__ double sh[32];
    const int e = blockIdx.x;
    int running = 0;
    double f1 = 0.0;
    for (int c0 = 0; c0 < C; c0 += CHUNK_THREADS) {
        int c = c0 + threadIdx.x;
        int v = c < C ? hist[(size_t)c * E + e] : 0, ex, total;
        if (c < C) f1 += hist1[(size_t)c * E + e];
        scan_t(tmp).ExclusiveSum(v, ex, total);
        __syncthreads();
        if (c < C) base[(size_t)c * E + e] = running + ex;
        running += total;
    }
    f1 = moe_block_sum(f1, sh);
    if (threadIdx.x == 0) {
        counts[e] = running;
        float f = all_k ? (float)running : (float)f1; // exact: integers < 2^24
        aux_f[e] = T ? f / T : 0.0f;
    }
}

// Capacity (c_static < 0: dropless, C_e = max count; given: capacity holds C_e),
// kept = min(count, C_e), offsets = exclusive sum of kept. E is small: one thread.
__global__ static void capacity_kernel(int *capacity, int *kept, int *offsets, const int *counts,
                                       int E, int c_static, int given) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int c_max = 0;
    for (int e = 0; e < E; e++)
        c_max = max(c_max, counts[e]);
    offsets[0] = 0;
    for (int e = 0; e < E; e++) {
        capacity[e] = c_static < 0 ? c_max : given ? capacity[e] : c_static;
        kept[e] = min(counts[e], capacity[e]);
        offsets[e + 1] = offsets[e] + kept[e];
    }
}

// One block per chunk; shared: per-warp counts [CHUNK_WARPS, E] and the
// chunk's running counts [E].
__global__ static void assign_kernel(int *expert, int *slot, const int *choice, const int *order,
                                     const int *base, const int *capacity, int T, int k, int E) {
    extern __shared__ int sh[];
    int *wc = sh, *run = sh + CHUNK_WARPS * E;
    for (int i = threadIdx.x; i < (CHUNK_WARPS + 1) * E; i += blockDim.x)
        sh[i] = 0;
    __syncthreads();
    const long n = (long)T * k, c = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = 0; r < CHUNK_ITEMS; r++) {
        long s = c * CHUNK + (long)r * CHUNK_THREADS + threadIdx.x;
        bool valid = s < n;
        size_t a = 0;
        int e = valid ? seq_choice(choice, order, s, T, k, &a) : -1;
        unsigned peers = __match_any_sync(0xffffffffu, e);
        int rank_w = __popc(peers & ((1u << lane) - 1u)); // same expert, lower lanes
        if (valid && rank_w == 0) wc[warp * E + e] = __popc(peers);
        __syncthreads();
        if (valid) {
            int rank = base[c * E + e] + run[e] + rank_w;
            for (int w = 0; w < warp; w++)
                rank += wc[w * E + e];
            bool keep = rank < capacity[e];
            expert[a] = keep ? e : -1;
            slot[a] = keep ? rank : -1;
        }
        __syncthreads();
        for (int x = threadIdx.x; x < E; x += blockDim.x) {
            int add = 0;
            for (int w = 0; w < CHUNK_WARPS; w++) {
                add += wc[w * E + x];
                wc[w * E + x] = 0;
            }
            run[x] += add;
        }
        __syncthreads();
    }
}

// ---- 5. weights and losses -------------------------------------------------------------

__global__ static void weights_kernel(float *weight, const float *probs, const int *expert, int T,
                                      int E, int k, int normalize) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        const float *p = probs + (size_t)t * E;
        const int *ex = expert + (size_t)t * k;
        float *w = weight + (size_t)t * k;
        double s = 0.0;
        for (int j = 0; j < k; j++)
            s += ex[j] >= 0 ? p[ex[j]] : 0.0;
        for (int j = 0; j < k; j++) {
            w[j] = ex[j] < 0 ? 0.0f : p[ex[j]];
            if (normalize) w[j] = s > 0 ? (float)(w[j] / s) : 0.0f;
        }
    }
}

enum { LOSS_TILE = 1024 };

// Block b sums tokens [b LOSS_TILE, (b+1) LOSS_TILE): part[b, e] = sum_t p[t, e]
// (thread (g, e) reads row t = g, g + G, ...: coalesced over e), part[b, E] =
// sum_t lse_t^2. Fixed order everywhere: deterministic. blockDim = G E.
__global__ static void loss_part_kernel(double *part, const float *probs, const float *lse, int T,
                                        int E) {
    extern __shared__ double shd[];
    const int e = threadIdx.x % E, g = threadIdx.x / E, G = blockDim.x / E;
    const int t0 = blockIdx.x * LOSS_TILE, t1 = min(T, t0 + LOSS_TILE);
    double acc = 0.0, z = 0.0;
    for (int t = t0 + g; t < t1; t += G)
        acc += probs[(size_t)t * E + e];
    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x)
        z += (double)lse[t] * lse[t];
    shd[threadIdx.x] = acc;
    shd[blockDim.x + threadIdx.x] = z;
    __syncthreads();
    double *out = part + (size_t)blockIdx.x * (E + 1);
    if (g == 0) {
        double s = 0.0;
        for (int i = 0; i < G; i++)
            s += shd[i * E + e];
        out[e] = s;
    }
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int i = 0; i < (int)blockDim.x; i++)
            s += shd[blockDim.x + i];
        out[E] = s;
    }
}

// Block e sums part[b, e] over the nb tiles: red[e] (e = E: the z sum).
__global__ static void loss_final_kernel(double *red, const double *part, int nb, int E) {
    __shared__ double sh[32];
    const int e = blockIdx.x;
    double s = 0.0;
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        s += part[(size_t)b * (E + 1) + e];
    s = moe_block_sum(s, sh);
    if (threadIdx.x == 0) red[e] = s;
}

// ---- host side -------------------------------------------------------------------------

static_assert((int)CHUNK == (int)MOE_CUDA_ROUTER_CHUNK && (int)LOSS_TILE == (int)MOE_CUDA_LOSS_TILE,
              "moe/cuda_sizes.h sizes the plan with these");

extern "C" int moe_cuda_sort_tmp_query(int n, size_t *bytes) {
    *bytes = 0;
    CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, *bytes, (const uint64_t *)nullptr,
                                             (uint64_t *)nullptr, (const int *)nullptr,
                                             (int *)nullptr, n));
    return 0;
}

// Sizes from moe_cuda_plan_sizes (the planner's), memory from moe_cuda_alloc
// (tracked: moe_cuda_mem_peak).
extern "C" int moe_cuda_plan_alloc(moe_cuda_plan *p, int T_max, int E, int k) {
    memset(p, 0, sizeof *p);
    if (T_max < 0 || E < 1 || k < 1 || k > E)
        return moe_fail(MOE_EINVAL, "cuda plan: T_max=%d E=%d k=%d", T_max, E, k);
    if (E > 1024)
        return moe_fail(MOE_EINVAL, "cuda router: %d experts (at most 1024 on the GPU)", E);
    p->T_max = T_max, p->E = E, p->k = k;
    MOE_TRY(moe_cuda_sort_tmp_query(T_max ? T_max : 1, &p->sort_tmp_bytes));
    void **ptrs[MOE_CUDA_PLAN_BUFS] = {
        (void **)&p->expert,   (void **)&p->choice,   (void **)&p->slot,      (void **)&p->weight,
        (void **)&p->probs,    (void **)&p->lse,      (void **)&p->counts,    (void **)&p->kept,
        (void **)&p->capacity, (void **)&p->offsets,  (void **)&p->aux_f,     (void **)&p->order,
        (void **)&p->keys,     (void **)&p->keys_alt, (void **)&p->order_alt, &p->sort_tmp,
        (void **)&p->hist,     (void **)&p->hist1,    (void **)&p->base,      (void **)&p->part,
        (void **)&p->red,      (void **)&p->flags,    (void **)&p->task_rank,
    };
    size_t bytes[MOE_CUDA_PLAN_BUFS];
    moe_cuda_plan_sizes(T_max, E, k, p->sort_tmp_bytes, bytes);
    for (size_t i = 0; i < MOE_CUDA_PLAN_BUFS; i++) {
        if (!(*ptrs[i] = moe_cuda_alloc(bytes[i]))) {
            char why[512];
            snprintf(why, sizeof why, "%s", moe_last_error());
            moe_cuda_plan_free(p);
            return moe_fail(MOE_ENOMEM, "cuda plan for T=%d E=%d k=%d: %s", T_max, E, k, why);
        }
    }
    // host mirrors: the doubles first, then floats and ints
    const size_t host_bytes =
        sizeof(double) * (E + 1) + sizeof(float) * E + sizeof(int) * (6 * E + 3 + MOE_MAX_TASKS);
    if (!(p->host = moe_cuda_host_alloc(host_bytes))) {
        char why[512];
        snprintf(why, sizeof why, "%s", moe_last_error());
        moe_cuda_plan_free(p);
        return moe_fail(MOE_ENOMEM, "cuda plan host mirrors (E=%d): %s", E, why);
    }
    p->red_h = (double *)p->host;
    p->aux_f_h = (float *)(p->red_h + E + 1);
    p->counts_h = (int *)(p->aux_f_h + E);
    p->kept_h = p->counts_h + E;
    p->capacity_h = p->kept_h + E;
    p->offsets_h = p->capacity_h + E;
    p->flags_h = p->offsets_h + E + 1;
    p->cap_in_h = p->flags_h + 2;
    p->task_rank_in_h = p->cap_in_h + E;
    return 0;
}

extern "C" void moe_cuda_plan_free(moe_cuda_plan *p) {
    void *ptrs[] = {p->expert, p->choice,   p->slot,      p->weight,   p->probs,    p->lse,
                    p->counts, p->kept,     p->capacity,  p->offsets,  p->aux_f,    p->order,
                    p->keys,   p->keys_alt, p->order_alt, p->sort_tmp, p->hist,     p->hist1,
                    p->base,   p->part,     p->red,       p->flags,    p->task_rank};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++)
        moe_cuda_free(ptrs[i]); // NULL is skipped
    moe_cuda_host_free(p->host);
    memset(p, 0, sizeof *p);
}

// Rank of each task's priority among the distinct priorities, highest first.
static void task_ranks(int *rank, const moe_router_config *cfg) {
    for (int i = 0; i < cfg->n_task_priority; i++) {
        int r = 0;
        for (int j = 0; j < cfg->n_task_priority; j++) {
            bool higher = cfg->task_priority[j] > cfg->task_priority[i], seen = false;
            for (int l = 0; l < j && higher; l++) // count each distinct value once
                seen |= cfg->task_priority[l] == cfg->task_priority[j];
            r += higher && !seen;
        }
        rank[i] = r;
    }
}

// The kernels route token choice only: an expert-choice config (plan k = E,
// experts pick tokens) would get token-choice plans without a word.
static int expert_choice_refused(void) {
    return moe_fail(MOE_EINVAL, "cuda router: router.type = expert_choice is not supported on "
                                "the GPU (CPU router only)");
}

__global__ static void reset_flags_kernel(int *flags) {
    flags[0] = flags[1] = INT32_MAX; // no non-finite logit, no bad task id yet
}

extern "C" int moe_cuda_router_forward(moe_cuda_plan *p, const float *logits, const int *task_id,
                                       const int *capacity, int T, int E,
                                       const moe_router_config *cfg, bool training, uint64_t step) {
    const int k = cfg->top_k;
    if (T < 0 || T > p->T_max || E != p->E || k != p->k)
        return moe_fail(
            MOE_EINVAL,
            "cuda router: call sizes T=%d E=%d k=%d do not fit the plan (T_max=%d E=%d k=%d)", T, E,
            k, p->T_max, p->E, p->k);
    MOE_TRY(moe_router_config_check(cfg, E));
    if (cfg->type != MOE_ROUTER_TOKEN_CHOICE) return expert_choice_refused();
    if (cfg->score != MOE_SCORE_SOFTMAX || cfg->route_scale != 1.0)
        return moe_fail(MOE_EINVAL, "cuda router: router.score = sigmoid and router.route_scale "
                                    "!= 1 are not supported on the GPU (CPU router only)");
    if (cfg->bias_update_rate != 0)
        return moe_fail(MOE_EINVAL,
                        "cuda router: router.bias_update_rate = %g (auxiliary-loss-free "
                        "balancing) is not supported on the GPU (CPU router only)",
                        cfg->bias_update_rate);
    if (moe_router_groups_active(cfg))
        return moe_fail(MOE_EINVAL, "cuda router: group-limited routing (router.n_groups, "
                                    "router.topk_groups) is not supported on the GPU (CPU router "
                                    "only)");
    bool priority = cfg->slot_order == MOE_SLOT_PRIORITY && T > 1;
    if (priority && cfg->n_task_priority > 0 && !task_id)
        return moe_fail(MOE_EINVAL, "router.task_priority is set but no task ids were given");
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    p->T = T;
    const int threads = 128;
    const unsigned blocks = moe_cuda_blocks(T, threads);
    // Inputs reach the device by kernel or from the page-locked mirrors: a
    // copy from pageable memory may wait for the stream.
    reset_flags_kernel<<<1, 1, 0, c.stream>>>(p->flags);
    CUDA_LAUNCH_CHECK();

    // 1. probabilities, lse, choices
    const int gumbel = training && cfg->noise == MOE_NOISE_GUMBEL && k > 1;
    softmax_topk_kernel<<<blocks, threads, 0, c.stream>>>(p->probs, p->lse, p->choice, p->flags,
                                                          logits, T, E, k, gumbel, cfg->seed, step);
    CUDA_LAUNCH_CHECK();
    // 3. slot order (before the counts: the slot pass walks the sequence in it)
    if (priority) {
        // the mirror is free: the last forward's copy finished before its sync
        memset(p->task_rank_in_h, 0, sizeof(int) * MOE_MAX_TASKS);
        task_ranks(p->task_rank_in_h, cfg);
        if (cfg->n_task_priority > 0)
            CUDA_TRY(cudaMemcpyAsync(p->task_rank, p->task_rank_in_h, sizeof(int) * MOE_MAX_TASKS,
                                     cudaMemcpyHostToDevice, c.stream));
        priority_keys_kernel<<<blocks, threads, 0, c.stream>>>(p->keys, p->order_alt, p->flags,
                                                               p->probs, task_id, p->task_rank,
                                                               cfg->n_task_priority, T, E);
        CUDA_LAUNCH_CHECK();
        size_t bytes = p->sort_tmp_bytes;
        CUDA_TRY(cub::DeviceRadixSort::SortPairs(p->sort_tmp, bytes, p->keys, p->keys_alt,
                                                 p->order_alt, p->order, T, 0, 64, c.stream));
    } else if (T > 0) {
        iota_kernel<<<blocks, threads, 0, c.stream>>>(p->order, T);
        CUDA_LAUNCH_CHECK();
    }
    // 2 + 4. counts, capacity, slots
    const long n = (long)T * k;
    const unsigned chunks = (unsigned)((n + CHUNK - 1) / CHUNK);
    if (chunks) {
        chunk_hist_kernel<<<chunks, CHUNK_THREADS, 2 * E * sizeof(int), c.stream>>>(
            p->hist, p->hist1, p->choice, p->order, T, k, E);
        CUDA_LAUNCH_CHECK();
    }
    chunk_scan_kernel<<<E, CHUNK_THREADS, 0, c.stream>>>(
        p->base, p->counts, p->aux_f, p->hist, p->hist1, (int)chunks, E, T, cfg->aux_counts_all_k);
    CUDA_LAUNCH_CHECK();
    int given = capacity != NULL && cfg->capacity_factor > 0;
    if (given) {
        memcpy(p->cap_in_h, capacity, E * sizeof(int));
        CUDA_TRY(cudaMemcpyAsync(p->capacity, p->cap_in_h, E * sizeof(int), cudaMemcpyHostToDevice,
                                 c.stream));
    }
    capacity_kernel<<<1, 32, 0, c.stream>>>(p->capacity, p->kept, p->offsets, p->counts, E,
                                            moe_capacity_static(cfg, T, E), given);
    CUDA_LAUNCH_CHECK();
    if (chunks) {
        assign_kernel<<<chunks, CHUNK_THREADS, (CHUNK_WARPS + 1) * E * sizeof(int), c.stream>>>(
            p->expert, p->slot, p->choice, p->order, p->base, p->capacity, T, k, E);
        CUDA_LAUNCH_CHECK();
    }
    // 5. weights, loss sums
    if (T > 0) {
        weights_kernel<<<blocks, threads, 0, c.stream>>>(p->weight, p->probs, p->expert, T, E, k,
                                                         cfg->normalize_topk);
        CUDA_LAUNCH_CHECK();
    }
    const int tiles = (T + LOSS_TILE - 1) / LOSS_TILE;
    if (tiles) {
        const int G = E >= 256 ? 1 : 256 / E, lt = G * E;
        loss_part_kernel<<<tiles, lt, 2 * lt * sizeof(double), c.stream>>>(p->part, p->probs,
                                                                           p->lse, T, E);
        CUDA_LAUNCH_CHECK();
    }
    loss_final_kernel<<<E + 1, 256, 0, c.stream>>>(p->red, p->part, tiles, E);
    CUDA_LAUNCH_CHECK();

    // The one read-back, into the page-locked mirrors: error flags, the loss
    // sums and the statistics the layer and the trainer read.
    const double *red = p->red_h;
    const float *aux_f = p->aux_f_h;
    const int *flags = p->flags_h;
    const struct {
        void *dst;
        const void *src;
        size_t bytes;
    } back[] = {
        {p->flags_h, p->flags, 2 * sizeof(int)},
        {p->red_h, p->red, (E + 1) * sizeof(double)},
        {p->aux_f_h, p->aux_f, E * sizeof(float)},
        {p->counts_h, p->counts, E * sizeof(int)},
        {p->kept_h, p->kept, E * sizeof(int)},
        {p->capacity_h, p->capacity, E * sizeof(int)},
        {p->offsets_h, p->offsets, (E + 1) * sizeof(int)},
    };
    for (size_t i = 0; i < sizeof back / sizeof *back; i++)
        CUDA_TRY(cudaMemcpyAsync(back[i].dst, back[i].src, back[i].bytes, cudaMemcpyDeviceToHost,
                                 c.stream));
    CUDA_TRY(cudaStreamSynchronize(c.stream));
    if (flags[0] != INT32_MAX)
        return moe_fail(MOE_ENUMERIC, "a logit of token %d is not finite", flags[0]);
    if (flags[1] != INT32_MAX)
        return moe_fail(MOE_EINVAL,
                        "a task id of token %d has no entry in router.task_priority (%d entries)",
                        flags[1], cfg->n_task_priority);
    double aux = 0.0;
    for (int e = 0; e < E; e++)
        aux += aux_f[e] * (T ? red[e] / T : 0.0);
    p->aux_loss = (float)(E * aux);
    p->z_loss = T ? (float)(red[E] / T) : 0.0f;
    return 0;
}

// One thread per token, the CPU's formulas (router/router.c) term for term.
__global__ static void router_bwd_kernel(float *dlogits, const float *dweight, const float *probs,
                                         const float *lse, const int *expert, const float *weight,
                                         const float *aux_f, int T, int E, int k, int normalize,
                                         double aux_c, double z_scale) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        const float *p = probs + (size_t)t * E;
        const int *ex = expert + (size_t)t * k;
        const float *w = weight + (size_t)t * k;
        const float *dw = dweight ? dweight + (size_t)t * k : NULL;
        float *dl = dlogits + (size_t)t * E;
        double s = 0.0, dot_w = 0.0;
        for (int j = 0; j < k; j++) {
            if (ex[j] < 0) continue;
            s += p[ex[j]];
            if (dw) dot_w += (double)dw[j] * w[j];
        }
#define DPK(j)                                                                                     \
    (ex[j] < 0 || !dw ? 0.0 : normalize ? (s > 0 ? (dw[j] - dot_w) / s : 0.0) : (double)dw[j])
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += p[e] * aux_c * aux_f[e];
        for (int j = 0; j < k; j++)
            if (ex[j] >= 0) dot += p[ex[j]] * DPK(j);
        double zc = 2.0 * z_scale * lse[t] / T;
        for (int e = 0; e < E; e++) {
            double dp = aux_c * aux_f[e];
            for (int j = 0; j < k; j++)
                if (ex[j] == e) dp += DPK(j);
            dl[e] += (float)(p[e] * (dp - dot) + zc * p[e]);
        }
#undef DPK
    }
}

extern "C" int moe_cuda_router_backward(float *dlogits, const float *dweight,
                                        const moe_cuda_plan *p, const moe_router_config *cfg,
                                        float aux_scale, float z_scale) {
    int T = p->T, E = p->E, k = p->k;
    if (cfg->type != MOE_ROUTER_TOKEN_CHOICE) return expert_choice_refused();
    if (cfg->score != MOE_SCORE_SOFTMAX || cfg->route_scale != 1.0)
        return moe_fail(MOE_EINVAL, "cuda router: router.score = sigmoid and router.route_scale "
                                    "!= 1 are not supported on the GPU (CPU router only)");
    if (T == 0) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    double aux_c = (double)aux_scale * E / T;
    router_bwd_kernel<<<moe_cuda_blocks(T, 128), 128, 0, c.stream>>>(
        dlogits, dweight, p->probs, p->lse, p->expert, p->weight, p->aux_f, T, E, k,
        cfg->normalize_topk, aux_c, z_scale);
    CUDA_LAUNCH_CHECK();
    return 0;
}
