// Tokenizers (moe/tokenizer.h): the byte tokenizer, SentencePiece models
// trained here on the repository's README through libsentencepiece (round
// trips, equality with the spm_encode tool, bad .model files refused), the
// model.tokenizer key, and a checkpoint that keeps its tokenizer: moe generate
// decodes with it after a reload, and moe export --hf writes it for transformers.
#include "moe/checkpoint.h"
#include "moe/config.h"
#include "moe/error.h"
#include "moe/export.h"
#include "moe/fsio.h"
#include "moe/infer.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/prepare.h"
#include "moe/tokenizer.h"
#include "testutil.h"

#include <errno.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define VOCAB 1000

// The suite's folder: the SentencePiece model (tok.model), trained once.
static char root[400], model_path[480];

static void train_tokenizer(void) {
    if (root[0]) return;
    const char *t = tu_tmpdir();
    ck_assert_ptr_nonnull(t);
    snprintf(root, sizeof root, "%s", t);
    char prefix[440];
    snprintf(prefix, sizeof prefix, "%s/tok", root);
    snprintf(model_path, sizeof model_path, "%s.model", prefix);
    ck_assert_msg(moe_tok_train_spm(MOE_SOURCE_DIR "/README.md", prefix, VOCAB) == 0, "%s",
                  moe_last_error());
}

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    ck_assert_ptr_nonnull(b);
    ck_assert_int_eq(fread(b, 1, (size_t)n, f), (size_t)n);
    b[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void write_bytes(const char *path, const void *b, size_t n) {
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fwrite(b, 1, n, f), n);
    fclose(f);
}

// text -> ids -> text must give text back, every id inside the vocabulary.
static void round_trip(const moe_tokenizer *t, const char *text, size_t len) {
    int32_t *ids;
    size_t n;
    ck_assert_msg(moe_tok_encode(t, text, len, &ids, &n) == 0, "%s", moe_last_error());
    for (size_t i = 0; i < n; i++)
        ck_assert(ids[i] >= 0 && ids[i] < moe_tok_vocab_size(t));
    char *back;
    size_t blen;
    ck_assert_msg(moe_tok_decode(t, ids, n, &back, &blen) == 0, "%s", moe_last_error());
    ck_assert_msg(blen == len && !memcmp(back, text, len), "'%.*s' came back as '%s'", (int)len,
                  text, back);
    ck_assert_int_eq(back[blen], 0);
    free(ids);
    free(back);
}

START_TEST(test_bytes_tokenizer_is_the_identity_on_bytes) {
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open("bytes", &t), 0);
    ck_assert_str_eq(moe_tok_kind(t), "bytes");
    ck_assert_int_eq(moe_tok_vocab_size(t), 256);
    ck_assert_int_eq(moe_tok_bos_id(t), -1);
    ck_assert_int_eq(moe_tok_eos_id(t), -1);
    const char text[] = "ab\n\xc3\xa9\xff\x01 z"; // UTF-8, a stray 0xff, a control byte
    int32_t *ids;
    size_t n;
    ck_assert_int_eq(moe_tok_encode(t, text, sizeof text - 1, &ids, &n), 0);
    ck_assert_int_eq(n, sizeof text - 1);
    for (size_t i = 0; i < n; i++)
        ck_assert_int_eq(ids[i], (unsigned char)text[i]);
    free(ids);
    round_trip(t, text, sizeof text - 1);
    round_trip(t, "", 0);
    char piece[16];
    ck_assert_int_eq(moe_tok_piece(t, 'A', piece, sizeof piece), 0);
    ck_assert_str_eq(piece, "A");
    ck_assert_int_eq(moe_tok_piece(t, '\n', piece, sizeof piece), 0);
    ck_assert_str_eq(piece, "<0x0A>");
    size_t len;
    ck_assert_ptr_null(moe_tok_model_bytes(t, &len));
    ck_assert_int_eq(len, 0);
    moe_tok_free(t);
}
END_TEST

START_TEST(test_decode_refuses_ids_outside_the_vocabulary) {
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open("bytes", &t), 0);
    char *s;
    size_t n;
    const int32_t bad[] = {65, 256};
    ck_assert_int_eq(moe_tok_decode(t, bad, 2, &s, &n), MOE_EINVAL);
    ck_assert_ptr_null(s);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "token 256"));
    const int32_t neg[] = {-1};
    ck_assert_int_eq(moe_tok_decode(t, neg, 1, &s, &n), MOE_EINVAL);
    char piece[8];
    ck_assert_int_eq(moe_tok_piece(t, 300, piece, sizeof piece), MOE_EINVAL);
    moe_tok_free(t);
    if (!moe_tok_have_sentencepiece()) return;
    train_tokenizer();
    ck_assert_int_eq(moe_tok_open(model_path, &t), 0);
    const int32_t over[] = {5, VOCAB};
    ck_assert_int_eq(moe_tok_decode(t, over, 2, &s, &n), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "outside the vocabulary 0..999"));
    moe_tok_free(t);
}
END_TEST

START_TEST(test_spm_model_has_the_trained_vocabulary_and_specials) {
    train_tokenizer();
    moe_tokenizer *t;
    ck_assert_msg(moe_tok_open(model_path, &t) == 0, "%s", moe_last_error());
    ck_assert_str_eq(moe_tok_kind(t), "sentencepiece");
    ck_assert_int_eq(moe_tok_vocab_size(t), VOCAB);
    ck_assert_int_eq(moe_tok_bos_id(t), 1); // spm_train's defaults: <unk> 0, <s> 1, </s> 2
    ck_assert_int_eq(moe_tok_eos_id(t), 2);
    char piece[64];
    ck_assert_int_eq(moe_tok_piece(t, 1, piece, sizeof piece), 0);
    ck_assert_str_eq(piece, "<s>");
    ck_assert_int_eq(moe_tok_piece(t, 2, piece, sizeof piece), 0);
    ck_assert_str_eq(piece, "</s>");
    ck_assert_int_eq(moe_tok_piece(t, 3 + '\n', piece, sizeof piece), 0); // byte fallback
    ck_assert_str_eq(piece, "<0x0A>");
    size_t len, flen;
    const void *b = moe_tok_model_bytes(t, &len);
    char *file = slurp(model_path, &flen);
    ck_assert_int_eq(len, flen);
    ck_assert(!memcmp(b, file, len));
    free(file);
    // Text the model saw encodes into fewer tokens than bytes (merges were learned).
    const char *seen = "The checkpoint is written to a temp name, fsynced, renamed";
    int32_t *ids;
    size_t n;
    ck_assert_int_eq(moe_tok_encode(t, seen, strlen(seen), &ids, &n), 0);
    ck_assert_msg(n > 0 && n < strlen(seen) / 2, "%zu tokens for %zu bytes", n, strlen(seen));
    free(ids);
    moe_tok_free(t);
}
END_TEST

START_TEST(test_spm_round_trips_text_through_libsentencepiece) {
    train_tokenizer();
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(model_path, &t), 0);
    const char *texts[] = {
        "Mixture of Experts",
        "moe train configs/tiny.json --set router.top_k=1",
        "  two leading spaces,  two inside, one trailing ",
        "lines\nand\ttabs\r\n",
        "caf\xc3\xa9 na\xc3\xafve \xe2\x86\x92 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e", // é ï →
                                                                                      // 日本語
        "\xf0\x9f\x99\x82 emoji, digits 0123456789, symbols {}[]<>#$%^&*~`|\\",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        round_trip(t, texts[i], strlen(texts[i]));
    int32_t *ids;
    size_t n;
    ck_assert_int_eq(moe_tok_encode(t, "", 0, &ids, &n), 0);
    ck_assert_int_eq(n, 0);
    free(ids);
    // BOS and EOS decode to nothing (transformers' skip_special_tokens)
    const int32_t with_specials[] = {1, 3 + 'h', 3 + 'i', 2};
    char *s;
    ck_assert_int_eq(moe_tok_decode(t, with_specials, 4, &s, &n), 0);
    ck_assert_str_eq(s, "hi");
    free(s);
    moe_tok_free(t);
}
END_TEST

