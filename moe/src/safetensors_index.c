// Checkpoint tensor sets: a single model.safetensors or the Hugging Face
// sharded layout (model.safetensors.index.json naming each tensor's shard).
// Only headers are read at open; the byte counters let callers prove that a
// partial load read nothing but the headers and the tensors it asked for.
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/json_error.h"
#include "moe/safetensors.h"

#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void moe_st_set_close(moe_st_set *s) {
    if (!s) return;
    for (int i = 0; i < s->n_files; i++)
        moe_st_close(s->files[i]);
    free(s->files);
    free(s->refs);
    moe_name_map_free(&s->index);
    free(s);
}

static int add_file(moe_st_set *s, const char *path) {
    moe_st_file *f;
    MOE_TRY(moe_st_open(path, &f));
    moe_st_file **grown = realloc(s->files, sizeof *grown * (size_t)(s->n_files + 1));
    if (!grown) {
        moe_st_close(f);
        return moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    }
    s->files = grown;
    s->files[s->n_files++] = f;
    s->total_bytes += f->file_size;
    return 0;
}

// A shard name must be a plain file name in the checkpoint folder.
static int check_shard_name(const char *index, const char *tensor, const char *shard) {
    size_t n = strlen(shard);
    if (!n || strchr(shard, '/') || !strcmp(shard, ".") || !strcmp(shard, "..") ||
        n < strlen(".safetensors") || strcmp(shard + n - strlen(".safetensors"), ".safetensors"))
        return moe_fail(MOE_EFORMAT,
                        "%s: tensor '%s' maps to '%s', expected a .safetensors file name in the "
                        "same folder",
                        index, tensor, shard);
    return 0;
}

static const char *file_path(const void *files, uint32_t i) {
    return ((moe_st_file *const *)files)[i]->path;
}

static const char *ref_name(const void *set, uint32_t i) {
    const moe_st_set *s = set;
    return s->files[s->refs[i].file]->tensors[s->refs[i].tensor].name;
}

// Indexes every tensor of every shard by name: readers find a name in any
// shard, so it must be in exactly one.
static int index_shards(moe_st_set *s, const char *index) {
    size_t n = 0;
    for (int i = 0; i < s->n_files; i++)
        n += (size_t)s->files[i]->n_tensors;
    if (!(s->refs = malloc((n ? n : 1) * sizeof *s->refs)))
        return moe_fail(MOE_ENOMEM, "%s: out of memory indexing %zu tensors", index, n);
    MOE_TRY(moe_name_map_reserve(&s->index, n));
    for (int i = 0; i < s->n_files; i++)
        for (int j = 0; j < s->files[i]->n_tensors; j++) {
            s->refs[s->n_refs] = (moe_st_ref){i, j};
            long dup;
            MOE_TRY(moe_name_map_add(&s->index, s, ref_name, s->n_refs, &dup));
            if (dup >= 0)
                return moe_fail(MOE_EFORMAT, "%s: tensor '%s' is stored in 2 shards (%s and %s)",
                                index, s->files[i]->tensors[j].name,
                                s->files[s->refs[dup].file]->path, s->files[i]->path);
            s->n_refs++;
        }
    return 0;
}

