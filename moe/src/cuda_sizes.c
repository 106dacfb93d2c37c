// Device memory sizes of the CUDA backend (moe/cuda_sizes.h): pure arithmetic
// shared by the allocation code and the planner, so `moe plan` on a machine
// without a GPU predicts what the GPU run allocates. Only cub's radix-sort
// temp storage needs the runtime; without one it is estimated.
#include "moe/cuda_sizes.h"
#include "kernels/cpu/nn.h" // MOE_CCE_NB, MOE_CCE_VB: the cut cross-entropy tiles
#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/router_cuda.h"
#endif

#include <stdint.h>

size_t moe_cuda_granule(size_t bytes) {
    return bytes ? (bytes + 255) / 256 * 256 : 256;
}

void moe_cuda_plan_sizes(int T_max, int E, int k, size_t sort_tmp, size_t out[MOE_CUDA_PLAN_BUFS]) {
    const size_t tm = T_max > 0 ? (size_t)T_max : 1, e = E > 0 ? (size_t)E : 1;
    const size_t tk = tm * (size_t)(k > 0 ? k : 1), te = tm * e;
    const size_t chunks = (tk + MOE_CUDA_ROUTER_CHUNK - 1) / MOE_CUDA_ROUTER_CHUNK;
    const size_t tiles = (tm + MOE_CUDA_LOSS_TILE - 1) / MOE_CUDA_LOSS_TILE;
    const size_t s[MOE_CUDA_PLAN_BUFS] = {
        tk * sizeof(int),
        tk * sizeof(int),
        tk * sizeof(int),
        tk * sizeof(float),
        te * sizeof(float),
        tm * sizeof(float),
        e * sizeof(int),
        e * sizeof(int),
        e * sizeof(int),
        (e + 1) * sizeof(int),
        e * sizeof(float),
        tm * sizeof(int),
        tm * sizeof(uint64_t),
        tm * sizeof(uint64_t),
        tm * sizeof(int),
        sort_tmp + 16,
        chunks * e * sizeof(int),
        chunks * e * sizeof(int),
        chunks * e * sizeof(int),
        tiles * (e + 1) * sizeof(double),
        (e + 1) * sizeof(double),
        2 * sizeof(int),
        MOE_MAX_TASKS * sizeof(int),
    };
    for (int i = 0; i < MOE_CUDA_PLAN_BUFS; i++)
        out[i] = s[i];
}

size_t moe_cuda_sort_tmp_bytes(int n, bool *exact) {
    if (n < 1) n = 1;
#ifdef MOE_HAVE_CUDA
    size_t b = 0;
    if (moe_cuda_device_count(NULL, 0) > 0 && moe_cuda_sort_tmp_query(n, &b) == 0) {
        if (exact) *exact = true;
        return b;
    }
#endif
    if (exact) *exact = false;
    return (size_t)n * (sizeof(uint64_t) + sizeof(int)) + ((size_t)128 << 10);
}

void moe_cuda_layer_sizes(const moe_layer_config *cfg, size_t out[MOE_CUDA_LAYER_BUFS]) {
    const size_t T = (size_t)cfg->T_max, D = (size_t)cfg->D, H = (size_t)cfg->H;
    const size_t E = (size_t)cfg->E, k = (size_t)cfg->router.top_k, Hs = (size_t)cfg->H_shared;
    const size_t R = T * k; // every assignment kept
    // With mini-sequence chunks the expert side holds one chunk of Tc tokens.
    const bool chunked = cfg->n_chunks > 1;
    const size_t Tc = chunked ? (T + (size_t)cfg->n_chunks - 1) / (size_t)cfg->n_chunks : T;
    const size_t Rc = Tc * k;
    const size_t nt = (size_t)cfg->n_tasks, G = nt ? nt : T;
    const size_t jit = cfg->router.noise == MOE_NOISE_JITTER ? G * D : 0;
    const size_t s[MOE_CUDA_LAYER_BUFS] = {
        T * E * 4,       Rc * 4,
        Rc * D * 4,      Rc * 2 * H * 4,
        Rc * H * 4,      Rc * D * 4,
        Tc * 2 * Hs * 4, Tc * Hs * 4,
        T * E * 4,       R * 4,
        Rc * D * 4,      Rc * D * 4,
        Rc * H * 4,      Rc * 2 * H * 4,
        Tc * Hs * 4,     Tc * 2 * Hs * 4,
        jit * 4,         jit * 4,
        jit * 4,         nt * E * 4,
        nt * E * 4,      chunked ? (E + 1) * 4 : 0,
    };
    for (int i = 0; i < MOE_CUDA_LAYER_BUFS; i++)
        out[i] = s[i];
}

