"""`bin/bench peers`: the same model, data, seed, precision, clipping and steps trained by each offloading peer.

Rows (each trained in its own process, so one peer's memory does not affect the next; `--peers` picks them):
  plain           torch AdamW, nothing offloaded: the reference the loss column is measured against
  ours            the engine (Engine.train_batch) at each --fractions value, exact update
  ours-delayed    the same with optimizer.delayed_param_update (CPU-stepped parameters one step late)
  megatron        megatron-core's HybridDeviceOptimizer at each fraction (built as `bin/bench optimizer` builds it)
  ds-zero2        DeepSpeed ZeRO-2 + offload_optimizer cpu (ZeRO-Offload, DeepSpeedCPUAdam): every step on the CPU
  ds-zero3-ratio  DeepSpeed ZeRO-3 + offload_optimizer ratio=f (Twin-Flow) at each fraction
  ds-zenflow      DeepSpeed ZenFlow (ZeRO-2 + CPU offload, top-k columns stepped on the GPU, the rest late)
  torchao         torchao.optim.CPUOffloadOptimizer (every step on the CPU)
  fsdp2           FSDP2 fully_shard on one rank with CPUOffloadPolicy (parameters and Adam on the host)
All: AdamW (0.9, 0.95, eps 1e-8), bf16 compute, fp32 master weights and Adam states, gradients clipped to
--clip-grad, one micro-batch per step of the stdlib bytes (vocab 256). A peer that is not installed or fails
is a row with the first line of its error. The loss column is each run's loss after the last step minus the
plain run's, and the largest |difference| over all steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from engine.bench.peers.trainers import PERIODS, SEMANTICS, TRAINERS
from engine.planning.budget import meminfo

COMMAND = "bin/bench peers"
RUNNER = "engine.bench.peers.runner"
AT_FRACTION = ("ours", "ours-delayed", "megatron", "ds-zero3-ratio")  # the rest offload all of the Adam step
OOM_SHARE = 0.8  # a child killed past this share of host memory ran out of it
DEFAULT_PEERS = "plain,ours,ours-delayed,megatron,ds-zero2,ds-zero3-ratio,ds-zenflow,torchao,fsdp2"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        choices=["gpt", "llama"],
        default="gpt",
        help="gpt: the built-in GPT; llama: transformers' LlamaForCausalLM of the same depth and width",
    )
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 128)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--fractions", default="0.25,0.5,1", help="the CPU-stepped fractions of the rows that take one")
    ap.add_argument("--peers", default=DEFAULT_PEERS, help="which rows, comma-separated")
    ap.add_argument("--iters", type=int, default=6, help="measured steps per row (the loss column is after all)")
    ap.add_argument("--warmup", type=int, default=3)
    # a few steps from initialisation at 1 B: 1e-4 made rows' loss rise; 1e-6 fell (tools/short_lr_gpu.sh, BENCHMARKS)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cpu-threads", type=int, default=None, help="ours' optimizer.cpu_optimizer_threads")
    ap.add_argument("--threads", type=int, default=None, help="torch's thread count in each row's process")
    ap.add_argument("--data-bytes", type=int, default=16 << 20)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one row may run before it is a failure")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--runner", default=RUNNER, help=argparse.SUPPRESS)  # the child module; a test plants one
    return ap  # fmt: skip


def _spec(a: argparse.Namespace, peer: str, fraction: float) -> dict:
    return {"peer": peer, "fraction": fraction, "model": a.model, "layers": a.layers, "hidden": a.hidden,
            "heads": a.heads or max(1, a.hidden // 128), "seq": a.seq, "micro_batch": a.micro_batch,
            "iters": a.iters, "warmup": a.warmup, "seed": a.seed, "lr": a.lr, "weight_decay": a.weight_decay,
            "clip": a.clip_grad, "cpu_threads": a.cpu_threads, "threads": a.threads,
            "data_bytes": a.data_bytes}  # fmt: skip


def run_row(a: argparse.Namespace, spec: dict) -> dict:
    """One peer in a child process: its `PEERS_ROW` line, or why there is none (its last error line)."""
    from engine.bench.peers.runner import MARK

    row = {"peer": spec["peer"], "fraction": spec["fraction"], "semantics": SEMANTICS[spec["peer"]]}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    here = os.getcwd()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*sys.path[:1], here, env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, "-m", a.runner, json.dumps(spec)], stdout=out, stderr=err, env=env)
        reaped = _wait(child, a.timeout)
        if reaped is None:
            return {**row, "error": f"no result within --timeout {a.timeout:g} s"}
        returncode, peak_rss = reaped
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MARK)]
    if lines:
        return {**row, **json.loads(lines[-1][len(MARK) :])}
    last = [ln for ln in (stderr + stdout).splitlines() if ln.strip()]
    return {**row, "error": _death(returncode, peak_rss, last[-1] if last else "no output")}


def _wait(child: subprocess.Popen, timeout: float) -> tuple[int, int] | None:
    """The child's exit code and its own peak RSS in bytes (wait4's rusage), or None after killing it at timeout.

    wait4 rather than RUSAGE_CHILDREN: the latter is the largest of every row so far, not this row's."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
            return child.returncode, usage.ru_maxrss * 1024  # Linux reports KiB
        if time.monotonic() > deadline:
            child.kill()
            child.wait()
            return None
        time.sleep(0.05)


