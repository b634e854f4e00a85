"""`bin/bench cpass`: the C AdamW pass against torch's fused CPU AdamW, one call on large tensors.

Both step the same fp32 masters and states from a bf16 gradient and produce the bf16 weights a GPU
uploads, as the hybrid optimizer's CPU part needs them. The C pass does all of it in one pass; torch's
`AdamW(fused=True)` needs the casts around it: the gradient to fp32 before, the weights to bf16 after
(what `use_torch_optimizer_for_cpu_offload` runs). Out of place (the C pass's speculative step writes
new banks and keeps the old ones) torch first copies p, m and v into the new banks, then steps them.

Rows: G params/s per call (median of --reps after one warm-up), at --threads threads for both (the
engine's default: the cores this process may use, minus one); torch also at all cores; the torch-ops
path the engine falls back to where the C pass does not build. Needs no GPU.

Then the state forms (--forms): fp32, bf16/fp16 moments, block-wise 8-bit moments (int8_blockwise), the remainder
master (store_param_remainders), each
stepped in place by the C pass and by the torch-ops fallback, with the bytes per parameter the pass moves
through host memory (fused_kernel.pass_bytes), the GB/s that makes, and the DRAM floor measured in the same
run: an in-place torch pass over the same bytes (each read once and written once, as the C pass treats its
states) at the same threads. Beside it, the C pass's rate where DRAM does not bound it: each of --threads
processes stepping its own cache-sized slice over and over (the cores' ceiling). The lower of the two says what
limits the pass at that width: the cores or DRAM.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

from engine.optim import blockwise, fused_kernel, remainder
from engine.optim.adam_math import Hyper, adamw_scalars
from engine.optim.cpu_arith import FusedAdamW, TensorStep
from engine.optim.hybrid import default_cpu_threads

COMMAND = "bin/bench cpass"
HYPER = Hyper(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, momentum=0.0)


def _median_s(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up: first-touch page faults, thread pools
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _torch_adamw(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.optim.AdamW:
    """torch's fused CPU AdamW over one flat master whose states are the given m and v."""
    h = HYPER
    opt = torch.optim.AdamW([p], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
                            fused=True)  # fmt: skip
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}
    return opt


def measure(numel: int, threads: int, reps: int) -> list[dict]:
    """The rows; leaves torch's thread count (process-wide: it changes the losses of whatever runs next in this
    process) as it found it."""
    before = torch.get_num_threads()
    try:
        return _measure(numel, threads, reps)
    finally:
        torch.set_num_threads(before)


def _measure(numel: int, threads: int, reps: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=g)
    m = torch.randn(numel, generator=g).mul_(1e-3)
    v = torch.rand(numel, generator=g).mul_(1e-6)
    grad16 = torch.randn(numel, generator=g).bfloat16()
    grad32 = torch.empty(numel)  # torch's scratch for the cast gradient
    half = torch.empty(numel, dtype=torch.bfloat16)
    p2, m2, v2 = torch.empty_like(p), torch.empty_like(m), torch.empty_like(v)  # out-of-place banks
    scalars = adamw_scalars(HYPER, 2, 1.0, 1.0)
    rows: list[dict] = []

    def row(name: str, path: str, where: str, fn: Callable[[], None], n_threads: int) -> None:
        torch.set_num_threads(n_threads)
        s = _median_s(fn, reps)
        rows.append({"name": name, "path": path, "where": where, "threads": n_threads, "s": s,
                     "gparams_s": numel / s / 1e9})  # fmt: skip
        print(f"  {name:50s} {where:12s} {numel / s / 1e9:6.2f} G params/s ({s * 1e3:.1f} ms, {n_threads} threads)",
              flush=True)  # fmt: skip

    p.grad = grad32
    inplace = _torch_adamw(p, m, v)
    p2.grad = grad32
    outofplace = _torch_adamw(p2, m2, v2)

    def torch_kernel() -> None:
        inplace.step()

    def torch_in_place() -> None:
        grad32.copy_(grad16)
        inplace.step()
        half.copy_(p)

    def torch_out_of_place() -> None:
        grad32.copy_(grad16)
        p2.copy_(p), m2.copy_(m), v2.copy_(v)
        outofplace.step()
        half.copy_(p2)

    grad32.copy_(grad16)
    for n_threads in sorted({threads, torch.get_num_threads(), os.cpu_count() or threads}):
        if n_threads < threads:
            continue
        row("torch AdamW(fused=True), fp32 grad (no casts)", "torch", "in place", torch_kernel, n_threads)
        row("torch AdamW(fused=True) + casts: grad in, bf16 out", "torch", "in place", torch_in_place,
            n_threads)  # fmt: skip
        row("torch AdamW(fused=True) + casts + copy to new banks", "torch", "out of place", torch_out_of_place,
            n_threads)  # fmt: skip

    lib = fused_kernel.load()
    for name, lib_ in (("C pass", lib), ("torch ops (fallback)", None)):
        if name == "C pass" and lib is None:
            print(f"  C pass: not built here ({fused_kernel.status()})")
            continue
        arith = FusedAdamW(lib_, threads, host=None, group_of={})  # step() only: no host state to name
        step_in = [TensorStep(p, m, v, grad16, p, m, v, half, scalars)]
        step_out = [TensorStep(p, m, v, grad16, p2, m2, v2, half, scalars)]
        row(f"{name}, bf16 grad in, bf16 weight out", "c" if lib_ else "torch-ops", "in place",
            lambda s=step_in, a=arith: a.step(s), threads)  # fmt: skip
        row(f"{name}, bf16 grad in, bf16 weight out", "c" if lib_ else "torch-ops", "out of place",
            lambda s=step_out, a=arith: a.step(s), threads)  # fmt: skip
        arith.close()
    return rows


