// Token files mapped read-only (moe/shards.h): llm.c shards (header, then
// uint16 or uint32 tokens), nanoGPT raw uint16 files and UTF-8 text. Every
// check a reader needs happens once at open, so batches read the mapping
// without further validation.
#include "moe/shards.h"
#include "moe/error.h"
#include "moe/file.h"

#include <errno.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static uint32_t le32(const unsigned char *p) {
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int moe_llmc_header_parse(const unsigned char *hdr, size_t n, size_t file_size, const char *path,
                          int *width, long *n_tokens) {
    if (file_size == 0) return moe_fail(MOE_EFORMAT, "%s: empty file (no llm.c header)", path);
    if (n < 12 || file_size < MOE_LLMC_HEADER)
        return moe_fail(MOE_EFORMAT, "%s: truncated header: %zu bytes, expected at least %d", path,
                        file_size, MOE_LLMC_HEADER);
    if (le32(hdr) != MOE_LLMC_MAGIC)
        return moe_fail(MOE_EFORMAT, "%s: byte 0: magic %u, expected %d (llm.c token file)", path,
                        le32(hdr), MOE_LLMC_MAGIC);
    uint32_t version = le32(hdr + 4);
    if (version != 1 && version != 2)
        return moe_fail(MOE_EFORMAT,
                        "%s: byte 4: version %u, expected 1 (uint16 tokens) or 2 (uint32 tokens)",
                        path, version);
    int w = version == 1 ? 2 : 4;
    uint32_t raw = le32(hdr + 8);
    if (raw > INT32_MAX) // llm.c stores the count as int32
        return moe_fail(MOE_EFORMAT, "%s: byte 8: token count %d is negative", path, (int32_t)raw);
    long ntok = (long)raw;
    size_t body = file_size - MOE_LLMC_HEADER;
    if (body != (size_t)w * (size_t)ntok)
        return moe_fail(MOE_EFORMAT,
                        "%s: byte 8: header says %ld tokens (%zu bytes) but %zu bytes follow the "
                        "header%s",
                        path, ntok, (size_t)w * (size_t)ntok, body,
                        body < (size_t)w * (size_t)ntok ? " (truncated)" : "");
    if (ntok == 0) return moe_fail(MOE_EFORMAT, "%s: byte 8: the file holds no tokens", path);
    *width = w;
    *n_tokens = ntok;
    return 0;
}

void moe_llmc_header_fill(unsigned char hdr[MOE_LLMC_HEADER], int version, long n_tokens) {
    memset(hdr, 0, MOE_LLMC_HEADER);
    const uint32_t v[3] = {MOE_LLMC_MAGIC, (uint32_t)version, (uint32_t)n_tokens};
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < 4; b++)
            hdr[4 * i + b] = (unsigned char)(v[i] >> (8 * b));
}

// Well-formed UTF-8 as RFC 3629 §4 defines it: no overlong forms (C0, C1,
// E0 80..9F, F0 80..8F), no surrogates (ED A0..BF), nothing above U+10FFFF
// (F4 90..BF, F5..FF). The second byte's range depends on the lead; the
// others are always 80..BF.
long moe_utf8_bad(const unsigned char *s, long n) {
    for (long i = 0; i < n;) {
        unsigned c = s[i];
        if (c < 0x80) { // ASCII runs dominate text: no table lookups
            i++;
            continue;
        }
        int len;
        unsigned lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            len = 2;
        else if (c >= 0xE0 && c <= 0xEF)
            len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        else if (c >= 0xF0 && c <= 0xF4)
            len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        else
            return i;
        for (int j = 1; j < len; j++) {
            if (i + j >= n) return i; // truncated at the end of the text
            if (s[i + j] < (j == 1 ? lo : 0x80) || s[i + j] > (j == 1 ? hi : 0xBF)) return i + j;
        }
        i += len;
    }
    return -1;
}

// model.vocab_size's upper bound (its range in trainer/config.c's key table).
#define MOE_VOCAB_LIMIT (1 << 24)

// One pass over the tokens: the first out-of-vocabulary one and the largest.
static int check_vocab(const moe_token_file *f, long header, int vocab) {
    if (f->width == 2 && vocab >= 65536) return 0; // no uint16 can exceed it
    long first = -1;
    int32_t first_tok = 0;
    uint32_t max = 0;
    for (long i = 0; i < f->n_tokens; i++) {
        uint32_t t = (uint32_t)moe_token_at(f, i);
        if (t > max) max = t;
        if (first < 0 && t >= (uint32_t)vocab) first = i, first_tok = (int32_t)t;
    }
    if (first < 0) return 0;
    if (max >= MOE_VOCAB_LIMIT) // no vocab_size would do: advice to raise it would mislead
        return moe_fail(MOE_EFORMAT,
                        "%s: byte %ld: token %u >= model.vocab_size %d, and the largest token in "
                        "the file, %u, is out of any valid range (model.vocab_size is at most %d): "
                        "a corrupt file, or not a token file of this data.kind",
                        f->path, header + first * f->width, (uint32_t)first_tok, vocab, max,
                        MOE_VOCAB_LIMIT);
    return moe_fail(MOE_EFORMAT,
                    "%s: byte %ld: token %u >= model.vocab_size %d (the largest token in the "
                    "file is %u: set model.vocab_size to at least %lu)",
                    f->path, header + first * f->width, (uint32_t)first_tok, vocab, max,
                    (unsigned long)max + 1);
}

