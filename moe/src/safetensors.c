// safetensors reader and atomic writer (format: huggingface/safetensors
// README). Every size in the header is checked against the file length before
// any tensor is read, so a truncated or lying file fails at open with a message
// naming the tensor, not later with a short read or an out-of-bounds copy.
#include "moe/safetensors.h"
#include "moe/bf16.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/json_error.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// Tensor bytes are copied as they lie in memory; the format is little-endian.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "moe safetensors I/O assumes a little-endian host"
#endif

static const struct {
    const char *name;
    size_t size;
} dtypes[MOE_ST_NDTYPES] = {
    [MOE_ST_F64] = {"F64", 8},   [MOE_ST_F32] = {"F32", 4}, [MOE_ST_F16] = {"F16", 2},
    [MOE_ST_BF16] = {"BF16", 2}, [MOE_ST_I64] = {"I64", 8}, [MOE_ST_I32] = {"I32", 4},
    [MOE_ST_I16] = {"I16", 2},   [MOE_ST_I8] = {"I8", 1},   [MOE_ST_U64] = {"U64", 8},
    [MOE_ST_U32] = {"U32", 4},   [MOE_ST_U16] = {"U16", 2}, [MOE_ST_U8] = {"U8", 1},
    [MOE_ST_BOOL] = {"BOOL", 1},
};

const char *moe_st_dtype_name(moe_st_dtype dt) {
    return (unsigned)dt < MOE_ST_NDTYPES ? dtypes[dt].name : "?";
}

