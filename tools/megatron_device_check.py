#!/usr/bin/env python3
"""GPU check of engine.megatron: prints one PASS/FAIL/SKIP line per check, then a table of training runs.

On the H200 (python3.12, torch 2.11, megatron-core 0.19.2 carried as a wheel and put on PYTHONPATH):

    PYTHONUNBUFFERED=1 python3 tools/megatron_device_check.py            # about a minute
    python3 tools/megatron_device_check.py --layers 8 --hidden 2048      # a larger model
    python3 tools/megatron_device_check.py --device cpu                  # dry run of what CPU can run

Checks: SDPA core attention against megatron's DotProductAttention on CUDA; the whole GPT with megatron's
attention against SDPA; five training steps of a megatron-core GPTModel with torch AdamW (the reference),
with megatron-core's HybridDeviceOptimizer at offload fraction 0.5 and 1.0, with the engine's activation
offloading (if engine.offload is present) alone and together with the HybridDeviceOptimizer: every loss
within --tol (0.001) of the reference's, and activation offloading alone bitwise equal; then the same
through engine.initialize (skipped until the lead has wired model/optimizer.implementation='megatron');
then pytest of tests/test_megatron*.py. Writes megatron_device_check.json under $OUT when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RESULTS: list[dict] = []


def report(status: str, name: str, detail: str = "") -> None:
    RESULTS.append({"status": status, "check": name, "detail": detail})
    print(f"{status} {name}: {detail}", flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    report("PASS" if ok else "FAIL", name, detail)


def guarded(name: str):
    """Run a check function; an exception is a FAIL line with its last traceback line, not an abort."""

    def wrap(fn):
        def run(*a, **k):
            try:
                return fn(*a, **k)
            except Exception as e:  # noqa: BLE001 - the script's job is to report every check
                report("FAIL", name, f"{type(e).__name__}: {e}".splitlines()[0][:300])
                traceback.print_exc()
                return None

        return run

    return wrap


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--attention", default="auto", choices=["auto", "megatron", "sdpa"])
    p.add_argument("--min-bytes", type=int, default=None, help="engine.offload's min_bytes (default: its own)")
    p.add_argument("--no-pytest", action="store_true")
    return p.parse_args()


def env_line(args: argparse.Namespace) -> None:
    from engine import megatron

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    try:
        import triton

        tri = triton.__version__
    except Exception:  # noqa: BLE001
        tri = "absent"
    import megatron.core.optimizer as mopt

    print(
        f"ENV python {sys.version.split()[0]}, torch {torch.__version__}, GPU {gpu}, megatron-core "
        f"{megatron.version()}, TE {'yes' if megatron.te_available() else 'no'}, triton {tri}, megatron's Adam "
        f"{mopt.Adam.__module__}.{mopt.Adam.__name__}, device {args.device}",
        flush=True,
    )


@guarded("attention-parity")
def attention_parity(args: argparse.Namespace, shape: SimpleNamespace) -> None:
    """SDPA core attention vs megatron-core's own DotProductAttention, unpatched, on CUDA, fp32, GQA."""
    if args.device != "cuda":
        report("SKIP", "attention-parity", "megatron's DotProductAttention needs CUDA (tested on CPU by pytest)")
        return
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from engine import megatron
    from engine.megatron.attention import SDPACoreAttention

    megatron.ensure_model_parallel(device="cuda")
    worst = 0.0
    for groups in (shape.num_attention_heads, shape.num_attention_heads // 2):
        cfg = megatron.transformer_config(shape, num_query_groups=groups)
        ref = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
        ours = SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
        s, b, n, hn = 128, 2, shape.num_attention_heads, shape.hidden_size // shape.num_attention_heads
        q = torch.randn(s, b, n, hn, device="cuda", requires_grad=True)
        k, v = (torch.randn(s, b, groups, hn, device="cuda", requires_grad=True) for _ in range(2))
        o_ref, o = ref(q, k, v, None), ours(q, k, v, None)
        g = torch.randn_like(o)
        gr, go = torch.autograd.grad(o_ref, (q, k, v), g), torch.autograd.grad(o, (q, k, v), g)
        worst = max(
            [worst, (o - o_ref).abs().max().item()] + [(a - r).abs().max().item() for a, r in zip(go, gr, strict=True)]
        )
    check("attention-parity", worst < 1e-4, f"max |SDPA - DotProductAttention| over out and grads = {worst:.2e}")


@guarded("model-parity")
def model_parity(args: argparse.Namespace, shape: SimpleNamespace, batch) -> None:
    if args.device != "cuda":
        report("SKIP", "model-parity", "megatron's attention needs CUDA")
        return
    from engine import megatron

    logits = {}
    for attn in ("megatron", "sdpa"):
        torch.manual_seed(0)
        model = megatron.build_gpt(shape, device="cuda", core_attention=attn).cuda()
        with torch.no_grad():
            logits[attn] = model(batch[0]).float()
        del model
    d = (logits["megatron"] - logits["sdpa"]).abs().max().item()
    check("model-parity", d < 1e-3, f"fp32 logits, GPT with megatron attention vs SDPA: max diff {d:.2e}")


def make_optimizer(kind: str, model, args: argparse.Namespace, fraction: float = 0.0):
    from engine import megatron

    if kind == "torch-adamw":
        groups = megatron.megatron_param_groups(model, 0.01)
        inner = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        return megatron.MegatronOptimizerAdapter(inner)
    cfg = SimpleNamespace(
        optimizer="adam", lr=args.lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        sgd_momentum=0.9, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
        overlap_cpu_optimizer_d2h_h2d=True, pin_cpu_grads=True, pin_cpu_params=True,
    )  # fmt: skip
    return megatron.build_hybrid_optimizer(model, cfg)


def train(args: argparse.Namespace, shape: SimpleNamespace, batch, optimizer: str, fraction: float = 0.0,
          offload_layers: int = 0) -> dict:  # fmt: skip
    """`args.steps` steps on one fixed batch (bf16 autocast on CUDA, fp32 on CPU); losses before each step."""
    from engine import megatron

    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = megatron.build_gpt(shape, device=dev, core_attention=args.attention).to(dev)
    handle = None
    if offload_layers:
        from engine.offload import apply_activation_offloading

        kw = {} if args.min_bytes is None else {"min_bytes": args.min_bytes}
        handle = apply_activation_offloading(model, num_layers=offload_layers, **kw)
    opt = make_optimizer(optimizer, model, args, fraction)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, moved, t0 = [], 0, time.perf_counter()
    x, y = batch
    for _ in range(args.steps):
        with amp:
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        if handle is not None:  # between forward and backward: what the offloaded layers hold on the host
            moved = max(moved, handle.host_bytes())
        loss.backward()
        opt.clip_and_step(1.0)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if dev.type == "cuda":
        torch.cuda.synchronize()
    out = {
        "losses": losses,
        "step_s": (time.perf_counter() - t0) / args.steps,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
        "host_opt_gib": opt.host_bytes() / 2**30,
        "host_act_gib": moved / 2**30,
    }
    if handle is not None:
        handle.remove()
    del model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def training_runs(args: argparse.Namespace, shape: SimpleNamespace, batch) -> list[tuple[str, dict]]:
    try:
        import engine.offload  # noqa: F401

        have_offload = True
    except ImportError:
        have_offload = False
    k = args.layers - 1  # offload all layers but the last, the reference's maximum
    plans = [
        ("torch AdamW (reference)", dict(optimizer="torch-adamw")),
        ("megatron HDO fraction 0.5", dict(optimizer="hdo", fraction=0.5)),
        ("megatron HDO fraction 1.0", dict(optimizer="hdo", fraction=1.0)),
        (f"act offload {k} layers + AdamW", dict(optimizer="torch-adamw", offload_layers=k)),
        (f"act offload {k} layers + HDO 0.5", dict(optimizer="hdo", fraction=0.5, offload_layers=k)),
    ]
    rows: list[tuple[str, dict]] = []
    for name, plan in plans:
        if plan["optimizer"] == "hdo" and args.device != "cuda":
            report("SKIP", name, "megatron's HybridDeviceOptimizer is CUDA-only")
            continue
        if plan.get("offload_layers") and not have_offload:
            report("SKIP", name, "engine.offload is not in this tree")
            continue
        r = guarded(name)(train)(args, shape, batch, **plan)
        if r is None:
            continue
        rows.append((name, r))
        base = rows[0][1]["losses"]
        if name.startswith("torch AdamW"):
            check(name, r["losses"][-1] < r["losses"][0], f"losses {fmt(r['losses'])} (must fall)")
            continue
        diff = max(abs(a - b) for a, b in zip(r["losses"], base, strict=True))
        if plan["optimizer"] == "torch-adamw":  # activation offloading alone moves bytes, not numerics
            host_mib = r["host_act_gib"] * 1024
            check(
                name,
                diff == 0.0 and host_mib > 0,
                f"max |loss - ref| = {diff:.2e} (must be 0), {host_mib:.2f} MiB on host",
            )
        else:
            check(name, diff <= args.tol, f"max |loss - ref| = {diff:.2e} (tol {args.tol}), losses {fmt(r['losses'])}")
    return rows


def opt_state_for(adapter, saved: dict) -> dict:
    """`saved` with the live optimizer classes put back (what the adapter's load does before megatron's)."""
    sd = {**saved, "param_groups": [dict(g) for g in saved["param_groups"]]}
    for g, live in zip(sd["param_groups"], adapter.inner.param_groups, strict=True):
        g.update({k: v for k, v in live.items() if isinstance(v, type)})
    return sd


@guarded("hdo-checkpoint")
def hdo_checkpoint(args: argparse.Namespace, shape: SimpleNamespace, batch, uninterrupted: list[float]) -> None:
    """HDO 0.5: 2 steps, save model + optimizer, load (weights_only) into fresh ones, 3 more steps; the losses
    must follow the uninterrupted run's."""
    import io

    from engine import megatron

    def fresh():
        torch.manual_seed(0)
        model = megatron.build_gpt(shape, device="cuda", core_attention=args.attention).cuda()
        return model, make_optimizer("hdo", model, args, 0.5)

    def step(model, opt):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(batch[0]).float().flatten(0, 1), batch[1].flatten())
        loss.backward()
        opt.clip_and_step(1.0)
        opt.zero_grad(set_to_none=True)
        return loss.item()

    model, opt = fresh()
    losses = [step(model, opt) for _ in range(2)]
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    del model, opt
    buf.seek(0)
    state = torch.load(buf, map_location="cpu", weights_only=True)
    model, opt = fresh()
    model.load_state_dict(state["model"])
    try:  # what megatron-core's own loader does with fp32 parameters (the adapter works around a KeyError)
        _, raw = fresh()
        raw.inner.load_state_dict(opt_state_for(raw, state["opt"]))
        print("INFO megatron HDO.load_state_dict with fp32 params: works without the adapter's workaround")
    except Exception as e:  # noqa: BLE001
        print(f"INFO megatron HDO.load_state_dict with fp32 params: {type(e).__name__}: {e}"[:300])
    opt.load_state_dict(state["opt"])
    losses += [step(model, opt) for _ in range(args.steps - 2)]
    diff = max(abs(a - b) for a, b in zip(losses, uninterrupted, strict=True))
    check("hdo-checkpoint", diff <= 1e-4, f"save at step 2, load, continue: max |loss - uninterrupted| = {diff:.2e}")


