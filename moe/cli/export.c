// `moe export CKPT --hf DIR`: a folder Hugging Face transformers loads as
// MixtralForCausalLM; features Mixtral cannot express are refused by name.
#include "moe/export.h"
#include "moe/checkpoint.h"
#include "moe/cli/cli.h"
#include "moe/error.h"

#include <stdio.h>
#include <string.h>

static const char *export_help =
    "usage: moe export CKPT_DIR --hf OUT_DIR\n"
    "\n"
    "Writes OUT_DIR/config.json (model_type mixtral) and OUT_DIR/model.safetensors\n"
    "(the checkpoint's tensors under their Mixtral names, lm_head.weight written out\n"
    "when the embeddings are tied) so that transformers loads the folder with\n"
    "MixtralForCausalLM.from_pretrained(OUT_DIR). Tokens are bytes (vocab_size 256, the\n"
    "synthetic tasks' markers are bytes 128 + task id); no tokenizer files are written.\n"
    "Refused, with the feature named: shared experts, per-layer expert counts (pyramid),\n"
    "task-routed layers, dense layers between MoE layers (moe.every != 1) and raw top-k\n"
    "weights (router.normalize_topk = false). scripts/hf_check.py compares the export's\n"
    "logits with moe eval --dump-logits.\n"
    "\n"
    "exit status: 0 ok, 1 runtime failure, 2 bad usage or input\n";

int moe_cli_export(int argc, char **argv) {
    const char *dir = NULL, *out = NULL;
    for (int i = 1; i < argc; i++) {
        int m;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(export_help, stdout);
            return MOE_EXIT_OK;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--hf", &out)) != 0) {
            if (m < 0) return moe_cli_fail("export", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if (argv[i][0] == '-') {
            return moe_cli_unknown_option("export", argv[i], export_help);
        } else if (!dir) {
            dir = argv[i];
        } else {
            return moe_cli_fail("export", MOE_EXIT_USAGE, "more than one checkpoint ('%s', '%s')",
                                dir, argv[i]);
        }
    }
    if (!dir || !out)
        return moe_cli_fail("export", MOE_EXIT_USAGE, "usage: moe export CKPT_DIR --hf OUT_DIR");
    moe_config cfg; // a checkpoint that cannot be read is bad input
    int rc = moe_cli_check_ckpt(dir);
    if (rc == 0) rc = moe_ckpt_config(dir, &cfg);
    if (rc < 0) return moe_cli_fail("export", moe_cli_input_exit_code(rc), "%s", moe_last_error());
    rc = moe_export_hf(dir, out);
    if (rc < 0) return moe_cli_fail("export", moe_cli_exit_code(rc), "%s", moe_last_error());
    printf("exported %s to %s (MixtralForCausalLM)\n", dir, out);
    return MOE_EXIT_OK;
}