void moe_st_describe(char *buf, size_t cap, moe_st_dtype dt, int ndim, const int64_t *shape) {
    if (!cap) return;
    size_t n = (size_t)snprintf(buf, cap, "%s [", moe_st_dtype_name(dt));
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

size_t moe_st_dtype_size(moe_st_dtype dt) {
    return (unsigned)dt < MOE_ST_NDTYPES ? dtypes[dt].size : 0;
}

int moe_st_dtype_parse(const char *name, moe_st_dtype *out) {
    for (int i = 0; i < MOE_ST_NDTYPES; i++)
        if (!strcmp(name, dtypes[i].name)) {
            *out = (moe_st_dtype)i;
            return 0;
        }
    return moe_fail(MOE_EINVAL, "unknown dtype '%s'", name);
}

// numel * dtype size with overflow checks; false if it does not fit in 64 bits.
static bool tensor_bytes(moe_st_dtype dt, int ndim, const int64_t *shape, uint64_t *numel,
                         uint64_t *nbytes) {
    uint64_t n = 1;
    *numel = *nbytes = 0;
    for (int d = 0; d < ndim; d++)
        if (__builtin_mul_overflow(n, (uint64_t)shape[d], &n)) return false;
    *numel = n;
    return !__builtin_mul_overflow(n, (uint64_t)moe_st_dtype_size(dt), nbytes);
}

// pread until len bytes arrive; a short file is MOE_EIO (it changed under us).
static int pread_full(int fd, void *dst, size_t len, uint64_t off, const char *path,
                      const char *what) {
    char *p = dst;
    while (len > 0) {
        ssize_t r = pread(fd, p, len, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return moe_fail(MOE_EIO, "%s: reading %s: %s", path, what, strerror(errno));
        if (r == 0) return moe_fail(MOE_EIO, "%s: unexpected end of file reading %s", path, what);
        p += r;
        len -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

void moe_st_close(moe_st_file *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    for (int i = 0; i < f->n_tensors; i++)
        free(f->tensors[i].name);
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_values[i]);
    }
    free(f->tensors);
    moe_name_map_free(&f->index);
    free(f->meta_keys);
    free(f->meta_values);
    free(f->path);
    free(f);
}

// Reads a JSON integer >= 0 (no reals, no negatives) into *out.
static bool json_nonneg_int(const json_t *v, int64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (int64_t)json_integer_value(v);
    return true;
}

static int parse_metadata(moe_st_file *f, json_t *meta) {
    if (!json_is_object(meta))
        return moe_fail(MOE_EFORMAT, "%s: header __metadata__ is not an object", f->path);
    size_t n = json_object_size(meta);
    f->meta_keys = calloc(n ? n : 1, sizeof *f->meta_keys);
    f->meta_values = calloc(n ? n : 1, sizeof *f->meta_values);
    if (!f->meta_keys || !f->meta_values) return moe_fail(MOE_ENOMEM, "%s: out of memory", f->path);
    const char *key;
    json_t *v;
    json_object_foreach(meta, key, v) {
        if (!json_is_string(v))
            return moe_fail(MOE_EFORMAT, "%s: header __metadata__ '%s' is not a string", f->path,
                            key);
        f->meta_keys[f->n_meta] = dup_str(key);
        f->meta_values[f->n_meta] = dup_str(json_string_value(v));
        if (!f->meta_keys[f->n_meta] || !f->meta_values[f->n_meta]) {
            f->n_meta++; // so close frees whichever was allocated
            return moe_fail(MOE_ENOMEM, "%s: out of memory", f->path);
        }
        f->n_meta++;
    }
    return 0;
}

// Validates one header entry and fills t (t->name is already set).
static int parse_entry(const moe_st_file *f, moe_st_tensor *t, json_t *v) {
    const char *p = f->path, *nm = t->name;
    if (!json_is_object(v))
        return moe_fail(MOE_EFORMAT, "%s: header entry '%s' is not an object", p, nm);
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"),
           *jo = json_object_get(v, "data_offsets");
    if (!jd || !js || !jo)
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' is missing %s", p, nm,
                        !jd   ? "dtype"
                        : !js ? "shape"
                              : "data_offsets");
    if (!json_is_string(jd))
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' dtype is not a string", p, nm);
    if (moe_st_dtype_parse(json_string_value(jd), &t->dtype) < 0)
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' has unknown dtype '%s'", p, nm,
                        json_string_value(jd));
    if (!json_is_array(js))
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' shape is not an array", p, nm);
    if (json_array_size(js) > MOE_ST_MAX_DIMS)
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' has %zu dims, at most %d supported", p, nm,
                        json_array_size(js), MOE_ST_MAX_DIMS);
    t->ndim = (int)json_array_size(js);
    for (int d = 0; d < t->ndim; d++)
        if (!json_nonneg_int(json_array_get(js, (size_t)d), &t->shape[d]))
            return moe_fail(MOE_EFORMAT, "%s: tensor '%s' shape[%d] is not a non-negative integer",
                            p, nm, d);
    int64_t begin, end;
    if (!json_is_array(jo) || json_array_size(jo) != 2 ||
        !json_nonneg_int(json_array_get(jo, 0), &begin) ||
        !json_nonneg_int(json_array_get(jo, 1), &end))
        return moe_fail(MOE_EFORMAT,
                        "%s: tensor '%s' data_offsets is not [begin, end] of non-negative "
                        "integers",
                        p, nm);
    if (begin > end)
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' data_offsets begin %lld > end %lld", p, nm,
                        (long long)begin, (long long)end);
    if ((uint64_t)end > f->data_size)
        return moe_fail(MOE_EFORMAT,
                        "%s: tensor '%s' ends at byte %lld, beyond the data section of %llu "
                        "bytes (file truncated or header lies about sizes)",
                        p, nm, (long long)end, (unsigned long long)f->data_size);
    uint64_t want;
    if (!tensor_bytes(t->dtype, t->ndim, t->shape, &t->numel, &want))
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' shape overflows 64-bit sizes: size mismatch",
                        p, nm);
    if (want != (uint64_t)(end - begin))
        return moe_fail(MOE_EFORMAT,
                        "%s: tensor '%s' spans %lld bytes but its shape and dtype %s need "
                        "%llu: size mismatch",
                        p, nm, (long long)(end - begin), moe_st_dtype_name(t->dtype),
                        (unsigned long long)want);
    t->offset = f->data_start + (uint64_t)begin;
    t->nbytes = (uint64_t)(end - begin);
    return 0;
}

