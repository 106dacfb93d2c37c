// Token files as training reads them: llm.c shards (256 x int32 header: magic
// 20240520, version 1 = uint16 tokens or 2 = uint32 tokens, token count; then
// the tokens), nanoGPT's headerless uint16 train.bin/val.bin and UTF-8 text
// (one byte per token). Files are memory-mapped read-only, never copied.
#ifndef MOE_SHARDS_H
#define MOE_SHARDS_H

#include "moe/config.h"

#include <stddef.h>
#include <stdint.h>

#define MOE_LLMC_MAGIC 20240520
#define MOE_LLMC_HEADER 1024 // bytes: 256 int32

typedef enum { MOE_TOKENS_LLMC = 0, MOE_TOKENS_NANOGPT, MOE_TOKENS_TEXT } moe_token_format;

typedef struct moe_token_file {
    char path[MOE_PATH_MAX];
    const void *map;          // the whole file, PROT_READ (NULL: nothing mapped)
    size_t map_len;           // bytes mapped
    const unsigned char *tok; // first token inside map
    int width;                // bytes per token: 1 (text), 2 (uint16), 4 (uint32)
    long n_tokens;
} moe_token_file;

// Parses an llm.c header (the first n bytes of a file of file_size bytes;
// n >= 12 reads the fields, fewer is a truncated header) and checks it against
// the file size. Sets *width (2 or 4) and *n_tokens. Errors (MOE_EFORMAT)
// name path, the byte offset and what was expected: a truncated header, a
// wrong magic or version, a count that disagrees with the size, no tokens.
int moe_llmc_header_parse(const unsigned char *hdr, size_t n, size_t file_size, const char *path,
                          int *width, long *n_tokens);
// Fills an llm.c header for n_tokens tokens of version (1: uint16, 2: uint32).
void moe_llmc_header_fill(unsigned char hdr[MOE_LLMC_HEADER], int version, long n_tokens);

// Maps path (through moe_open_regular: a FIFO or folder is refused) and checks
// it: the header, UTF-8 for text (the first bad byte's offset), and every token
// below vocab in one scan at open (skipped when the width cannot exceed vocab);
// a token >= vocab is refused with its byte offset and the model.vocab_size to
// set. An empty file is refused.
int moe_token_file_open(moe_token_file *f, const char *path, moe_token_format fmt, int vocab);
void moe_token_file_close(moe_token_file *f);

static inline int32_t moe_token_at(const moe_token_file *f, long i) {
    const unsigned char *p = f->tok + (size_t)i * (size_t)f->width;
    switch (f->width) {
    case 1:
        return p[0];
    case 2:
        return (int32_t)(p[0] | (uint32_t)p[1] << 8);
    default:
        return (int32_t)(p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
    }
}

// Expands pattern (glob(3), sorted; a plain path names itself) into *paths
// (*n of them; free with moe_glob_free). No match is MOE_ENOTFOUND with a
// message naming key and pattern (and, when a file of the pattern's literal
// name exists, how to escape its glob characters); a folder that cannot be
// listed is moe_input_errno_code's code (moe/file.h).
int moe_glob_paths(const char *key, const char *pattern, char ***paths, int *n);
void moe_glob_free(char **paths, int n);

// Offset of the first byte that breaks well-formed UTF-8 (RFC 3629: no
// overlong forms, surrogates or code points above U+10FFFF) in s[0, n), or -1;
// a sequence cut by the end of s is reported at its lead byte.
long moe_utf8_bad(const unsigned char *s, long n);

#endif
