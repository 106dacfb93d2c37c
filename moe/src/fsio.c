// Counted file-system calls and the fault hook behind them (moe/fsio.h). A
// checkpoint save that goes through these wrappers can be cut at any of its
// calls, which is how tests/test_ckpt_faults.c proves the save protocol.
#define _GNU_SOURCE // renameat2
#include "moe/fsio.h"
#include "moe/error.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static long op_count, fault_at;
static moe_fault_mode fault_mode;
static int env_read;
static const char *fault_op = "";

void moe_fs_fault_arm(long n, moe_fault_mode mode) {
    env_read = 1; // an explicit arm overrides MOE_FAULT
    op_count = 0;
    fault_at = n > 0 ? n : 0;
    fault_mode = n > 0 ? mode : MOE_FAULT_OFF;
}

long moe_fs_op_count(void) {
    return op_count;
}

const char *moe_fs_fault_op(void) {
    return fault_op;
}

static void read_env(void) {
    env_read = 1;
    const char *s = getenv("MOE_FAULT");
    if (!s || !*s) return;
    char *end, mode[8];
    long n = strtol(s, &end, 10);
    if (n <= 0 || *end != ':') return;
    const char *colon = strchr(end + 1, ':'); // "N:abort:RANK": that MPI rank only
    size_t len = colon ? (size_t)(colon - end - 1) : strlen(end + 1);
    if (len >= sizeof mode) return;
    memcpy(mode, end + 1, len);
    mode[len] = 0;
    if (colon) {
        // The launcher's variable: fsio sits below the communicator and must not need it.
        const char *me = getenv("OMPI_COMM_WORLD_RANK");
        if (!me) me = getenv("PMI_RANK");
        if (!me || strcmp(me, colon + 1)) return;
    }
    if (!strcmp(mode, "fail"))
        fault_at = n, fault_mode = MOE_FAULT_FAIL;
    else if (!strcmp(mode, "abort"))
        fault_at = n, fault_mode = MOE_FAULT_ABORT;
}

// Counts one call; nonzero when this call must fail (errno set to EIO).
static int fault(const char *kind) {
    if (!env_read) read_env();
    if (++op_count != fault_at || fault_mode == MOE_FAULT_OFF) return 0;
    fault_op = kind;
    if (fault_mode == MOE_FAULT_ABORT) abort();
    errno = EIO;
    return 1;
}

int moe_fs_create(const char *path) {
    if (fault("create")) return -1;
    return open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
}

int moe_fs_create_excl(const char *path) {
    if (fault("create")) return -1;
    return open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
}

int moe_fs_mkstemp(char *tmpl) {
    if (fault("create")) return -1;
    return mkstemp(tmpl);
}

int moe_fs_write(int fd, const void *buf, size_t len) {
    if (fault("write")) return -1;
    const char *p = buf;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -1;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

int moe_fs_fsync(int fd) {
    if (fault("fsync")) return -1;
    return fsync(fd);
}

int moe_fs_rename(const char *from, const char *to) {
    if (fault("rename")) return -1;
    return rename(from, to);
}

int moe_fs_rename_noreplace(const char *from, const char *to) {
    if (fault("rename")) return -1;
    if (renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE) == 0) return 0;
    if (errno != EINVAL && errno != ENOSYS) return -1;
    // A filesystem without RENAME_NOREPLACE: a hard link fails on an existing
    // name as well; only where links are missing too is the check racy.
    if (link(from, to) == 0) {
        unlink(from);
        return 0;
    }
    if (errno == EEXIST) return -1;
    struct stat st;
    if (lstat(to, &st) == 0) {
        errno = EEXIST;
        return -1;
    }
    return rename(from, to);
}

int moe_fs_unlink(const char *path) {
    if (fault("unlink")) return -1;
    return unlink(path);
}

int moe_fs_mkdir(const char *path, mode_t mode) {
    if (fault("mkdir")) return -1;
    return mkdir(path, mode);
}

int moe_fs_rmdir(const char *path) {
    if (fault("rmdir")) return -1;
    return rmdir(path);
}