static int cmp_offset(const void *a, const void *b) {
    const moe_st_tensor *x = *(const moe_st_tensor *const *)a,
                        *y = *(const moe_st_tensor *const *)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

// The tensors' bytes must tile the data section, as the reference reader
// (huggingface/safetensors) demands: no byte shared by two tensors, none that
// belongs to no tensor, none after the last one (bytes appended to a file or a
// hole left by a bad writer are refused, not ignored). Empty tensors own no
// byte and may sit anywhere.
static int check_tiling(const moe_st_file *f) {
    int n = f->n_tensors;
    const moe_st_tensor **by = malloc((size_t)(n ? n : 1) * sizeof *by);
    if (!by) return moe_fail(MOE_ENOMEM, "%s: out of memory", f->path);
    for (int i = 0; i < n; i++)
        by[i] = &f->tensors[i];
    qsort(by, (size_t)n, sizeof *by, cmp_offset);
    const moe_st_tensor *prev = NULL; // the non-empty tensor reaching furthest so far
    uint64_t covered = 0;             // data-section bytes [0, covered) belong to tensors
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        const moe_st_tensor *t = by[i];
        if (t->nbytes == 0) continue;
        uint64_t begin = t->offset - f->data_start;
        if (prev && covered > begin)
            rc =
                moe_fail(MOE_EFORMAT, "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap",
                         f->path, prev->name, (unsigned long long)(prev->offset - f->data_start),
                         (unsigned long long)covered, t->name, (unsigned long long)begin,
                         (unsigned long long)(begin + t->nbytes));
        else if (begin > covered)
            rc = moe_fail(MOE_EFORMAT,
                          "%s: data bytes [%llu, %llu) before tensor '%s' belong to no tensor "
                          "(a hole the safetensors format does not allow)",
                          f->path, (unsigned long long)covered, (unsigned long long)begin, t->name);
        if (begin + t->nbytes > covered) {
            covered = begin + t->nbytes;
            prev = t;
        }
    }
    free(by);
    if (rc == 0 && covered != f->data_size)
        rc = moe_fail(MOE_EFORMAT,
                      "%s: data bytes [%llu, %llu) after the last tensor belong to no tensor "
                      "(bytes appended to the file, or a damaged header)",
                      f->path, (unsigned long long)covered, (unsigned long long)f->data_size);
    return rc;
}

static const char *tensor_name(const void *tensors, uint32_t i) {
    return ((const moe_st_tensor *)tensors)[i].name;
}

// The name index; the JSON parser already refused duplicate keys, this is the backstop.
static int index_names(moe_st_file *f) {
    MOE_TRY(moe_name_map_reserve(&f->index, (size_t)f->n_tensors));
    for (int i = 0; i < f->n_tensors; i++) {
        long dup;
        MOE_TRY(moe_name_map_add(&f->index, f->tensors, tensor_name, (size_t)i, &dup));
        if (dup >= 0)
            return moe_fail(MOE_EFORMAT, "%s: tensor '%s' appears twice", f->path,
                            f->tensors[i].name);
    }
    return 0;
}

int moe_st_open(const char *path, moe_st_file **out) {
    *out = NULL;
    int rc = 0;
    char *hdr = NULL;
    json_t *root = NULL;
    moe_st_file *f = calloc(1, sizeof *f);
    if (!f) return moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    f->fd = -1;
    if (!(f->path = dup_str(path))) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "out of memory"), rc);

    MOE_TRY_GOTO(moe_open_regular(path, &f->fd), rc);
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        MOE_TRY_GOTO(moe_fail(MOE_EIO, "%s: cannot stat: %s", path, strerror(errno)), rc);
    f->file_size = (uint64_t)sb.st_size;
    if (f->file_size < 8)
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT,
                              "%s: file is %llu bytes, shorter than the 8-byte header length", path,
                              (unsigned long long)f->file_size),
                     rc);

    unsigned char len8[8];
    MOE_TRY_GOTO(pread_full(f->fd, len8, 8, 0, path, "the header length"), rc);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | len8[i];
    if (n > f->file_size - 8)
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT,
                              "%s: header length %llu is larger than the file (%llu bytes after "
                              "the 8-byte length): truncated or not a safetensors file",
                              path, (unsigned long long)n, (unsigned long long)(f->file_size - 8)),
                     rc);
    if (n > MOE_ST_MAX_HEADER)
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: header length %llu exceeds the limit of %u bytes",
                              path, (unsigned long long)n, MOE_ST_MAX_HEADER),
                     rc);
    f->data_start = 8 + n;
    f->header_bytes = 8 + n;
    f->data_size = f->file_size - f->data_start;

    if (!(hdr = malloc(n ? n : 1)))
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
    MOE_TRY_GOTO(pread_full(f->fd, hdr, n, 8, path, "the header"), rc);
    json_error_t jerr;
    root = json_loadb(hdr, n, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: header is not valid JSON: line %d column %d: %s",
                              path, jerr.line, moe_json_column(&jerr), jerr.text),
                     rc);
    if (!json_is_object(root))
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: header JSON is not an object", path), rc);

    size_t cap = json_object_size(root);
    if (!(f->tensors = calloc(cap ? cap : 1, sizeof *f->tensors)))
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (!strcmp(key, "__metadata__")) {
            MOE_TRY_GOTO(parse_metadata(f, v), rc);
            continue;
        }
        moe_st_tensor *t = &f->tensors[f->n_tensors];
        if (!(t->name = dup_str(key))) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "out of memory"), rc);
        f->n_tensors++;
        MOE_TRY_GOTO(parse_entry(f, t, v), rc);
    }
    MOE_TRY_GOTO(check_tiling(f), rc);
    MOE_TRY_GOTO(index_names(f), rc);

    json_decref(root);
    free(hdr);
    *out = f;
    return 0;