// The ids of the wrapper equal those of the sentencepiece tools' spm_encode
// (the reference), when the tools are installed.
START_TEST(test_spm_ids_equal_spm_encode) {
    if (system("command -v spm_encode >/dev/null 2>&1") != 0) {
        fprintf(stderr, "test_spm_ids_equal_spm_encode: skipped (no spm_encode tool)\n");
        return;
    }
    train_tokenizer();
    const char *text =
        "Experts are sharded over the expert-parallel group, caf\xc3\xa9 \xe2\x86\x92";
    char in[800], out[800], cmd[2600];
    snprintf(in, sizeof in, "%s/line.txt", root);
    snprintf(out, sizeof out, "%s/ids.txt", root);
    FILE *f = fopen(in, "w");
    fprintf(f, "%s\n", text);
    fclose(f);
    snprintf(cmd, sizeof cmd, "spm_encode --model='%s' --output_format=id <'%s' >'%s'", model_path,
             in, out);
    ck_assert_int_eq(system(cmd), 0);
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(model_path, &t), 0);
    int32_t *ids;
    size_t n;
    ck_assert_int_eq(moe_tok_encode(t, text, strlen(text), &ids, &n), 0);
    f = fopen(out, "r");
    ck_assert_ptr_nonnull(f);
    size_t k = 0;
    int v;
    while (fscanf(f, "%d", &v) == 1) {
        ck_assert_msg(k < n, "spm_encode gives more than %zu ids", n);
        ck_assert_int_eq(ids[k], v);
        k++;
    }
    fclose(f);
    ck_assert_int_eq(k, n);
    free(ids);
    moe_tok_free(t);
}
END_TEST

// A bad .model is refused with the file named and the code of the fault.
// moe prepare --tokenizer PATH: the shard holds BOS + the document's ids, and
// decoding them gives the document back byte for byte.
START_TEST(test_prepare_with_spm_writes_bos_and_ids_that_decode_to_the_text) {
    train_tokenizer();
    moe_prepare_tokenizer ptk;
    ck_assert_msg(moe_prepare_tokenizer_open(&ptk, model_path) == 0, "%s", moe_last_error());
    ck_assert_int_eq(ptk.vocab_size, VOCAB);
    char out[480];
    snprintf(out, sizeof out, "%s/shards", root);
    const char *inputs[] = {MOE_SOURCE_DIR "/README.md"};
    moe_prepare_opts o = {.out_dir = out,
                          .inputs = inputs,
                          .n_inputs = 1,
                          .tokenizer = &ptk,
                          .val_fraction = 0,
                          .seed = 1,
                          .doc = MOE_DOC_FILE,
                          .shard_tokens = 100000000};
    moe_prepare_result r;
    ck_assert_msg(moe_prepare(&o, &r) == 0, "%s", moe_last_error());
    moe_prepare_tokenizer_close(&ptk);
    ck_assert_int_eq(r.version, 1);
    char shard[520];
    snprintf(shard, sizeof shard, "%s/train_000000.bin", out);
    size_t len, tlen;
    char *bin = slurp(shard, &len);
    char *text = slurp(MOE_SOURCE_DIR "/README.md", &tlen);
    const int32_t *h = (const int32_t *)bin;
    ck_assert_int_eq(h[0], 20240520);
    ck_assert_int_eq(h[1], 1);
    size_t n = (size_t)h[2];
    ck_assert_uint_eq(len, 256 * sizeof(int32_t) + n * sizeof(uint16_t));
    ck_assert_int_eq((long)n, r.tokens[0]);
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(model_path, &t), 0);
    const uint16_t *tok = (const uint16_t *)(bin + 256 * sizeof(int32_t));
    ck_assert_int_eq(tok[0], moe_tok_bos_id(t));
    int32_t *ids = malloc(n * sizeof *ids);
    ck_assert_ptr_nonnull(ids);
    for (size_t i = 0; i < n; i++)
        ids[i] = tok[i];
    char *back;
    size_t blen;
    ck_assert_msg(moe_tok_decode(t, ids + 1, n - 1, &back, &blen) == 0, "%s", moe_last_error());
    ck_assert_msg(blen == tlen && !memcmp(back, text, tlen), "decoded %zu bytes, README has %zu",
                  blen, tlen);
    free(back);
    free(ids);
    moe_tok_free(t);
    free(bin);
    free(text);
}
END_TEST

// The shards of prepare with --tokenizer MODEL, as their raw bytes.
static char *spm_shards(const char *input, moe_doc_unit doc, size_t part_bytes, const char *name,
                        size_t *len) {
    moe_prepare_tokenizer ptk;
    ck_assert_msg(moe_prepare_tokenizer_open(&ptk, model_path) == 0, "%s", moe_last_error());
    char out[600], shard[700];
    snprintf(out, sizeof out, "%s/%s", root, name);
    const char *inputs[] = {input};
    moe_prepare_opts o = {.out_dir = out,
                          .inputs = inputs,
                          .n_inputs = 1,
                          .tokenizer = &ptk,
                          .doc = doc,
                          .shard_tokens = 100000000,
                          .part_bytes = part_bytes};
    moe_prepare_result r;
    ck_assert_msg(moe_prepare(&o, &r) == 0, "%s", moe_last_error());
    moe_prepare_tokenizer_close(&ptk);
    ck_assert_int_eq(r.shards[0], 1);
    snprintf(shard, sizeof shard, "%s/train_000000.bin", out);
    return slurp(shard, len);
}

// A long document is encoded in parts (SentencePiece takes ~220x the bytes
// it encodes at once); cut after a newline or before a space, the tokens
// equal those of the whole document: README in one piece and in parts of at
// most 4096 bytes (cuts at newlines) or 200 (11 cuts at spaces); README as one
// line in parts of 200 (cuts at spaces).
START_TEST(test_prepare_spm_parts_equal_whole_document_encoding) {
    train_tokenizer();
    const char *readme = MOE_SOURCE_DIR "/README.md";
    size_t n_whole, n_nl, n_sp;
    char *whole = spm_shards(readme, MOE_DOC_FILE, (size_t)1 << 30, "whole", &n_whole);
    char *nl = spm_shards(readme, MOE_DOC_FILE, 4096, "parts4096", &n_nl);
    char *sp = spm_shards(readme, MOE_DOC_FILE, 200, "parts200", &n_sp);
    ck_assert_uint_gt(n_whole, 1024 + 2 * 10000);
    ck_assert_uint_eq(n_nl, n_whole);
    ck_assert(memcmp(nl, whole, n_whole) == 0);
    ck_assert_uint_eq(n_sp, n_whole);
    ck_assert(memcmp(sp, whole, n_whole) == 0);
    // one line of 118 KB: every cut at 200 bytes is before a space
    size_t tlen;
    char *text = slurp(readme, &tlen), line[600];
    for (size_t i = 0; i < tlen; i++)
        if (text[i] == '\n') text[i] = ' ';
    snprintf(line, sizeof line, "%s/oneline.txt", root);
    write_bytes(line, text, tlen);
    free(text);
    size_t n_l1, n_l2;
    char *l1 = spm_shards(line, MOE_DOC_FILE, (size_t)1 << 30, "line_whole", &n_l1);
    char *l2 = spm_shards(line, MOE_DOC_FILE, 200, "line_parts", &n_l2);
    ck_assert_uint_eq(n_l1, n_l2);
    ck_assert(memcmp(l1, l2, n_l1) == 0);
    free(l1);
    free(l2);
    // the model without the dummy prefix is what makes this hold: a later
    // part encoded as a document of its own starts with "▁" instead
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(model_path, &t), 0);
    int32_t *a, *b;
    size_t na, nb;
    ck_assert_int_eq(moe_tok_encode_part(t, "model", 5, 1, &a, &na), 0);
    ck_assert_int_eq(moe_tok_encode_part(t, "model", 5, 0, &b, &nb), 0);
    ck_assert(na != nb || memcmp(a, b, na * sizeof *a) != 0);
    free(a);
    free(b);
    moe_tok_free(t);
    free(whole);
    free(nl);
    free(sp);
}
END_TEST

