// safetensors reader/writer: byte-exact round trips, partial reads, and one
// test per malformed-file class (each must fail at open with its own message).
#include "moe/error.h"
#include "moe/safetensors.h"
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static unsigned char *slurp(const char *path, size_t *len) {
    FILE *fp = fopen(path, "rb");
    ck_assert_ptr_nonnull(fp);
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    ck_assert_uint_eq(fread(b, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    *len = (size_t)n;
    return b;
}

static void spit(const char *path, const void *b, size_t len) {
    FILE *fp = fopen(path, "wb");
    ck_assert_ptr_nonnull(fp);
    ck_assert_uint_eq(fwrite(b, 1, len, fp), len);
    ck_assert_int_eq(fclose(fp), 0);
}

// A file by hand: 8-byte length (hlen_field, or strlen(json) if ~0), the JSON,
// then data_len bytes of data.
static void write_raw(const char *path, const char *json, uint64_t hlen_field, size_t data_len) {
    size_t jl = strlen(json);
    uint64_t h = hlen_field == ~0ull ? jl : hlen_field;
    unsigned char *b = calloc(8 + jl + data_len + 1, 1);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(h >> (8 * i));
    memcpy(b + 8, json, jl);
    for (size_t i = 0; i < data_len; i++)
        b[8 + jl + i] = (unsigned char)i;
    spit(path, b, 8 + jl + data_len);
    free(b);
}

// Opening must fail with code and a message containing word; nothing is returned.
static void expect_open_fails(const char *path, int code, const char *word) {
    moe_st_file *f = (moe_st_file *)1;
    int rc = moe_st_open(path, &f);
    ck_assert_msg(rc == code, "%s: rc %d, want %d (%s)", path, rc, code, moe_last_error());
    ck_assert_ptr_null(f);
    ck_assert_msg(strstr(moe_last_error(), word), "message '%s' lacks '%s'", moe_last_error(),
                  word);
}

static void expect_raw_fails(const char *json, size_t data_len, const char *word) {
    const char *p = tu_in_dir("bad.safetensors");
    write_raw(p, json, ~0ull, data_len);
    expect_open_fails(p, MOE_EFORMAT, word);
}

// --- the fixture of the round-trip tests ----------------------------------------------

enum { T = 5, E = 3 };
static float logits[T * E];
static int32_t ids[T];
static float loss1[1];
static int64_t scalar = -1234567890123ll;
static uint16_t bf[4] = {0x3f80, 0xbf80, 0x7f7f, 0x0001}; // 1, -1, largest finite, subnormal
static const char *const meta[] = {"format", "pt", "note", "h\xc3\xa9llo \"quoted\"", NULL};

static int fixture(moe_st_entry *e) {
    tu_rng r;
    tu_seed(&r, 7);
    tu_fill_normal(&r, logits, T * E, 3.0f);
    for (int i = 0; i < T; i++)
        ids[i] = i * 7 - 10;
    loss1[0] = 0.125f;
    int n = 0;
    e[n++] = (moe_st_entry){"logits", MOE_ST_F32, 2, {T, E}, logits};
    e[n++] = (moe_st_entry){"task_ids", MOE_ST_I32, 1, {T}, ids};
    e[n++] = (moe_st_entry){"aux_loss", MOE_ST_F32, 1, {1}, loss1};
    e[n++] = (moe_st_entry){"empty", MOE_ST_F32, 2, {0, 4}, NULL};
    e[n++] = (moe_st_entry){"step", MOE_ST_I64, 0, {0}, &scalar};
    e[n++] = (moe_st_entry){"w \"odd\" name.\xce\xbb", MOE_ST_BF16, 2, {2, 2}, bf};
    return n;
}

START_TEST(test_roundtrip_is_byte_exact_with_metadata) {
    moe_st_entry e[8];
    int n = fixture(e);
    const char *p = tu_in_dir("a.safetensors");
    ck_assert_int_eq(moe_st_write(p, e, n, meta), 0);

    moe_st_file *f;
    ck_assert_msg(moe_st_open(p, &f) == 0, "%s", moe_last_error());
    ck_assert_int_eq(f->n_tensors, n);
    ck_assert_uint_eq(f->bytes_read, 0);
    ck_assert_uint_eq(f->data_start % 8, 0); // header padded to 8 bytes
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        const moe_st_tensor *t = &f->tensors[i];
        ck_assert_str_eq(t->name, e[i].name); // order kept
        ck_assert_ptr_eq(moe_st_find(f, e[i].name), t);
        ck_assert_int_eq(t->dtype, e[i].dtype);
        ck_assert_int_eq(t->ndim, e[i].ndim);
        for (int d = 0; d < t->ndim; d++)
            ck_assert_int_eq(t->shape[d], e[i].shape[d]);
        unsigned char buf[128];
        ck_assert_uint_le(t->nbytes, sizeof buf);
        ck_assert_int_eq(moe_st_read(f, t, buf, sizeof buf), 0);
        if (t->nbytes) ck_assert_int_eq(memcmp(buf, e[i].data, t->nbytes), 0);
        total += t->nbytes;
    }
    ck_assert_uint_eq(total, (uint64_t)(T * E * 4 + T * 4 + 4 + 0 + 8 + 8));
    ck_assert_uint_eq(f->bytes_read, total);
    ck_assert_uint_eq(f->data_size, total); // packed back to back, nothing after
    ck_assert_uint_eq(moe_st_find(f, "step")->numel, 1);
    ck_assert_uint_eq(moe_st_find(f, "empty")->numel, 0);
    ck_assert_ptr_null(moe_st_find(f, "__metadata__"));
    ck_assert_ptr_null(moe_st_find(f, "missing"));
    ck_assert_int_eq(f->n_meta, 2);
    ck_assert_str_eq(moe_st_meta(f, "format"), "pt");
    ck_assert_str_eq(moe_st_meta(f, "note"), meta[3]);
    ck_assert_ptr_null(moe_st_meta(f, "absent"));
    moe_st_close(f);

    // The bytes on disk: LE length, JSON starting '{', spaces as padding.
    size_t len;
    unsigned char *b = slurp(p, &len);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--)
        h = h << 8 | b[i];
    ck_assert_uint_eq(len, 8 + h + total);
    ck_assert_uint_eq(h % 8, 0);
    ck_assert_int_eq(b[8], '{');
    size_t end = 8 + h;
    while (end > 8 && b[end - 1] == ' ')
        end--;
    ck_assert_int_eq(b[end - 1], '}');
    ck_assert_int_eq(memcmp(b + 8 + h, logits, sizeof logits), 0); // first tensor first
    free(b);
    ck_assert_int_eq(tu_count_entries(tu_dir), 1); // no temp file left behind
}
END_TEST

