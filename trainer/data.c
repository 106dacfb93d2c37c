// Data sources. Synthetic: five tasks of rising difficulty (copy, reverse,
// sort, caesar, add), each sample tagged with its task; rows pack samples of
// one task; only answer tokens are scored. The validation split is disjoint
// by construction: a sample belongs to the split chosen by a hash of its
// input. Token files: llm.c format (256 x int32 header: magic 20240520,
// version 1, token count; then uint16 tokens); text: UTF-8 bytes.
#include "moe/alloc.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/rng.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *const task_names[] = {"copy", "reverse", "sort", "caesar", "add"};
enum { T_COPY, T_REVERSE, T_SORT, T_CAESAR, T_ADD, N_TASK_FN };

int moe_synth_task_index(const char *name) {
    for (int i = 0; i < N_TASK_FN; i++)
        if (!strcmp(name, task_names[i])) return i;
    return -1;
}

static int cmp_i32(const void *a, const void *b) {
    return (*(const int32_t *)a > *(const int32_t *)b) -
           (*(const int32_t *)a < *(const int32_t *)b);
}

// Writes input and answer of generator fn from hash stream h; returns lengths.
// Letter tasks take 4 random letters; add takes two numbers below 100.
static void generate(int fn, uint64_t h, int32_t *in, int *n_in, int32_t *out, int *n_out) {
    // Fixed-length inputs: the answer sits at a fixed distance from its
    // source, so attention learns the letter tasks within a CPU-minute budget.
    const int L = 4;
    for (int i = 0; i < L; i++)
        in[i] = 'a' + (int)(moe_u01(moe_hash4(h, i, 1, 0)) * 26);
    *n_in = L;
    switch (fn) {
    case T_COPY:
        memcpy(out, in, L * sizeof *in), *n_out = L;
        break;
    case T_REVERSE:
        for (int i = 0; i < L; i++)
            out[i] = in[L - 1 - i];
        *n_out = L;
        break;
    case T_SORT:
        memcpy(out, in, L * sizeof *in);
        qsort(out, L, sizeof *out, cmp_i32);
        *n_out = L;
        break;
    case T_CAESAR:
        for (int i = 0; i < L; i++)
            out[i] = 'a' + (in[i] - 'a' + 3) % 26;
        *n_out = L;
        break;
    case T_ADD: {
        int a = (int)(moe_u01(moe_hash4(h, 2, 0, 0)) * 100);
        int b = (int)(moe_u01(moe_hash4(h, 3, 0, 0)) * 100);
        char buf[16];
        *n_in = snprintf(buf, sizeof buf, "%d+%d", a, b);
        for (int i = 0; i < *n_in; i++)
            in[i] = buf[i];
        *n_out = snprintf(buf, sizeof buf, "%d", a + b);
        for (int i = 0; i < *n_out; i++)
            out[i] = buf[i];
        break;
    }
    }
}

void moe_synth_sample(const moe_data *d, int split, int task, uint64_t index, moe_sample *s) {
    int32_t in[16], out[16];
    int n_in = 0, n_out = 0;
    for (uint64_t attempt = 0;; attempt++) {
        generate(d->task_fn[task], moe_hash4(d->seed, task, index, attempt), in, &n_in, out,
                 &n_out);
        uint64_t key = moe_mix64((uint64_t)task + 0x51ED);
        for (int i = 0; i < n_in; i++)
            key = moe_mix64(key ^ (uint64_t)in[i]);
        int is_val = moe_u01(key) < d->val_fraction;
        if (is_val == (split == MOE_SPLIT_VAL) || attempt > 10000) break;
    }
    s->task = task;
    int n = 0;
    s->tok[n++] = MOE_SYNTH_MARKER + task;
    for (int i = 0; i < n_in; i++)
        s->tok[n++] = in[i];
    s->tok[n++] = '=';
    s->n_prompt = n;
    for (int i = 0; i < n_out; i++)
        s->tok[n++] = out[i];
    s->tok[n++] = '\n';
    s->n_answer = n - s->n_prompt;
}

