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
  --fractions one more exact row of the deep shape per fraction (f=0: no optimizer offload).
  --hf-config a HuggingFace causal LM (a config.json or a named shape of engine/bench/hf_models.py) instead of
              the built-in GPT; its twin's depth and `--layers auto` come from the memory plan (bench/hf_scale.py).
`--set key=value` overrides the config of every row (e.g. bf16 gradient accumulation for the largest model).

Per row: median iteration time, tokens/s, model TFLOP/s (formula printed with the table), TFLOP/s over
the fitting twin's, peak GPU memory, host memory (the engine's accounting and the process's RSS), and the
CPU step, measured where it runs (engine.optim.cpu_side.StepTiming, medians over the measured steps):
  CPU step     its arithmetic (host clock), with the C pass's bytes per parameter through host memory and the
               GB/s its parameters moved at (fused_kernel.pass_bytes: the pass's own bytes, not the PCIe copies'
               share of DRAM); and how much of it ran before the clip factor was known (units guessed during
               backward, with the guesses committed of those made)
  GPU waited   CUDA events around each CPU-stepped unit's wait: how long the compute stream stood still for
               the update (the next forward's pre-hooks, or a delayed update landing)
  hidden       CPU step - GPU waited: the arithmetic the GPU did not wait for
  exposed      iteration - the twin's iteration scaled by the FLOP ratio: every cost of offloading the
               twin does not pay (the GPU's waits, copies, host gaps), an upper bound on what the CPU step costs
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from engine.bench import hf_models, no_cuda
from engine.bench.scale_rows import report
from engine.bench.scale_run import COMMAND, deep_rows, row_config, run_rows
from engine.config import load_config
from engine.data import TokenBatches, stdlib_bytes
from engine.models.gpt import GPT
from engine.planning.budget import parse_gib

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

    planned_at_a_batch = False  # the built-in GPT's activations are read off its shape

    def build(self, device: torch.device, seed: int, cfg: dict | None = None) -> GPT:
        """The built-in GPT at this shape in bf16, the same initial weights for every row (the same seed)."""
        torch.manual_seed(seed)
        with torch.device(device):
            model = GPT(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                        seq_length=self.seq, vocab_size=self.vocab)  # fmt: skip
        return model.to(torch.bfloat16)

    def batches(self, tokens, micro_batch: int, seed: int) -> TokenBatches:
        return TokenBatches(tokens, self.seq, micro_batch, seed)

    def model_section(self) -> dict:
        """The config's `model` keys describing this shape."""
        return {"num_layers": self.layers, "hidden_size": self.hidden, "num_attention_heads": self.heads,
                "seq_length": self.seq, "vocab_size": self.vocab}  # fmt: skip

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


def plan_fraction(a: argparse.Namespace, shape: Shape) -> float:
    """The memory plan's fraction (optimizer_offload_fraction="auto") for the offloaded shape on this machine."""
    from engine.planning import plan

    cfg = row_config(a, shape, 0.3, False, {"optimizer.optimizer_offload_fraction": "auto"})
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--hf-config", default=None, metavar="PATH|NAME",
                    help="a HF causal LM instead of the built-in GPT: a config.json (or its directory) or a named "
                    f"shape ({hf_models.known()}); random weights, built on the device in bf16")  # fmt: skip
    ap.add_argument("--layers-fit", type=int, default=None,
                    help="depth of the twin that fits without offload (default 16; --hf-config: the deepest the "
                    "plan fits without offload)")  # fmt: skip
    ap.add_argument("--layers", default=None, help="depth that needs optimizer offload (default 40; --hf-config: "
                    'the config\'s; "auto": the deepest at which every deep row\'s plan fits)')  # fmt: skip
    ap.add_argument("--hidden", type=int, default=None, help="the built-in GPT's width (default 4096)")
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
    ap.add_argument("--lr-warmup", type=int, default=2000, help="linear warm-up steps of the schedule the rows "
                    "start (a wide random-init model's loss rises under Adam's first steps at 1e-5)")  # fmt: skip
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: tiny shapes only (tests)")
    ap.add_argument("--implementation", choices=["builtin", "megatron"], default="builtin",
                    help="model.implementation of every row: megatron builds megatron-core's GPTModel")  # fmt: skip
    ap.add_argument("--te", action="store_true", help="model.use_te=true (Transformer Engine layers; CUDA only)")
    ap.add_argument("--rows", default="fit,exact,dpu", help="which of fit,exact,dpu to run, comma-separated (may be "
                    "empty: --fractions and --variant rows only)")  # fmt: skip
    ap.add_argument(
        "--fractions",
        default="",
        metavar="F[,F]",
        help="one more exact row of the deep shape per fraction, named f=F (0: no optimizer offload)",
    )
    ap.add_argument("--gpu-memory", default=None, metavar="GIB", help="plan every row against this GPU budget")
    ap.add_argument("--host-memory", default=None, metavar="GIB", help="plan every row against this host budget")
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
    unknown = set(filter(None, a.rows.split(","))) - {"fit", "exact", "dpu"}
    if unknown:
        raise SystemExit(f"{COMMAND}: --rows {a.rows}: unknown {', '.join(sorted(unknown))}; rows are fit, exact, dpu")
    a.fractions = [_number("--fractions", f, 0.0, 1.0) for f in filter(None, a.fractions.split(","))]
    try:
        a.gpu_memory = None if a.gpu_memory is None else parse_gib("--gpu-memory", a.gpu_memory)
        a.host_memory = None if a.host_memory is None else parse_gib("--host-memory", a.host_memory)
    except ValueError as e:
        raise SystemExit(f"{COMMAND}: {e}") from None
    if a.layers not in (None, "auto"):
        a.layers = int(_number("--layers", a.layers, 1, None))
    if a.hf_config is None:
        if a.layers == "auto":
            raise SystemExit(f'{COMMAND}: --layers auto: the plan picks the depth of a --hf-config model only; give '
                             "the built-in GPT's depth as a number")  # fmt: skip
        a.layers, a.layers_fit, a.hidden = a.layers or 40, a.layers_fit or 16, a.hidden or 4096
    else:
        given = [f for f, v in (("--hidden", a.hidden), ("--heads", a.heads), ("--te", a.te)) if v]
        given += ["--implementation megatron"] if a.implementation == "megatron" else []
        if given:
            raise SystemExit(f"{COMMAND}: {', '.join(given)}: describe the built-in GPT, and --hf-config brings its "
                             f"own shape; remove {', '.join(given)}")  # fmt: skip
    return a


def _number(flag: str, text: str, lo: float, hi: float | None) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (lo <= value and (hi is None or value <= hi)):  # NaN fails too
        bound = f"from {lo:g} to {hi:g}" if hi is not None else f"of at least {lo:g}"
        raise SystemExit(f"{COMMAND}: {flag} {text}: expected a number {bound}")
    return value


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and (refusal := no_cuda(COMMAND)):  # before anything is read or built
        print(refusal, file=sys.stderr)
        return 2
    if a.hf_config is not None:
        from engine.bench import hf_scale

        return hf_scale.main(a, argv)
    heads = a.heads or max(1, a.hidden // 128)
    fit_shape = Shape(a.layers_fit, a.hidden, heads, a.seq)
    shape = Shape(a.layers, a.hidden, heads, a.seq)
    fraction = resolve_fraction(a, shape)
    if a.fraction == "auto":  # each row's plan decides (the delayed update's GPU shadow may need a larger fraction)
        fraction = "auto"
    tokens = stdlib_bytes(a.data_bytes)
    device = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"{COMMAND}: hidden {a.hidden}, {heads} heads, seq {a.seq}, micro-batch {a.micro_batch}, global batch "
          f"{a.global_batch}, bf16 half weights, fp32 master + AdamW states; {a.warmup} warm-up + {a.iters} measured "
          f"iterations per row (median); {device}", flush=True)  # fmt: skip
    fit = [("fit", fit_shape, 0.0, False, False, {})] if "fit" in a.rows.split(",") else []
    rows = run_rows(a, fit + deep_rows(a, shape, fraction), tokens)
    report(a, argv, rows, fit_shape, shape, FORMULA, COMMAND)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
