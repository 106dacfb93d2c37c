#!/usr/bin/env python3
"""Training tokens/s of moe against transformers' MixtralForCausalLM on the
same model: build/bench/train_step on a config (default configs/tiny.json,
changed by --set KEY=VALUE as moe train --set does, always dropless) against
the same dims in transformers, with its eager experts (a loop over experts)
and its grouped-matmul experts (experts_implementation="grouped_mm"), same
batch, sequence length, steps, AdamW (betas 0.9/0.95, clipping at
train.grad_clip, weight decay on the matrices) and thread count.

Every run is a child process; the three kinds are interleaved for --rounds
rounds, each run prints one JSON line, and a last line has the medians, the
ratios moe / eager and moe / grouped_mm and the load average. On a shared
machine tokens/s mostly measure how much CPU each run got (torch's OpenMP
threads spin while waiting, the moe pool sleeps), so the lines also give
tokens per CPU second (user + system time of all threads; torch's spinning
counts against it) and their ratios. Optional, not
part of the tests; needs torch and transformers (plain PyPI works):

    python3 -m venv .venv && .venv/bin/pip install torch transformers
    cmake --build build --target bench_train_step
    .venv/bin/python bench/hf_mixtral_bench.py --machine NAME
    .venv/bin/python bench/hf_mixtral_bench.py --machine NAME --set model.d_model=512 \\
        --set model.d_ff=1024 --set model.seq_len=256

Correspondence (as moe export --hf writes it): d_model -> hidden_size, the
expert width (moe.d_expert, else model.d_ff) -> intermediate_size, head_dim =
d_model / n_heads, rope_theta, norm_eps -> rms_norm_eps, tie_embeddings ->
tie_word_embeddings, router.top_k -> num_experts_per_tok; the Mixtral router
renormalises the top-k weights and has no capacity limit (dropless), and its
load-balancing loss (router.aux_loss_coef) is added as moe adds its own.
Attention is transformers' default (sdpa). Only moe.every = 1 with one
expert count and no shared expert has a Mixtral counterpart.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def set_key(cfg: dict, assignment: str) -> None:
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise SystemExit(f"hf_mixtral_bench: --set {assignment!r}: expected KEY=VALUE")
    try:
        value = json.loads(value)
    except ValueError:
        pass  # a bare string (an enum value)
    node = cfg
    *path, last = key.split(".")
    for p in path:
        node = node.setdefault(p, {})
    node[last] = value


def hf_dims(cfg: dict) -> dict:
    """The transformers side of the config (defaults as in trainer/config.c)."""
    m, moe, r, t = (cfg.get(k, {}) for k in ("model", "moe", "router", "train"))
    E = moe.get("num_experts", 8)
    if isinstance(E, list):
        if len(set(E)) != 1:
            raise SystemExit("hf_mixtral_bench: moe.num_experts varies per layer; Mixtral has one")
        E = E[0]
    if moe.get("every", 1) != 1 or moe.get("shared_experts", 0):
        raise SystemExit("hf_mixtral_bench: Mixtral has an MoE block in every layer and no "
                         "shared expert (moe.every = 1, moe.shared_experts = 0)")
    d, d_ff = m.get("d_model", 128), m.get("d_ff", 256)
    heads = m.get("n_heads", 4)
    return {
        "vocab_size": m.get("vocab_size", 256), "hidden_size": d,
        "intermediate_size": moe.get("d_expert", 0) or d_ff,
        "num_hidden_layers": m.get("n_layers", 4), "num_attention_heads": heads,
        "num_key_value_heads": m.get("n_kv_heads", heads), "head_dim": d // heads,
        "max_position_embeddings": m.get("seq_len", 64), "rms_norm_eps": m.get("norm_eps", 1e-5),
        "rope_theta": m.get("rope_theta", 10000.0),
        "tie_word_embeddings": m.get("tie_embeddings", True), "num_local_experts": E,
        "num_experts_per_tok": r.get("top_k", 2), "router_jitter_noise": 0.0,
        "router_aux_loss_coef": r.get("aux_loss_coef", 0.01), "output_router_logits": True,
        "batch_size": t.get("batch_size", 8), "lr": t.get("lr", 3e-4),
        "grad_clip": t.get("grad_clip", 1.0), "weight_decay": t.get("weight_decay", 0.1),
    }


def torch_worker(args) -> int:
    """One run of transformers with experts implementation args.worker."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with open(args.config) as f:
        dims = hf_dims(json.load(f))
    train = {k: dims.pop(k) for k in ("batch_size", "lr", "grad_clip", "weight_decay")}
    hf = MixtralConfig(**dims)
    model = MixtralForCausalLM._from_config(hf, experts_implementation=args.worker,
                                            dtype=torch.float32)
    model.train()
    used = model.config._experts_implementation
    if used != args.worker:
        raise SystemExit(f"hf_mixtral_bench: asked for experts {args.worker}, got {used}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train["weight_decay"]},
              {"params": rest, "weight_decay": 0.0}]
    try:  # the fused CPU AdamW where this torch has it: torch at its best
        opt = torch.optim.AdamW(groups, lr=train["lr"], betas=(0.9, 0.95), eps=1e-8, fused=True)
        fused = True
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(groups, lr=train["lr"], betas=(0.9, 0.95), eps=1e-8)
        fused = False
    B, T, V = train["batch_size"], dims["max_position_embeddings"], dims["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    coef = dims["router_aux_loss_coef"]
    t0 = r0 = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            t0, r0 = time.perf_counter(), os.times()
        tok = torch.randint(0, V, (B, T + 1), generator=gen)
        out = model(input_ids=tok[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), tok[:, 1:].reshape(-1))
        if out.aux_loss is not None:
            loss = loss + coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train["grad_clip"])
        opt.step()
    wall, r1 = time.perf_counter() - t0, os.times()
    print(json.dumps({
        "tokens_per_s": round(B * T * args.steps / wall), "ms_per_step": 1e3 * wall / args.steps,
        "user_s": round(r1.user - r0.user, 3), "sys_s": round(r1.system - r0.system, 3),
        "params": sum(p.numel() for p in model.parameters()), "fused_adamw": fused,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "attention": model.config._attn_implementation}))
    return 0


