// The expert selection bias of auxiliary-loss-free balancing (router/bias.c) in
// checkpoint files: one F32 [E] tensor per MoE layer, named as transformers'
// DeepseekV3 names its e_score_correction_bias, checked on reading like every
// other tensor (dtype, shape, finite values).
#include "moe/checkpoint.h"
#include "moe/error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int moe_ckpt_bias_layer(const char *name) {
    int l = -1, n = 0;
    char again[160];
    if (sscanf(name, "model.layers.%d.%n", &l, &n) != 1 || l < 0 || n == 0) return -1;
    // the canonical spelling only: "model.layers.+3..." or "...03..." is not layer 3's
    snprintf(again, sizeof again, MOE_CKPT_BIAS_FMT, l);
    return strcmp(again, name) ? -1 : l;
}

int moe_ckpt_bias_read(const moe_st_set *s, const char *what, int l, int E, float *out,
                       bool *found) {
    char name[160];
    snprintf(name, sizeof name, MOE_CKPT_BIAS_FMT, l);
    *found = false;
    moe_st_file *f = NULL;
    const moe_st_tensor *t = moe_st_set_find(s, name, &f);
    if (!t) return 0;
    if (t->dtype != MOE_ST_F32 || t->ndim != 1 || t->shape[0] != E)
        return moe_fail(MOE_EFORMAT,
                        "%s: tensor '%s' is %s with %d dims [%lld], the config expects F32 [%d] "
                        "(one bias per expert)",
                        f->path, name, moe_st_dtype_name(t->dtype), t->ndim,
                        (long long)(t->ndim > 0 ? t->shape[0] : 0), E);
    float *tmp = malloc(sizeof(float) * (size_t)E);
    if (!tmp) return moe_fail(MOE_ENOMEM, "%s: out of memory", what);
    int rc = moe_st_read(f, t, tmp, sizeof(float) * (size_t)E);
    for (int e = 0; rc == 0 && e < E; e++)
        if (!isfinite(tmp[e]))
            rc = moe_fail(MOE_EFORMAT, "%s: tensor '%s' element %d is %g, expected a finite bias",
                          f->path, name, e, tmp[e]);
    if (rc == 0) {
        memcpy(out, tmp, sizeof(float) * (size_t)E);
        *found = true;
    }
    free(tmp);
    return rc;
}
