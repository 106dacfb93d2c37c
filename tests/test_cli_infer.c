// `moe generate` and `moe eval` through the binary: only ids the tokenizer can
// decode are produced, sampling is keyed by the --input line (not the batch
// row), bad prompt lines are refused before any answer, ignored options and a
// context that ends answers early are noted, and eval checks what it needs
// (dump path, task_experts.json, the shards it reads) before evaluating.
#include "moe/error.h"
#include "moe/infer.h"
#include "moe/rng.h"
#include "moe/safetensors.h"
#include "moe/tokenizer.h"
#include "testutil.h"

#include <dirent.h>
#include <math.h>

#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static char root[600], run[700], run320[700];

// Runs moe (printf-style args) with stdout and stderr in root/out.txt, err.txt.
static int moe(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int moe(const char *fmt, ...) {
    char args[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    return tu_run_moe(root, args);
}

static const char *out_text(void) {
    return tu_file_text(root, "out.txt");
}

static const char *err_text(void) {
    return tu_file_text(root, "err.txt");
}

static void expect_err(const char *want) {
    ck_assert_msg(strstr(err_text(), want), "stderr lacks '%s': %s", want, err_text());
}

// Line n (1-based) of text, without its newline, into buf.
static const char *line_of(const char *text, int n, char *buf, size_t cap) {
    for (int i = 1; i < n && text; i++)
        if ((text = strchr(text, '\n'))) text++;
    ck_assert_msg(text && *text, "no line %d", n);
    size_t len = strcspn(text, "\n");
    ck_assert_uint_lt(len, cap);
    memcpy(buf, text, len);
    buf[len] = 0;
    return buf;
}

static int count_lines(const char *text) {
    int n = 0;
    for (; *text; text++)
        n += *text == '\n';
    return n;
}

// Two short runs of configs/tiny.json (2 layers, d_model 32): the byte
// vocabulary, and vocab_size 320 (ids 256..319 no tokenizer decodes).
static void setup(void) {
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(run, sizeof run, "%s/run", root);
    snprintf(run320, sizeof run320, "%s/run320", root);
    const char *common = "--steps 4 --quiet --set model.n_layers=2 --set model.d_model=32 "
                         "--set model.d_ff=64 --set train.eval_every=0";
    ck_assert_msg(moe("train '%s/configs/tiny.json' %s --out '%s'", MOE_SOURCE_DIR, common, run) ==
                      0,
                  "%s", err_text());
    ck_assert_msg(moe("train '%s/configs/tiny.json' %s --set model.vocab_size=320 --out '%s'",
                      MOE_SOURCE_DIR, common, run320) == 0,
                  "%s", err_text());
}

static void teardown(void) {
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    ck_assert_int_eq(system(cmd), 0);
}

// Logits that favour the ids past the tokenizer: greedy and sampling (any
// seed, any top-k) must still pick below n_vocab.
START_TEST(test_sample_token_never_picks_ids_past_the_tokenizer) {
    enum { V = 12, NV = 8 };
    float logits[V];
    int idx[V];
    for (int v = 0; v < V; v++)
        logits[v] = v < NV ? 0.1f * v : 5.0f + v;
    moe_gen_opts o = {.n_vocab = NV};
    ck_assert_int_eq(moe_sample_token(logits, V, &o, 0, 0, idx), NV - 1);
    o.temperature = 1e6;
    for (int top_k = 0; top_k <= V; top_k += 3)
        for (uint64_t s = 0; s < 200; s++) {
            o.top_k = top_k, o.seed = s;
            const int t = moe_sample_token(logits, V, &o, s % 7, s, idx);
            ck_assert_msg(t >= 0 && t < NV, "picked %d (top_k %d, seed %llu)", t, top_k,
                          (unsigned long long)s);
        }
    o.n_vocab = 0; // unset: the whole row
    o.temperature = 0;
    ck_assert_int_eq(moe_sample_token(logits, V, &o, 0, 0, idx), V - 1);
}
END_TEST

// Greedy takes the lowest id among equal logits (README "Generation"), also
// when the tie is at the vocabulary cut; sampling at a tiny temperature draws
// that same id.
START_TEST(test_greedy_ties_go_to_the_lowest_id) {
    const float logits[6] = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f, 9.0f};
    int idx[6];
    moe_gen_opts o = {0};
    ck_assert_int_eq(moe_sample_token(logits, 5, &o, 0, 0, idx), 1);
    o.n_vocab = 5; // id 5 (the largest) is past the tokenizer
    ck_assert_int_eq(moe_sample_token(logits, 6, &o, 0, 0, idx), 1);
    const float two[2] = {-0.5f, -0.5f};
    ck_assert_int_eq(moe_sample_token(two, 2, &o, 0, 0, idx), 0);
}
END_TEST

// The sampler before its top-k became a heap: k passes of selection over
// (logit desc, id asc), O(k V). Kept as the reference the heap must match.
static int sample_by_selection(const float *logits, int V, const moe_gen_opts *o, uint64_t b,
                               uint64_t i, int *idx) {
    if (o->n_vocab > 0 && o->n_vocab < V) V = o->n_vocab;
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (o->temperature <= 0) return best;
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
    double sum = 0.0;
    for (int j = 0; j < k; j++)
        sum += exp(((double)logits[idx[j]] - logits[best]) / o->temperature);
    double u = moe_u01(moe_hash4(o->seed, b, i, 0x53414D504C45ull)) * sum, acc = 0.0;
    for (int j = 0; j < k; j++) {
        acc += exp(((double)logits[idx[j]] - logits[best]) / o->temperature);
        if (u < acc) return idx[j];
    }
    return idx[k - 1];
}

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Top-k sampling draws exactly the tokens of the selection sampler: random
// logits on a coarse grid (many ties, ties across the k-th place too), every
// k from 1 past V, several temperatures and vocabulary cuts. Then one timing
// line (V 32000, k 50) for the record, not asserted.
START_TEST(test_top_k_sampling_draws_what_selection_drew) {
    enum { VMAX = 300 };
    float logits[VMAX];
    int ia[VMAX], ib[VMAX];
    uint64_t r = 12345;
    const int Vs[] = {1, 2, 3, 17, 64, VMAX};
    const double temps[] = {0.05, 0.7, 1.0, 30.0};
    long draws = 0;
    for (int vi = 0; vi < 6; vi++) {
        const int V = Vs[vi];
        for (int rep = 0; rep < 6; rep++) {
            const int levels = rep % 2 ? 4 : 40; // few levels: ties everywhere
            for (int v = 0; v < V; v++) {
                r = r * 6364136223846793005ull + 1442695040888963407ull;
                logits[v] = (float)((r >> 33) % levels) * 0.5f - 3.0f;
            }
            const int ks[] = {0, 1, 2, 3, 5, 8, 50, V - 1, V, V + 7};
            for (int ki = 0; ki < 10; ki++)
                for (int ti = 0; ti < 4; ti++)
                    for (int cut = 0; cut < 2; cut++) {
                        moe_gen_opts o = {.temperature = temps[ti],
                                          .top_k = ks[ki] < 0 ? 0 : ks[ki],
                                          .seed = (uint64_t)(rep * 31 + ki),
                                          .n_vocab = cut ? (V + 1) / 2 : 0};
                        for (uint64_t i = 0; i < 40; i++, draws++) {
                            const int a = moe_sample_token(logits, V, &o, i % 3, i, ia);
                            const int b = sample_by_selection(logits, V, &o, i % 3, i, ib);
                            ck_assert_msg(a == b,
                                          "V %d top_k %d T %g n_vocab %d draw %llu: %d, selection "
                                          "%d",
                                          V, o.top_k, o.temperature, o.n_vocab,
                                          (unsigned long long)i, a, b);
                        }
                    }
        }
    }
    ck_assert_int_gt(draws, 50000);
    enum { BV = 32000, BK = 50, N = 20 };
    float *big = malloc(sizeof(float) * BV);
    int *idx = malloc(sizeof(int) * BV);
    ck_assert(big && idx);
    for (int v = 0; v < BV; v++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        big[v] = (float)((r >> 40) % 100000) * 1e-4f;
    }
    moe_gen_opts o = {.temperature = 0.8, .top_k = BK, .seed = 3};
    int sink = 0;
    double t0 = seconds();
    for (int i = 0; i < N; i++)
        sink += sample_by_selection(big, BV, &o, 0, (uint64_t)i, idx);
    double t_sel = (seconds() - t0) / N;
    t0 = seconds();
    for (int i = 0; i < N; i++)
        sink -= moe_sample_token(big, BV, &o, 0, (uint64_t)i, idx);
    double t_heap = (seconds() - t0) / N;
    ck_assert_int_eq(sink, 0);
    printf("{\"op\": \"sample_top_k\", \"V\": %d, \"k\": %d, \"selection_us\": %.1f, "
           "\"heap_us\": %.1f, \"speedup\": %.1f}\n",
           BV, BK, t_sel * 1e6, t_heap * 1e6, t_heap > 0 ? t_sel / t_heap : 0.0);
    free(big);
    free(idx);
}
END_TEST

// vocab_size 320 on bytes: an id of 256..319 was printed as its low byte
// (0x12d as \x2d); now none is sampled, so a printable byte never shows as \xNN.
START_TEST(test_byte_model_with_a_larger_vocabulary_prints_only_bytes) {
    ck_assert_int_eq(moe("generate '%s' --task copy --input /dev/null --quiet", run320), 2);
    char p[800];
    snprintf(p, sizeof p, "%s/p320.txt", root);
    FILE *f = fopen(p, "w");
    for (int i = 0; i < 8; i++)
        fprintf(f, "ab%d=\n", i);
    fclose(f);
    ck_assert_msg(moe("generate '%s' --task copy --input '%s' --temperature 1000 --max-new 48 "
                      "--seed 5 --quiet",
                      run320, p) == 0,
                  "%s", err_text());
    const char *o = out_text();
    ck_assert_int_eq(count_lines(o), 8);
    for (const char *s = o; (s = strstr(s, "\\x")) != NULL; s += 2) {
        unsigned v;
        ck_assert_int_eq(sscanf(s + 2, "%2x", &v), 1);
        ck_assert_msg(v < 32 || v >= 127, "printable byte 0x%02x escaped: an id >= 256", v);
    }
}
END_TEST

static void write_lines(const char *name, int n, const char *(*line)(int)) {
    char p[800];
    snprintf(p, sizeof p, "%s/%s", root, name);
    FILE *f = fopen(p, "w");
    for (int i = 1; i <= n; i++)
        fprintf(f, "%s\n", line(i));
    fclose(f);
}

static const char *hello(int i) {
    (void)i;
    return "hello=";
}

static const char *hello_at_1_and_65(int i) {
    return i == 1 || i == 65 ? "hello=" : "xyz=";
}

// The draw of token i of line b is hash(seed, b, i): the same prompt on lines 1
// and 65 (row 0 of two batches of 64) answers differently, and a line's
// answer does not depend on the other lines or on the batch it falls in.
START_TEST(test_sampling_is_keyed_by_the_input_line_not_the_batch_row) {
    char a1[256], a65[256], a129[256], b1[256], b65[256], p[800];
    write_lines("same.txt", 130, hello);
    write_lines("mixed.txt", 65, hello_at_1_and_65);
    const char *opts = "--temperature 2 --seed 1 --max-new 24 --quiet";
    snprintf(p, sizeof p, "%s/same.txt", root);
    ck_assert_msg(moe("generate '%s' --task reverse --input '%s' %s", run, p, opts) == 0, "%s",
                  err_text());
    ck_assert_int_eq(count_lines(out_text()), 130);
    line_of(out_text(), 1, a1, sizeof a1);
    line_of(out_text(), 65, a65, sizeof a65);
    line_of(out_text(), 129, a129, sizeof a129);
    ck_assert_msg(strcmp(a1, a65) && strcmp(a65, a129) && strcmp(a1, a129),
                  "lines 1, 65, 129 answer '%s', '%s', '%s'", a1, a65, a129);
    snprintf(p, sizeof p, "%s/mixed.txt", root);
    ck_assert_int_eq(moe("generate '%s' --task reverse --input '%s' %s", run, p, opts), 0);
    line_of(out_text(), 1, b1, sizeof b1);
    line_of(out_text(), 65, b65, sizeof b65);
    ck_assert_str_eq(b1, a1);
    ck_assert_str_eq(b65, a65);
    // --prompt is line 1
    ck_assert_int_eq(moe("generate '%s' --task reverse --prompt hello= %s", run, opts), 0);
    ck_assert_str_eq(line_of(out_text(), 1, b1, sizeof b1), a1);
}
END_TEST

static const char *long_line_70(int i) {
    static char longp[100];
    memset(longp, 'x', 80);
    longp[80] = 0;
    return i == 70 ? longp : "ab=";
}

static const char *empty_line_3(int i) {
    return i == 3 ? "" : "ab=";
}

// A bad line after the first batch is refused before any answer, naming the
// file and its 1-based line.
START_TEST(test_bad_input_line_is_refused_before_any_answer) {
    char p[800], want[900];
    write_lines("long.txt", 71, long_line_70);
    snprintf(p, sizeof p, "%s/long.txt", root);
    ck_assert_int_eq(moe("generate '%s' --task copy --input '%s' --quiet", run, p), 2);
    ck_assert_str_eq(out_text(), "");
    snprintf(want, sizeof want, "%s:70: the prompt has 81 tokens", p);
    expect_err(want);
    expect_err("at most 64 fit");
    // with --raw there is no marker byte: an empty line is an empty prompt
    write_lines("empty.txt", 4, empty_line_3);
    snprintf(p, sizeof p, "%s/empty.txt", root);
    ck_assert_int_eq(moe("generate '%s' --task copy --input '%s' --raw --quiet", run, p), 2);
    ck_assert_str_eq(out_text(), "");
    snprintf(want, sizeof want, "%s:3: the prompt is empty", p);
    expect_err(want);
}
END_TEST

// A short run of a SentencePiece model (trained on README.md, 1000 pieces,
// model.seq_len 32), built by the first test that needs it; NULL without the
// library.
static char spm_ckpt[800];

// Tests run in forked processes: a later one finds the folder an earlier made.
static const char *spm_checkpoint(void) {
    if (!moe_tok_have_sentencepiece()) return NULL;
    snprintf(spm_ckpt, sizeof spm_ckpt, "%s/spmrun/checkpoint", root);
    struct stat sb;
    if (stat(spm_ckpt, &sb) == 0) return spm_ckpt;
    char prefix[700], model[720], p[800];
    snprintf(prefix, sizeof prefix, "%s/tok", root);
    snprintf(model, sizeof model, "%s.model", prefix);
    ck_assert_msg(moe_tok_train_spm(MOE_SOURCE_DIR "/README.md", prefix, 1000) == 0, "%s",
                  moe_last_error());
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(model, &t), 0);
    const char text[] = "The router picks the top experts of every token and the trainer "
                        "keeps the load of each expert in balance.";
    int32_t *ids;
    size_t n;
    ck_assert_int_eq(moe_tok_encode(t, text, strlen(text), &ids, &n), 0);
    moe_tok_free(t);
    snprintf(p, sizeof p, "%s/spm.bin", root); // llm.c shard: 256-int header, uint16 ids
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    int32_t hdr[256] = {20240520, 1, (int32_t)(64 * n)};
    fwrite(hdr, sizeof hdr, 1, f);
    for (int r = 0; r < 64; r++)
        for (size_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)ids[i];
            fwrite(&v, 2, 1, f);
        }
    fclose(f);
    free(ids);
    snprintf(p, sizeof p, "%s/spm.json", root);
    f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "{\"model\": {\"vocab_size\": 1000, \"d_model\": 32, \"n_layers\": 2, \"d_ff\": 48,"
            " \"seq_len\": 32, \"tokenizer\": \"%s\"},\n"
            " \"moe\": {\"num_experts\": 4},\n"
            " \"train\": {\"steps\": 2, \"batch_size\": 2, \"eval_every\": 0},\n"
            " \"data\": {\"kind\": \"bin\", \"path\": \"%s/spm.bin\"}}\n",
            model, root);
    fclose(f);
    ck_assert_msg(moe("train '%s' --quiet --out '%s/spmrun'", p, root) == 0, "%s", err_text());
    return spm_ckpt;
}