def run(cmd) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"hf_mixtral_bench: {' '.join(cmd)} failed:\n{p.stderr.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.json")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured transformers steps first "
                    "(train_step always runs 5; torch's CPU kernels are slow on their first "
                    "shapes, 10 steps settle them at tiny)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (moe: its pool "
                    "takes the cores of its affinity mask; MOE_NUM_THREADS caps it)")
    ap.add_argument("--impl", default="eager,grouped_mm", help="transformers experts "
                    "implementations to compare")
    ap.add_argument("--train-step", default="build/bench/train_step")
    ap.add_argument("--machine", default="", help="recorded in every line")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally clauses
    if args.worker:
        return torch_worker(args)
    with open(args.config) as f:
        cfg = json.load(f)
    for s in args.set:
        set_key(cfg, s)
    set_key(cfg, "router.capacity_factor=0")  # dropless, as Mixtral
    dims = hf_dims(cfg)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
        path = f.name
    env = dict(os.environ, MOE_NUM_THREADS=str(args.threads))
    shape = {k: dims[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_local_experts", "num_experts_per_tok", "batch_size",
                                  "max_position_embeddings")}
    common = {"machine": args.machine, "config": args.config, "set": args.set,
              "threads": args.threads, "steps": args.steps, "shape": shape}
    kinds = ["moe"] + [k for k in args.impl.split(",") if k]
    tps = {k: [] for k in kinds}
    cpu = {k: [] for k in kinds}  # tokens per CPU second (user + sys, all threads)
    try:
        for rnd in range(args.rounds):
            for kind in kinds:
                load = os.getloadavg()[0]
                if kind == "moe":
                    p = subprocess.run([args.train_step, path, "--steps", str(args.steps),
                                        "--machine", args.machine],
                                       capture_output=True, text=True, env=env)
                    if p.returncode != 0:
                        raise SystemExit(f"hf_mixtral_bench: {args.train_step} failed:\n"
                                         f"{p.stderr.strip()}")
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                    r = {k: r[k] for k in ("tokens_per_s", "ms_per_step", "user_s", "sys_s",
                                           "params", "share") if k in r}
                else:
                    r = run([sys.executable, __file__, "--worker", kind, "--config", path,
                             "--steps", str(args.steps), "--warmup", str(args.warmup),
                             "--threads", str(args.threads)])
                tps[kind].append(r["tokens_per_s"])
                r["tokens_per_cpu_s"] = round(
                    dims["batch_size"] * dims["max_position_embeddings"] * args.steps /
                    max(r["user_s"] + r["sys_s"], 1e-9))
                cpu[kind].append(r["tokens_per_cpu_s"])
                print(json.dumps({"bench": "hf_mixtral", "impl": kind, "round": rnd, **common,
                                  "load1_before": load, **r}), flush=True)
    finally:  # also on Ctrl-C / SIGTERM (see signal handler)
        os.unlink(path)
    med = {k: statistics.median(v) for k, v in tps.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    print(json.dumps({"bench": "hf_mixtral_summary", **common, "rounds": args.rounds,
                      "median_tokens_per_s": med,
                      "ratio": {f"moe/{k}": round(med["moe"] / med[k], 3) for k in kinds[1:]},
                      "median_tokens_per_cpu_s": mcpu,
                      "cpu_ratio": {f"moe/{k}": round(mcpu["moe"] / mcpu[k], 3)
                                    for k in kinds[1:]},
                      "load1_after": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
