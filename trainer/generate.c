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
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int moe_sample_token(const float *logits, int V, const moe_gen_opts *o, uint64_t b, uint64_t i,
                     int *idx) {
    if (o->n_vocab > 0 && o->n_vocab < V) V = o->n_vocab; // the rest cannot be decoded
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (o->temperature <= 0) return best;
    // the top_k largest logits (ties to the lower id); then softmax(l / T)
    int k = o->top_k > 0 && o->top_k < V ? o->top_k : V;
    for (int v = 0; v < V; v++)
        idx[v] = v;
    if (k < V)
        for (int a = 0; a < k; a++)
            for (int c = a + 1; c < V; c++)
                if (logits[idx[c]] > logits[idx[a]] ||
                    (logits[idx[c]] == logits[idx[a]] && idx[c] < idx[a])) {
                    int t = idx[a];
                    idx[a] = idx[c], idx[c] = t;
                }
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