void moe_cuda_layer_ep_sizes(const moe_layer_config *cfg, size_t out[MOE_CUDA_EP_BUFS]) {
    const size_t ep = cfg->ep_size > 1 ? (size_t)cfg->ep_size : 0, D = (size_t)cfg->D;
    const size_t H = (size_t)cfg->H, R = ep * (size_t)cfg->T_max * (size_t)cfg->router.top_k;
    const size_t s[MOE_CUDA_EP_BUFS] = {R * D * 4, R * 2 * H * 4, R * H * 4,    R * D * 4,
                                        R * D * 4, R * H * 4,     R * 2 * H * 4};
    for (int i = 0; i < MOE_CUDA_EP_BUFS; i++)
        out[i] = s[i];
}

size_t moe_cuda_layer_bytes(const moe_layer_config *cfg, size_t sort_tmp) {
    size_t s[MOE_CUDA_LAYER_BUFS], p[MOE_CUDA_PLAN_BUFS], q[MOE_CUDA_EP_BUFS], b = 0;
    moe_cuda_layer_ep_sizes(cfg, q);
    for (int i = 0; i < MOE_CUDA_EP_BUFS; i++)
        b += q[i] ? moe_cuda_granule(q[i]) : 0;
    moe_cuda_layer_sizes(cfg, s);
    for (int i = 0; i < MOE_CUDA_LAYER_BUFS; i++)
        b += s[i] ? moe_cuda_granule(s[i]) : 0; // empty buffers are not allocated
    moe_cuda_plan_sizes(cfg->T_max, cfg->E, cfg->router.top_k, sort_tmp, p);
    for (int i = 0; i < MOE_CUDA_PLAN_BUFS; i++)
        b += moe_cuda_granule(p[i]);
    return b;
}

size_t moe_cuda_attention_state_floats(int B, int T, int Hq) {
    return (size_t)B * Hq * T * T;
}

size_t moe_cuda_attention_scratch_floats(int B, int T, int Hq, int Hkv, int hd) {
    (void)Hq, (void)Hkv, (void)hd;
    return (size_t)(B > 0 ? B : 1) * T * T;
}

static size_t slab_floats = (size_t)1 << 24; // 64 MiB of G per chunk

void moe_cuda_cce_set_slab_floats(size_t floats) {
    slab_floats = floats ? floats : (size_t)1 << 24;
}

size_t moe_cuda_cce_slab_floats(void) {
    return slab_floats;
}

static size_t cdiv(size_t a, size_t b) {
    return (a + b - 1) / b;
}

size_t moe_cuda_cce_scratch_floats(int N, int V) {
    if (N < 1 || V < 1) return 0;
    const size_t n = (size_t)N, vmax = cdiv((size_t)V, MOE_CCE_VB) * MOE_CCE_VB;
    const size_t fwd = 2 * ((size_t)MOE_CUDA_CCE_SPLIT_BLOCKS * MOE_CUDA_CCE_BM + n);
    size_t slab = slab_floats > n * MOE_CCE_VB ? slab_floats : n * MOE_CCE_VB;
    if (slab > n * vmax) slab = n * vmax;
    const size_t bwd = slab + cdiv(n, MOE_CCE_NB) * (vmax / MOE_CCE_VB);
    return fwd > bwd ? fwd : bwd;
}

const moe_ops moe_ops_cuda_sizes = {
    .name = "cuda",
    .alloc_size = moe_cuda_granule,
    .attention_state_floats = moe_cuda_attention_state_floats,
    .attention_scratch_floats = moe_cuda_attention_scratch_floats,
};
