// Tokenizers behind one C interface (model.tokenizer): `bytes` (token = byte,
// vocabulary 256, what the synthetic tasks and data.kind = text use) and
// SentencePiece models (.model files, the tokenizer family of Llama and
// Mixtral) through libsentencepiece, wrapped in moe/src/tokenizer_spm.cc.
// A build without libsentencepiece keeps `bytes` and refuses a .model file.
#ifndef MOE_TOKENIZER_H
#define MOE_TOKENIZER_H

#include "moe/config.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_tokenizer moe_tokenizer;

// Largest .model file read (Llama's is 0.5 MB, the largest public ones a few MB).
#define MOE_TOK_MAX_FILE_BYTES (256ull << 20)

// True when this build links libsentencepiece.
bool moe_tok_have_sentencepiece(void);

// Opens spec: "bytes" or the path of a SentencePiece .model file. Errors
// (message names the file): MOE_ENOTFOUND no such file, MOE_EFORMAT not a
// regular file, empty, truncated or not a SentencePiece model, MOE_EINVAL a
// build without libsentencepiece, MOE_EIO, MOE_ENOMEM.
int moe_tok_open(const char *spec, moe_tokenizer **out);
void moe_tok_free(moe_tokenizer *t);

// "bytes" or "sentencepiece".
const char *moe_tok_kind(const moe_tokenizer *t);
// Token ids are 0 .. vocab_size - 1.
int moe_tok_vocab_size(const moe_tokenizer *t);
// Begin / end of sequence ids, -1 when the tokenizer has none (bytes: none).
int moe_tok_bos_id(const moe_tokenizer *t);
int moe_tok_eos_id(const moe_tokenizer *t);
// The id of <unk>, which text outside the vocabulary encodes to without byte
// fallback (-1: none; bytes: none).
int moe_tok_unk_id(const moe_tokenizer *t);

// Encodes len bytes of UTF-8 text (no BOS or EOS added; the caller decides,
// as transformers' add_bos_token does). *ids is malloc'ed (free it), *n its
// length (0 for empty text; *ids is then still a valid allocation).
int moe_tok_encode(const moe_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n);
// As moe_tok_encode, for a document encoded in parts: first = 0 marks text
// that continues one, which SentencePiece encodes without its dummy prefix
// ("▁" before the first word of the document only). The parts' ids equal
// the whole text's when each cut is before a space or after a newline, for
// models with the identity normalizer, remove_extra_whitespaces off,
// split_by_whitespace on and byte fallback (README "Tokenizers").
int moe_tok_encode_part(const moe_tokenizer *t, const char *text, size_t len, int first,
                        int32_t **ids, size_t *n);
// Decodes n ids to text: *text malloc'ed and NUL-terminated, *len bytes before
// the NUL. Control ids (BOS, EOS, pad) decode to nothing, as transformers'
// skip_special_tokens. An id outside 0 .. vocab_size - 1 is refused (MOE_EINVAL).
int moe_tok_decode(const moe_tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len);
// The piece of id ("▁the", "<0x0A>", "<s>"; bytes: the byte itself when
// printable ASCII, else "<0xNN>"), NUL-terminated into buf (cap bytes,
// truncated when longer). MOE_EINVAL for an id outside the vocabulary.
int moe_tok_piece(const moe_tokenizer *t, int32_t id, char *buf, size_t cap);
// The whole piece of id, however long, into *piece (malloc'ed, NUL-terminated;
// free it). MOE_EINVAL for an id outside the vocabulary, MOE_ENOMEM.
int moe_tok_piece_dup(const moe_tokenizer *t, int32_t id, char **piece);

// SentencePiece piece score (0 for bytes) and whether id is a control or
// unknown piece (<unk>, <s>, </s>: special tokens in transformers).
float moe_tok_score(const moe_tokenizer *t, int32_t id);
bool moe_tok_is_special(const moe_tokenizer *t, int32_t id);
// The SentencePiece piece type of id (ModelProto.SentencePiece.Type):
// MOE_TOK_NORMAL, ..., MOE_TOK_USER_DEFINED (spm_train --user_defined_symbols:
// always one token, never split, yet text and not special); bytes: NORMAL.
enum {
    MOE_TOK_NORMAL = 1,
    MOE_TOK_UNKNOWN = 2,
    MOE_TOK_CONTROL = 3,
    MOE_TOK_USER_DEFINED = 4,
    MOE_TOK_UNUSED = 5,
    MOE_TOK_BYTE = 6
};
int moe_tok_piece_type(const moe_tokenizer *t, int32_t id);
// The SentencePiece model type of its trainer spec: 1 unigram, 2 BPE, 3 word,
// 4 char (0 for bytes).
int moe_tok_model_type(const moe_tokenizer *t);

// The .model file's bytes (NULL, 0 for bytes): what a checkpoint copies.
const void *moe_tok_model_bytes(const moe_tokenizer *t, size_t *len);
// 64-bit FNV-1a of those bytes (0 for bytes): the identity moe prepare
// records in manifest.json ("tokenizer_hash") and training checks.
uint64_t moe_tok_hash(const moe_tokenizer *t);

// model.tokenizer against the model: opens it and checks model.vocab_size >=
// its vocabulary (refused naming both values and the key to set). bytes
// always passes here (the data readers check their own bytes).
int moe_tok_check_config(const moe_config *cfg);

// Trains a SentencePiece model on the text file input (one sentence per
// line) as spm_train does: model_prefix.model and model_prefix.vocab, BPE with
// byte fallback and Llama's identity normalizer, vocab_size pieces. For tests and small
// experiments; the sentencepiece tools (spm_train) are the way to train a real one.
int moe_tok_train_spm(const char *input, const char *model_prefix, int vocab_size);

#ifdef __cplusplus
}
#endif

#endif