@guarded("engine.initialize")
def engine_runs(args: argparse.Namespace, batch) -> None:
    """The issue's Done line through the engine: megatron GPT + activation offload + megatron's HDO vs plain."""
    import engine

    if not hasattr(engine, "initialize"):
        report("SKIP", "engine.initialize", "this tree has no engine.initialize yet")
        return
    common = {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads,
              "seq_length": args.seq, "vocab_size": args.vocab, "implementation": "megatron"}  # fmt: skip
    train_cfg = {"train_iters": args.steps, "global_batch_size": args.batch, "micro_batch_size": args.batch,
                 "precision": "bf16" if args.device == "cuda" else "fp32", "device": args.device}  # fmt: skip
    plain = {"model": common, "optimizer": {"lr": args.lr}, "train": train_cfg,
             "logging": {"progress_bar": False, "metrics_file": None}}  # fmt: skip
    offl = json.loads(json.dumps(plain))
    offl["model"].update(cpu_offloading=True, cpu_offloading_num_layers=args.layers - 1)
    if args.device == "cuda":
        offl["optimizer"].update(implementation="megatron", optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                                 use_distributed_optimizer=True,
                                 overlap_cpu_optimizer_d2h_h2d=True)  # fmt: skip
    losses = {}
    for name, cfg in (("plain", plain), ("offloaded", offl)):
        try:
            eng, _, _ = engine.initialize(config=cfg)
        except Exception as e:  # noqa: BLE001 - not wired yet reads as SKIP, not FAIL
            if "not built" in str(e).lower() or "issue 7" in str(e).lower():
                report("SKIP", "engine.initialize", f"not wired yet: {str(e).splitlines()[0][:200]}")
                return
            raise
        losses[name] = [float(eng.train_batch(iter([batch] * args.steps))) for _ in range(args.steps)]
        del eng
    diff = max(abs(a - b) for a, b in zip(losses["plain"], losses["offloaded"], strict=True))
    check("engine.initialize", diff <= args.tol,
          f"megatron GPT, act offload + megatron HDO 0.5 vs plain: max |loss diff| {diff:.2e}, "
          f"plain {fmt(losses['plain'])}")  # fmt: skip


