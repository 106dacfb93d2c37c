// tokenizer.json for `moe export --hf`: a SentencePiece BPE model written in
// the `tokenizers` library's format the way transformers converts Llama's
// (LlamaConverter / SentencePieceExtractor): the same vocabulary and ids, a
// merge (l, r) for every split of a piece into two pieces, ranked by the id of
// the merged piece, so both libraries apply the merges in the same order.
#include "moe/error.h"
#include "moe/export.h"
#include "moe/fsio.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Number of UTF-8 code points of s (transformers sorts merges by len()).
static size_t code_points(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xc0) != 0x80;
    return k;
}

typedef struct {
    int merged, l, r;    // piece ids
    size_t len_l, len_r; // code points of l and r
} merge;

static int cmp_merge(const void *pa, const void *pb) {
    const merge *a = pa, *b = pb;
#define CMP(x, y)                                                                                  \
    if ((x) != (y)) return (x) < (y) ? -1 : 1
    CMP(a->merged, b->merged);
    CMP(a->len_l, b->len_l);
    CMP(a->len_r, b->len_r);
    CMP(a->l, b->l);
    CMP(a->r, b->r);
#undef CMP
    return 0;
}

// Control and unknown pieces (<s>, </s>, <unk>) are special added tokens;
// user-defined ones (spm_train --user_defined_symbols) are added tokens too,
// so `tokenizers` keeps them whole as SentencePiece does, but not special:
// they are text (transformers' SpmConverter makes both kinds the same way).
static bool is_added(const moe_tokenizer *t, int id) {
    return moe_tok_is_special(t, id) || moe_tok_piece_type(t, id) == MOE_TOK_USER_DEFINED;
}

static json_t *added_token(int id, const char *piece, bool special) {
    return json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", id, "content", piece,
                     "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special",
                     special);
}

