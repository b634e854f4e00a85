"""Train a HuggingFace causal LM with the engine's activation and optimizer offloading, then `save_pretrained`.

    python examples/hf_causal_lm.py --preset tiny --device cpu --steps 3           # a tiny random Llama, CPU
    python examples/hf_causal_lm.py --model path/to/local/dir --save out/          # config (and weights) from a dir
    python examples/hf_causal_lm.py --preset llama-1.1b --activation-layers 21 --optimizer-fraction 0.5
    python examples/hf_causal_lm.py --preset llama3-8b --seq 4096 --micro-batch 1 --accum 8 --params-dtype half \
        --optimizer-fraction auto --activation-layers auto        # Llama-3-8B's shape on one H200: the plan picks

The model is built from its config (random weights, on the training device, in bf16 under --params-dtype half)
unless the directory holds weights; nothing is downloaded. The first micro-batch is given to engine.initialize as
`example_batch`: the memory plan measures the activations, logits and loss at that shape (which "auto" needs).
Batches are written the HF way (`input_ids`, `attention_mask`, `labels`) and there is no loss_fn: the model's
own loss is used. The data are byte tokens of the Python standard library's sources (real text on every
machine); bring your own tokenized batches for real training. The last line is a JSON record of the run
(seconds per iteration after warm-up, peak GPU memory) for tools/hf_gpu.sh.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import engine  # noqa: E402
from engine.bench.hf_models import SHAPES, build, flops_per_token, hf_config  # noqa: E402
from engine.data import stdlib_bytes  # noqa: E402
from engine.metrics import format_bytes  # noqa: E402
from engine.planning import preflight  # noqa: E402
from engine.planning.budget import peak_rss_bytes  # noqa: E402

PRESETS = SHAPES  # named shapes, one table with bin/bench scale --hf-config (engine/bench/hf_models.py)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local directory with config.json (and weights, if any)")
    src.add_argument("--preset", choices=list(PRESETS), default="tiny", help="a named shape, built from its config")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument(
        "--activation-layers",
        type=_count_or_auto,
        default=0,
        help='layers whose activations go to the host, or "auto": the memory plan chooses',
    )
    p.add_argument(
        "--optimizer-fraction",
        type=_fraction_or_auto,
        default=0.0,
        help='share of the optimizer the CPU steps, or "auto": the memory plan chooses',
    )
    p.add_argument("--layers", type=int, default=None, help="another depth of the preset (a twin that fits)")
    p.add_argument("--clip", type=float, default=1.0, help="optimizer.clip_grad")
    p.add_argument("--delayed", action="store_true", help="optimizer.delayed_param_update")
    p.add_argument("--recompute", action="store_true", help='model.recompute_granularity="full"')
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--params-dtype", choices=["fp32", "half"], default="fp32")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup", type=int, default=None,
                   help="linear warm-up steps (default: all of --steps: a random-init model at full lr from step 1 "
                        "can make the loss rise)")  # fmt: skip
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--save", help="save_pretrained here at the end")
    p.add_argument("--override", action="append", default=[], help="any config override, e.g. train.seed=1")
    return p.parse_args(argv)


def _count_or_auto(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _fraction_or_auto(text: str) -> float | str:
    return text if text == "auto" else float(text)


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    import transformers

    dtype = torch.bfloat16 if args.params_dtype == "half" and args.precision == "bf16" else torch.float32
    if args.model is None:  # built where it trains, in its training dtype: no host or fp32 copy of 8 B parameters
        return build(hf_config(PRESETS[args.preset], args.layers), device, dtype, seed=0)
    with device:
        folder = Path(args.model)
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        has_weights = any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
        if has_weights:
            return transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        return transformers.AutoModelForCausalLM.from_config(config)


def batches(seq: int, micro_batch: int, seed: int = 0):
    """Endless micro-batches of random windows of byte tokens; labels are the inputs (HF shifts them itself)."""
    tokens = torch.from_numpy(stdlib_bytes(1 << 22).astype("int64"))
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq, (micro_batch,), generator=g)
        ids = torch.stack([tokens[s : s + seq] for s in starts.tolist()])
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def overrides(args: argparse.Namespace) -> list[str]:
    out = [f"optimizer.clip_grad={args.clip}"]
    if args.activation_layers:
        out += ["model.cpu_offloading=true", f"model.cpu_offloading_num_layers={args.activation_layers}"]
    if args.optimizer_fraction:
        out += ["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true",
                f"optimizer.optimizer_offload_fraction={args.optimizer_fraction}",
                "optimizer.overlap_cpu_optimizer_d2h_h2d=true"]  # fmt: skip
    if args.delayed:
        out += ["optimizer.delayed_param_update=true", "optimizer.delayed_param_update_warmup=1"]
    if args.recompute:
        out += ["model.recompute_granularity=full"]
    return out + args.override


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    config = {
        "optimizer": {"lr": args.lr, "lr_warmup_iters": args.steps if args.lr_warmup is None else args.lr_warmup,
                      "lr_decay_style": "constant"},
        "train": {"train_iters": args.steps, "micro_batch_size": args.micro_batch, "device": args.device,
                  "global_batch_size": args.micro_batch * args.accum, "precision": args.precision,
                  "params_dtype": args.params_dtype},
        "logging": {"metrics_file": None, "progress_bar": False},
    }  # fmt: skip
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    model = build_model(args, device)
    data, times, losses = batches(args.seq, args.micro_batch), [], []
    first = next(data)
    eng, _, _ = engine.initialize(model=model, config=config, overrides=overrides(args), example_batch=first)
    data = itertools.chain([first], data)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        start = time.perf_counter()
        losses.append(eng.train_batch(data))  # the loss's .item() waits for the step's GPU work
        times.append(time.perf_counter() - start)
        print(f"step {step + 1}/{args.steps}: loss {losses[-1]:.4f}, {times[-1]:.3f} s", flush=True)
    timed = times[args.warmup :] or times
    c = eng.config
    _, plan = preflight.last()
    s_per_iter = statistics.median(timed)
    tokens = c.train.global_batch_size * args.seq
    result = {
        "model": args.model or args.preset,
        "layers": model.config.num_hidden_layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "activation_layers": c.model.cpu_offloading_num_layers if c.model.cpu_offloading else 0,
        "optimizer_fraction": c.optimizer.optimizer_offload_fraction if c.optimizer.optimizer_cpu_offload else 0.0,
        "auto": {k: v for k, v in plan.auto.items() if v},
        "s_per_iter": s_per_iter,
        "predicted_s_per_iter": plan.step_time.total_s if plan.step_time is not None else None,  # the plan's model
        "tokens_per_s": tokens / s_per_iter,
        "tflops": tokens * flops_per_token(model, model.config, args.seq)["total"] / s_per_iter / 1e12,
        "plan_gpu_bytes": plan.gpu.total_bytes,
        "plan_host_bytes": plan.host.total_bytes,
        "plan_fits": plan.fits,
        "peak_host_bytes": peak_rss_bytes(),
        "peak_gpu_bytes": eng.peak_memory_bytes() if device.type == "cuda" else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "offload": eng.offload_report(),
    }
    for line in result["offload"]:
        print(line)
    if args.save:
        eng.save_pretrained(args.save)
        print(f"saved to {args.save} (load with {type(eng.module).__name__}.from_pretrained)")
    peak = "" if result["peak_gpu_bytes"] is None else f", peak GPU memory {format_bytes(result['peak_gpu_bytes'])}"
    print(f"median {result['s_per_iter']:.3f} s/iter{peak}")
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
