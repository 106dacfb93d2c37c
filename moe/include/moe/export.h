// Export of a checkpoint to a folder Hugging Face transformers loads as
// MixtralForCausalLM (config.json with model_type "mixtral", model.safetensors
// with Mixtral's tensor names), and its tokenizer as AutoTokenizer loads it: a
// byte vocabulary has no tokenizer files; a SentencePiece one (model.tokenizer)
// gets tokenizer.model, tokenizer.json, tokenizer_config.json and
// special_tokens_map.json, as Mixtral's own repositories ship them.
#ifndef MOE_EXPORT_H
#define MOE_EXPORT_H

#include "moe/tokenizer.h"

// Writes out/config.json and out/model.safetensors from checkpoint folder
// ckpt (and the tokenizer files above). MOE_EINVAL naming every feature
// Mixtral cannot express (shared experts, pyramid expert counts, task routing,
// dense layers between MoE layers, unnormalised top-k); MOE_EFORMAT/MOE_EIO for
// bad or unwritable files.
int moe_export_hf(const char *ckpt, const char *out);

// tokenizer.json (the `tokenizers` library's format) for a SentencePiece BPE
// model, as transformers' Llama tokenizer: vocabulary in id order, merges
// ranked by the merged piece's id, byte fallback, "▁" for spaces with one
// prepended, BOS added by the post-processor. MOE_EINVAL for other model types.
int moe_export_tokenizer_json(const char *path, const moe_tokenizer *t);

#endif