static void refused(const char *path, int code, const char *what) {
    moe_tokenizer *t = (moe_tokenizer *)1;
    int rc = moe_tok_open(path, &t);
    ck_assert_msg(rc == code, "%s: code %d, expected %d (%s)", path, rc, code, moe_last_error());
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(moe_last_error(), path) && strstr(moe_last_error(), what),
                  "message '%s' lacks '%s' or '%s'", moe_last_error(), path, what);
}

START_TEST(test_bad_model_files_are_refused) {
    train_tokenizer();
    char p[800];
    snprintf(p, sizeof p, "%s/absent.model", root);
    refused(p, MOE_ENOTFOUND, "cannot open");
    snprintf(p, sizeof p, "%s/empty.model", root);
    write_bytes(p, "", 0);
    refused(p, MOE_EFORMAT, "0 bytes");
    snprintf(p, sizeof p, "%s/text.model", root);
    write_bytes(p, "this is not a model\n", 20);
    refused(p, MOE_EFORMAT, "not a SentencePiece model");
    snprintf(p, sizeof p, "%s/adir.model", root);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    refused(p, MOE_EFORMAT, "not a regular file");
    rmdir(p);
    // Truncated at many lengths: never a crash, always refused or (a prefix
    // that is itself a whole model) a model whose ids stay in range.
    size_t len;
    char *good = slurp(model_path, &len);
    snprintf(p, sizeof p, "%s/cut.model", root);
    int n_refused = 0;
    for (size_t cut = 1; cut < len; cut += len / 97 + 1) {
        write_bytes(p, good, cut);
        moe_tokenizer *t;
        if (moe_tok_open(p, &t) < 0) {
            ck_assert_ptr_nonnull(strstr(moe_last_error(), p));
            n_refused++;
            continue;
        }
        round_trip(t, "abc", 3);
        moe_tok_free(t);
    }
    ck_assert_int_gt(n_refused, 50);
    write_bytes(p, good, len / 2);
    refused(p, MOE_EFORMAT, "SentencePiece");
    free(good);
}
END_TEST

START_TEST(test_spm_model_is_refused_without_the_library) {
    if (moe_tok_have_sentencepiece()) return; // covered by the build without it
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(MOE_SOURCE_DIR "/README.md", &t), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "libsentencepiece"));
}
END_TEST

START_TEST(test_vocab_size_below_the_tokenizer_is_refused) {
    train_tokenizer();
    moe_config c = tu_small_config();
    snprintf(c.model.tokenizer, sizeof c.model.tokenizer, "%s", model_path);
    snprintf(c.data.kind, sizeof c.data.kind, "bin");
    c.model.vocab_size = VOCAB - 1;
    ck_assert_int_eq(moe_tok_check_config(&c), MOE_EINVAL);
    const char *m = moe_last_error();
    ck_assert_msg(strstr(m, "has 1000 pieces") && strstr(m, "model.vocab_size = 999") &&
                      strstr(m, "set model.vocab_size >= 1000"),
                  "%s", m);
    c.model.vocab_size = VOCAB;
    ck_assert_msg(moe_tok_check_config(&c) == 0, "%s", moe_last_error());
    snprintf(c.model.tokenizer, sizeof c.model.tokenizer, "bytes");
    ck_assert_int_eq(moe_tok_check_config(&c), 0);
}
END_TEST

START_TEST(test_config_key_and_byte_data_combinations) {
    moe_config c;
    moe_config_default(&c);
    ck_assert_str_eq(c.model.tokenizer, "bytes");
    moe_config_src *src = moe_config_src_new();
    ck_assert_int_eq(moe_config_set(&c, src, "model.tokenizer=some/tok.model"), 0);
    ck_assert_str_eq(c.model.tokenizer, "some/tok.model");
    // synthetic tasks (the default data) are byte tokens
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "--set model.tokenizer") &&
                      strstr(moe_last_error(), "data.kind = synthetic"),
                  "%s", moe_last_error());
    ck_assert_int_eq(moe_config_set(&c, src, "data.kind=text"), 0);
    ck_assert_int_eq(moe_config_set(&c, src, "data.path=x.txt"), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, src, "data.kind=bin"), 0);
    ck_assert_msg(moe_config_check(&c, src) == 0, "%s", moe_last_error());
    ck_assert_int_eq(moe_config_set(&c, src, "model.tokenizer="), 0);
    ck_assert_int_eq(moe_config_check(&c, src), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "model.tokenizer is empty"));
    moe_config_src_free(src);
}
END_TEST

// --- a tiny model trained on tokens of the README, through the CLI ----------

static char run_dir[700], ckpt[800];

// README tokens as an llm.c token file (header of 256 int32, uint16 tokens),
// a config naming the tokenizer, and `moe train` on it: once per test case.
static void train_model(void) {
    if (ckpt[0]) return;
    train_tokenizer();
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(model_path, &t), 0);
    size_t len, n;
    char *text = slurp(MOE_SOURCE_DIR "/README.md", &len);
    int32_t *ids;
    ck_assert_int_eq(moe_tok_encode(t, text, len, &ids, &n), 0);
    free(text);
    moe_tok_free(t);
    char p[800];
    snprintf(p, sizeof p, "%s/readme.bin", root);
    FILE *f = fopen(p, "wb");
    int32_t hdr[256] = {20240520, 1, (int32_t)n};
    fwrite(hdr, sizeof hdr, 1, f);
    for (size_t i = 0; i < n; i++) {
        uint16_t v = (uint16_t)ids[i];
        fwrite(&v, 2, 1, f);
    }
    fclose(f);
    free(ids);
    snprintf(p, sizeof p, "%s/cfg.json", root);
    f = fopen(p, "w");
    fprintf(f,
            "{\"model\": {\"vocab_size\": %d, \"d_model\": 32, \"n_layers\": 2, \"d_ff\": 48,"
            " \"seq_len\": 32, \"tokenizer\": \"%s\"},\n"
            " \"moe\": {\"num_experts\": 4},\n"
            " \"train\": {\"steps\": 30, \"batch_size\": 4, \"lr\": 1e-2, \"warmup_steps\": 5,"
            " \"eval_every\": 0},\n"
            " \"data\": {\"kind\": \"bin\", \"path\": \"%s/readme.bin\"}}\n",
            VOCAB + 16, model_path, root); // a vocabulary larger than the tokenizer's is fine
    fclose(f);
    snprintf(run_dir, sizeof run_dir, "%s/run", root);
    char args[2400];
    snprintf(args, sizeof args, "train '%s/cfg.json' --out '%s'", root, run_dir);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    snprintf(ckpt, sizeof ckpt, "%s/checkpoint", run_dir);
}

