// The named-view table over a flat parameter buffer (moe/params.h).
#include "moe/params.h"
#include "moe/error.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *view_name(const void *views, uint32_t i) {
    return ((const moe_param_view *)views)[i].name;
}

void moe_param_table_init(moe_param_table *t) {
    memset(t, 0, sizeof *t);
}

void moe_param_table_free(moe_param_table *t) {
    free(t->views);
    moe_name_map_free(&t->index);
    memset(t, 0, sizeof *t);
}

int moe_param_table_add(moe_param_table *t, const char *prefix, const char *name, int ndim,
                        const int64_t *shape) {
    if (ndim < 1 || ndim > MOE_PARAM_MAX_DIMS)
        return moe_fail(MOE_EINVAL, "parameter %s%s: ndim = %d not in 1..%d", prefix ? prefix : "",
                        name, ndim, MOE_PARAM_MAX_DIMS);
    moe_param_view v = {.ndim = ndim, .offset = t->numel, .numel = 1};
    int len = snprintf(v.name, sizeof v.name, "%s%s", prefix ? prefix : "", name);
    if (len < 0 || len >= (int)sizeof v.name)
        return moe_fail(MOE_EINVAL, "parameter %s%s: name longer than %d characters",
                        prefix ? prefix : "", name, MOE_PARAM_NAME_MAX - 1);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return moe_fail(MOE_EINVAL, "parameter %s: negative dimension %lld", v.name,
                            (long long)shape[i]);
        v.shape[i] = shape[i];
        v.numel *= (size_t)shape[i];
    }
    if (t->count == t->cap) {
        if (t->cap > INT_MAX / 2)
            return moe_fail(MOE_ENOMEM, "parameter table: more than %d views", t->cap);
        int cap = t->cap ? 2 * t->cap : 16;
        moe_param_view *nv = realloc(t->views, (size_t)cap * sizeof *nv);
        if (!nv) return moe_fail(MOE_ENOMEM, "parameter table: out of memory at %d views", cap);
        t->views = nv;
        t->cap = cap;
    }
    t->views[t->count] = v; // the index reads the name from here
    long dup;
    MOE_TRY(moe_name_map_add(&t->index, t->views, view_name, (size_t)t->count, &dup));
    if (dup >= 0) return moe_fail(MOE_EINVAL, "parameter %s: name already in the table", v.name);
    t->count++;
    t->numel += v.numel;
    return 0;
}

const moe_param_view *moe_param_table_find(const moe_param_table *t, const char *name) {
    long i = moe_name_map_find(&t->index, t->views, view_name, name);
    return i < 0 ? NULL : &t->views[i];
}