// The longest prefix of an ASCII sentence that encodes to exactly n pieces
// (no BOS) with the checkpoint's tokenizer, into buf.
static void prompt_of_pieces(const char *dir, size_t n, char *buf, size_t cap) {
    char p[900];
    snprintf(p, sizeof p, "%s/tokenizer.model", dir);
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(p, &t), 0);
    const char *words = "the router picks the top experts of every token and the trainer keeps "
                        "the load of each expert in balance while the checkpoint holds the "
                        "weights of every layer and the optimizer state of the run";
    size_t best = 0;
    for (size_t len = 1; len <= strlen(words); len++) {
        int32_t *ids;
        size_t k;
        ck_assert_int_eq(moe_tok_encode(t, words, len, &ids, &k), 0);
        free(ids);
        if (k == n && words[len - 1] != ' ') best = len;
    }
    moe_tok_free(t);
    ck_assert_msg(best > 0 && best < cap, "no prefix of %zu pieces", n);
    memcpy(buf, words, best);
    buf[best] = 0;
}

// model.seq_len counts the BOS token a SentencePiece prompt gets: a prompt of
// seq_len pieces is refused before anything is generated, one piece less fits.
START_TEST(test_prompt_length_counts_the_bos_token) {
    const char *dir = spm_checkpoint();
    if (!dir) return; // no libsentencepiece: the byte path has no BOS
    char prompt[400];
    prompt_of_pieces(dir, 32, prompt, sizeof prompt);
    ck_assert_int_eq(moe("generate '%s' --prompt '%s' --max-new 1 --quiet", dir, prompt), 2);
    ck_assert_str_eq(out_text(), "");
    expect_err("--prompt: the prompt has 33 tokens (with BOS); at most 32 fit the context "
               "(model.seq_len)");
    prompt_of_pieces(dir, 31, prompt, sizeof prompt);
    ck_assert_msg(moe("generate '%s' --prompt '%s' --max-new 1 --quiet", dir, prompt) == 0, "%s",
                  err_text());
    ck_assert_int_eq(count_lines(out_text()), 1);
}
END_TEST

