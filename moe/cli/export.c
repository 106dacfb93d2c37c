// `moe export CKPT --hf DIR`: a folder Hugging Face transformers loads as
// MixtralForCausalLM (see trainer/export.c for what is refused and why).
#include "moe/cli/cli.h"
#include "moe/error.h"

#include <stdio.h>
#include <string.h>

int moe_cli_export(int argc, char **argv) {
    (void)argc, (void)argv;
    return moe_cli_fail("export", MOE_EXIT_USAGE, "not implemented yet");
}