def run_pytest(args: argparse.Namespace) -> None:
    tests = sorted(str(p) for p in (ROOT / "tests").glob("test_megatron*.py"))
    if args.no_pytest or not tests:
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-W", "ignore", "-p", "no:cacheprovider", *tests]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode:
        print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
    check("pytest tests/test_megatron*.py", proc.returncode == 0, tail)


def fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in xs) + "]"


def main() -> int:
    args = parse()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP all: no CUDA device (use --device cpu for a dry run)")
        return 0
    from engine import megatron

    if not megatron.available():
        try:
            megatron.require("model.implementation='megatron'")
        except ImportError as e:
            report("FAIL", "megatron-core import", str(e))
        return 1
    env_line(args)
    shape = SimpleNamespace(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            ffn_hidden_size=None, seq_length=args.seq, vocab_size=args.vocab, init_method_std=0.02,
                            use_te=False, recompute_granularity=None)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    toks = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
    batch = (toks[:, :-1].contiguous(), toks[:, 1:].contiguous())
    attention_parity(args, shape)
    model_parity(args, shape, batch)
    rows = training_runs(args, shape, batch)
    hdo = dict(rows).get("megatron HDO fraction 0.5")
    if hdo is not None and args.steps >= 3:
        hdo_checkpoint(args, shape, batch, hdo["losses"])
    engine_runs(args, batch)
    run_pytest(args)
    megatron.teardown()

    print(f"\nmodel: megatron-core GPTModel {args.layers}x{args.hidden}, heads {args.heads}, seq {args.seq}, vocab "
          f"{args.vocab}, batch {args.batch}, {args.steps} steps, attention {args.attention}")  # fmt: skip
    heads = ("final loss", "step s", "GPU peak GiB", "host opt GiB", "host act GiB")
    print(f"{'run':38s} " + " ".join(f"{h:>12s}" for h in heads))
    for name, r in rows:
        vals = (r["losses"][-1], r["step_s"], r["peak_gib"], r["host_opt_gib"], r["host_act_gib"])
        print(f"{name:38s} " + " ".join(f"{v:12.4f}" for v in vals))
    fails = [r for r in RESULTS if r["status"] == "FAIL"]
    print(f"\nSUMMARY {len(RESULTS) - len(fails)} ok/skipped, {len(fails)} failed: "
          + ("ALL PASS" if not fails else ", ".join(r["check"] for r in fails)))  # fmt: skip
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "megatron_device_check.json").write_text(
            json.dumps({"args": vars(args), "checks": RESULTS, "runs": dict(rows)}, indent=1)
        )
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
