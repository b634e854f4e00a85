#!/usr/bin/env python3
"""Convergence evidence for optimizer.delayed_param_update: one run exact, one delayed, same model, data and
seed, in one process; both loss curves in one plot, and the final losses compared.

  --preset cpu      configs/default.json (4 layers, hidden 128, seq 128, fp32, global batch 16, 200 iterations,
                    stdlib bytes) with its optimizer offloaded at f=0.5, overlap on; DPU after the default
                    40-step warm-up. The plot checked in as docs/dpu_convergence_cpu.png comes from this.
  --preset h200-8b  the 8 B shape of bin/bench scale (hidden 4096 x 40 layers, seq 2048, bf16 half weights,
                    fp32 masters and AdamW states, f=0.3, micro-batch 1, global batch 8, stdlib bytes), 60
                    iterations with a 10-step warm-up, so 50 steps are delayed; a few minutes on one H200.
"Final loss" is the mean of the last 10 iterations' losses (one batch's loss is noisy); the run passes when
the delayed run's is within --tolerance (2%) of the exact run's. Exit status 0 when it passes, 1 when not.
Usage: tools/dpu_convergence.py [--preset cpu|h200-8b] [--iters N] [--warmup W] [--out PNG] [key=value ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.config import load_config  # noqa: E402
from engine.engine import initialize  # noqa: E402
from engine.models.gpt import GPT  # noqa: E402

OFFLOAD = ["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true",
           "optimizer.overlap_cpu_optimizer_d2h_h2d=true", "logging.metrics_file=null",
           "logging.progress_bar=false"]  # fmt: skip
PRESETS = {
    "cpu": dict(config=str(ROOT / "configs" / "default.json"), iters=200, warmup=40,
                overrides=["optimizer.optimizer_offload_fraction=0.5", "train.device=cpu"],
                out=str(ROOT / "docs" / "dpu_convergence_cpu.png")),
    "h200-8b": dict(config=None, iters=60, warmup=10,
                    overrides=["model.num_layers=40", "model.hidden_size=4096", "model.num_attention_heads=32",
                               "model.seq_length=2048", "model.vocab_size=256", "train.precision=bf16",
                               "train.params_dtype=half", "train.micro_batch_size=1", "train.global_batch_size=8",
                               "optimizer.optimizer_offload_fraction=0.3", "optimizer.lr=1e-4",
                               "optimizer.min_lr=1e-5", "optimizer.lr_warmup_iters=10",
                               "optimizer.lr_decay_style=cosine", "optimizer.weight_decay=0.1",
                               "optimizer.adam_beta2=0.95", "optimizer.clip_grad=1.0"],
                    out="dpu_convergence_h200_8b.png"),
}  # fmt: skip


def _model(cfg) -> torch.nn.Module:
    """The built-in GPT built on the training device (a large one never passes through host memory in fp32)."""
    m, t = cfg.model, cfg.train
    device = torch.device("cuda" if torch.cuda.is_available() and t.device != "cpu" else "cpu")
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = GPT(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                    seq_length=m.seq_length, vocab_size=m.vocab_size, ffn_hidden_size=m.ffn_hidden_size,
                    init_method_std=m.init_method_std)  # fmt: skip
    return model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]) if t.params_dtype == "half" else model


def run(cfg, label: str) -> dict:
    eng, _, _ = initialize(model=_model(cfg), config=cfg)
    alive = weakref.ref(eng.module)
    losses, delayed, times = [], [], []
    for _ in range(cfg.train.train_iters):
        t = time.perf_counter()
        losses.append(eng.train_batch())
        times.append(time.perf_counter() - t)
        delayed.append(eng.last_step_delayed)
    eng.synchronize()
    eng.optimizer.close()
    del eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if alive() is not None:
        raise RuntimeError(f"the {label} run's model is still referenced; the next run would not fit")
    ms = 1e3 * statistics.median(times[len(times) // 4 :])
    print(f"  {label}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, median {ms:.1f} ms/iter, "
          f"{sum(delayed)} delayed steps", flush=True)  # fmt: skip
    return {"losses": losses, "delayed": delayed, "median_ms": ms}


def _smooth(xs: list[float], w: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def plot(exact: dict, dpu: dict, warmup: int, title: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    it = range(1, len(exact["losses"]) + 1)
    for r, name, color in ((exact, "exact", "tab:blue"), (dpu, "delayed parameter update", "tab:orange")):
        a.plot(it, r["losses"], color=color, alpha=0.25, lw=0.8)
        a.plot(it, _smooth(r["losses"]), color=color, lw=1.8, label=f"{name} (mean of 10)")
    a.axvline(warmup + 0.5, color="gray", ls="--", lw=1)
    a.text(warmup + 1, 0.03, f" delayed from step {warmup + 1}", color="gray", transform=a.get_xaxis_transform())
    a.set_ylabel("training loss")
    a.set_title(title, fontsize=10)
    a.legend()
    diff = [d - e for d, e in zip(dpu["losses"], exact["losses"], strict=True)]
    b.plot(it, _smooth(diff), color="tab:red", lw=1.5)
    b.axhline(0, color="black", lw=0.6)
    b.set_ylabel("delayed - exact\n(mean of 10)")
    b.set_xlabel("iteration")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None, help="optimizer.delayed_param_update_warmup")
    ap.add_argument("--out", default=None, help="the plot (PNG); the losses go beside it as JSON")
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    a = ap.parse_args(argv)
    p = PRESETS[a.preset]
    iters, warmup, out = a.iters or p["iters"], p["warmup"] if a.warmup is None else a.warmup, a.out or p["out"]
    base = OFFLOAD + p["overrides"] + [f"train.train_iters={iters}"] + a.overrides
    exact_cfg = load_config(p["config"] or {}, base)
    dpu_cfg = load_config(p["config"] or {}, base + ["optimizer.delayed_param_update=true",
                                                      f"optimizer.delayed_param_update_warmup={warmup}"])  # fmt: skip
    m, o, t = exact_cfg.model, exact_cfg.optimizer, exact_cfg.train
    title = (f"GPT {m.num_layers} x {m.hidden_size}, seq {m.seq_length}, {t.precision} ({t.params_dtype} weights), "
             f"global batch {t.global_batch_size}, f={o.optimizer_offload_fraction}, warm-up {warmup}")  # fmt: skip
    print(f"{title}; {iters} iterations each; device "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() and t.device != 'cpu' else 'CPU'}",
          flush=True)  # fmt: skip
    exact = run(exact_cfg, "exact")
    dpu = run(dpu_cfg, "delayed")
    k = min(10, iters)
    fe, fd = statistics.fmean(exact["losses"][-k:]), statistics.fmean(dpu["losses"][-k:])
    rel = (fd - fe) / fe
    ok = abs(rel) <= a.tolerance
    print(f"final loss (mean of the last {k}): exact {fe:.4f}, delayed {fd:.4f}, difference {rel:+.2%} "
          f"({'within' if ok else 'OUTSIDE'} {a.tolerance:.0%}); ms/iter exact {exact['median_ms']:.1f}, "
          f"delayed {dpu['median_ms']:.1f}")  # fmt: skip
    plot(exact, dpu, warmup, title, out)
    Path(out).with_suffix(".json").write_text(
        json.dumps(
            {
                "title": title,
                "iters": iters,
                "warmup": warmup,
                "exact": exact,
                "delayed": dpu,
                "final_exact": fe,
                "final_delayed": fd,
                "relative_difference": rel,
                "command": " ".join(["tools/dpu_convergence.py", *argv]),
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
