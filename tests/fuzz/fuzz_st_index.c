// libFuzzer target: model.safetensors.index.json of a sharded checkpoint. The
// folder holds two valid shards; the input is the index that maps tensors to
// them. Every tensor an accepted index names must be found in its shard.
#include "fuzz_util.h"
#include "moe/safetensors.h"

#include <jansson.h>

static void write_shards(void) {
    static const float a[4] = {1, 2, 3, 4}, b[2] = {5, 6};
    moe_st_entry s1[] = {{"model.norm.weight", MOE_ST_F32, 1, {4}, a},
                         {"model.embed_tokens.weight", MOE_ST_F32, 2, {2, 2}, a}};
    moe_st_entry s2[] = {{"lm_head.weight", MOE_ST_F32, 1, {2}, b}};
    char p[700];
    snprintf(p, sizeof p, "%s", fuzz_path("model-00001-of-00002.safetensors"));
    if (moe_st_write(p, s1, 2, NULL) < 0) abort();
    snprintf(p, sizeof p, "%s", fuzz_path("model-00002-of-00002.safetensors"));
    if (moe_st_write(p, s2, 1, NULL) < 0) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int ready;
    if (!ready) write_shards(), ready = 1;
    fuzz_write(fuzz_path("model.safetensors.index.json"), data, size);
    moe_st_set *s = NULL;
    if (moe_st_set_open(fuzz_dir(), &s) < 0) return 0;
    // An accepted index maps only tensors that exist.
    json_t *doc = json_loadb((const char *)data, size, 0, NULL);
    const char *name;
    json_t *v;
    json_object_foreach(json_object_get(doc, "weight_map"), name, v) {
        if (!moe_st_set_find(s, name, NULL)) abort();
    }
    json_decref(doc);
    moe_st_set_close(s);
    return 0;
}
