// The tokenizer interface (moe/tokenizer.h): the byte tokenizer here, and
// SentencePiece models read here (bounded, regular files only) and handed as
// bytes to the C++ wrapper moe/src/tokenizer_spm.cc when the build has
// libsentencepiece (MOE_HAVE_SENTENCEPIECE); without it a .model is refused.
#include "moe/tokenizer.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/src/tokenizer_spm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct moe_tokenizer {
    moe_spm *spm;     // NULL: bytes
    void *model;      // the .model file's bytes
    size_t model_len; //
    uint8_t *types;   // [vocab] SentencePiece piece types (MOE_TOK_*); NULL: bytes
};

#ifndef MOE_HAVE_SENTENCEPIECE
// The C++ half is not compiled: these stubs keep the link whole; moe_tok_open
// refuses a .model before any of them can be reached.
int moe_spm_load(const void *bytes, size_t len, const char *name, moe_spm **out) {
    *out = NULL;
    return moe_fail(MOE_EINVAL, "%s: unreachable", name);
}
void moe_spm_free(moe_spm *s) {}
int moe_spm_vocab_size(const moe_spm *s) {
    return 0;
}
int moe_spm_bos_id(const moe_spm *s) {
    return -1;
}
int moe_spm_eos_id(const moe_spm *s) {
    return -1;
}
int moe_spm_unk_id(const moe_spm *s) {
    return -1;
}
int moe_spm_encode(const moe_spm *s, const char *text, size_t len, int32_t **ids, size_t *n) {
    return moe_fail(MOE_EINVAL, "tokenizer: built without libsentencepiece");
}
int moe_spm_encode_part(const moe_spm *s, const char *text, size_t len, int first, int32_t **ids,
                        size_t *n) {
    return moe_fail(MOE_EINVAL, "tokenizer: built without libsentencepiece");
}
int moe_spm_decode(const moe_spm *s, const int32_t *ids, size_t n, char **text, size_t *len) {
    return moe_fail(MOE_EINVAL, "tokenizer: built without libsentencepiece");
}
int moe_spm_piece(const moe_spm *s, int32_t id, char *buf, size_t cap) {
    return moe_fail(MOE_EINVAL, "tokenizer: built without libsentencepiece");
}
float moe_spm_score(const moe_spm *s, int32_t id) {
    return 0.0f;
}
int moe_spm_is_special(const moe_spm *s, int32_t id) {
    return 0;
}
int moe_spm_train(const char *input, const char *model_prefix, int vocab_size) {
    return moe_fail(MOE_EINVAL,
                    "%s: this build has no libsentencepiece (install libsentencepiece-dev and "
                    "rebuild, or train with spm_train)",
                    input);
}
#endif

bool moe_tok_have_sentencepiece(void) {
#ifdef MOE_HAVE_SENTENCEPIECE
    return true;
#else
    return false;
#endif
}

// The whole file, bounded by MOE_TOK_MAX_FILE_BYTES; an empty one is refused.
static int read_model(const char *path, void **buf, size_t *len) {
    FILE *f;
    MOE_TRY(moe_fopen_regular(path, &f));
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        int err = errno;
        fclose(f);
        return moe_fail(MOE_EIO, "%s: cannot stat: %s", path, strerror(err));
    }
    if (st.st_size == 0 || (unsigned long long)st.st_size > MOE_TOK_MAX_FILE_BYTES) {
        fclose(f);
        return moe_fail(MOE_EFORMAT, "%s: %lld bytes; a SentencePiece model has 1 to %llu", path,
                        (long long)st.st_size, MOE_TOK_MAX_FILE_BYTES);
    }
    *len = (size_t)st.st_size;
    if (!(*buf = malloc(*len))) {
        fclose(f);
        return moe_fail(MOE_ENOMEM, "%s: %zu bytes: out of memory", path, *len);
    }
    size_t got = fread(*buf, 1, *len, f);
    fclose(f);
    if (got != *len) {
        free(*buf);
        *buf = NULL;
        return moe_fail(MOE_EIO, "%s: short read at byte %zu of %zu", path, got, *len);
    }
    return 0;
}

// A protobuf varint at *p (bounded by end); false when it runs off the end.
static bool varint(const unsigned char **p, const unsigned char *end, uint64_t *v) {
    *v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        unsigned char b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return true;
    }
    return false;
}

