// Shared by the key table (trainer/config.c) and the whole-config checks
// (trainer/config_check.c); not part of the public API.
#ifndef MOE_CONFIG_INTERNAL_H
#define MOE_CONFIG_INTERNAL_H

#include "moe/config.h"

// Every key's value inside its range; the message names where it was set.
int moe_config_check_keys(const moe_config *c, const moe_config_src *src);
// "file:line:col" or "--set key" where key was set, "default" otherwise.
const char *moe_config_where(const moe_config_src *src, const char *key);
// When key was set, relative to the other keys: larger is later, 0 never.
unsigned moe_config_order(const moe_config_src *src, const char *key);
// Records that key was set by where ("--grid router.top_k"): callers that set
// keys through moe_config_set on behalf of another option name it in errors.
void moe_config_src_mark(moe_config_src *src, const char *key, const char *where);

#endif
