// Data: synthetic tasks compute the right answers, are deterministic, keep
// validation disjoint from training and score only answers; llm.c token files
// and text files load, and every corrupt file names its byte offset.
#include "moe/data.h"
#include "moe/error.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static moe_config synth_cfg(void) {
    moe_config c;
    moe_config_default(&c);
    c.train.batch_size = 4;
    c.model.seq_len = 48;
    return c;
}

static void answer_of(const moe_sample *s, char *in, char *ans) {
    int n = 0;
    for (int i = 1; i < s->n_prompt - 1; i++)
        in[n++] = (char)s->tok[i];
    in[n] = 0;
    n = 0;
    for (int i = s->n_prompt; i < s->n_prompt + s->n_answer - 1; i++)
        ans[n++] = (char)s->tok[i];
    ans[n] = 0;
}

START_TEST(test_synthetic_answers_are_right) {
    moe_config c = synth_cfg();
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    for (int task = 0; task < d.n_tasks; task++) {
        for (uint64_t i = 0; i < 50; i++) {
            moe_sample s;
            moe_synth_sample(&d, MOE_SPLIT_TRAIN, task, i, &s);
            ck_assert_int_eq(s.tok[0], MOE_SYNTH_MARKER + task);
            ck_assert_int_eq(s.tok[s.n_prompt - 1], '=');
            ck_assert_int_eq(s.tok[s.n_prompt + s.n_answer - 1], '\n');
            char in[32], ans[32], want[32];
            answer_of(&s, in, ans);
            int L = (int)strlen(in);
            const char *name = d.task_names[task];
            if (!strcmp(name, "copy")) strcpy(want, in);
            if (!strcmp(name, "reverse"))
                for (int j = 0; j <= L; j++)
                    want[j] = j < L ? in[L - 1 - j] : 0;
            if (!strcmp(name, "caesar"))
                for (int j = 0; j <= L; j++)
                    want[j] = j < L ? 'a' + (in[j] - 'a' + 3) % 26 : 0;
            if (!strcmp(name, "sort")) {
                strcpy(want, in);
                for (int a = 0; a < L; a++) // insertion sort as an independent reference
                    for (int b = a; b > 0 && want[b - 1] > want[b]; b--) {
                        char t = want[b];
                        want[b] = want[b - 1];
                        want[b - 1] = t;
                    }
            }
            if (!strcmp(name, "add")) {
                int x, y;
                ck_assert_int_eq(sscanf(in, "%d+%d", &x, &y), 2);
                snprintf(want, sizeof want, "%d", x + y);
            }
            ck_assert_str_eq(ans, want);
        }
    }
    moe_data_close(&d);
}
END_TEST

START_TEST(test_synthetic_split_disjoint_and_deterministic) {
    moe_config c = synth_cfg();
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    enum { NT = 3000, NV = 300 };
    static char train[NT][32], val[NV][32];
    for (int task = 0; task < 2; task++) { // copy and reverse: the smallest input spaces
        for (int i = 0; i < NT; i++) {
            moe_sample s;
            char ans[32];
            moe_synth_sample(&d, MOE_SPLIT_TRAIN, task, i, &s);
            answer_of(&s, train[i], ans);
        }
        for (int i = 0; i < NV; i++) {
            moe_sample s;
            char ans[32];
            moe_synth_sample(&d, MOE_SPLIT_VAL, task, i, &s);
            answer_of(&s, val[i], ans);
            for (int j = 0; j < NT; j++)
                ck_assert_msg(strcmp(val[i], train[j]), "'%s' is in both splits", val[i]);
        }
    }
    int32_t in1[4 * 48], tg1[4 * 48], tk1[4], in2[4 * 48], tg2[4 * 48], tk2[4];
    ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_TRAIN, 17, in1, tg1, tk1), 0);
    ck_assert_int_eq(moe_data_next(&d, MOE_SPLIT_TRAIN, in2, tg2, tk2), 0); // batch 0
    ck_assert_int_eq(d.cursor[MOE_SPLIT_TRAIN], 1);
    ck_assert(memcmp(in1, in2, sizeof in1));
    ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_TRAIN, 17, in2, tg2, tk2), 0);
    ck_assert_mem_eq(in1, in2, sizeof in1);
    ck_assert_mem_eq(tg1, tg2, sizeof tg1);
    // targets are next tokens, scored only inside answers; every row has some
    for (int r = 0; r < 4; r++) {
        int scored = 0;
        ck_assert_int_eq(in1[r * 48], MOE_SYNTH_MARKER + tk1[r]);
        for (int p = 0; p + 1 < 48; p++) {
            int32_t t = tg1[r * 48 + p];
            if (t < 0) continue;
            scored++;
            ck_assert_int_eq(t, in1[r * 48 + p + 1]);
            ck_assert_int_lt(t, MOE_SYNTH_MARKER); // never a task marker
            ck_assert_int_ne(t, '=');
        }
        ck_assert_int_gt(scored, 5);
    }
    // exactly the answers are scored: the target after '=' (the answer's
    // first token) through the '\n' ending it; not the next sample's prompt
    for (int r = 0; r < 4; r++) {
        int answer = 0; // a row starts with a sample's task marker
        for (int p = 0; p + 1 < 48; p++) {
            if (in1[r * 48 + p] == '=') answer = 1;
            if (in1[r * 48 + p] == '\n') answer = 0;
            ck_assert_msg((tg1[r * 48 + p] >= 0) == answer, "row %d position %d: target %d", r, p,
                          tg1[r * 48 + p]);
        }
    }
    moe_data_close(&d);
}
END_TEST

