"""The seed's success criteria for megatron-core's GPTModel, one bin/train run per cell: loss against the
non-offloaded baseline (max |delta| < 1e-3) for activation offload, optimizer offload at 0.25/0.5/1 and both,
megatron's own HybridDeviceOptimizer at 0.5, with Transformer Engine layers and without; then peak GPU memory
against the offload fraction (the same runs). The warm-up is checked too: the largest rise of the baseline's
10-iteration mean loss above its running minimum, and its gradient norms after the warm-up, so a criterion measured
across a divergence shows as one (one batch's loss above the last minimum is the data, not a divergence).

Two control cells say what a delta means. `lr+1ulp`: the baseline with its learning rate (and floor) one fp32 ulp
higher, so every update differs by about one part in 10^7, the size of the difference between two AdamW
arithmetics: its delta is the run's own sensitivity to a last-bit difference in the step. megatron's optimizer
cells (`hdo-base`: megatron-core's Adam unoffloaded, `hdo0.5`: its HybridDeviceOptimizer) are compared with their
own baseline and with ours.

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
         "train.global_batch_size=8", "train.precision=bf16", "train.params_dtype=half",
         "optimizer.lr_decay_style=cosine", "optimizer.clip_grad=1.0"]  # fmt: skip
TINY = ["model.implementation=megatron", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.seq_length=16", "train.micro_batch_size=2", "train.global_batch_size=2", "train.precision=fp32",
        "train.device=cpu"]  # fmt: skip
OPT = "optimizer.optimizer_cpu_offload=true optimizer.use_distributed_optimizer=true".split()
OVERLAP = ["optimizer.overlap_cpu_optimizer_d2h_h2d=true"]
LR, MIN_LR = 3e-4, 3e-5  # every cell's schedule: cosine from LR to MIN_LR after a warm-up of a quarter of the run
ULP = 1 + 2**-23  # about one fp32 ulp of a learning rate: every update moves by ~1.2e-7 of itself
LR_ULP = [f"optimizer.lr={LR * ULP!r}", f"optimizer.min_lr={MIN_LR * ULP!r}"]


def act(layers: int) -> list[str]:
    return ["model.cpu_offloading=true", f"model.cpu_offloading_num_layers={layers}"]


def cells(layers: int, tiny: bool) -> list[tuple[str, str, list[str]]]:
    """(name, baseline name, overrides); the fraction cells also make the memory table."""
    out = [("base", "base", []), ("act", "base", act(layers - 1)), ("lr+1ulp", "base", LR_ULP)]
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
    metrics.unlink(missing_ok=True)  # bin/train appends runs to a metrics file: an earlier call's would be read too
    cmd = [sys.executable, "bin/train", *overrides, "logging.progress_bar=false", f"logging.metrics_file={metrics}"]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print(f"{name}: bin/train exited {rc}: {log.read_text().strip().splitlines()[-1:]}")
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "iteration" in r]


def rise(losses: list[float], window: int = 10) -> float:
    """The largest rise of the `window`-iteration mean loss above its running minimum (0 for a run that never climbs
    back): each batch's loss differs by its data, the mean moves only when training does."""
    means = [sum(losses[i - window : i]) / window for i in range(window, len(losses) + 1)] or losses
    low, worst = float("inf"), 0.0
    for x in means:
        low = min(low, x)
        worst = max(worst, x - low)
    return worst


def max_delta(ref: list[dict], rows: list[dict]) -> float:
    return max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, rows, strict=False))


def table(te: bool, iters: int, tiny: bool, out: Path, jobs: int = 1) -> list[str]:
    layers = 2 if tiny else 4
    warmup = f"optimizer.lr_warmup_iters={max(1, iters // 4)}"
    shape = [*(TINY if tiny else SHAPE), f"optimizer.lr={LR!r}", f"optimizer.min_lr={MIN_LR!r}",
             f"train.train_iters={iters}", warmup, f"model.use_te={str(te).lower()}"]  # fmt: skip
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
        delta = max_delta(ref, rows)
        verdict = "baseline" if name == base else ("PASS" if delta < 1e-3 else "FAIL")
        if name.startswith("hdo") and runs.get("base"):
            verdict += f" (against ours: {max_delta(runs['base'], rows):.2e})"
        ms = sorted(r["iteration_ms"] for r in rows)[len(rows) // 2]
        peak = max(r["peak_memory_bytes"] for r in rows) / 2**30
        host = max(r["host_offload_bytes"] for r in rows) / 2**30
        lines.append(f"| {name} | {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} | {delta:.2e} | {verdict} | "
                     f"{ms:.1f} | {peak:.3f} | {host:.3f} |")  # fmt: skip
    base = runs.get("base") or []
    if base:
        norms = [r["grad_norm"] for r in base]
        losses = [r["loss"] for r in base]
        after = norms[max(1, iters // 4) :] or norms
        lines.append(f"baseline warm-up: largest rise of the 10-iteration mean loss above its running minimum "
                     f"{rise(losses):.3f} (of one iteration's loss: {rise(losses, 1):.3f}); grad norm max "
                     f"{max(norms):.2f} in the warm-up, {max(after):.2f} after it")  # fmt: skip
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
