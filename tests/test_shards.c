// Token files read through mmap: llm.c v1/v2 shards, nanoGPT .bin, globs,
// data.val_path, the same windows as the former whole-file reader, shuffled
// epochs that visit every window once, exact resume, file tasks and their
// sampling frequencies, and every kind of bad file refused with its reason.
#include "moe/data.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/shards.h"
#include "moe/train.h"
#include "testutil.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

// An llm.c file: header (magic, version, count) then n tokens tok(i).
static const char *write_llmc(const char *name, int32_t magic, int32_t version, int32_t count,
                              long n, uint32_t (*tok)(long)) {
    const char *p = tu_in_dir(name);
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    int32_t hdr[256] = {magic, version, count};
    ck_assert_int_eq(fwrite(hdr, sizeof hdr, 1, f), 1);
    for (long i = 0; i < n; i++) {
        uint32_t t = tok(i);
        if (version == 2)
            ck_assert_int_eq(fwrite(&t, 4, 1, f), 1);
        else {
            uint16_t s = (uint16_t)t;
            ck_assert_int_eq(fwrite(&s, 2, 1, f), 1);
        }
    }
    ck_assert_int_eq(fclose(f), 0);
    return p;
}

static uint32_t tok_mod200(long i) {
    return (uint32_t)(i % 200);
}
static uint32_t tok_pos(long i) { // unique per position: identifies the window
    return (uint32_t)i;
}
static uint32_t tok_ff(long i) {
    return i == 7 ? 0xFFFFFFFFu : 5;
}
static uint32_t tok_big(long i) {
    return 70000u + (uint32_t)(i % 1000);
}

static moe_config file_cfg(const char *kind, const char *path, int V) {
    moe_config c = tu_small_config();
    snprintf(c.data.kind, sizeof c.data.kind, "%s", kind);
    ck_assert_int_lt(snprintf(c.data.path, sizeof c.data.path, "%s", path), sizeof c.data.path);
    c.model.vocab_size = V;
    c.model.seq_len = 16;
    c.train.batch_size = 4;
    return c;
}

START_TEST(test_llmc_v1_and_v2_tokens_read_back) {
    moe_token_file f;
    const char *p1 = write_llmc("v1.bin", MOE_LLMC_MAGIC, 1, 500, 500, tok_mod200);
    ck_assert_int_eq(moe_token_file_open(&f, p1, MOE_TOKENS_LLMC, 256), 0);
    ck_assert_int_eq(f.width, 2);
    ck_assert_int_eq(f.n_tokens, 500);
    for (long i = 0; i < 500; i++)
        ck_assert_int_eq(moe_token_at(&f, i), i % 200);
    moe_token_file_close(&f);
    const char *p2 = write_llmc("v2.bin", MOE_LLMC_MAGIC, 2, 300, 300, tok_big);
    ck_assert_int_eq(moe_token_file_open(&f, p2, MOE_TOKENS_LLMC, 80000), 0);
    ck_assert_int_eq(f.width, 4);
    for (long i = 0; i < 300; i++)
        ck_assert_int_eq(moe_token_at(&f, i), 70000 + i % 1000);
    moe_token_file_close(&f);
    unsigned char hdr[MOE_LLMC_HEADER];
    moe_llmc_header_fill(hdr, 2, 300);
    int w;
    long n;
    ck_assert_int_eq(moe_llmc_header_parse(hdr, sizeof hdr, 1024 + 1200, "x", &w, &n), 0);
    ck_assert_int_eq(w, 4);
    ck_assert_int_eq(n, 300);
}
END_TEST

START_TEST(test_nanogpt_raw_uint16) {
    const char *p = tu_in_dir("train.bin");
    FILE *f = fopen(p, "wb");
    for (int i = 0; i < 400; i++) {
        uint16_t t = (uint16_t)(i * 7 % 250);
        fwrite(&t, 2, 1, f);
    }
    fclose(f);
    moe_config c = file_cfg("nanogpt", p, 256);
    c.data.shuffle = false;
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    ck_assert_int_eq(d.n_tokens, 400);
    int32_t in[64], tg[64], task[4];
    ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_TRAIN, 1, in, tg, task), 0);
    for (int i = 0; i < 64; i++) { // rows 4..7: windows at 16 * row
        long pos = (4 + i / 16) * 16 + i % 16;
        ck_assert_int_eq(in[i], pos * 7 % 250);
        ck_assert_int_eq(tg[i], (pos + 1) * 7 % 250);
    }
    moe_data_close(&d);
    f = fopen(p, "ab");
    fputc(1, f); // an odd byte count is not uint16 tokens
    fclose(f);
    ck_assert_int_eq(moe_data_open(&d, &c), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "not a whole number of uint16 tokens"));
}
END_TEST

