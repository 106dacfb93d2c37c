// The SentencePiece half of moe/tokenizer.h, implemented in C++ by
// moe/src/tokenizer_spm.cc (only in builds with libsentencepiece). Every
// function catches whatever the C++ side throws and returns an MOE_E* code
// with a message: no exception crosses into C.
#ifndef MOE_TOKENIZER_SPM_H
#define MOE_TOKENIZER_SPM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_spm moe_spm;

// Parses a serialized .model (len bytes); name (the file) is for messages.
int moe_spm_load(const void *bytes, size_t len, const char *name, moe_spm **out);
void moe_spm_free(moe_spm *s);
int moe_spm_vocab_size(const moe_spm *s);
int moe_spm_bos_id(const moe_spm *s);
int moe_spm_eos_id(const moe_spm *s);
int moe_spm_unk_id(const moe_spm *s);
// As moe_tok_encode / moe_tok_decode / moe_tok_piece (ids already range-checked).
int moe_spm_encode(const moe_spm *s, const char *text, size_t len, int32_t **ids, size_t *n);
// As moe_tok_encode_part.
int moe_spm_encode_part(const moe_spm *s, const char *text, size_t len, int first, int32_t **ids,
                        size_t *n);
int moe_spm_decode(const moe_spm *s, const int32_t *ids, size_t n, char **text, size_t *len);
// As moe_tok_piece, but returns the piece's whole length (snprintf's contract).
int moe_spm_piece(const moe_spm *s, int32_t id, char *buf, size_t cap);
float moe_spm_score(const moe_spm *s, int32_t id);
int moe_spm_is_special(const moe_spm *s, int32_t id); // control or unknown
int moe_spm_train(const char *input, const char *model_prefix, int vocab_size);

#ifdef __cplusplus
}
#endif

#endif