START_TEST(test_partial_read_counts_only_that_tensor) {
    moe_st_entry e[8];
    int n = fixture(e);
    const char *p = tu_in_dir("a.safetensors");
    ck_assert_int_eq(moe_st_write(p, e, n, NULL), 0);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    ck_assert_int_eq(f->n_meta, 0);
    int32_t got[T];
    ck_assert_int_eq(moe_st_read(f, moe_st_find(f, "task_ids"), got, sizeof got), 0);
    ck_assert_uint_eq(f->bytes_read, sizeof got);
    ck_assert_int_eq(memcmp(got, ids, sizeof got), 0);
    // A buffer one byte short is refused and counts nothing.
    ck_assert_int_eq(moe_st_read(f, moe_st_find(f, "task_ids"), got, sizeof got - 1), MOE_EINVAL);
    ck_assert_uint_eq(f->bytes_read, sizeof got);
    moe_st_close(f);
}
END_TEST

START_TEST(test_load_checks_dtype_and_rank) {
    moe_st_entry e[8];
    int n = fixture(e);
    const char *p = tu_in_dir("plan.safetensors");
    ck_assert_int_eq(moe_st_write(p, e, n, NULL), 0);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    void *d = (void *)1;
    int64_t shape[MOE_ST_MAX_DIMS] = {0};

    ck_assert_int_eq(moe_st_load(f, "logits", MOE_ST_F32, 2, shape, &d), 0);
    ck_assert_int_eq(shape[0], T);
    ck_assert_int_eq(shape[1], E);
    ck_assert_int_eq(memcmp(d, logits, sizeof logits), 0);
    free(d);

    ck_assert_int_eq(moe_st_load(f, "task_ids", MOE_ST_F32, 1, NULL, &d), MOE_EFORMAT);
    ck_assert_ptr_null(d);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "plan.safetensors: tensor 'task_ids' has dtype "
                                                   "I32, expected F32"));
    ck_assert_int_eq(moe_st_load(f, "logits", MOE_ST_F32, 3, NULL, &d), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "tensor 'logits' has rank 2, expected 3"));
    ck_assert_int_eq(moe_st_load(f, "nope", MOE_ST_F32, 1, NULL, &d), MOE_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "'nope'"));
    uint64_t before = f->bytes_read;
    ck_assert_int_eq(moe_st_load(f, "empty", MOE_ST_F32, -1, shape, &d), 0); // any rank
    ck_assert_int_eq(shape[1], 4);
    ck_assert_uint_eq(f->bytes_read, before);
    free(d);
    moe_st_close(f);
}
END_TEST

