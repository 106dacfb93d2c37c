// The inference forward with a KV cache: N new tokens, each at its own
// (cache row, position), through the training forward's math (moe/model.h):
// RMSNorm, q/k/v projections, RoPE at the token's position, causal GQA
// attention over the cached keys, SwiGLU FFN or the MoE block (gate, router
// with no capacity limit and no noise, experts on expert-contiguous rows,
// weighted combine), final norm and LM head. Projections are GEMMs, or GEMVs
// for the few rows of a decode step.
#include "moe/infer.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/nn.h"
#include "kernels/ops.h"
#include "moe/error.h"

#include <cblas.h>
#include <string.h>

// c [n, out] = a [n, in] @ w^T (w [out, in]) + beta * c. Decoding feeds a
// few rows at a time; a GEMM would then spend its time packing w, so up to
// GEMV_ROWS rows go through one GEMV each. Partial and full loads take the
// same path for the same rows, so they stay bit-identical.
enum { GEMV_ROWS = 4 };

// OpenBLAS runs single-threaded inside our pool, so a large GEMV splits its
// output rows over the pool. Parts are multiples of GEMV_ALIGN rows (the GEMV
// kernels' column blocks), so each output sums its products exactly as in one
// GEMV over all rows, whatever the thread count; small GEMVs stay on the
// calling thread, where waking the pool would cost more than it saves.
enum { GEMV_ALIGN = 16, GEMV_SPLIT_MACS = 1 << 17 };

typedef struct {
    float *c;
    const float *a, *w;
    const int8_t *q;
    const float *scale;
    int n, out, in, rows; // rows: output rows per part
    float beta;
} gemv_job;

static int gemv_parts(gemv_job *j) {
    const int T = moe_cpu_threads();
    if (T == 1 || (size_t)j->n * j->out * j->in < GEMV_SPLIT_MACS || j->out < 2 * GEMV_ALIGN) {
        j->rows = j->out;
        return 1;
    }
    // two parts per thread: a thread slowed by another process's work
    // leaves its second part to the others
    int rows = (j->out + 2 * T - 1) / (2 * T);
    rows = (rows + GEMV_ALIGN - 1) / GEMV_ALIGN * GEMV_ALIGN;
    j->rows = rows;
    return (j->out + rows - 1) / rows;
}

static void gemv_part(void *ctx, int i) {
    const gemv_job *j = ctx;
    const int o0 = i * j->rows, m = j->out - o0 < j->rows ? j->out - o0 : j->rows;
    for (int r = 0; r < j->n; r++) {
        float *c = j->c + (size_t)r * j->out + o0;
        if (j->beta == 0.0f) memset(c, 0, sizeof(float) * m);
        cblas_sgemv(CblasRowMajor, CblasNoTrans, m, j->in, 1.0f, j->w + (size_t)o0 * j->in, j->in,
                    j->a + (size_t)r * j->in, 1, j->beta, c, 1);
    }
}

static int linear(float *c, const float *a, const float *w, int n, int out, int in, float beta) {
    if (n > GEMV_ROWS) return moe_ops_cpu.matmul(c, a, w, n, out, in, false, true, 1.0f, beta);
    gemv_job j = {.c = c, .a = a, .w = w, .n = n, .out = out, .in = in, .beta = beta};
    moe_cpu_parallel_for(gemv_parts(&j), gemv_part, &j);
    return 0;
}

// The same for int8 weights q [out, in] with one scale per output row, for
// a few rows: c[r, o] = scale[o] * sum_i q[o, i] * a[r, i], dequantised on
// the fly with fp32 accumulation in 16 lanes (so the compiler vectorises it).
static void qlinear_part(void *ctx, int part) {
    const gemv_job *j = ctx;
    const int o0 = part * j->rows, o1 = j->out - o0 < j->rows ? j->out : o0 + j->rows;
    const int in = j->in;
    for (int r = 0; r < j->n; r++) {
        const float *x = j->a + (size_t)r * in;
        for (int o = o0; o < o1; o++) {
            const int8_t *qo = j->q + (size_t)o * in;
            float lane[16] = {0}, acc = 0.0f;
            int i = 0;
            for (; i + 16 <= in; i += 16)
                for (int l = 0; l < 16; l++)
                    lane[l] += (float)qo[i + l] * x[i + l];
            for (; i < in; i++)
                acc += (float)qo[i] * x[i];
            for (int l = 0; l < 16; l++)
                acc += lane[l];
            j->c[(size_t)r * j->out + o] = acc * j->scale[o];
        }
    }
}

