// `moe prepare`: text files -> llm.c token shards (moe/prepare.h). Two
// passes: the first checks every input (regular file, UTF-8) so that bad input
// leaves nothing behind; the second splits documents into train and
// validation by a hash of their bytes, encodes them and streams the tokens
// into shards whose header count is written when the shard closes.
#include "moe/prepare.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/rng.h"
#include "moe/shards.h"
#include "moe/tokenizer.h"

#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int moe_tokens_reserve(moe_tokens *t, size_t extra) {
    if (t->n + extra <= t->cap) return 0;
    size_t cap = t->cap ? t->cap : 4096;
    while (cap < t->n + extra)
        cap *= 2;
    uint32_t *p = realloc(t->tok, sizeof *p * cap);
    if (!p) return moe_fail(MOE_ENOMEM, "tokens: out of memory (%zu)", cap);
    t->tok = p, t->cap = cap;
    return 0;
}

void moe_tokens_free(moe_tokens *t) {
    free(t->tok);
    memset(t, 0, sizeof *t);
}

static int encode_bytes(void *ctx, const char *text, size_t len, int first, moe_tokens *out) {
    (void)ctx, (void)first;
    MOE_TRY(moe_tokens_reserve(out, len));
    for (size_t i = 0; i < len; i++)
        out->tok[out->n++] = (unsigned char)text[i];
    return 0;
}

// A SentencePiece document starts with BOS: what moe generate and
// transformers put before a prompt, so training sees the same context.
static int encode_spm(void *ctx, const char *text, size_t len, int first, moe_tokens *out) {
    const moe_tokenizer *tk = ctx;
    int32_t *ids = NULL;
    size_t n = 0;
    MOE_TRY(moe_tok_encode_part(tk, text, len, first, &ids, &n));
    int rc = moe_tokens_reserve(out, n + 1);
    if (rc == 0) {
        if (first && moe_tok_bos_id(tk) >= 0) out->tok[out->n++] = (uint32_t)moe_tok_bos_id(tk);
        for (size_t i = 0; i < n; i++)
            out->tok[out->n++] = (uint32_t)ids[i];
    }
    free(ids);
    return rc;
}

static void free_spm(void *ctx) {
    moe_tok_free(ctx);
}

int moe_prepare_tokenizer_open(moe_prepare_tokenizer *t, const char *spec) {
    memset(t, 0, sizeof *t);
    if (!strcmp(spec, "bytes")) {
        snprintf(t->name, sizeof t->name, "bytes");
        t->vocab_size = 256;
        t->encode = encode_bytes;
        return 0;
    }
    if (strlen(spec) >= sizeof t->name)
        return moe_fail(MOE_EINVAL, "--tokenizer: path longer than %zu characters",
                        sizeof t->name - 1);
    moe_tokenizer *tk;
    int rc = moe_tok_open(spec, &tk);
    if (rc == MOE_ENOTFOUND) // "byte: cannot open" says nothing of what was expected
        return moe_fail(rc,
                        "--tokenizer %s: no such file (--tokenizer takes bytes or the path of a "
                        "SentencePiece .model): %s",
                        spec, moe_last_error());
    if (rc < 0) return rc;
    snprintf(t->name, sizeof t->name, "%s", spec);
    t->vocab_size = moe_tok_vocab_size(tk);
    t->hash = moe_tok_hash(tk);
    t->unk_id = moe_tok_unk_id(tk);
    t->has_unk = t->unk_id >= 0;
    t->encode = encode_spm;
    t->free = free_spm;
    t->ctx = tk;
    return 0;
}

void moe_prepare_tokenizer_close(moe_prepare_tokenizer *t) {
    if (t->free && t->ctx) t->free(t->ctx);
    t->ctx = NULL;
}

// --- inputs --------------------------------------------------------------------------

typedef struct {
    char **path;
    int n;
} path_list;

static int list_add(path_list *l, const char *p) {
    char **a = realloc(l->path, sizeof *a * (size_t)(l->n + 1));
    if (!a || !(a[l->n] = strdup(p))) {
        if (a) l->path = a;
        return moe_fail(MOE_ENOMEM, "prepare: out of memory");
    }
    l->path = a;
    l->n++;
    return 0;
}

