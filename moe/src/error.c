// Thread-local last-error message and the logger (MOE_LOG levels).
#include "moe/error.h"
#include "moe/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char last_error[512];

// A message longer than the buffer (a path near PATH_MAX, or two of them)
// keeps its start and its end, where the reason is, with "..." between:
// cut at the end alone it would be the path and nothing else.
static void elide(char *out, size_t cap, const char *s, size_t n) {
    size_t head = cap / 3, tail = cap - 1 - head - 3;
    while (head > 0 && ((unsigned char)s[head] & 0xC0) == 0x80) // whole UTF-8 characters
        head--;
    const char *t = s + n - tail;
    while (*t && ((unsigned char)*t & 0xC0) == 0x80)
        t++;
    snprintf(out, cap, "%.*s...%s", (int)head, s, t);
}

int moe_fail(int code, const char *fmt, ...) {
    // Format into a copy: callers may pass moe_last_error() as an argument to
    // add context to the message already recorded.
    char buf[sizeof last_error];
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    const int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    char *whole = n >= (int)sizeof buf ? malloc((size_t)n + 1) : NULL;
    if (whole) { // (without memory the cut message stays)
        vsnprintf(whole, (size_t)n + 1, fmt, again);
        elide(buf, sizeof buf, whole, (size_t)n);
        free(whole);
    }
    va_end(again);
    memcpy(last_error, buf, sizeof buf);
    return code;
}

const char *moe_last_error(void) {
    return last_error;
}

const char *moe_strerror(int code) {
    switch (code) {
    case MOE_OK:
        return "ok";
    case MOE_EINVAL:
        return "invalid argument";
    case MOE_EIO:
        return "i/o error";
    case MOE_EFORMAT:
        return "malformed input";
    case MOE_ENOMEM:
        return "out of memory";
    case MOE_ENUMERIC:
        return "non-finite value";
    case MOE_ENOTFOUND:
        return "not found";
    case MOE_EDEVICE:
        return "device error";
    default:
        return "unknown error";
    }
}

int moe_trace(int code, const char *file, int line) {
    moe_log(MOE_LOG_DEBUG, "error %d passed %s:%d (%s)", code, file, line, last_error);
    return code;
}

static int log_level(void) {
    static int level = -1;
    if (level < 0) {
        const char *s = getenv("MOE_LOG");
        level = MOE_LOG_INFO;
        if (s && strcmp(s, "error") == 0) level = MOE_LOG_ERROR;
        if (s && strcmp(s, "warn") == 0) level = MOE_LOG_WARN;
        if (s && strcmp(s, "debug") == 0) level = MOE_LOG_DEBUG;
    }
    return level;
}

int moe_log_enabled(moe_log_level level) {
    return (int)level <= log_level();
}

void moe_log(moe_log_level level, const char *fmt, ...) {
    if (!moe_log_enabled(level)) return;
    static const char *names[] = {"error", "warn", "info", "debug"};
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moe %s: ", names[level]);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}
