// Data sources. Synthetic: five tasks of rising difficulty (copy, reverse,
// sort, caesar, add), each sample tagged with its task; rows pack samples of
// one task; only answer tokens are scored. The validation split is disjoint
// by construction: a sample belongs to the split chosen by a hash of its
// input. Token files (moe/shards.h, memory-mapped): llm.c shards, nanoGPT
// uint16 files and UTF-8 text as bytes, by glob, one corpus or one per task.
#include "moe/data.h"
#include "moe/alloc.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/json_error.h"
#include "moe/rng.h"
#include "moe/shards.h"
#include "moe/tokenizer.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
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

// Windows per piece of len tokens: inputs at stride T, each with T+1 tokens.
static long windows_of(long len, int T) {
    return len >= (long)T + 1 ? (len - 1) / T : 0;
}

// Element x of a seeded permutation of [0, n): a 4-round Feistel network on
// the smallest even-bit domain >= n, cycle-walked back into [0, n) (the domain
// is below 4n, so about 4 steps at most on average). O(1) per element, no
// table: window order is a pure function of (seed, task, split, epoch).
static uint64_t permute(uint64_t x, uint64_t n, uint64_t key) {
    if (n <= 1) return 0;
    int bits = 64 - __builtin_clzll(n - 1);
    bits += bits & 1;
    const int h = bits / 2;
    const uint64_t mask = (1ull << h) - 1;
    do {
        uint64_t L = x >> h, R = x & mask;
        for (uint64_t r = 0; r < 4; r++) {
            uint64_t t = L ^ (moe_hash4(key, r, R, 0x9E37) & mask);
            L = R;
            R = t;
        }
        x = L << h | R;
    } while (x >= n);
    return x;
}

// The task of training row `row` (data.task_sampling's probabilities).
static int train_task(const moe_data *d, uint64_t row) {
    double u = moe_u01(moe_hash4(d->seed, 0x7A5C, row, 0));
    for (int t = 0; t < d->n_tasks - 1; t++)
        if (u < d->task_cdf[t]) return t;
    return d->n_tasks - 1;
}

// Training row -> (task, how many earlier rows drew that task), counted
// forward from the memo (rows are asked for in increasing order; going back,
// as a resume into an older run does, recounts from row 0).
static void train_slot(moe_data *d, uint64_t row, int *task, uint64_t *j) {
    if (row < d->memo_row) {
        d->memo_row = 0;
        memset(d->memo_count, 0, sizeof d->memo_count);
    }
    for (; d->memo_row < row; d->memo_row++)
        d->memo_count[train_task(d, d->memo_row)]++;
    *task = train_task(d, row);
    *j = d->memo_count[*task];
}

static void file_row(moe_data *d, int split, uint64_t row, int32_t *in, int32_t *tg,
                     int32_t *task) {
    int t = 0;
    uint64_t j = row;
    if (d->n_tasks > 1 && split == MOE_SPLIT_VAL)
        t = (int)(row % (uint64_t)d->n_tasks), j = row / (uint64_t)d->n_tasks;
    else if (d->n_tasks > 1)
        train_slot(d, row, &t, &j);
    const moe_data_part *p = &d->part[t][split];
    const uint64_t n = (uint64_t)p->n_windows, epoch = j / n;
    uint64_t w = j % n;
    if (d->shuffle) w = permute(w, n, moe_hash4(d->seed, 0x5EED + (uint64_t)t, split, epoch));
    int lo = 0, hi = p->n_seg - 1; // the piece holding window w
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if ((uint64_t)p->cum[mid] <= w)
            lo = mid;
        else
            hi = mid - 1;
    }
    const moe_data_seg *s = &p->seg[lo];
    const moe_token_file *f = &d->files[s->file];
    long start = s->start + (long)(w - (uint64_t)p->cum[lo]) * d->T;
    for (int i = 0; i < d->T; i++) {
        in[i] = moe_token_at(f, start + i);
        tg[i] = moe_token_at(f, start + i + 1);
    }
    *task = t;
}

int moe_data_batch(moe_data *d, int split, uint64_t index, int32_t *inputs, int32_t *targets,
                   int32_t *task) {
    for (int r = 0; r < d->B; r++) {
        uint64_t row = index * d->B + r;
        int32_t *in = inputs + (size_t)r * d->T, *tg = targets + (size_t)r * d->T;
        if (d->kind == 0)
            synth_row(d, split, row, in, tg, &task[r]);
        else
            file_row(d, split, row, in, tg, &task[r]);
    }
    return 0;
}