static void list_free(path_list *l) {
    for (int i = 0; i < l->n; i++)
        free(l->path[i]);
    free(l->path);
    memset(l, 0, sizeof *l);
}

// The input files with the identity (device, inode) of what each path names,
// so that one file reached by two paths is caught.
typedef struct {
    path_list paths;
    struct file_id {
        dev_t dev;
        ino_t ino;
        int at; // index into paths
    } * id;
    int skipped;     // entries of folders that are no file or folder (or cannot be read)
    char skip[4200]; // the first of them and why
} input_list;

static int input_add(input_list *in, const char *p, const struct stat *st) {
    struct file_id *a = realloc(in->id, sizeof *a * (size_t)(in->paths.n + 1));
    if (!a) return moe_fail(MOE_ENOMEM, "prepare: out of memory");
    in->id = a;
    a[in->paths.n] = (struct file_id){st->st_dev, st->st_ino, in->paths.n};
    return list_add(&in->paths, p);
}

static void input_free(input_list *in) {
    list_free(&in->paths);
    free(in->id);
    in->id = NULL;
}

static int by_id(const void *a, const void *b) {
    const struct file_id *x = a, *y = b;
    if (x->dev != y->dev) return x->dev < y->dev ? -1 : 1;
    if (x->ino != y->ino) return x->ino < y->ino ? -1 : 1;
    return x->at - y->at;
}

// A file included twice would be trained on twice and could land in both
// splits: the same (device, inode) under two paths is refused.
static int refuse_duplicates(const input_list *in) {
    int n = in->paths.n;
    struct file_id *s = malloc(sizeof *s * (size_t)(n ? n : 1));
    if (!s) return moe_fail(MOE_ENOMEM, "prepare: out of memory");
    memcpy(s, in->id, sizeof *s * (size_t)n);
    qsort(s, (size_t)n, sizeof *s, by_id);
    int rc = 0;
    for (int i = 1; i < n && rc == 0; i++) {
        if (s[i].dev != s[i - 1].dev || s[i].ino != s[i - 1].ino) continue;
        const char *a = in->paths.path[s[i - 1].at], *b = in->paths.path[s[i].at];
        if (!strcmp(a, b))
            rc = moe_fail(MOE_EINVAL,
                          "%s: included twice (an input given twice, or a file inside a folder "
                          "also given): give each file once",
                          a);
        else
            rc = moe_fail(MOE_EINVAL,
                          "%s and %s are the same file (a link, or the same file by two paths): "
                          "give each file once",
                          a, b);
    }
    free(s);
    return rc;
}

// The folders a walk has entered, as (device, inode) in an open-addressing
// set: a folder reached again through a symbolic link (a loop such as
// `ln -s . a`, or two links to one folder) is not entered twice.
typedef struct {
    struct dir_id {
        dev_t dev;
        ino_t ino;
        bool used;
    } * slot;
    size_t cap, n;
} dir_set;

static size_t dir_hash(dev_t dev, ino_t ino, size_t cap) {
    uint64_t h = ((uint64_t)dev * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)ino * 0xC2B2AE3D27D4EB4Full);
    return (size_t)(h ^ (h >> 29)) & (cap - 1);
}

// 1 when (dev, ino) was new (now added), 0 when already in the set.
static int dir_set_add(dir_set *d, dev_t dev, ino_t ino) {
    if (2 * (d->n + 1) > d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 64;
        struct dir_id *s = calloc(cap, sizeof *s);
        if (!s) return moe_fail(MOE_ENOMEM, "prepare: out of memory");
        for (size_t i = 0; i < d->cap; i++)
            if (d->slot[i].used) {
                size_t h = dir_hash(d->slot[i].dev, d->slot[i].ino, cap);
                while (s[h].used)
                    h = (h + 1) & (cap - 1);
                s[h] = d->slot[i];
            }
        free(d->slot);
        d->slot = s, d->cap = cap;
    }
    size_t h = dir_hash(dev, ino, d->cap);
    for (; d->slot[h].used; h = (h + 1) & (d->cap - 1))
        if (d->slot[h].dev == dev && d->slot[h].ino == ino) return 0;
    d->slot[h] = (struct dir_id){dev, ino, true};
    d->n++;
    return 1;
}

