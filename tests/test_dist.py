"""Data parallelism on CPU with gloo and two processes, against one-process runs of the same global batch.

One 2-rank job (this module run as `python -m tests.test_dist worker OUT`, one process per rank, with the
environment torchrun would set) trains the scenarios below and leaves its losses, weights and checkpoint in
OUT; the tests compare them with runs of one process in pytest itself. Ranks run with one thread each,
so the job fits the CI machine's two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import engine
from engine import checkpoint, dist
from engine.optim.distributed import DistributedOptimizer, partition
from tests import ranks

ROOT = Path(__file__).resolve().parent.parent
ITERS = 4  # optimizer steps per run; checkpoints are taken after HALF of them
HALF = 2
# global batch 8 of micro-batches of 2: 4 accumulation steps on one rank, 2 on each of two (so no_sync is used).
# eps 1e-5: a weight whose first gradient cancels to ~5e-9 (layers.0.attn.qkv.weight[70, 29] at seed 1234) makes
# Adam at eps 1e-8 amplify the rounding difference of a two-rank sum to 1.5e-6 in that weight after 4 steps
DP = ["train.global_batch_size=8", "train.micro_batch_size=2", f"train.train_iters={ITERS}", "optimizer.adam_eps=1e-5"]
SHARDED = DP + ["optimizer.use_distributed_optimizer=true"]


class NamedAdamW(torch.optim.AdamW):
    """An inner optimizer shaped like the HybridDeviceOptimizer: `clip_and_step`, a state dict keyed by name."""

    def __init__(self, groups, **kwargs):
        self.names = [n for g in groups for n, _ in g["params"]]
        super().__init__(groups, **kwargs)

    def clip_and_step(self, max_norm, grad_scale=1.0):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        torch._foreach_mul_([p.grad for p in params], 1.0 / grad_scale)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"), foreach=True)
        self.step()
        return float(norm), True

    def state_dict(self):
        sd = super().state_dict()
        return {"format": "named", "state": {self.names[i]: s for i, s in sd["state"].items()},
                "param_groups": [{**g, "params": g["param_names"]} for g in sd["param_groups"]]}  # fmt: skip

    def load_state_dict(self, sd):
        index = {n: i for i, n in enumerate(self.names)}
        super().load_state_dict({"state": {index[n]: s for n, s in sd["state"].items()},
                                 "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                                  for g in sd["param_groups"]]})  # fmt: skip


def named_adamw(groups, cfg, model=None):
    o = cfg.optimizer
    return NamedAdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)


def train(config, overrides, iters, load=None, save=None, build=None):
    real = engine.first_batch.build_optimizer  # where initialize builds the optimizer
    engine.first_batch.build_optimizer = build or real
    try:
        eng, _, _ = engine.initialize(config=config, overrides=overrides)
    finally:
        engine.first_batch.build_optimizer = real
    if load:
        eng.load_checkpoint(str(load))
    losses = [eng.train_batch() for _ in range(iters)]
    if save:
        eng.save_checkpoint(str(save))
    return eng, losses


# --- the 2-rank side ---------------------------------------------------------------------------------------
def worker(out: Path) -> None:
    """Runs on every rank of the job; rank 0 writes results.json, every rank its final weights."""
    config = json.loads((out / "config.json").read_text())  # the tests' tiny config, written by `job`
    results = {}
    _, results["ddp"] = train(config, DP, ITERS)
    seen, real_hook = {"eng": None, "micro_steps": []}, DistributedOptimizer.ddp_comm_hook

    def hook(self, state, bucket):  # records which micro-batch's backward reduces
        seen["micro_steps"].append(seen["eng"] and seen["eng"].micro_step)
        return real_hook(self, state, bucket)

    DistributedOptimizer.ddp_comm_hook = hook
    eng, first = train(config, SHARDED, HALF, save=out / "ckpt_2ranks")
    seen["eng"], seen["micro_steps"] = eng, []
    results["sharded"] = first + [eng.train_batch() for _ in range(ITERS - HALF)]
    results["reducing_micro_steps"] = sorted(set(seen["micro_steps"]))
    DistributedOptimizer.ddp_comm_hook = real_hook
    opt = eng.optimizer
    results["owned_numel"] = sum(p.numel() for p in opt.owned)
    results["inner_state_numel"] = sum(s["exp_avg"].numel() for s in opt.inner.state_dict()["state"].values())
    results["grad_norm"] = float(eng.last_grad_norm)
    torch.save(eng.module.state_dict(), out / f"weights_rank{dist.rank()}.pt")
    _, results["resumed_from_1rank"] = train(config, SHARDED, ITERS - HALF, load=out / "ckpt_1rank")
    eng, first = train(config, SHARDED, HALF, save=out / "ckpt_named", build=named_adamw)
    results["named_inner"] = first + [eng.train_batch() for _ in range(ITERS - HALF)]
    shards = [None] * dist.world_size()
    torch.distributed.all_gather_object(shards, results["owned_numel"])
    results["owned_by_rank"] = shards
    if dist.is_main():
        (out / "results.json").write_text(json.dumps(results))
    dist.shutdown()


def launch(n: int, args: list[str], timeout: float = 180):
    """This module's worker (or failing) entry on ranks 0..n-1."""
    return ranks.launch("tests.test_dist", n, args, timeout)


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_config):
    """The 2-rank job, after the 1-rank run that leaves the checkpoint it resumes from."""
    out = tmp_path_factory.mktemp("dist")
    (out / "config.json").write_text(json.dumps(tiny_config))
    train(tiny_config, DP, HALF, save=out / "ckpt_1rank")
    ranks = launch(2, ["worker", str(out)])
    for r, p in enumerate(ranks):
        assert p.returncode == 0, f"rank {r}:\n{p.stderr[-3000:]}"
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def reference(tiny_config):
    """One process, the whole global batch: losses and final weights."""
    eng, losses = train(tiny_config, DP, ITERS)
    return losses, eng.module.state_dict(), float(eng.last_grad_norm)