// Written the way Python tools write it: spaces, keys in another order,
// __metadata__ last, tensors not in offset order.
START_TEST(test_reads_foreign_header_layout) {
    const char *json = "{ \"b\" : { \"shape\" : [ 2 ], \"data_offsets\" : [ 3, 11 ], "
                       "\"dtype\" : \"F32\" }, \"a\": {\"dtype\":\"U8\",\"shape\":[3,1],"
                       "\"data_offsets\":[0,3]}, \"__metadata__\": {\"format\": \"pt\"} }";
    const char *p = tu_in_dir("hf.safetensors");
    write_raw(p, json, ~0ull, 11);
    moe_st_file *f;
    ck_assert_msg(moe_st_open(p, &f) == 0, "%s", moe_last_error());
    ck_assert_int_eq(f->n_tensors, 2);
    ck_assert_str_eq(f->tensors[0].name, "b");
    ck_assert_str_eq(moe_st_meta(f, "format"), "pt");
    unsigned char a[3], b[8];
    ck_assert_int_eq(moe_st_read(f, moe_st_find(f, "a"), a, sizeof a), 0);
    ck_assert_int_eq(moe_st_read(f, moe_st_find(f, "b"), b, sizeof b), 0);
    ck_assert_int_eq(a[2], 2); // write_raw fills data byte i with i
    ck_assert_int_eq(b[0], 3);
    ck_assert_int_eq(b[7], 10);
    moe_st_close(f);
}
END_TEST

START_TEST(test_truncated_file_fails_at_every_cut) {
    moe_st_entry e[8];
    int n = fixture(e);
    const char *p = tu_in_dir("a.safetensors");
    ck_assert_int_eq(moe_st_write(p, e, n, meta), 0);
    size_t len;
    unsigned char *b = slurp(p, &len);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--)
        h = h << 8 | b[i];
    // Cut inside the length, inside the header, inside the data, one byte short.
    size_t cuts[] = {0, 1, 7, 8, 9, 8 + h / 2, 8 + h - 1, 8 + h, 8 + h + 10, len - 1};
    const char *words[] = {"shorter",       "shorter",       "shorter",       "header length",
                           "header length", "header length", "header length", "beyond",
                           "beyond",        "beyond"};
    const char *q = tu_in_dir("cut.safetensors");
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
        spit(q, b, cuts[i]);
        expect_open_fails(q, MOE_EFORMAT, words[i]);
    }
    free(b);
}
END_TEST

START_TEST(test_header_length_larger_than_file) {
    const char *p = tu_in_dir("big.safetensors");
    write_raw(p, "{}", 1000, 0);
    expect_open_fails(p, MOE_EFORMAT, "header length 1000 is larger than the file");
    write_raw(p, "{}", ~0ull - 1, 0); // would wrap 8 + N
    expect_open_fails(p, MOE_EFORMAT, "header length");
}
END_TEST

START_TEST(test_bad_json_names_line_and_column) {
    expect_raw_fails("{\"a\": {\"dtype\": \"F32\",\n \"shape\": [1], oops}}", 4, "line 2 column");
    expect_raw_fails("{\"a\": {\"dtype\": \"F32\"", 0, "not valid JSON");
    expect_raw_fails("", 0, "not valid JSON");
    expect_raw_fails("[1, 2]", 0, "not an object");
    // Duplicate keys would silently keep one tensor; refuse them.
    expect_raw_fails("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                     "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                     2, "duplicate");
}
END_TEST

