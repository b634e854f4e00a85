"""`bin/bench optimizer`: the hybrid optimizer against megatron-core's HybridDeviceOptimizer on one GPU.

Trains the built-in GPT (bf16 weights, fp32 masters) for a few iterations at each offload fraction
with our optimizer and, in the same process on the same model and data, with Megatron's, built as
megatron.core.optimizer builds it for `optimizer_cpu_offload` without TE/Apex: torch AdamW on both
sides with fused=True, param_update_in_fp32=True, overlap on. Prints one table: median iteration time
(forward + backward + clip + step), that time over ours at f=0, peak GPU memory, the CPU step time,
the loss difference from ours at f=0, and how many measured steps were clipped.

--forms adds our rows with narrow states (bin/bench cpass's forms the optimizer builds: bf16 moments, block-wise
8-bit moments, the remainder master; fp16 moments are refused, stored unscaled) at each fraction above 0; every
row of ours states the CPU step's bytes per parameter through host memory (fused_kernel.pass_bytes) and the GB/s
reached, against the DRAM floor measured in the same run (an in-place torch pass over the same bytes, as bin/bench
cpass measures it).

Data: `--data stdlib` (default) trains on the bytes of Python's standard library sources (vocab 256),
so the loss falls and gradient norms behave as in real training; `--data random` draws uniform
tokens, on which this model is unstable (loss spikes, gradient norms up to hundreds, every step
clipped at 1.0): the worst case for overlapping a clipped step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.bench import no_cuda
from engine.bench.cpass import FORMS, dram_floor_gbs
from engine.data import stdlib_bytes
from engine.models.gpt import GPT, gpt_loss
from engine.optim import HybridDeviceOptimizer, HybridOptions
from engine.optim.fused_kernel import pass_bytes
from engine.optim.hybrid import default_cpu_threads
from engine.optim.param_groups import named_parameter_groups

COMMAND = "bin/bench optimizer"
# ours+assist: cpu_offload_gpu_assist=true (the GPU steps some host-resident units); ours+torch-cpu:
# use_torch_optimizer_for_cpu_offload=true (torch's fused CPU AdamW instead of the C pass, no speculation)
OURS = ("ours", "ours+assist", "ours+torch-cpu")


def _refusal(form: str) -> str | None:
    """Why the optimizer does not build cpass.FORMS's `form` (HybridOptions' own check: fp16 moments), or None."""
    m_dtype, v_dtype, rem = FORMS[form]
    try:
        HybridOptions(lr=1e-3, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype, store_param_remainders=rem)
    except ValueError as e:
        return str(e)
    return None


def _megatron_available() -> bool:
    from engine import megatron

    if not megatron.available():
        print("megatron-core is not importable: its rows are skipped (pip install -e '.[megatron]')")
    return megatron.available()


def _groups(model: torch.nn.Module, wd: float, named: bool) -> list[dict]:
    return named_parameter_groups(model, None, wd, named=named)


def _build(kind: str, fraction: float, model, a, form: str = "fp32") -> tuple[object, callable]:
    """The optimizer and its step(max_norm) -> None. form: cpass.FORMS's CPU-side state form (ours only)."""
    if kind in OURS:
        m_dtype, v_dtype, rem = FORMS[form]
        opt = HybridDeviceOptimizer(_groups(model, a.weight_decay, True), HybridOptions(
                                    lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                                    offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=True,
                                    cpu_threads=a.cpu_threads, gpu_assist=kind == "ours+assist",
                                    use_torch_optimizer_for_cpu_offload=kind == "ours+torch-cpu",
                                    exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
                                    store_param_remainders=rem))  # fmt: skip
        opt.attach_model(model)
        return opt, lambda: opt.clip_and_step(a.clip_grad)[0]
    from engine import megatron
    from engine.config import load_config

    # built by the same code as optimizer.implementation="megatron": as megatron.core.optimizer builds it
    # for optimizer_cpu_offload (torch AdamW on both sides without TE/Apex, fp32 master, fused)
    cfg = load_config({"optimizer": {
        "implementation": "megatron", "lr": a.lr, "weight_decay": a.weight_decay, "adam_beta1": 0.9,
        "adam_beta2": 0.95, "adam_eps": 1e-8, "optimizer_cpu_offload": True, "use_distributed_optimizer": True,
        "optimizer_offload_fraction": fraction, "overlap_cpu_optimizer_d2h_h2d": True}}).optimizer  # fmt: skip
    opt = megatron.build_megatron_optimizer(_groups(model, a.weight_decay, False), cfg)

    def step():
        if a.clip_grad > 0:  # Megatron clips, then steps; clip_grad 0 means no clipping there too
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        return norm

    return opt, step


