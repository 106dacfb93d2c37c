// Evaluation through the inference engine: per-task validation loss of a
// (partial, budgeted or int8) load, and the logits dump that the Hugging Face
// check script compares with the exported model.
#include "kernels/cpu/nn.h"
#include "moe/alloc.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/infer.h"
#include "moe/safetensors.h"
#include "moe/train.h"

#include <stdlib.h>
#include <string.h>

int moe_infer_val_loss(moe_infer *m, void *data, int n_batches, double *loss, long *n) {
    moe_data *d = data;
    if (d->T > m->max_seq)
        return moe_fail(MOE_EINVAL, "validation rows of %d tokens exceed the cache of %d", d->T,
                        m->max_seq);
    int32_t *in = moe_malloc(sizeof(int32_t) * d->B * d->T),
            *tg = moe_malloc(sizeof(int32_t) * d->B * d->T);
    int32_t *task = moe_malloc(sizeof(int32_t) * d->B);
    int *pos = moe_malloc(sizeof(int) * d->T), *seq = moe_calloc((size_t)d->T, sizeof(int));
    float *losses = moe_malloc(sizeof(float) * d->T);
    int rc = 0;
    double sum = 0;
    long cnt = 0;
    if (!in || !tg || !task || !pos || !seq || !losses)
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "eval: out of memory"), rc);
    for (int t = 0; t < d->T; t++)
        pos[t] = t;
    for (int b = 0; b < n_batches; b++) {
        MOE_TRY_GOTO(moe_data_batch(d, MOE_SPLIT_VAL, (uint64_t)b, in, tg, task), rc);
        for (int r = 0; r < d->B; r++) {
            if (task[r] != m->task) continue;
            const int32_t *x = in + (size_t)r * d->T, *y = tg + (size_t)r * d->T;
            MOE_TRY_GOTO(moe_infer_forward(m, x, seq, pos, d->T), rc);
            double mean;
            MOE_TRY_GOTO(moe_cpu_crossentropy_forward(losses, &mean, m->logits, y, d->T, m->V), rc);
            for (int t = 0; t < d->T; t++)
                if (y[t] >= 0) sum += losses[t], cnt++;
        }
    }
    *loss = cnt ? sum / cnt : 0.0;
    *n = cnt;
fail:
    moe_mfree(in);
    moe_mfree(tg);
    moe_mfree(task);
    moe_mfree(pos);
    moe_mfree(seq);
    moe_mfree(losses);
    return rc;
}

// The logits of rows [B, T] of the tokens `in` (tasks `task`) through the
// inference engine of ckpt_dir: one full load per task present, each row one
// prefill, so expert choice with its token-choice fallback routes as
// `moe generate` and an export do.
static int engine_logits(const char *ckpt_dir, moe_data *d, const int32_t *in, const int32_t *task,
                         float *logits) {
    const size_t T = d->T;
    int *pos = moe_malloc(sizeof(int) * T), *seq = moe_calloc(T, sizeof(int));
    int rc = 0;
    if (!pos || !seq) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "eval: out of memory"), rc);
    for (size_t t = 0; t < T; t++)
        pos[t] = (int)t;
    for (int k = 0; k < d->n_tasks && rc == 0; k++) {
        bool used = false;
        for (int r = 0; r < d->B; r++)
            used |= task[r] == k;
        if (!used) continue;
        moe_infer e;
        moe_infer_opts o = {.task = d->n_tasks > 1 ? d->task_names[k] : NULL,
                            .full_load = true,
                            .max_batch = 1,
                            .max_seq = d->T};
        MOE_TRY_GOTO(moe_infer_open(&e, ckpt_dir, &o), rc);
        for (int r = 0; r < d->B && rc == 0; r++) {
            if (task[r] != k) continue;
            if ((rc = moe_infer_forward(&e, in + r * T, seq, pos, d->T)) == 0)
                memcpy(logits + r * T * e.V, e.logits, sizeof(float) * T * e.V);
        }
        moe_infer_free(&e);
    }
fail:
    moe_mfree(pos);
    moe_mfree(seq);
    return rc;
}

int moe_eval_dump_logits(moe_model *m, moe_data *d, const char *ckpt_dir, const char *path) {
    const bool ec = m->cfg.router.type == MOE_ROUTER_EXPERT_CHOICE;
    if (ec && m->cfg.router.ec_fallback != MOE_EC_FALLBACK_TOKEN_CHOICE)
        return moe_fail(MOE_EINVAL,
                        "--dump-logits: router.type = expert_choice routes over a whole batch; "
                        "the dump is for comparing an export, which needs router.ec_fallback = "
                        "token_choice (then the dump routes by token choice, as inference does)");
    const size_t B = d->B, T = d->T, V = m->V;
    int32_t *in = moe_malloc(sizeof(int32_t) * B * T), *tg = moe_malloc(sizeof(int32_t) * B * T);
    int32_t *task = moe_malloc(sizeof(int32_t) * B);
    float *logits = moe_malloc(sizeof(float) * B * T * V);
    int rc = 0;
    if (!in || !tg || !task || !logits)
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "eval: out of memory"), rc);
    MOE_TRY_GOTO(moe_data_batch(d, MOE_SPLIT_VAL, 0, in, tg, task), rc);
    if (ec) {
        MOE_TRY_GOTO(engine_logits(ckpt_dir, d, in, task, logits), rc);
        goto write;
    }
    m->dropless = true; // Mixtral (and Hugging Face) route without capacity limits
    for (size_t r = 0; r < B; r++) {
        rc = moe_model_forward(m, in + r * T, NULL, task + r, 1, (int)T, false, 0);
        if (rc < 0) break;
        memcpy(logits + r * T * V, m->logits, sizeof(float) * T * V);
    }
    m->dropless = false;
    if (rc < 0) goto fail;
write:;
    moe_st_entry e[3] = {
        {"tokens", MOE_ST_I32, 2, {(int64_t)B, (int64_t)T}, in},
        {"task_ids", MOE_ST_I32, 1, {(int64_t)B}, task},
        {"logits", MOE_ST_F32, 3, {(int64_t)B, (int64_t)T, (int64_t)V}, logits},
    };
    MOE_TRY_GOTO(moe_st_write(path, e, 3, NULL), rc);
fail:
    moe_mfree(in);
    moe_mfree(tg);
    moe_mfree(task);
    moe_mfree(logits);
    return rc;
}
