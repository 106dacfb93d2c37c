// Parsing of config values from text, shared by the router's keys and the run
// config: the whole string must be the value; errors name the key and quote
// at most the first 64 characters of a rejected value.
#ifndef MOE_PARSE_H
#define MOE_PARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

int moe_parse_double(const char *key, const char *v, double *out); // finite numbers only
int moe_parse_int(const char *key, const char *v, long lo, long hi, int *out);
int moe_parse_u64(const char *key, const char *v, uint64_t *out); // no sign
int moe_parse_bool(const char *key, const char *v, bool *out);    // true|false|1|0

// Ranges of numeric keys: [lo, hi], with an end excluded when its bit is set
// in `open`. lo = -DBL_MAX or hi = DBL_MAX leave that side unbounded.
#define MOE_RANGE_LO_OPEN 1
#define MOE_RANGE_HI_OPEN 2
// Fails with MOE_EINVAL "key = v: expected RANGE" ("key item i = ..." when
// item >= 0) unless v is finite and inside the range.
int moe_check_range(const char *key, int item, double v, double lo, double hi, int open,
                    bool integer);
// The range as text for messages and --help-config: "1..64", "[0, 1)", "> 0".
void moe_range_text(char *buf, size_t cap, double lo, double hi, int open, bool integer);

// "Did you mean": one rule for commands, options, config keys, enum values and
// task names. moe_edit_distance is the Levenshtein distance; moe_nearest
// returns the candidate nearest to word when it is a likely typo of it (at
// most 2 edits, 3 for words of 10 or more characters, and fewer edits than
// word has characters), else NULL. moe_nearest_value does the same over
// "a|b|c" (the value lists of enum keys), copying the match into buf.
int moe_edit_distance(const char *a, const char *b);
const char *moe_nearest(const char *word, const char *const *cands, int n);
const char *moe_nearest_value(const char *word, const char *values, char *buf, size_t cap);

#endif