// An entry of a folder that walk passes over: counted, the first named.
static void skip_entry(input_list *l, const char *p, const char *why) {
    if (!l->skipped++) snprintf(l->skip, sizeof l->skip, "%s: %s", p, why);
}

static const char *not_walked(const char *p, const struct stat *st, int err) {
    struct stat ls;
    if (err == ENOENT && lstat(p, &ls) == 0 && S_ISLNK(ls.st_mode)) return "broken link";
    if (err) return strerror(err);
    return S_ISFIFO(st->st_mode) ? "a FIFO" : S_ISSOCK(st->st_mode) ? "a socket" : "a device";
}

// Regular files under dir, sorted by name, hidden entries skipped; links are
// followed, but a folder already entered is skipped. Anything else (a broken
// link, a FIFO, an entry stat cannot read) is skipped and counted.
static int walk(input_list *l, dir_set *seen, const char *dir, int depth) {
    if (depth > 64) return moe_fail(MOE_EINVAL, "%s: folders nested deeper than 64", dir);
    struct dirent **ents;
    int n = scandir(dir, &ents, NULL, alphasort);
    if (n < 0)
        return moe_fail(moe_input_errno_code(errno), "%s: cannot list: %s", dir, strerror(errno));
    int rc = 0;
    for (int i = 0; i < n; i++) {
        const char *name = ents[i]->d_name;
        char p[4096];
        struct stat st;
        if (rc == 0 && name[0] != '.') {
            if (snprintf(p, sizeof p, "%s/%s", dir, name) >= (int)sizeof p)
                rc = moe_fail(MOE_EINVAL, "%s/%s: path too long", dir, name);
            else if (stat(p, &st) != 0)
                skip_entry(l, p, not_walked(p, &st, errno));
            else if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode))
                skip_entry(l, p, not_walked(p, &st, 0));
            else if (S_ISDIR(st.st_mode)) {
                if ((rc = dir_set_add(seen, st.st_dev, st.st_ino)) > 0)
                    rc = walk(l, seen, p, depth + 1);
            } else
                rc = input_add(l, p, &st);
        }
        free(ents[i]);
    }
    free(ents);
    return rc;
}

// A read-only mapping of a whole input (NULL data for an empty file).
typedef struct {
    const char *data;
    size_t len;
} text_map;

static int map_text(const char *path, text_map *m) {
    return moe_map_regular(path, (const void **)&m->data, &m->len);
}

static void unmap_text(text_map *m) {
    moe_unmap(m->data, m->len);
    m->data = NULL;
}

// --- shards --------------------------------------------------------------------------

typedef struct {
    const char *dir, *split;
    int width, version;
    long per_shard;
    FILE *f;
    long n;         // tokens in the open shard
    int count;      // shards started
    int created;    // NAME.tmp files this run created (the first `created` of done)
    int renamed;    // shards this run moved from NAME.tmp to NAME
    path_list done; // every shard started, by its final name
} shard_writer;

// Shards are written as NAME.tmp and renamed to NAME only when all of them and
// the manifest are complete: a killed prepare leaves no file that the glob
// DIR/train_*.bin picks up, and a run that maps an old shard is never hit by
// a shard rewritten under it (SIGBUS). Each NAME.tmp is created exclusively
// and NAME never replaced: two prepares into one folder, or one beside a
// killed one's leftovers, fail instead of deleting each other's shards.
static void tmp_name(char *out, size_t cap, const char *path) {
    snprintf(out, cap, "%s.tmp", path);
}

static int refuse_taken(const char *path) {
    return moe_fail(MOE_EINVAL,
                    "%s exists: another moe prepare is writing into this --out, or one was "
                    "stopped there (its .tmp files stay): choose another --out or remove them",
                    path);
}

