#!/usr/bin/env python3
"""Reference check of `moe export --hf`: loads the exported folder with Hugging
Face transformers as MixtralForCausalLM, runs it on the tokens that
`moe eval --dump-logits` wrote, and prints the largest absolute difference
between the two sets of logits.

Optional, not part of the default tests; it needs torch, transformers and
safetensors. The CPU wheel of torch is enough (about 200 MB instead of the
default wheel's several GB of CUDA libraries):

    python3 -m venv .venv
    .venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch
    .venv/bin/pip install transformers safetensors
    build/moe export runs/tiny --hf out/hf
    build/moe eval runs/tiny --samples 0 --dump-logits out/logits.safetensors
    .venv/bin/python scripts/hf_check.py out/hf out/logits.safetensors

Exit status 0 when the difference is within --tol (default 1e-4), 1 above it,
2 on bad usage or input.
"""
import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", help="folder written by moe export --hf")
    ap.add_argument("dump", help="file written by moe eval --dump-logits")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest abs difference accepted")
    args = ap.parse_args()
    try:
        import torch
        from safetensors.torch import load_file
        from transformers import MixtralForCausalLM
    except ImportError as e:
        print(f"hf_check: {e} (pip install --index-url https://download.pytorch.org/whl/cpu "
              "torch; pip install transformers safetensors)", file=sys.stderr)
        return 2
    ref = load_file(args.dump)
    tokens, logits = ref["tokens"].long(), ref["logits"]
    model = MixtralForCausalLM.from_pretrained(
        args.hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        hf = model(input_ids=tokens).logits.float()
    if hf.shape != logits.shape:
        print(f"hf_check: shapes differ: transformers {tuple(hf.shape)}, "
              f"moe {tuple(logits.shape)}", file=sys.stderr)
        return 2
    diff = (hf - logits).abs()
    worst = diff.max().item()
    scale = logits.abs().max().item()
    agree = (hf.argmax(-1) == logits.argmax(-1)).float().mean().item()
    print(f"sequences {tokens.shape[0]} x {tokens.shape[1]} tokens, vocab {logits.shape[2]}")
    print(f"max abs logit difference {worst:.3e} (largest |logit| {scale:.3f}, "
          f"mean abs difference {diff.mean().item():.3e})")
    print(f"argmax agreement {100 * agree:.2f}%")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
