// Evaluation: validation loss per task on fixed batches, exact-match accuracy
// of greedy answers on the synthetic tasks, and expert usage per task (first
// choices) for every MoE layer.
#include "moe/alloc.h"
#include "moe/error.h"
#include "moe/train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// Greedy decoding of one sample's answer; 1 if it matches exactly.
static int answer_matches(moe_model *m, const moe_sample *s, int32_t *buf, int *ok) {
    int n = s->n_prompt, total = s->n_prompt + s->n_answer;
    *ok = 0;
    if (total > m->T) return 0; // does not fit the context: not scored
    memcpy(buf, s->tok, sizeof(int32_t) * n);
    int32_t task = s->task;
    while (n < total) {
        MOE_TRY(moe_model_forward(m, buf, NULL, &task, 1, n, false, 0));
        const float *row = m->logits + (size_t)(n - 1) * m->V;
        int best = 0;
        for (int v = 1; v < m->V; v++)
            if (row[v] > row[best]) best = v;
        if (best != s->tok[n]) return 0;
        buf[n++] = best;
    }
    *ok = 1;
    return 0;
}

int moe_eval(moe_model *m, moe_data *d, int n_batches, int n_samples, moe_eval_result *r) {
    memset(r, 0, sizeof *r);
    r->n_tasks = d->n_tasks;
    for (int t = 0; t < d->n_tasks; t++)
        snprintf(r->task[t], MOE_NAME_MAX, "%s", d->task_names[t]);
    for (int l = 0; l < m->L; l++)
        if (m->is_moe[l]) r->moe_layer[r->n_moe++] = l;
    r->E = m->usage_E;
    size_t nu = (size_t)r->n_moe * d->n_tasks * (r->E ? r->E : 1);
    r->usage = moe_calloc(nu ? nu : 1, sizeof(long));
    int32_t *in = moe_malloc(sizeof(int32_t) * d->B * d->T),
            *tg = moe_malloc(sizeof(int32_t) * d->B * d->T);
    int32_t *task = moe_malloc(sizeof(int32_t) * d->B);
    long *count = moe_calloc(d->V, sizeof(long));
    int rc = 0;
    if (!r->usage || !in || !tg || !task || !count) {
        rc = moe_fail(MOE_ENOMEM, "eval: out of memory");
        goto fail;
    }
    double sum[MOE_MAX_TASKS] = {0}, all = 0;
    long cnt[MOE_MAX_TASKS] = {0}, n_all = 0;
    m->usage = r->usage;
    for (int b = 0; b < n_batches; b++) {
        MOE_TRY_GOTO(moe_data_batch(d, MOE_SPLIT_VAL, (uint64_t)b, in, tg, task), rc);
        MOE_TRY_GOTO(moe_model_forward(m, in, tg, task, d->B, d->T, false, 0), rc);
        for (int i = 0; i < d->B * d->T; i++) {
            if (tg[i] < 0) continue;
            int t = task[i / d->T];
            sum[t] += m->losses[i];
            cnt[t]++;
            all += m->losses[i];
            n_all++;
            count[tg[i]]++;
        }
    }
    m->usage = NULL;
    r->val_loss = n_all ? all / n_all : NAN;
    for (int t = 0; t < d->n_tasks; t++) {
        r->task_loss[t] = cnt[t] ? sum[t] / cnt[t] : NAN;
        r->accuracy[t] = -1;
    }
    for (int v = 0; v < d->V; v++)
        if (count[v])
            r->unigram_entropy -= (double)count[v] / n_all * log((double)count[v] / n_all);
    if (d->kind == 0 && n_samples > 0) {
        for (int t = 0; t < d->n_tasks; t++) {
            int right = 0, scored = 0;
            for (int i = 0; i < n_samples; i++) {
                moe_sample s;
                int ok;
                moe_synth_sample(d, MOE_SPLIT_VAL, t, (uint64_t)i, &s);
                if (s.n_prompt + s.n_answer > m->T) continue;
                m->dropless = true; // decoding routes without capacity limits
                rc = answer_matches(m, &s, in, &ok);
                m->dropless = false;
                if (rc < 0) goto fail;
                right += ok;
                scored++;
            }
            r->accuracy[t] = scored ? (double)right / scored : -1;
        }
    }
fail:
    m->usage = NULL;
    moe_mfree(in);
    moe_mfree(tg);
    moe_mfree(task);
    moe_mfree(count);
    if (rc < 0) moe_eval_result_free(r);
    return rc;
}

void moe_eval_result_free(moe_eval_result *r) {
    moe_mfree(r->usage);
    r->usage = NULL;
}

void moe_eval_print(const moe_eval_result *r, FILE *f) {
    fprintf(f, "\nvalidation: loss %.4f nats/token (unigram baseline %.4f)\n", r->val_loss,
            r->unigram_entropy);
    fprintf(f, "  %-10s %9s %9s\n", "task", "val loss", "accuracy");
    int unseen = 0; // tasks no validation row held (a batch smaller than the task count)
    for (int t = 0; t < r->n_tasks; t++) {
        if (!isfinite(r->task_loss[t])) {
            fprintf(f, "  %-10s %9s %9s\n", r->task[t], "-", "-");
            unseen++;
            continue;
        }
        fprintf(f, "  %-10s %9.4f ", r->task[t], r->task_loss[t]);
        if (r->accuracy[t] < 0)
            fprintf(f, "%9s\n", "n/a");
        else
            fprintf(f, "%8.1f%%\n", 100.0 * r->accuracy[t]);
    }
    if (unseen)
        fprintf(f,
                "  (-: %d task%s had no validation row, so the loss above covers the others; "
                "more rows per batch (train.batch_size) or eval batches cover every task)\n",
                unseen, unseen > 1 ? "s" : "");
    for (int i = 0; i < r->n_moe; i++) {
        fprintf(f,
                "\nexpert usage, layer %d (share of each task's tokens whose first choice is "
                "the expert):\n  %-10s",
                r->moe_layer[i], "task");
        for (int e = 0; e < r->E; e++)
            fprintf(f, " %5s%-2d", "e", e);
        fputc('\n', f);
        for (int t = 0; t < r->n_tasks; t++) {
            const long *u = r->usage + ((size_t)i * r->n_tasks + t) * r->E;
            long tot = 0;
            for (int e = 0; e < r->E; e++)
                tot += u[e];
            fprintf(f, "  %-10s", r->task[t]);
            for (int e = 0; e < r->E; e++) {
                if (tot)
                    fprintf(f, " %6.1f%%", 100.0 * u[e] / tot);
                else
                    fprintf(f, " %7s", "-");
            }
            fputc('\n', f);
        }
    }
}
