"""bf16 against FP8 (train.fp8, TE's recipe) on the built-in GPT with Transformer Engine layers, each without and
with offload (activations of all layers but the last, the hybrid optimizer at f=0.5): seconds per iteration,
tokens/s, model TFLOP/s, peak GPU memory and the losses, one in-process engine run per row on the stdlib data.

    python3 tools/fp8_bench.py [--iters 12 --warmup 3 --recipe delayed --format hybrid]
    python3 tools/fp8_bench.py --tiny     # CPU check: tiny shape, bf16 rows run, FP8 rows show the refusal
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402
from engine.bench.scale import Shape  # noqa: E402
from engine.config import ConfigError  # noqa: E402

ROWS = ("bf16", "bf16+offload", "fp8", "fp8+offload")


def config(shape: Shape, row: str, a: argparse.Namespace) -> dict:
    gpu = not a.tiny
    cfg = {
        "model": {"num_layers": shape.layers, "hidden_size": shape.hidden, "num_attention_heads": shape.heads,
                  "seq_length": shape.seq, "vocab_size": shape.vocab, "use_te": gpu},
        "optimizer": {"lr": a.lr, "lr_warmup_iters": a.lr_warmup, "lr_decay_iters": 1000},
        "train": {"train_iters": a.warmup + a.iters, "global_batch_size": a.global_batch,
                  "micro_batch_size": a.micro_batch, "precision": "bf16", "params_dtype": "half" if gpu else "fp32",
                  "device": "cuda" if gpu else "cpu"},
        "logging": {"progress_bar": False, "metrics_file": None},
        "data": {"max_bytes": 4 << 20},
    }  # fmt: skip
    if row.startswith("fp8"):
        cfg["train"].update(fp8=a.format, fp8_recipe=a.recipe)
    if row.endswith("+offload"):
        if gpu:
            cfg["model"].update(cpu_offloading=True, cpu_offloading_num_layers=shape.layers - 1)
        cfg["optimizer"].update(optimizer_cpu_offload=True, use_distributed_optimizer=True,
                                optimizer_offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    return cfg


def held_gib() -> float:
    """GPU memory allocated now (GiB): before a row, what earlier rows left behind (counted in this row's peak)."""
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def run(shape: Shape, row: str, a: argparse.Namespace) -> dict:
    held = held_gib()
    try:
        eng = engine.initialize(config=config(shape, row, a))[0]
    except (ConfigError, SystemExit) as e:
        return {"row": row, "refused": str(e).strip().splitlines()[-1]}
    cuda = eng.device.type == "cuda"
    losses = [float(eng.train_batch()) for _ in range(a.warmup)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses += [float(eng.train_batch()) for _ in range(a.iters)]
    if cuda:
        torch.cuda.synchronize()
    s = (time.perf_counter() - t0) / a.iters
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    session = getattr(eng.offloader, "session", None)  # the most one layer's forward copied to the host
    moved = max(session.peak_call_bytes, default=0) / 2**20 if session is not None else float("nan")
    if hasattr(eng.optimizer, "close"):
        eng.optimizer.close()  # its worker threads and host buffers go now, not at some later collection
    del eng
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    tokens = a.global_batch * shape.seq
    return {"row": row, "s": s, "tokens_s": tokens / s, "tflops": shape.flops_per_token()["total"] * tokens / s / 1e12,
            "peak": peak, "held": held, "left": held_gib(), "moved": moved, "losses": losses}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU check at a tiny shape")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=12, help="timed iterations")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    p.add_argument("--recipe", default="delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8"])
    p.add_argument("--format", default="hybrid", choices=["hybrid", "e4m3"])
    p.add_argument("--rows", default=",".join(ROWS))
    # a few Adam steps from initialisation at a 1 B shape: 3e-4 warmed over 2 steps made every row's loss rise, and
    # tools/short_lr_gpu.sh found 1e-5 rising too; 1e-6 is the constant lr whose loss fell (docs/BENCHMARKS.md)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--lr-warmup", type=int, default=0, help="lr warm-up iterations")
    a = p.parse_args()
    if a.tiny:
        a.layers, a.hidden, a.heads, a.seq, a.micro_batch, a.global_batch, a.iters, a.warmup = 2, 64, 4, 32, 2, 2, 2, 1
    shape = Shape(a.layers, a.hidden, a.heads, a.seq, 32768 if not a.tiny else 256)
    layers = "torch layers (CPU check)" if a.tiny else "TE layers"
    print(
        f"built-in GPT with {layers}: {shape.layers} x {shape.hidden}, seq {shape.seq}, {shape.params() / 1e9:.2f} B "
        f"params; global batch {a.global_batch} (micro {a.micro_batch}); FP8 {a.format}/{a.recipe}; offload = "
        f"activations of {shape.layers - 1} layers + hybrid optimizer f=0.5; {a.warmup} + {a.iters} iterations, "
        f"lr {a.lr:g} (warm-up {a.lr_warmup})"
    )
    print(f"\n{'row':<14} {'s/iter':>7} {'tokens/s':>9} {'TFLOP/s':>8} {'peak GiB':>9} {'held GiB':>9} "
          f"{'left GiB':>9} {'moved MiB':>9} {'loss first':>10} {'loss last':>9}")  # fmt: skip
    results = []
    for row in a.rows.split(","):  # each line as its row ends: a run cut short still shows the rows done
        r = run(shape, row, a)
        results.append(r)
        if "refused" in r:
            print(f"{r['row']:<14} refused: {r['refused']}")
            continue
        print(f"{r['row']:<14} {r['s']:7.3f} {r['tokens_s']:9.0f} {r['tflops']:8.1f} {r['peak']:9.1f} "
              f"{r['held']:9.2f} {r['left']:9.2f} {r['moved']:9.1f} {r['losses'][0]:10.4f} "
              f"{r['losses'][-1]:9.4f}{'  ROSE: lower --lr' if r['losses'][-1] > r['losses'][0] else ''}")  # fmt: skip
    for r in results:
        if "losses" in r:
            print(f"losses {r['row']}: " + " ".join(f"{x:.4f}" for x in r["losses"]))
    print(
        "TFLOP/s: model FLOPs per token 6*N + 12*L*h*s (engine/bench/scale.py FORMULA); held/left GiB: GPU memory "
        "allocated before the row / after it was dropped (non-zero: an earlier row's memory in this row's peak); "
        "moved MiB: the most one layer's forward of one micro-batch copied to the host (activation offload)"
    )
    print("command: python3 tools/fp8_bench.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