static void suite_teardown(void) {
    if (root[0]) moe_fs_remove_tree(root);
    root[0] = ckpt[0] = 0;
}

START_TEST(test_checkpoint_keeps_a_copy_of_its_tokenizer) {
    train_model();
    char p[900];
    snprintf(p, sizeof p, "%s/tokenizer.model", ckpt);
    size_t a, b;
    char *copy = slurp(p, &a), *orig = slurp(model_path, &b);
    ck_assert_ptr_nonnull(copy);
    ck_assert(a == b && !memcmp(copy, orig, a));
    free(copy);
    free(orig);
    // config.json names the copy relative to the folder; the manifest lists it
    ck_assert_ptr_nonnull(strstr(tu_file_text(ckpt, "config.json"), "\"tokenizer.model\""));
    ck_assert_ptr_nonnull(strstr(tu_file_text(ckpt, "manifest.json"), "\"tokenizer.model\""));
    ck_assert(moe_ckpt_complete(ckpt));
    moe_config c;
    ck_assert_int_eq(moe_ckpt_config(ckpt, &c), 0);
    ck_assert_str_eq(c.model.tokenizer, p);
}
END_TEST

// The answer of the CLI equals the library's greedy generation decoded with
// the checkpoint's tokenizer (BOS first, stop at EOS, control bytes as \xNN).
static void expected_answer(const char *dir, const char *prompt, int max_new, char *out,
                            size_t cap) {
    moe_infer m;
    moe_infer_opts io = {.task = "all", .max_batch = 1};
    ck_assert_msg(moe_infer_open(&m, dir, &io) == 0, "%s", moe_last_error());
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(m.cfg.model.tokenizer, &t), 0);
    int32_t *ids, pr[256], gen[64];
    size_t n;
    ck_assert_int_eq(moe_tok_encode(t, prompt, strlen(prompt), &ids, &n), 0);
    pr[0] = moe_tok_bos_id(t);
    memcpy(pr + 1, ids, sizeof(int32_t) * n);
    free(ids);
    const int32_t *cp[1] = {pr};
    int np[1] = {(int)n + 1}, nout[1];
    moe_gen_opts go = {.max_new = max_new, .stop = moe_tok_eos_id(t)};
    moe_gen_stats gs;
    ck_assert_int_eq(moe_generate(&m, 1, cp, np, &go, gen, nout, &gs), 0);
    int k = nout[0];
    if (k > 0 && gen[k - 1] == go.stop) k--;
    char *s;
    ck_assert_int_eq(moe_tok_decode(t, gen, (size_t)k, &s, &n), 0);
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        o += (size_t)snprintf(out + o, cap - o, c < 32 || c == 127 ? "\\x%02x" : "%c", c);
    }
    snprintf(out + o, cap - o, "\n");
    free(s);
    moe_tok_free(t);
    moe_infer_free(&m);
}

START_TEST(test_generate_decodes_with_the_checkpoint_tokenizer) {
    train_model();
    // Moved away from where it was trained, its tokenizer's original gone:
    // the checkpoint stands alone.
    char moved[900], hidden[900], args[2400];
    snprintf(moved, sizeof moved, "%s/moved", root);
    snprintf(hidden, sizeof hidden, "%s.hidden", model_path);
    ck_assert_int_eq(rename(ckpt, moved), 0);
    ck_assert_int_eq(rename(model_path, hidden), 0);
    snprintf(args, sizeof args, "generate '%s' --task all --prompt 'The router' --max-new 12",
             moved);
    int rc = tu_run_moe(root, args);
    char want[1024];
    expected_answer(moved, "The router", 12, want, sizeof want);
    ck_assert_int_eq(rename(moved, ckpt), 0);
    ck_assert_int_eq(rename(hidden, model_path), 0);
    ck_assert_msg(rc == 0, "%s", tu_file_text(root, "err.txt"));
    const char *got = tu_file_text(root, "out.txt");
    ck_assert_msg(!strcmp(got, want), "moe generate printed '%s', the library decodes '%s'", got,
                  want);
    ck_assert_msg(strlen(got) > 1, "empty answer");
}
END_TEST

// vocab_size is 16 past the tokenizer's 1000 pieces: near-uniform sampling
// would pick ids 1000..1015 (about one draw in 60), which no piece decodes;
// they are never produced, so every answer decodes (before: exit 2).
START_TEST(test_generate_samples_only_the_tokenizer_pieces) {
    train_model();
    char p[900], args[2400];
    snprintf(p, sizeof p, "%s/prompts.txt", root);
    FILE *f = fopen(p, "w");
    fputs("The model\nA\nB\nThe router\n", f);
    fclose(f);
    snprintf(args, sizeof args,
             "generate '%s' --input '%s' --temperature 1000 --max-new 100 --seed 0 --quiet", ckpt,
             p);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    int lines = 0;
    for (const char *s = tu_file_text(root, "out.txt"); *s; s++)
        lines += *s == '\n';
    ck_assert_int_eq(lines, 4);
}
END_TEST

START_TEST(test_generate_refuses_a_checkpoint_whose_tokenizer_is_broken) {
    train_model();
    char p[900], keep[900], args[1200];
    snprintf(p, sizeof p, "%s/tokenizer.model", ckpt);
    snprintf(keep, sizeof keep, "%s/tokenizer.keep", root);
    ck_assert_int_eq(rename(p, keep), 0);
    write_bytes(p, "garbage", 7);
    tu_refresh_manifest(ckpt); // past the manifest's size check, to the tokenizer's
    snprintf(args, sizeof args, "generate '%s' --task all --prompt 'x' --quiet", ckpt);
    int rc = tu_run_moe(root, args);
    ck_assert_int_eq(rename(keep, p), 0);
    tu_refresh_manifest(ckpt);
    ck_assert_int_eq(rc, 2);
    const char *err = tu_file_text(root, "err.txt");
    ck_assert_msg(strstr(err, "tokenizer.model") && strstr(err, "not a SentencePiece model"), "%s",
                  err);
}
END_TEST