START_TEST(test_bad_entries_each_have_a_message) {
    expect_raw_fails("{\"a\": 3}", 0, "entry 'a' is not an object");
    expect_raw_fails("{\"a\": {\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "missing dtype");
    expect_raw_fails("{\"a\": {\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "missing shape");
    expect_raw_fails("{\"a\": {\"dtype\":\"F32\",\"shape\":[1]}}", 4, "missing data_offsets");
    expect_raw_fails("{\"a\": {\"dtype\":\"F8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
                     "unknown dtype 'F8'");
    expect_raw_fails("{\"a\": {\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
                     "shape[0]");
    expect_raw_fails("{\"a\": {\"dtype\":\"F32\",\"shape\":[1,2.5],\"data_offsets\":[0,4]}}", 12,
                     "shape[1] is not a non-negative integer");
    expect_raw_fails("{\"a\": {\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 12,
                     "begin 8 > end 4");
    expect_raw_fails("{\"a\": {\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4,
                     "data_offsets");
    expect_raw_fails("{\"__metadata__\": {\"k\": 1}}", 0, "__metadata__ 'k' is not a string");
    expect_raw_fails("{\"__metadata__\": [1]}", 0, "__metadata__ is not an object");
}
END_TEST

START_TEST(test_header_lying_about_sizes) {
    // data_offsets past the data section: name the tensor, its end and the real size.
    expect_raw_fails("{\"x\": {\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 12,
                     "tensor 'x' ends at byte 16, beyond the data section of 12 bytes");
    // A range that does not match shape x dtype.
    expect_raw_fails("{\"x\": {\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 16,
                     "size mismatch");
    expect_raw_fails("{\"x\": {\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16,
                     "need 16");
    // Shape whose byte count overflows 64 bits.
    expect_raw_fails("{\"x\": {\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],"
                     "\"data_offsets\":[0,0]}}",
                     0, "size mismatch");
}
END_TEST

START_TEST(test_overlapping_tensors_are_refused) {
    expect_raw_fails("{\"a\": {\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                     "\"b\": {\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}",
                     24, "overlap");
    // Overlap hidden behind an empty tensor: in offset order a, z (empty), c, b;
    // c lies inside a although its neighbour z does not reach it.
    expect_raw_fails("{\"b\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[40,44]},"
                     "\"a\": {\"dtype\":\"U8\",\"shape\":[32],\"data_offsets\":[0,32]},"
                     "\"z\": {\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[10,10]},"
                     "\"c\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[20,24]}}",
                     44, "'a' [0, 32) and 'c' [20, 24) overlap");
    // Touching ranges and empty tensors anywhere are fine.
    const char *p = tu_in_dir("ok.safetensors");
    write_raw(p,
              "{\"a\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
              "\"z\": {\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[2,2]},"
              "\"b\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}",
              ~0ull, 8);
    moe_st_file *f;
    ck_assert_msg(moe_st_open(p, &f) == 0, "%s", moe_last_error());
    moe_st_close(f);
}
END_TEST

// The reference reader refuses data bytes that belong to no tensor, and so do
// we: a hole between tensors, bytes appended after the last one.
START_TEST(test_bytes_outside_every_tensor_are_refused) {
    expect_raw_fails("{\"a\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                     "\"b\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[6,10]}}",
                     10, "data bytes [4, 6) before tensor 'b' belong to no tensor");
    expect_raw_fails("{\"a\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}", 6,
                     "data bytes [0, 2) before tensor 'a'");
    expect_raw_fails("{\"a\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", 5,
                     "data bytes [4, 5) after the last tensor");
    expect_raw_fails("{}", 3, "data bytes [0, 3) after the last tensor");
    // A file our writer made, with one byte appended.
    moe_st_entry e[8];
    int n = fixture(e);
    const char *p = tu_in_dir("grown.safetensors");
    ck_assert_int_eq(moe_st_write(p, e, n, meta), 0);
    FILE *fp = fopen(p, "ab");
    ck_assert_ptr_nonnull(fp);
    ck_assert_int_eq(fputc(0, fp), 0);
    ck_assert_int_eq(fclose(fp), 0);
    expect_open_fails(p, MOE_EFORMAT, "after the last tensor belong to no tensor");
}
END_TEST

// Element sizes of every dtype (safetensors format): a [3] tensor of each
// spans exactly 3 * size bytes and opens, and the reader names its size; a
// reader with one size wrong would refuse these files or read past a tensor.
START_TEST(test_dtype_sizes_match_the_format) {
    static const struct {
        const char *name;
        moe_st_dtype dt;
        size_t size;
    } want[] = {{"F64", MOE_ST_F64, 8},   {"F32", MOE_ST_F32, 4}, {"F16", MOE_ST_F16, 2},
                {"BF16", MOE_ST_BF16, 2}, {"I64", MOE_ST_I64, 8}, {"I32", MOE_ST_I32, 4},
                {"I16", MOE_ST_I16, 2},   {"I8", MOE_ST_I8, 1},   {"U64", MOE_ST_U64, 8},
                {"U32", MOE_ST_U32, 4},   {"U16", MOE_ST_U16, 2}, {"U8", MOE_ST_U8, 1},
                {"BOOL", MOE_ST_BOOL, 1}};
    ck_assert_int_eq(sizeof want / sizeof *want, MOE_ST_NDTYPES);
    const char *p = tu_in_dir("dt.safetensors");
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        ck_assert_uint_eq(moe_st_dtype_size(want[i].dt), want[i].size);
        ck_assert_str_eq(moe_st_dtype_name(want[i].dt), want[i].name);
        char json[128];
        snprintf(json, sizeof json,
                 "{\"x\": {\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[0,%zu]}}", want[i].name,
                 3 * want[i].size);
        write_raw(p, json, ~0ull, 3 * want[i].size);
        moe_st_file *f;
        ck_assert_msg(moe_st_open(p, &f) == 0, "%s: %s", want[i].name, moe_last_error());
        const moe_st_tensor *t = moe_st_find(f, "x");
        ck_assert(t && t->dtype == want[i].dt && t->nbytes == 3 * want[i].size && t->numel == 3);
        moe_st_close(f);
        // one element's bytes short: refused
        snprintf(json, sizeof json,
                 "{\"x\": {\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[0,%zu]}}", want[i].name,
                 2 * want[i].size);
        expect_raw_fails(json, 2 * want[i].size, "size mismatch");
    }
}
END_TEST

// The smallest hole, one byte between two tensors, is refused like a large one.
START_TEST(test_one_byte_hole_is_refused) {
    expect_raw_fails("{\"a\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                     "\"b\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[5,9]}}",
                     9, "data bytes [4, 5) before tensor 'b' belong to no tensor");
}
END_TEST

// MOE_ST_MAX_DIMS (8) dims open; 9 are refused at open, not written past shape[8].
START_TEST(test_rank_limit_is_max_dims) {
    const char *p = tu_in_dir("dims.safetensors");
    write_raw(p, "{\"x\": {\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,2],\"data_offsets\":[0,2]}}",
              ~0ull, 2);
    moe_st_file *f;
    ck_assert_msg(moe_st_open(p, &f) == 0, "%s", moe_last_error());
    ck_assert_int_eq(moe_st_find(f, "x")->ndim, MOE_ST_MAX_DIMS);
    moe_st_close(f);
    expect_raw_fails("{\"x\": {\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,2],"
                     "\"data_offsets\":[0,2]}}",
                     2, "has 9 dims, at most 8 supported");
}
END_TEST

START_TEST(test_missing_file_or_folder_is_refused_with_reason) {
    expect_open_fails(tu_in_dir("nope.safetensors"), MOE_ENOTFOUND, "No such file");
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "nope.safetensors"));
    expect_open_fails(tu_dir, MOE_EFORMAT, "not a regular file");
}
END_TEST

