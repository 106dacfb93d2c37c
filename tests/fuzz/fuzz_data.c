// libFuzzer target: an llm.c token file (256 x int32 header, then uint16 or
// uint32 tokens). The header parser and the mapped open must validate the
// header against the file's length; an accepted file must give batches whose
// tokens are in the vocabulary.
#include "fuzz_util.h"
#include "moe/config.h"
#include "moe/data.h"
#include "moe/shards.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int width;
    long n_tok;
    if (moe_llmc_header_parse(data, size, size, "fuzz", &width, &n_tok) == 0 &&
        (size_t)n_tok * (size_t)width + MOE_LLMC_HEADER != size)
        abort(); // an accepted header accounts for every byte
    const char *path = fuzz_path("tokens.bin");
    fuzz_write(path, data, size);
    moe_config cfg;
    moe_config_default(&cfg);
    if (moe_config_set(&cfg, NULL, "data.kind=bin") < 0 ||
        moe_config_set(&cfg, NULL, "model.seq_len=8") < 0 ||
        moe_config_set(&cfg, NULL, "train.batch_size=2") < 0)
        abort();
    snprintf(cfg.data.path, sizeof cfg.data.path, "%s", path);
    moe_data d;
    memset(&d, 0, sizeof d);
    if (moe_data_open(&d, &cfg) < 0) return 0;
    int32_t in[16], tg[16], task[2];
    for (int split = 0; split < 2; split++)
        if (moe_data_next(&d, split, in, tg, task) == 0)
            for (int i = 0; i < 16; i++)
                if (in[i] < 0 || in[i] >= cfg.model.vocab_size) abort();
    moe_data_close(&d);
    return 0;
}