// Reads the window of one row (first input token and the row's task).
static void row0(moe_data *d, int split, uint64_t batch, int r, int32_t *first, int32_t *task) {
    int32_t in[4 * 16], tg[4 * 16], tk[4];
    ck_assert_int_eq(moe_data_batch(d, split, batch, in, tg, tk), 0);
    *first = in[r * 16];
    *task = tk[r];
}

START_TEST(test_glob_sorted_and_val_path) {
    // 2 train shards named out of order, and one validation file
    write_llmc("train_001.bin", MOE_LLMC_MAGIC, 2, 161, 161, tok_big);
    write_llmc("train_000.bin", MOE_LLMC_MAGIC, 2, 161, 161, tok_pos);
    write_llmc("val_000.bin", MOE_LLMC_MAGIC, 1, 81, 81, tok_mod200);
    char pat[600];
    snprintf(pat, sizeof pat, "%s/train_*.bin", tu_dir);
    moe_config c = file_cfg("llmc", pat, 80000);
    snprintf(c.data.val_path, sizeof c.data.val_path, "%s", tu_in_dir("val_*.bin"));
    c.data.shuffle = false;
    moe_data d;
    ck_assert_msg(moe_data_open(&d, &c) == 0, "%s", moe_last_error());
    ck_assert_int_eq(d.n_files, 3);
    ck_assert_int_eq(d.part[0][MOE_SPLIT_TRAIN].n_windows, 20); // 10 per 161-token shard
    ck_assert_int_eq(d.part[0][MOE_SPLIT_VAL].n_windows, 5);
    int32_t first, task;
    row0(&d, MOE_SPLIT_TRAIN, 0, 0, &first, &task);
    ck_assert_int_eq(first, 0);                     // train_000 comes first
    row0(&d, MOE_SPLIT_TRAIN, 2, 2, &first, &task); // row 10: train_001's first window
    ck_assert_int_eq(first, 70000);
    row0(&d, MOE_SPLIT_VAL, 1, 1, &first, &task); // val row 5 wraps to window 0
    ck_assert_int_eq(first, 0);
    row0(&d, MOE_SPLIT_VAL, 0, 3, &first, &task);
    ck_assert_int_eq(first, 48);
    moe_data_close(&d);
    snprintf(c.data.val_path, sizeof c.data.val_path, "%s", tu_in_dir("nothing_*.bin"));
    ck_assert_int_eq(moe_data_open(&d, &c), MOE_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "data.val_path"));
}
END_TEST

// The reader this replaced: the whole file as int32, train = the first
// (1 - val_fraction) tokens, row r = window r % windows in file order.
static void old_batch(const int32_t *tok, long n, double vf, int B, int T, int split, uint64_t idx,
                      int32_t *in, int32_t *tg) {
    long n_train = (long)(n * (1.0 - vf));
    long base = split ? n_train : 0, len = split ? n - n_train : n_train;
    long windows = (len - 1) / T;
    for (int r = 0; r < B; r++) {
        long start = base + (long)((idx * B + r) % (uint64_t)windows) * T;
        for (int i = 0; i < T; i++)
            in[r * T + i] = tok[start + i], tg[r * T + i] = tok[start + i + 1];
    }
}

