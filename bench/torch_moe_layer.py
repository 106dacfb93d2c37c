#!/usr/bin/env python3
"""The MoE layer of bench/gpu_moe_layer written in plain PyTorch, forward +
backward, timed on the same GPU in the same command as the project's layer.

Layer: gate logits x W_g^T in fp32, softmax, top-k renormalised, dropless;
experts SwiGLU, y_e = (silu(x w1^T) * x w3^T) w2^T, combined with the router
weights. Variants:
  loop     sort the (token, expert) assignments by expert, gather the rows,
           one matmul pair per expert, index_add the weighted rows back
           (what MoE layers written in PyTorch do);
  grouped  the same with torch._grouped_mm over the sorted rows (one call per
           projection), where this torch has it and the device runs it.
Each variant's time is the best of --reps (after --warmup), with CUDA events,
as gpu_moe_layer takes its best. With --ours CMD (e.g. "build/bench/gpu_moe_layer
--shape 16384,4096,14336,8,2 --capacity 0") the project's bench runs in the
same command and every line gets speedup_vs_torch = torch time / the project's.
One JSON line per variant, each with the device's name.

    python3 bench/torch_moe_layer.py --shape 16384,4096,14336,8,2 \\
        --ours "build/bench/gpu_moe_layer --shape 16384,4096,14336,8,2 --capacity 0"

Optional, not part of the tests; runs on the CPU too (small shapes) to check it.
"""
import argparse
import json
import shlex
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def route(x, wg, k):
    logits = (x.float() @ wg.float().t())
    probs = torch.softmax(logits, dim=-1)
    w, idx = torch.topk(probs, k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype), idx


def dispatch(x, idx, E):
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    token = order // idx.shape[1]
    return order, token, counts


def layer_loop(x, wg, w13, w2, k):
    T, D = x.shape
    E, H2, _ = w13.shape
    w, idx = route(x, wg, k)
    order, token, counts = dispatch(x, idx, E)
    xs = x[token]
    out_rows = []
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        ab = xs[start:start + c] @ w13[e].t()
        a, b = ab.split(H2 // 2, dim=-1)
        out_rows.append((F.silu(a) * b) @ w2[e].t())
        start += c
    ys = torch.cat(out_rows) * w.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, token, ys)


def layer_grouped(x, wg, w13, w2, k):
    T, D = x.shape
    E, H2, _ = w13.shape
    w, idx = route(x, wg, k)
    order, token, counts = dispatch(x, idx, E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[token]
    ab = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    a, b = ab.split(H2 // 2, dim=-1)
    ys = torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)
    ys = ys * w.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, token, ys)


def timed(fn, dev, reps, warmup):
    best, times = float("inf"), []
    for r in range(warmup + reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            t = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            fn()
            t = 1e3 * (time.perf_counter() - t0)
        if r >= warmup:
            times.append(t)
            best = min(best, t)
    times.sort()
    return best, times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="16384,4096,14336,8,2", help="T,D,H,E,k")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ours", default="", help="the project's bench command (one JSON line with ms)")
    ap.add_argument("--check", action="store_true", help="compare the variants' outputs first")
    a = ap.parse_args()
    T, D, H, E, k = (int(v) for v in a.shape.split(","))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)

    def param(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt).requires_grad_()

    x = param(T, D, scale=1.0)
    wg = param(E, D, scale=1.0 / D ** 0.5)
    w13 = param(E, 2 * H, D, scale=1.0 / D ** 0.5)
    w2 = param(E, D, H, scale=1.0 / H ** 0.5)
    dy = torch.randn(T, D, generator=g).to(dev, dt)

    variants = {"loop": layer_loop}
    if hasattr(torch, "_grouped_mm"):
        variants["grouped"] = layer_grouped
    ours = None
    if a.ours:
        out = subprocess.run(shlex.split(a.ours), capture_output=True, text=True, check=True).stdout
        lines = [json.loads(s) for s in out.splitlines() if s.startswith("{")]
        ours = next((j for j in lines if "ms" in j), None)
        if ours is None:
            sys.exit(f"torch_moe_layer: no timing from {a.ours!r}: {out.strip()}")
    ref = None
    for vname, fn in variants.items():
        def step():
            for p in (x, wg, w13, w2):
                p.grad = None
            fn(x, wg, w13, w2, k).backward(dy)
        try:
            if a.check:
                y = fn(x, wg, w13, w2, k).float()
                if ref is None:
                    ref = y
                err = ((y - ref).norm() / ref.norm()).item()
            best, med = timed(step, dev, a.reps, a.warmup)
        except (RuntimeError, NotImplementedError) as e:  # grouped_mm off its devices/dtypes
            print(json.dumps({"bench": "torch_moe_layer", "device": name, "variant": vname,
                              "skipped": str(e).splitlines()[0]}))
            continue
        line = {"bench": "torch_moe_layer", "device": name, "variant": vname, "dtype": a.dtype,
                "torch": torch.__version__, "T": T, "D": D, "H": H, "E": E, "k": k,
                "ms": round(best, 3), "ms_median": round(med, 3)}
        if a.check:
            line["rel_diff_vs_loop"] = err
        if ours is not None:
            line["ours_ms"] = ours["ms"]
            line["speedup_vs_torch"] = round(best / ours["ms"], 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