static char path[600];

static const char *write_file(const void *data, size_t n) {
    snprintf(path, sizeof path, "%s/data.bin", tu_tmpdir());
    FILE *f = fopen(path, "wb");
    fwrite(data, 1, n, f);
    fclose(f);
    return path;
}

// llm.c header + ntok uint16 tokens (t = i % 200).
static unsigned char *bin_file(int32_t magic, int32_t version, int32_t ntok, int real, size_t *n) {
    *n = 1024 + 2 * (size_t)real;
    unsigned char *b = calloc(1, *n);
    int32_t h[3] = {magic, version, ntok};
    memcpy(b, h, sizeof h);
    for (int i = 0; i < real; i++) {
        b[1024 + 2 * i] = (unsigned char)(i % 200);
        b[1024 + 2 * i + 1] = 0;
    }
    return b;
}

static int open_kind(const char *kind, const char *p, moe_data *d) {
    moe_config c = synth_cfg();
    c.data.shuffle = false; // file order: the tests below read known offsets
    snprintf(c.data.kind, sizeof c.data.kind, "%s", kind);
    snprintf(c.data.path, sizeof c.data.path, "%.500s", p);
    return moe_data_open(d, &c);
}

static void expect_bin_error(unsigned char *b, size_t n, const char *what) {
    moe_data d;
    ck_assert_int_eq(open_kind("bin", write_file(b, n), &d), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), what) && strstr(moe_last_error(), path),
                  "'%s' lacks '%s'", moe_last_error(), what);
    free(b);
}

START_TEST(test_bin_files) {
    size_t n;
    unsigned char *b = bin_file(20240520, 1, 2000, 2000, &n);
    moe_data d;
    ck_assert_int_eq(open_kind("bin", write_file(b, n), &d), 0);
    free(b);
    ck_assert_int_eq(d.n_tokens, 2000);
    ck_assert_int_eq(d.n_train, 1800);
    int32_t in[4 * 48], tg[4 * 48], tk[4];
    ck_assert_int_eq(moe_data_next(&d, MOE_SPLIT_VAL, in, tg, tk), 0);
    ck_assert_int_eq(in[0], 1800 % 200); // validation starts after the train tokens
    ck_assert_int_eq(tg[0], in[1]);
    moe_data_close(&d);

    b = bin_file(20240521, 1, 10, 10, &n);
    expect_bin_error(b, n, "byte 0: magic 20240521");
    b = bin_file(20240520, 3, 10, 10, &n);
    expect_bin_error(b, n, "byte 4: version 3");
    b = bin_file(20240520, 1, 3000, 2000, &n);
    expect_bin_error(b, n, "(truncated)");
    b = bin_file(20240520, 1, 2000, 2000, &n);
    b[1024 + 2 * 7 + 1] = 1; // token 7 + 256 >= vocab 256
    expect_bin_error(b, n, "byte 1038: token 263");
    b = bin_file(20240520, 1, 10, 10, &n);
    expect_bin_error(b, n, "too few");
    expect_bin_error(calloc(1, 100), 100, "truncated header: 100 bytes");
    ck_assert_int_eq(open_kind("bin", "/nonexistent/x.bin", &d), MOE_ENOTFOUND);
}
END_TEST