int moe_token_file_open(moe_token_file *f, const char *path, moe_token_format fmt, int vocab) {
    memset(f, 0, sizeof *f);
    if (strlen(path) >= sizeof f->path)
        return moe_fail(MOE_EINVAL, "%.64s...: path longer than %zu characters", path,
                        sizeof f->path - 1);
    snprintf(f->path, sizeof f->path, "%s", path);
    const void *map;
    size_t size;
    MOE_TRY(moe_map_regular(path, &map, &size));
    if (size == 0) return moe_fail(MOE_EFORMAT, "%s: empty file", path);
    f->map = map;
    f->map_len = size;
    const unsigned char *b = map;
    long header = 0;
    int rc = 0;
    switch (fmt) {
    case MOE_TOKENS_LLMC:
        rc = moe_llmc_header_parse(b, size, size, path, &f->width, &f->n_tokens);
        header = MOE_LLMC_HEADER;
        break;
    case MOE_TOKENS_NANOGPT:
        if (size % 2) {
            rc = moe_fail(MOE_EFORMAT,
                          "%s: %zu bytes, not a whole number of uint16 tokens (nanoGPT .bin)", path,
                          size);
            break;
        }
        f->width = 2, f->n_tokens = (long)(size / 2);
        break;
    case MOE_TOKENS_TEXT: {
        long bad = moe_utf8_bad(b, (long)size);
        if (bad >= 0) rc = moe_fail(MOE_EFORMAT, "%s: byte %ld: invalid UTF-8", path, bad);
        f->width = 1, f->n_tokens = (long)size;
        break;
    }
    }
    f->tok = b + header;
    // An llm.c shard read as nanoGPT tokens: its header would be trained on,
    // or refused as tokens out of range with advice to raise vocab_size. A
    // whole valid header (magic, version, a count matching the size) is no
    // accident of token values.
    int w_llmc;
    long n_llmc;
    if (rc == 0 && fmt == MOE_TOKENS_NANOGPT && size >= MOE_LLMC_HEADER &&
        le32(b) == MOE_LLMC_MAGIC &&
        moe_llmc_header_parse(b, size, size, path, &w_llmc, &n_llmc) == 0)
        rc = moe_fail(MOE_EFORMAT,
                      "%s: an llm.c token file (magic %d, version %d, %ld tokens), not a "
                      "nanoGPT .bin: set data.kind = llmc",
                      path, MOE_LLMC_MAGIC, w_llmc / 2, n_llmc);
    if (rc == 0) rc = check_vocab(f, header, vocab);
    if (rc < 0) moe_token_file_close(f);
    return rc;
}

void moe_token_file_close(moe_token_file *f) {
    moe_unmap(f->map, f->map_len);
    f->map = NULL;
    f->tok = NULL;
    f->n_tokens = 0;
}

// The first folder glob could not list, and why (glob's own code says only
// "aborted"). Not thread-safe, as glob's callback has no context.
static char glob_err_path[512];
static int glob_err_errno;
static int glob_error(const char *path, int err) {
    if (!glob_err_errno) snprintf(glob_err_path, sizeof glob_err_path, "%s", path);
    if (!glob_err_errno) glob_err_errno = err;
    return 1; // stop: GLOB_ERR
}

int moe_glob_paths(const char *key, const char *pattern, char ***paths, int *n) {
    *paths = NULL;
    *n = 0;
    if (!pattern[0]) return moe_fail(MOE_EINVAL, "%s is empty: name a data file or a glob", key);
    glob_t g;
    glob_err_errno = 0;
    int rc = glob(pattern, GLOB_ERR, glob_error, &g); // sorted by default
    struct stat st;
    if (rc == GLOB_NOMATCH && strpbrk(pattern, "[]*?") && lstat(pattern, &st) == 0) {
        globfree(&g); // x[1].bin matches x1.bin only: the file itself is not found
        return moe_fail(MOE_ENOTFOUND,
                        "%s = '%s': read as a glob pattern ([...], * and ? are wildcards), it "
                        "matches no file, though a file of that literal name exists: write each "
                        "of those characters with a backslash before it (x\\[1\\].bin) or "
                        "rename the file",
                        key, pattern);
    }
    if (rc == GLOB_NOMATCH) {
        globfree(&g);
        return moe_fail(MOE_ENOTFOUND, "%s = '%s': no such file", key, pattern);
    }
    if (rc == GLOB_ABORTED && glob_err_errno) {
        globfree(&g);
        return moe_fail(moe_input_errno_code(glob_err_errno), "%s = '%s': cannot list %s: %s", key,
                        pattern, glob_err_path, strerror(glob_err_errno));
    }
    if (rc != 0) {
        globfree(&g);
        return moe_fail(rc == GLOB_NOSPACE ? MOE_ENOMEM : MOE_EIO, "%s = '%s': cannot list: %s",
                        key, pattern, rc == GLOB_NOSPACE ? "out of memory" : "read error");
    }
    if (g.gl_pathc > 1 << 20) {
        globfree(&g);
        return moe_fail(MOE_EINVAL, "%s = '%s': more than %d files", key, pattern, 1 << 20);
    }
    char **p = calloc(g.gl_pathc, sizeof *p);
    for (size_t i = 0; p && i < g.gl_pathc; i++)
        if (!(p[i] = strdup(g.gl_pathv[i]))) {
            moe_glob_free(p, (int)i);
            p = NULL;
        }
    int count = (int)g.gl_pathc;
    globfree(&g);
    if (!p) return moe_fail(MOE_ENOMEM, "%s = '%s': out of memory", key, pattern);
    *paths = p;
    *n = count;
    return 0;
}

void moe_glob_free(char **paths, int n) {
    for (int i = 0; paths && i < n; i++)
        free(paths[i]);
    free(paths);
}