fail:
    json_decref(root);
    free(hdr);
    moe_st_close(f);
    return rc;
}

const moe_st_tensor *moe_st_find(const moe_st_file *f, const char *name) {
    long i = moe_name_map_find(&f->index, f->tensors, tensor_name, name);
    return i < 0 ? NULL : &f->tensors[i];
}

const char *moe_st_meta(const moe_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta_keys[i], key)) return f->meta_values[i];
    return NULL;
}

// Floats are tested by their bits (exponent all ones: Inf or NaN), which
// -ffast-math cannot fold away and the compiler vectorises: the OR over a block
// runs at memory speed; only a block with a hit is scanned for its first index.
typedef uint16_t u16_alias __attribute__((may_alias));
typedef uint32_t u32_alias __attribute__((may_alias));
typedef uint64_t u64_alias __attribute__((may_alias));

#define FIRST_NONFINITE(type, mask)                                                                \
    do {                                                                                           \
        const type *u = p;                                                                         \
        for (uint64_t b = 0; b < n; b += 4096) {                                                   \
            const uint64_t e = n - b < 4096 ? n : b + 4096;                                        \
            unsigned bad = 0;                                                                      \
            for (uint64_t i = b; i < e; i++)                                                       \
                bad |= (u[i] & (mask)) == (mask);                                                  \
            if (bad)                                                                               \
                for (uint64_t i = b; i < e; i++)                                                   \
                    if ((u[i] & (mask)) == (mask)) return (int64_t)i;                              \
        }                                                                                          \
        return -1;                                                                                 \
    } while (0)

// The index of the first Inf or NaN among n elements of a float dtype, or -1.
static int64_t first_nonfinite(const void *p, uint64_t n, moe_st_dtype dt) {
    switch (dt) {
    case MOE_ST_F32:
        FIRST_NONFINITE(u32_alias, 0x7f800000u);
    case MOE_ST_BF16:
        FIRST_NONFINITE(u16_alias, 0x7f80u);
    case MOE_ST_F16:
        FIRST_NONFINITE(u16_alias, 0x7c00u);
    case MOE_ST_F64:
        FIRST_NONFINITE(u64_alias, 0x7ff0000000000000ull);
    default:
        return -1;
    }
}
#undef FIRST_NONFINITE

// "[i0, i1, ...]": the multi-index of flat element i of t.
static void element_index(const moe_st_tensor *t, uint64_t i, char *buf, size_t cap) {
    uint64_t idx[MOE_ST_MAX_DIMS];
    for (int d = t->ndim - 1; d >= 0; d--) {
        uint64_t dim = t->shape[d] > 0 ? (uint64_t)t->shape[d] : 1;
        idx[d] = i % dim;
        i /= dim;
    }
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < t->ndim && n < cap; d++)
        n +=
            (size_t)snprintf(buf + n, cap - n, "%s%llu", d ? ", " : "", (unsigned long long)idx[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

int moe_st_read(moe_st_file *f, const moe_st_tensor *t, void *dst, size_t dst_bytes) {
    if (dst_bytes < t->nbytes)
        return moe_fail(MOE_EINVAL, "%s: tensor '%s' has %llu bytes, buffer holds %zu", f->path,
                        t->name, (unsigned long long)t->nbytes, dst_bytes);
    char what[300];
    snprintf(what, sizeof what, "tensor '%s'", t->name);
    MOE_TRY(pread_full(f->fd, dst, t->nbytes, t->offset, f->path, what));
    f->bytes_read += t->nbytes;
    int64_t bad = first_nonfinite(dst, t->numel, t->dtype);
    if (bad >= 0) {
        char at[MOE_ST_MAX_DIMS * 22 + 4];
        element_index(t, (uint64_t)bad, at, sizeof at);
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' has a non-finite value at element %lld %s",
                        f->path, t->name, (long long)bad, at);
    }
    return 0;
}

int moe_st_load(moe_st_file *f, const char *name, moe_st_dtype dtype, int ndim, int64_t *shape_out,
                void **data) {
    *data = NULL;
    const moe_st_tensor *t = moe_st_find(f, name);
    if (!t) return moe_fail(MOE_ENOTFOUND, "%s: no tensor '%s'", f->path, name);
    if (t->dtype != dtype)
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' has dtype %s, expected %s", f->path, name,
                        moe_st_dtype_name(t->dtype), moe_st_dtype_name(dtype));
    if (ndim >= 0 && t->ndim != ndim)
        return moe_fail(MOE_EFORMAT, "%s: tensor '%s' has rank %d, expected %d", f->path, name,
                        t->ndim, ndim);
    if (t->nbytes > SIZE_MAX)
        return moe_fail(MOE_ENOMEM, "%s: tensor '%s' is too large", f->path, name);
    void *buf = malloc(t->nbytes ? (size_t)t->nbytes : 1);
    if (!buf)
        return moe_fail(MOE_ENOMEM, "%s: cannot allocate %llu bytes for tensor '%s'", f->path,
                        (unsigned long long)t->nbytes, name);
    int rc = moe_st_read(f, t, buf, (size_t)t->nbytes);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    if (shape_out)
        for (int d = 0; d < t->ndim; d++)
            shape_out[d] = t->shape[d];
    *data = buf;
    return 0;
}

