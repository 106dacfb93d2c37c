// Generation over the KV-cache forward: each prompt is prefilled by one
// forward, then every unfinished sequence advances one token per forward
// (batched decode). Greedy or temperature/top-k sampling; sample i of prompt b
// draws from hash(seed, b, i) with b counted over all prompts (o->first), so the
// draw does not depend on the batch (the logits may, in the last bits: decode
// steps of more than 4 rows use GEMMs). A model's vocab_size may exceed its
// tokenizer's (rounded up for the GEMMs): ids past the tokenizer never come out.
#include "moe/error.h"
#include "moe/infer.h"
#include "moe/rng.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// a ranks below b in (logit desc, id asc): the sampling order of the top k.
static inline bool ranks_below(const float *l, int a, int b) {
    return l[a] < l[b] || (l[a] == l[b] && a > b);
}

static void heap_down(int *h, int n, int i, const float *l) {
    for (;;) {
        int c = 2 * i + 1, m = i;
        if (c < n && ranks_below(l, h[c], h[m])) m = c;
        if (c + 1 < n && ranks_below(l, h[c + 1], h[m])) m = c + 1;
        if (m == i) return;
        int t = h[i];
        h[i] = h[m], h[m] = t, i = m;
    }
}

// idx[0..k) = the k best ids of l[0..V) in (logit desc, id asc) order, best
// first: a heap of the best k so far with the worst at the root, O(V log k)
// (most ids lose to the root at the first compare), then drained. Ids arrive
// in ascending order, so a tie with the root never replaces it: the same list
// as k passes of selection over (logit, id), the order sampling walks.
static void top_k_ids(int *idx, const float *l, int V, int k) {
    for (int v = 0; v < k; v++) { // sift up each of the first k
        int i = v;
        idx[i] = v;
        while (i > 0 && ranks_below(l, idx[i], idx[(i - 1) / 2])) {
            int t = idx[i];
            idx[i] = idx[(i - 1) / 2], idx[(i - 1) / 2] = t, i = (i - 1) / 2;
        }
    }
    for (int v = k; v < V; v++)
        if (l[v] > l[idx[0]]) {
            idx[0] = v;
            heap_down(idx, k, 0, l);
        }
    for (int n = k; n > 1;) { // drain: the root (worst left) goes last
        int t = idx[0];
        idx[0] = idx[--n], idx[n] = t;
        heap_down(idx, n, 0, l);
    }
}

int moe_sample_token(const float *logits, int V, const moe_gen_opts *o, uint64_t b, uint64_t i,
                     int *idx) {
    if (o->n_vocab > 0 && o->n_vocab < V) V = o->n_vocab; // the rest cannot be decoded
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (o->temperature <= 0) return best;
    // the top_k largest logits (ties to the lower id), best first; all ids in
    // id order without top-k. Then softmax(l / T) over them.
    int k = o->top_k > 0 && o->top_k < V ? o->top_k : V;
    if (k < V)
        top_k_ids(idx, logits, V, k);
    else
        for (int v = 0; v < V; v++)
            idx[v] = v;
    double sum = 0.0; // two passes over the same exp() values: no [k] buffer
    for (int j = 0; j < k; j++)
        sum += exp(((double)logits[idx[j]] - logits[best]) / o->temperature);
    double u = moe_u01(moe_hash4(o->seed, b, i, 0x53414D504C45ull)) * sum, acc = 0.0;
    for (int j = 0; j < k; j++) {
        acc += exp(((double)logits[idx[j]] - logits[best]) / o->temperature);
        if (u < acc) return idx[j];
    }
    return idx[k - 1];
}

int moe_generate(moe_infer *m, int B, const int32_t *const *prompt, const int *n_prompt,
                 const moe_gen_opts *o, int32_t *out, int *n_out, moe_gen_stats *st) {
    memset(st, 0, sizeof *st);
    if (B < 1 || B > m->max_batch)
        return moe_fail(MOE_EINVAL, "generate: %d prompts, the cache holds %d", B, m->max_batch);
    if (o->max_new < 0) return moe_fail(MOE_EINVAL, "generate: max_new %d < 0", o->max_new);
    int *pos = malloc(sizeof(int) * m->N_max), *seq = malloc(sizeof(int) * m->N_max);
    int32_t *tok = malloc(sizeof(int32_t) * m->N_max);
    bool *done = calloc((size_t)B, sizeof(bool));
    int *row = malloc(sizeof(int) * B), *idx = malloc(sizeof(int) * m->V);
    int rc = 0;
    if (!pos || !seq || !tok || !done || !row || !idx)
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "generate: out of memory"), rc);
    for (int b = 0; b < B; b++) {
        n_out[b] = 0;
        if (n_prompt[b] < 1 || n_prompt[b] > m->max_seq)
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "prompt %llu has %d tokens; 1..%d fit the context",
                                  (unsigned long long)(o->first + b + 1), n_prompt[b], m->max_seq),
                         rc);
    }
    double t0 = now();
    for (int b = 0; b < B; b++) { // prefill: one forward per prompt
        for (int i = 0; i < n_prompt[b]; i++)
            seq[i] = b, pos[i] = i;
        MOE_TRY_GOTO(moe_infer_forward(m, prompt[b], seq, pos, n_prompt[b]), rc);
        st->prefill_tokens += n_prompt[b];
        if (o->max_new == 0) {
            done[b] = true;
            continue;
        }
        const float *last = m->logits + (size_t)(n_prompt[b] - 1) * m->V;
        int32_t t = moe_sample_token(last, m->V, o, o->first + (uint64_t)b, 0, idx);
        out[(size_t)b * o->max_new] = t;
        n_out[b] = 1;
        done[b] = t == o->stop || o->max_new == 1 || n_prompt[b] >= m->max_seq;
    }
    st->prefill_s = now() - t0;
    t0 = now();
    for (;;) { // decode: every unfinished sequence feeds its last token
        int N = 0;
        for (int b = 0; b < B; b++) {
            if (done[b]) continue;
            tok[N] = out[(size_t)b * o->max_new + n_out[b] - 1];
            seq[N] = b;
            pos[N] = n_prompt[b] + n_out[b] - 1;
            row[N++] = b;
        }
        if (N == 0) break;
        MOE_TRY_GOTO(moe_infer_forward(m, tok, seq, pos, N), rc);
        st->decode_tokens += N;
        for (int n = 0; n < N; n++) {
            const int b = row[n];
            int32_t t = moe_sample_token(m->logits + (size_t)n * m->V, m->V, o,
                                         o->first + (uint64_t)b, (uint64_t)n_out[b], idx);
            out[(size_t)b * o->max_new + n_out[b]++] = t;
            done[b] =
                t == o->stop || n_out[b] >= o->max_new || n_prompt[b] + n_out[b] >= m->max_seq;
        }
    }
    st->decode_s = now() - t0;
fail:
    free(pos);
    free(seq);
    free(tok);
    free(done);
    free(row);
    free(idx);
    return rc;
}