START_TEST(test_mmap_reader_equals_in_memory_reader) {
    const long n = 3001;
    const char *p = write_llmc("one.bin", MOE_LLMC_MAGIC, 1, (int32_t)n, n, tok_mod200);
    int32_t *all = malloc(sizeof *all * n);
    for (long i = 0; i < n; i++)
        all[i] = (int32_t)tok_mod200(i);
    moe_config c = file_cfg("bin", p, 256);
    c.data.shuffle = false;
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    int32_t in[64], tg[64], tk[4], ri[64], rt[64];
    for (int split = 0; split < 2; split++)
        for (uint64_t b = 0; b < 60; b++) {
            ck_assert_int_eq(moe_data_batch(&d, split, b, in, tg, tk), 0);
            old_batch(all, n, 0.1, 4, 16, split, b, ri, rt);
            ck_assert_mem_eq(in, ri, sizeof in);
            ck_assert_mem_eq(tg, rt, sizeof tg);
        }
    moe_data_close(&d);
    free(all);
}
END_TEST

START_TEST(test_shuffled_epoch_visits_every_window_once) {
    const char *p = write_llmc("pos.bin", MOE_LLMC_MAGIC, 2, 1601, 1601, tok_pos);
    moe_config c = file_cfg("llmc", p, 4096);
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    long W = d.part[0][MOE_SPLIT_TRAIN].n_windows; // (1440 - 1) / 16 = 89
    ck_assert_int_eq(W, 89);
    int seen[2][89] = {{0}}, order[2][89], in_order = 0, same = 0;
    for (int e = 0; e < 2; e++)
        for (long r = 0; r < W; r++) {
            int32_t first, task;
            row0(&d, MOE_SPLIT_TRAIN, (uint64_t)(e * W + r) / 4, (int)((e * W + r) % 4), &first,
                 &task);
            ck_assert_int_eq(first % 16, 0);
            ck_assert_int_lt(first / 16, W);
            seen[e][first / 16]++;
            order[e][r] = first / 16;
            in_order += first / 16 == r;
        }
    for (int e = 0; e < 2; e++)
        for (long w = 0; w < W; w++)
            ck_assert_int_eq(seen[e][w], 1);
    ck_assert_int_lt(in_order, 20); // a permutation, not the file order
    for (long r = 0; r < W; r++)    // README: a new permutation each epoch
        same += order[0][r] == order[1][r];
    ck_assert_int_lt(same, 20);
    moe_data_close(&d);
}
END_TEST

START_TEST(test_resume_mid_epoch_is_bit_exact) {
    const char *p = write_llmc("r.bin", MOE_LLMC_MAGIC, 1, 4001, 4001, tok_mod200);
    const char *p2 = write_llmc("t2.bin", MOE_LLMC_MAGIC, 1, 2001, 2001, tok_pos);
    moe_config c = file_cfg("llmc", p, 256);
    // two file tasks: the task draw and each task's window order must resume
    c.data.path[0] = 0;
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.tasks=a=x,b=y"), 0);
    snprintf(c.data.task_paths[0], MOE_PATH_MAX, "%s", p);
    snprintf(c.data.task_paths[1], MOE_PATH_MAX, "%s", p2);
    c.model.vocab_size = 2048;
    c.train.steps = 8;
    c.train.grad_accum = 2;
    char a[700], b[700], ckb[800], pa[900], pb[900];
    char tmp[600]; // run folders: not in tu_dir, which holds plain files only
    snprintf(tmp, sizeof tmp, "%s", tu_tmpdir());
    snprintf(a, sizeof a, "%s/straight", tmp);
    snprintf(b, sizeof b, "%s/halves", tmp);
    snprintf(ckb, sizeof ckb, "%s/checkpoint", b);
    double la[8] = {0}, lb[8] = {0};
    moe_train_result r;
    moe_train_opts o = {.out_dir = a, .quiet = true, .losses = la};
    ck_assert_int_eq(moe_train(&c, &o, &r), 0);
    ck_assert_int_eq(r.eval.n_tasks, 2);
    ck_assert_str_eq(r.eval.task[1], "b");
    ck_assert(isfinite(r.eval.task_loss[0]) && isfinite(r.eval.task_loss[1]));
    moe_eval_result_free(&r.eval);
    moe_train_opts h1 = {.out_dir = b, .quiet = true, .losses = lb, .stop_after = 3};
    ck_assert_int_eq(moe_train(&c, &h1, &r), 0);
    ck_assert_int_eq(r.steps, 3);
    moe_train_opts h2 = {.out_dir = b, .resume_dir = ckb, .quiet = true, .losses = lb};
    ck_assert_int_eq(moe_train(&c, &h2, &r), 0);
    moe_eval_result_free(&r.eval);
    for (int i = 0; i < 8; i++)
        ck_assert_msg(la[i] == lb[i], "step %d: %.9g vs %.9g", i, la[i], lb[i]);
    snprintf(pa, sizeof pa, "%s/checkpoint/model.safetensors", a);
    snprintf(pb, sizeof pb, "%s/checkpoint/model.safetensors", b);
    tu_assert_same_file(pa, pb);
}
END_TEST

