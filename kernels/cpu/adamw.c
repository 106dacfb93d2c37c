// Optimizer ops of the CPU table: one AdamW step (Loshchilov & Hutter, arXiv
// 1711.05101; bias-corrected moments, decoupled weight decay) with the
// gradient-clipping scale folded in (per-element decay mask: the op table's;
// decayed ranges and fp32 or bf16 moments: the trainer's), the sum of squares
// behind the gradient norm, and a plain scaling. The trainer's optimizer (trainer/optim.c) calls
// these. Both passes run in fixed chunks over the thread pool: the update is
// elementwise and the sum of squares adds chunk sums in chunk order, so the
// results do not depend on the thread count.
#include "kernels/cpu/cpu.h"
#include "moe/bf16.h"
#include "moe/error.h"

#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { CHUNK = 1 << 15 }; // elements per task: 128 KiB of each stream

typedef struct {
    float *params, *m, *v;
    uint16_t *m16, *v16; // the ranged pass with bf16 moments: these, not m and v
    const float *grads;
    const uint8_t *decay;
    const size_t *ranges; // the ranged pass: decayed [ranges[2k], ranges[2k + 1])
    int n_ranges;
    size_t n;
    float step_size, rsqrt_bc2, beta1, beta2, eps, lr_wd, grad_scale;
} adamw_job;

// All-float arithmetic so the loop runs on 8-wide vectors: the bias
// corrections fold into two per-step constants, lr / bc1 and 1 / sqrt(bc2)
// (computed in double), since mhat / (sqrt(vhat) + eps) =
// (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps). A double division per element
// made the pass compute-bound at about twice the time of its memory traffic.
// One element's step, with the fused multiply-adds written out: the file is
// built with -ffp-contract=off, so the AVX2 form below does exactly these
// operations per lane and every path (masked, ranged, bf16 moments, vector or
// scalar tail) gives the same bits. Returns the new parameter; m and v get
// the unrounded moments.
static inline float step1(float p, float *m, float *v, float grad, const adamw_job *J, float wd) {
    const float g = grad * J->grad_scale; // the clipped gradient, as a clipping pass would store it
    const float mi = *m = fmaf(J->beta1, *m, (1.0f - J->beta1) * g);
    const float vi = *v = fmaf(J->beta2, *v, (1.0f - J->beta2) * g * g);
    return p - fmaf(wd, p, J->step_size * mi / fmaf(sqrtf(vi), J->rsqrt_bc2, J->eps));
}

#ifdef __AVX2__
typedef struct {
    __m256 beta1, c1, beta2, c2, eps, step_size, rsqrt_bc2, s;
} consts8;

static inline consts8 broadcast(const adamw_job *J) {
    return (consts8){_mm256_set1_ps(J->beta1),     _mm256_set1_ps(1.0f - J->beta1),
                     _mm256_set1_ps(J->beta2),     _mm256_set1_ps(1.0f - J->beta2),
                     _mm256_set1_ps(J->eps),       _mm256_set1_ps(J->step_size),
                     _mm256_set1_ps(J->rsqrt_bc2), _mm256_set1_ps(J->grad_scale)};
}

static inline __m256 step8(__m256 p, __m256 *m, __m256 *v, __m256 grad, const consts8 *k,
                           __m256 wd) {
    const __m256 g = _mm256_mul_ps(grad, k->s);
    *m = _mm256_fmadd_ps(k->beta1, *m, _mm256_mul_ps(k->c1, g));
    *v = _mm256_fmadd_ps(k->beta2, *v, _mm256_mul_ps(_mm256_mul_ps(k->c2, g), g));
    const __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(*v), k->rsqrt_bc2, k->eps);
    return _mm256_sub_ps(
        p, _mm256_fmadd_ps(wd, p, _mm256_div_ps(_mm256_mul_ps(k->step_size, *m), den)));
}

// bf16 <-> float in registers; integer bit operations, so the scalar forms'
// bits (moe/bf16.h).
static inline __m256 widen8(const uint16_t *h) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline void narrow8(uint16_t *h, __m256 f) {
    const __m256i u = _mm256_castps_si256(f), hi = _mm256_srli_epi32(u, 16);
    const __m256i r =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                           _mm256_and_si256(hi, _mm256_set1_epi32(1))),
                          16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    const __m256i out = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    // values < 2^16: the unsigned saturating pack keeps them
    _mm_storeu_si128((__m128i *)h, _mm_packus_epi32(_mm256_castsi256_si128(out),
                                                    _mm256_extracti128_si256(out, 1)));
}
#endif