// manifest.json beside token files (prepare's) as moe_data_check_tokenizer
// reads it: a FIFO is refused (json_load_file blocked on it), a file that
// is not JSON is refused, a field of the wrong type is refused naming it
// (it skipped the check), and so is one without format, tokenizer or
// vocab_size, which prepare always writes (it was passed unchecked).
START_TEST(test_manifest_of_token_files_is_checked_strictly) {
    size_t n;
    unsigned char *b = bin_file(20240520, 1, 2000, 2000, &n);
    moe_data d;
    ck_assert_int_eq(open_kind("bin", write_file(b, n), &d), 0);
    free(b);
    char mf[700];
    snprintf(mf, sizeof mf, "%.*s/manifest.json", (int)(strrchr(path, '/') - path), path);
    ck_assert_int_eq(moe_data_check_tokenizer(&d, "bytes", NULL), 0); // none: passes
    static const struct {
        const char *text, *want;
    } cases[] = {
        {"{\"format\": \"llm.c\", \"tokenizer\": \"bytes\", \"vocab_size\": 256}", NULL},
        {"{\"format\": \"other\", \"tokenizer_hash\": 7}", NULL}, // not prepare's
        {"{\"format\": \"llm.c\", \"tokenizer\": \"bytes\", \"vocab_size\": 256, "
         "\"tokenizer_hash\": 7}",
         "tokenizer_hash is not a string"},
        {"{\"format\": \"llm.c\", \"tokenizer\": \"bytes\", \"vocab_size\": \"256\"}",
         "vocab_size is not a positive integer"},
        {"{\"format\": \"llm.c\", \"tokenizer\": null, \"vocab_size\": 256}",
         "tokenizer is not a string"},
        // prepare always writes format, tokenizer and vocab_size: a manifest
        // without them was passed unchecked
        {"{\"tokenizer\": \"other.model\", \"vocab_size\": 300}", "format is missing"},
        {"{}", "format is missing"},
        {"[]", "format is missing"},
        {"{\"format\": 1}", "format is not a string"},
        {"{\"format\": \"llm.c\", \"vocab_size\": 256}", "tokenizer is missing"},
        {"{\"format\": \"llm.c\", \"tokenizer\": \"bytes\"}", "vocab_size is missing"},
        {"{\"format\": \"llm.c\",", "manifest.json:1:"},
        {"", "manifest.json: the file is empty (the manifest"},
        {" \n\t\n", "manifest.json: the file is empty (the manifest"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        FILE *f = fopen(mf, "w");
        fputs(cases[i].text, f);
        fclose(f);
        const int rc = moe_data_check_tokenizer(&d, "bytes", NULL);
        if (!cases[i].want) {
            ck_assert_msg(rc == 0, "%s: %s", cases[i].text, moe_last_error());
            continue;
        }
        ck_assert_int_eq(rc, MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), cases[i].want) && strstr(moe_last_error(), mf),
                      "'%s' lacks '%s'", moe_last_error(), cases[i].want);
    }
    unlink(mf);
    ck_assert_int_eq(mkfifo(mf, 0600), 0);
    ck_assert_int_eq(moe_data_check_tokenizer(&d, "bytes", NULL), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "not a regular file"));
    unlink(mf);
    moe_data_close(&d);
}
END_TEST

// 2000 tokens: the last 10% (200) validate, 4 windows of 49 at stride 48;
// batches of 4 rows: batch 0 holds each once, batch 1 starts over.
START_TEST(test_val_batches_before_windows_repeat) {
    size_t n;
    unsigned char *b = bin_file(20240520, 1, 2000, 2000, &n);
    moe_data d;
    ck_assert_int_eq(open_kind("bin", write_file(b, n), &d), 0);
    free(b);
    ck_assert_int_eq(moe_data_val_distinct_batches(&d), 1);
    int32_t in[2][4 * 48], tg[4 * 48], tk[4];
    for (int k = 0; k < 2; k++)
        ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_VAL, (uint64_t)k, in[k], tg, tk), 0);
    const size_t row = sizeof(int32_t) * 48;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < i; j++)
            ck_assert(memcmp(in[0] + 48 * i, in[0] + 48 * j, row));
    ck_assert(!memcmp(in[1], in[0], row)); // batch 1's first row: window 0 again
    moe_data_close(&d);
    moe_config c = synth_cfg();
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    ck_assert_int_eq(moe_data_val_distinct_batches(&d), -1);
    moe_data_close(&d);
}
END_TEST

START_TEST(test_text_files) {
    char text[4000];
    for (int i = 0; i < 3999; i++)
        text[i] = 'a' + i % 26;
    moe_data d;
    ck_assert_int_eq(open_kind("text", write_file(text, 3999), &d), 0);
    ck_assert_int_eq(d.n_tokens, 3999);
    moe_data_close(&d);
    text[2500] = (char)0xC3; // a lead byte followed by an ASCII byte
    ck_assert_int_eq(open_kind("text", write_file(text, 3999), &d), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "byte 2501: invalid UTF-8"));
}
END_TEST

static Suite *data_suite(void) {
    Suite *s = suite_create("data");
    TCase *tc = tcase_create("data");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_synthetic_answers_are_right);
    tcase_add_test(tc, test_synthetic_split_disjoint_and_deterministic);
    tcase_add_test(tc, test_bin_files);
    tcase_add_test(tc, test_manifest_of_token_files_is_checked_strictly);
    tcase_add_test(tc, test_val_batches_before_windows_repeat);
    tcase_add_test(tc, test_text_files);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(data_suite());
}
