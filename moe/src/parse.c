// Config values from text (see parse.h). Values are user text of any length:
// messages quote a bounded prefix so the "expected ..." part always survives.
#include "moe/parse.h"
#include "moe/error.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QUOTE_MAX 64
#define QUOTE(v) QUOTE_MAX, (v), strlen(v) > QUOTE_MAX ? "..." : ""

int moe_parse_double(const char *key, const char *v, double *out) {
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(d))
        return moe_fail(MOE_EINVAL, "%s = '%.*s%s': expected a finite number", key, QUOTE(v));
    *out = d;
    return 0;
}

int moe_parse_int(const char *key, const char *v, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (end == v || *end)
        return moe_fail(MOE_EINVAL, "%s = '%.*s%s': expected an integer", key, QUOTE(v));
    if (errno || n < lo || n > hi)
        return moe_fail(MOE_EINVAL, "%s = %.*s%s: expected %ld..%ld", key, QUOTE(v), lo, hi);
    *out = (int)n;
    return 0;
}

int moe_parse_u64(const char *key, const char *v, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long u = strtoull(v, &end, 10);
    if (end == v || *end || errno || strchr(v, '-'))
        return moe_fail(MOE_EINVAL, "%s = '%.*s%s': expected a non-negative integer", key,
                        QUOTE(v));
    *out = u;
    return 0;
}

int moe_parse_bool(const char *key, const char *v, bool *out) {
    if (!strcmp(v, "true") || !strcmp(v, "1"))
        *out = true;
    else if (!strcmp(v, "false") || !strcmp(v, "0"))
        *out = false;
    else
        return moe_fail(MOE_EINVAL, "%s = '%.*s%s': expected true or false", key, QUOTE(v));
    return 0;
}

void moe_range_text(char *buf, size_t cap, double lo, double hi, int open, bool integer) {
    const bool has_lo = lo > -DBL_MAX, has_hi = hi < DBL_MAX;
    const char *lo_op = open & MOE_RANGE_LO_OPEN ? ">" : ">=";
    const char *hi_op = open & MOE_RANGE_HI_OPEN ? "<" : "<=";
    if (integer && has_lo && has_hi)
        snprintf(buf, cap, "%.0f..%.0f", lo, hi);
    else if (has_lo && has_hi)
        snprintf(buf, cap, "%c%.17g, %.17g%c", open & MOE_RANGE_LO_OPEN ? '(' : '[', lo, hi,
                 open & MOE_RANGE_HI_OPEN ? ')' : ']');
    else if (has_lo)
        snprintf(buf, cap, "%s %.17g", lo_op, lo);
    else if (has_hi)
        snprintf(buf, cap, "%s %.17g", hi_op, hi);
    else
        snprintf(buf, cap, "a finite number");
}

int moe_check_range(const char *key, int item, double v, double lo, double hi, int open,
                    bool integer) {
    if (isfinite(v) && v >= lo && v <= hi && !(open & MOE_RANGE_LO_OPEN && v == lo) &&
        !(open & MOE_RANGE_HI_OPEN && v == hi))
        return 0;
    char want[96], item_s[32] = "";
    moe_range_text(want, sizeof want, lo, hi, open, integer);
    if (item >= 0) snprintf(item_s, sizeof item_s, " item %d", item);
    return moe_fail(MOE_EINVAL, "%s%s = %.17g: expected %s", key, item_s, v, want);
}