START_TEST(test_writer_into_missing_dir_leaves_nothing) {
    moe_st_entry e[8];
    int n = fixture(e);
    const char *p = tu_in_dir("sub/a.safetensors");
    ck_assert_int_eq(moe_st_write(p, e, n, NULL), MOE_EIO);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "sub/a.safetensors"));
    ck_assert_int_eq(tu_count_entries(tu_dir), 0);
}
END_TEST

START_TEST(test_writer_rejects_bad_entries_and_keeps_old_file) {
    moe_st_entry e[8];
    int n = fixture(e);
    const char *p = tu_in_dir("a.safetensors");
    ck_assert_int_eq(moe_st_write(p, e, 1, NULL), 0);
    size_t len0;
    unsigned char *old = slurp(p, &len0);

    moe_st_entry bad[2] = {e[0], e[1]};
    bad[1].name = "logits";
    ck_assert_int_eq(moe_st_write(p, bad, 2, NULL), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "given twice"));
    bad[1] = e[1];
    bad[1].shape[0] = -3;
    ck_assert_int_eq(moe_st_write(p, bad, 2, NULL), MOE_EINVAL);
    bad[1] = e[1];
    bad[1].data = NULL;
    ck_assert_int_eq(moe_st_write(p, bad, 2, NULL), MOE_EINVAL);
    bad[1] = e[1];
    bad[1].name = "__metadata__";
    ck_assert_int_eq(moe_st_write(p, bad, 2, NULL), MOE_EINVAL);
    const char *odd_meta[] = {"k", "v", "k2", NULL};
    ck_assert_int_eq(moe_st_write(p, e, n, odd_meta), MOE_EINVAL);

    size_t len1;
    unsigned char *now = slurp(p, &len1);
    ck_assert_uint_eq(len0, len1);
    ck_assert_int_eq(memcmp(old, now, len0), 0);
    ck_assert_int_eq(tu_count_entries(tu_dir), 1);
    free(old);
    free(now);

    // A good write replaces the file whole.
    ck_assert_int_eq(moe_st_write(p, e, n, NULL), 0);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    ck_assert_int_eq(f->n_tensors, n);
    moe_st_close(f);
}
END_TEST