// One synthetic row of T+1 tokens: samples of one task back to back.
static void synth_row(const moe_data *d, int split, uint64_t row, int32_t *inputs, int32_t *targets,
                      int32_t *task) {
    int t = (int)(moe_u01(moe_hash4(d->seed, split, row, 7)) * d->n_tasks);
    *task = t;
    int pos = 0;
    for (uint64_t j = 0; pos <= d->T; j++) {
        moe_sample s;
        moe_synth_sample(d, split, t, (row << 12) | j, &s);
        int n = s.n_prompt + s.n_answer;
        for (int i = 0; i < n && pos <= d->T; i++, pos++) {
            if (pos < d->T) inputs[pos] = s.tok[i];
            // token i is the target of position pos-1: scored only in the answer
            if (pos > 0) targets[pos - 1] = i >= s.n_prompt ? s.tok[i] : -1;
        }
    }
}

int moe_data_batch(moe_data *d, int split, uint64_t index, int32_t *inputs, int32_t *targets,
                   int32_t *task) {
    for (int r = 0; r < d->B; r++) {
        uint64_t row = index * d->B + r;
        int32_t *in = inputs + (size_t)r * d->T, *tg = targets + (size_t)r * d->T;
        if (d->kind == 0) {
            synth_row(d, split, row, in, tg, &task[r]);
            continue;
        }
        long base = split == MOE_SPLIT_TRAIN ? 0 : d->n_train;
        long len = split == MOE_SPLIT_TRAIN ? d->n_train : d->n_tokens - d->n_train;
        long windows = (len - 1) / d->T; // non-overlapping windows of T+1 tokens
        long start = base + (long)(row % (uint64_t)windows) * d->T;
        for (int i = 0; i < d->T; i++) {
            in[i] = d->tokens[start + i];
            tg[i] = d->tokens[start + i + 1];
        }
        task[r] = 0;
    }
    return 0;
}

int moe_data_next(moe_data *d, int split, int32_t *inputs, int32_t *targets, int32_t *task) {
    MOE_TRY(moe_data_batch(d, split, d->cursor[split], inputs, targets, task));
    d->cursor[split]++;
    return 0;
}

// Reads a whole file; *n gets its size.
static int read_file(const char *path, unsigned char **buf, long *n) {
    FILE *f;
    MOE_TRY(moe_fopen_regular(path, &f));
    struct stat st;
    if (fstat(fileno(f), &st)) {
        fclose(f);
        return moe_fail(MOE_EIO, "%s: cannot stat: %s", path, strerror(errno));
    }
    *n = (long)st.st_size;
    *buf = malloc(*n ? (size_t)*n : 1);
    if (!*buf) {
        fclose(f);
        return moe_fail(MOE_ENOMEM, "%s: %ld bytes: out of memory", path, *n);
    }
    size_t got = fread(*buf, 1, (size_t)*n, f);
    fclose(f);
    if (got != (size_t)*n) {
        free(*buf);
        return moe_fail(MOE_EIO, "%s: short read at byte %zu of %ld", path, got, *n);
    }
    return 0;
}

