// `moe export CKPT --hf DIR [--task NAME]`: a folder Hugging Face transformers
// loads as MixtralForCausalLM (the whole model, or one task of an all
// task-routed one); features Mixtral cannot express are refused by name.
#include "moe/export.h"
#include "moe/checkpoint.h"
#include "moe/cli/cli.h"
#include "moe/error.h"

#include <stdio.h>
#include <string.h>

static const char *export_help =
    "usage: moe export CKPT_DIR --hf OUT_DIR [--task NAME]\n"
    "\n"
    "Writes OUT_DIR/config.json (model_type mixtral) and OUT_DIR/model.safetensors\n"
    "(the checkpoint's tensors under their Mixtral names, lm_head.weight written out\n"
    "when the embeddings are tied) so that transformers loads the folder with\n"
    "MixtralForCausalLM.from_pretrained(OUT_DIR). With model.tokenizer = bytes tokens are\n"
    "bytes (the synthetic tasks' markers are bytes 128 + task id) and no tokenizer files\n"
    "are written; a checkpoint with a SentencePiece tokenizer also gets tokenizer.model,\n"
    "tokenizer.json (BPE models), tokenizer_config.json and special_tokens_map.json, so\n"
    "AutoTokenizer.from_pretrained(OUT_DIR) encodes and decodes as moe generate does;\n"
    "user-defined pieces (<|user|>) are non-special added tokens, kept whole. Training-only\n"
    "settings (memory.mini_seq, memory.recompute) change no weight: such checkpoints export.\n"
    "\n"
    "Refused, with the feature named: shared experts, per-layer expert counts (pyramid),\n"
    "task-routed layers, dense layers between MoE layers (moe.every != 1), raw top-k\n"
    "weights (router.normalize_topk = false), sigmoid scores, router.route_scale != 1,\n"
    "group-limited routing (router.topk_groups below router.n_groups), a non-zero expert\n"
    "selection bias and expert choice without a token-choice fallback.\n"
    "\n"
    "--task NAME exports one task of a model whose every layer is task-routed\n"
    "(moe.task_layers lists every layer, moe.every = 1, no shared experts, no pyramid):\n"
    "all of a task's tokens go to the same top_k experts with the same weights, so the\n"
    "task's sub-model is a Mixtral with top_k experts per layer, all used, an all-zero\n"
    "gate (each expert weighed 1/top_k) and each expert's w2 scaled by top_k times its\n"
    "routing weight: the same logits as moe generate --task NAME up to float rounding.\n"
    "config.json records the task (moe_task, moe_task_id).\n"
    "\n"
    "OUT_DIR must be new, empty or an earlier export (its config.json carries\n"
    "moe_tokenizer); a folder holding other files is refused, naming them, and left as\n"
    "it is. Over an earlier export the files written are replaced, and a byte model's\n"
    "export removes the earlier export's tokenizer files. A tokenizer with more pieces\n"
    "than model.vocab_size is refused.\n"
    "\n"
    "scripts/hf_check.py compares the export's logits with moe eval --dump-logits (the\n"
    "task's rows with --task) and, for a SentencePiece model, transformers' generate with\n"
    "moe generate.\n"
    "\n"
    "exit status: 0 ok, 1 runtime failure, 2 bad usage or input (a feature Mixtral cannot\n"
    "express, an unknown task)\n";

int moe_cli_export(int argc, char **argv) {
    const char *dir = NULL, *out = NULL, *task = NULL;
    for (int i = 1; i < argc; i++) {
        int m;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(export_help, stdout);
            return MOE_EXIT_OK;
        } else if ((m = moe_cli_opt_path(argc, argv, &i, "--hf", &out)) != 0 ||
                   (m = moe_cli_opt_once(argc, argv, &i, "--task", &task)) != 0) {
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
        return moe_cli_fail("export", MOE_EXIT_USAGE,
                            "usage: moe export CKPT_DIR --hf OUT_DIR [--task NAME]");
    moe_config cfg; // a checkpoint that cannot be read is bad input
    int rc = moe_cli_check_ckpt(dir);
    if (rc == 0) rc = moe_ckpt_config(dir, &cfg);
    if (rc < 0) return moe_cli_fail("export", moe_cli_input_exit_code(rc), "%s", moe_last_error());
    rc = moe_export_hf_task(dir, out, task);
    if (rc < 0) return moe_cli_fail("export", moe_cli_exit_code(rc), "%s", moe_last_error());
    if (task)
        printf("exported task %s of %s to %s (MixtralForCausalLM)\n", task, dir, out);
    else
        printf("exported %s to %s (MixtralForCausalLM)\n", dir, out);
    return MOE_EXIT_OK;
}