// Invalid UTF-8 is refused for a SentencePiece model (it would become U+FFFD)
// naming the offset of the first bad byte, in --prompt and in an --input line;
// a byte model takes the same bytes (every byte is a token).
START_TEST(test_invalid_utf8_prompt_is_refused_for_sentencepiece) {
    const char *dir = spm_checkpoint();
    if (dir) {
        ck_assert_int_eq(moe("generate '%s' --prompt \"$(printf 'ab\\303(cd')\" --quiet", dir), 2);
        ck_assert_str_eq(out_text(), "");
        expect_err("--prompt: the prompt is not valid UTF-8 at byte 3");
        char p[800], want[900];
        snprintf(p, sizeof p, "%s/bad_utf8.txt", root);
        FILE *f = fopen(p, "wb");
        ck_assert_ptr_nonnull(f);
        fputs("good text\nfine \xc3\xa9t\xc3\xa9\nbad \xed\xa0\x80 surrogate\n", f);
        fclose(f);
        ck_assert_int_eq(moe("generate '%s' --input '%s' --quiet", dir, p), 2);
        ck_assert_str_eq(out_text(), "");
        snprintf(want, sizeof want, "--input %s:3: the prompt is not valid UTF-8 at byte 5", p);
        expect_err(want);
    }
    // bytes: the same bytes are a prompt of tokens 0..255
    ck_assert_msg(
        moe("generate '%s' --task copy --prompt \"$(printf 'ab\\303(cd=')\" --max-new 2 --quiet",
            run) == 0,
        "%s", err_text());
    ck_assert_int_eq(count_lines(out_text()), 1);
}
END_TEST