// The masked pass: a decay byte per element.
static void adamw_chunk(void *ctx, int c) {
    const adamw_job *J = ctx;
    const size_t i0 = (size_t)c * CHUNK, i1 = J->n - i0 < CHUNK ? J->n : i0 + CHUNK;
    float *restrict params = J->params, *restrict m = J->m, *restrict v = J->v;
    const float *restrict grads = J->grads;
    const uint8_t *restrict decay = J->decay;
    size_t i = i0;
#ifdef __AVX2__
    const consts8 k = broadcast(J);
    const __m256 lr_wd = _mm256_set1_ps(J->lr_wd);
    for (; i + 8 <= i1; i += 8) {
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(decay + i)));
        const __m256 off = _mm256_castsi256_ps(_mm256_cmpeq_epi32(d, _mm256_setzero_si256()));
        __m256 mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
        const __m256 p = step8(_mm256_loadu_ps(params + i), &mi, &vi, _mm256_loadu_ps(grads + i),
                               &k, _mm256_andnot_ps(off, lr_wd));
        _mm256_storeu_ps(m + i, mi), _mm256_storeu_ps(v + i, vi), _mm256_storeu_ps(params + i, p);
    }
#endif
    for (; i < i1; i++)
        params[i] = step1(params[i], &m[i], &v[i], grads[i], J, decay[i] ? J->lr_wd : 0.0f);
}

// A step's constants; the caller adds the moments and the decay.
static adamw_job step_job(float *params, const float *grads, size_t n, long step, float lr,
                          float beta1, float beta2, float eps, float weight_decay,
                          float grad_scale) {
    const double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
    return (adamw_job){.params = params,
                       .grads = grads,
                       .n = n,
                       .step_size = (float)(lr / bc1),
                       .rsqrt_bc2 = (float)(1.0 / sqrt(bc2)),
                       .beta1 = beta1,
                       .beta2 = beta2,
                       .eps = eps,
                       .lr_wd = lr * weight_decay,
                       .grad_scale = grad_scale};
}

int moe_cpu_adamw_scaled(float *params, float *m, float *v, const float *grads,
                         const uint8_t *decay, size_t n, long step, float lr, float beta1,
                         float beta2, float eps, float weight_decay, float grad_scale) {
    if (step < 1) return moe_fail(MOE_EINVAL, "adamw: step %ld (1-based)", step);
    adamw_job J = step_job(params, grads, n, step, lr, beta1, beta2, eps, weight_decay, grad_scale);
    J.m = m, J.v = v, J.decay = decay;
    moe_cpu_parallel_for((int)((n + CHUNK - 1) / CHUNK), adamw_chunk, &J);
    return 0;
}

int moe_cpu_adamw(float *params, float *m, float *v, const float *grads, const uint8_t *decay,
                  size_t n, long step, float lr, float beta1, float beta2, float eps,
                  float weight_decay) {
    return moe_cpu_adamw_scaled(params, m, v, grads, decay, n, step, lr, beta1, beta2, eps,
                                weight_decay, 1.0f);
}

// The ranged pass: one decay factor per run of elements [i0, i1), so the
// loop reads params, grads and the moments only (no mask byte). bf16 moments
// are widened (exactly) in registers, stepped by the same arithmetic (the
// step uses the unrounded moments, so the parameter bits are the fp32
// state's from the same moments) and stored back rounded to nearest even.
static void seg_f32(const adamw_job *J, size_t i0, size_t i1, float wd) {
    float *restrict params = J->params, *restrict m = J->m, *restrict v = J->v;
    const float *restrict grads = J->grads;
    size_t i = i0;
#ifdef __AVX2__
    const consts8 k = broadcast(J);
    const __m256 w = _mm256_set1_ps(wd);
    for (; i + 8 <= i1; i += 8) {
        __m256 mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
        const __m256 p =
            step8(_mm256_loadu_ps(params + i), &mi, &vi, _mm256_loadu_ps(grads + i), &k, w);
        _mm256_storeu_ps(m + i, mi), _mm256_storeu_ps(v + i, vi), _mm256_storeu_ps(params + i, p);
    }
#endif
    for (; i < i1; i++)
        params[i] = step1(params[i], &m[i], &v[i], grads[i], J, wd);
}

static void seg_bf16(const adamw_job *J, size_t i0, size_t i1, float wd) {
    float *restrict params = J->params;
    uint16_t *restrict m16 = J->m16, *restrict v16 = J->v16;
    const float *restrict grads = J->grads;
    size_t i = i0;
#ifdef __AVX2__
    const consts8 k = broadcast(J);
    const __m256 w = _mm256_set1_ps(wd);
    for (; i + 8 <= i1; i += 8) {
        __m256 mi = widen8(m16 + i), vi = widen8(v16 + i);
        const __m256 p =
            step8(_mm256_loadu_ps(params + i), &mi, &vi, _mm256_loadu_ps(grads + i), &k, w);
        narrow8(m16 + i, mi), narrow8(v16 + i, vi), _mm256_storeu_ps(params + i, p);
    }
#endif
    for (; i < i1; i++) {
        float mi = moe_bf16_to_float(m16[i]), vi = moe_bf16_to_float(v16[i]);
        params[i] = step1(params[i], &mi, &vi, grads[i], J, wd);
        m16[i] = moe_bf16_round(mi), v16[i] = moe_bf16_round(vi);
    }
}