static uint32_t le32(const unsigned char *p) {
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int load_bin(moe_data *d, const char *path) {
    unsigned char *b;
    long n;
    MOE_TRY(read_file(path, &b, &n));
    int rc = 0;
    if (n < 1024) {
        rc = moe_fail(MOE_EFORMAT, "%s: truncated header: %ld bytes, expected at least 1024", path,
                      n);
        goto fail;
    }
    if (le32(b) != 20240520) {
        rc = moe_fail(MOE_EFORMAT, "%s: byte 0: magic %u, expected 20240520 (llm.c token file)",
                      path, le32(b));
        goto fail;
    }
    if (le32(b + 4) != 1) {
        rc = moe_fail(MOE_EFORMAT, "%s: byte 4: version %u, expected 1", path, le32(b + 4));
        goto fail;
    }
    long ntok = (long)le32(b + 8);
    if (n - 1024 != 2 * ntok) {
        rc = moe_fail(MOE_EFORMAT,
                      "%s: byte 8: header says %ld tokens (%ld bytes) but %ld bytes follow the "
                      "header%s",
                      path, ntok, 2 * ntok, n - 1024, n - 1024 < 2 * ntok ? " (truncated)" : "");
        goto fail;
    }
    d->tokens = moe_malloc(sizeof(int32_t) * (ntok ? ntok : 1));
    if (!d->tokens) {
        rc = moe_fail(MOE_ENOMEM, "%s: %ld tokens: out of memory", path, ntok);
        goto fail;
    }
    for (long i = 0; i < ntok; i++) {
        int32_t t = b[1024 + 2 * i] | b[1024 + 2 * i + 1] << 8;
        if (t >= d->V) {
            rc = moe_fail(MOE_EFORMAT, "%s: byte %ld: token %d >= model.vocab_size %d", path,
                          1024 + 2 * i, t, d->V);
            goto fail;
        }
        d->tokens[i] = t;
    }
    d->n_tokens = ntok;
fail:
    if (rc < 0) moe_data_close(d);
    free(b);
    return rc;
}

// Offset of the first byte that breaks UTF-8, or -1.
static long utf8_bad(const unsigned char *s, long n) {
    for (long i = 0; i < n;) {
        int len = s[i] < 0x80         ? 1
                  : (s[i] >> 5) == 6  ? 2
                  : (s[i] >> 4) == 14 ? 3
                  : (s[i] >> 3) == 30 ? 4
                                      : 0;
        if (!len || i + len > n) return i;
        for (int j = 1; j < len; j++)
            if ((s[i + j] & 0xC0) != 0x80) return i + j;
        i += len;
    }
    return -1;
}

static int load_text(moe_data *d, const char *path) {
    unsigned char *b;
    long n;
    MOE_TRY(read_file(path, &b, &n));
    long bad = utf8_bad(b, n);
    if (bad >= 0) {
        free(b);
        return moe_fail(MOE_EFORMAT, "%s: byte %ld: invalid UTF-8", path, bad);
    }
    d->tokens = moe_malloc(sizeof(int32_t) * (n ? n : 1));
    if (!d->tokens) {
        free(b);
        return moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    }
    for (long i = 0; i < n; i++)
        d->tokens[i] = b[i];
    d->n_tokens = n;
    free(b);
    return 0;
}

int moe_data_open(moe_data *d, const moe_config *cfg) {
    memset(d, 0, sizeof *d);
    d->B = cfg->train.batch_size;
    d->T = cfg->model.seq_len;
    d->V = cfg->model.vocab_size;
    d->seed = cfg->train.seed;
    d->val_fraction = cfg->data.val_fraction;
    const char *kind = cfg->data.kind;
    if (!strcmp(kind, "synthetic")) {
        d->kind = 0;
        d->n_tasks = cfg->data.n_tasks;
        if (d->n_tasks < 1) return moe_fail(MOE_EINVAL, "data.tasks is empty");
        if (d->V < MOE_SYNTH_MARKER + d->n_tasks)
            return moe_fail(MOE_EINVAL, "synthetic data needs model.vocab_size >= %d, it is %d",
                            MOE_SYNTH_MARKER + d->n_tasks, d->V);
        for (int i = 0; i < d->n_tasks; i++) {
            d->task_fn[i] = moe_synth_task_index(cfg->data.tasks[i]);
            if (d->task_fn[i] < 0)
                return moe_fail(MOE_EINVAL,
                                "data.tasks: unknown task '%s' (copy, reverse, sort, caesar, add)",
                                cfg->data.tasks[i]);
            snprintf(d->task_names[i], MOE_NAME_MAX, "%s", cfg->data.tasks[i]);
        }
        return 0;
    }
    d->n_tasks = 1;
    snprintf(d->task_names[0], MOE_NAME_MAX, "%s", "all");
    if (!strcmp(kind, "bin")) {
        d->kind = 1;
        MOE_TRY(load_bin(d, cfg->data.path));
    } else {
        d->kind = 2;
        if (d->V < 256)
            return moe_fail(MOE_EINVAL, "text data needs model.vocab_size >= 256, it is %d", d->V);
        MOE_TRY(load_text(d, cfg->data.path));
    }
    d->n_train = (long)(d->n_tokens * (1.0 - d->val_fraction));
    if (d->n_train < d->T + 1 || d->n_tokens - d->n_train < d->T + 1) {
        long have = d->n_tokens;
        moe_data_close(d);
        return moe_fail(MOE_EFORMAT,
                        "%s: %ld tokens are too few for train and validation windows of %d",
                        cfg->data.path, have, d->T + 1);
    }
    return 0;
}

void moe_data_close(moe_data *d) {
    moe_mfree(d->tokens);
    d->tokens = NULL;
}