static void qlinear(float *c, const float *a, const int8_t *q, const float *scale, int n, int out,
                    int in) {
    gemv_job j = {.c = c, .a = a, .q = q, .scale = scale, .n = n, .out = out, .in = in};
    moe_cpu_parallel_for(gemv_parts(&j), qlinear_part, &j);
}

static void add_into(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
}

// Expert e's fp32 weights: the loaded block, or the int8 block dequantised
// into m->deq (w = q * scale of its output row).
static const float *expert_weights(moe_infer *m, const moe_infer_layer *y, int slot) {
    const size_t D = m->D, H = y->H, blk = 3 * H * D, nrow = 2 * H + D;
    if (y->experts) return y->experts + (size_t)slot * blk;
    const int8_t *q = y->q + (size_t)slot * blk;
    const float *sc = y->q_scale + (size_t)slot * nrow;
    size_t off = 0;
    for (size_t r = 0; r < nrow; r++) {
        const size_t w = r < 2 * H ? D : H;
        for (size_t c = 0; c < w; c++)
            m->deq[off + c] = (float)q[off + c] * sc[r];
        off += w;
    }
    return m->deq;
}

// y [N, D] = MoE(x [N, D]) for the engine's task.
static int moe_block(moe_infer *m, int l, float *y, const float *x, int N) {
    const moe_ops *ops = &moe_ops_cpu;
    moe_infer_layer *L = &m->layer[l];
    const int D = m->D, E = L->E, H = L->H, k = m->k;
    if (L->task_routed) { // the task embedding's logits, broadcast to every token
        // the layer's GEMM over all task embeddings (the same bits as in
        // training), then row `task` copied to every token
        MOE_TRY(ops->matmul(m->mlogits, L->task_emb, L->gate, m->n_tasks, E, D, false, true, 1.0f,
                            0.0f));
        float row[E];
        memcpy(row, m->mlogits + (size_t)m->task * E, sizeof row);
        for (int n = 0; n < N; n++)
            memcpy(m->mlogits + (size_t)n * E, row, sizeof row);
    } else {
        MOE_TRY(linear(m->mlogits, x, L->gate, N, E, D, 0.0f));
    }
    // expert budget: an expert left out gets softmax weight 0 here, and the
    // plan's usable mask keeps it out of the choice and of group scores
    if (L->allowed)
        for (int n = 0; n < N; n++)
            for (int e = 0; e < E; e++)
                if (!L->allowed[e]) m->mlogits[(size_t)n * E + e] = -1e30f;
    for (int e = 0; e < E; e++)
        m->cap[e] = N;
    int rc = moe_router_forward(&L->plan, m->mlogits, m->task_tok, m->cap, N, E, &m->cfg.router,
                                false, 0);
    if (rc < 0) return moe_fail(rc, "layer %d (MoE): %s", l, moe_last_error());
    const moe_plan *pl = &L->plan;
    MOE_TRY(ops->dispatch_rows(m->row, pl->expert, pl->slot, pl->offsets, N, k));
    MOE_TRY(ops->permute_forward(m->xe, x, m->row, N, k, D));
    for (int e = 0; e < E; e++) {
        const int n = pl->kept[e];
        if (n == 0) continue;
        if (L->slot[e] < 0)
            return moe_fail(MOE_EINVAL,
                            "layer %d routes %d tokens to expert %d, which was not loaded", l, n,
                            e);
        const size_t r0 = (size_t)pl->offsets[e];
        float *ab = m->eab + r0 * 2 * H, *h = m->eh + r0 * H;
        if (L->q && n <= GEMV_ROWS) { // decode rows: int8 GEMV, no dequantised copy
            const size_t s = (size_t)L->slot[e], blk = 3 * (size_t)H * D;
            const int8_t *q = L->q + s * blk;
            const float *sc = L->q_scale + s * (2 * (size_t)H + D);
            qlinear(ab, m->xe + r0 * D, q, sc, n, 2 * H, D);
            MOE_TRY(ops->swiglu_forward(h, ab, n, H));
            qlinear(m->ye + r0 * D, h, q + 2 * (size_t)H * D, sc + 2 * H, n, D, H);
            continue;
        }
        const float *w = expert_weights(m, L, L->slot[e]);
        MOE_TRY(linear(ab, m->xe + r0 * D, w, n, 2 * H, D, 0.0f));
        MOE_TRY(ops->swiglu_forward(h, ab, n, H));
        MOE_TRY(linear(m->ye + r0 * D, h, w + 2 * (size_t)H * D, n, D, H, 0.0f));
    }
    MOE_TRY(ops->unpermute_forward(y, m->ye, m->row, pl->weight, N, k, D));
    if (L->Hs) {
        const int Hs = L->Hs;
        MOE_TRY(linear(m->ab, x, L->shared_w13, N, 2 * Hs, D, 0.0f));
        MOE_TRY(ops->swiglu_forward(m->h, m->ab, N, Hs));
        MOE_TRY(linear(y, m->h, L->shared_w2, N, D, Hs, 1.0f));
    }
    return 0;
}

