"""Train a model of your own (a plain nn.Module) with the engine's activation and optimizer offloading.

    python examples/custom_model.py --device cpu --steps 5

The model is a small image classifier on torch's TransformerEncoder. What the engine needs from it:
  - its layers: found as the one ModuleList of repeated blocks (`encoder.layers` here), or named with
    `model.cpu_offloading_layers_path`; `model.cpu_offloading_num_layers` counts them (not `model.num_layers`,
    which describes only the built-in GPT and is refused with a model of your own);
  - its loss: `loss_fn(output, labels)` for `(inputs, labels)` batches, as here; a forward that takes `labels`
    and returns the loss (or an HF-style output with `.loss`) needs no loss_fn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import engine  # noqa: E402


class PatchClassifier(nn.Module):
    """Images [b, 3, 32, 32] -> class logits [b, classes], on 64 patches of 4 x 4 pixels."""

    def __init__(self, width: int = 64, layers: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, width, kernel_size=4, stride=4)
        block = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)  # [b, 64, width]
        return self.head(self.encoder(x).mean(1))


def data(batch: int, seed: int = 0):
    """Endless (images, labels): the label is the brightest of 10 fixed colour patterns, plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    while True:
        labels = torch.randint(0, 10, (batch,), generator=g)
        yield patterns[labels] + 0.1 * torch.randn(batch, 3, 32, 32, generator=g), labels


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--save", help="save an engine checkpoint (resumable) here at the end")
    args = p.parse_args(argv)
    config = {
        "model": {"cpu_offloading": True, "cpu_offloading_num_layers": 2},  # 2 of the 3 encoder layers
        "optimizer": {"lr": 3e-3, "lr_warmup_iters": 0, "optimizer_cpu_offload": True,
                      "optimizer_offload_fraction": 0.5, "use_distributed_optimizer": True},
        "train": {"train_iters": args.steps, "global_batch_size": 16, "micro_batch_size": 8, "device": args.device,
                  "precision": "bf16"},
        "logging": {"metrics_file": None, "progress_bar": False},
    }  # fmt: skip
    torch.manual_seed(0)
    eng, _, _ = engine.initialize(model=PatchClassifier(), config=config, loss_fn=nn.functional.cross_entropy)
    batches = data(8)
    losses = []
    for step in range(args.steps):
        losses.append(eng.train_batch(batches))
        print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    for line in eng.offload_report():
        print(line)
    if args.save:
        print(f"checkpoint: {eng.save_checkpoint(args.save)}")
    return losses


if __name__ == "__main__":
    main()
