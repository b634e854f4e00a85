"""Where FP8's memory and time go in one Transformer Engine layer: bf16 against FP8 (delayed, hybrid), with and
without TE's FP8 weight cache (`is_first_microbatch`), at several hidden sizes.

For each (hidden, mode), one TE TransformerLayer built as the engine builds it (engine/models/te.py), bf16 weights,
runs the micro-batches of one global batch (forward under the FP8 context, backward outside it) and reports:
  saved MiB      bytes the layer saves for backward per micro-batch (saved-tensor hooks, one count per storage),
                 split into FP8 data (uint8 storages), of which FP8 weight copies (the layer's weights quantized,
                 with their transposes on Hopper), and the rest (bf16/fp32)
  peak MiB       peak GPU memory of one forward+backward above what was allocated before it
  kept MiB       GPU memory still held after the global batch beyond the weights (TE's cached FP8 weights)
  ms fwd+bwd     GPU time of one micro-batch's forward and backward (median, CUDA events)
  ms launch      host time of the forward call alone (close to the GPU's: the run waits on Python, not the GPU)
Modes: bf16; fp8 (TE's default, and the engine's before it passed is_first_microbatch: every weight cast again in
each micro-batch's forward, the cast saved for backward); fp8-cache (what the engine runs now: is_first_microbatch
True on the first micro-batch, False after: one cast per global batch into a persistent workspace).

    python3 tools/fp8_diag.py [--hidden 2048,4096,5120 --micro-batch 2 --seq 2048 --micro-batches 8]
    python3 tools/fp8_diag.py --dry-run     # CPU check: the built-in torch layer at a tiny shape, bf16 only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import extras  # noqa: E402

MODES = ("bf16", "fp8", "fp8-cache")
MiB = 2**20


def storages(t: torch.Tensor) -> list[tuple[int, int, torch.dtype]]:
    """(data pointer, bytes, dtype) of each storage a saved tensor holds: its own, or for a wrapper subclass
    (TE's cached FP8 weight, a Float8Tensor with no storage of its own) those of its inner tensors."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        held = getattr(t, "__dict__", {}).values()
        inner = [v for v in held if isinstance(v, torch.Tensor) and type(v) is torch.Tensor]
        if inner:
            return [x for v in inner for x in storages(v)]
    st = t.untyped_storage()
    return [(st.data_ptr(), st.nbytes(), t.dtype)]


class SavedBytes:
    """Counts what autograd saves inside its context, once per storage and parameters left out: FP8 data (uint8),
    of it TE's cached FP8 weights, and the rest."""

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.seen: dict[int, tuple[int, torch.dtype]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for ptr, nbytes, dtype in storages(t):
            if ptr not in self.param_ptrs and nbytes:  # a parameter itself is no saved activation
                self.seen[ptr] = (nbytes, dtype)
        return t

    def totals(self, workspace_ptrs: set[int]) -> dict[str, int]:
        fp8 = sum(n for n, d in self.seen.values() if d == torch.uint8)
        weights = sum(n for p, (n, d) in self.seen.items() if d == torch.uint8 and p in workspace_ptrs)
        other = sum(n for n, d in self.seen.values() if d != torch.uint8)
        return {"fp8": fp8, "cached_weights": weights, "other": other}


def workspace_ptrs(layer: torch.nn.Module) -> set[int]:
    """Storages of TE's cached FP8 weights (`_fp8_workspaces`, filled only when is_first_microbatch is passed)."""
    out = set()
    for m in layer.modules():
        for ws in getattr(m, "_fp8_workspaces", {}).values():
            for v in getattr(ws, "__dict__", {}).values():
                if isinstance(v, torch.Tensor) and v.numel():
                    out.add(v.untyped_storage().data_ptr())
    return out


def build_layer(hidden: int, heads: int, te: bool, device: torch.device) -> torch.nn.Module:
    if te:
        from engine.models.te import build_te_layers

        return build_te_layers(num_layers=1, hidden_size=hidden, num_attention_heads=heads, device=device,
                               params_dtype=torch.bfloat16)[0]  # fmt: skip
    from engine.models.gpt import TransformerLayer

    return TransformerLayer(hidden, heads, 4 * hidden).to(device=device, dtype=torch.bfloat16)


def fp8_context(mode: str) -> Callable:
    """A fresh forward context per micro-batch, as the engine's (engine/precision.py Fp8Forward)."""
    import contextlib

    if mode == "bf16":
        return contextlib.nullcontext
    from types import SimpleNamespace

    from engine.precision import Fp8Forward

    t = SimpleNamespace(fp8="hybrid", fp8_recipe="delayed", fp8_margin=0, fp8_amax_history_len=1,
                        fp8_amax_compute_algo="most_recent")  # fmt: skip
    return Fp8Forward(t)


def measure(hidden: int, mode: str, a: argparse.Namespace, device: torch.device) -> dict:
    """One layer, one global batch of micro-batches (plus one untimed global batch first)."""
    cuda = device.type == "cuda"
    heads = max(1, hidden // 128)
    torch.manual_seed(0)
    layer = build_layer(hidden, heads, not a.dry_run, device)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    weights_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    context = fp8_context(mode)
    x = torch.randn(a.micro_batch, a.seq, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    fwd, fwd_bwd, launch, saved, peak = [], [], [], None, 0
    for step in range(2):
        for i in range(a.micro_batches):
            kw = {"is_first_microbatch": i == 0} if mode == "fp8-cache" else {}
            counter = SavedBytes(params)
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                start.record()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), context():
                y = layer(x, **kw)
            launch.append(time.perf_counter() - t0)
            if cuda:
                mid.record()
            y.backward(grad)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                fwd.append(start.elapsed_time(mid) / 1e3)
                fwd_bwd.append(start.elapsed_time(end) / 1e3)
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
            else:
                fwd_bwd.append(time.perf_counter() - t0)
                fwd.append(launch[-1])
            x.grad = None
            layer.zero_grad(set_to_none=True)
            if step == 1 and i == a.micro_batches - 1:
                saved = counter.totals(workspace_ptrs(layer))
            del y
    if cuda:
        torch.cuda.synchronize()
    kept = (torch.cuda.memory_allocated() if cuda else 0) - weights_bytes - 2 * x.numel() * x.element_size()
    n = a.micro_batches
    out = {"hidden": hidden, "mode": mode, "saved": saved, "peak": peak, "kept": max(kept, 0),
           "fwd": statistics.median(fwd[n:]), "fwd_bwd": statistics.median(fwd_bwd[n:]),
           "launch": statistics.median(launch[n:]),
           "weights": weights_bytes, "tokens": a.micro_batch * a.seq}  # fmt: skip
    del layer, x, grad
    if cuda:
        torch.cuda.empty_cache()
    return out


def expected_saved(hidden: int, tokens: int, mode: str) -> float:
    """Bytes TE 2.20's TransformerLayer saves per micro-batch on Hopper by its code (ffn = 4h), for the table:
    bf16 16Th + 4Tf (x and norm output of both blocks, q/k/v/out, fc1 output, GELU output); per-tensor FP8
    saves the qkv input's transpose (1 B) for its norm output, the projection input's transpose beside the
    attention output (+1 B), the GELU output as FP8 (1 B), so Tf bytes less, plus each weight's FP8 copy with its
    transpose (2 B per weight element) when not cached."""
    h, t, f = hidden, tokens, 4 * hidden
    bf16 = 16 * t * h + 4 * t * f
    if mode == "bf16":
        return bf16
    weights = 2 * (4 * h * h + 2 * h * f)
    return bf16 - t * f + (weights if mode == "fp8" else 0)


def table(rows: list[dict]) -> None:
    print(f"\n{'hidden':>6} {'mode':<10} {'saved MiB':>9} {'FP8':>7} {'cached w':>8} {'other':>7} {'expect':>7} "
          f"{'peak MiB':>8} {'kept MiB':>8} {'ms fwd':>7} {'ms fwd+bwd':>10} {'ms launch':>9}")  # fmt: skip
    for r in rows:
        if "skipped" in r:
            print(f"{r['hidden']:>6} {r['mode']:<10} skipped: {r['skipped']}")
            continue
        s = r["saved"]
        total, expect = s["fp8"] + s["other"], expected_saved(r["hidden"], r["tokens"], r["mode"])
        print(f"{r['hidden']:>6} {r['mode']:<10} {total / MiB:9.1f} {s['fp8'] / MiB:7.1f} "
              f"{s['cached_weights'] / MiB:8.1f} {s['other'] / MiB:7.1f} {expect / MiB:7.1f} "
              f"{r['peak'] / MiB:8.1f} {r['kept'] / MiB:8.1f} {1e3 * r['fwd']:7.2f} {1e3 * r['fwd_bwd']:10.2f} "
              f"{1e3 * r['launch']:9.2f}")  # fmt: skip
    by = {(r["hidden"], r["mode"]): r for r in rows if "saved" in r}
    for h in sorted({r["hidden"] for r in rows}):
        plain, cached, bf16 = by.get((h, "fp8")), by.get((h, "fp8-cache")), by.get((h, "bf16"))
        if plain and cached:
            acts = sum(cached["saved"].values()) - 2 * cached["saved"]["cached_weights"]
            copies = sum(plain["saved"].values()) - plain["saved"]["cached_weights"] - acts
            line = f"hidden {h}: FP8 activations {acts / MiB:.1f} MiB + uncached FP8 weight copies "
            line += f"{copies / MiB:.1f} MiB"
            line += f" (layer weights {plain['weights'] / MiB:.1f} MiB bf16)"
            if bf16:
                line += f"; bf16 saves {sum(bf16['saved'].values()) / MiB:.1f} MiB"
                line += f"; time fp8/bf16 {plain['fwd_bwd'] / bf16['fwd_bwd']:.2f}, fp8-cache/bf16 "
                line += f"{cached['fwd_bwd'] / bf16['fwd_bwd']:.2f}"
            print(line)
    print(
        "saved: per micro-batch, once per storage, parameters left out; FP8: uint8 storages; cached w: TE's "
        "persistent FP8 weights among them; expect: by TE 2.20's code on Hopper (expected_saved; fp8-cache: without "
        "the cached weights); peak: one "
        "micro-batch's forward+backward above the memory before it; kept: held after the global batch beyond "
        "weights and input; ms launch: host time of the forward call"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", default="2048,4096,5120", help="hidden sizes (heads = hidden / 128)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches of one global batch")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dry-run", action="store_true", help="CPU check: the built-in torch layer, tiny, bf16 only")
    a = p.parse_args()
    if a.dry_run:
        a.hidden, a.micro_batch, a.seq, a.micro_batches = "64", 2, 32, 2
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
    missing = None if not a.dry_run and torch.cuda.is_available() and extras.te_available() else (
        "needs CUDA and Transformer Engine (this is the CPU check)" if a.dry_run else
        "needs CUDA and Transformer Engine: pip install -e '.[te]'")  # fmt: skip
    print(
        f"one TE TransformerLayer per row: micro-batch {a.micro_batch} x seq {a.seq}, {a.micro_batches} "
        f"micro-batches per global batch; FP8 hybrid/delayed (amax history 1)"
        + (" [CPU check: torch layer]" if a.dry_run else "")
    )
    rows = []
    for hidden in (int(h) for h in a.hidden.split(",")):
        for mode in a.modes.split(","):
            if mode != "bf16" and missing:
                rows.append({"hidden": hidden, "mode": mode, "skipped": missing})
                continue
            if mode == "bf16" and not a.dry_run and missing:
                rows.append({"hidden": hidden, "mode": mode, "skipped": missing})
                continue
            rows.append(measure(hidden, mode, a, device))
    table(rows)
    print("command: python3 tools/fp8_diag.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
