// Output files of moe report (trainer/report_out.h). A page or CSV is built in
// memory and put in place with one rename, so a full disk or a crash leaves
// the earlier report whole; an existing target is replaced only when it is an
// earlier output of ours, so `--out RUN/metrics.jsonl` cannot destroy a run.
#include "trainer/report_out.h"
#include "moe/error.h"
#include "moe/fsio.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int report_out_open(report_out *o, const char *path) {
    o->buf = NULL;
    o->len = 0;
    o->f = open_memstream(&o->buf, &o->len);
    return o->f ? 0 : moe_fail(MOE_ENOMEM, "%s: out of memory", path);
}

void report_out_discard(report_out *o) {
    if (o->f) fclose(o->f);
    free(o->buf);
    o->f = NULL, o->buf = NULL;
}

static bool same_file(const struct stat *a, const char *run_dir, const char *name) {
    char p[PATH_MAX];
    struct stat b;
    if (snprintf(p, sizeof p, "%s/%s", run_dir, name) >= (int)sizeof p || stat(p, &b) != 0)
        return false;
    return a->st_dev == b.st_dev && a->st_ino == b.st_ino;
}

// Whether the existing regular file at path begins the way our outputs of
// this kind do (or is empty: nothing to lose).
static bool ours(const char *path, report_out_kind kind) {
    char head[sizeof REPORT_HTML_MAGIC + sizeof REPORT_HTML_ABLATE] = {0};
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t n = read(fd, head, sizeof head - 1);
    close(fd);
    if (n == 0) return true;
    if (n < 0) return false;
    const size_t k = strlen(REPORT_HTML_MAGIC);
    if (kind != REPORT_OUT_CSV && strncmp(head, REPORT_HTML_MAGIC, k)) return false;
    if (kind == REPORT_OUT_HTML)
        return !strncmp(head + k, REPORT_HTML_RUN, strlen(REPORT_HTML_RUN));
    if (kind == REPORT_OUT_ABLATE_HTML)
        return !strncmp(head + k, REPORT_HTML_ABLATE, strlen(REPORT_HTML_ABLATE));
    return !strncmp(head, "step,", 5) || !strncmp(head, "task,", 5); // the header rows we write
}

int report_out_check(const char *path, report_out_kind kind, const char *run_dir) {
    struct stat sb;
    if (stat(path, &sb) != 0) return 0; // nothing there (or a dangling link): nothing to lose
    static const char *inputs[] = {"metrics.jsonl", "config.json"};
    for (int i = 0; run_dir && i < 2; i++)
        if (same_file(&sb, run_dir, inputs[i]))
            return moe_fail(MOE_EINVAL, "%s is the run's %s: refusing to overwrite an input", path,
                            inputs[i]);
    if (S_ISDIR(sb.st_mode)) return moe_fail(MOE_EINVAL, "%s: is a folder, expected a file", path);
    if (!S_ISREG(sb.st_mode)) return moe_fail(MOE_EINVAL, "%s: not a regular file", path);
    static const char *what[] = {"a run report page written by moe report",
                                 "an ablation page written by moe ablate",
                                 "a CSV written by moe report"};
    if (!ours(path, kind))
        return moe_fail(MOE_EINVAL,
                        "%s: exists and is not %s: refusing to overwrite it (remove it or choose "
                        "another path)",
                        path, what[kind]);
    return 0;
}

int report_out_commit(report_out *o, const char *path, report_out_kind kind, const char *run_dir) {
    bool bad = ferror(o->f) != 0;
    int rc = fclose(o->f) != 0 || bad ? moe_fail(MOE_ENOMEM, "%s: out of memory", path) : 0;
    o->f = NULL;
    if (rc == 0) rc = report_out_check(path, kind, run_dir);
    if (rc == 0) rc = moe_fs_replace_file(path, o->buf, o->len);
    free(o->buf);
    o->buf = NULL;
    return rc;
}