// Task frequencies of 30000 training rows against p, by a chi-square bound:
// 2 degrees of freedom, P(X > 27.6) = 1e-6 for a correct sampler.
static void check_frequencies(const char *sampling, double temp, const double *n_i) {
    moe_config c = file_cfg("llmc", "", 256);
    c.data.path[0] = 0;
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.tasks=a=x,b=y,c=z"), 0);
    const long len[3] = {16 * 40 + 1, 16 * 200 + 1, 16 * 1000 + 1};
    const char *names[3] = {"fa.bin", "fb.bin", "fc.bin"};
    for (int t = 0; t < 3; t++)
        snprintf(c.data.task_paths[t], MOE_PATH_MAX, "%s",
                 write_llmc(names[t], MOE_LLMC_MAGIC, 1, (int32_t)len[t], len[t], tok_mod200));
    char set[64];
    snprintf(set, sizeof set, "data.task_sampling=%s", sampling);
    ck_assert_int_eq(moe_config_set(&c, NULL, set), 0);
    c.data.task_temperature = temp;
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    double w[3], sum = 0, count[3] = {0};
    for (int t = 0; t < 3; t++) {
        double n = (double)d.part[t][MOE_SPLIT_TRAIN].n_windows;
        ck_assert_double_eq(n, n_i[t]);
        w[t] = !strcmp(sampling, "uniform") ? 1 : pow(n, 1.0 / temp);
        sum += w[t];
    }
    const int N = 30000;
    int32_t in[64], tg[64], tk[4];
    for (int b = 0; b < N / 4; b++) {
        ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_TRAIN, (uint64_t)b, in, tg, tk), 0);
        for (int r = 0; r < 4; r++)
            count[tk[r]]++;
    }
    double chi2 = 0;
    for (int t = 0; t < 3; t++) {
        double e = N * w[t] / sum;
        chi2 += (count[t] - e) * (count[t] - e) / e;
    }
    ck_assert_msg(chi2 < 27.6, "%s: chi2 %g (counts %g %g %g)", sampling, chi2, count[0], count[1],
                  count[2]);
    // validation rows take the tasks in turn
    ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_VAL, 0, in, tg, tk), 0);
    for (int r = 0; r < 4; r++)
        ck_assert_int_eq(tk[r], r % 3);
    moe_data_close(&d);
}

// Validation rows of file tasks take the tasks in turn, each task its own
// windows in order: row r is window r / n_tasks of task r % n_tasks. Two
// files of 321 tokens: [288, 321) validates, 2 windows of 17 at stride 16.
START_TEST(test_val_rows_of_file_tasks_take_their_windows_in_turn) {
    moe_config c = file_cfg("llmc", "", 4096);
    c.data.path[0] = 0;
    c.data.shuffle = false;
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.tasks=a=x,b=y"), 0);
    const char *names[2] = {"va.bin", "vb.bin"};
    for (int t = 0; t < 2; t++)
        snprintf(c.data.task_paths[t], MOE_PATH_MAX, "%s",
                 write_llmc(names[t], MOE_LLMC_MAGIC, 1, 321, 321, tok_pos));
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    ck_assert_int_eq(d.part[0][MOE_SPLIT_VAL].n_windows, 2);
    ck_assert_int_eq(moe_data_val_distinct_batches(&d), 1); // row 4 is task 0's window 0 again
    int32_t in[4 * 16], tg[4 * 16], tk[4];
    static const int32_t first[4] = {288, 288, 304, 304}; // batch 1: every window again
    for (int b = 0; b < 2; b++) {
        ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_VAL, (uint64_t)b, in, tg, tk), 0);
        for (int r = 0; r < 4; r++) {
            ck_assert_int_eq(tk[r], r % 2);
            ck_assert_msg(in[r * 16] == first[r], "batch %d row %d starts at %d, expected %d", b, r,
                          in[r * 16], first[r]);
        }
    }
    moe_data_close(&d);
}
END_TEST