def _run(kind: str, fraction: float, model, init_state, data, a, form: str = "fp32") -> dict:
    model.load_state_dict(init_state)
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t_setup = time.perf_counter()
    opt, step = _build(kind, fraction, model, a, form)
    setup_s = time.perf_counter() - t_setup
    times, losses, norms, cpu_steps, speculated, clipped = [], [], [], [], [], []
    for it, tokens in enumerate(data):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(model(tokens), tokens)
        loss.backward()
        norm = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        norms.append(float(norm))
        if it >= a.warmup:
            clipped.append(a.clip_grad > 0 and float(norm) > a.clip_grad)
        if kind in OURS and opt.cpu is not None and it > a.warmup:
            # the CPU step of the previous iteration, finished by now (this forward waited for it);
            # read without waiting, so the current step still overlaps the next iteration
            cpu_steps.append(opt.cpu.timing["compute_s"])
            speculated.append((opt.cpu.timing.get("speculated", 0), opt.cpu.timing.get("assisted", 0)))
    if kind in OURS:
        opt.synchronize()
    peak = torch.cuda.max_memory_allocated()
    host = opt.host_bytes() if kind in OURS else None
    cpu_params, pass_b = 0, None
    if kind in OURS and opt.cpu is not None:
        cpu_params = sum(p.numel() for p in opt.cpu.params.values())
        m_dtype, v_dtype, rem = FORMS[form]
        half = next(iter(opt.cpu.params.values())).dtype
        pass_b = pass_bytes(m_dtype, v_dtype, half, None if half == torch.float32 else half, rem)
    if kind in OURS:
        opt.close()  # removes its hooks from the model, which would otherwise keep it alive
    del opt, step
    for p in model.parameters():
        p.grad = None
    for name in ("_host_emptyCache", "_cuda_hostEmptyCache"):  # Megatron's pinned buffers come from torch's
        if hasattr(torch._C, name):  # caching host allocator, which keeps them after they are freed
            getattr(torch._C, name)()
            break
    return dict(
        kind=kind, fraction=fraction, iter_s=statistics.median(times[a.warmup :]), peak=peak, losses=losses,
        norms=norms, speculated=speculated, cpu_step_s=statistics.median(cpu_steps) if cpu_steps else None,
        setup_s=setup_s, host=host, clipped=sum(clipped), measured=len(clipped), form=form, cpu_params=cpu_params,
        pass_bytes=pass_b,
    )  # fmt: skip


def _floor(results: list[dict], a) -> float:
    """The host's DRAM floor in GB/s: an in-place torch pass over the bytes the largest CPU step moves (at most
    8 GB), at the CPU step's threads, measured now (after the runs, so it does not compete with them)."""
    moved = max((r["cpu_params"] * r["pass_bytes"] for r in results if r["pass_bytes"]), default=1 << 30)
    return dram_floor_gbs(min(moved, 8 << 30), a.cpu_threads or default_cpu_threads(), 3)


