"""Data parallel with parameters a step does not use (a conditional branch, a head never called), on gloo with
two processes, against one process over the same global batches.

The model picks one of two branches per micro-batch from its data, so within one global batch a rank may use
only branch `a` while the other uses only `b`, and in another step no rank uses `b`; its `unused` layer is never
called. Without DDP's find_unused_parameters the second forward fails with DDP's "Expected to have finished
reduction in the prior iteration"; the engine turns it on by itself for a model passed to engine.initialize.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import engine
from engine import dist
from tests.ranks import launch

STEPS, MICRO_BATCHES = 3, 4  # optimizer steps; micro-batches per global batch (2 per rank on two ranks)
# which branch each micro-batch of each step takes: rank 0 gets the first two of a step, rank 1 the last two
BRANCHES = [["a", "a", "b", "b"], ["a", "a", "a", "a"], ["a", "b", "a", "b"]]
CFG = {
    "optimizer": {"lr": 1e-2, "clip_grad": 1.0, "lr_decay_style": "constant"},
    "train": {"train_iters": STEPS, "global_batch_size": 2 * MICRO_BATCHES, "micro_batch_size": 2,
              "precision": "fp32", "device": "cpu"},
    "logging": {"metrics_file": None, "progress_bar": False},
}  # fmt: skip


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)  # an HF-style head this task never calls
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = self.a(h) if bool(input_ids[0, 0] == 0) else self.b(h)  # the branch is chosen by the data
        return nn.functional.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), labels.flatten())


def micro_batch(step: int, i: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + i)
    ids = torch.randint(1, 16, (2, 6), generator=g)
    ids[0, 0] = 0 if BRANCHES[step][i] == "a" else 1
    return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}


def run(rank: int = 0, world: int = 1, overrides=()) -> tuple[list[float], dict]:
    eng, _, _ = engine.initialize(model=Branchy(), config=CFG, overrides=list(overrides))
    per_rank = MICRO_BATCHES // world
    losses = []
    for step in range(STEPS):
        mine = [micro_batch(step, rank * per_rank + j) for j in range(per_rank)]
        losses.append(eng.train_batch(iter(mine)))
    return losses, {k: v.clone() for k, v in eng.module.state_dict().items()}


def worker(out: Path) -> None:
    """Every rank trains; rank 0 writes the losses and weights."""
    results = {}
    for name, overrides in (("plain", []), ("offloaded", OFFLOAD)):
        losses, weights = run(dist.rank(), dist.world_size(), overrides)
        results[name] = losses
        if dist.is_main():
            torch.save(weights, out / f"weights_{name}.pt")
    if dist.is_main():
        (out / "results.json").write_text(json.dumps(results))
    dist.shutdown()


OFFLOAD = ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5",
           "optimizer.use_distributed_optimizer=true"]  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("unused")
    ranks = launch("tests.test_dist_unused", 2, ["worker", str(out)])
    for r, p in enumerate(ranks):
        assert p.returncode == 0, f"rank {r}:\n{p.stderr[-3000:]}"
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("name", ["plain", "offloaded"])
def test_unused_parameters_on_two_ranks_equal_one_rank(job, name):
    out, results = job
    losses, weights = run(overrides=OFFLOAD if name == "offloaded" else ())
    assert results[name] == pytest.approx(losses, rel=1e-6)
    two = torch.load(out / f"weights_{name}.pt", weights_only=True)
    for k, v in weights.items():
        torch.testing.assert_close(two[k], v, rtol=1e-5, atol=1e-7, msg=k)
    assert torch.equal(two["unused.weight"], Branchy().unused.weight)  # never stepped: no gradient, no decay


if __name__ == "__main__" and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]))