START_TEST(test_task_sampling_frequencies) {
    // training windows: (0.9 * len - 1) / 16 per file
    const double n_i[3] = {35, 179, 899};
    check_frequencies("proportional", 1, n_i);
    check_frequencies("uniform", 1, n_i);
    check_frequencies("temperature", 5, n_i);
    check_frequencies("temperature", 2, n_i);
}
END_TEST

// Temperature weights n_i^(1/T) by hand, the largest task (in the middle,
// where a NaN cdf's fall-through to the last task is visible) at T = 2, and
// every row on it for tiny T (n^(1/T) overflowed to inf / inf = NaN there).
START_TEST(test_task_temperature_tiny_gives_the_largest_task) {
    moe_config c = file_cfg("llmc", "", 256);
    c.data.path[0] = 0;
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.tasks=a=x,b=y,c=z"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.task_sampling=temperature"), 0);
    const long len[3] = {16 * 40 + 1, 16 * 1000 + 1, 16 * 200 + 1}; // 35, 899, 179 windows
    const char *names[3] = {"ta.bin", "tb.bin", "tc.bin"};
    for (int t = 0; t < 3; t++)
        snprintf(c.data.task_paths[t], MOE_PATH_MAX, "%s",
                 write_llmc(names[t], MOE_LLMC_MAGIC, 1, (int32_t)len[t], len[t], tok_mod200));
    // T = 2: sqrt(35), sqrt(899), sqrt(179) = 5.9161, 29.9833, 13.3791 of 49.2785
    const double cdf2[3] = {0.120054, 0.728500, 1};
    const double temps[3] = {2, 1e-3, 1e-300};
    for (int k = 0; k < 3; k++) {
        c.data.task_temperature = temps[k];
        moe_data d;
        ck_assert_int_eq(moe_data_open(&d, &c), 0);
        for (int t = 0; t < 3; t++) {
            double want = k == 0 ? cdf2[t] : t == 0 ? 0 : 1;
            ck_assert_msg(fabs(d.task_cdf[t] - want) < 1e-6, "T=%g: cdf[%d] = %.9g, expected %g",
                          temps[k], t, d.task_cdf[t], want);
        }
        int32_t in[64], tg[64], tk[4];
        for (int b = 0; k > 0 && b < 250; b++) {
            ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_TRAIN, (uint64_t)b, in, tg, tk), 0);
            for (int r = 0; r < 4; r++)
                ck_assert_int_eq(tk[r], 1);
        }
        moe_data_close(&d);
    }
}
END_TEST

START_TEST(test_file_tasks_config_round_trip) {
    const char *p = tu_in_dir("tasks.json");
    FILE *f = fopen(p, "w");
    fputs("{\"data\": {\"kind\": \"llmc\", \"tasks\": {\"en\": \"d/en_*.bin\", \"de\": "
          "\"d/de_*.bin\"}, \"task_sampling\": \"temperature\"}}",
          f);
    fclose(f);
    moe_config a, b;
    moe_config_default(&a);
    ck_assert_int_eq(moe_config_load(&a, NULL, p), 0);
    ck_assert_int_eq(a.data.n_tasks, 2);
    ck_assert_str_eq(a.data.tasks[1], "de");
    ck_assert_str_eq(a.data.task_paths[1], "d/de_*.bin");
    ck_assert_int_eq(a.data.task_sampling, MOE_TASK_SAMPLING_TEMPERATURE);
    ck_assert_int_eq(moe_config_check(&a, NULL), 0);
    f = fopen(p, "w");
    ck_assert_int_eq(moe_config_write(&a, f), 0);
    fclose(f);
    moe_config_default(&b);
    ck_assert_int_eq(moe_config_load(&b, NULL, p), 0);
    ck_assert_mem_eq(&a, &b, sizeof a);
    moe_config_default(&b);
    ck_assert_int_eq(moe_config_set(&b, NULL, "data.tasks=en=d/en_*.bin,de=d/de_*.bin"), 0);
    ck_assert_str_eq(b.data.task_paths[0], "d/en_*.bin");
    ck_assert_int_eq(moe_config_set(&b, NULL, "data.tasks=en=x,de"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&b, NULL, "data.task_sampling=sometimes"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&b, NULL, "data.tasks=en=x,de=y"), 0);
    ck_assert_int_eq(moe_config_check(&b, NULL), MOE_EINVAL); // data.kind = synthetic
    ck_assert_msg(strstr(moe_last_error(), "data.kind"), "%s", moe_last_error());
    ck_assert_int_eq(moe_config_set(&b, NULL, "data.kind=llmc"), 0);
    ck_assert_int_eq(moe_config_set(&b, NULL, "data.path=z.bin"), 0);
    ck_assert_int_eq(moe_config_check(&b, NULL), MOE_EINVAL); // a second corpus
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "data.path"));
}
END_TEST

