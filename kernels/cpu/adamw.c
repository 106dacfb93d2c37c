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
static void adamw_chunk(void *ctx, int c) {
    const adamw_job *J = ctx;
    const size_t i0 = (size_t)c * CHUNK, i1 = J->n - i0 < CHUNK ? J->n : i0 + CHUNK;
    float *restrict params = J->params, *restrict m = J->m, *restrict v = J->v;
    const float *restrict grads = J->grads;
    const uint8_t *restrict decay = J->decay;
    const float beta1 = J->beta1, beta2 = J->beta2, eps = J->eps, s = J->grad_scale;
    const float step_size = J->step_size, rsqrt_bc2 = J->rsqrt_bc2, lr_wd = J->lr_wd;
    for (size_t i = i0; i < i1; i++) {
        const float g = grads[i] * s; // the clipped gradient, as a clipping pass would store it
        const float mi = m[i] = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
        const float wd = decay[i] ? lr_wd : 0.0f, p = params[i];
        params[i] = p - (step_size * mi / (sqrtf(vi) * rsqrt_bc2 + eps) + wd * p);
    }
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

// The ranged pass: one decay factor per run of elements, so the loop reads
// params, grads and the moments only (no mask byte), and its body is the
// masked one's with wd fixed: the same bits.
static inline void run_f32(float *restrict params, float *restrict m, float *restrict v,
                           const float *restrict grads, size_t n, const adamw_job *J, float wd) {
    const float beta1 = J->beta1, beta2 = J->beta2, eps = J->eps, s = J->grad_scale;
    const float step_size = J->step_size, rsqrt_bc2 = J->rsqrt_bc2;
    for (size_t i = 0; i < n; i++) {
        const float g = grads[i] * s;
        const float mi = m[i] = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
        const float p = params[i];
        params[i] = p - (step_size * mi / (sqrtf(vi) * rsqrt_bc2 + eps) + wd * p);
    }
}

static void seg_f32(const adamw_job *J, size_t i0, size_t i1, float wd) {
    run_f32(J->params + i0, J->m + i0, J->v + i0, J->grads + i0, i1 - i0, J, wd);
}

// bf16 moments: blocks of BLK elements widened (exactly) into float buffers
// that stay in L1, updated by the fp32 loop itself (the same arithmetic, so
// the same parameter bits from the same moments; the step uses the unrounded
// moments), and stored back rounded to nearest even. Three simple loops
// vectorise better than one with the conversions inlined.
enum { BLK = 512 };

// The conversions are integer bit operations, so the AVX2 forms give the
// scalar ones' bits (moe/bf16.h); the scalar loops finish ragged ends.
static void widen(float *restrict out, const uint16_t *restrict h, size_t n) {
    size_t j = 0;
#ifdef __AVX2__
    for (; j + 8 <= n; j += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + j)));
        _mm256_storeu_si256((__m256i *)(out + j), _mm256_slli_epi32(w, 16));
    }
#endif
    for (; j < n; j++)
        out[j] = moe_bf16_to_float(h[j]);
}

static void narrow(uint16_t *restrict h, const float *restrict x, size_t n) {
    size_t j = 0;
#ifdef __AVX2__
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1),
                  quiet = _mm256_set1_epi32(0x40);
    for (; j + 8 <= n; j += 8) {
        const __m256 f = _mm256_loadu_ps(x + j);
        const __m256i u = _mm256_castps_si256(f), hi = _mm256_srli_epi32(u, 16);
        const __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(hi, one)), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
        const __m256i out = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet), nan);
        // values < 2^16: the unsigned saturating pack keeps them
        _mm_storeu_si128((__m128i *)(h + j), _mm_packus_epi32(_mm256_castsi256_si128(out),
                                                              _mm256_extracti128_si256(out, 1)));
    }
#endif
    for (; j < n; j++)
        h[j] = moe_bf16_round(x[j]);
}

static void seg_bf16(const adamw_job *J, size_t i0, size_t i1, float wd) {
    float mt[BLK], vt[BLK];
    for (size_t b = i0; b < i1; b += BLK) {
        const size_t k = i1 - b < BLK ? i1 - b : BLK;
        widen(mt, J->m16 + b, k);
        widen(vt, J->v16 + b, k);
        run_f32(J->params + b, mt, vt, J->grads + b, k, J, wd);
        narrow(J->m16 + b, mt, k);
        narrow(J->v16 + b, vt, k);
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

// One chunk's sum of squares in 16 double lanes (four 4-wide accumulators,
// enough independent FMA chains to keep up with the loads), combined in a
// fixed pairwise order.
static double sumsq_block(const float *restrict x, size_t n) {
    double acc[16] = {0};
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++)
            acc[l] += (double)x[i + l] * x[i + l];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    double s = acc[0];
    for (; i < n; i++)
        s += (double)x[i] * x[i];
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