# --- the tests ---------------------------------------------------------------------------------------------
def test_two_ranks_equal_one_rank_with_the_same_global_batch(job, reference):
    _, results = job
    assert results["ddp"] == pytest.approx(reference[0], rel=0, abs=1e-6)


def test_distributed_optimizer_equals_the_unsharded_run(job, reference):
    out, results = job
    losses, weights, grad_norm = reference
    assert results["sharded"] == pytest.approx(losses, rel=0, abs=1e-6)
    assert results["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)  # the global norm, not a shard's
    w0 = torch.load(out / "weights_rank0.pt")
    w1 = torch.load(out / "weights_rank1.pt")
    for name, ref in weights.items():
        torch.testing.assert_close(w0[name], w1[name], rtol=0, atol=0, msg=name)  # the ranks agree exactly
        torch.testing.assert_close(w0[name], ref, rtol=0, atol=1e-6, msg=name)


def test_only_the_last_micro_batch_reduces_gradients(job):
    _, results = job
    assert results["reducing_micro_steps"] == [1]  # 2 micro-batches per rank and step: the first one does not sync


def test_distributed_optimizer_shards_states_by_whole_tensors(job, reference):
    _, results = job
    total = sum(p.numel() for p in reference[1].values())
    owned = results["owned_by_rank"]
    assert sum(owned) == total and 0 < min(owned) <= max(owned) < total
    assert results["inner_state_numel"] == owned[0]  # rank 0's optimizer holds states for its shard only


def test_partition_balances_whole_tensors_deterministically():
    numels = [100, 10, 60, 40, 30, 30, 1]
    owner = partition(numels, 2)
    loads = [sum(n for n, o in zip(numels, owner, strict=True) if o == r) for r in range(2)]
    # largest first onto the lighter rank: 100->0, 60->1, 40->1, 30->0 (tie), 30->1, 10->0 (tie), 1->1
    assert owner == [0, 0, 1, 1, 0, 1, 1] and loads == [140, 131]
    assert max(loads) - min(loads) <= max(numels)  # the greedy bound
    assert partition(numels, 1) == [0] * len(numels)


def test_data_position_carries_across_world_sizes():
    saved = {"index": 6, "data_parallel_size": 2}  # 6 micro-batches on each of 2 ranks: 12 drawn in all
    assert dist.rescale_data_state(saved, 1) == {"index": 12}
    assert dist.rescale_data_state(saved, 4) == {"index": 3}
    with pytest.raises(ValueError, match="12 micro-batches drawn over 2 ranks do not split evenly over 5 ranks"):
        dist.rescale_data_state(saved, 5)


def test_single_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist.setup("cpu") == 1 and not torch.distributed.is_initialized()
    assert dist.rank_path("runs/m.jsonl") == "runs/m.jsonl"
    monkeypatch.setenv("RANK", "3")
    assert dist.rank_path("runs/m.jsonl") == "runs/m.rank3.jsonl"


def test_global_batch_is_checked_at_the_actual_world_size(monkeypatch, make_engine):
    monkeypatch.setattr(dist, "setup", lambda *a, **k: 2)  # as if torchrun had started two ranks
    with pytest.raises(engine.ConfigError, match=r"must be divisible by train.micro_batch_size \(4\) x "
                       r"data-parallel size \(2\) = 8"):  # fmt: skip
        make_engine(["train.global_batch_size=4", "train.micro_batch_size=4"])


def test_two_rank_checkpoint_resumes_on_one_rank(job, reference, tiny_config):
    out, _ = job
    _, resumed = train(tiny_config, SHARDED, ITERS - HALF, load=out / "ckpt_2ranks")
    assert resumed == pytest.approx(reference[0][HALF:], rel=0, abs=1e-6)


def test_inner_optimizer_with_its_own_clip_and_step_and_named_state(job, reference, tiny_config):
    """The shape of the HybridDeviceOptimizer: clipped through grad_scale, its state gathered by name."""
    out, results = job
    assert results["named_inner"] == pytest.approx(reference[0], rel=0, abs=1e-6)
    saved = checkpoint.load(out / "ckpt_named")["optimizer"]
    assert saved["format"] == "named" and set(saved["state"]) == set(reference[1])
    _, resumed = train(tiny_config, SHARDED, ITERS - HALF, load=out / "ckpt_named", build=named_adamw)
    assert resumed == pytest.approx(reference[0][HALF:], rel=0, abs=1e-6)


def test_one_rank_checkpoint_resumes_on_two_ranks(job, reference):
    _, results = job
    assert results["resumed_from_1rank"] == pytest.approx(reference[0][HALF:], rel=0, abs=1e-6)


def test_sharded_checkpoint_has_the_unsharded_format_and_values(job):
    """The gathered optimizer state is what the engine's optimizer over every parameter saves, element-wise."""
    out, _ = job
    sharded, plain = checkpoint.load(out / "ckpt_2ranks"), checkpoint.load(out / "ckpt_1rank")
    assert sharded["data"] == {"index": HALF * 2, "data_parallel_size": 2}
    assert plain["data"] == {"index": HALF * 4, "data_parallel_size": 1}
    a, b = sharded["optimizer"], plain["optimizer"]
    assert a["format"] == b["format"]
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert a["state"].keys() == b["state"].keys()
    for k in b["state"]:
        assert a["state"][k]["step"] == b["state"][k]["step"]
        for field in ("master", "exp_avg", "exp_avg_sq"):
            # atol 1e-6: a sum of two ranks' gradients rounds differently from one rank's sum (seen: 2e-7)
            torch.testing.assert_close(a["state"][k][field], b["state"][k][field], rtol=1e-5, atol=1e-6)


def failing(failing_rank: int) -> None:
    """A user's script where one rank raises while the other waits for it forever."""
    dist.setup("cpu")
    if dist.rank() == failing_rank:
        raise ValueError(f"boom on rank {failing_rank}")
    if failing_rank == 0:  # rank 0 hosts the store here, and the survivor is inside a real collective
        torch.distributed.all_reduce(torch.ones(1))
    threading.Event().wait(300)  # stands in for an NCCL collective that would wait for its 10-minute timeout


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_failing_rank_ends_the_job_with_its_message(failing_rank):
    ranks = launch(2, ["failing", str(failing_rank)], timeout=60)  # without the watchdog: TimeoutExpired
    survivor = ranks[1 - failing_rank]
    assert [p.returncode != 0 for p in ranks] == [True, True]
    assert f"ValueError: boom on rank {failing_rank}" in ranks[failing_rank].stderr
    assert f"error: rank {failing_rank} failed: ValueError: boom on rank {failing_rank}" in survivor.stderr, (
        survivor.stderr[-2000:]
    )


def test_torchrun_bin_train_on_two_ranks(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "bin" / "train"), "train.train_iters=2", "optimizer.lr_warmup_iters=0", "train.device=cpu",
         "train.global_batch_size=4", "train.micro_batch_size=1", "optimizer.use_distributed_optimizer=true",
         "model.num_layers=1", "model.hidden_size=32", "model.seq_length=32", "data.max_bytes=65536",
         f"logging.metrics_file={metrics}", f"checkpoint.save={tmp_path / 'ckpt'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][1:]  # after the run's header
    rows1 = [json.loads(line) for line in (tmp_path / "m.rank1.jsonl").read_text().splitlines()][1:]
    assert [r["iteration"] for r in rows] == [1, 2] and [r["loss"] for r in rows] == [r["loss"] for r in rows1]
    assert proc.stdout.count("iterations 1..2: loss") == 1  # the summary, from rank 0 only
    assert checkpoint.load(tmp_path / "ckpt")["iteration"] == 2


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(Path(sys.argv[2]))
    elif sys.argv[1] == "failing":
        failing(int(sys.argv[2]))