static const char *base_name(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

// A folder whose manifest.json lists this index (a sharded checkpoint written
// by moe_ckpt_save) must hold every shard at the size the manifest recorded:
// a shard replaced or truncated after the save is refused here, by name,
// rather than read as weights. Without a manifest, or one that does not list
// the index (a set copied in from elsewhere), the shards' headers suffice.
static int check_manifest(const moe_st_set *s, const char *dir, const char *index) {
    char p[PATH_MAX];
    struct stat sb;
    if (snprintf(p, sizeof p, "%s/manifest.json", dir) >= (int)sizeof p) return 0;
    if (lstat(p, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size > (1 << 20)) return 0;
    json_t *doc = json_load_file(p, JSON_REJECT_DUPLICATES, NULL);
    json_t *files = json_object_get(doc, "files");
    int rc = 0;
    if (json_is_object(files) && json_object_get(files, base_name(index))) {
        for (int i = 0; i < s->n_files && rc == 0; i++) {
            const char *name = base_name(s->files[i]->path);
            json_t *v = json_object_get(files, name);
            if (!json_is_integer(v))
                rc = moe_fail(MOE_EFORMAT, "%s: does not list shard %s, which %s names", p, name,
                              index);
            else if ((uint64_t)json_integer_value(v) != s->files[i]->file_size)
                rc = moe_fail(MOE_EFORMAT,
                              "%s: is %llu bytes, but %s lists %lld (the shard changed after the "
                              "save)",
                              s->files[i]->path, (unsigned long long)s->files[i]->file_size, p,
                              (long long)json_integer_value(v));
        }
    }
    json_decref(doc);
    return rc;
}

static int open_index(moe_st_set *s, const char *dir, const char *index) {
    json_error_t jerr;
    FILE *in;
    MOE_TRY(moe_fopen_regular(index, &in));
    struct stat sb;
    if (fstat(fileno(in), &sb) == 0) s->index_bytes = (uint64_t)sb.st_size;
    json_t *doc = json_loadf(in, JSON_REJECT_DUPLICATES, &jerr);
    fclose(in);
    if (!doc) return moe_json_fail(MOE_EFORMAT, index, &jerr);
    int rc = 0;
    s->total_bytes += s->index_bytes;
    moe_name_map files = {0}; // shard path -> position in s->files
    json_t *map = json_object_get(doc, "weight_map");
    if (!json_is_object(map) || json_object_size(map) == 0)
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: 'weight_map' missing or empty", index), rc);
    const char *name;
    json_t *v;
    json_object_foreach(map, name, v) { // open each shard once, in order of first mention
        if (!json_is_string(v))
            MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: weight_map '%s' is not a string", index, name),
                         rc);
        const char *shard = json_string_value(v);
        MOE_TRY_GOTO(check_shard_name(index, name, shard), rc);
        char path[PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", dir, shard) >= (int)sizeof path)
            MOE_TRY_GOTO(moe_fail(MOE_EINVAL, "%s: path too long", dir), rc);
        long known = moe_name_map_find(&files, s->files, file_path, path);
        if (known < 0) {
            struct stat fs;
            if (stat(path, &fs) != 0)
                MOE_TRY_GOTO(moe_fail(MOE_EFORMAT,
                                      "%s: tensor '%s' is mapped to shard %s, which is missing",
                                      index, name, shard),
                             rc);
            MOE_TRY_GOTO(add_file(s, path), rc);
            known = s->n_files - 1;
            long dup;
            MOE_TRY_GOTO(moe_name_map_add(&files, s->files, file_path, (size_t)known, &dup), rc);
        }
        if (!moe_st_find(s->files[known], name))
            MOE_TRY_GOTO(moe_fail(MOE_EFORMAT, "%s: tensor '%s' is mapped to %s, which lacks it",
                                  index, name, shard),
                         rc);
    }
    MOE_TRY_GOTO(index_shards(s, index), rc);
    MOE_TRY_GOTO(check_manifest(s, dir, index), rc);
fail:
    moe_name_map_free(&files);
    json_decref(doc);
    return rc;
}

int moe_st_set_open(const char *dir, moe_st_set **out) {
    *out = NULL;
    // The checkpoint resolver picks the folder and the layout for every reader.
    char rdir[PATH_MAX], path[PATH_MAX];
    moe_ckpt_layout layout;
    MOE_TRY(moe_ckpt_resolve(dir, rdir, sizeof rdir, &layout));
    MOE_TRY(moe_ckpt_check_sizes(rdir));
    if (snprintf(path, sizeof path, "%s/%s", rdir,
                 layout == MOE_CKPT_SHARDED ? "model.safetensors.index.json"
                                            : "model.safetensors") >= (int)sizeof path)
        return moe_fail(MOE_EINVAL, "%s: path too long", rdir);
    moe_st_set *s = calloc(1, sizeof *s);
    if (!s) return moe_fail(MOE_ENOMEM, "%s: out of memory", dir);
    int rc = layout == MOE_CKPT_SHARDED ? open_index(s, rdir, path) : add_file(s, path);
    if (rc < 0) {
        moe_st_set_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

int moe_st_set_open_index(const char *folder, const char *index_name, moe_st_set **out) {
    *out = NULL;
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", folder, index_name) >= (int)sizeof path)
        return moe_fail(MOE_EINVAL, "%s: path too long", folder);
    moe_st_set *s = calloc(1, sizeof *s);
    if (!s) return moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    int rc = open_index(s, folder, path);
    if (rc < 0) {
        moe_st_set_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

const moe_st_tensor *moe_st_set_find(const moe_st_set *s, const char *name, moe_st_file **file) {
    if (s->n_refs == 0) { // one file (or shards not indexed yet)
        for (int i = 0; i < s->n_files; i++) {
            const moe_st_tensor *t = moe_st_find(s->files[i], name);
            if (t) {
                if (file) *file = s->files[i];
                return t;
            }
        }
        return NULL;
    }
    long i = moe_name_map_find(&s->index, s, ref_name, name);
    if (i < 0) return NULL;
    moe_st_file *f = s->files[s->refs[i].file];
    if (file) *file = f;
    return &f->tensors[s->refs[i].tensor];
}

uint64_t moe_st_set_bytes_read(const moe_st_set *s) {
    uint64_t n = s->index_bytes;
    for (int i = 0; i < s->n_files; i++)
        n += s->files[i]->header_bytes + s->files[i]->bytes_read;
    return n;
}
