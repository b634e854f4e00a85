"""`bin/bench scale`: one layer shape at a depth that fits without offload and at one that does not.

In one process, on the engine's own training step (`Engine.train_batch`, bf16 half weights, fp32 master
weights and AdamW states, the stdlib bytes as data), it trains in turn:
  fit     `--layers-fit` layers, no optimizer offload: the fitting twin, the throughput to aim for;
  exact   `--layers` layers, `--fraction` of the parameters stepped on the CPU, overlap on;
  dpu     the same with optimizer.delayed_param_update (when this checkout has it; else the row says so).
Each model is freed completely (optimizer closed, weak reference checked dead, caches emptied) before
the next is built: two models at the default shape would not fit on one GPU together.

  --variant   more rows of the deep shape with config overrides (`NAME:key=value,key=value`): another
              fraction, clip_grad=0 (unclipped steps, where the speculative step can act), a speculation budget.
`--set key=value` overrides the config of every row (e.g. bf16 gradient accumulation for the largest model).

Per row: median iteration time, tokens/s, model TFLOP/s (formula printed with the table), TFLOP/s over
the fitting twin's, peak GPU memory, host memory (the engine's accounting and the process's RSS), and the
CPU step, measured where it runs (engine.optim.cpu_side.StepTiming, medians over the measured steps):
  CPU step     its arithmetic (host clock), and how much of it ran before the clip factor was known
               (units guessed during backward, with the guesses committed of those made)
  GPU waited   CUDA events around each CPU-stepped unit's wait: how long the compute stream stood still for
               the update (the next forward's pre-hooks, or a delayed update landing)
  hidden       CPU step - GPU waited: the arithmetic the GPU did not wait for
  exposed      iteration - the twin's iteration scaled by the FLOP ratio: every cost of offloading the
               twin does not pay (the GPU's waits, copies, host gaps), an upper bound on what the CPU step costs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field

import torch

from engine.bench import no_cuda
from engine.config import ConfigError, load_config
from engine.data import TokenBatches, stdlib_bytes
from engine.models.gpt import GPT

COMMAND = "bin/bench scale"
VOCAB = 256  # the stdlib bytes


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = VOCAB

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    def params(self) -> int:
        """All parameters of the built-in GPT (engine/models/gpt.py) at this shape."""
        h, f = self.hidden, self.ffn
        per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h  # qkv, proj, fc1, fc2, 2 LN
        return self.layers * per_layer + self.vocab * h + self.seq * h + 2 * h + h * self.vocab

    def matmul_params(self) -> int:
        """N: the weights that multiply activations (embedding lookups, biases and norms excluded)."""
        h, f = self.hidden, self.ffn
        return self.layers * (4 * h * h + 2 * h * f) + h * self.vocab

    def flops_per_token(self) -> dict[str, float]:
        """Model FLOPs per trained token (forward + backward; recompute not counted)."""
        dense = 6 * self.matmul_params()
        attention = 12 * self.layers * self.hidden * self.seq  # the full s x s scores, as Megatron/PaLM count
        causal = 6 * self.layers * self.hidden * (self.seq + 1)  # only the scores a causal kernel must compute
        return {"dense": dense, "attention": attention, "total": dense + attention, "causal_total": dense + causal}


FORMULA = """\
FLOPs per token = 6*N + 12*L*h*s  (forward 2 per multiply-add, backward twice the forward)
  N = L*(4*h^2 + 2*h*f) + h*V: the matmul weights (qkv 3h^2, proj h^2, fc1 h*f, fc2 f*h, output head h*V);
      embedding lookups, biases, norms, GELU, softmax and the loss are not counted
  12*L*h*s: per layer, QK^T and softmax(QK^T)V each 2*h*s forward over the full s x s scores, x3 with
      the backward: the convention of Megatron's and PaLM's MFU, so the figures compare with published ones.
      The causal kernel computes about half of those scores; counted that way the term is 6*L*h*(s+1)"""


@dataclass
class Row:
    name: str
    layers: int
    params: int
    fraction: float | str  # "auto" until the row's engine resolves it
    dpu: bool
    pin: bool = False
    iter_ms: float = 0.0
    tokens_per_s: float = 0.0
    tflops: float = 0.0
    vs_fit: float | None = None
    peak_gpu_bytes: int | None = None
    host_engine_bytes: int = 0
    host_rss_bytes: int = 0
    cpu_step_ms: float | None = None
    speculated_ms: float | None = None
    guesses: str | None = None  # "committed/made" over the measured steps
    gpu_wait_ms: float | None = None
    exposed_ms: float | None = None
    hidden_ms: float | None = None
    overrides: dict = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    delayed_steps: list[int] = field(default_factory=list)
    setup_s: float = 0.0
    unavailable: str | None = None


def _rss_bytes() -> int:
    """The process's resident memory now (Linux); elsewhere its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config(a: argparse.Namespace, shape: Shape, fraction: float | str, dpu: bool, extra: dict | None = None,
            pin: bool = False) -> dict:  # fmt: skip
    offload = fraction == "auto" or fraction > 0
    cfg = {
        "model": {"num_layers": shape.layers, "hidden_size": shape.hidden, "num_attention_heads": shape.heads,
                  "seq_length": shape.seq, "vocab_size": shape.vocab},
        "optimizer": {"optimizer": "adam", "lr": a.lr, "min_lr": a.lr,
                      "lr_warmup_iters": min(a.lr_warmup, a.warmup + a.iters), "lr_decay_style": "constant",
                      "weight_decay": 0.1, "adam_beta1": 0.9,
                      "adam_beta2": 0.95, "clip_grad": 1.0, "optimizer_cpu_offload": offload,
                      "optimizer_offload_fraction": fraction, "overlap_cpu_optimizer_d2h_h2d": offload,
                      "use_distributed_optimizer": offload, "cpu_optimizer_pin_threads": pin and offload,
                      "cpu_optimizer_threads": a.cpu_threads},
        "train": {"train_iters": a.warmup + a.iters, "global_batch_size": a.global_batch,
                  "micro_batch_size": a.micro_batch, "precision": "bf16", "params_dtype": "half", "seed": a.seed,
                  "device": a.device},
        "logging": {"metrics_file": None, "progress_bar": False},
    }  # fmt: skip
    if dpu:  # a short warm-up: the measured iterations are delayed ones
        cfg["optimizer"].update(delayed_param_update=True, delayed_param_update_warmup=a.dpu_warmup)
    for path, value in {**a.set, **(extra or {})}.items():
        ns, key = path.split(".", 1)
        cfg.setdefault(ns, {})[key] = value
    return cfg