// A prompt near the context stops early: one note on stderr (exit 0); an answer
// that ends within --max-new gets none.
START_TEST(test_answer_cut_by_the_context_is_noted) {
    char prompt[64];
    memset(prompt, 'a', 59);
    strcpy(prompt + 59, "="); // 60 tokens with the marker byte: 4 new fit in 64
    ck_assert_int_eq(moe("generate '%s' --task copy --prompt '%s' --raw --max-new 32 "
                         "--temperature 1000 --quiet",
                         run, prompt),
                     0);
    ck_assert_int_eq(count_lines(out_text()), 1);
    expect_err("note: 1 answer stopped at the model's context of 64 tokens before --max-new 32");
    expect_err("a prompt of 60 tokens, 4 new");
    ck_assert_int_eq(moe("generate '%s' --task copy --prompt ab= --max-new 3 --temperature 1000 "
                         "--quiet",
                         run),
                     0);
    ck_assert_ptr_null(strstr(err_text(), "note"));
}
END_TEST

// Options that cannot change the answers are named in one note; the answers
// are those without them.
START_TEST(test_options_greedy_ignores_are_noted) {
    static char plain[4096];
    ck_assert_int_eq(moe("generate '%s' --task copy --prompt ab= --quiet", run), 0);
    snprintf(plain, sizeof plain, "%s", out_text());
    ck_assert_ptr_null(strstr(err_text(), "note"));
    ck_assert_int_eq(moe("generate '%s' --task copy --prompt ab= --top-k 3 --seed 9 --quiet", run),
                     0);
    ck_assert_str_eq(out_text(), plain);
    expect_err("note: ignored: --top-k and --seed (greedy decoding");
    ck_assert_int_eq(
        moe("generate '%s' --task copy --prompt ab= --seed 9 --temperature 1 --quiet", run), 0);
    ck_assert_ptr_null(strstr(err_text(), "note"));
}
END_TEST

