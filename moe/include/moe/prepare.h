// `moe prepare`: UTF-8 text files and folders -> tokenized llm.c shards
// (moe/shards.h) split into train and validation by document, and a
// manifest.json of what went in. The tokenizer plugs in through one function.
#ifndef MOE_PREPARE_H
#define MOE_PREPARE_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// A growing token buffer the encoder appends to.
typedef struct {
    uint32_t *tok;
    size_t n, cap;
} moe_tokens;
// Makes room for extra more tokens. MOE_ENOMEM when out of memory.
int moe_tokens_reserve(moe_tokens *t, size_t extra);
void moe_tokens_free(moe_tokens *t);

// The tokenizer interface: encode appends the tokens of text[0, len) (valid
// UTF-8, a document or, first = 0, a later part of one) to out, each below
// vocab_size, and returns 0 or a negative MOE_E* code with a message. ctx is
// the tokenizer's own state.
typedef struct {
    char name[512]; // "bytes" or the model file (recorded in the manifest)
    int vocab_size;
    uint64_t hash; // moe_tok_hash of the model (0: bytes), recorded in the manifest
    bool has_unk;  // encode gives unk_id for text it cannot represent: counted
    int unk_id;
    int (*encode)(void *ctx, const char *text, size_t len, int first, moe_tokens *out);
    void (*free)(void *ctx); // NULL: nothing to free
    void *ctx;
} moe_prepare_tokenizer;

// spec "bytes": one token per byte (vocab 256); else the path of a
// SentencePiece .model (moe/tokenizer.h): every document starts with its BOS.
int moe_prepare_tokenizer_open(moe_prepare_tokenizer *t, const char *spec);
void moe_prepare_tokenizer_close(moe_prepare_tokenizer *t);

// What a document is: a whole file, a paragraph (text up to and including a
// blank line) or a line. Documents keep every byte, so train and validation
// together hold the input exactly.
typedef enum { MOE_DOC_FILE = 0, MOE_DOC_PARAGRAPH, MOE_DOC_LINE } moe_doc_unit;

typedef struct {
    size_t bytes_done, bytes_total;
    int files_done, files_total;
} moe_prepare_progress;

typedef struct {
    const char *out_dir;       // created if missing; must not hold a manifest.json
    const char *const *inputs; // files or folders (walked recursively, sorted; a folder
                               // entered once; one file twice is refused)
    int n_inputs;
    const moe_prepare_tokenizer *tokenizer;
    double val_fraction; // [0, 1): share of documents held out (by a hash of their bytes)
    uint64_t seed;       // of the split
    moe_doc_unit doc;
    long shard_tokens; // tokens per shard (the last one holds the rest)
    void (*progress)(void *ctx, const moe_prepare_progress *p); // NULL: none
    void *progress_ctx;
    // NULL, or a flag a signal handler sets: prepare then stops before the
    // next part of a document (part_bytes) or before renaming its shards into
    // place, removes what it wrote and returns MOE_EIO ("interrupted").
    const volatile sig_atomic_t *stop;
    // A document longer than this is encoded in parts of at most this many
    // bytes, cut after a newline, else before a space, else between two
    // characters (0: MOE_PREPARE_PART_BYTES): SentencePiece needs about 220
    // times the bytes it encodes at once.
    size_t part_bytes;
} moe_prepare_opts;

#define MOE_PREPARE_PART_BYTES (256 * 1024)

typedef struct {
    int files;
    size_t bytes;
    size_t split_bytes[2];        // per split (MOE_SPLIT_TRAIN, MOE_SPLIT_VAL)
    long documents[2], tokens[2]; // per split
    int shards[2];
    int version; // llm.c header version written: 1 (uint16) or 2 (uint32)
    // Tokens that are the tokenizer's <unk> (both splits): text a model
    // without byte fallback cannot represent, lost to training.
    long unk_tokens;
    // Entries of input folders that are neither regular files nor folders (a
    // broken link, a FIFO, one stat cannot read): passed over, the first named
    // in skip ("PATH: broken link").
    int skipped;
    char skip[4200];
} moe_prepare_result;

// Validates every input first (readable regular files, UTF-8: the first bad
// byte is reported with its file and offset), then writes
// out_dir/train_NNNNNN.bin, out_dir/val_NNNNNN.bin and out_dir/manifest.json.
// A document goes to validation when a hash of (seed, its bytes) falls below
// val_fraction: deterministic, and independent of the order of the inputs.
// Shards are written as NAME.tmp and renamed into place, then the manifest,
// once all are complete; on failure what was written so far is removed. An
// out_dir holding a manifest.json or train_*.bin / val_*.bin files (or their
// .tmp) is refused.
int moe_prepare(const moe_prepare_opts *o, moe_prepare_result *r);

#endif