def _assignments(text: str, what: str) -> dict:
    """`key=value,key=value` (values JSON, else strings) -> {"namespace.key": value}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or "." not in key:
            raise SystemExit(f"{COMMAND}: {what} {item!r}: expected namespace.key=value, e.g. optimizer.clip_grad=0")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def _variant(text: str) -> tuple[str, dict]:
    name, colon, rest = text.partition(":")
    if not colon or not name:
        raise SystemExit(f"{COMMAND}: --variant {text!r}: expected NAME:key=value[,key=value]")
    return name, _assignments(rest, "--variant")


def dpu_unavailable(a: argparse.Namespace, shape: Shape, fraction: float | str) -> str | None:
    """Why this checkout cannot run the DPU row (the config's own message), or None when it can."""
    try:
        load_config(_config(a, shape, fraction, True))
    except ConfigError as e:
        return "; ".join(e.errors)
    return None


def plan_fraction(a: argparse.Namespace, shape: Shape) -> float:
    """The memory plan's fraction (optimizer_offload_fraction="auto") for the offloaded shape on this machine."""
    from engine.planning import plan

    cfg = _config(a, shape, 0.3, False, {"optimizer.optimizer_offload_fraction": "auto"})
    return float(plan(load_config(cfg)).fraction)


def resolve_fraction(a: argparse.Namespace, shape: Shape) -> float:
    """--fraction as a number, or "auto": the memory plan's. Prints what the plan would choose either way."""
    try:
        planned = plan_fraction(a, shape)
    except ValueError as e:  # engine.planning.NothingFits: no fraction fits this machine
        if a.fraction == "auto":
            raise SystemExit(f"{COMMAND}: --fraction auto: {e}") from None
        print(f"the memory plan finds no fitting fraction for {shape.layers} layers here ({e}); "
              f"running --fraction {a.fraction}")  # fmt: skip
        return float(a.fraction)
    print(f"the memory plan picks optimizer_offload_fraction={planned:.2f} for {shape.layers} layers on this machine"
          f"{'' if a.fraction == 'auto' else f'; running --fraction {a.fraction}'}")  # fmt: skip
    return planned if a.fraction == "auto" else float(a.fraction)


def _model(shape: Shape, device: torch.device, seed: int) -> GPT:
    torch.manual_seed(seed)  # the same initial weights for the exact and the DPU row
    with torch.device(device):
        model = GPT(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                    seq_length=shape.seq, vocab_size=shape.vocab)  # fmt: skip
    return model.to(torch.bfloat16)


def _empty_caches() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for name in ("_host_emptyCache", "_cuda_hostEmptyCache"):  # pinned blocks torch's host allocator keeps
            if hasattr(torch._C, name):
                getattr(torch._C, name)()
                break


def run_row(a: argparse.Namespace, name: str, shape: Shape, fraction: float | str, dpu: bool, tokens,
            pin: bool = False, overrides: dict | None = None) -> Row:  # fmt: skip
    """Train `shape` for warmup + iters steps through the engine, then free everything it built."""
    from engine.engine import initialize

    row = Row(name, shape.layers, shape.params(), fraction, dpu, pin, overrides=dict(overrides or {}))
    device = torch.device(a.device)
    t0 = time.perf_counter()
    cfg = _config(a, shape, fraction, dpu, overrides, pin=pin)
    if a.implementation == "megatron":  # megatron-core's GPTModel, built by the engine on the device in bf16
        cfg["model"].update(implementation="megatron", use_te=a.te)
        torch.manual_seed(a.seed)
        eng, _, _ = initialize(config=cfg)
    else:
        eng, _, _ = initialize(model=_model(shape, device, a.seed), config=cfg)
    row.setup_s = time.perf_counter() - t0
    row.fraction = float(eng.config.optimizer.optimizer_offload_fraction)  # "auto" resolved by the plan
    row.dpu = bool(eng.config.optimizer.delayed_param_update)
    alive = weakref.ref(eng.module)
    data = TokenBatches(tokens, shape.seq, a.micro_batch, a.seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, cpu_steps, rss = [], [], []
    opt = eng.optimizer
    for i in range(a.warmup + a.iters):
        t = time.perf_counter()
        row.losses.append(eng.train_batch(data))  # .item() of the loss: waits for the GPU's work, not the CPU step
        times.append(time.perf_counter() - t)
        rss.append(_rss_bytes())
        if eng.last_step_delayed:
            row.delayed_steps.append(eng.iteration)
        timing = opt.cpu_step_timing()
        if timing is not None and i > a.warmup:  # the previous step's, with this step's GPU waits for it
            cpu_steps.append(timing)
    eng.synchronize()
    row.iter_ms = 1e3 * statistics.median(times[a.warmup :])
    row.tokens_per_s = a.global_batch * shape.seq / (row.iter_ms / 1e3)
    row.tflops = row.tokens_per_s * shape.flops_per_token()["total"] / 1e12
    row.peak_gpu_bytes = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    row.host_engine_bytes = eng.host_bytes()
    row.host_rss_bytes = max(rss)
    if cpu_steps:
        med = lambda key: 1e3 * statistics.median(t[key] for t in cpu_steps)  # noqa: E731
        row.cpu_step_ms, row.speculated_ms, row.gpu_wait_ms = med("compute_s"), med("speculated_s"), med("gpu_wait_s")
        row.guesses = f"{sum(t['committed'] for t in cpu_steps):.0f}/{sum(t['speculated'] for t in cpu_steps):.0f}"
        row.hidden_ms = max(0.0, row.cpu_step_ms - row.gpu_wait_ms)
    if hasattr(opt, "close"):
        opt.close()  # its hooks on the model hold it, and its threads and host buffers
    del eng, opt, data
    _empty_caches()
    if alive() is not None:
        raise RuntimeError(f"{COMMAND}: the {name} model is still referenced after its run; the next would not fit")
    return row


def _hidden(rows: list[Row], fit: Row, fit_shape: Shape, shape: Shape) -> None:
    scale = shape.flops_per_token()["total"] / fit_shape.flops_per_token()["total"]
    for r in rows:
        if r.unavailable:
            continue
        r.vs_fit = r.tflops / fit.tflops
        if r.cpu_step_ms is not None:
            r.exposed_ms = max(0.0, r.iter_ms - fit.iter_ms * scale)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def table(rows: list[Row]) -> str:
    out = ["| run | layers | params | f | ms/iter | tokens/s | TFLOP/s | vs fit | peak GPU | host (engine) | host RSS "
           "| CPU step | before clip (guesses used) | GPU waited | hidden | exposed | loss first -> last |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        f = f"{r.fraction:.2f}" if isinstance(r.fraction, float) else r.fraction
        head = f"| {r.name} | {r.layers} | {_count(r.params)} | {f} |"
        if r.unavailable:
            out.append(f"{head} not available: {r.unavailable} |")
            continue
        ms = lambda x: "-" if x is None else f"{x:.0f} ms"  # noqa: E731
        hid = ms(r.hidden_ms) + (f" ({r.hidden_ms / r.cpu_step_ms:.0%})" if r.hidden_ms is not None and
                                 r.cpu_step_ms else "")  # fmt: skip
        spec = "-" if r.speculated_ms is None else f"{r.speculated_ms:.0f} ms ({r.guesses})"
        out.append(f"{head} {r.iter_ms:.1f} | {r.tokens_per_s:,.0f} | {r.tflops:.4g} | "
                   f"{'-' if r.vs_fit is None else f'{r.vs_fit:.0%}'} | {_gib(r.peak_gpu_bytes)} | "
                   f"{_gib(r.host_engine_bytes)} | {_gib(r.host_rss_bytes)} | {ms(r.cpu_step_ms)} | {spec} | "
                   f"{ms(r.gpu_wait_ms)} | {hid} | {ms(r.exposed_ms)} | "
                   f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f} |")  # fmt: skip
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--layers-fit", type=int, default=16, help="depth of the twin that fits without offload")
    ap.add_argument("--layers", type=int, default=40, help="depth that needs optimizer offload")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 128)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument(
        "--fraction",
        default="0.3",
        help='CPU-stepped fraction of the deep model, or "auto": each row\'s memory plan chooses',
    )
    ap.add_argument("--iters", type=int, default=10, help="measured iterations per row")
    ap.add_argument("--warmup", type=int, default=3, help="iterations before measuring")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lr-warmup", type=int, default=10, help="linear warm-up steps (a first step at the full lr "
                    "moves a wide model's weights too far at once: the loss rises)")  # fmt: skip
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: tiny shapes only (tests)")
    ap.add_argument("--implementation", choices=["builtin", "megatron"], default="builtin",
                    help="model.implementation of every row: megatron builds megatron-core's GPTModel")  # fmt: skip
    ap.add_argument("--te", action="store_true", help="model.use_te=true (Transformer Engine layers; CUDA only)")
    ap.add_argument("--rows", default="fit,exact,dpu", help="which rows to run, comma-separated")
    ap.add_argument("--dpu-warmup", type=int, default=2, help="optimizer.delayed_param_update_warmup of the dpu row")
    ap.add_argument(
        "--pin-threads",
        choices=["off", "on", "both"],
        default="off",
        help="optimizer.cpu_optimizer_pin_threads; both: the exact row once unpinned, once pinned",
    )
    ap.add_argument("--data-bytes", type=int, default=16 << 20, help="stdlib bytes to draw windows from")
    ap.add_argument("--json", default=None, help="write the rows and the formula here as JSON")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every row, e.g. optimizer.accumulate_allreduce_grads_in_fp32=false",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="one more row of the deep shape with these overrides, e.g. "
        "unclipped:optimizer.clip_grad=0 or auto:optimizer.optimizer_offload_fraction=auto",
    )
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The parsed flags, --set as {"namespace.key": value} and --variant as [(name, overrides)]."""
    a = parser().parse_args(argv)
    a.set = _assignments(",".join(a.set), "--set")
    a.variant = [_variant(v) for v in a.variant]
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and (refusal := no_cuda(COMMAND)):  # before anything is read or built
        print(refusal, file=sys.stderr)
        return 2
    variants = a.variant
    heads = a.heads or max(1, a.hidden // 128)
    fit_shape = Shape(a.layers_fit, a.hidden, heads, a.seq)
    shape = Shape(a.layers, a.hidden, heads, a.seq)
    fraction = resolve_fraction(a, shape)
    if a.fraction == "auto":  # each row's plan decides (the delayed update's GPU shadow may need a larger fraction)
        fraction = "auto"
    tokens = stdlib_bytes(a.data_bytes)
    fpt = shape.flops_per_token()
    device = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"{COMMAND}: hidden {a.hidden}, {heads} heads, seq {a.seq}, micro-batch {a.micro_batch}, global batch "
          f"{a.global_batch}, bf16 half weights, fp32 master + AdamW states; {a.warmup} warm-up + {a.iters} measured "
          f"iterations per row (median); {device}", flush=True)  # fmt: skip
    wanted = set(a.rows.split(","))
    rows: list[Row] = []
    pin = a.pin_threads == "on"
    plan = [("fit", fit_shape, 0.0, False, False), ("exact", shape, fraction, False, pin)]
    if a.pin_threads == "both":
        plan.append(("exact+pin", shape, fraction, False, True))
    plan.append(("dpu", shape, fraction, True, pin))
    plan = [(*p, {}) for p in plan if p[0].split("+")[0] in wanted]
    plan += [(name, shape, fraction, False, pin, over) for name, over in variants]
    for name, shp, f, dpu, pinned, over in plan:
        why = dpu_unavailable(a, shp, f) if dpu else None
        if why:
            row = Row(name, shp.layers, shp.params(), f, dpu, pinned, unavailable=why)
        else:
            try:
                row = run_row(a, name, shp, f, dpu, tokens, pin=pinned, overrides=over)
            except (ConfigError, ValueError, torch.OutOfMemoryError) as e:  # the plan's refusal, or CUDA's
                row = Row(name, shp.layers, shp.params(), f, dpu, pinned, overrides=over,
                          unavailable=str(e).splitlines()[0])  # fmt: skip
        if row.unavailable:
            _empty_caches()  # after the except block: its traceback held the failed row's model
            print(f"  {name}: not available: {row.unavailable}", flush=True)
        else:
            print(f"  done {name}: {row.iter_ms:.1f} ms/iter, setup {row.setup_s:.1f} s, "
                  f"{len(row.delayed_steps)} delayed steps, losses "
                  + " ".join(f"{x:.3f}" for x in row.losses), flush=True)  # fmt: skip
        rows.append(row)
    fit = next((r for r in rows if r.name == "fit"), None)
    if fit is not None:
        _hidden(rows, fit, fit_shape, shape)
    print()
    print(FORMULA)
    for s in (fit_shape, shape):
        f = s.flops_per_token()
        print(f"  L={s.layers}: N={s.matmul_params():,} -> {f['dense']:.4g} + {f['attention']:.4g} = "
              f"{f['total']:.4g} FLOPs/token (causal-counted: {f['causal_total']:.4g})")  # fmt: skip
    print(
        "hidden = CPU step - GPU waited (CUDA events at each CPU-stepped unit's wait); exposed = ms/iter - the fit "
        f"row's ms/iter x the FLOP ratio ({fpt['total'] / fit_shape.flops_per_token()['total']:.3f})"
    )
    for name, over in variants:
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in over.items()))
    print()
    print(table(rows))
    print(f"\ncommand: {COMMAND} {' '.join(argv)}".rstrip())
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"formula": FORMULA, "rows": [asdict(r) for r in rows], "argv": argv}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