// --- eval -----------------------------------------------------------------

static const char *small_run = "--steps 4 --quiet --set model.n_layers=2 --set model.d_model=32 "
                               "--set model.d_ff=64 --set train.eval_every=0";

static bool exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

// Another run's checkpoint (or a folder inside it) is no place for a dump,
// whatever run is evaluated; a missing folder is named. All before evaluating.
START_TEST(test_dump_logits_is_refused_in_any_checkpoint_folder) {
    char p[900], want[1000];
    snprintf(p, sizeof p, "%s/checkpoint/new.st", run320);
    ck_assert_int_eq(moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", run, p), 2);
    ck_assert_str_eq(out_text(), "");
    ck_assert(!exists(p));
    snprintf(want, sizeof want, "lies in the checkpoint folder %s/checkpoint (it holds", run320);
    expect_err(want);
    snprintf(p, sizeof p, "%s/checkpoint/sub", run320);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/checkpoint/sub/new.st", run320);
    ck_assert_int_eq(moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", run, p), 2);
    expect_err(want);
    ck_assert(!exists(p));
    snprintf(p, sizeof p, "%s/checkpoint/sub", run320);
    ck_assert_int_eq(rmdir(p), 0);
    snprintf(p, sizeof p, "%s/nosuch/new.st", root);
    ck_assert_int_eq(moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", run, p), 2);
    ck_assert_str_eq(out_text(), "");
    expect_err("nosuch does not exist");
    // beside the runs, not in a checkpoint: written
    snprintf(p, sizeof p, "%s/ok.st", root);
    ck_assert_msg(moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", run, p) == 0, "%s",
                  err_text());
    ck_assert(exists(p));
}
END_TEST

static char *slurp(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    *n = ftell(f);
    rewind(f);
    char *b = malloc((size_t)*n + 1);
    ck_assert_int_eq(fread(b, 1, (size_t)*n, f), *n);
    fclose(f);
    return b;
}

// The dump holds tokens I32 [B, T], task_ids I32 [B] and logits F32 [B, T, V]
// of the fp32 weights (--quantize changes only the table it adds); a FIFO or
// another file is not replaced, and a write cut short by a full disk (ulimit
// -f) leaves the earlier dump as it was and no temporary file.
START_TEST(test_dump_logits_format_and_failed_writes) {
    char p[900], q[900], fifo[900];
    snprintf(p, sizeof p, "%s/fmt.st", root);
    ck_assert_msg(moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", run, p) == 0, "%s",
                  err_text());
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    ck_assert_int_eq(f->n_tensors, 3);
    const moe_st_tensor *tok = moe_st_find(f, "tokens"), *task = moe_st_find(f, "task_ids"),
                        *lg = moe_st_find(f, "logits");
    ck_assert(tok && task && lg);
    ck_assert(tok->dtype == MOE_ST_I32 && task->dtype == MOE_ST_I32 && lg->dtype == MOE_ST_F32);
    ck_assert_int_eq(tok->ndim, 2);
    ck_assert_int_eq(task->ndim, 1);
    ck_assert_int_eq(lg->ndim, 3);
    ck_assert_int_eq(task->shape[0], tok->shape[0]);
    ck_assert(lg->shape[0] == tok->shape[0] && lg->shape[1] == tok->shape[1]);
    ck_assert_int_eq(lg->shape[2], 256);
    moe_st_close(f);
    long n1, n2;
    char *a = slurp(p, &n1);
    snprintf(q, sizeof q, "%s/fmt8.st", root);
    ck_assert_msg(
        moe("eval '%s' --batches 1 --samples 0 --quantize int8 --dump-logits '%s'", run, q) == 0,
        "%s", err_text());
    char *b = slurp(q, &n2);
    ck_assert(n1 == n2 && !memcmp(a, b, (size_t)n1));
    free(b);
    // a FIFO and a file that is no dump: refused before evaluating, untouched
    snprintf(fifo, sizeof fifo, "%s/fifo.st", root);
    ck_assert_int_eq(mkfifo(fifo, 0644), 0);
    ck_assert_int_eq(moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", run, fifo), 2);
    ck_assert_str_eq(out_text(), "");
    expect_err("exists and is not an earlier logits dump");
    ck_assert_int_eq(unlink(fifo), 0);
    // a full disk: exit 1 naming the file, the earlier dump unchanged, no temporary left
    struct rlimit old, small;
    ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    small = old;
    small.rlim_cur = 64 * 1024; // the outputs fit, the dump does not
    signal(SIGXFSZ, SIG_IGN);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &small), 0);
    int rc = moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", run, p);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, SIG_DFL);
    ck_assert_int_eq(rc, 1);
    expect_err("write failed: File too large");
    b = slurp(p, &n2);
    ck_assert(n1 == n2 && !memcmp(a, b, (size_t)n1));
    free(a);
    free(b);
    DIR *d = opendir(root);
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        ck_assert_msg(strncmp(e->d_name, "fmt.st", 6) || !strcmp(e->d_name, "fmt.st"),
                      "left behind: %s", e->d_name);
    closedir(d);
}
END_TEST

// --expert-budget on a checkpoint without task_experts.json: exit 2 before
// any of the evaluation is printed.
START_TEST(test_expert_budget_without_task_experts_is_refused_before_evaluating) {
    char dir[800], p[900];
    snprintf(dir, sizeof dir, "%s/nobudget", root);
    ck_assert_int_eq(
        moe("train '%s/configs/tiny.json' %s --out '%s'", MOE_SOURCE_DIR, small_run, dir), 0);
    snprintf(p, sizeof p, "%s/checkpoint/task_experts.json", dir);
    ck_assert_int_eq(unlink(p), 0);
    snprintf(p, sizeof p, "%s/checkpoint", dir);
    tu_refresh_manifest(p); // else the manifest's check refuses the missing file first
    ck_assert_int_eq(moe("eval '%s' --batches 1 --samples 0 --expert-budget 0.1", dir), 2);
    ck_assert_str_eq(out_text(), "");
    expect_err("task_experts.json");
    ck_assert_int_eq(moe("eval '%s' --batches 1 --samples 0 --quantize int8", dir), 0);
    ck_assert_ptr_nonnull(strstr(out_text(), "int8 experts"));
}
END_TEST

// Expert choice with router.ec_fallback = token_choice: the dump routes as the
// inference engine (generate, export) does, row by row; without the fallback
// there is nothing it could be compared with, and it is refused up front.
START_TEST(test_dump_logits_of_expert_choice_routes_as_inference) {
    char dir[800], p[900];
    snprintf(dir, sizeof dir, "%s/ec", root);
    ck_assert_int_eq(
        moe("train '%s/configs/expert_choice.json' %s --out '%s'", MOE_SOURCE_DIR, small_run, dir),
        0);
    snprintf(p, sizeof p, "%s/ec.st", root);
    ck_assert_msg(moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", dir, p) == 0, "%s",
                  err_text());
    moe_st_file *f;
    int32_t *tokens, *task;
    float *logits;
    int64_t ts[4], ls[4];
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    ck_assert_int_eq(moe_st_load(f, "tokens", MOE_ST_I32, 2, ts, (void **)&tokens), 0);
    ck_assert_int_eq(moe_st_load(f, "task_ids", MOE_ST_I32, 1, NULL, (void **)&task), 0);
    ck_assert_int_eq(moe_st_load(f, "logits", MOE_ST_F32, 3, ls, (void **)&logits), 0);
    moe_st_close(f);
    const int B = (int)ts[0], T = (int)ts[1], V = (int)ls[2];
    static const char *names[] = {"copy", "reverse", "sort", "caesar", "add"};
    int pos[256], seq[256] = {0};
    ck_assert_int_le(T, 256);
    for (int t = 0; t < T; t++)
        pos[t] = t;
    char ck[900];
    snprintf(ck, sizeof ck, "%s/checkpoint", dir);
    double diff = 0, top = 0;
    for (int r = 0; r < B; r++) {
        moe_infer e;
        moe_infer_opts o = {.task = names[task[r]], .max_seq = T};
        ck_assert_msg(moe_infer_open(&e, ck, &o) == 0, "%s", moe_last_error());
        ck_assert_int_eq(e.V, V);
        ck_assert_int_eq(moe_infer_forward(&e, tokens + (size_t)r * T, seq, pos, T), 0);
        for (size_t i = 0; i < (size_t)T * V; i++) {
            diff = fmax(diff, fabs(e.logits[i] - logits[(size_t)r * T * V + i]));
            top = fmax(top, fabs(e.logits[i]));
        }
        moe_infer_free(&e);
    }
    ck_assert_msg(diff <= 1e-6 * top, "dump differs from the inference engine by %g (max %g)", diff,
                  top);
    free(tokens);
    free(task);
    free(logits);
    snprintf(dir, sizeof dir, "%s/ec_none", root);
    ck_assert_int_eq(moe("train '%s/configs/expert_choice.json' %s --set router.ec_fallback=none "
                         "--out '%s'",
                         MOE_SOURCE_DIR, small_run, dir),
                     0);
    snprintf(p, sizeof p, "%s/ec_none.st", root);
    ck_assert_int_eq(moe("eval '%s' --batches 1 --samples 0 --dump-logits '%s'", dir, p), 2);
    ck_assert_str_eq(out_text(), "");
    expect_err("router.ec_fallback");
    ck_assert(!exists(p));
}
END_TEST

// With data.val_path, eval reads only the validation files: the training
// files may be gone.
START_TEST(test_eval_with_val_path_needs_no_training_files) {
    char dir[800], tr[800], va[800];
    snprintf(dir, sizeof dir, "%s/textrun", root);
    snprintf(tr, sizeof tr, "%s/train.txt", root);
    snprintf(va, sizeof va, "%s/val.txt", root);
    FILE *a = fopen(tr, "w"), *b = fopen(va, "w");
    for (int i = 0; i < 400; i++) {
        fprintf(a, "line %d of the training text\n", i);
        if (i < 100) fprintf(b, "line %d of the validation text\n", i);
    }
    fclose(a);
    fclose(b);
    ck_assert_msg(moe("train '%s/configs/tiny.json' %s --set data.kind=text --set data.path='%s' "
                      "--set data.val_path='%s' --out '%s'",
                      MOE_SOURCE_DIR, small_run, tr, va, dir) == 0,
                  "%s", err_text());
    ck_assert_int_eq(unlink(tr), 0);
    ck_assert_msg(moe("eval '%s' --batches 1 --samples 0", dir) == 0, "%s", err_text());
    ck_assert_ptr_nonnull(strstr(out_text(), "validation: loss"));
    ck_assert_int_eq(unlink(va), 0); // what it reads must be there
    ck_assert_int_eq(moe("eval '%s' --batches 1 --samples 0", dir), 2);
    expect_err("data.val_path");
}
END_TEST

int main(void) {
    Suite *s = suite_create("cli_infer");
    TCase *tc = tcase_create("generate");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_sample_token_never_picks_ids_past_the_tokenizer);
    tcase_add_test(tc, test_greedy_ties_go_to_the_lowest_id);
    tcase_add_test(tc, test_top_k_sampling_draws_what_selection_drew);
    tcase_add_test(tc, test_byte_model_with_a_larger_vocabulary_prints_only_bytes);
    tcase_add_test(tc, test_sampling_is_keyed_by_the_input_line_not_the_batch_row);
    tcase_add_test(tc, test_bad_input_line_is_refused_before_any_answer);
    tcase_add_test(tc, test_answer_cut_by_the_context_is_noted);
    tcase_add_test(tc, test_options_greedy_ignores_are_noted);
    tcase_add_test(tc, test_prompt_length_counts_the_bos_token);
    tcase_add_test(tc, test_invalid_utf8_prompt_is_refused_for_sentencepiece);
    suite_add_tcase(s, tc);
    tc = tcase_create("eval");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_dump_logits_is_refused_in_any_checkpoint_folder);
    tcase_add_test(tc, test_dump_logits_format_and_failed_writes);
    tcase_add_test(tc, test_expert_budget_without_task_experts_is_refused_before_evaluating);
    tcase_add_test(tc, test_dump_logits_of_expert_choice_routes_as_inference);
    tcase_add_test(tc, test_eval_with_val_path_needs_no_training_files);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
