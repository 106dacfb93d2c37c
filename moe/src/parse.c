// Config values from text (see parse.h). Values are user text of any length:
// messages quote a bounded prefix so the "expected ..." part always survives.
#include "moe/parse.h"
#include "moe/error.h"

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QUOTE_MAX 64
#define QUOTE(v) QUOTE_MAX, (v), strlen(v) > QUOTE_MAX ? "..." : ""

// strto* skip leading blanks; a trailing one is refused, so both are.
static bool blank_first(const char *v) {
    return isspace((unsigned char)v[0]);
}

int moe_parse_double(const char *key, const char *v, double *out) {
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    // ERANGE on underflow (1e-320) still gives the nearest finite value: the
    // key's range check speaks for it. On overflow d is infinite.
    // strtod also reads hex floats (0x10, 0x1p-3), which a config file (JSON) refuses
    if (end == v || *end || blank_first(v) || (errno && errno != ERANGE) || !isfinite(d) ||
        strpbrk(v, "xX"))
        return moe_fail(MOE_EINVAL, "%s = '%.*s%s': expected a finite decimal number", key,
                        QUOTE(v));
    *out = d;
    return 0;
}

int moe_parse_int(const char *key, const char *v, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (end == v || *end || blank_first(v))
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
    if (end == v || *end || blank_first(v) || errno || strchr(v, '-'))
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

// Levenshtein distance with two rows; words longer than 127 bytes count as far.
int moe_edit_distance(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    if (na > 127 || nb > 127) return 1 << 20;
    int row[2][128];
    for (size_t j = 0; j <= nb; j++)
        row[0][j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        int *prev = row[(i - 1) & 1], *cur = row[i & 1];
        cur[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int sub = prev[j - 1] + (a[i - 1] != b[j - 1]);
            int del = prev[j] + 1, ins = cur[j - 1] + 1;
            cur[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
    }
    return row[na & 1][nb];
}

const char *moe_nearest(const char *word, const char *const *cands, int n) {
    size_t len = strlen(word);
    // a typo: up to 2 edits (3 in words of 10 or more), and fewer than the
    // word has letters ("x" is no typo of "xy")
    int limit = len >= 10 ? 3 : 2, best_d = limit + 1;
    const char *best = NULL;
    for (int i = 0; i < n; i++) {
        int d = moe_edit_distance(word, cands[i]);
        if (d < best_d && (size_t)d < len) best_d = d, best = cands[i];
    }
    return best;
}

const char *moe_nearest_value(const char *word, const char *values, char *buf, size_t cap) {
    const char *cands[32];
    char copy[512];
    int n = 0;
    snprintf(copy, sizeof copy, "%s", values);
    for (char *p = copy; p && n < 32;) {
        cands[n++] = p;
        p = strchr(p, '|');
        if (p) *p++ = 0;
    }
    const char *best = moe_nearest(word, cands, n);
    if (!best) return NULL;
    snprintf(buf, cap, "%s", best);
    return buf;
}
