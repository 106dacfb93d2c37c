// The checkpoint resolver: which folder of DIR, DIR.tmp, DIR.old a reader
// opens and which tensor layout it holds (protocol in moe/checkpoint.h). Every
// reader goes through it, so eval, generate, export and resume never disagree.
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/json_error.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

int moe_ckpt_complete(const char *folder) {
    char p[4096];
    if (snprintf(p, sizeof p, "%s/manifest.json", folder) >= (int)sizeof p) return 0;
    struct stat st;
    // A regular, small file only: json_load_file on a FIFO would block forever.
    if (lstat(p, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (1 << 20)) return 0;
    json_t *doc = json_load_file(p, JSON_REJECT_DUPLICATES, NULL);
    json_t *files = json_object_get(doc, "files");
    int ok = json_is_object(files) && json_object_size(files) > 0;
    const char *name;
    json_t *v;
    json_object_foreach(files, name, v) {
        if (!ok) break;
        ok = json_is_integer(v) && json_integer_value(v) >= 0 && !strchr(name, '/') &&
             strcmp(name, ".") && strcmp(name, "..") &&
             snprintf(p, sizeof p, "%s/%s", folder, name) < (int)sizeof p && lstat(p, &st) == 0 &&
             S_ISREG(st.st_mode) && (json_int_t)st.st_size == json_integer_value(v);
    }
    json_decref(doc);
    return ok;
}

int moe_ckpt_check_sizes(const char *folder) {
    char p[4096], f[4096];
    struct stat st;
    if (snprintf(p, sizeof p, "%s/manifest.json", folder) >= (int)sizeof p)
        return moe_fail(MOE_EINVAL, "%s: path too long", folder);
    if (lstat(p, &st) != 0) return 0;
    if (!S_ISREG(st.st_mode) || st.st_size > (1 << 20))
        return moe_fail(MOE_EFORMAT, "%s: not a regular file of at most 1 MiB", p);
    json_error_t jerr;
    json_t *doc = json_load_file(p, JSON_REJECT_DUPLICATES, &jerr);
    if (!doc) return moe_json_fail(MOE_EFORMAT, p, &jerr);
    json_t *files = json_object_get(doc, "files"), *v;
    int rc = 0;
    const char *name;
    if (!json_is_object(files))
        rc = moe_fail(MOE_EFORMAT, "%s: needs 'files', an object of file names and sizes", p);
    json_object_foreach(files, name, v) {
        if (rc) break;
        if (!json_is_integer(v) || json_integer_value(v) < 0 || strchr(name, '/') ||
            !strcmp(name, ".") || !strcmp(name, "..") || !name[0])
            rc = moe_fail(MOE_EFORMAT, "%s: entry '%s' must be a file name with a size in bytes", p,
                          name);
        else if (snprintf(f, sizeof f, "%s/%s", folder, name) >= (int)sizeof f)
            rc = moe_fail(MOE_EINVAL, "%s/%s: path too long", folder, name);
        else if (lstat(f, &st) != 0)
            rc = moe_fail(MOE_EFORMAT, "%s: missing, but %s lists it", f, p);
        else if (!S_ISREG(st.st_mode))
            rc = moe_fail(MOE_EFORMAT, "%s: not a regular file, but %s lists it", f, p);
        else if ((json_int_t)st.st_size != json_integer_value(v))
            rc = moe_fail(MOE_EFORMAT,
                          "%s: is %lld bytes, but %s lists %lld (the file changed after the save)",
                          f, (long long)st.st_size, p, (long long)json_integer_value(v));
    }
    json_decref(doc);
    return rc;
}

int moe_ckpt_step_name(const char *name, long *step, int *suffix) {
    if (strncmp(name, "checkpoint-", 11) != 0) return 0;
    const char *p = name + 11;
    if (*p < '0' || *p > '9') return 0;
    char *end;
    errno = 0;
    long s = strtol(p, &end, 10);
    if (errno || s < 0) return 0;
    static const char *const sfxs[] = {"", ".tmp", ".old", ".trash"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(end, sfxs[i])) {
            *step = s, *suffix = i;
            return 1;
        }
    return 0;
}

// A run folder given where a checkpoint is expected: writes into out the
// checkpoint it means (the one `latest` names, else the highest-numbered
// checkpoint-STEP, else checkpoint) and returns 1; 0 when dir is no run
// folder (a checkpoint folder, or nothing); < 0 on a bad `latest`.
static int run_target(const char *dir, char *out, size_t cap) {
    char p[4096];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    if (exists(p)) return 0;
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    if (exists(p)) return 0;
    struct stat st;
    if (snprintf(p, sizeof p, "%s/latest", dir) < (int)sizeof p && lstat(p, &st) == 0) {
        char line[80] = "";
        FILE *f = S_ISREG(st.st_mode) && st.st_size < (off_t)sizeof line ? fopen(p, "r") : NULL;
        size_t n = f ? fread(line, 1, sizeof line - 1, f) : 0;
        if (f) fclose(f);
        line[n] = 0;
        if (n && line[n - 1] == '\n') line[--n] = 0;
        long s;
        int sfx;
        if (!moe_ckpt_step_name(line, &s, &sfx) || sfx != MOE_CKPT_NAME_PLAIN)
            return moe_fail(MOE_EFORMAT,
                            "%s: %sexpected one line naming the newest checkpoint "
                            "(checkpoint-STEP)",
                            p, S_ISREG(st.st_mode) ? "" : "not a regular file (a link?): ");
        if (snprintf(out, cap, "%s/%s", dir, line) >= (int)cap)
            return moe_fail(MOE_EINVAL, "%s: path too long", dir);
        return 1;
    }
    long best = -1;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        long s;
        int sfx;
        if (moe_ckpt_step_name(e->d_name, &s, &sfx) && sfx != MOE_CKPT_NAME_TRASH && s > best)
            best = s;
    }
    if (d) closedir(d);
    if (best >= 0) {
        if (snprintf(out, cap, "%s/checkpoint-%ld", dir, best) >= (int)cap)
            return moe_fail(MOE_EINVAL, "%s: path too long", dir);
        return 1;
    }
    static const char *const plain[] = {"checkpoint", "checkpoint.tmp", "checkpoint.old"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, plain[i]);
        if (!is_dir(p)) continue;
        if (snprintf(out, cap, "%s/checkpoint", dir) >= (int)cap)
            return moe_fail(MOE_EINVAL, "%s: path too long", dir);
        return 1;
    }
    return 0;
}