static void expect_bad(const char *path, const char *kind, int V, const char *what) {
    moe_config c = file_cfg(kind, path, V);
    moe_data d;
    ck_assert_msg(moe_data_open(&d, &c) == MOE_EFORMAT, "%s: %s", what, moe_last_error());
    ck_assert_msg(strstr(moe_last_error(), what) && strstr(moe_last_error(), path),
                  "'%s' lacks '%s'", moe_last_error(), what);
}

// An llm.c shard read with data.kind = nanogpt: the header is no tokens, and
// the advice is the kind, not a larger model.vocab_size (which would train
// on the header at vocab_size >= 54233).
START_TEST(test_nanogpt_kind_on_an_llmc_shard_suggests_llmc) {
    const char *p = write_llmc("shard.bin", MOE_LLMC_MAGIC, 1, 500, 500, tok_mod200);
    const int V[2] = {256, 65536};
    for (int k = 0; k < 2; k++) {
        expect_bad(p, "nanogpt", V[k],
                   "an llm.c token file (magic 20240520, version 1, 500 "
                   "tokens), not a nanoGPT .bin: set data.kind = llmc");
        ck_assert_ptr_null(strstr(moe_last_error(), "vocab_size"));
    }
    // raw tokens that happen to begin like the magic, without a matching count, are tokens
    const char *q = write_llmc("raw.bin", MOE_LLMC_MAGIC, 1, 7, 500, tok_mod200);
    moe_config c = file_cfg("nanogpt", q, 65536);
    moe_data d;
    ck_assert_msg(moe_data_open(&d, &c) == 0, "%s", moe_last_error());
    moe_data_close(&d);
}
END_TEST

// A data.path holding a glob character ('x[1].bin') that exists only
// literally: the glob matches nothing, and the message says why and how to
// escape; the escaped pattern reads the file.
START_TEST(test_glob_missing_a_literal_file_says_how_to_escape) {
    write_llmc("x[1].bin", MOE_LLMC_MAGIC, 1, 500, 500, tok_mod200);
    char pat[700], esc[700];
    snprintf(pat, sizeof pat, "%s/x[1].bin", tu_dir);
    snprintf(esc, sizeof esc, "%s/x\\[1\\].bin", tu_dir);
    char **paths;
    int n;
    ck_assert_int_eq(moe_glob_paths("data.path", pat, &paths, &n), MOE_ENOTFOUND);
    ck_assert_msg(strstr(moe_last_error(), "read as a glob pattern") &&
                      strstr(moe_last_error(), "a file of that literal name exists"),
                  "%s", moe_last_error());
    ck_assert_int_eq(moe_glob_paths("data.path", esc, &paths, &n), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_str_eq(paths[0], pat);
    moe_glob_free(paths, n);
    snprintf(pat, sizeof pat, "%s/y[1].bin", tu_dir); // nothing by either name
    ck_assert_int_eq(moe_glob_paths("data.path", pat, &paths, &n), MOE_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "': no such file"));
}
END_TEST