long moe_data_val_distinct_batches(const moe_data *d) {
    if (d->kind == 0) return -1;
    // row r goes to task r % n_tasks as its (r / n_tasks)-th row: task t's
    // first repeat is row n_windows * n_tasks + t
    uint64_t first = UINT64_MAX;
    for (int t = 0; t < d->n_tasks; t++) {
        const uint64_t r = (uint64_t)d->part[t][MOE_SPLIT_VAL].n_windows * d->n_tasks + t;
        if (r < first) first = r;
    }
    return (long)(first / (uint64_t)d->B);
}

int moe_data_next(moe_data *d, int split, int32_t *inputs, int32_t *targets, int32_t *task) {
    MOE_TRY(moe_data_batch(d, split, d->cursor[split], inputs, targets, task));
    d->cursor[split]++;
    return 0;
}

static int add_seg(moe_data_part *p, int file, long start, long len, int T) {
    p->n_tokens += len;
    p->n_pieces += len > 0;
    if (len > p->max_piece) p->max_piece = len;
    long w = windows_of(len, T);
    p->n_used += w > 0 ? w * T + 1 : 0;
    if (w == 0) return 0;
    moe_data_seg *seg = realloc(p->seg, sizeof *seg * (size_t)(p->n_seg + 1));
    if (!seg) return moe_fail(MOE_ENOMEM, "data: out of memory");
    p->seg = seg;
    seg[p->n_seg++] = (moe_data_seg){file, start, w};
    p->n_windows += w;
    return 0;
}

// Opens every file pattern names and adds its tokens to the task's parts:
// split < 0 splits each file (train head, validation tail of val_fraction).
static int add_files(moe_data *d, moe_token_format fmt, const char *key, const char *pattern,
                     int task, int split) {
    char **paths;
    int n;
    MOE_TRY(moe_glob_paths(key, pattern, &paths, &n));
    int rc = 0;
    moe_token_file *files = realloc(d->files, sizeof *files * (size_t)(d->n_files + n));
    if (!files)
        rc = moe_fail(MOE_ENOMEM, "%s: out of memory", key);
    else
        d->files = files;
    for (int i = 0; rc == 0 && i < n; i++) {
        moe_token_file *f = &d->files[d->n_files];
        if ((rc = moe_token_file_open(f, paths[i], fmt, d->V)) < 0) break;
        int idx = d->n_files++;
        // tokens [0, cut) train, [cut, len) validation
        long len = f->n_tokens;
        long cut = split < 0                  ? (long)(len * (1.0 - d->val_fraction))
                   : split == MOE_SPLIT_TRAIN ? len
                                              : 0;
        d->n_tokens += len;
        d->n_train += cut;
        rc = add_seg(&d->part[task][MOE_SPLIT_TRAIN], idx, 0, cut, d->T);
        if (rc == 0) rc = add_seg(&d->part[task][MOE_SPLIT_VAL], idx, cut, len - cut, d->T);
    }
    moe_glob_free(paths, n);
    return rc;
}

// A file of files[split, n_files) (data.val_path's) that is also one of
// files[0, split) (data.path's), by identity however it is named; NULL if none.
static const char *shared_file(const moe_data *d, int split) {
    for (int v = split; v < d->n_files; v++) {
        struct stat sv, st;
        if (stat(d->files[v].path, &sv) != 0) continue;
        for (int t = 0; t < split; t++)
            if (stat(d->files[t].path, &st) == 0 && st.st_dev == sv.st_dev &&
                st.st_ino == sv.st_ino)
                return d->files[v].path;
    }
    return NULL;
}

static int finish_part(moe_data_part *p) {
    p->cum = malloc(sizeof *p->cum * (size_t)(p->n_seg + 1));
    if (!p->cum) return moe_fail(MOE_ENOMEM, "data: out of memory");
    p->cum[0] = 0;
    for (int i = 0; i < p->n_seg; i++)
        p->cum[i + 1] = p->cum[i] + p->seg[i].n_windows;
    return 0;
}

// Training task probabilities from each task's training windows n_i:
// proportional n_i, uniform, or temperature n_i^(1/T) (multilingual MT). The
// temperature weights are exp((log n_i - max_j log n_j) / T): n_i^(1/T)
// overflows for T below ~0.015 (inf / inf = NaN), while these lie in (0, 1]
// with the largest task's 1, so a tiny T gives that task p = 1.
static void task_probabilities(moe_data *d, const moe_config *cfg) {
    double w[MOE_MAX_TASKS], sum = 0, acc = 0, log_max = -INFINITY;
    for (int t = 0; t < d->n_tasks; t++)
        log_max = fmax(log_max, log((double)d->part[t][MOE_SPLIT_TRAIN].n_windows));
    for (int t = 0; t < d->n_tasks; t++) {
        double n = (double)d->part[t][MOE_SPLIT_TRAIN].n_windows;
        w[t] = cfg->data.task_sampling == MOE_TASK_SAMPLING_UNIFORM ? 1.0
               : cfg->data.task_sampling == MOE_TASK_SAMPLING_TEMPERATURE
                   ? (n > 0 ? exp((log(n) - log_max) / cfg->data.task_temperature) : 0)
                   : n;
        sum += w[t];
    }
    for (int t = 0; t < d->n_tasks; t++)
        d->task_cdf[t] = (acc += w[t] / sum);
}

