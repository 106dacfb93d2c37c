// libFuzzer target: a safetensors file (header length, JSON header, data).
// Opening must validate everything the header claims; every tensor it accepts
// must then read back within its byte range.
#include "fuzz_util.h"
#include "moe/log.h"
#include "moe/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_path("model.safetensors");
    fuzz_write(path, data, size);
    moe_st_file *f = NULL;
    if (moe_st_open(path, &f) < 0) return 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const moe_st_tensor *t = &f->tensors[i];
        if (moe_st_find(f, t->name) != t) abort(); // names are unique
        if (t->nbytes > (1u << 20)) continue;
        void *buf = malloc(t->nbytes ? t->nbytes : 1);
        if (buf) moe_st_read(f, t, buf, t->nbytes);
        free(buf);
    }
    for (int i = 0; i < f->n_meta; i++)
        moe_st_meta(f, f->meta_keys[i]);
    moe_st_close(f);
    return 0;
}
