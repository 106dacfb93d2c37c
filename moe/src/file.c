// Regular-file checks for every reader (moe/file.h). open(2) on a FIFO blocks
// until a writer appears, so a check after a plain fopen comes too late: the
// file is opened with O_NONBLOCK, its type taken with fstat on that same
// descriptor (no window for a swap), and only then used.
#include "moe/file.h"
#include "moe/error.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int moe_input_errno_code(int err) {
    switch (err) {
    case ENOENT:
    case ENOTDIR:
        return MOE_ENOTFOUND;
    case EACCES:
    case EPERM:
    case ELOOP:
    case ENAMETOOLONG:
        return MOE_EINVAL;
    default:
        return MOE_EIO;
    }
}

int moe_open_regular(const char *path, int *fd) {
    *fd = -1;
    int d = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (d < 0)
        return moe_fail(moe_input_errno_code(errno), "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(d, &sb) != 0) {
        int err = errno;
        close(d);
        return moe_fail(MOE_EIO, "%s: cannot stat: %s", path, strerror(err));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(d);
        return moe_fail(MOE_EFORMAT, "%s: not a regular file", path);
    }
    int fl = fcntl(d, F_GETFL); // reads of a regular file ignore it, but say what we mean
    if (fl >= 0) fcntl(d, F_SETFL, fl & ~O_NONBLOCK);
    *fd = d;
    return 0;
}

int moe_fopen_regular(const char *path, FILE **f) {
    *f = NULL;
    int fd;
    MOE_TRY(moe_open_regular(path, &fd));
    if (!(*f = fdopen(fd, "rb"))) {
        int err = errno;
        close(fd);
        return moe_fail(MOE_EIO, "%s: cannot open: %s", path, strerror(err));
    }
    return 0;
}

int moe_check_regular_file(const char *path) {
    int fd;
    MOE_TRY(moe_open_regular(path, &fd));
    close(fd);
    return 0;
}

// The live mappings, for the SIGBUS handler to name the file a fault lies
// in. Nodes are linked in complete and unlinked before munmap, by the thread
// that maps and unmaps; a fault is raised in the thread that reads, which the
// handler then runs on.
typedef struct map_node {
    struct map_node *next;
    const char *start;
    size_t len;
    char path[];
} map_node;
static map_node *volatile live_maps;

int moe_map_regular(const char *path, const void **data, size_t *len) {
    *data = NULL, *len = 0;
    int fd;
    MOE_TRY(moe_open_regular(path, &fd));
    struct stat st;
    int rc = 0;
    map_node *n = NULL;
    if (fstat(fd, &st)) {
        rc = moe_fail(MOE_EIO, "%s: cannot stat: %s", path, strerror(errno));
    } else if (st.st_size > 0 && !(n = malloc(sizeof *n + strlen(path) + 1))) {
        rc = moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    } else if (st.st_size > 0) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int err = errno; // ENOMEM: usually the count of mappings, not memory
            rc = moe_fail(MOE_EIO, "%s: cannot map: %s%s", path, strerror(err),
                          err == ENOMEM ? " (the process may hold vm.max_map_count mappings, "
                                          "one per file: use fewer, larger files, e.g. a "
                                          "larger moe prepare --shard-tokens, or raise "
                                          "vm.max_map_count)"
                                        : "");
        } else {
            *data = p, *len = (size_t)st.st_size;
            n->start = p, n->len = *len;
            strcpy(n->path, path);
            n->next = live_maps;
            live_maps = n;
            n = NULL;
        }
    }
    free(n);
    close(fd); // the mapping keeps the file
    return rc;
}

void moe_unmap(const void *data, size_t len) {
    if (!data) return;
    for (map_node *volatile *at = &live_maps; *at; at = &(*at)->next)
        if ((*at)->start == data) {
            map_node *n = *at;
            *at = n->next;
            free(n);
            break;
        }
    munmap((void *)data, len);
}

static void write_str(const char *s) {
    for (size_t n = strlen(s); n > 0;) {
        ssize_t w = write(STDERR_FILENO, s, n);
        if (w <= 0) return;
        s += w, n -= (size_t)w;
    }
}

// Async-signal-safe: strlen, write, signal, raise and _exit only. A SIGBUS
// outside every mapping (or sent by kill) is not ours to explain: the default
// action (a core) runs once the handler returns.
static void on_sigbus(int sig, siginfo_t *si, void *uctx) {
    (void)uctx;
    const char *a = si->si_addr;
    for (const map_node *n = live_maps; n; n = n->next)
        if (a >= n->start && a < n->start + n->len) {
            write_str("moe: ");
            write_str(n->path);
            write_str(": the file shrank while this process read it (another program truncated "
                      "or rewrote it in place): stopping; files being read must not change\n");
            _exit(1);
        }
    signal(sig, SIG_DFL);
    raise(sig);
}

int moe_map_guard_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, NULL) != 0)
        return moe_fail(MOE_EIO, "cannot install the SIGBUS handler: %s", strerror(errno));
    return 0;
}

int moe_make_dirs(const char *dir) {
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
        return moe_fail(MOE_EINVAL, "%.200s...: path longer than %d characters", dir, PATH_MAX - 1);
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s) continue;
        char c = *s;
        *s = 0;
        struct stat sb;
        int err = mkdir(p, 0755) ? errno : 0;
        if (err == EEXIST && stat(p, &sb) == 0 && S_ISDIR(sb.st_mode)) err = 0;
        if (err == EEXIST || err == ENOTDIR) // a file where a folder goes
            return moe_fail(MOE_EINVAL, "%s: exists and is not a folder", p);
        if (err == ENAMETOOLONG) // the name given, not the machine, is at fault
            return moe_fail(MOE_EINVAL, "%s: cannot create: %s (at most %d bytes a name)", p,
                            strerror(err), NAME_MAX);
        if (err) return moe_fail(MOE_EIO, "%s: cannot create: %s", p, strerror(err));
        if (!(*s = c)) return 0;
    }
}

bool moe_path_where(const char *path, char *out, size_t cap) {
    char head[PATH_MAX], rp[PATH_MAX];
    const char *tail = "";
    if (!*path || snprintf(head, sizeof head, "%s", path) >= (int)sizeof head) return false;
    for (;;) {
        if (realpath(head, rp))
            return snprintf(out, cap, "%s%s%s", rp, *tail ? "/" : "", tail) < (int)cap;
        char *slash = strrchr(head, '/');
        while (slash && slash > head && slash[1] == 0) { // "a/b/": drop the trailing slash
            *slash = 0;
            slash = strrchr(head, '/');
        }
        if (!slash) // a relative name: its parent is the working directory
            return realpath(".", rp) &&
                   snprintf(out, cap, "%s/%s%s%s", rp, head, *tail ? "/" : "", tail) < (int)cap;
        tail = path + (slash + 1 - head);
        if (slash == head) // "/name"
            return snprintf(out, cap, "/%s", tail) < (int)cap;
        *slash = 0;
    }
}

int moe_path_within(const char *path, const char *dir) {
    char src[PATH_MAX], dst[PATH_MAX];
    if (!realpath(dir, src) || !moe_path_where(path, dst, sizeof dst)) return 0;
    size_t n = strlen(src);
    if (n == 1) n = 0; // "/": every path lies inside it
    if (strncmp(dst, src, n) || (dst[n] != 0 && dst[n] != '/')) return 0;
    return dst[n] ? 2 : 1;
}
