"""Fused linear cross-entropy against the model's own loss on one GPU: peak memory and time of forward+backward.

A one-layer Qwen2 with Qwen2.5-7B's head (vocab 152064, hidden 3584, 28 heads, 4 KV heads, MLP 18944), random
init on the GPU in bf16, one sequence of 8192 tokens (labels = input ids, the last 512 set to -100): the model's
own loss (`model(**batch).loss`, full fp32 logits) against model.fused_linear_cross_entropy at a few chunk sizes.
Prints the loss, peak GPU memory above the model and its gradients, the median time of 5 forward+backward
passes, and the bytes engine.models.linear_cross_entropy says the fused loss holds.

Usage (repo root on the device; the engine itself needs no install for this script):
    python3 tools/fused_loss_gpu.py               # about 1 minute on an H200
    FUSED_LOSS_TINY=1 python3 tools/fused_loss_gpu.py   # the same on a CPU at a tiny shape
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import transformers as T

sys.path.insert(0, os.getcwd())
from engine.batch import BatchLoss  # noqa: E402
from engine.models.linear_cross_entropy import fused_linear_cross_entropy_bytes  # noqa: E402

TINY = os.environ.get("FUSED_LOSS_TINY") == "1"
VOCAB, HIDDEN, SEQ = (1000, 64, 256) if TINY else (152064, 3584, 8192)
CHUNKS = (32, 128) if TINY else (1024, 2048, 4096)
DEVICE = torch.device("cpu" if TINY else "cuda")


def build() -> torch.nn.Module:
    heads, kv, mlp = (4, 2, 4 * HIDDEN) if TINY else (28, 4, 18944)
    cfg = T.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=mlp, num_hidden_layers=1,
                        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=SEQ,
                        attn_implementation="sdpa")  # fmt: skip
    with torch.device(DEVICE):
        return T.Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def measure(model, batch, chunk: int | None) -> tuple[float, float, float]:
    """(loss, peak bytes above the start, median seconds) of forward+backward."""
    loss_of = BatchLoss(None, True)
    if chunk is not None:
        loss_of.fused = (model.get_output_embeddings(), chunk)
    times, loss = [], None
    for i in range(6):
        model.zero_grad(set_to_none=False)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start_bytes = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = loss_of(model, batch, DEVICE)
        loss.backward()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first pass warms up
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - start_bytes if DEVICE.type == "cuda" else float("nan")
    return float(loss.detach()), peak, statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    model = build()
    for p in model.parameters():  # gradients allocated once, outside what is measured
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, VOCAB, (1, SEQ), device=DEVICE)
    labels = ids.clone()
    labels[:, -512 if not TINY else -16 :] = -100
    batch = {"input_ids": ids, "labels": labels}
    rows = [("model's own", *measure(model, batch, None), None)]
    for chunk in CHUNKS:
        rows.append((f"fused, chunk {chunk}", *measure(model, batch, chunk),
                     fused_linear_cross_entropy_bytes(SEQ, HIDDEN, VOCAB, chunk)))  # fmt: skip
    print(
        f"command: {'FUSED_LOSS_TINY=1 ' if TINY else ''}python3 tools/fused_loss_gpu.py  "
        f"(vocab {VOCAB}, hidden {HIDDEN}, seq {SEQ}, bf16, 1 layer, {DEVICE.type})"
    )
    print(f"{'loss':<20} {'value':>10} {'peak GiB':>9} {'ms':>8} {'planned GiB':>12}")
    for name, value, peak, secs, planned in rows:
        shown = "-" if planned is None else f"{planned / 2**30:.2f}"
        print(f"{name:<20} {value:>10.5f} {peak / 2**30:>9.2f} {secs * 1e3:>8.1f} {shown:>12}")


if __name__ == "__main__":
    main()