// --- writer ------------------------------------------------------------------------

// Builds the compact JSON header: __metadata__ first (as HF writes it), then
// the tensors in the order given, packed back to back.
static int build_header(const char *path, const moe_st_entry *e, int n, const char *const *metadata,
                        bool from_bf16, uint64_t *nbytes, char **out) {
    int rc = 0;
    json_t *root = json_object();
    if (!root) return moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    if (metadata && metadata[0]) {
        json_t *meta = json_object();
        if (!meta || json_object_set_new(root, "__metadata__", meta) != 0)
            MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
        for (int i = 0; metadata[i]; i += 2) {
            if (!metadata[i + 1])
                MOE_TRY_GOTO(
                    moe_fail(MOE_EINVAL, "%s: metadata key '%s' has no value", path, metadata[i]),
                    rc);
            json_t *s = json_string(metadata[i + 1]);
            if (!s || json_object_set_new(meta, metadata[i], s) != 0)
                MOE_TRY_GOTO(
                    moe_fail(MOE_EINVAL, "%s: metadata '%s' is not valid UTF-8", path, metadata[i]),
                    rc);
        }
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const char *nm = e[i].name;
        if (!nm || !*nm || !strcmp(nm, "__metadata__"))
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: entry %d has an invalid name '%s'", path, i,
                                  nm ? nm : "(null)"),
                         rc);
        if (json_object_get(root, nm))
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: tensor '%s' given twice", path, nm), rc);
        if ((unsigned)e[i].dtype >= MOE_ST_NDTYPES)
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: tensor '%s' has dtype %d outside the enum", path,
                                  nm, (int)e[i].dtype),
                         rc);
        if (from_bf16 && e[i].dtype != MOE_ST_F32)
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL,
                                  "%s: tensor '%s' from bf16 values must be F32, not %s", path, nm,
                                  moe_st_dtype_name(e[i].dtype)),
                         rc);
        if (e[i].ndim < 0 || e[i].ndim > MOE_ST_MAX_DIMS)
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: tensor '%s' has rank %d, expected 0..%d", path,
                                  nm, e[i].ndim, MOE_ST_MAX_DIMS),
                         rc);
        json_t *shape = json_array();
        json_t *obj =
            json_pack("{s:s, s:o}", "dtype", moe_st_dtype_name(e[i].dtype), "shape", shape);
        if (!obj || json_object_set_new(root, nm, obj) != 0)
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: tensor name '%s' is not valid UTF-8", path, nm),
                         rc);
        for (int d = 0; d < e[i].ndim; d++) {
            if (e[i].shape[d] < 0)
                MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: tensor '%s' has shape[%d] = %lld < 0", path,
                                      nm, d, (long long)e[i].shape[d]),
                             rc);
            if (json_array_append_new(shape, json_integer(e[i].shape[d])) != 0)
                MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
        }
        uint64_t numel, sz;
        if (!tensor_bytes(e[i].dtype, e[i].ndim, e[i].shape, &numel, &sz) ||
            sz > (uint64_t)INT64_MAX - off) // offsets are JSON integers (int64)
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: tensor '%s' is too large", path, nm), rc);
        if (sz > 0 && !e[i].data)
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: tensor '%s' has no data", path, nm), rc);
        json_t *offs = json_pack("[I, I]", (json_int_t)off, (json_int_t)(off + sz));
        if (!offs || json_object_set_new(obj, "data_offsets", offs) != 0)
            MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
        off += sz;
    }
    *out = json_dumps(root, JSON_COMPACT);
    if (!*out) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
    *nbytes = off;
