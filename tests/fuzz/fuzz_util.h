// Shared by the libFuzzer targets: the library reads files by path, so each
// input is written to a file in a private temp folder and handed over by name.
#ifndef MOE_FUZZ_UTIL_H
#define MOE_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The fuzzer's private folder (created once, under $TMPDIR or /tmp).
static const char *fuzz_dir(void) {
    static char dir[512];
    if (!dir[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/moe-fuzz-XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(dir)) abort(); // the harness itself cannot run
    }
    return dir;
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