// Field `field` of the protobuf message [p, end): a varint (*v) or a
// length-delimited value ([*sub, *sub_end)); false when absent or malformed.
static bool proto_field(const unsigned char *p, const unsigned char *end, unsigned field,
                        uint64_t *v, const unsigned char **sub, const unsigned char **sub_end) {
    while (p < end) {
        uint64_t key, x;
        if (!varint(&p, end, &key)) return false;
        const unsigned wt = key & 7;
        if (wt == 0) {
            if (!varint(&p, end, &x)) return false;
            if ((key >> 3) == field) return *v = x, true;
        } else if (wt == 2) {
            if (!varint(&p, end, &x) || x > (uint64_t)(end - p)) return false;
            if ((key >> 3) == field && sub) return *sub = p, *sub_end = p + x, true;
            p += x;
        } else if (wt == 5 || wt == 1) {
            const size_t n = wt == 5 ? 4 : 8;
            if ((size_t)(end - p) < n) return false;
            p += n;
        } else {
            return false;
        }
    }
    return false;
}

// ModelProto.pieces (field 1, repeated) . type (field 3; absent: NORMAL), in
// id order: libsentencepiece's API has no call that tells a user-defined
// piece from a normal one.
static int read_piece_types(moe_tokenizer *t, const char *name) {
    const int V = moe_spm_vocab_size(t->spm);
    if (!(t->types = malloc((size_t)V)))
        return moe_fail(MOE_ENOMEM, "%s: %d pieces: out of memory", name, V);
    const unsigned char *p = t->model, *end = p + t->model_len;
    int id = 0;
    while (p < end) {
        uint64_t key, x;
        if (!varint(&p, end, &key)) break;
        const unsigned wt = key & 7;
        if (wt == 0) {
            if (!varint(&p, end, &x)) break;
        } else if (wt == 2) {
            if (!varint(&p, end, &x) || x > (uint64_t)(end - p)) break;
            if ((key >> 3) == 1 && id < V) {
                uint64_t type = MOE_TOK_NORMAL;
                proto_field(p, p + x, 3, &type, NULL, NULL);
                t->types[id++] = type <= MOE_TOK_BYTE ? (uint8_t)type : MOE_TOK_NORMAL;
            }
            p += x;
        } else if ((wt == 5 || wt == 1) && (size_t)(end - p) >= (wt == 5 ? 4u : 8u)) {
            p += wt == 5 ? 4 : 8;
        } else {
            break;
        }
    }
    if (id != V)
        return moe_fail(MOE_EFORMAT, "%s: %d piece records read of the model's %d pieces", name, id,
                        V);
    return 0;
}

int moe_tok_open(const char *spec, moe_tokenizer **out) {
    *out = NULL;
    moe_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return moe_fail(MOE_ENOMEM, "tokenizer: out of memory");
    if (!strcmp(spec, "bytes")) {
        *out = t;
        return 0;
    }
    int rc = 0;
    if (!moe_tok_have_sentencepiece()) {
        free(t);
        return moe_fail(MOE_EINVAL,
                        "model.tokenizer = %s: this build has no libsentencepiece (install "
                        "libsentencepiece-dev and rebuild); only model.tokenizer = bytes works",
                        spec);
    }
    MOE_TRY_GOTO(read_model(spec, &t->model, &t->model_len), rc);
    MOE_TRY_GOTO(moe_spm_load(t->model, t->model_len, spec, &t->spm), rc);
    MOE_TRY_GOTO(read_piece_types(t, spec), rc);
    *out = t;
    return 0;
fail:
    if (t->spm) moe_spm_free(t->spm);
    free(t->types);
    free(t->model);
    free(t);
    return rc;
}

void moe_tok_free(moe_tokenizer *t) {
    if (!t) return;
    if (t->spm) moe_spm_free(t->spm);
    free(t->types);
    free(t->model);
    free(t);
}

const char *moe_tok_kind(const moe_tokenizer *t) {
    return t->spm ? "sentencepiece" : "bytes";
}

int moe_tok_vocab_size(const moe_tokenizer *t) {
    return t->spm ? moe_spm_vocab_size(t->spm) : 256;
}

int moe_tok_bos_id(const moe_tokenizer *t) {
    return t->spm ? moe_spm_bos_id(t->spm) : -1;
}

int moe_tok_eos_id(const moe_tokenizer *t) {
    return t->spm ? moe_spm_eos_id(t->spm) : -1;
}

int moe_tok_unk_id(const moe_tokenizer *t) {
    return t->spm ? moe_spm_unk_id(t->spm) : -1;
}

const void *moe_tok_model_bytes(const moe_tokenizer *t, size_t *len) {
    *len = t->model_len;
    return t->model;
}

uint64_t moe_tok_hash(const moe_tokenizer *t) {
    size_t n;
    const unsigned char *b = moe_tok_model_bytes(t, &n);
    if (!b) return 0;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}

int moe_tok_encode(const moe_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n) {
    return moe_tok_encode_part(t, text, len, 1, ids, n);
}