// A write that fails half way (file size limit: EFBIG) must remove its temp
// file and leave the previous file at path untouched.
START_TEST(test_failed_write_midway_leaves_old_file) {
    enum { BIG = 1 << 16 };
    float *big = calloc(BIG, sizeof *big);
    moe_st_entry e = {"big", MOE_ST_F32, 1, {BIG}, big};
    moe_st_entry small = {"small", MOE_ST_F32, 1, {1}, loss1};
    const char *p = tu_in_dir("a.safetensors");
    ck_assert_int_eq(moe_st_write(p, &small, 1, NULL), 0);

    struct rlimit old;
    ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {4096, old.rlim_max};
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int rc = moe_st_write(p, &e, 1, NULL);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, prev);

    ck_assert_int_eq(rc, MOE_EIO);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "write failed"));
    ck_assert_int_eq(tu_count_entries(tu_dir), 1);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    ck_assert_ptr_nonnull(moe_st_find(f, "small"));
    moe_st_close(f);
    free(big);
}
END_TEST

// Sharded sets: a name stored in two shards is refused (readers would pick
// one silently); an index naming a missing shard fails naming it.
START_TEST(test_shard_set_refuses_duplicates_and_missing_shards) {
    float a[2] = {1, 2}, b[2] = {3, 4};
    moe_st_entry one[2] = {{"x", MOE_ST_F32, 1, {2}, a}, {"y", MOE_ST_F32, 1, {2}, b}};
    moe_st_entry two[1] = {{"y", MOE_ST_F32, 1, {2}, a}};
    ck_assert_int_eq(moe_st_write(tu_in_dir("s1.safetensors"), one, 2, NULL), 0);
    ck_assert_int_eq(moe_st_write(tu_in_dir("s2.safetensors"), two, 1, NULL), 0);
    FILE *f = fopen(tu_in_dir("model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": {\"x\": \"s1.safetensors\", \"y\": \"s2.safetensors\"}}", f);
    fclose(f);
    moe_st_set *s;
    ck_assert_int_eq(moe_st_set_open(tu_dir, &s), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "'y' is stored in 2 shards"));
    ck_assert_int_eq(moe_st_write(tu_in_dir("s1.safetensors"), one, 1, NULL), 0); // x only
    ck_assert_int_eq(moe_st_set_open(tu_dir, &s), 0);
    const moe_st_tensor *t = moe_st_set_find(s, "y", NULL);
    ck_assert(t != NULL && t->shape[0] == 2);
    moe_st_set_close(s);
    f = fopen(tu_in_dir("model.safetensors.index.json"), "w");
    fputs("{\"weight_map\": {\"x\": \"s1.safetensors\", \"y\": \"s3.safetensors\"}}", f);
    fclose(f);
    ck_assert_int_lt(moe_st_set_open(tu_dir, &s), 0);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "s3.safetensors"));
}
END_TEST

