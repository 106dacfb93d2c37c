#!/usr/bin/env python3
"""Reference check of `moe export --hf`: loads the exported folder with Hugging
Face transformers as MixtralForCausalLM, runs it on the tokens that
`moe eval --dump-logits` wrote, and prints the largest absolute difference
between the two sets of logits. With --generate CKPT (a checkpoint trained
with a SentencePiece model.tokenizer), it instead checks the tokenizer and
generation: AutoTokenizer + MixtralForCausalLM.generate (greedy) on the
exported folder must print the same text as `moe generate` on the checkpoint,
for every --prompt, and encode each prompt to the same ids as sentencepiece;
a byte-token checkpoint is compared on the prompt's bytes (moe generate --raw:
no task marker) up to the first newline.

A task export (moe export --task NAME, config.json's moe_task) is compared on
the dump's sequences of that task only, and moe generate runs with --task NAME;
--task NAME checks that the export is that task's.

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
    build/moe export runs/task --hf out/hf-copy --task copy
    .venv/bin/python scripts/hf_check.py out/hf-copy out/logits.safetensors --task copy

Exit status 0 when the difference is within --tol (default 1e-4) or every
answer agrees, 1 otherwise, 2 on bad usage or input.
"""
import argparse
import json
import subprocess
import sys


def escape(text: str) -> str:
    """Control characters as moe generate prints them (\\xNN)."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c for c in text)


def generate_bytes(args, model, torch) -> int:
    """A byte-token export: ids are the prompt's UTF-8 bytes, an answer ends at a newline."""
    bad = 0
    for prompt in args.prompt:
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.max_new, eos_token_id=10, pad_token_id=10)
        ans = out[0, ids.shape[1]:].tolist()
        if ans and ans[-1] == 10:
            ans = ans[:-1]
        hf = "".join(chr(b) if 32 <= b < 127 else f"\\x{b & 0xff:02x}" for b in ans)
        run = subprocess.run([args.moe, "generate", args.generate, "--task", args.task, "--raw",
                              "--prompt", prompt, "--max-new", str(args.max_new), "--quiet"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"hf_check: moe generate failed: {run.stderr.strip()}", file=sys.stderr)
            return 2
        moe = run.stdout.rstrip("\n")
        same = moe == hf
        bad += not same
        print(f"{'same' if same else 'DIFFERENT'}: prompt {prompt!r} ({ids.shape[1]} bytes)\n"
              f"  moe generate:  {moe!r}\n  transformers:  {hf!r}")
    print(f"{len(args.prompt) - bad} of {len(args.prompt)} prompts agree")
    return 1 if bad else 0


def check_generate(args) -> int:
    try:
        import torch
        from transformers import AutoTokenizer, MixtralForCausalLM
        if args.config.get("moe_tokenizer") != "bytes":
            import sentencepiece as spm
    except ImportError as e:
        print(f"hf_check: {e} (pip install torch transformers sentencepiece protobuf)",
              file=sys.stderr)
        return 2
    model = MixtralForCausalLM.from_pretrained(
        args.hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if args.config.get("moe_tokenizer") == "bytes":
        return generate_bytes(args, model, torch)
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    sp = spm.SentencePieceProcessor(model_file=f"{args.hf_dir}/tokenizer.model")
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
    ap.add_argument("--task", help="task for moe generate (default: the export's task, else "
                    "all); the export must be that task's when it is a task export")
    ap.add_argument("--moe", default="build/moe", help="the moe binary (default build/moe)")
    args = ap.parse_args()
    try:
        with open(f"{args.hf_dir}/config.json") as f:
            args.config = json.load(f)
    except (OSError, ValueError) as e:
        print(f"hf_check: {args.hf_dir}/config.json: {e}", file=sys.stderr)
        return 2
    exported = args.config.get("moe_task")
    if args.task and exported and args.task != exported:
        print(f"hf_check: {args.hf_dir} is the export of task {exported!r}, not {args.task!r}",
              file=sys.stderr)
        return 2
    args.task = args.task or exported or "all"
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
    if exported:  # a task's sub-model: only the dump's sequences of that task
        rows = ref["task_ids"] == args.config["moe_task_id"]
        if not rows.any():
            print(f"hf_check: the dump has no sequence of task {exported!r} "
                  f"(task_ids {ref['task_ids'].tolist()}); dump more batches or another seed",
                  file=sys.stderr)
            return 2
        tokens, logits = tokens[rows], logits[rows]
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
    print(f"sequences {tokens.shape[0]} x {tokens.shape[1]} tokens, vocab {logits.shape[2]}"
          + (f", task {exported}" if exported else ""))
    print(f"max abs logit difference {worst:.3e} (largest |logit| {scale:.3f}, "
          f"mean abs difference {diff.mean().item():.3e})")
    print(f"argmax agreement {100 * agree:.2f}%")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
