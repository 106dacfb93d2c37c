// Export of a checkpoint to a folder Hugging Face transformers loads as
// MixtralForCausalLM (config.json with model_type "mixtral", model.safetensors
// with Mixtral's tensor names). Byte vocabulary, no tokenizer files.
#ifndef MOE_EXPORT_H
#define MOE_EXPORT_H

// Writes out/config.json and out/model.safetensors from checkpoint folder
// ckpt. MOE_EINVAL naming every feature Mixtral cannot express (shared
// experts, pyramid expert counts, task routing, dense layers between MoE
// layers, unnormalised top-k); MOE_EFORMAT/MOE_EIO for bad or unwritable files.
int moe_export_hf(const char *ckpt, const char *out);

#endif