START_TEST(test_export_writes_the_tokenizer_for_transformers) {
    train_model();
    char out[900], args[2400], p[1000];
    snprintf(out, sizeof out, "%s/hf", root);
    snprintf(args, sizeof args, "export '%s' --hf '%s'", ckpt, out);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    snprintf(p, sizeof p, "%s/tokenizer.model", out);
    size_t a, b;
    char *copy = slurp(p, &a), *orig = slurp(model_path, &b);
    ck_assert_ptr_nonnull(copy);
    ck_assert(a == b && !memcmp(copy, orig, a));
    free(copy);
    free(orig);
    json_error_t je;
    snprintf(p, sizeof p, "%s/tokenizer_config.json", out);
    json_t *tc = json_load_file(p, 0, &je);
    ck_assert_ptr_nonnull(tc);
    ck_assert_str_eq(json_string_value(json_object_get(tc, "tokenizer_class")), "LlamaTokenizer");
    ck_assert_str_eq(json_string_value(json_object_get(tc, "bos_token")), "<s>");
    ck_assert_str_eq(json_string_value(json_object_get(tc, "eos_token")), "</s>");
    ck_assert(json_is_true(json_object_get(tc, "add_bos_token")));
    ck_assert(json_is_false(json_object_get(tc, "add_eos_token")));
    json_decref(tc);
    snprintf(p, sizeof p, "%s/special_tokens_map.json", out);
    json_t *sm = json_load_file(p, 0, &je);
    ck_assert_ptr_nonnull(sm);
    ck_assert_str_eq(json_string_value(json_object_get(sm, "unk_token")), "<unk>");
    json_decref(sm);
    // tokenizer.json: every piece at its id; every merge joins two pieces into
    // a piece, ranked by the merged piece's id (the order SentencePiece merges)
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(model_path, &t), 0);
    snprintf(p, sizeof p, "%s/tokenizer.json", out);
    json_t *tj = json_load_file(p, 0, &je);
    ck_assert_msg(tj != NULL, "%s: %s", p, je.text);
    json_t *model = json_object_get(tj, "model");
    ck_assert_str_eq(json_string_value(json_object_get(model, "type")), "BPE");
    json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    ck_assert_int_eq(json_object_size(vocab), VOCAB);
    char piece[256], joined[512];
    for (int id = 0; id < VOCAB; id++) {
        ck_assert_int_eq(moe_tok_piece(t, id, piece, sizeof piece), 0);
        ck_assert_int_eq(json_integer_value(json_object_get(vocab, piece)), id);
    }
    ck_assert_int_gt(json_array_size(merges), 100);
    json_int_t last = -1;
    for (size_t i = 0; i < json_array_size(merges); i++) {
        json_t *m = json_array_get(merges, i);
        snprintf(joined, sizeof joined, "%s%s", json_string_value(json_array_get(m, 0)),
                 json_string_value(json_array_get(m, 1)));
        json_t *id = json_object_get(vocab, joined);
        ck_assert_msg(id != NULL, "merge %zu makes '%s', not a piece", i, joined);
        ck_assert_int_ge(json_integer_value(id), last);
        last = json_integer_value(id);
    }
    json_decref(tj);
    moe_tok_free(t);
    snprintf(p, sizeof p, "%s/config.json", out);
    json_t *cf = json_load_file(p, 0, &je);
    ck_assert_ptr_nonnull(cf);
    ck_assert_int_eq(json_integer_value(json_object_get(cf, "bos_token_id")), 1);
    ck_assert_int_eq(json_integer_value(json_object_get(cf, "eos_token_id")), 2);
    ck_assert_int_eq(json_integer_value(json_object_get(cf, "vocab_size")), VOCAB + 16);
    ck_assert_str_eq(json_string_value(json_object_get(cf, "moe_tokenizer")), "sentencepiece");
    json_decref(cf);
}
END_TEST

// A save with a tokenizer through the counted calls (moe/fsio.h): its copy
// costs three more calls (create, write, fsync), and a failure at any call of
// the save leaves a checkpoint whose config names a tokenizer that opens.
START_TEST(test_save_with_tokenizer_survives_a_failed_call_at_every_point) {
    train_tokenizer();
    moe_config c = tu_ckpt_config();
    c.model.vocab_size = VOCAB + 24;
    snprintf(c.data.kind, sizeof c.data.kind, "bin");
    snprintf(c.data.path, sizeof c.data.path, "unused.bin");
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 1), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    char dir[700];
    snprintf(dir, sizeof dir, "%s/faults", root);
    moe_train_state st = {.step = 1};
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    ck_assert_int_eq(moe_ckpt_save(dir, &m, &opt, &st, NULL), 0);
    moe_fs_fault_arm(0, MOE_FAULT_OFF); // a save over an existing checkpoint, as below
    ck_assert_int_eq(moe_ckpt_save(dir, &m, &opt, &st, NULL), 0);
    const long bytes_calls = moe_fs_op_count();
    snprintf(m.cfg.model.tokenizer, sizeof m.cfg.model.tokenizer, "%s", model_path);
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    ck_assert_int_eq(moe_ckpt_save(dir, &m, &opt, &st, NULL), 0);
    const long n = moe_fs_op_count();
    ck_assert_int_eq(n, bytes_calls + 3);
    for (long i = 1; i <= n; i++) {
        st.step = 10 + i;
        moe_fs_fault_arm(i, MOE_FAULT_FAIL);
        int rc = moe_ckpt_save(dir, &m, &opt, &st, NULL);
        moe_fs_fault_arm(0, MOE_FAULT_OFF);
        (void)rc; // a failure after the swap is logged, not returned
        moe_config got;
        ck_assert_msg(moe_ckpt_config(dir, &got) == 0, "fault at call %ld: %s", i,
                      moe_last_error());
        moe_tokenizer *t;
        ck_assert_msg(moe_tok_open(got.model.tokenizer, &t) == 0, "fault at call %ld: %s", i,
                      moe_last_error());
        ck_assert_int_eq(moe_tok_vocab_size(t), VOCAB);
        moe_tok_free(t);
    }
    ck_assert_int_eq(moe_ckpt_save(dir, &m, &opt, &st, NULL), 0);
    char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, MOE_CKPT_TOKENIZER);
    ck_assert_int_eq(access(p, F_OK), 0);
    moe_adamw_free(&opt);
    moe_model_free(&m);
}
END_TEST

// Every save copies the tokenizer the caller opened (model.tokenizer read
// once when the run starts): a file replaced or removed between two saves
// changes neither checkpoint's copy.
START_TEST(test_saves_copy_the_tokenizer_read_when_the_run_started) {
    train_tokenizer();
    size_t n0, n;
    char *orig = slurp(model_path, &n0), live[460], dir[700], p[800];
    snprintf(live, sizeof live, "%s/live.model", root);
    write_bytes(live, orig, n0);
    moe_config c = tu_ckpt_config();
    c.model.vocab_size = VOCAB + 24;
    snprintf(c.data.kind, sizeof c.data.kind, "bin");
    snprintf(c.data.path, sizeof c.data.path, "unused.bin");
    snprintf(c.model.tokenizer, sizeof c.model.tokenizer, "%s", live);
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 1), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(live, &t), 0);
    m.tokenizer = t;
    snprintf(dir, sizeof dir, "%s/live-ckpt", root);
    snprintf(p, sizeof p, "%s/%s", dir, MOE_CKPT_TOKENIZER);
    moe_train_state st = {.step = 1};
    write_bytes(live, "another tokenizer", 17); // replaced after the run opened it
    ck_assert_msg(moe_ckpt_save(dir, &m, &opt, &st, NULL) == 0, "%s", moe_last_error());
    char *copy = slurp(p, &n);
    ck_assert(n == n0 && !memcmp(copy, orig, n0));
    free(copy);
    ck_assert_int_eq(unlink(live), 0); // and removed before the next save
    st.step = 2;
    ck_assert_msg(moe_ckpt_save(dir, &m, &opt, &st, NULL) == 0, "%s", moe_last_error());
    copy = slurp(p, &n);
    ck_assert(n == n0 && !memcmp(copy, orig, n0));
    free(copy);
    free(orig);
    moe_tok_free(t);
    moe_adamw_free(&opt);
    moe_model_free(&m);
}
END_TEST