int moe_infer_forward(moe_infer *m, const int32_t *tok, const int *seq, const int *pos, int N) {
    if (N < 1 || N > m->N_max)
        return moe_fail(MOE_EINVAL, "inference forward: %d tokens, 1..%d allowed", N, m->N_max);
    for (int n = 0; n < N; n++)
        if (seq[n] < 0 || seq[n] >= m->max_batch || pos[n] < 0 || pos[n] >= m->max_seq)
            return moe_fail(MOE_EINVAL,
                            "inference forward: token %d at sequence %d position %d; the cache "
                            "holds %d sequences of %d positions",
                            n, seq[n], pos[n], m->max_batch, m->max_seq);
    const moe_ops *ops = &moe_ops_cpu;
    const int D = m->D, QD = m->Hq * m->hd, KD = m->Hkv * m->hd;
    const float eps = (float)m->cfg.model.norm_eps, theta = (float)m->cfg.model.rope_theta;
    for (int n = 0; n < N; n++)
        m->task_tok[n] = m->task;
    MOE_TRY(moe_cpu_embedding_forward(m->x, tok, m->embed, N, D, m->V));
    for (int l = 0; l < m->L; l++) {
        moe_infer_layer *y = &m->layer[l];
        MOE_TRY(moe_cpu_rmsnorm_forward(m->ln, m->rstd, m->x, y->ln1, N, D, eps));
        MOE_TRY(linear(m->q, m->ln, y->wq, N, QD, D, 0.0f));
        MOE_TRY(linear(m->kk, m->ln, y->wk, N, KD, D, 0.0f));
        MOE_TRY(linear(m->vv, m->ln, y->wv, N, KD, D, 0.0f));
        MOE_TRY(moe_cpu_rope_at(m->q, m->q, pos, N, m->Hq, m->hd, theta));
        MOE_TRY(moe_cpu_rope_at(m->kk, m->kk, pos, N, m->Hkv, m->hd, theta));
        // every new key/value enters the cache before any query reads it
        for (int n = 0; n < N; n++) {
            size_t c = ((size_t)seq[n] * m->max_seq + pos[n]) * KD;
            memcpy(y->kc + c, m->kk + (size_t)n * KD, sizeof(float) * KD);
            memcpy(y->vc + c, m->vv + (size_t)n * KD, sizeof(float) * KD);
        }
        for (int n = 0; n < N; n++) {
            size_t c = (size_t)seq[n] * m->max_seq * KD;
            MOE_TRY(moe_cpu_attention_cached(m->atty + (size_t)n * QD, m->scores,
                                             m->q + (size_t)n * QD, y->kc + c, y->vc + c, pos[n],
                                             m->Hq, m->Hkv, m->hd));
        }
        MOE_TRY(linear(m->mid, m->atty, y->wo, N, D, QD, 0.0f));
        add_into(m->mid, m->x, (size_t)N * D);
        MOE_TRY(moe_cpu_rmsnorm_forward(m->ln, m->rstd, m->mid, y->ln2, N, D, eps));
        if (!y->is_moe) {
            MOE_TRY(linear(m->ab, m->ln, y->w13, N, 2 * m->F, D, 0.0f));
            MOE_TRY(ops->swiglu_forward(m->h, m->ab, N, m->F));
            MOE_TRY(linear(m->x, m->h, y->w2, N, D, m->F, 0.0f));
        } else {
            MOE_TRY(moe_block(m, l, m->x, m->ln, N));
        }
        add_into(m->x, m->mid, (size_t)N * D); // next layer's input = mid + ffn
    }
    MOE_TRY(moe_cpu_rmsnorm_forward(m->ln, m->rstd, m->x, m->norm, N, D, eps));
    return linear(m->logits, m->ln, m->lm_head, N, m->V, D, 0.0f);
}
