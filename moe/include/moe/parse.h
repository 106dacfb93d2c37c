// Parsing of config values from text, shared by the router's keys and the run
// config: the whole string must be the value; errors name the key.
#ifndef MOE_PARSE_H
#define MOE_PARSE_H

#include <stdbool.h>
#include <stdint.h>

int moe_parse_double(const char *key, const char *v, double *out); // finite numbers only
int moe_parse_int(const char *key, const char *v, long lo, long hi, int *out);
int moe_parse_u64(const char *key, const char *v, uint64_t *out); // no sign
int moe_parse_bool(const char *key, const char *v, bool *out);     // true|false|1|0

#endif