// Two shards and their index: x in s1, y in s2.
static void write_two_shards(const char *index_name) {
    float a[2] = {1, 2}, b[2] = {3, 4};
    moe_st_entry one[1] = {{"x", MOE_ST_F32, 1, {2}, a}}, two[1] = {{"y", MOE_ST_F32, 1, {2}, b}};
    ck_assert_int_eq(moe_st_write(tu_in_dir("s1.safetensors"), one, 1, NULL), 0);
    ck_assert_int_eq(moe_st_write(tu_in_dir("s2.safetensors"), two, 1, NULL), 0);
    FILE *f = fopen(tu_in_dir(index_name), "w");
    fputs("{\"weight_map\": {\"x\": \"s1.safetensors\", \"y\": \"s2.safetensors\"}}", f);
    fclose(f);
}

static void write_manifest(const char *index_name, long s1_size, long s2_size) {
    FILE *f = fopen(tu_in_dir("manifest.json"), "w");
    fprintf(f, "{\"files\": {\"%s\": 80, \"s1.safetensors\": %ld", index_name, s1_size);
    if (s2_size >= 0) fprintf(f, ", \"s2.safetensors\": %ld", s2_size);
    fputs("}}\n", f);
    fclose(f);
}

static long size_of(const char *name) {
    size_t n;
    free(slurp(tu_in_dir(name), &n));
    return (long)n;
}

// An index naming a shard that is not there fails naming the shard and a
// tensor mapped to it; a shard lacking a tensor its index maps to it fails
// naming both.
START_TEST(test_shard_set_names_a_missing_shard_and_a_missing_tensor) {
    write_two_shards("model.safetensors.index.json");
    unlink(tu_in_dir("s2.safetensors"));
    moe_st_set *s;
    ck_assert_int_eq(moe_st_set_open(tu_dir, &s), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "'y' is mapped to shard s2.safetensors, "
                                                   "which is missing"));
    write_two_shards("model.safetensors.index.json");
    float a[2] = {1, 2};
    moe_st_entry other[1] = {{"z", MOE_ST_F32, 1, {2}, a}};
    ck_assert_int_eq(moe_st_write(tu_in_dir("s2.safetensors"), other, 1, NULL), 0);
    ck_assert_int_eq(moe_st_set_open(tu_dir, &s), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "'y' is mapped to s2.safetensors, which lacks"));
}
END_TEST

// A checkpoint's manifest records each shard's size: a shard of another size
// (replaced or cut after the save), or one the manifest does not list, is
// refused naming it, for the model and the optimizer index alike. A manifest
// that does not list the index (a set copied in) is not consulted.
START_TEST(test_shard_of_a_size_other_than_the_manifest_lists_is_refused) {
    const char *idx[2] = {"model.safetensors.index.json", "optimizer.safetensors.index.json"};
    for (int i = 0; i < 2; i++) {
        write_two_shards(idx[i]);
        long s1 = size_of("s1.safetensors"), s2 = size_of("s2.safetensors");
        moe_st_set *s = NULL;
        write_manifest(idx[i], s1, s2);
        ck_assert_int_eq(moe_st_set_open_index(tu_dir, idx[i], &s), 0);
        moe_st_set_close(s);
        write_manifest(idx[i], s1, s2 + 8);
        ck_assert_int_eq(moe_st_set_open_index(tu_dir, idx[i], &s), MOE_EFORMAT);
        ck_assert_ptr_null(s);
        ck_assert_ptr_nonnull(strstr(moe_last_error(), "s2.safetensors: is"));
        ck_assert_ptr_nonnull(strstr(moe_last_error(), "manifest.json lists"));
        if (i == 0) ck_assert_int_eq(moe_st_set_open(tu_dir, &s), MOE_EFORMAT);
        write_manifest(idx[i], s1, -1);
        ck_assert_int_eq(moe_st_set_open_index(tu_dir, idx[i], &s), MOE_EFORMAT);
        ck_assert_ptr_nonnull(strstr(moe_last_error(), "does not list shard s2.safetensors"));
        write_manifest("other.json", s1 + 1, s2 + 1);
        ck_assert_int_eq(moe_st_set_open_index(tu_dir, idx[i], &s), 0);
        moe_st_set_close(s);
        unlink(tu_in_dir(idx[i]));
    }
}
END_TEST