fail:
    json_decref(root);
    return rc;
}

// fsync the directory holding path so the rename itself survives a crash.
// Best effort: the checkpoint writer syncs its folder again and checks that.
static void sync_parent_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : dup_str(".");
    if (!dir) return;
    moe_fs_fsync_dir(dir);
    free(dir);
}

// An F32 tensor from bf16 values: widened through a small stack buffer.
static int write_widened(int fd, const uint16_t *h, uint64_t numel) {
    float buf[4096];
    for (uint64_t i = 0; i < numel;) {
        const size_t k = numel - i < 4096 ? (size_t)(numel - i) : 4096;
        for (size_t j = 0; j < k; j++)
            buf[j] = moe_bf16_to_float(h[i + j]);
        if (moe_fs_write(fd, buf, k * sizeof(float)) != 0) return -1;
        i += k;
    }
    return 0;
}

static int write_file(const char *path, const moe_st_entry *entries, int n,
                      const char *const *metadata, bool from_bf16) {
    int rc = 0, fd = -1;
    char *header = NULL, *tmp = NULL;
    uint64_t data_bytes = 0;
    if (n < 0 || (n > 0 && !entries))
        return moe_fail(MOE_EINVAL, "%s: %d tensors to write", path, n);
    MOE_TRY(build_header(path, entries, n, metadata, from_bf16, &data_bytes, &header));

    // Pad with spaces so the data section starts 8-byte aligned (8 + N, N % 8 == 0).
    size_t hlen = strlen(header), padded = (hlen + 7) & ~(size_t)7;
    char *h = realloc(header, padded);
    if (!h) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
    header = h;
    memset(header + hlen, ' ', padded - hlen);
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));

    size_t plen = strlen(path);
    if (!(tmp = malloc(plen + sizeof ".tmp.XXXXXX")))
        MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp.XXXXXX", sizeof ".tmp.XXXXXX");
    fd = moe_fs_mkstemp(tmp);
    if (fd < 0) {
        int err = errno;
        free(tmp);
        tmp = NULL; // nothing was created, nothing to unlink
        MOE_TRY_GOTO(
            moe_fail(MOE_EIO, "%s: cannot create a temp file beside it: %s", path, strerror(err)),
            rc);
    }
    const char *step = "write";
    if (moe_fs_write(fd, len8, 8) != 0 || moe_fs_write(fd, header, padded) != 0) goto io_fail;
    for (int i = 0; i < n; i++) {
        uint64_t numel, sz;
        tensor_bytes(entries[i].dtype, entries[i].ndim, entries[i].shape, &numel, &sz);
        if (from_bf16) {
            if (write_widened(fd, entries[i].data, numel) != 0) goto io_fail;
        } else if (sz > 0 && moe_fs_write(fd, entries[i].data, (size_t)sz) != 0)
            goto io_fail;
    }
    step = "chmod";
    if (fchmod(fd, 0644) != 0) goto io_fail;
    step = "fsync";
    if (moe_fs_fsync(fd) != 0) goto io_fail;
    step = "close";
    int cfd = fd;
    fd = -1;
    if (close(cfd) != 0) goto io_fail;
    step = "rename";
    if (moe_fs_rename(tmp, path) != 0) goto io_fail;
    free(tmp);
    free(header);
    sync_parent_dir(path);
    return 0;

io_fail:
    rc = moe_fail(MOE_EIO, "%s: %s failed: %s", path, step, strerror(errno));
fail:
    if (fd >= 0) close(fd);
    // Counted too: when this unlink fails the temp file stays, and the
    // checkpoint writer must still clean it (it removes whole folders).
    if (tmp) moe_fs_unlink(tmp);
    free(tmp);
    free(header);
    return rc;
}

int moe_st_write(const char *path, const moe_st_entry *entries, int n,
                 const char *const *metadata) {
    return write_file(path, entries, n, metadata, false);
}

int moe_st_write_from_bf16(const char *path, const moe_st_entry *entries, int n,
                           const char *const *metadata) {
    return write_file(path, entries, n, metadata, true);
}