// A run trained with tok.model's copy, saved at step 4: --resume trains on
// with the checkpoint's tokenizer. Its file removed, the copy is used (and
// saved again, byte for byte); its file replaced by another tokenizer, the
// resume is refused naming both.
START_TEST(test_resume_takes_the_checkpoint_tokenizer) {
    train_model(); // readme.bin
    size_t n0, n;
    char *orig = slurp(model_path, &n0), live[460], cfg[460], run[460], args[2400], p[1200];
    snprintf(live, sizeof live, "%s/resume.model", root);
    write_bytes(live, orig, n0);
    snprintf(cfg, sizeof cfg, "%s/resume.json", root);
    FILE *f = fopen(cfg, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "{\"model\": {\"vocab_size\": %d, \"d_model\": 32, \"n_layers\": 2, \"d_ff\": 48,"
            " \"seq_len\": 32, \"tokenizer\": \"%s\"},\n"
            " \"moe\": {\"num_experts\": 4},\n"
            " \"train\": {\"steps\": 4, \"batch_size\": 4, \"eval_every\": 0},\n"
            " \"data\": {\"kind\": \"bin\", \"path\": \"%s/readme.bin\"}}\n",
            VOCAB + 16, live, root);
    fclose(f);
    snprintf(run, sizeof run, "%s/resume-run", root);
    snprintf(args, sizeof args, "train '%s' --out '%s' --quiet", cfg, run);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    // replaced by another tokenizer: refused, naming the file and the copy
    char prefix[900], big[1000];
    snprintf(prefix, sizeof prefix, "%s/big", root);
    snprintf(big, sizeof big, "%s.model", prefix);
    if (access(big, F_OK) != 0)
        ck_assert_msg(moe_tok_train_spm(MOE_SOURCE_DIR "/README.md", prefix, 1100) == 0, "%s",
                      moe_last_error());
    char *other = slurp(big, &n);
    write_bytes(live, other, n);
    free(other);
    snprintf(args, sizeof args, "train --resume '%s' --steps 8 --quiet", run);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    const char *err = tu_file_text(root, "err.txt");
    snprintf(p, sizeof p, "model.tokenizer = %s differs from %s/checkpoint/tokenizer.model", live,
             run);
    ck_assert_msg(strstr(err, p), "%s", err);
    // a FIFO in its place: refused, naming the key
    ck_assert_int_eq(unlink(live), 0);
    ck_assert_int_eq(mkfifo(live, 0600), 0);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    err = tu_file_text(root, "err.txt");
    ck_assert_msg(strstr(err, "model.tokenizer: ") && strstr(err, "not a regular file"), "%s", err);
    // removed: the checkpoint's copy trains on and is saved again
    ck_assert_int_eq(unlink(live), 0);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    ck_assert_ptr_nonnull(
        strstr(tu_file_text(run, "checkpoint/trainer_state.json"), "\"step\": 8"));
    snprintf(p, sizeof p, "%s/checkpoint/%s", run, MOE_CKPT_TOKENIZER);
    char *copy = slurp(p, &n);
    ck_assert_ptr_nonnull(copy);
    ck_assert(n == n0 && !memcmp(copy, orig, n0));
    free(copy);
    free(orig);
}
END_TEST

// Shards record their tokenizer (manifest.json: name, vocab_size, hash of
// the .model's bytes); training on them with another tokenizer is refused
// naming the folder and both, with the same one it trains.
START_TEST(test_training_refuses_shards_of_another_tokenizer) {
    train_tokenizer();
    char sh[600], args[3000], want[2400], prefix[500], other[520];
    snprintf(sh, sizeof sh, "%s/sh-a", root);
    snprintf(args, sizeof args,
             "prepare '%s/README.md' --out '%s' --tokenizer '%s' --doc line --quiet",
             MOE_SOURCE_DIR, sh, model_path);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    moe_tokenizer *t;
    ck_assert_int_eq(moe_tok_open(model_path, &t), 0);
    char hash[24];
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)moe_tok_hash(t));
    moe_tok_free(t);
    snprintf(want, sizeof want, "\"tokenizer_hash\": \"%s\"", hash);
    ck_assert_msg(strstr(tu_file_text(sh, "manifest.json"), want), "%s",
                  tu_file_text(sh, "manifest.json"));
    // another tokenizer of the same size: only the hash tells
    snprintf(prefix, sizeof prefix, "%s/other", root);
    snprintf(other, sizeof other, "%s.model", prefix);
    char half[520];
    snprintf(half, sizeof half, "%s/half.txt", root);
    snprintf(args, sizeof args, "head -c 60000 '%s/README.md' > '%s'", MOE_SOURCE_DIR, half);
    ck_assert_int_eq(system(args), 0);
    ck_assert_msg(moe_tok_train_spm(half, prefix, VOCAB) == 0, "%s", moe_last_error());
    const char *common = "--set model.d_model=32 --set model.n_layers=2 --set model.d_ff=32 "
                         "--set moe.num_experts=4 --set train.batch_size=2 --set "
                         "model.seq_len=16 --set train.steps=2 --set train.eval_every=0 "
                         "--set data.kind=llmc --quiet";
    const char *toks[2] = {other, model_path};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args,
                 "train %s/configs/tiny.json %s --set model.vocab_size=%d --set "
                 "'model.tokenizer=%s' --set 'data.path=%s/train_*.bin' --set "
                 "'data.val_path=%s/val_*.bin' --out '%s/run-sh%d'",
                 MOE_SOURCE_DIR, common, VOCAB + 24, toks[i], sh, sh, root, i);
        const int code = tu_run_moe(root, args);
        const char *err = tu_file_text(root, "err.txt");
        if (i == 1) {
            ck_assert_msg(code == 0, "%s", err);
            break;
        }
        ck_assert_int_eq(code, 2);
        snprintf(want, sizeof want,
                 "%s: token files prepared with tokenizer %s (%d pieces, hash %s), but "
                 "model.tokenizer = %s (%d pieces, hash ",
                 sh, model_path, VOCAB, hash, toks[i], VOCAB);
        ck_assert_msg(strstr(err, want), "%s\nlacks\n%s", err, want);
    }
    // eval checks the shards against the checkpoint's tokenizer the same way
    snprintf(args, sizeof args, "eval '%s/run-sh1' --batches 1 --samples 0", root);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    char mf[700];
    snprintf(mf, sizeof mf, "%s/manifest.json", sh);
    char *text = strdup(tu_file_text(sh, "manifest.json")), *at = strstr(text, hash);
    ck_assert_ptr_nonnull(at);
    at[0] = at[0] == '0' ? '1' : '0'; // another tokenizer's hash
    FILE *f = fopen(mf, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
    free(text);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    const char *err = tu_file_text(root, "err.txt");
    snprintf(want, sizeof want, "moe eval: %s: token files prepared with tokenizer %s (%d pieces",
             sh, model_path, VOCAB);
    ck_assert_msg(strstr(err, want), "%s\nlacks\n%s", err, want);
}
END_TEST

