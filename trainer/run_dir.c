// Run folders: step-numbered checkpoints with a `latest` pointer and their
// rotation (train.keep_checkpoints), the "does this folder hold a run" test
// behind `moe train`'s refusal, and --overwrite's removal. The order of the
// calls, and why a crash anywhere leaves `latest` naming a complete
// checkpoint, is written down in moe/checkpoint.h.
#include "checkpoint_internal.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

enum { SFX_NONE = MOE_CKPT_NAME_PLAIN, SFX_TMP, SFX_OLD, SFX_TRASH };

static int parse_name(const char *name, long *step, int *sfx) {
    return moe_ckpt_step_name(name, step, sfx);
}

static int is_dir(const char *p) {
    struct stat st;
    return lstat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

// Removes p by renaming it to p's trash name first (folder NAME -> NAME.trash);
// with later, the trash folder is left for later's owner to remove. A
// leftover trash folder (a crash's) is removed now.
static int discard(const char *run, const char *name, int sfx, moe_ckpt_trash *later) {
    char p[PATH_MAX], trash[PATH_MAX];
    if (snprintf(p, sizeof p, "%s/%s", run, name) >= (int)sizeof p) return 0;
    if (sfx == SFX_TRASH) return moe_fs_remove_tree(p);
    size_t base = strlen(name) - (sfx == SFX_NONE ? 0 : 4); // ".tmp", ".old" cut
    if (snprintf(trash, sizeof trash, "%s/%.*s.trash", run, (int)base, name) >= (int)sizeof trash)
        return 0;
    MOE_TRY(moe_fs_remove_tree(trash));
    if (moe_fs_rename(p, trash) != 0)
        return moe_fail(MOE_EIO, "%s: cannot rename to %s: %s", p, trash, strerror(errno));
    if (later && moe_ckpt_trash_add(later, trash) == 0) return 0;
    return moe_fs_remove_tree(trash);
}

int moe_ckpt_trash_add(moe_ckpt_trash *t, const char *p) {
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 4;
        void *g = realloc(t->path, sizeof *t->path * (size_t)cap);
        if (!g) return moe_fail(MOE_ENOMEM, "%s: out of memory", p);
        t->path = g;
        t->cap = cap;
    }
    snprintf(t->path[t->n++], sizeof t->path[0], "%s", p);
    return 0;
}

int moe_ckpt_trash_empty(moe_ckpt_trash *t) {
    int rc = 0;
    for (int i = 0; i < t->n; i++) {
        int r = moe_fs_remove_tree(t->path[i]);
        if (rc == 0) rc = r;
    }
    t->n = 0;
    return rc;
}

void moe_ckpt_trash_free(moe_ckpt_trash *t) {
    free(t->path);
    *t = (moe_ckpt_trash){0};
}

