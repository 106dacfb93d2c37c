// Shared by the libFuzzer targets: the library reads files by path, so each
// input is written to a file in a private temp folder and handed over by name.
#ifndef MOE_FUZZ_UTIL_H
#define MOE_FUZZ_UTIL_H

#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char fuzz_dir_path[512];

// Removes path and all it holds (links are not followed).
static void fuzz_remove_tree(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return;
    DIR *dp = S_ISDIR(sb.st_mode) ? opendir(path) : NULL;
    struct dirent *de;
    char p[1024];
    while (dp && (de = readdir(dp)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") &&
            snprintf(p, sizeof p, "%s/%s", path, de->d_name) < (int)sizeof p)
            fuzz_remove_tree(p);
    if (dp) closedir(dp);
    remove(path);
}

static void fuzz_remove_dir(void) {
    fuzz_remove_tree(fuzz_dir_path);
}

// The fuzzer's private folder (created once, under $TMPDIR or /tmp; removed
// when the fuzzer exits normally, kept after a crash).
static const char *fuzz_dir(void) {
    if (!fuzz_dir_path[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(fuzz_dir_path, sizeof fuzz_dir_path, "%s/moe-fuzz-XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(fuzz_dir_path) || atexit(fuzz_remove_dir)) abort(); // the harness cannot run
    }
    return fuzz_dir_path;
}

// "fuzz_dir()/name" in a static buffer.
static const char *fuzz_path(const char *name) {
    static char p[640];
    snprintf(p, sizeof p, "%s/%s", fuzz_dir(), name);
    return p;
}

// Writes n bytes to path (aborts when the harness cannot write: not a finding).
static void fuzz_write(const char *path, const uint8_t *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f)) abort();
}

#endif
