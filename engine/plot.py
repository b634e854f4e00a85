"""`bin/plot METRICS.jsonl [...] [-o OUT.png]`: loss, tokens/s and memory of one or several runs, as one PNG
(matplotlib, the `plot` extra).

Each file is one line per run; a run that resumed from a checkpoint continues the line of the run before it
in the same file. Skipped (non-finite) steps show as gaps in the loss and as crosses at its foot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine.metrics import read_runs

GIB = 1024**3


NEEDED = ("iteration", "tokens_per_s", "peak_memory_bytes")  # what every drawn record must carry


def series(path: str | Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, iteration records) per line to draw from one metrics file."""
    stem, lines = Path(path).stem, []
    for run in read_runs(path, warn=lambda line: print(f"warning: {line}", file=sys.stderr)):
        for rec in run["records"]:
            if missing := [key for key in NEEDED if key not in rec]:
                raise ValueError(f"{path}: the record of iteration {rec['iteration']} has no {missing[0]!r}")
        resumed = run["header"] is not None and run["header"].get("resumed_from") is not None
        if resumed and lines:
            lines[-1][1].extend(run["records"])
        else:
            lines.append((stem, list(run["records"])))
    lines = [(label, recs) for label, recs in lines if recs]
    if len(lines) > 1:
        lines = [(f"{label} (run {i + 1})", recs) for i, (label, recs) in enumerate(lines)]
    return lines


def plot(paths: list[str], out: str | Path) -> Path:
    """Draws every run of `paths` to `out` (PNG) and returns it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    lines = [line for p in paths for line in series(p)]
    if not lines:
        raise ValueError(f"{', '.join(paths)}: no iteration records to plot")
    fig, (loss_ax, tok_ax, mem_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, (label, recs) in enumerate(lines):
        color = f"C{i % 10}"
        its = [r["iteration"] for r in recs]
        loss = [r["loss"] if r.get("loss") is not None else float("nan") for r in recs]
        marker = "." if len(its) < 30 else None  # a short run's points stay visible between gaps
        loss_ax.plot(its, loss, color=color, marker=marker, label=label)
        skipped = [r["iteration"] for r in recs if r.get("skipped")]
        if skipped:  # crosses along the foot of the axes, whatever the loss scale
            foot = blended_transform_factory(loss_ax.transData, loss_ax.transAxes)
            loss_ax.plot(skipped, [0.03] * len(skipped), "x", color=color, transform=foot,
                         label=f"{label}: skipped steps")  # fmt: skip
        tok_ax.plot(its, [r["tokens_per_s"] for r in recs], color=color, marker=marker, label=label)
        mem_ax.plot(its, [r["peak_memory_bytes"] / GIB for r in recs], color=color, label=f"{label}: peak")
        host = [r.get("host_offload_bytes", 0) / GIB for r in recs]
        if any(host):
            mem_ax.plot(its, host, color=color, linestyle="--", label=f"{label}: host offload")
    for ax, title, unit in ((loss_ax, "loss", "loss"), (tok_ax, "throughput", "tokens/s"),
                            (mem_ax, "memory", "GiB")):  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bin/plot", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("metrics", nargs="+", help="metrics JSONL files (logging.metrics_file of each run)")
    p.add_argument("-o", "--out", help="the PNG to write (default: the first file's name with .png)")
    args = p.parse_args(argv)
    out = args.out or str(Path(args.metrics[0]).with_suffix(".png"))
    try:
        written = plot(args.metrics, out)
    except ImportError:
        print("error: bin/plot needs matplotlib: pip install 'offload-engine[plot]'", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # a missing file, a line that is not a record (named with its file and line)
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0