def _death(returncode: int, peak_rss: int, last_line: str) -> str:
    """Why a child left no row: its exit code and last line, or the signal that killed it and how much host
    memory it held then (SIGKILL near the machine's memory is the kernel's out-of-memory killer)."""
    if returncode >= 0:
        return f"exited {returncode}: {last_line}"
    name = signal.Signals(-returncode).name
    host = meminfo().get("MemTotal", 0)
    held = f"killed by {name} at {peak_rss / 2**30:.1f} GiB peak host RSS of {host / 2**30:.1f} GiB"
    if name == "SIGKILL" and peak_rss > OOM_SHARE * host:
        return f"{held}: out of host memory (does not fit)"
    return f"{held}: {last_line}"


def compare(rows: list[dict]) -> None:
    """Each measured row's loss after the last step against the plain run's, and the largest |difference|."""
    plain = next((r for r in rows if r["peer"] == "plain" and "losses" in r), None)
    for r in rows:
        if plain is None or "losses" not in r:
            continue
        r["loss_delta"] = r["losses"][-1] - plain["losses"][-1]
        r["loss_max_abs_delta"] = max(abs(x - y) for x, y in zip(r["losses"], plain["losses"], strict=True))


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def table(rows: list[dict], iters: int) -> str:
    out = [f"| peer | f | ms/iter | tokens/s | TFLOP/s | peak GPU | peak host RSS | loss after {iters} steps "
           "(- plain; max abs over steps) | semantics |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        head = f"| {r['peer']} | {r['fraction']:g} |"
        if "error" in r:
            out.append(f"{head} not run: {r['error']} | | | | | | {r['semantics']} |")
            continue
        delta = f" ({r['loss_delta']:+.4f}; {r['loss_max_abs_delta']:.4f})" if "loss_delta" in r else ""
        out.append(f"{head} {r['iter_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | "
                   f"{_gib(r['peak_gpu_bytes'])} | {_gib(r['peak_rss_bytes'])} | {r['losses'][-1]:.4f}{delta}"
                   f"{rose(r)} | {r['semantics']} |")  # fmt: skip
    return "\n".join(out)


def rose(r: dict) -> str:
    """A warning where a row's loss ended above where it began: its comparison is then of a divergence."""
    first, last = r["losses"][0], r["losses"][-1]
    return f"; ROSE from {first:.4f}: lower --lr" if last > first else ""


def plan_rows(a: argparse.Namespace) -> list[tuple[str, float]]:
    fractions = [float(f) for f in a.fractions.split(",") if f]
    rows = []
    for peer in filter(None, a.peers.split(",")):
        if peer not in TRAINERS:
            raise SystemExit(f"{COMMAND}: --peers {peer!r}: not a peer; choose from {', '.join(TRAINERS)}")
        rows += [(peer, f) for f in fractions] if peer in AT_FRACTION else [(peer, 0.0 if peer == "plain" else 1.0)]
    return rows


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    heads = a.heads or max(1, a.hidden // 128)
    print(f"{COMMAND}: {a.model} {a.layers} layers, hidden {a.hidden}, {heads} heads, seq {a.seq}, micro-batch "
          f"{a.micro_batch}; {a.warmup} warm-up + {a.iters} measured steps per row (median; ZenFlow's mean), "
          f"clip {a.clip_grad}, lr {a.lr}, seed {a.seed}; each row in its own process", flush=True)  # fmt: skip
    planned = plan_rows(a)
    for peer in sorted({p for p, _ in planned if a.iters % PERIODS.get(p, 1)}):
        print(f"  note: {peer} updates every {PERIODS[peer]} steps; --iters {a.iters} is not a multiple of that, "
              "so its mean ms/iter holds a part of an interval", flush=True)  # fmt: skip
    rows = []
    for peer, f in planned:
        r = run_row(a, _spec(a, peer, f))
        rows.append(r)
        compare(rows)
        write_json(a, argv, rows, partial=True)  # a run stopped from outside keeps the rows it finished
        print(f"  {peer} f={f:g}: {progress(r)}", flush=True)
    device = next((r["device"] for r in rows if "device" in r), "-")
    print(f"\ndevice: {device}; TFLOP/s counts 6*N + 12*L*h*s per token (bin/bench scale's formula)\n")
    print(table(rows, a.warmup + a.iters))
    print(f"\ncommand: {COMMAND} {' '.join(argv)}".rstrip())
    write_json(a, argv, rows, partial=False)
    return 0


def progress(r: dict) -> str:
    """A finished row in one line: enough of it to read where the table is never printed."""
    if "error" in r:
        return f"not run: {r['error']}"
    peak = f", peak GPU {r['peak_gpu_bytes'] / 2**30:.1f} GiB" if r.get("peak_gpu_bytes") else ""
    delta = f" ({r['loss_delta']:+.4f} vs plain)" if "loss_delta" in r else ""
    return (
        f"{r['iter_ms']:.1f} ms/iter, setup {r['setup_s']:.1f} s{peak}, host RSS "
        f"{r['peak_rss_bytes'] / 2**30:.1f} GiB, last loss {r['losses'][-1]:.4f}{delta}{rose(r)}"
    )


def write_json(a: argparse.Namespace, argv: list[str], rows: list[dict], partial: bool) -> None:
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"argv": argv, "rows": rows, **({"partial": True} if partial else {})}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