int moe_ckpt_resolve(const char *dir_in, char *out, size_t out_size, moe_ckpt_layout *layout) {
    char dir[4096], tmp[4096], old[4096], single[4096], index[4096];
    if (snprintf(dir, sizeof dir, "%s", dir_in) >= (int)sizeof dir)
        return moe_fail(MOE_EINVAL, "%s: path too long", dir_in);
    size_t n = strlen(dir); // "run/checkpoint/" names the same folder: its .old is beside it
    while (n > 1 && dir[n - 1] == '/')
        dir[--n] = 0;
    if (is_dir(dir)) { // a run folder: the checkpoint it names
        char target[4096];
        int r = run_target(dir, target, sizeof target);
        if (r < 0) return r;
        if (r > 0) snprintf(dir, sizeof dir, "%s", target);
        n = strlen(dir);
    }
    if (snprintf(tmp, sizeof tmp, "%s.tmp", dir) >= (int)sizeof tmp ||
        snprintf(old, sizeof old, "%s.old", dir) >= (int)sizeof old)
        return moe_fail(MOE_EINVAL, "%s: path too long", dir);
    const char *pick = NULL;
    if (exists(dir)) {
        if (!is_dir(dir)) return moe_fail(MOE_ENOTFOUND, "%s: not a checkpoint folder", dir);
        pick = dir;
    } else if (is_dir(tmp) && moe_ckpt_complete(tmp)) {
        pick = tmp; // newer than dir.old: the swap stopped between its renames
    } else if (is_dir(old)) {
        pick = old;
    } else {
        struct stat st; // a link loop or a folder it may not read is not a missing one
        if (stat(dir, &st) != 0 && (errno == ELOOP || errno == EACCES))
            return moe_fail(MOE_ENOTFOUND, "%s: no checkpoint here: %s", dir, strerror(errno));
        return moe_fail(MOE_ENOTFOUND, "%s: no checkpoint here (no such folder, nor %s.old%s)", dir,
                        dir, is_dir(tmp) ? "; its .tmp is incomplete: a save was cut off" : "");
    }
    if (snprintf(out, out_size, "%s", pick) >= (int)out_size ||
        snprintf(single, sizeof single, "%s/model.safetensors", pick) >= (int)sizeof single ||
        snprintf(index, sizeof index, "%s/model.safetensors.index.json", pick) >= (int)sizeof index)
        return moe_fail(MOE_EINVAL, "%s: path too long", pick);
    int has_single = exists(single), has_index = exists(index);
    if (has_single && has_index)
        return moe_fail(MOE_EFORMAT,
                        "%s: holds both model.safetensors and model.safetensors.index.json; a "
                        "checkpoint has one tensor layout: remove the stale one",
                        pick);
    if (!has_single && !has_index)
        return moe_fail(MOE_ENOTFOUND,
                        "%s: no checkpoint here (a checkpoint holds config.json and "
                        "model.safetensors or model.safetensors.index.json)",
                        pick);
    if (layout) *layout = has_index ? MOE_CKPT_SHARDED : MOE_CKPT_SINGLE;
    return 0;
}
