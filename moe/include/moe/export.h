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
// The same for one task (task non-NULL) of a model whose every layer is
// task-routed (moe.task_layers lists them all, moe.every = 1, no shared
// experts, no pyramid; otherwise MOE_EINVAL naming what stands in the way):
// a Mixtral with the task's k experts per layer, top-k = k, an all-zero gate
// (each expert weighed 1/k) and expert j's w2 multiplied by k * w_j, w_j the
// router's weight of the task's j-th expert: the task's sub-model up to float
// rounding. config.json records moe_task and moe_task_id. An unknown task is
// MOE_EINVAL naming the known ones. task NULL: moe_export_hf, which refuses
// an all-task-routed model suggesting --task.
int moe_export_hf_task(const char *ckpt, const char *out, const char *task);

// tokenizer.json (the `tokenizers` library's format) for a SentencePiece BPE
// model, as transformers' Llama tokenizer: vocabulary in id order, merges
// ranked by the merged piece's id, byte fallback, "▁" for spaces with one
// prepended, BOS added by the post-processor. MOE_EINVAL for other model types.
int moe_export_tokenizer_json(const char *path, const moe_tokenizer *t);

#endif