// tmp renamed to fin, which must not exist yet.
static int put_in_place(const char *tmp, const char *fin) {
    if (moe_fs_rename_noreplace(tmp, fin) == 0) return 0;
    if (errno == EEXIST) return refuse_taken(fin);
    return moe_fail(MOE_EIO, "%s: cannot rename to %s: %s", tmp, fin, strerror(errno));
}

static int shard_close(shard_writer *w) {
    if (!w->f) return 0;
    unsigned char hdr[MOE_LLMC_HEADER];
    moe_llmc_header_fill(hdr, w->version, w->n);
    int bad = fseek(w->f, 0, SEEK_SET) || fwrite(hdr, sizeof hdr, 1, w->f) != 1;
    bad |= fclose(w->f) != 0;
    w->f = NULL;
    if (bad)
        return moe_fail(MOE_EIO, "%s: write failed: %s", w->done.path[w->done.n - 1],
                        strerror(errno));
    return 0;
}

static int shard_write(shard_writer *w, const uint32_t *tok, size_t n) {
    unsigned char buf[8192];
    while (n > 0) {
        if (!w->f) {
            char p[4096];
            snprintf(p, sizeof p, "%s/%s_%06d.bin", w->dir, w->split, w->count++);
            MOE_TRY(list_add(&w->done, p));
            char t[4200];
            tmp_name(t, sizeof t, p);
            unsigned char hdr[MOE_LLMC_HEADER];
            moe_llmc_header_fill(hdr, w->version, 0); // rewritten with the count at close
            int fd = moe_fs_create_excl(t);
            if (fd < 0 && errno == EEXIST) return refuse_taken(t);
            if (fd < 0) return moe_fail(MOE_EIO, "%s: cannot create: %s", t, strerror(errno));
            w->created++;
            if (!(w->f = fdopen(fd, "wb"))) close(fd);
            if (!w->f || fwrite(hdr, sizeof hdr, 1, w->f) != 1)
                return moe_fail(MOE_EIO, "%s: cannot write: %s", t, strerror(errno));
            w->n = 0;
        }
        size_t room = (size_t)(w->per_shard - w->n), take = n < room ? n : room;
        size_t per = sizeof buf / (size_t)w->width;
        for (size_t done = 0; done < take;) {
            size_t k = take - done < per ? take - done : per;
            for (size_t i = 0; i < k; i++)
                for (int b = 0; b < w->width; b++)
                    buf[i * w->width + b] = (unsigned char)(tok[done + i] >> (8 * b));
            if (fwrite(buf, (size_t)w->width, k, w->f) != k)
                return moe_fail(MOE_EIO, "%s: write failed: %s", w->done.path[w->done.n - 1],
                                strerror(errno));
            done += k;
        }
        w->n += (long)take, tok += take, n -= take;
        if (w->n == w->per_shard) MOE_TRY(shard_close(w));
    }
    return 0;
}

// --- documents -----------------------------------------------------------------------

// Length of the document starting at s[0, n): through the end of the line,
// through the blank line ending a paragraph, or the rest.
static size_t doc_len(const char *s, size_t n, moe_doc_unit unit) {
    if (unit == MOE_DOC_FILE) return n;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\n') continue;
        if (unit == MOE_DOC_LINE) return i + 1;
        size_t j = i + 1; // a paragraph ends after a line holding only blanks
        while (j < n && (s[j] == ' ' || s[j] == '\t' || s[j] == '\r'))
            j++;
        if (j < n && s[j] == '\n') {
            while (j < n && s[j] == '\n')
                j++;
            return j;
        }
    }
    return n;
}