START_TEST(test_bad_files_are_refused) {
    const int32_t M = MOE_LLMC_MAGIC;
    expect_bad(write_llmc("m.bin", 1234, 1, 500, 500, tok_mod200), "llmc", 256,
               "byte 0: magic 1234");
    expect_bad(write_llmc("v.bin", M, 3, 500, 500, tok_mod200), "llmc", 256, "byte 4: version 3");
    expect_bad(write_llmc("t.bin", M, 2, 500, 400, tok_big), "llmc", 80000, "(truncated)");
    expect_bad(write_llmc("z.bin", M, 1, 0, 0, tok_mod200), "llmc", 256, "no tokens");
    expect_bad(write_llmc("o.bin", M, 2, 500, 500, tok_big), "llmc", 70200,
               "byte 1824: token 70200 >= model.vocab_size 70200 (the largest token in the file "
               "is 70499: set model.vocab_size to at least 70500)");
    // no model.vocab_size can hold 0xFFFFFFFF: no advice to raise it past its maximum
    expect_bad(write_llmc("ff.bin", M, 2, 500, 500, tok_ff), "llmc", 256,
               "token 4294967295 >= model.vocab_size 256, and the largest token in the file, "
               "4294967295, is out of any valid range (model.vocab_size is at most 16777216)");
    // a validation file too short for one window names its own token count
    write_llmc("big.bin", M, 1, 5000, 5000, tok_mod200);
    moe_config c = file_cfg("llmc", tu_in_dir("big.bin"), 256);
    snprintf(c.data.val_path, sizeof c.data.val_path, "%s",
             write_llmc("tiny.bin", M, 1, 3, 3, tok_mod200));
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(),
                         "tiny.bin: 3 tokens are too few for validation windows of 17 tokens"),
                  "%s", moe_last_error());
    FILE *f = fopen(tu_in_dir("empty.bin"), "wb");
    fclose(f);
    expect_bad(tu_in_dir("empty.bin"), "llmc", 256, "empty file");
    expect_bad(tu_in_dir("empty.bin"), "nanogpt", 256, "empty file");
    f = fopen(tu_in_dir("short.bin"), "wb");
    fwrite("\x28\xd6\x34\x01\x01\x00", 6, 1, f);
    fclose(f);
    expect_bad(tu_in_dir("short.bin"), "llmc", 256, "truncated header: 6 bytes");
}
END_TEST

// RFC 3629's table of well-formed sequences, by hand: each boundary of each
// row, and the forms a bit-pattern check lets through (overlong, surrogate,
// above U+10FFFF, leads F5..FF). at: the offset reported, -1 for good text.
// A child process reads token `at` of the mapped file after shrinking it to
// keep bytes; its exit status, and its stderr in out (cap bytes).
static int read_after_shrink(const char *path, long keep, long at, char *out, size_t cap) {
    moe_token_file f;
    ck_assert_msg(moe_token_file_open(&f, path, MOE_TOKENS_LLMC, 65536) == 0, "%s",
                  moe_last_error());
    const char *err = tu_in_dir("child_err.txt");
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        if (!freopen(err, "w", stderr) || moe_map_guard_install() < 0 || truncate(path, keep) != 0)
            _exit(3);
        volatile int32_t t = moe_token_at(&f, at);
        (void)t;
        _exit(0);
    }
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    moe_token_file_close(&f);
    FILE *e = fopen(err, "r");
    ck_assert_ptr_nonnull(e);
    size_t n = fread(out, 1, cap - 1, e);
    out[n] = 0;
    fclose(e);
    return st;
}

static uint32_t tok_mod(long i) {
    return (uint32_t)(i % 50000);
}

// A token file truncated by another program under a run: the next read past
// the new end is a clear message naming the file and exit 1, not a SIGBUS
// core; reads inside what is left, and faults nowhere near a mapping, are as
// before.
START_TEST(test_file_truncated_under_the_reader_is_named) {
    const char *p = write_llmc("big.bin", MOE_LLMC_MAGIC, 1, 100000, 100000, tok_mod);
    char err[1024];
    int st = read_after_shrink(p, 4096, 99999, err, sizeof err);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %#x, stderr: %s", st, err);
    ck_assert_msg(strstr(err, p) && strstr(err, "shrank"), "stderr: %s", err);
    p = write_llmc("big.bin", MOE_LLMC_MAGIC, 1, 100000, 100000, tok_mod);
    st = read_after_shrink(p, 200000, 10, err, sizeof err); // token 10 is still there
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %#x, stderr: %s", st, err);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        moe_map_guard_install();
        raise(SIGBUS);
        _exit(0);
    }
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS, "status %#x", st);
}
END_TEST

