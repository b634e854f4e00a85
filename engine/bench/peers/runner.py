"""One row of `bin/bench peers` in its own process: `python -m engine.bench.peers.runner '<spec as JSON>'`.

Trains the spec's peer for warmup + iters steps and prints one line, `PEERS_ROW {json}`: the per-step losses,
the median step time (the mean for a peer with periodic updates, trainers.PERIODS), each step's time, the peak GPU
memory (torch's allocator, from after the model was built), the process's peak RSS (VmHWM: pinned buffers and
the peer's own host copies included), or `error`: the first line of why the peer could not run.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from engine.bench.peers import models
from engine.bench.peers.trainers import PERIODS, TRAINERS
from engine.planning.budget import peak_rss_bytes

MARK = "PEERS_ROW "


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(spec: dict) -> dict:
    """The measurements of one peer's run (raises whatever the peer raises)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    data = models.batches(spec, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = TRAINERS[spec["peer"]](spec, device)
    setup_s = time.perf_counter() - t0
    losses, times = [], []
    for inputs, labels in data:
        t = time.perf_counter()
        loss = trainer.step(inputs, labels)
        losses.append(float(loss.detach()))  # waits for the GPU's work of this step
        _sync(device)
        times.append(time.perf_counter() - t)
    trainer.close()
    measured = times[spec["warmup"] :]
    iter_s = (statistics.mean if spec["peer"] in PERIODS else statistics.median)(measured)
    tokens_per_s = spec["micro_batch"] * spec["seq"] / iter_s
    return {
        "losses": losses,
        "iter_ms": 1e3 * iter_s,
        "step_ms": [1e3 * t for t in times],
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * models.flops_per_token(spec) / 1e12,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "setup_s": setup_s,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
    }


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    try:
        row = train(spec)
    except Exception as e:  # the row says why; the bench goes on with the next peer
        row = {"error": first_line(e)}
    print(MARK + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