static void adamw_ranged_chunk(void *ctx, int c) {
    const adamw_job *J = ctx;
    const size_t i0 = (size_t)c * CHUNK, i1 = J->n - i0 < CHUNK ? J->n : i0 + CHUNK;
    const size_t *r = J->ranges;
    int lo = 0, hi = J->n_ranges; // the first range ending after i0
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if (r[2 * mid + 1] <= i0)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (size_t i = i0; i < i1;) {
        const bool in = lo < J->n_ranges && r[2 * lo] <= i;
        size_t end = in ? r[2 * lo + 1] : lo < J->n_ranges ? r[2 * lo] : i1;
        if (end > i1) end = i1;
        if (J->m16)
            seg_bf16(J, i, end, in ? J->lr_wd : 0.0f);
        else
            seg_f32(J, i, end, in ? J->lr_wd : 0.0f);
        if (in && end == r[2 * lo + 1]) lo++;
        i = end;
    }
}

int moe_cpu_adamw_ranged(float *params, void *m, void *v, bool bf16, const float *grads,
                         const size_t *ranges, int n_ranges, size_t n, long step, float lr,
                         float beta1, float beta2, float eps, float weight_decay,
                         float grad_scale) {
    if (step < 1) return moe_fail(MOE_EINVAL, "adamw: step %ld (1-based)", step);
    adamw_job J = step_job(params, grads, n, step, lr, beta1, beta2, eps, weight_decay, grad_scale);
    if (bf16)
        J.m16 = m, J.v16 = v;
    else
        J.m = m, J.v = v;
    J.ranges = ranges, J.n_ranges = n_ranges;
    moe_cpu_parallel_for((int)((n + CHUNK - 1) / CHUNK), adamw_ranged_chunk, &J);
    return 0;
}

// One chunk's sum of squares in 32 double lanes (eight 4-wide fused
// multiply-add chains: enough independent chains to keep up with the loads
// from cache, where four were latency-bound at half the rate), combined in a
// fixed pairwise order. The AVX2 and the scalar forms do the same operations
// per lane, so the same bits.
enum { LANES = 32 };

static double sumsq_block(const float *restrict x, size_t n) {
    double acc[LANES] = {0};
    size_t i = 0;
#ifdef __AVX2__
    __m256d a[LANES / 4];
    for (int j = 0; j < LANES / 4; j++)
        a[j] = _mm256_setzero_pd();
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES / 4; j++) {
            const __m256d y = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * j));
            a[j] = _mm256_fmadd_pd(y, y, a[j]);
        }
    for (int j = 0; j < LANES / 4; j++)
        _mm256_storeu_pd(acc + 4 * j, a[j]);
#else
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] = fma((double)x[i + l], (double)x[i + l], acc[l]);
#endif
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    double s = acc[0];
    for (; i < n; i++)
        s = fma((double)x[i], (double)x[i], s);
    return s;
}

typedef struct {
    const float *x;
    size_t n;
    double *part;
} sumsq_job;

static void sumsq_chunk(void *ctx, int c) {
    const sumsq_job *J = ctx;
    const size_t i0 = (size_t)c * CHUNK;
    J->part[c] = sumsq_block(J->x + i0, J->n - i0 < CHUNK ? J->n - i0 : CHUNK);
}

int moe_cpu_sumsq(double *sumsq, const float *x, size_t n) {
    enum { MAX_CHUNKS = 256 }; // larger tensors take several rounds
    double part[MAX_CHUNKS], s = 0.0;
    for (size_t base = 0; base < n; base += (size_t)MAX_CHUNKS * CHUNK) {
        size_t len = n - base < (size_t)MAX_CHUNKS * CHUNK ? n - base : (size_t)MAX_CHUNKS * CHUNK;
        sumsq_job J = {x + base, len, part};
        int chunks = (int)((len + CHUNK - 1) / CHUNK);
        moe_cpu_parallel_for(chunks, sumsq_chunk, &J);
        for (int c = 0; c < chunks; c++)
            s += part[c];
    }
    *sumsq = s;
    return 0;
}

int moe_cpu_scale(float *x, size_t n, float s) {
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
    return 0;
}