static int cmp_desc(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

// Step 3 of the rotation: keeps `current` and the keep-1 newest complete
// checkpoint-S folders below it; everything else of the checkpoint-* family goes.
static int prune(const char *run, int keep, long current, moe_ckpt_trash *later) {
    DIR *d = opendir(run);
    if (!d && errno == ENOENT) return 0; // no run folder yet: nothing to prune
    if (!d) return moe_fail(MOE_EIO, "%s: cannot list: %s", run, strerror(errno));
    long *steps = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    char p[PATH_MAX];
    while ((e = readdir(d)) != NULL) {
        long s;
        int sfx;
        if (!parse_name(e->d_name, &s, &sfx) || sfx != SFX_NONE || s >= current) continue;
        if (snprintf(p, sizeof p, "%s/%s", run, e->d_name) >= (int)sizeof p || !is_dir(p)) continue;
        if (n == cap) {
            long *g = realloc(steps, sizeof *steps * (cap = cap ? 2 * cap : 16));
            if (!g) {
                closedir(d);
                free(steps);
                return moe_fail(MOE_ENOMEM, "%s: out of memory", run);
            }
            steps = g;
        }
        steps[n++] = s;
    }
    if (n) qsort(steps, n, sizeof *steps, cmp_desc); // (qsort(NULL, 0) is undefined)
    size_t k = keep > 1 ? (size_t)keep - 1 : 0;      // kept besides current
    if (k > n) k = n;
    const long oldest_kept = k ? steps[k - 1] : current;
    free(steps);
    // A second pass removes; names are collected first, as removing while
    // reading a directory may skip entries.
    rewinddir(d);
    char(*names)[256] = NULL;
    size_t nn = 0, ncap = 0;
    while ((e = readdir(d)) != NULL) {
        long s;
        int sfx;
        if (!parse_name(e->d_name, &s, &sfx)) continue;
        // kept: the folder itself of a kept step; leftovers go whatever the step
        if (sfx == SFX_NONE && (s == current || (s < current && s >= oldest_kept))) continue;
        if (sfx != SFX_NONE && s == current) continue; // the save of current cleans its own
        if (nn == ncap) {
            void *g = realloc(names, sizeof *names * (ncap = ncap ? 2 * ncap : 16));
            if (!g) {
                closedir(d);
                free(names);
                return moe_fail(MOE_ENOMEM, "%s: out of memory", run);
            }
            names = g;
        }
        snprintf(names[nn++], sizeof names[0], "%s", e->d_name);
    }
    closedir(d);
    int rc = 0;
    // .trash first, so a rename to NAME.trash never finds one in the way
    for (int pass = 0; pass < 2 && rc == 0; pass++)
        for (size_t i = 0; i < nn && rc == 0; i++) {
            long s;
            int sfx;
            parse_name(names[i], &s, &sfx);
            if ((sfx == SFX_TRASH) == (pass == 0)) rc = discard(run, names[i], sfx, later);
        }
    free(names);
    if (rc == 0 && nn && moe_fs_fsync_dir(run) != 0)
        rc = moe_fail(MOE_EIO, "%s: fsync failed: %s", run, strerror(errno));
    return rc;
}

int moe_ckpt_run_folder(const char *run, int keep, long step, char *saved, size_t cap) {
    int n = keep > 0 ? snprintf(saved, cap, "%s/checkpoint-%ld", run, step)
                     : snprintf(saved, cap, "%s/checkpoint", run);
    if (n < 0 || (size_t)n >= cap) return moe_fail(MOE_EINVAL, "%s: path too long", run);
    return 0;
}

int moe_run_path_check(const char *run, int keep, long steps) {
    char ck[PATH_MAX], name[40] = "checkpoint"; // the longest of its checkpoint folders
    if (keep > 0) snprintf(name, sizeof name, "checkpoint-%ld", steps);
    int rc = snprintf(ck, sizeof ck, "%s/%s", run, name) < (int)sizeof ck ? 0 : MOE_EINVAL;
    if (rc == 0) rc = moe_ckpt_path_check(ck);
    if (rc < 0)
        return moe_fail(MOE_EINVAL,
                        "%s: path too long for a run folder: the files of its checkpoints "
                        "(%s.tmp/...) would pass %d characters, the longest path; choose a "
                        "shorter folder",
                        run, name, PATH_MAX - 1);
    return 0;
}

int moe_ckpt_save_run(const char *run, int keep, const moe_model *m, const moe_adamw *opt,
                      const moe_train_state *st, moe_parallel *par, char *saved, size_t cap) {
    MOE_TRY(moe_ckpt_run_folder(run, keep, st->step, saved, cap));
    MOE_TRY(moe_ckpt_save(saved, m, opt, st, par));
    if (par && par->rank != 0) return 0;
    return moe_ckpt_run_finish(run, keep, st->step, NULL);
}

int moe_ckpt_run_finish(const char *run, int keep, long step, moe_ckpt_trash *later) {
    char tmp[PATH_MAX], latest[PATH_MAX], line[64];
    if (snprintf(tmp, sizeof tmp, "%s/latest.tmp", run) >= (int)sizeof tmp ||
        snprintf(latest, sizeof latest, "%s/latest", run) >= (int)sizeof latest)
        return moe_fail(MOE_EINVAL, "%s: path too long", run);
    if (keep <= 0) {
        // One checkpoint/ folder. Step-numbered ones of an earlier setting of
        // this run are older: `latest` goes first (readers then fall back to
        // checkpoint/ once they are gone too), then they do.
        struct stat sb;
        if (lstat(latest, &sb) == 0 && (moe_fs_unlink(latest) != 0 || moe_fs_fsync_dir(run) != 0))
            return moe_fail(MOE_EIO, "%s: cannot remove: %s", latest, strerror(errno));
        if (prune(run, 0, LONG_MAX, later) < 0)
            moe_log(MOE_LOG_WARN, "checkpoint saved, but removing older ones failed: %s",
                    moe_last_error());
        return 0;
    }
    int len = snprintf(line, sizeof line, "checkpoint-%ld\n", step);
    MOE_TRY(moe_fs_write_file(tmp, line, (size_t)len));
    if (moe_fs_rename(tmp, latest) != 0)
        return moe_fail(MOE_EIO, "%s: cannot rename to %s: %s", tmp, latest, strerror(errno));
    if (moe_fs_fsync_dir(run) != 0)
        return moe_fail(MOE_EIO, "%s: fsync failed: %s", run, strerror(errno));
    // `latest` names the new checkpoint: a failure from here on loses nothing,
    // and the next save's pruning finishes the job.
    if (prune(run, keep, step, later) < 0)
        moe_log(MOE_LOG_WARN, "checkpoint saved, but removing older ones failed: %s",
                moe_last_error());
    return 0;
}

int moe_run_exists(const char *run) {
    static const char *const names[] = {"metrics.jsonl",  "checkpoint", "checkpoint.tmp",
                                        "checkpoint.old", "latest",     NULL};
    char p[PATH_MAX];
    struct stat st;
    // An empty metrics.jsonl alone is a run that failed before its first
    // step: nothing to resume or lose, so a new run may take the folder.
    for (int i = 0; names[i]; i++)
        if (snprintf(p, sizeof p, "%s/%s", run, names[i]) < (int)sizeof p && lstat(p, &st) == 0 &&
            (i > 0 || !S_ISREG(st.st_mode) || st.st_size > 0))
            return 1;
    DIR *d = opendir(run);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while (!found && (e = readdir(d)) != NULL) {
        long s;
        int sfx;
        found = parse_name(e->d_name, &s, &sfx);
    }
    closedir(d);
    return found;
}

int moe_run_foreign_config(const char *run) {
    static const char *const marks[] = {"metrics.jsonl", "latest", NULL};
    char p[PATH_MAX];
    struct stat st;
    if (snprintf(p, sizeof p, "%s/config.json", run) >= (int)sizeof p || lstat(p, &st) != 0)
        return 0;
    // a run that failed before its first step has config.json and an empty
    // metrics.jsonl: moe train's own, which a new run may replace
    for (int i = 0; marks[i]; i++)
        if (snprintf(p, sizeof p, "%s/%s", run, marks[i]) < (int)sizeof p && lstat(p, &st) == 0)
            return 0;
    return !moe_run_exists(run);
}

int moe_run_lock(const char *run, moe_run_lock_t *lk) {
    lk->fd = -1;
    lk->created[0] = 0;
    if (snprintf(lk->run, sizeof lk->run, "%s", run) >= (int)sizeof lk->run)
        return moe_fail(MOE_EINVAL, "%.200s...: path longer than %d characters", run,
                        (int)sizeof lk->run - 1);
    // the topmost missing folder of RUN's path, removed again by an unlock
    // after a refusal
    char p[sizeof lk->run];
    snprintf(p, sizeof p, "%s", run);
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s) continue;
        const char c = *s;
        *s = 0;
        struct stat st;
        if (lstat(p, &st) != 0 && errno == ENOENT) {
            snprintf(lk->created, sizeof lk->created, "%s", p);
            break;
        }
        if (!(*s = c)) break;
    }
    MOE_TRY(moe_make_dirs(run));
    lk->fd = open(run, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (lk->fd < 0)
        return moe_fail(errno == ENOTDIR ? MOE_EINVAL : MOE_EIO, "%s: cannot open: %s", run,
                        strerror(errno));
    if (flock(lk->fd, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        close(lk->fd);
        lk->fd = -1;
        lk->created[0] = 0; // not ours to remove
        if (err == EWOULDBLOCK)
            return moe_fail(MOE_EINVAL,
                            "%s: another moe train or moe ablate is writing this folder (it holds the "
                            "folder's lock); wait for it to end, or give another --out",
                            run);
        return moe_fail(MOE_EIO, "%s: cannot lock: %s", run, strerror(err));
    }
    return 0;
}

void moe_run_unlock(moe_run_lock_t *lk, bool remove_created) {
    if (lk->fd < 0) return;
    // Empty folders first, while the lock still keeps a second run out; rmdir
    // removes nothing a run wrote.
    if (remove_created && lk->created[0]) {
        char p[sizeof lk->run];
        snprintf(p, sizeof p, "%s", lk->run);
        for (;;) {
            if (rmdir(p) != 0 || !strcmp(p, lk->created)) break;
            char *slash = strrchr(p, '/');
            if (!slash || slash == p) break;
            *slash = 0;
        }
    }
    close(lk->fd);
    lk->fd = -1;
}

int moe_run_clear(const char *run) {
    if (moe_run_foreign_config(run))
        return moe_fail(MOE_EINVAL,
                        "%s/config.json: not written by moe train (the folder holds no "
                        "metrics.jsonl or checkpoint); --overwrite removes only a run's files",
                        run);
    static const char *const names[] = {"metrics.jsonl",  "config.json",      "latest",
                                        "latest.tmp",     "checkpoint.trash", "checkpoint",
                                        "checkpoint.tmp", "checkpoint.old",   NULL};
    enum { N_FILES = 4 }; // the names before it are files, the others folders
    char p[PATH_MAX];
    // A folder where a run writes a file (or a file where it writes a folder)
    // is not a run's: it could hold anything, and is never removed. All are
    // checked before any is removed.
    for (int i = 0; names[i]; i++) {
        struct stat sb;
        if (snprintf(p, sizeof p, "%s/%s", run, names[i]) >= (int)sizeof p)
            return moe_fail(MOE_EINVAL, "%s: path too long", run);
        if (lstat(p, &sb) == 0 && (i < N_FILES ? S_ISDIR(sb.st_mode) : S_ISREG(sb.st_mode)))
            return moe_fail(MOE_EINVAL,
                            "%s: a %s where moe train writes a %s, so no run's; --overwrite "
                            "removes only a run's files: move it away or choose another --out",
                            p, i < N_FILES ? "folder" : "file", i < N_FILES ? "file" : "folder");
    }
    for (int i = 0; names[i]; i++) {
        snprintf(p, sizeof p, "%s/%s", run, names[i]);
        MOE_TRY(moe_fs_remove_tree(p));
    }
    // the TensorBoard event files of train.tensorboard (trainer/tensorboard.c
    // names them): left, TensorBoard would draw the old run with the new
    DIR *d = opendir(run);
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && d && (e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, "events.out.tfevents.", 20) && strstr(e->d_name, ".moe.") &&
            snprintf(p, sizeof p, "%s/%s", run, e->d_name) < (int)sizeof p && unlink(p) != 0 &&
            errno != ENOENT)
            rc = moe_fail(MOE_EIO, "%s: cannot remove: %s", p, strerror(errno));
    if (d) closedir(d);
    MOE_TRY(rc);
    return prune(run, 0, LONG_MAX, NULL); // every checkpoint-STEP and its leftovers
}
