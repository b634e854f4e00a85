"""The seed's success criteria for megatron-core's GPTModel, one bin/train run per cell: loss against the
non-offloaded baseline (max |delta| < 1e-3) for activation offload, optimizer offload at 0.25/0.5/1 and both,
megatron's own HybridDeviceOptimizer at 0.5, with Transformer Engine layers and without; then peak GPU memory
against the offload fraction (the same runs). The warm-up is checked too: the baseline's largest rise above its
running minimum is printed, so a criterion measured across a divergence shows as one.

    python3 tools/megatron_parity.py --out DIR [--te both|on|off] [--iters 200] [--jobs N] [--tiny]

--jobs N: N cells' runs side by side (each its own process: the losses and each process's peak memory are what
they are alone; ms/iter is then not a speed figure). --tiny: CPU, fp32, a 2-layer 32-wide model, 4 iterations,
no TE, no megatron HDO (a check of this script).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHAPE = ["model.implementation=megatron", "model.num_layers=4", "model.hidden_size=512",
         "model.num_attention_heads=8", "model.seq_length=512", "train.micro_batch_size=4",
         "train.global_batch_size=8", "train.precision=bf16", "train.params_dtype=half", "optimizer.lr=3e-4",
         "optimizer.min_lr=3e-5", "optimizer.lr_decay_style=cosine", "optimizer.clip_grad=1.0"]  # fmt: skip
TINY = ["model.implementation=megatron", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.seq_length=16", "train.micro_batch_size=2", "train.global_batch_size=2", "train.precision=fp32",
        "train.device=cpu"]  # fmt: skip
OPT = "optimizer.optimizer_cpu_offload=true optimizer.use_distributed_optimizer=true".split()
OVERLAP = ["optimizer.overlap_cpu_optimizer_d2h_h2d=true"]


def act(layers: int) -> list[str]:
    return ["model.cpu_offloading=true", f"model.cpu_offloading_num_layers={layers}"]


def cells(layers: int, tiny: bool) -> list[tuple[str, str, list[str]]]:
    """(name, baseline name, overrides); the fraction cells also make the memory table."""
    out = [("base", "base", []), ("act", "base", act(layers - 1))]
    for f in (0.25, 0.5, 1.0):
        out.append((f"opt{f:g}", "base", [*OPT, *OVERLAP, f"optimizer.optimizer_offload_fraction={f}"]))
    both = [*act(layers - 1), *OPT, *OVERLAP, "optimizer.optimizer_offload_fraction=0.5"]
    out.append(("act+opt0.5", "base", both))
    if not tiny:  # megatron-core's HybridDeviceOptimizer needs CUDA; its baseline is megatron's optimizer unoffloaded
        hdo = ["optimizer.implementation=megatron"]
        out.append(("hdo-base", "hdo-base", hdo))
        out.append(("hdo0.5", "hdo-base", [*hdo, *OPT, "optimizer.optimizer_offload_fraction=0.5"]))
    return out


def run(name: str, overrides: list[str], out: Path) -> list[dict]:
    metrics = out / f"{name}.jsonl"
    log = out / f"{name}.log"
    cmd = [sys.executable, "bin/train", *overrides, "logging.progress_bar=false", f"logging.metrics_file={metrics}"]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print(f"{name}: bin/train exited {rc}: {log.read_text().strip().splitlines()[-1:]}")
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "iteration" in r]


def rise(losses: list[float]) -> float:
    """The largest rise of the loss above its running minimum (0 for a run that never climbs back)."""
    low, worst = float("inf"), 0.0
    for x in losses:
        low = min(low, x)
        worst = max(worst, x - low)
    return worst


def table(te: bool, iters: int, tiny: bool, out: Path, jobs: int = 1) -> list[str]:
    layers = 2 if tiny else 4
    warmup = f"optimizer.lr_warmup_iters={max(1, iters // 4)}"
    shape = [*(TINY if tiny else SHAPE), f"train.train_iters={iters}", warmup, f"model.use_te={str(te).lower()}"]
    tag = "te" if te else "local"
    todo = cells(layers, tiny)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # each run is its own process
        done = pool.map(lambda cell: run(f"{tag}-{cell[0]}", [*shape, *cell[2]], out), todo)
        runs: dict[str, list[dict]] = {name: rows for (name, _, _), rows in zip(todo, done, strict=True)}
    ms_head = "ms/iter" if jobs <= 1 else f"ms/iter ({jobs} runs side by side)"
    lines = [f"### megatron-core GPT, {'TE' if te else 'local'} spec, {iters} iterations",
             f"| cell | loss first -> last | max abs loss delta | verdict | {ms_head} | peak GPU GiB | host GiB |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, base, _ in todo:
        rows = runs[name]
        ref = runs.get(base) or []
        if not rows or not ref:
            lines.append(f"| {name} | failed (see {tag}-{name}.log) | | | | | |")
            continue
        delta = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, rows, strict=False))
        verdict = "baseline" if name == base else ("PASS" if delta < 1e-3 else "FAIL")
        ms = sorted(r["iteration_ms"] for r in rows)[len(rows) // 2]
        peak = max(r["peak_memory_bytes"] for r in rows) / 2**30
        host = max(r["host_offload_bytes"] for r in rows) / 2**30
        lines.append(f"| {name} | {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} | {delta:.2e} | {verdict} | "
                     f"{ms:.1f} | {peak:.3f} | {host:.3f} |")  # fmt: skip
    base = runs.get("base") or []
    if base:
        norms = [r["grad_norm"] for r in base]
        worst = rise([r["loss"] for r in base])
        lines.append(f"baseline warm-up: largest loss rise above its running minimum {worst:.3f}, "
                     f"max grad norm {max(norms):.2f}")  # fmt: skip
    lines += ["", f"peak GPU memory against the optimizer offload fraction ({'TE' if te else 'local'} spec)",
              "| fraction | peak GPU GiB | of f=0 |", "|---|---|---|"]  # fmt: skip
    for name, f in (("base", 0.0), ("opt0.25", 0.25), ("opt0.5", 0.5), ("opt1", 1.0)):
        if runs.get(name) and base:
            peak = max(r["peak_memory_bytes"] for r in runs[name])
            lines.append(f"| {f:g} | {peak / 2**30:.3f} | {peak / max(r['peak_memory_bytes'] for r in base):.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/megatron_parity")
    ap.add_argument("--te", choices=["both", "on", "off"], default="both")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=1, help="cells run side by side (separate processes)")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny shape, no TE (checks this script)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = {"both": [False, True], "on": [True], "off": [False]}[a.te]
    lines = [f"command: python3 tools/megatron_parity.py {' '.join(argv if argv is not None else sys.argv[1:])}"]
    for te in modes if not a.tiny else [False]:
        lines += table(te, a.iters, a.tiny, out, a.jobs)
        lines.append("")
        print("\n".join(lines), flush=True)
        lines = []
    return 0


if __name__ == "__main__":
    sys.exit(main())
