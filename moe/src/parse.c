// Config values from text (see parse.h).
#include "moe/parse.h"
#include "moe/error.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int moe_parse_double(const char *key, const char *v, double *out) {
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(d))
        return moe_fail(MOE_EINVAL, "%s = '%s': expected a number", key, v);
    *out = d;
    return 0;
}

int moe_parse_int(const char *key, const char *v, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (end == v || *end || errno)
        return moe_fail(MOE_EINVAL, "%s = '%s': expected an integer", key, v);
    if (n < lo || n > hi) return moe_fail(MOE_EINVAL, "%s = %ld: expected %ld..%ld", key, n, lo, hi);
    *out = (int)n;
    return 0;
}

int moe_parse_u64(const char *key, const char *v, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long u = strtoull(v, &end, 10);
    if (end == v || *end || errno || strchr(v, '-'))
        return moe_fail(MOE_EINVAL, "%s = '%s': expected a non-negative integer", key, v);
    *out = u;
    return 0;
}

int moe_parse_bool(const char *key, const char *v, bool *out) {
    if (!strcmp(v, "true") || !strcmp(v, "1")) *out = true;
    else if (!strcmp(v, "false") || !strcmp(v, "0")) *out = false;
    else return moe_fail(MOE_EINVAL, "%s = '%s': expected true or false", key, v);
    return 0;
}
