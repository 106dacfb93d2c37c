// libFuzzer target: a run config file followed by --set overrides. The input
// is split at the first "\n--\n": before it the JSON file, after it one
// key=value per line. An accepted config must check cleanly or fail with a
// message, and write out and read back to the same values.
#include "fuzz_util.h"
#include "moe/config.h"
#include "moe/error.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    char *sets = strstr(text, "\n--\n");
    size_t json_len = sets ? (size_t)(sets - text) : size;
    const char *path = fuzz_path("config.json");
    fuzz_write(path, data, json_len);
    moe_config *cfg = malloc(sizeof *cfg), *back = malloc(sizeof *back);
    if (!cfg || !back) abort();
    moe_config_default(cfg);
    int rc = moe_config_load(cfg, NULL, path);
    for (char *line = sets ? sets + 4 : NULL; rc == 0 && line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        rc = moe_config_set(cfg, NULL, line);
        line = nl ? nl + 1 : NULL;
    }
    if (rc == 0) rc = moe_config_check(cfg, NULL);
    if (rc < 0 && !moe_last_error()[0]) abort(); // every failure says why
    if (rc == 0) { // the resolved config written next to a run loads back
        const char *out = fuzz_path("resolved.json");
        FILE *f = fopen(out, "w");
        if (!f) abort();
        if (moe_config_write(cfg, f) < 0) abort();
        fclose(f);
        moe_config_default(back);
        if (moe_config_load(back, NULL, out) < 0 || moe_config_check(back, NULL) < 0) abort();
    }
    free(cfg);
    free(back);
    free(text);
    return 0;
}