START_TEST(test_utf8_exact_well_formed_table) {
    static const struct {
        const char *s;
        long at;
    } cases[] = {
        {"plain ascii \x7f", -1},
        {"\xc2\x80", -1},         // U+0080, the smallest two-byte form
        {"\xdf\xbf", -1},         // U+07FF
        {"\xe0\xa0\x80", -1},     // U+0800
        {"\xed\x9f\xbf", -1},     // U+D7FF, below the surrogates
        {"\xee\x80\x80", -1},     // U+E000, above them
        {"\xef\xbf\xbf", -1},     // U+FFFF
        {"\xf0\x90\x80\x80", -1}, // U+10000
        {"\xf4\x8f\xbf\xbf", -1}, // U+10FFFF, the last code point
        {"\xc3\xa9t\xc3\xa9", -1},
        {"\xc0\xaf", 0},             // overlong '/'
        {"\xc1\xbf", 0},             // overlong U+007F
        {"ab\xe0\x80\xaf", 3},       // overlong '/' in three bytes
        {"\xe0\x9f\xbf", 1},         // overlong U+07FF
        {"\xf0\x80\x80\xaf", 1},     // overlong '/' in four bytes
        {"\xf0\x8f\xbf\xbf", 1},     // overlong U+FFFF
        {"\xed\xa0\x80", 1},         // U+D800, a surrogate
        {"\xed\xbf\xbf", 1},         // U+DFFF
        {"\xf4\x90\x80\x80", 1},     // U+110000
        {"\xf5\x80\x80\x80", 0},     // leads F5..FF never start a sequence
        {"\xf8\x88\x80\x80\x80", 0}, //
        {"\xff", 0},                 //
        {"\xfe", 0},                 //
        {"\x80", 0},                 // a lone continuation byte
        {"a\xc3(", 2},               // a lead then ASCII
        {"\xe2\x82", 0},             // cut by the end of the text
        {"\xe2\x82\xac\xe2\x28\xac", 4},
        {"\xf0\x9f\x98\x80\xf0\x9f\x98", 4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        long n = (long)strlen(cases[i].s);
        long got = moe_utf8_bad((const unsigned char *)cases[i].s, n);
        ck_assert_msg(got == cases[i].at, "case %zu: offset %ld, expected %ld", i, got,
                      cases[i].at);
    }
    // data.kind = text uses the same check
    char text[600];
    memset(text, 'a', sizeof text);
    memcpy(text + 300, "\xed\xa0\x80", 3);
    FILE *f = fopen(tu_in_dir("sur.txt"), "wb");
    ck_assert_int_eq(fwrite(text, sizeof text, 1, f), 1);
    fclose(f);
    expect_bad(tu_in_dir("sur.txt"), "text", 256, "byte 301: invalid UTF-8");
}
END_TEST

static Suite *shards_suite(void) {
    Suite *s = suite_create("shards");
    TCase *tc = tcase_create("shards");
    tcase_set_timeout(tc, 120);
    tcase_add_checked_fixture(tc, tu_dir_setup, tu_dir_teardown);
    tcase_add_test(tc, test_llmc_v1_and_v2_tokens_read_back);
    tcase_add_test(tc, test_nanogpt_kind_on_an_llmc_shard_suggests_llmc);
    tcase_add_test(tc, test_glob_missing_a_literal_file_says_how_to_escape);
    tcase_add_test(tc, test_nanogpt_raw_uint16);
    tcase_add_test(tc, test_glob_sorted_and_val_path);
    tcase_add_test(tc, test_mmap_reader_equals_in_memory_reader);
    tcase_add_test(tc, test_shuffled_epoch_visits_every_window_once);
    tcase_add_test(tc, test_resume_mid_epoch_is_bit_exact);
    tcase_add_test(tc, test_task_sampling_frequencies);
    tcase_add_test(tc, test_val_rows_of_file_tasks_take_their_windows_in_turn);
    tcase_add_test(tc, test_task_temperature_tiny_gives_the_largest_task);
    tcase_add_test(tc, test_file_tasks_config_round_trip);
    tcase_add_test(tc, test_bad_files_are_refused);
    tcase_add_test(tc, test_utf8_exact_well_formed_table);
    tcase_add_test(tc, test_file_truncated_under_the_reader_is_named);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(shards_suite());
}