def _dram(r: dict, floor: float) -> str:
    """The CPU step's bytes per parameter and GB/s (its median compute time) against the floor."""
    if not r["pass_bytes"] or not r["cpu_step_s"]:
        return "-"
    gbs = r["pass_bytes"] * r["cpu_params"] / r["cpu_step_s"] / 1e9
    return f"{r['pass_bytes']:g} B, {gbs:.0f} GB/s ({gbs / floor:.0%})"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="0,0.25,0.5,1")
    ap.add_argument(
        "--compare",
        choices=["megatron", "none"],
        default="megatron",
        help="megatron: megatron-core's HybridDeviceOptimizer on the same model in the same run",
    )
    ap.add_argument("--megatron-fractions", default=None, help="Megatron's fractions (default: --fractions)")
    ap.add_argument("--assist-fractions", default="0.25,0.5,1", help="fractions run again with the GPU assist")
    ap.add_argument(
        "--torch-cpu-fractions",
        default="",
        help="fractions run again with use_torch_optimizer_for_cpu_offload (torch's fused CPU AdamW)",
    )
    ap.add_argument("--json", default=None, help="also write the rows (without per-iteration lists) to this file")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--data", choices=["stdlib", "random"], default="stdlib")
    built = [f for f in FORMS if _refusal(f) is None]
    ap.add_argument("--forms", default="", help=f"our rows again with these CPU-side state forms ({', '.join(built)})")
    a = ap.parse_args(argv)
    forms = [f for f in a.forms.split(",") if f]
    if bad := [f for f in forms if f not in FORMS]:
        print(f"{COMMAND}: --forms {bad[0]!r} is not a state form; use some of {', '.join(built)}", file=sys.stderr)
        return 2
    if refused := [(f, why) for f in forms if (why := _refusal(f))]:
        print(f"{COMMAND}: --forms {refused[0][0]!r}: {refused[0][1]}", file=sys.stderr)
        return 2
    if refusal := no_cuda(COMMAND):
        print(refusal, file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=a.seq,
                    vocab_size=a.vocab)  # fmt: skip
    model = model.to(torch.bfloat16)
    init_state = {k: v.clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device="cuda").manual_seed(1)
    if a.data == "random":
        data = [torch.randint(0, a.vocab, (a.micro_batch, a.seq), device="cuda", generator=g) for _ in range(a.iters)]
    else:
        stream = torch.from_numpy(stdlib_bytes(64 << 20).astype("int64")).to("cuda") % a.vocab
        starts = torch.randint(0, len(stream) - a.seq, (a.iters, a.micro_batch), device="cuda", generator=g)
        data = [stream[s[:, None] + torch.arange(a.seq, device="cuda")] for s in starts]
    print(f"GPT {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, micro-batch {a.micro_batch}, "
          f"vocab {a.vocab}: {n_params / 1e9:.3f} B params, bf16 weights + fp32 masters; {a.iters} iterations, "
          f"median of the last {a.iters - a.warmup}; clip_grad {a.clip_grad}; data {a.data}")  # fmt: skip
    runs = [("ours", float(f), "fp32") for f in a.fractions.split(",") if f]
    runs += [("ours", float(f), form) for form in forms for f in a.fractions.split(",") if f and float(f) > 0]
    runs += [("ours+assist", float(f), "fp32") for f in a.assist_fractions.split(",") if f]
    runs += [("ours+torch-cpu", float(f), "fp32") for f in a.torch_cpu_fractions.split(",") if f]
    if a.compare == "megatron" and _megatron_available():
        runs += [("megatron", float(f), "fp32") for f in (a.megatron_fractions or a.fractions).split(",") if f]
    results = []
    for kind, f, form in runs:
        r = _run(kind, f, model, init_state, data, a, form)
        results.append(r)
        cpu = f"{r['cpu_step_s'] * 1e3:.0f} ms" if r["cpu_step_s"] is not None else "-"
        print(f"  done {kind:11s} f={f:<4}: {r['iter_s'] * 1e3:7.1f} ms/iter, peak {r['peak'] / 2**30:.1f} GiB, "
              f"CPU step {cpu}, setup {r['setup_s']:.1f} s", flush=True)  # fmt: skip
        losses, norms = " ".join(f"{x:.3f}" for x in r["losses"]), " ".join(f"{x:.2f}" for x in r["norms"])
        print(f"      loss {losses} | grad norm {norms} | units (guessed in backward, GPU-assisted) {r['speculated']}")
    base = next((r for r in results if r["kind"] == "ours" and r["fraction"] == 0.0), results[0])
    floor = _floor(results, a)
    print()
    print("| optimizer | f | iteration (median) | vs ours f=0 | peak GPU memory | CPU step | CPU step B/param, GB/s "
          f"(DRAM floor {floor:.0f} GB/s) | loss delta vs f=0 | clipped steps |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        mega = next((m for m in results if m["kind"] == "megatron" and m["fraction"] == r["fraction"]), None)
        vs = f" ({mega['iter_s'] / r['iter_s']:.1f}x faster than Megatron)" if r["kind"] in OURS and mega else ""
        cpu = f"{r['cpu_step_s'] * 1e3:.0f} ms" if r["cpu_step_s"] is not None else "-"
        dl = max(abs(x - y) for x, y in zip(r["losses"], base["losses"], strict=True))
        it = f"{r['iter_s'] * 1e3:.1f} ms{vs}"
        kind = r["kind"] if r["form"] == "fp32" else f"{r['kind']} [{r['form']}]"
        print(f"| {kind} | {r['fraction']} | {it} | {r['iter_s'] / base['iter_s']:.2f}x | "
              f"{r['peak'] / 2**30:.2f} GiB | {cpu} | {_dram(r, floor)} | {dl:.2e} | "
              f"{r['clipped']}/{r['measured']} |")  # fmt: skip
    print(f"\ncommand: {COMMAND} {' '.join(argv)}".rstrip())
    if a.json:
        keep = ("kind", "fraction", "iter_s", "peak", "cpu_step_s", "setup_s", "host", "clipped", "measured", "form",
                "cpu_params", "pass_bytes")  # fmt: skip
        with open(a.json, "w") as f:
            json.dump({"command": f"{COMMAND} {' '.join(argv)}", "params": n_params, "dram_floor_gbs": floor,
                       "rows": [{k: r[k] for k in keep} for r in results]}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