int moe_fs_fsync_dir(const char *dir) {
    if (fault("fsync")) return -1;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    if (rc != 0 && errno == EINVAL) rc = 0;
    int err = errno;
    close(fd);
    errno = err;
    return rc;
}

int moe_fs_write_file(const char *path, const void *buf, size_t len) {
    int fd = moe_fs_create(path);
    if (fd < 0) return moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
    const char *step = "write";
    if (moe_fs_write(fd, buf, len) != 0) goto fail;
    step = "fsync";
    if (moe_fs_fsync(fd) != 0) goto fail;
    step = "close";
    int cfd = fd;
    fd = -1;
    if (close(cfd) != 0) goto fail;
    return 0;
fail:;
    int err = errno;
    if (fd >= 0) close(fd);
    unlink(path); // not counted: the failure being handled is the one injected
    return moe_fail(MOE_EIO, "%s: %s failed: %s", path, step, strerror(err));
}

int moe_fs_replace_file(const char *path, const void *buf, size_t len) {
    size_t plen = strlen(path);
    if (plen + sizeof ".tmp.XXXXXX" > PATH_MAX)
        return moe_fail(MOE_EINVAL, "%s: path too long", path);
    char tmp[PATH_MAX];
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp.XXXXXX", sizeof ".tmp.XXXXXX");
    int fd = moe_fs_mkstemp(tmp);
    if (fd < 0)
        return moe_fail(MOE_EIO, "%s: cannot create a temp file beside it: %s", path,
                        strerror(errno));
    const char *step = "write";
    if (moe_fs_write(fd, buf, len) != 0) goto fail;
    step = "chmod"; // mkstemp makes 0600; the file replaced was an ordinary 0644 one
    if (fchmod(fd, 0644) != 0) goto fail;
    step = "fsync";
    if (moe_fs_fsync(fd) != 0) goto fail;
    step = "close";
    int cfd = fd;
    fd = -1;
    if (close(cfd) != 0) goto fail;
    step = "rename";
    if (moe_fs_rename(tmp, path) != 0) goto fail;
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else
        snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    moe_fs_fsync_dir(dir);
    return 0;
fail:;
    int err = errno;
    if (fd >= 0) close(fd);
    unlink(tmp); // not counted: the failure being handled is the one injected
    return moe_fail(MOE_EIO, "%s: %s failed: %s", path, step, strerror(err));
}

int moe_fs_write_json(const char *path, const json_t *doc, size_t flags) {
    char *text = json_dumps(doc, flags);
    if (!text) return moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    size_t n = strlen(text);
    char *line = realloc(text, n + 2);
    if (!line) {
        free(text);
        return moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    }
    line[n] = '\n';
    int rc = moe_fs_write_file(path, line, n + 1);
    free(line);
    return rc;
}

// depth bounds the recursion: checkpoint folders are flat, so anything deeper
// than a few levels was not made by us and is refused rather than walked.
static int remove_tree(const char *dir, int depth) {
    struct stat st;
    if (lstat(dir, &st) != 0)
        return errno == ENOENT ? 0 : moe_fail(MOE_EIO, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) // a file or a link where a folder was expected: never followed
        return moe_fs_unlink(dir) == 0 || errno == ENOENT
                   ? 0
                   : moe_fail(MOE_EIO, "%s: cannot remove: %s", dir, strerror(errno));
    if (depth > 8) return moe_fail(MOE_EIO, "%s: folders nested too deep to remove", dir);
    DIR *d = opendir(dir);
    if (!d) return moe_fail(MOE_EIO, "%s: cannot list: %s", dir, strerror(errno));
    int rc = 0;
    struct dirent *e;
    char p[PATH_MAX];
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) >= (int)sizeof p) {
            rc = moe_fail(MOE_EIO, "%s/%s: path too long", dir, e->d_name);
            break;
        }
        rc = remove_tree(p, depth + 1);
    }
    closedir(d);
    if (rc == 0 && moe_fs_rmdir(dir) != 0 && errno != ENOENT)
        rc = moe_fail(MOE_EIO, "%s: cannot remove: %s", dir, strerror(errno));
    return rc;
}

int moe_fs_remove_tree(const char *dir) {
    return remove_tree(dir, 0);
}