// Protocol buffer encoding, enough for a SentencePiece ModelProto.
static size_t pb_varint(unsigned char *o, uint64_t v) {
    size_t n = 0;
    do {
        o[n++] = (unsigned char)((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return n;
}

static size_t pb_bytes(unsigned char *o, int field, const void *b, size_t len) {
    size_t n = pb_varint(o, (uint64_t)field << 3 | 2);
    n += pb_varint(o + n, len);
    memcpy(o + n, b, len);
    return n + len;
}

// A character model without byte fallback: <unk> 0, <s> 1, </s> 2 and the
// pieces "\xE2\x96\x81" (the word boundary), "a" and "b"; any other character
// encodes to <unk> (a run of them to one <unk>, as SentencePiece merges it).
static void write_char_model(const char *path) {
    static const char *const piece[] = {"<unk>", "<s>", "</s>", "\xE2\x96\x81", "a", "b"};
    static const int type[] = {2, 3, 3, 1, 1, 1}; // UNKNOWN, CONTROL, NORMAL
    unsigned char out[512], m[64];
    size_t n = 0;
    for (int i = 0; i < 6; i++) {
        size_t k = pb_bytes(m, 1, piece[i], strlen(piece[i]));
        m[k++] = 2 << 3 | 5; // score: float 0
        memset(m + k, 0, 4), k += 4;
        m[k++] = 3 << 3, m[k++] = (unsigned char)type[i];
        n += pb_bytes(out + n, 1, m, k);
    }
    const unsigned char trainer[] = {3 << 3, 4}; // model_type: CHAR
    n += pb_bytes(out + n, 2, trainer, sizeof trainer);
    size_t k = pb_bytes(m, 1, "identity", 8);
    m[k++] = 4 << 3, m[k++] = 0; // remove_extra_whitespaces: false
    n += pb_bytes(out + n, 3, m, k);
    write_bytes(path, out, n);
}

// prepare counts the <unk> tokens a model without byte fallback produces,
// exactly: in its result, its manifest and a warning with the share.
START_TEST(test_prepare_counts_unknown_tokens) {
    const char *dir = tu_tmpdir();
    char model[600], in[600], out[600], args[2400];
    snprintf(model, sizeof model, "%s/char.model", dir);
    snprintf(in, sizeof in, "%s/in.txt", dir);
    snprintf(out, sizeof out, "%s/sh", dir);
    write_char_model(model);
    moe_tokenizer *t;
    ck_assert_msg(moe_tok_open(model, &t) == 0, "%s", moe_last_error());
    ck_assert_int_eq(moe_tok_unk_id(t), 0);
    moe_tok_free(t);
    // one document: <s> ▁ a b <unk>(c) a <unk>(xy) b <unk>(é and the newline)
    write_bytes(in, "abcaxyb\xC3\xA9\n", 11);
    moe_prepare_tokenizer tk;
    ck_assert_int_eq(moe_prepare_tokenizer_open(&tk, model), 0);
    const char *inputs[1] = {in};
    moe_prepare_opts o = {
        .out_dir = out, .inputs = inputs, .n_inputs = 1, .tokenizer = &tk, .shard_tokens = 1 << 20};
    moe_prepare_result r;
    ck_assert_msg(moe_prepare(&o, &r) == 0, "%s", moe_last_error());
    moe_prepare_tokenizer_close(&tk);
    ck_assert_int_eq(r.tokens[0] + r.tokens[1], 9);
    ck_assert_int_eq(r.unk_tokens, 3);
    ck_assert_ptr_nonnull(strstr(tu_file_text(out, "manifest.json"), "\"unk_tokens\": 3,"));
    snprintf(args, sizeof args,
             "prepare '%s' --out '%s/sh2' --tokenizer '%s' --val-fraction 0 --quiet", in, dir,
             model);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    ck_assert_msg(strstr(tu_file_text(dir, "out.txt"), "; 3 <unk> tokens;"), "%s",
                  tu_file_text(dir, "out.txt"));
    ck_assert_msg(strstr(tu_file_text(dir, "err.txt"),
                         "moe prepare: warning: 3 of 9 tokens (33.33%) are <unk>"),
                  "%s", tu_file_text(dir, "err.txt"));
    moe_fs_remove_tree(dir);
}
END_TEST

// A copy of the checkpoint whose tokenizer.model is a 1100-piece model (the
// model has 1016 rows); manifest: refreshed (the copy is consistent) or not.
static void copy_with_big_tokenizer(const char *copy, bool refresh) {
    char cmd[2400], prefix[900], big[1000];
    snprintf(prefix, sizeof prefix, "%s/big", root);
    snprintf(big, sizeof big, "%s.model", prefix);
    if (access(big, F_OK) != 0)
        ck_assert_msg(moe_tok_train_spm(MOE_SOURCE_DIR "/README.md", prefix, 1100) == 0, "%s",
                      moe_last_error());
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s' && cp '%s' '%s/tokenizer.model'",
             copy, ckpt, copy, big, copy);
    ck_assert_int_eq(system(cmd), 0);
    if (refresh) tu_refresh_manifest(copy);
}

// generate and export apply one check: a tokenizer with more pieces than the
// model's vocabulary is refused by both, with the same message.
START_TEST(test_a_tokenizer_larger_than_the_model_is_refused_by_generate_and_export) {
    train_model();
    char copy[900], args[2400], msg[2][1024];
    snprintf(copy, sizeof copy, "%s/bigtok", root);
    copy_with_big_tokenizer(copy, true);
    snprintf(args, sizeof args, "generate '%s' --task all --prompt 'x' --quiet", copy);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    snprintf(msg[0], sizeof msg[0], "%s", strchr(tu_file_text(root, "err.txt"), ':'));
    snprintf(args, sizeof args, "export '%s' --hf '%s/hf-big'", copy, root);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    snprintf(msg[1], sizeof msg[1], "%s", strchr(tu_file_text(root, "err.txt"), ':'));
    ck_assert_msg(strstr(msg[0], "has 1100 pieces, the model 1016"), "%s", msg[0]);
    ck_assert_str_eq(msg[0], msg[1]);
    snprintf(args, sizeof args, "%s/hf-big", root);
    ck_assert_int_ne(access(args, F_OK), 0); // nothing written
}
END_TEST

// A tokenizer.model other than the one the save listed (another size) is
// refused by eval, generate and export, naming it and both sizes.
START_TEST(test_a_replaced_tokenizer_is_refused_by_every_reader) {
    train_model();
    char copy[900], args[2400], p[1000];
    snprintf(copy, sizeof copy, "%s/swapped", root);
    copy_with_big_tokenizer(copy, false);
    snprintf(p, sizeof p, "%s/tokenizer.model: is ", copy);
    const char *cmds[] = {"eval '%s'", "generate '%s' --task all --prompt 'x' --quiet",
                          "export '%s' --hf '%s/hf-swapped'"};
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, cmds[i], copy, root);
        ck_assert_int_eq(tu_run_moe(root, args), 2);
        const char *err = tu_file_text(root, "err.txt");
        ck_assert_msg(strstr(err, p) && strstr(err, "manifest.json lists"), "%s: %s", cmds[i], err);
    }
}
END_TEST

// A copy of the checkpoint with a unigram SentencePiece model of 600 pieces
// as its tokenizer (manifest refreshed); path into uni, the model into model.
static void unigram_checkpoint(char *uni, size_t cap, char *model, size_t mcap) {
    char prefix[700], cmd[8000];
    snprintf(uni, cap, "%s/uni-ck", root);
    snprintf(prefix, sizeof prefix, "%s/uni", root);
    snprintf(model, mcap, "%s.model", prefix);
    if (access(uni, F_OK) == 0) return;
    snprintf(cmd, sizeof cmd,
             "spm_train --input=" MOE_SOURCE_DIR "/README.md --model_prefix='%s' "
             "--vocab_size=600 --model_type=unigram --byte_fallback=true >/dev/null 2>&1 && "
             "cp -r '%s' '%s' && cp '%s' '%s/tokenizer.model'",
             prefix, ckpt, uni, model, uni);
    ck_assert_int_eq(system(cmd), 0);
    tu_refresh_manifest(uni);
}

static const char *const export_names[] = {"model.safetensors",     "config.json",
                                           "tokenizer.model",       "tokenizer.json",
                                           "tokenizer_config.json", "special_tokens_map.json"};

