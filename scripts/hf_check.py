#!/usr/bin/env python3
"""Reference check of `moe export --hf`: loads the exported folder with Hugging
Face transformers as MixtralForCausalLM, runs it on the tokens that
`moe eval --dump-logits` wrote, and prints the largest absolute difference
between the two sets of logits. With --generate CKPT (a checkpoint trained
with a SentencePiece model.tokenizer), it instead checks the tokenizer and
generation: AutoTokenizer + MixtralForCausalLM.generate (greedy) on the
exported folder must print the same text as `moe generate` on the checkpoint,
for every --prompt, and encode each prompt to the same ids as sentencepiece.

Optional, not part of the default tests; it needs torch, transformers and
safetensors. The CPU wheel of torch is enough (about 200 MB instead of the
default wheel's several GB of CUDA libraries); sentencepiece and protobuf for
--generate:

    python3 -m venv .venv
    .venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch
    .venv/bin/pip install transformers safetensors
    build/moe export runs/tiny --hf out/hf
    build/moe eval runs/tiny --samples 0 --dump-logits out/logits.safetensors
    .venv/bin/python scripts/hf_check.py out/hf out/logits.safetensors
    .venv/bin/python scripts/hf_check.py out/hf --generate CKPT --prompt 'The router'

Exit status 0 when the difference is within --tol (default 1e-4) or every
answer agrees, 1 otherwise, 2 on bad usage or input.
"""
import argparse
import subprocess
import sys


def escape(text: str) -> str:
    """Control characters as moe generate prints them (\\xNN)."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c for c in text)


def check_generate(args) -> int:
    try:
        import torch
        import sentencepiece as spm
        from transformers import AutoTokenizer, MixtralForCausalLM
    except ImportError as e:
        print(f"hf_check: {e} (pip install torch transformers sentencepiece protobuf)",
              file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    sp = spm.SentencePieceProcessor(model_file=f"{args.hf_dir}/tokenizer.model")
    model = MixtralForCausalLM.from_pretrained(
        args.hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    bad = 0
    for prompt in args.prompt:
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = [sp.bos_id()] + sp.encode(prompt)
        if ids[0].tolist() != ref:
            print(f"prompt {prompt!r}: AutoTokenizer ids {ids[0].tolist()} != "
                  f"sentencepiece {ref}")
            bad += 1
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.max_new, eos_token_id=sp.eos_id(),
                                 pad_token_id=sp.eos_id())
        hf = escape(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        run = subprocess.run([args.moe, "generate", args.generate, "--task", args.task,
                              "--prompt", prompt, "--max-new", str(args.max_new), "--quiet"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"hf_check: moe generate failed: {run.stderr.strip()}", file=sys.stderr)
            return 2
        moe = run.stdout.rstrip("\n")
        same = moe == hf
        bad += not same
        print(f"{'same' if same else 'DIFFERENT'}: prompt {prompt!r} ({len(ref)} tokens)\n"
              f"  moe generate:  {moe!r}\n  transformers:  {hf!r}")
    print(f"{len(args.prompt) - bad} of {len(args.prompt)} prompts agree")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", help="folder written by moe export --hf")
    ap.add_argument("dump", nargs="?", help="file written by moe eval --dump-logits")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest abs difference accepted")
    ap.add_argument("--generate", metavar="CKPT",
                    help="compare moe generate on CKPT with transformers' generate")
    ap.add_argument("--prompt", action="append", help="prompt for --generate (repeatable)")
    ap.add_argument("--max-new", type=int, default=16, help="tokens to generate per prompt")
    ap.add_argument("--task", default="all", help="task for moe generate (default all)")
    ap.add_argument("--moe", default="build/moe", help="the moe binary (default build/moe)")
    args = ap.parse_args()
    if args.generate:
        if not args.prompt:
            ap.error("--generate needs at least one --prompt")
        return check_generate(args)
    if not args.dump:
        ap.error("give the logits dump, or --generate CKPT --prompt TEXT")
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