// An index may name only plain .safetensors files in its own folder: a shard
// in a subfolder (or, through "..", anywhere) and a file of another kind are
// refused, whether or not the file is there and holds the tensor.
START_TEST(test_shard_names_outside_the_folder_or_not_safetensors_are_refused) {
    float a[2] = {1, 2};
    moe_st_entry one[1] = {{"x", MOE_ST_F32, 1, {2}, a}};
    ck_assert_int_eq(mkdir(tu_in_dir("sub"), 0755), 0);
    ck_assert_int_eq(moe_st_write(tu_in_dir("sub/s1.safetensors"), one, 1, NULL), 0);
    ck_assert_int_eq(moe_st_write(tu_in_dir("model-00001.bin"), one, 1, NULL), 0);
    const char *maps[] = {"sub/s1.safetensors", "model-00001.bin", "../s1.safetensors"};
    for (int i = 0; i < 3; i++) {
        FILE *f = fopen(tu_in_dir("model.safetensors.index.json"), "w");
        fprintf(f, "{\"weight_map\": {\"x\": \"%s\"}}", maps[i]);
        fclose(f);
        moe_st_set *s = (moe_st_set *)1;
        ck_assert_int_eq(moe_st_set_open_index(tu_dir, "model.safetensors.index.json", &s),
                         MOE_EFORMAT);
        ck_assert_ptr_null(s);
        ck_assert_msg(
            strstr(moe_last_error(), "expected a .safetensors file name in the same folder"),
            "%s: %s", maps[i], moe_last_error());
    }
    unlink(tu_in_dir("sub/s1.safetensors"));
    rmdir(tu_in_dir("sub"));
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("safetensors");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, tu_dir_setup, tu_dir_teardown);
    tcase_add_test(tc, test_roundtrip_is_byte_exact_with_metadata);
    tcase_add_test(tc, test_partial_read_counts_only_that_tensor);
    tcase_add_test(tc, test_load_checks_dtype_and_rank);
    tcase_add_test(tc, test_reads_foreign_header_layout);
    tcase_add_test(tc, test_truncated_file_fails_at_every_cut);
    tcase_add_test(tc, test_header_length_larger_than_file);
    tcase_add_test(tc, test_bad_json_names_line_and_column);
    tcase_add_test(tc, test_bad_entries_each_have_a_message);
    tcase_add_test(tc, test_header_lying_about_sizes);
    tcase_add_test(tc, test_overlapping_tensors_are_refused);
    tcase_add_test(tc, test_bytes_outside_every_tensor_are_refused);
    tcase_add_test(tc, test_one_byte_hole_is_refused);
    tcase_add_test(tc, test_dtype_sizes_match_the_format);
    tcase_add_test(tc, test_rank_limit_is_max_dims);
    tcase_add_test(tc, test_missing_file_or_folder_is_refused_with_reason);
    tcase_add_test(tc, test_writer_into_missing_dir_leaves_nothing);
    tcase_add_test(tc, test_writer_rejects_bad_entries_and_keeps_old_file);
    tcase_add_test(tc, test_shard_set_refuses_duplicates_and_missing_shards);
    tcase_add_test(tc, test_shard_set_names_a_missing_shard_and_a_missing_tensor);
    tcase_add_test(tc, test_shard_of_a_size_other_than_the_manifest_lists_is_refused);
    tcase_add_test(tc, test_shard_names_outside_the_folder_or_not_safetensors_are_refused);
    tcase_add_test(tc, test_failed_write_midway_leaves_old_file);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