F32, BF16, F16, Q8 = torch.float32, torch.bfloat16, torch.float16, blockwise.CODES
FORMS = {  # name -> (exp_avg dtype, exp_avg_sq dtype, remainder master); Q8: block-wise 8-bit codes + scales
    "fp32": (F32, F32, False),
    "bf16-m/v": (BF16, BF16, False),
    "fp16-m/v": (F16, F16, False),
    "fp32-m/v+remainder": (F32, F32, True),
    "bf16-m/v+remainder": (BF16, BF16, True),
    "int8-m/v": (Q8, Q8, False),
    "int8-m/v+remainder": (Q8, Q8, True),
}


def _moment(x: torch.Tensor, dtype: torch.dtype, signed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A moment of fp32 values x held as dtype: (tensor, its per-block scales for the 8-bit form, else None)."""
    return blockwise.quantise(x, signed) if dtype == Q8 else (x.to(dtype), None)


def dram_floor_gbs(nbytes: int, threads: int, reps: int) -> float:
    """GB/s of an in-place torch pass that moves nbytes through host memory (nbytes/2 read, then written back).
    Not a copy: a copy's destination lines are read before they are written (write-allocate), so it moves 1.5x
    the bytes it is credited with and sits below what a pass that writes back what it read can reach."""
    buf = torch.zeros(max(1, nbytes // 8), dtype=torch.int32)
    torch.set_num_threads(threads)
    return 2 * 4 * buf.numel() / _median_s(lambda: buf.add_(1), reps) / 1e9


CACHE_SLICE = 1 << 16  # elements a thread steps over and over: ~1.2-2 MB of states, resident in L2/L3


def _form_step(numel: int, form: str, grad16: torch.Tensor, gen: torch.Generator) -> TensorStep:
    """One in-place TensorStep of `form` over numel parameters, with the gradient grad16 (numel long)."""
    m_dtype, v_dtype, rem = FORMS[form]
    p = torch.randn(numel, generator=gen)
    m, ms = _moment(torch.randn(numel, generator=gen).mul_(1e-3), m_dtype, True)
    v, vs = _moment(torch.rand(numel, generator=gen).mul_(1e-6), v_dtype, False)
    scalars = adamw_scalars(HYPER, 2, 1.0, 1.0)
    scales = (ms, vs, ms, vs)
    if rem:
        w, r = remainder.split(p)
        return TensorStep(w, m, v, grad16, w, m, v, None, scalars, r, r, *scales)
    half = torch.empty(numel, dtype=torch.bfloat16)
    return TensorStep(p, m, v, grad16, p, m, v, half, scalars, None, None, *scales)


def cores_rate(lib, form: str, threads: int, reps: int, calls: int = 100) -> float | None:
    """G params/s of the C pass with DRAM out of the way: each of `threads` forked processes steps its own
    CACHE_SLICE `calls` times in a row, all started together; per rep the slowest process's time, the median over
    reps after a warm-up. Processes, not threads: threads of one interpreter take the GIL for each call's ctypes
    arguments, which at a dozen threads or more outlasts a cache-sized slice's compute. None where processes
    cannot fork (Windows)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    gen = torch.Generator().manual_seed(1)
    grad16 = torch.randn(CACHE_SLICE, generator=gen).bfloat16()
    # built before the fork: the children run only the prepared ctypes calls, never torch's thread pool
    entries = [_prepared(lib, _form_step(CACHE_SLICE, form, grad16, gen)) for _ in range(threads)]
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(threads)
    pipes = [ctx.Pipe(duplex=False) for _ in entries]

    def work(entry: Callable[[], int], conn) -> None:
        entry()  # warm-up: the slice's pages become this process's own
        times = []
        for _ in range(reps):
            start.wait()
            t0 = time.perf_counter()
            for _ in range(calls):
                entry()
            times.append(time.perf_counter() - t0)
        conn.send(times)

    procs = [ctx.Process(target=work, args=(e, w), daemon=True) for e, (_, w) in zip(entries, pipes, strict=True)]
    with warnings.catch_warnings():  # 3.12 warns of fork in a threaded process; the children take no locks
        warnings.simplefilter("ignore", DeprecationWarning)
        for p in procs:
            p.start()
    times = [r.recv() for r, _ in pipes]
    for p in procs:
        p.join()
    sec = statistics.median(max(rep) for rep in zip(*times, strict=True))
    return threads * CACHE_SLICE * calls / sec / 1e9


def _prepared(lib, s: TensorStep) -> Callable[[], int]:
    """The C call that steps all of s, its arguments built once: the slice functions' own Python per call, under
    the GIL, would otherwise take longer than a cache-sized slice computes once several threads share it."""
    calls = []

    class Recorder:
        def __getattr__(self, name: str) -> Callable[..., int]:
            entry = getattr(lib, name)
            return lambda *args: calls.append((entry, args)) or 0

    n = s.p.numel()
    if s.narrow:
        fused_kernel.narrow_slice(Recorder(), 0, n, s)
    else:
        fused_kernel.adamw_slice(Recorder(), 0, n, s.p, s.m, s.v, s.g, None, s.p_out, s.m_out, s.v_out,
                                 s.half_out, s.scalars, device=s.device)  # fmt: skip
    ((entry, args),) = calls
    return lambda held=s: entry(*args)  # holds s: the arguments are raw pointers into its tensors


def measure_forms(numel: int, threads: int, reps: int, forms: list[str]) -> list[dict]:
    """One in-place step per form and path: bytes per parameter, GB/s and the in-place floor of the same bytes."""
    before = torch.get_num_threads()
    try:
        return _measure_forms(numel, threads, reps, forms)
    finally:
        torch.set_num_threads(before)


def _measure_forms(numel: int, threads: int, reps: int, forms: list[str]) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    grad16 = torch.randn(numel, generator=g).bfloat16()
    lib = fused_kernel.load()
    rows = []
    for form in forms:
        m_dtype, v_dtype, rem = FORMS[form]
        step = [_form_step(numel, form, grad16, g)]
        nbytes = fused_kernel.pass_bytes(m_dtype, v_dtype, grad16.dtype, None if rem else torch.bfloat16, rem)
        floor = dram_floor_gbs(round(nbytes * numel), threads, reps)
        for path, lib_ in (("c", lib), ("torch-ops", None)):
            if path == "c" and lib is None:
                continue
            arith = FusedAdamW(lib_, threads, host=None, group_of={})
            torch.set_num_threads(threads)
            sec = _median_s(lambda a=arith, s=step: a.step(s), reps)
            arith.close()
            gbs = nbytes * numel / sec / 1e9
            cores = cores_rate(lib_, form, threads, reps) if lib_ is not None else None
            rows.append({"form": form, "path": path, "bytes_per_param": nbytes, "s": sec,
                         "gparams_s": numel / sec / 1e9, "gbs": gbs, "floor_gbs": floor,
                         "cores_gparams_s": cores})  # fmt: skip
    print(f"\n| state form | path | B/param through DRAM | G params/s | GB/s | DRAM floor GB/s (in-place torch "
          f"pass, same bytes, {threads} threads) | of floor | in cache G params/s (the cores' ceiling) "
          "| limit |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cores = r["cores_gparams_s"]
        # the lower ceiling, in parameters per second: DRAM's floor over the bytes, or the cores' in-cache rate
        limit = "-" if cores is None else "cores" if cores * r["bytes_per_param"] < r["floor_gbs"] else "DRAM"
        print(f"| {r['form']} | {r['path']} | {r['bytes_per_param']:g} | {r['gparams_s']:.2f} | {r['gbs']:.1f} | "
              f"{r['floor_gbs']:.1f} | {r['gbs'] / r['floor_gbs']:.0%} | "
              f"{'-' if cores is None else f'{cores:.2f}'} | {limit} |")  # fmt: skip
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=200_000_000, help="parameters per call (one flat tensor)")
    ap.add_argument("--threads", type=int, default=None, help="default: the engine's (usable cores minus one)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"state forms to step ({', '.join(FORMS)}; '' none)")
    a = ap.parse_args(argv)
    forms = [f for f in a.forms.split(",") if f]
    if bad := [f for f in forms if f not in FORMS]:
        print(f"{COMMAND}: --forms {bad[0]!r} is not a state form; use some of {', '.join(FORMS)}", file=sys.stderr)
        return 2
    threads = a.threads or default_cpu_threads()
    print(f"{COMMAND}: {a.numel / 1e6:.0f} M parameters per call, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, C pass: {fused_kernel.status()}")  # fmt: skip
    rows = measure(a.numel, threads, a.reps)
    form_rows = measure_forms(a.numel, threads, a.reps, forms)
    print(f"\ncommand: {COMMAND} {' '.join(argv)}".rstrip())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": f"{COMMAND} {' '.join(argv)}", "numel": a.numel, "rows": rows,
                       "forms": form_rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
