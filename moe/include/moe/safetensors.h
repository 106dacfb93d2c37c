// safetensors files (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON naming each tensor's dtype,
// shape and byte range, then the data section. Opening reads and validates
// the header only; tensors are read one at a time with pread, so a caller can
// load just the tensors it needs. Writing is atomic (temp file, fsync, rename).
#ifndef MOE_SAFETENSORS_H
#define MOE_SAFETENSORS_H

#include "moe/name_map.h"

#include <stddef.h>
#include <stdint.h>

#define MOE_ST_MAX_DIMS 8
// Largest header accepted on read (the reference implementation's limit).
#define MOE_ST_MAX_HEADER (100u * 1024u * 1024u)

typedef enum {
    MOE_ST_F64 = 0,
    MOE_ST_F32,
    MOE_ST_F16,
    MOE_ST_BF16,
    MOE_ST_I64,
    MOE_ST_I32,
    MOE_ST_I16,
    MOE_ST_I8,
    MOE_ST_U64,
    MOE_ST_U32,
    MOE_ST_U16,
    MOE_ST_U8,
    MOE_ST_BOOL,
    MOE_ST_NDTYPES
} moe_st_dtype;

// "F32", "BF16", ...; "?" for a value outside the enum.
const char *moe_st_dtype_name(moe_st_dtype dt);
// "F32 [64, 2]": dtype and shape as messages print them (ndim dims, none
// invented for a lower rank), into buf (cap bytes, truncated if short).
void moe_st_describe(char *buf, size_t cap, moe_st_dtype dt, int ndim, const int64_t *shape);
// Bytes per element (0 for a value outside the enum).
size_t moe_st_dtype_size(moe_st_dtype dt);
// Parses a header dtype string; 0 on success, MOE_EINVAL if unknown.
int moe_st_dtype_parse(const char *name, moe_st_dtype *out);

// One tensor of an open file. Offsets are absolute file positions.
typedef struct {
    char *name;
    moe_st_dtype dtype;
    int ndim; // 0 for a scalar (one element)
    int64_t shape[MOE_ST_MAX_DIMS];
    uint64_t numel;
    uint64_t offset; // first byte in the file (8 + N + data_offsets[0])
    uint64_t nbytes; // data_offsets[1] - data_offsets[0] == numel * dtype size
} moe_st_tensor;

typedef struct {
    char *path;
    int fd;
    uint64_t file_size;
    uint64_t data_start; // 8 + header length
    uint64_t data_size;  // file_size - data_start
    int n_tensors;
    moe_st_tensor *tensors; // in header order
    int n_meta;
    char **meta_keys; // "__metadata__" entries, in header order
    char **meta_values;
    uint64_t bytes_read;   // tensor bytes read so far by moe_st_read/moe_st_load
    uint64_t header_bytes; // bytes read by moe_st_open: 8 + header length
    moe_name_map index;    // tensor name -> position in tensors
} moe_st_file;

// Opens path and validates its header (sizes against the file length, dtypes,
// shapes, ranges, overlaps). Errors: MOE_EIO (cannot open/read), MOE_EFORMAT
// (malformed or lying header), MOE_ENOMEM. On error *out is NULL.
int moe_st_open(const char *path, moe_st_file **out);
// Closes the fd and frees everything; NULL is allowed.
void moe_st_close(moe_st_file *f);

// The tensor called name, or NULL. O(1): hashed.
const moe_st_tensor *moe_st_find(const moe_st_file *f, const char *name);
// The metadata value for key, or NULL.
const char *moe_st_meta(const moe_st_file *f, const char *key);

// Reads tensor t's bytes (exactly t->nbytes) into dst; dst_bytes must be at
// least t->nbytes (MOE_EINVAL otherwise). Adds t->nbytes to f->bytes_read.
// A floating-point tensor (F32, F64, F16, BF16) holding an Inf or NaN is
// refused: MOE_EFORMAT "FILE: tensor 'NAME' has a non-finite value at element
// I [i0, i1]" (weights, optimizer moments and router logits must be finite).
int moe_st_read(moe_st_file *f, const moe_st_tensor *t, void *dst, size_t dst_bytes);

