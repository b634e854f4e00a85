"""bin/bench activations: layer activation offloading against no offloading and torch's save_on_cpu.

For each sequence length, the built-in GPT in bf16 runs forward+backward with the first k layers offloaded:
`none` (k=0), `offload` (engine.offload), `offload-db` (with double buffering) and `save_on_cpu`
(torch.autograd.graph.save_on_cpu(pin_memory=True) around the same k layers). Reported per row: median
iteration, forward and backward times; peak activation memory (peak allocated minus parameters and
gradients); bytes moved each way; the floor max(compute, bytes/bandwidth) of forward plus that of backward,
with compute from the k=0 row and the PCIe bandwidth of each direction measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.bench import no_cuda
from engine.models.gpt import GPT, gpt_loss
from engine.offload import apply_activation_offloading

GB = 1e9


def measure_bandwidth(nbytes: int = 2 << 30, reps: int = 5) -> tuple[float, float]:
    """(D2H, H2D) bytes/s of one pinned copy on a side stream, median of `reps`."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    out = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out.append(nbytes / statistics.median(times[1:]))
    del dev, host
    return out[0], out[1]


class SaveOnCpuLayers:
    """torch's save_on_cpu(pin_memory=True) around the first k layers; counts the bytes it copies."""

    def __init__(self, layers: torch.nn.ModuleList, k: int) -> None:
        self.layers, self.bytes = list(layers[:k]), 0
        for layer in self.layers:
            layer.forward = self._wrap(layer.forward)

    def _wrap(self, forward):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
            pack = ctx.pack_hook

            def counting(t: torch.Tensor) -> object:
                self.bytes += t.numel() * t.element_size()
                return pack(t)

            ctx.pack_hook = counting
            with ctx:
                return forward(*args, **kwargs)

        return run

    def host_bytes(self) -> int:
        return self.bytes

    def remove(self) -> None:
        for layer in self.layers:
            del layer.forward


def run_config(model: GPT, mode: str, k: int, tokens: torch.Tensor, labels: torch.Tensor, args, base: int) -> dict:  # noqa: ANN001
    if mode == "save_on_cpu":
        off = SaveOnCpuLayers(model.layers, k)
    else:
        off = apply_activation_offloading(model, num_layers=k, double_buffering=mode == "offload-db")
    fwd, bwd, it, moved = [], [], [], 0
    torch.cuda.reset_peak_memory_stats()
    t_first = time.perf_counter()
    for i in range(args.warmup + args.iters):
        if mode == "save_on_cpu":
            off.bytes = 0
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e[0].record()
        loss = gpt_loss(model(tokens), labels)
        e[1].record()
        moved = off.host_bytes()
        loss.backward()
        e[2].record()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        del loss
        if i == 0:
            first = t1 - t_first
        if i >= args.warmup:
            fwd.append(e[0].elapsed_time(e[1]))
            bwd.append(e[1].elapsed_time(e[2]))
            it.append((t1 - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base
    off.remove()
    return {
        "mode": mode, "k": k, "iter_ms": statistics.median(it), "fwd_ms": statistics.median(fwd),
        "bwd_ms": statistics.median(bwd), "peak_act_gib": peak / 2**30, "moved_gb": moved / GB,
        "first_iter_s": first,
    }  # fmt: skip


def bench_seq(seq: int, args, bw: tuple[float, float], emit) -> list[dict]:  # noqa: ANN001
    torch.manual_seed(0)
    model = GPT(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, seq_length=seq,
        vocab_size=args.vocab,
    ).to("cuda", torch.bfloat16)  # fmt: skip
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, seq), device="cuda")
    labels = torch.randint(0, args.vocab, (args.micro_batch, seq), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    rows: list[dict] = []
    # largest k first in each family: smaller ones then reuse the pinned blocks the largest one cached
    plan = [("none", 0)] + [("offload", k) for k in sorted(args.ks, reverse=True) if k]
    plan += [("offload-db", k) for k in sorted(args.db_ks, reverse=True) if k]
    plan += [("save_on_cpu", k) for k in sorted(args.baseline_ks, reverse=True) if k]
    for i, (mode, k) in enumerate(plan):
        if mode == "save_on_cpu" and plan[i - 1][0] != "save_on_cpu":
            torch._C._host_emptyCache()  # our pool's pinned blocks: their sizes don't suit save_on_cpu's
        try:
            row = run_config(model, mode, k, tokens, labels, args, base)
        except Exception as exc:  # keep the other rows
            row = {"mode": mode, "k": k, "error": f"{type(exc).__name__}: {exc}"[:300]}
        row["seq"] = seq
        rows.append(row)
        emit(row)
    torch._C._host_emptyCache()
    comp = next((r for r in rows if r["mode"] == "none" and "error" not in r), None)
    for r in rows:
        if "error" in r or comp is None:
            continue
        moved = r["moved_gb"] * GB
        r["floor_ms"] = max(comp["fwd_ms"], moved / bw[0] * 1e3) + max(comp["bwd_ms"], moved / bw[1] * 1e3)
        r["x_floor"] = r["iter_ms"] / r["floor_ms"]
        r["overhead"] = r["iter_ms"] / comp["iter_ms"] - 1
        soc = next((s for s in rows if s["mode"] == "save_on_cpu" and s["k"] == r["k"] and "error" not in s), None)
        if soc is not None and r["mode"] != "save_on_cpu":
            r["speedup_vs_save_on_cpu"] = soc["iter_ms"] / r["iter_ms"]
    del model
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], bw: tuple[float, float]) -> str:
    head = (
        f"PCIe measured: D2H {bw[0] / GB:.1f} GB/s, H2D {bw[1] / GB:.1f} GB/s\n"
        "| seq | mode | k | iter ms | fwd ms | bwd ms | peak act GiB | moved GB (each way) | floor ms | x floor "
        "| vs save_on_cpu | vs k=0 |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['mode']} | {r['k']} | error: {r['error']} |")
            continue
        soc = f"{r['speedup_vs_save_on_cpu']:.2f}x" if "speedup_vs_save_on_cpu" in r else ""
        lines.append(
            f"| {r['seq']} | {r['mode']} | {r['k']} | {r['iter_ms']:.0f} | {r['fwd_ms']:.0f} | {r['bwd_ms']:.0f} "
            f"| {r['peak_act_gib']:.1f} | {r['moved_gb']:.2f} | {r.get('floor_ms', 0):.0f} | {r.get('x_floor', 0):.2f} "
            f"| {soc} | {r.get('overhead', 0) * 100:+.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bin/bench activations", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 12, 23], help="offloaded layer counts (k=0 always runs)")
    p.add_argument("--db-ks", type=int, nargs="*", default=[23], help="k for the double-buffered rows")
    p.add_argument("--baseline-ks", type=int, nargs="*", default=[12, 23], help="k for the save_on_cpu rows")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None, help="append each row as a JSON line here")
    args = p.parse_args(argv)
    if refusal := no_cuda("bin/bench activations"):
        print(refusal, file=sys.stderr)
        return 2
    bw = measure_bandwidth()
    print(f"bandwidth D2H {bw[0] / GB:.1f} GB/s, H2D {bw[1] / GB:.1f} GB/s", flush=True)

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    rows = [r for seq in args.seq for r in bench_seq(seq, args, bw, emit)]
    print("bin/bench activations " + " ".join(argv))
    print(table(rows, bw))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"bandwidth": bw, "rows": rows}) + "\n")
    return 0