// Every export file of b equal to the same file of a, and no other file.
static void assert_same_folder(const char *a, const char *b, long call) {
    ck_assert_msg(tu_count_entries(a) == tu_count_entries(b), "fault at call %ld: %d files, not %d",
                  call, tu_count_entries(b), tu_count_entries(a));
    char pa[1000], pb[1000];
    for (int i = 0; i < 6; i++) {
        snprintf(pa, sizeof pa, "%s/%s", a, export_names[i]);
        snprintf(pb, sizeof pb, "%s/%s", b, export_names[i]);
        ck_assert_int_eq(access(pa, F_OK), access(pb, F_OK));
        if (access(pa, F_OK) == 0) tu_assert_same_file(pa, pb);
    }
}

// Exports `from` into out, then `to` over it failing at each of its counted
// file-system calls in turn: each failure leaves the first export byte for
// byte and names errno's text. Sets bit i of *named for each file of
// export_names a failure message named.
static void fail_over(const char *from, const char *to, const char *out, unsigned *named) {
    char snap[900], cmd[4000];
    snprintf(snap, sizeof snap, "%s.snap", out);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", out, snap);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_msg(moe_export_hf(from, out) == 0, "%s", moe_last_error());
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", out, snap);
    ck_assert_int_eq(system(cmd), 0);
    char redo[2000];
    snprintf(redo, sizeof redo, "rm -rf '%s' && cp -r '%s' '%s'", out, snap, out);
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    ck_assert_msg(moe_export_hf(to, out) == 0, "%s", moe_last_error());
    const long n = moe_fs_op_count();
    for (long i = 1; i <= n; i++) {
        ck_assert_int_eq(system(redo), 0);
        moe_fs_fault_arm(i, MOE_FAULT_FAIL);
        int rc = moe_export_hf(to, out);
        moe_fs_fault_arm(0, MOE_FAULT_OFF);
        if (rc == 0) continue; // a best-effort call (a folder's fsync) failed
        const char *err = moe_last_error();
        ck_assert_msg(strstr(err, strerror(EIO)), "fault at call %ld: %s", i, err);
        for (int f = 0; f < 6; f++) {
            char slash[64];
            snprintf(slash, sizeof slash, "/%s", export_names[f]);
            if (strstr(err, slash)) *named |= 1u << f;
        }
        assert_same_folder(snap, out, i);
    }
}

// An export over an earlier one that fails at any counted call of the
// export (moe/fsio.h: every file of it is written through them) leaves the
// earlier export as it was, with no file of its own.
START_TEST(test_a_failed_export_leaves_the_earlier_export_as_it_was) {
    train_model();
    char out[900], bytes_ck[900], uni[900], uni_model[900];
    snprintf(out, sizeof out, "%s/hf-over", root);
    snprintf(bytes_ck, sizeof bytes_ck, "%s/bytes-ck", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, bytes_ck);
    unigram_checkpoint(uni, sizeof uni, uni_model, sizeof uni_model);
    unsigned named = 0;
    fail_over(ckpt, bytes_ck, out, &named); // the tokenizer files go
    fail_over(ckpt, uni, out, &named);      // tokenizer.json goes
    fail_over(bytes_ck, ckpt, out, &named); // all six come
    ck_assert_msg(named == 0x3f, "only the files of mask 0x%x failed", named);
}
END_TEST

// A byte model's export over a SentencePiece one leaves no tokenizer file; a
// unigram SentencePiece model has no tokenizer.json (transformers converts
// it): its export over a BPE export leaves no stale tokenizer.json that
// AutoTokenizer would load instead.
START_TEST(test_an_export_removes_the_tokenizer_files_it_does_not_write) {
    train_model();
    char out[900], uni[900], uni_model[900], bytes_ck[900], p[1000];
    snprintf(out, sizeof out, "%s/hf-uni", root);
    unigram_checkpoint(uni, sizeof uni, uni_model, sizeof uni_model);
    ck_assert_msg(moe_export_hf(ckpt, out) == 0, "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/tokenizer.json", out);
    ck_assert_int_eq(access(p, F_OK), 0);
    ck_assert_msg(moe_export_hf(uni, out) == 0, "%s", moe_last_error());
    ck_assert_int_ne(access(p, F_OK), 0);
    snprintf(p, sizeof p, "%s/tokenizer.model", out);
    tu_assert_same_file(p, uni_model);
    ck_assert_int_eq(tu_count_entries(out), 5);
    snprintf(bytes_ck, sizeof bytes_ck, "%s/bytes-ck2", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, bytes_ck);
    ck_assert_msg(moe_export_hf(bytes_ck, out) == 0, "%s", moe_last_error());
    ck_assert_int_eq(tu_count_entries(out), 2); // config.json and model.safetensors
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("tokenizer");
    TCase *tc = tcase_create("bytes");
    tcase_add_test(tc, test_bytes_tokenizer_is_the_identity_on_bytes);
    tcase_add_test(tc, test_decode_refuses_ids_outside_the_vocabulary);
    tcase_add_test(tc, test_spm_model_is_refused_without_the_library);
    tcase_add_test(tc, test_config_key_and_byte_data_combinations);
    tcase_add_unchecked_fixture(tc, NULL, suite_teardown);
    suite_add_tcase(s, tc);
    if (!moe_tok_have_sentencepiece()) {
        fprintf(stderr, "test_tokenizer: SentencePiece tests skipped: this build has no "
                        "libsentencepiece (install libsentencepiece-dev and reconfigure)\n");
        return s;
    }
    tc = tcase_create("sentencepiece");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_spm_model_has_the_trained_vocabulary_and_specials);
    tcase_add_test(tc, test_spm_round_trips_text_through_libsentencepiece);
    tcase_add_test(tc, test_spm_ids_equal_spm_encode);
    tcase_add_test(tc, test_prepare_with_spm_writes_bos_and_ids_that_decode_to_the_text);
    tcase_add_test(tc, test_prepare_spm_parts_equal_whole_document_encoding);
    tcase_add_test(tc, test_bad_model_files_are_refused);
    tcase_add_test(tc, test_vocab_size_below_the_tokenizer_is_refused);
    tcase_add_test(tc, test_save_with_tokenizer_survives_a_failed_call_at_every_point);
    tcase_add_test(tc, test_saves_copy_the_tokenizer_read_when_the_run_started);
    tcase_add_test(tc, test_training_refuses_shards_of_another_tokenizer);
    tcase_add_test(tc, test_prepare_counts_unknown_tokens);
    tcase_add_unchecked_fixture(tc, NULL, suite_teardown);
    suite_add_tcase(s, tc);
    tc = tcase_create("checkpoint");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_checkpoint_keeps_a_copy_of_its_tokenizer);
    tcase_add_test(tc, test_generate_decodes_with_the_checkpoint_tokenizer);
    tcase_add_test(tc, test_generate_refuses_a_checkpoint_whose_tokenizer_is_broken);
    tcase_add_test(tc, test_generate_samples_only_the_tokenizer_pieces);
    tcase_add_test(tc, test_export_writes_the_tokenizer_for_transformers);
    tcase_add_test(tc, test_a_tokenizer_larger_than_the_model_is_refused_by_generate_and_export);
    tcase_add_test(tc, test_a_replaced_tokenizer_is_refused_by_every_reader);
    tcase_add_test(tc, test_a_failed_export_leaves_the_earlier_export_as_it_was);
    tcase_add_test(tc, test_an_export_removes_the_tokenizer_files_it_does_not_write);
    tcase_add_test(tc, test_resume_takes_the_checkpoint_tokenizer);
    tcase_add_unchecked_fixture(tc, NULL, suite_teardown);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