// Reads tensor name into a fresh malloc'd buffer (*data, free() it) after
// checking its dtype and rank: MOE_ENOTFOUND if absent, MOE_EFORMAT on a dtype
// or rank mismatch. ndim < 0 accepts any rank. shape_out (may be NULL) gets
// the tensor's ndim dims.
int moe_st_load(moe_st_file *f, const char *name, moe_st_dtype dtype, int ndim, int64_t *shape_out,
                void **data);

// One tensor to write; data holds numel * dtype size bytes, row-major.
typedef struct {
    const char *name;
    moe_st_dtype dtype;
    int ndim;
    int64_t shape[MOE_ST_MAX_DIMS];
    const void *data; // may be NULL only when the tensor has no elements
} moe_st_entry;

// Writes n tensors, in the order given, and optional string metadata
// (NULL, or a NULL-terminated list "key1", "value1", "key2", "value2", ..., NULL)
// to path, atomically: a temp file beside it (path.tmp.XXXXXX) is written,
// fsynced and renamed over path; on any failure the temp file is removed and
// path is untouched. The header is padded with spaces to a multiple of 8 bytes.
// The file gets mode 0644. Errors: MOE_EINVAL (bad entry), MOE_EIO, MOE_ENOMEM.
int moe_st_write(const char *path, const moe_st_entry *entries, int n, const char *const *metadata);
// The same for F32 tensors whose data holds bfloat16 values (uint16_t, numel
// each): written widened to F32 (exact), so a caller with bf16 buffers needs
// no full-size float copy. A dtype other than F32 is MOE_EINVAL.
int moe_st_write_from_bf16(const char *path, const moe_st_entry *entries, int n,
                           const char *const *metadata);

// A checkpoint's tensors: one model.safetensors, or shards listed by
// model.safetensors.index.json ({"weight_map": {tensor: shard file}}, the
// Hugging Face layout). Opening reads the index and every shard's header,
// nothing else; tensors are then read one by one, so a caller that needs a
// few experts reads only their byte ranges.
typedef struct {
    int file, tensor; // files[file]->tensors[tensor]
} moe_st_ref;

typedef struct {
    int n_files;
    moe_st_file **files;
    uint64_t index_bytes; // bytes of the index file read (0: single file)
    uint64_t total_bytes; // size of every file (index and shards): the checkpoint's size
    // Shards only: every tensor of every shard, and its name index (a name
    // held by two shards is refused at open).
    size_t n_refs;
    moe_st_ref *refs;
    moe_name_map index;
} moe_st_set;

// dir is a checkpoint folder; moe_ckpt_resolve (moe/checkpoint.h) picks the
// folder (dir, or a crash's dir.tmp / dir.old) and its one layout.
// Errors: MOE_ENOTFOUND (neither file), MOE_EFORMAT (both files, bad index, a
// tensor the index maps to a shard that lacks it, a tensor in two shards, bad
// shard), MOE_EIO, MOE_ENOMEM.
int moe_st_set_open(const char *dir, moe_st_set **out);
// The set of one index file (index_name, e.g. "optimizer.safetensors.index.json")
// in folder, read as is (no resolving). A shard the index names must exist
// (MOE_EFORMAT naming it), and when the folder's manifest.json lists the
// index, every shard must have the size the manifest lists (MOE_EFORMAT).
// moe_st_set_open applies the same checks to a sharded model.
int moe_st_set_open_index(const char *folder, const char *index_name, moe_st_set **out);
void moe_st_set_close(moe_st_set *s);
// The tensor called name and its file, or NULL (*file untouched). O(1).
const moe_st_tensor *moe_st_set_find(const moe_st_set *s, const char *name, moe_st_file **file);
// Bytes read so far: the index, every shard's header, and the tensors read.
uint64_t moe_st_set_bytes_read(const moe_st_set *s);

#endif