// Bytes of the next part of a document s[0, n) to encode, at most max (>= 1):
// through the last newline, else up to the last space that follows a
// non-space, else up to the last character boundary. Tokens at a newline or
// space cut equal those of the whole document for the usual SentencePiece
// models (moe/tokenizer.h, moe_tok_encode_part); a cut inside a word may
// split a token there.
static size_t part_len(const char *s, size_t n, size_t max) {
    if (n <= max) return n;
    for (size_t k = max; k > 0; k--)
        if (s[k - 1] == '\n') return k;
    for (size_t k = max; k > 1; k--)
        if (s[k] == ' ' && s[k - 1] != ' ') return k;
    size_t k = max;
    while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80)
        k--;
    while (k == 0 && ++max < n) // max inside the first character: past it
        if (((unsigned char)s[max] & 0xC0) != 0x80) k = max;
    return k ? k : n;
}

static int stopped(const moe_prepare_opts *o) {
    return o->stop && *o->stop
               ? moe_fail(MOE_EIO, "interrupted: the shards written so far are removed")
               : 0;
}

static int doc_split(const char *s, size_t n, uint64_t seed, double val_fraction) {
    uint64_t h = 0xCBF29CE484222325ull; // FNV-1a, then mixed with the seed
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 0x100000001B3ull;
    return moe_u01(moe_hash4(seed, h, n, 0xD0C)) < val_fraction ? MOE_SPLIT_VAL : MOE_SPLIT_TRAIN;
}

typedef struct {
    size_t bytes;
    long docs[2], tokens[2];
} file_stat;

static const char *const doc_names[] = {"file", "paragraph", "line"};

// A file name as a JSON string: names are bytes, JSON is UTF-8, so each byte
// of an invalid sequence is written as the text \xHH (jansson would give NULL
// and the key would be dropped without a word).
static json_t *name_json(const char *name) {
    size_t n = strlen(name);
    if (moe_utf8_bad((const unsigned char *)name, (long)n) < 0) return json_string(name);
    char *t = malloc(4 * n + 1), *o = t;
    if (!t) return NULL;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)name[i];
        size_t len = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
        if (i + len <= n && moe_utf8_bad((const unsigned char *)name + i, (long)len) < 0) {
            memcpy(o, name + i, len), o += len, i += len;
        } else {
            o += sprintf(o, "\\x%02X", c);
            i++;
        }
    }
    *o = 0;
    json_t *j = json_string(t);
    free(t);
    return j;
}

// Writes DIR/manifest.json.tmp; *created is set once this run made that file.
static int write_manifest(const moe_prepare_opts *o, const path_list *in, const file_stat *fs,
                          const moe_prepare_result *r, shard_writer w[2], bool *created) {
    char p[4096];
    snprintf(p, sizeof p, "%s/manifest.json", o->out_dir);
    json_t *root = json_object(), *files = json_array(), *splits = json_object();
    json_object_set_new(root, "format", json_string("llm.c"));
    json_object_set_new(root, "version", json_integer(r->version));
    json_object_set_new(root, "tokenizer", json_string(o->tokenizer->name));
    json_object_set_new(root, "vocab_size", json_integer(o->tokenizer->vocab_size));
    if (o->tokenizer->hash) { // a string: JSON readers lose integers past 2^53
        char h[24];
        snprintf(h, sizeof h, "%016" PRIx64, o->tokenizer->hash);
        json_object_set_new(root, "tokenizer_hash", json_string(h));
    }
    json_object_set_new(root, "unk_tokens", json_integer(r->unk_tokens));
    json_object_set_new(root, "document", json_string(doc_names[o->doc]));
    json_object_set_new(root, "val_fraction", json_real(o->val_fraction));
    json_object_set_new(root, "seed", json_integer((json_int_t)o->seed));
    for (int i = 0; i < in->n; i++) {
        json_t *f = json_object();
        json_object_set_new(f, "path", name_json(in->path[i]));
        json_object_set_new(f, "bytes", json_integer((json_int_t)fs[i].bytes));
        json_object_set_new(f, "documents", json_integer(fs[i].docs[0] + fs[i].docs[1]));
        json_object_set_new(f, "train_documents", json_integer(fs[i].docs[0]));
        json_object_set_new(f, "val_documents", json_integer(fs[i].docs[1]));
        json_object_set_new(f, "tokens", json_integer(fs[i].tokens[0] + fs[i].tokens[1]));
        json_array_append_new(files, f);
    }
    for (int s = 0; s < 2; s++) {
        json_t *o2 = json_object(), *names = json_array();
        json_object_set_new(o2, "bytes", json_integer((json_int_t)r->split_bytes[s]));
        json_object_set_new(o2, "documents", json_integer(r->documents[s]));
        json_object_set_new(o2, "tokens", json_integer(r->tokens[s]));
        for (int i = 0; i < w[s].done.n; i++) {
            const char *slash = strrchr(w[s].done.path[i], '/');
            json_array_append_new(names, json_string(slash ? slash + 1 : w[s].done.path[i]));
        }
        json_object_set_new(o2, "shards", names);
        json_object_set_new(splits, s ? "val" : "train", o2);
    }
    json_object_set_new(root, "files", files);
    json_object_set_new(root, "splits", splits);
    char t[4200];
    tmp_name(t, sizeof t, p);
    char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
    json_decref(root);
    if (!text) return moe_fail(MOE_ENOMEM, "%s: out of memory", t);
    int rc = 0, fd = moe_fs_create_excl(t);
    if (fd < 0 && errno == EEXIST)
        rc = refuse_taken(t);
    else if (fd < 0)
        rc = moe_fail(MOE_EIO, "%s: cannot create: %s", t, strerror(errno));
    else {
        *created = true;
        size_t n = strlen(text);
        text[n] = '\n'; // json_dumps's NUL: the file ends with a newline, not a NUL
        if (moe_fs_write(fd, text, n + 1) != 0)
            rc = moe_fail(MOE_EIO, "%s: cannot write: %s", t, strerror(errno));
        if (close(fd) != 0 && rc == 0)
            rc = moe_fail(MOE_EIO, "%s: cannot write: %s", t, strerror(errno));
    }
    free(text);
    return rc;
}