static int open_files(moe_data *d, const moe_config *cfg, bool val_only) {
    const char *kind = cfg->data.kind;
    moe_token_format fmt = !strcmp(kind, "text")      ? MOE_TOKENS_TEXT
                           : !strcmp(kind, "nanogpt") ? MOE_TOKENS_NANOGPT
                                                      : MOE_TOKENS_LLMC;
    d->kind = fmt == MOE_TOKENS_TEXT ? 2 : 1;
    if (fmt == MOE_TOKENS_TEXT && d->V < 256)
        return moe_fail(MOE_EINVAL, "text data needs model.vocab_size >= 256, it is %d", d->V);
    const bool tasks = cfg->data.n_tasks > 0 && cfg->data.task_paths[0][0];
    d->n_tasks = tasks ? cfg->data.n_tasks : 1;
    for (int t = 0; t < d->n_tasks; t++) {
        snprintf(d->task_names[t], MOE_NAME_MAX, "%s", tasks ? cfg->data.tasks[t] : "all");
        char key[64 + MOE_NAME_MAX];
        snprintf(key, sizeof key, tasks ? "data.tasks.%s" : "data.path", cfg->data.tasks[t]);
        const char *pattern = tasks ? cfg->data.task_paths[t] : cfg->data.path;
        const bool val_files = !tasks && cfg->data.val_path[0];
        if (!(val_files && val_only))
            MOE_TRY(add_files(d, fmt, key, pattern, t, val_files ? MOE_SPLIT_TRAIN : -1));
        const int n_train_files = d->n_files;
        if (val_files)
            MOE_TRY(add_files(d, fmt, "data.val_path", cfg->data.val_path, t, MOE_SPLIT_VAL));
        if (val_files && !val_only) d->val_in_train = shared_file(d, n_train_files);
        for (int s = 0; s < 2; s++) {
            const moe_data_part *p = &d->part[t][s];
            const char *name = s == MOE_SPLIT_VAL && val_files ? cfg->data.val_path : pattern;
            const bool none = p->n_windows == 0 && !(s == MOE_SPLIT_TRAIN && val_files && val_only);
            if (none && p->n_pieces > 1) // the total may be plenty: say it is per file
                return moe_fail(MOE_EFORMAT,
                                "%s: no file holds a %s window of %d tokens (windows do not cross "
                                "files): the largest of its %d files holds %ld tokens%s, %ld in "
                                "all; use fewer, larger files (moe prepare --shard-tokens) or a "
                                "smaller model.seq_len",
                                name, s ? "validation" : "training", d->T + 1, p->n_pieces,
                                p->max_piece, s && !val_files ? " in its data.val_fraction" : "",
                                p->n_tokens);
            if (none)
                return moe_fail(MOE_EFORMAT,
                                "%s: %ld tokens are too few for %s windows of %d tokens%s", name,
                                p->n_tokens, s ? "validation" : "training", d->T + 1,
                                s && !val_files ? " (data.val_fraction of each file)" : "");
            MOE_TRY(finish_part(&d->part[t][s]));
        }
    }
    if (!val_only) task_probabilities(d, cfg); // no training rows are drawn
    long train_tokens = 0, used = 0;
    for (int t = 0; t < d->n_tasks; t++)
        train_tokens += d->part[t][MOE_SPLIT_TRAIN].n_tokens,
            used += d->part[t][MOE_SPLIT_TRAIN].n_used;
    d->unused_share = train_tokens > 0 ? (double)(train_tokens - used) / (double)train_tokens : 0;
    return 0;
}

static int data_open(moe_data *d, const moe_config *cfg, bool val_only) {
    memset(d, 0, sizeof *d);
    d->B = cfg->train.batch_size;
    d->T = cfg->model.seq_len;
    d->V = cfg->model.vocab_size;
    d->seed = cfg->train.seed;
    d->val_fraction = cfg->data.val_fraction;
    d->shuffle = cfg->data.shuffle;
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
    int rc = open_files(d, cfg, val_only);
    if (rc < 0) moe_data_close(d);
    return rc;
}

int moe_data_open(moe_data *d, const moe_config *cfg) {
    return data_open(d, cfg, false);
}

int moe_data_open_val(moe_data *d, const moe_config *cfg) {
    return data_open(d, cfg, true);
}