int moe_export_tokenizer_json(const char *path, const moe_tokenizer *t) {
    if (moe_tok_model_type(t) != 2)
        return moe_fail(MOE_EINVAL,
                        "%s: the tokenizer is a SentencePiece model of type %d, not BPE (2): "
                        "train it with --model_type=bpe",
                        path, moe_tok_model_type(t));
    const int V = moe_tok_vocab_size(t), bos = moe_tok_bos_id(t);
    char **piece = calloc((size_t)V, sizeof *piece); // whole pieces, however long
    char *left = NULL;                               // [longest piece + 1]
    size_t longest = 0;
    json_t *vocab = json_object(), *added = json_array(), *merges = json_array();
    merge *mg = NULL;
    size_t n_mg = 0, cap_mg = 0;
    int rc = 0;
    if (!piece || !vocab || !added || !merges)
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
    for (int id = 0; id < V; id++) {
        MOE_TRY_GOTO(moe_tok_piece_dup(t, id, &piece[id]), rc);
        const size_t n = strlen(piece[id]);
        if (n > longest) longest = n;
        if (json_object_set_new(vocab, piece[id], json_integer(id)) != 0)
            MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: piece %d is not valid UTF-8", path, id), rc);
        if (is_added(t, id))
            json_array_append_new(
                added,
                added_token(id, piece[id], moe_tok_piece_type(t, id) != MOE_TOK_USER_DEFINED));
    }
    if (!(left = malloc(longest + 1)))
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
    // Added tokens are matched whole before the model runs: no merge builds one.
    for (int id = 0; id < V; id++) {
        if (is_added(t, id)) continue;
        const char *p = piece[id];
        const size_t n = strlen(p);
        for (size_t i = 1; i < n; i++) {
            if (((unsigned char)p[i] & 0xc0) == 0x80) continue; // inside a code point
            memcpy(left, p, i);
            left[i] = 0;
            json_t *jl = json_object_get(vocab, left), *jr = json_object_get(vocab, p + i);
            if (!jl || !jr) continue;
            if (n_mg == cap_mg) {
                cap_mg = cap_mg ? 2 * cap_mg : 1024;
                merge *g = realloc(mg, sizeof *mg * cap_mg);
                if (!g) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
                mg = g;
            }
            mg[n_mg++] = (merge){id, (int)json_integer_value(jl), (int)json_integer_value(jr),
                                 code_points(p, i), code_points(p + i, n - i)};
        }
    }
    qsort(mg, n_mg, sizeof *mg, cmp_merge);
    for (size_t i = 0; i < n_mg; i++)
        json_array_append_new(merges, json_pack("[s, s]", piece[mg[i].l], piece[mg[i].r]));
    json_t *single = json_array(), *pair = json_array(), *special = json_object();
    if (bos >= 0) {
        json_array_append_new(
            single, json_pack("{s:{s:s, s:i}}", "SpecialToken", "id", piece[bos], "type_id", 0));
        json_array_append_new(
            pair, json_pack("{s:{s:s, s:i}}", "SpecialToken", "id", piece[bos], "type_id", 0));
        json_object_set_new(
            special, piece[bos],
            json_pack("{s:s, s:[i], s:[s]}", "id", piece[bos], "ids", bos, "tokens", piece[bos]));
    }
    json_array_append_new(single, json_pack("{s:{s:s, s:i}}", "Sequence", "id", "A", "type_id", 0));
    json_array_append_new(pair, json_pack("{s:{s:s, s:i}}", "Sequence", "id", "A", "type_id", 0));
    if (bos >= 0)
        json_array_append_new(
            pair, json_pack("{s:{s:s, s:i}}", "SpecialToken", "id", piece[bos], "type_id", 1));
    json_array_append_new(pair, json_pack("{s:{s:s, s:i}}", "Sequence", "id", "B", "type_id", 1));
    json_t *doc = json_object();
    json_object_set_new(doc, "version", json_string("1.0"));
    json_object_set_new(doc, "truncation", json_null());
    json_object_set_new(doc, "padding", json_null());
    json_object_set_new(doc, "added_tokens", added);
    // SentencePiece's dummy prefix and its space symbol U+2581
    json_object_set_new(doc, "normalizer",
                        json_pack("{s:s, s:[{s:s, s:s}, {s:s, s:{s:s}, s:s}]}", "type", "Sequence",
                                  "normalizers", "type", "Prepend", "prepend", "\xe2\x96\x81",
                                  "type", "Replace", "pattern", "String", " ", "content",
                                  "\xe2\x96\x81"));
    json_object_set_new(doc, "pre_tokenizer", json_null());
    json_object_set_new(doc, "post_processor",
                        json_pack("{s:s, s:o, s:o, s:o}", "type", "TemplateProcessing", "single",
                                  single, "pair", pair, "special_tokens", special));
    json_object_set_new(
        doc, "decoder",
        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}, {s:s, s:s, s:i, s:i}]}", "type",
                  "Sequence", "decoders", "type", "Replace", "pattern", "String", "\xe2\x96\x81",
                  "content", " ", "type", "ByteFallback", "type", "Fuse", "type", "Strip",
                  "content", " ", "start", 1, "stop", 0));
    json_t *model = json_object();
    json_object_set_new(model, "type", json_string("BPE"));
    json_object_set_new(model, "dropout", json_null());
    int unk = 0; // the special piece that is neither BOS nor EOS (<unk>)
    for (int id = V - 1; id >= 0; id--)
        if (moe_tok_is_special(t, id) && id != bos && id != moe_tok_eos_id(t)) unk = id;
    json_object_set_new(model, "unk_token", json_string(piece[unk]));
    json_object_set_new(model, "continuing_subword_prefix", json_null());
    json_object_set_new(model, "end_of_word_suffix", json_null());
    json_object_set_new(model, "fuse_unk", json_true());
    json_object_set_new(model, "byte_fallback", json_true());
    json_object_set_new(model, "ignore_merges", json_false());
    json_object_set_new(model, "vocab", vocab);
    json_object_set_new(model, "merges", merges);
    json_object_set_new(doc, "model", model);
    added = vocab = merges = NULL; // owned by doc now
    rc = moe_fs_write_json(path, doc, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
    json_decref(doc);
fail:
    json_decref(vocab);
    json_decref(added);
    json_decref(merges);
    free(mg);
    free(left);
    for (int id = 0; piece && id < V; id++)
        free(piece[id]);
    free(piece);
    return rc;
}