// The names prepare writes, and those of a prepare that was killed: a folder
// holding any of them is refused, since an old shard left beside new ones
// would be trained on by DIR/train_*.bin. Other files are left alone.
static int check_out_dir(const char *dir) {
    static const char *const ours[] = {"manifest.json", "manifest.json.tmp", "train_*.bin",
                                       "val_*.bin",     "train_*.bin.tmp",   "val_*.bin.tmp"};
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : moe_make_dirs(dir); // its message for a non-folder
    int rc = 0;
    for (struct dirent *e; rc == 0 && (e = readdir(d)) != NULL;)
        for (size_t k = 0; rc == 0 && k < sizeof ours / sizeof ours[0]; k++)
            if (fnmatch(ours[k], e->d_name, 0) == 0)
                rc = moe_fail(MOE_EINVAL,
                              "%s/%s exists: %s already holds shards or a manifest (of an earlier "
                              "moe prepare; .tmp: of one that was stopped): choose another --out "
                              "or remove them",
                              dir, e->d_name, dir);
    closedir(d);
    return rc;
}

int moe_prepare(const moe_prepare_opts *o, moe_prepare_result *r) {
    memset(r, 0, sizeof *r);
    if (o->val_fraction < 0 || o->val_fraction >= 1)
        return moe_fail(MOE_EINVAL, "--val-fraction %g: expected 0 <= f < 1", o->val_fraction);
    if (o->shard_tokens < 1 || o->shard_tokens > INT32_MAX)
        return moe_fail(MOE_EINVAL, "--shard-tokens %ld: expected 1..%d", o->shard_tokens,
                        INT32_MAX);
    if (o->n_inputs < 1) return moe_fail(MOE_EINVAL, "no input files or folders");
    // The longest name written: a shard's temp file. Found out only at the
    // first shard, it would fail after the inputs' checks, with its name cut.
    if (strlen(o->out_dir) + sizeof "/train_000000.bin.tmp" > PATH_MAX)
        return moe_fail(MOE_EINVAL,
                        "%s: path too long: its shards (train_000000.bin.tmp) would pass %d "
                        "characters, the longest path; choose a shorter --out",
                        o->out_dir, PATH_MAX - 1);
    const moe_prepare_tokenizer *tk = o->tokenizer;
    r->version = tk->vocab_size <= 65536 ? 1 : 2;
    input_list inl = {0};
    const path_list *in = &inl.paths;
    struct stat out_st;
    bool made_out = false;
    file_stat *fs = NULL;
    moe_tokens toks = {0};
    shard_writer w[2];
    for (int s = 0; s < 2; s++)
        w[s] = (shard_writer){.dir = o->out_dir,
                              .split = s ? "val" : "train",
                              .width = r->version * 2,
                              .version = r->version,
                              .per_shard = o->shard_tokens};
    int rc = 0;
    char p[4200], manifest[4096] = "";
    bool manifest_tmp = false; // manifest.json.tmp created by this run
    // Pass 1: every input is a readable regular file of UTF-8 text.
    for (int i = 0; rc == 0 && i < o->n_inputs; i++) {
        struct stat st;
        if (stat(o->inputs[i], &st) != 0) { // map_text names what is wrong
            rc = input_add(&inl, o->inputs[i], &(struct stat){.st_ino = 0});
            continue;
        }
        if (S_ISDIR(st.st_mode)) {
            dir_set seen = {0};
            rc = dir_set_add(&seen, st.st_dev, st.st_ino);
            if (rc >= 0) rc = walk(&inl, &seen, o->inputs[i], 0);
            free(seen.slot);
        } else
            rc = input_add(&inl, o->inputs[i], &st);
    }
    size_t total = 0;
    for (int i = 0; rc == 0 && i < in->n; i++) {
        text_map m;
        if ((rc = map_text(in->path[i], &m)) < 0) break;
        long bad = moe_utf8_bad((const unsigned char *)m.data, (long)m.len);
        if (bad >= 0) rc = moe_fail(MOE_EFORMAT, "%s: byte %ld: invalid UTF-8", in->path[i], bad);
        total += m.len;
        unmap_text(&m);
    }
    if (rc == 0 && in->n == 0)
        rc = inl.skipped ? moe_fail(MOE_EINVAL,
                                    "no files in the inputs given (%d entries skipped, the first "
                                    "%s)",
                                    inl.skipped, inl.skip)
                         : moe_fail(MOE_EINVAL, "no files in the inputs given");
    if (rc == 0) rc = refuse_duplicates(&inl);
    if (rc == 0 && total == 0) rc = moe_fail(MOE_EFORMAT, "the inputs hold no text (all empty)");
    if (rc < 0) goto fail;
    if ((rc = check_out_dir(o->out_dir)) < 0) goto fail;
    made_out = stat(o->out_dir, &out_st) != 0; // a folder the user made stays
    if ((rc = moe_make_dirs(o->out_dir)) < 0) goto fail;
    fs = calloc((size_t)in->n, sizeof *fs);
    if (!fs) {
        rc = moe_fail(MOE_ENOMEM, "prepare: out of memory");
        goto fail;
    }
    // Pass 2: documents -> tokens -> shards.
    const size_t part_max = o->part_bytes ? o->part_bytes : MOE_PREPARE_PART_BYTES;
    moe_prepare_progress pr = {0, total, 0, in->n};
    for (int i = 0; i < in->n; i++) {
        text_map m;
        MOE_TRY_GOTO(map_text(in->path[i], &m), rc);
        fs[i].bytes = m.len;
        for (size_t at = 0; at < m.len && rc == 0;) {
            size_t n = doc_len(m.data + at, m.len - at, o->doc);
            int s = doc_split(m.data + at, n, o->seed, o->val_fraction);
            long doc_tokens = 0;
            // The stop flag between parts, not only documents: one document
            // may be the whole input.
            for (size_t off = 0, len; off < n && rc == 0 && (rc = stopped(o)) == 0; off += len) {
                len = part_len(m.data + at + off, n - off, part_max);
                toks.n = 0;
                if ((rc = tk->encode(tk->ctx, m.data + at + off, len, off == 0, &toks)) < 0) break;
                for (size_t k = 0; k < toks.n && rc == 0; k++) {
                    if (toks.tok[k] >= (uint32_t)tk->vocab_size)
                        rc = moe_fail(MOE_EINVAL,
                                      "%s: tokenizer %s gave token %u >= its vocabulary %d",
                                      in->path[i], tk->name, toks.tok[k], tk->vocab_size);
                    r->unk_tokens += tk->has_unk && toks.tok[k] == (uint32_t)tk->unk_id;
                }
                if (rc == 0) rc = shard_write(&w[s], toks.tok, toks.n);
                doc_tokens += (long)toks.n;
            }
            if (rc < 0) break;
            fs[i].docs[s]++, fs[i].tokens[s] += doc_tokens;
            r->documents[s]++, r->tokens[s] += doc_tokens, r->split_bytes[s] += n;
            // progress about every MiB inside large files
            if (o->progress && (at >> 20) != ((at + n) >> 20)) {
                pr.bytes_done += n;
                o->progress(o->progress_ctx, &pr);
                pr.bytes_done -= n;
            }
            at += n;
        }
        unmap_text(&m);
        if (rc < 0) goto fail;
        pr.bytes_done += fs[i].bytes, pr.files_done++;
        if (o->progress) o->progress(o->progress_ctx, &pr);
    }
    for (int s = 0; s < 2; s++)
        MOE_TRY_GOTO(shard_close(&w[s]), rc);
    if (o->val_fraction > 0 && r->documents[MOE_SPLIT_VAL] == 0) {
        // What helps: smaller documents while there are any, else more of them,
        // a larger fraction or another seed (the split is a hash of both).
        static const char *const smaller[] = {"--doc paragraph or line, ", "--doc line, ", ""};
        rc = moe_fail(MOE_EINVAL,
                      "no document went to validation (%ld documents, --doc %s, --val-fraction "
                      "%g): use %smore text, a larger --val-fraction, another --seed, or "
                      "--val-fraction 0 (no validation shards)",
                      r->documents[0], doc_names[o->doc], o->val_fraction, smaller[o->doc]);
        goto fail;
    }
    if (r->tokens[MOE_SPLIT_TRAIN] == 0) {
        rc = moe_fail(MOE_EINVAL, "no training tokens: every document went to validation");
        goto fail;
    }
    r->files = in->n;
    r->skipped = inl.skipped;
    snprintf(r->skip, sizeof r->skip, "%s", inl.skip);
    r->bytes = total;
    r->shards[0] = w[0].done.n, r->shards[1] = w[1].done.n;
    snprintf(manifest, sizeof manifest, "%s/manifest.json", o->out_dir);
    rc = write_manifest(o, in, fs, r, w, &manifest_tmp);
    if (rc == 0) rc = stopped(o); // the last moment a stop still leaves nothing behind
    // Every shard into place, then the manifest (what marks DIR as complete).
    // An existing NAME is another run's: the rename fails rather than replace it.
    for (int s = 0; s < 2 && rc == 0; s++)
        for (; w[s].renamed < w[s].done.n && rc == 0;) {
            const char *fin = w[s].done.path[w[s].renamed];
            tmp_name(p, sizeof p, fin);
            if ((rc = put_in_place(p, fin)) == 0) w[s].renamed++;
        }
    tmp_name(p, sizeof p, manifest);
    if (rc == 0) rc = put_in_place(p, manifest);
fail:
    // Only what this run created goes: a name it did not create or rename into
    // place belongs to another prepare.
    for (int s = 0; s < 2; s++) {
        if (w[s].f) fclose(w[s].f);
        for (int i = 0; rc < 0 && i < w[s].created; i++) {
            tmp_name(p, sizeof p, w[s].done.path[i]);
            unlink(i < w[s].renamed ? w[s].done.path[i] : p);
        }
        list_free(&w[s].done);
    }
    if (rc < 0 && manifest_tmp) {
        tmp_name(p, sizeof p, manifest);
        unlink(p);
    }
    if (rc < 0 && made_out) // the folder goes too when prepare created it and it is empty now
        rmdir(o->out_dir);
    moe_tokens_free(&toks);
    free(fs);
    input_free(&inl);
    return rc;
}