// One folder's manifest against the model's tokenizer (moe_data_check_tokenizer).
static int check_manifest(const char *dir, const char *spec, const struct moe_tokenizer *tok) {
    char p[MOE_PATH_MAX + 16];
    if (snprintf(p, sizeof p, "%s/manifest.json", dir) >= (int)sizeof p) return 0;
    // Mapped, not json_load_file: a FIFO there would block the run forever.
    const void *text = NULL;
    size_t len = 0;
    int rc = moe_map_regular(p, &text, &len);
    if (rc == MOE_ENOTFOUND) return 0;
    if (rc < 0) return rc;
    json_error_t jerr;
    json_t *m = json_loadb(text ? text : "", len, 0, &jerr); // an empty file maps to NULL
    moe_unmap(text, len);
    if (!m) {
        moe_json_fail(MOE_EINVAL, p, &jerr);
        return moe_fail(MOE_EINVAL,
                        "%s (the manifest moe prepare writes beside its token files; prepare "
                        "them again, or remove it)",
                        moe_last_error());
    }
    // Every manifest moe prepare wrote says "format": "llm.c" and names its
    // tokenizer and vocab_size: one without them is refused, not passed (a
    // manifest edited down to nothing would skip the check). Another format
    // string is another program's manifest (a checkpoint's) and passes.
    const json_t *jf = json_object_get(m, "format");
    if (!json_is_string(jf)) {
        json_decref(m);
        return moe_fail(MOE_EINVAL,
                        "%s: format is %s; moe prepare writes \"format\": \"llm.c\" (prepare "
                        "the token files again, or remove it)",
                        p, jf ? "not a string" : "missing");
    }
    if (strcmp(json_string_value(jf), "llm.c")) {
        json_decref(m);
        return 0;
    }
    // Present but of another type: refused, not taken as absent (the check
    // would pass silently). tokenizer_hash may be absent: bytes have none, and
    // prepares before it was recorded wrote none.
    static const char *const fields[] = {"tokenizer", "tokenizer_hash", "vocab_size"};
    for (int i = 0; i < 3; i++) {
        const json_t *v = json_object_get(m, fields[i]);
        if (!v && i != 1) {
            json_decref(m);
            return moe_fail(MOE_EINVAL,
                            "%s: %s is missing; moe prepare always writes it (prepare the "
                            "token files again)",
                            p, fields[i]);
        }
        if (v && !(i < 2 ? json_is_string(v) : json_is_integer(v) && json_integer_value(v) > 0)) {
            json_decref(m);
            return moe_fail(MOE_EINVAL, "%s: %s is not %s", p, fields[i],
                            i < 2 ? "a string" : "a positive integer");
        }
    }
    const char *mt = json_string_value(json_object_get(m, "tokenizer"));
    const char *mh = json_string_value(json_object_get(m, "tokenizer_hash"));
    const json_t *jv = json_object_get(m, "vocab_size");
    const long mv = json_is_integer(jv) ? (long)json_integer_value(jv) : -1;
    const long cv = tok ? moe_tok_vocab_size(tok) : 256;
    char ch[24] = "";
    if (tok) snprintf(ch, sizeof ch, "%016" PRIx64, moe_tok_hash(tok));
    const bool m_bytes = mt && !strcmp(mt, "bytes");
    if ((mv >= 0 && mv != cv) || (mh && ch[0] && strcmp(mh, ch)) || (mt && m_bytes != !tok))
        rc = moe_fail(MOE_EINVAL,
                      "%s: token files prepared with tokenizer %s (%ld pieces%s%s), but "
                      "model.tokenizer = %s (%ld pieces%s%s): train with the tokenizer they were "
                      "prepared with, or prepare them again with --tokenizer %s",
                      dir, mt ? mt : "?", mv, mh ? ", hash " : "", mh ? mh : "", spec, cv,
                      ch[0] ? ", hash " : "", ch, spec);
    json_decref(m);
    return rc;
}

int moe_data_check_tokenizer(const moe_data *d, const char *spec, const struct moe_tokenizer *tok) {
    char dir[MOE_PATH_MAX], last[MOE_PATH_MAX] = "";
    for (int i = 0; i < d->n_files; i++) {
        const char *path = d->files[i].path, *slash = strrchr(path, '/');
        if (!slash)
            snprintf(dir, sizeof dir, ".");
        else
            snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
        if (!strcmp(dir, last)) continue; // a glob's files share their folder
        snprintf(last, sizeof last, "%s", dir);
        MOE_TRY(check_manifest(dir, spec, tok));
    }
    return 0;
}

void moe_data_close(moe_data *d) {
    for (int i = 0; i < d->n_files; i++)
        moe_token_file_close(&d->files[i]);
    free(d->files);
    d->files = NULL;
    d->n_files = 0;
    for (int t = 0; t < MOE_MAX_TASKS; t++)
        for (int s = 0; s < 2; s++) {
            free(d->part[t][s].seg);
            free(d->part[t][s].cum);
            d->part[t][s] = (moe_data_part){0};
        }
}