int moe_tok_encode_part(const moe_tokenizer *t, const char *text, size_t len, int first,
                        int32_t **ids, size_t *n) {
    if (t->spm) return moe_spm_encode_part(t->spm, text, len, first, ids, n);
    *n = 0;
    if (!(*ids = malloc(sizeof(int32_t) * (len ? len : 1))))
        return moe_fail(MOE_ENOMEM, "tokenizer: %zu bytes: out of memory", len);
    for (size_t i = 0; i < len; i++)
        (*ids)[i] = (unsigned char)text[i];
    *n = len;
    return 0;
}

static int check_id(const moe_tokenizer *t, int32_t id) {
    const int V = moe_tok_vocab_size(t);
    if (id < 0 || id >= V)
        return moe_fail(MOE_EINVAL, "tokenizer (%s): token %d is outside the vocabulary 0..%d",
                        moe_tok_kind(t), id, V - 1);
    return 0;
}

int moe_tok_decode(const moe_tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    for (size_t i = 0; i < n; i++)
        MOE_TRY(check_id(t, ids[i]));
    if (t->spm) return moe_spm_decode(t->spm, ids, n, text, len);
    if (!(*text = malloc(n + 1))) return moe_fail(MOE_ENOMEM, "tokenizer: out of memory");
    for (size_t i = 0; i < n; i++)
        (*text)[i] = (char)ids[i];
    (*text)[n] = 0;
    *len = n;
    return 0;
}

int moe_tok_piece(const moe_tokenizer *t, int32_t id, char *buf, size_t cap) {
    MOE_TRY(check_id(t, id));
    if (cap == 0) return moe_fail(MOE_EINVAL, "tokenizer: no room for a piece");
    if (t->spm) {
        int n = moe_spm_piece(t->spm, id, buf, cap);
        return n < 0 ? n : 0;
    }
    if (id >= 33 && id < 127)
        snprintf(buf, cap, "%c", (char)id);
    else
        snprintf(buf, cap, "<0x%02X>", (unsigned)id);
    return 0;
}

int moe_tok_piece_dup(const moe_tokenizer *t, int32_t id, char **piece) {
    *piece = NULL;
    MOE_TRY(check_id(t, id));
    char small[16]; // the whole piece when it fits (bytes: always), else its length
    int n;
    if (t->spm) {
        if ((n = moe_spm_piece(t->spm, id, small, sizeof small)) < 0) return n;
    } else {
        MOE_TRY(moe_tok_piece(t, id, small, sizeof small));
        n = (int)strlen(small);
    }
    char *p = malloc((size_t)n + 1);
    if (!p) return moe_fail(MOE_ENOMEM, "tokenizer: piece %d (%d bytes): out of memory", id, n);
    if ((size_t)n < sizeof small)
        memcpy(p, small, (size_t)n + 1);
    else if ((n = moe_spm_piece(t->spm, id, p, (size_t)n + 1)) < 0)
        return free(p), n;
    *piece = p;
    return 0;
}

int moe_tok_piece_type(const moe_tokenizer *t, int32_t id) {
    return t->types && id >= 0 && id < moe_tok_vocab_size(t) ? t->types[id] : MOE_TOK_NORMAL;
}

float moe_tok_score(const moe_tokenizer *t, int32_t id) {
    return t->spm && id >= 0 && id < moe_tok_vocab_size(t) ? moe_spm_score(t->spm, id) : 0.0f;
}

bool moe_tok_is_special(const moe_tokenizer *t, int32_t id) {
    return t->spm && id >= 0 && id < moe_tok_vocab_size(t) && moe_spm_is_special(t->spm, id);
}

int moe_tok_model_type(const moe_tokenizer *t) {
    if (!t->spm) return 0;
    // ModelProto.trainer_spec (field 2) . model_type (field 3); absent: UNIGRAM
    const unsigned char *p = t->model, *end = p + t->model_len, *s, *se;
    uint64_t v = 1, unused;
    if (proto_field(p, end, 2, &unused, &s, &se)) proto_field(s, se, 3, &v, NULL, NULL);
    return (int)v;
}

int moe_tok_check_config(const moe_config *cfg) {
    const char *spec = cfg->model.tokenizer;
    if (!strcmp(spec, "bytes")) return 0;
    moe_tokenizer *t;
    MOE_TRY(moe_tok_open(spec, &t));
    const int V = moe_tok_vocab_size(t);
    moe_tok_free(t);
    if (cfg->model.vocab_size < V)
        return moe_fail(MOE_EINVAL,
                        "model.tokenizer = %s has %d pieces but model.vocab_size = %d: set "
                        "model.vocab_size >= %d",
                        spec, V, cfg->model.vocab_size, V);
    return 0;
}

int moe_tok_train_spm(const char *input, const char *model_prefix, int vocab_size) {
    if (vocab_size < 1) return moe_fail(MOE_EINVAL, "vocab_size %d < 1", vocab_size);
    return moe_spm_train(input, model_prefix, vocab_size);
}
