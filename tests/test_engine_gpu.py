"""The engine on CUDA: the same step as on CPU, bf16 autocast, and checkpoint resume."""

import copy

import pytest
import torch

import engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="Requires: CUDA")]


def test_trains_on_cuda_in_bf16_autocast(tiny_config):
    eng, _, _ = engine.initialize(
        config=tiny_config,
        overrides=["train.device=cuda", "train.precision=bf16", "train.train_iters=30", "optimizer.lr=3e-3"],
    )
    assert eng.device.type == "cuda"
    losses = [eng.train_batch() for _ in range(30)]
    assert losses[-1] < 0.8 * losses[0]
    assert eng.peak_memory_bytes() > 0


def test_cuda_matches_cpu_in_fp32(make_engine):
    # the built-in GPT's initial weights are drawn on the training device, and CPU and CUDA generators differ:
    # the CUDA run starts from the CPU run's initial weights, so only the arithmetic is compared
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu, _, _ = make_engine(["train.device=cpu", "train.precision=fp32"])
    start = copy.deepcopy(cpu.module)
    cpu_losses = [cpu.train_batch() for _ in range(4)]
    cuda, _, _ = make_engine(["train.device=cuda", "train.precision=fp32"], model=start.to("cuda"))
    assert [cuda.train_batch() for _ in range(4)] == pytest.approx(cpu_losses, rel=1e-4)


def test_resume_on_cuda(tmp_path, tiny_config):
    o = ["train.device=cuda", "train.precision=bf16"]
    a, _, _ = engine.initialize(config=tiny_config, overrides=o)
    straight = [a.train_batch() for _ in range(4)]
    b, _, _ = engine.initialize(config=tiny_config, overrides=o)
    first = [b.train_batch() for _ in range(2)]
    b.save_checkpoint(str(tmp_path))
    c, _, _ = engine.initialize(config=tiny_config, overrides=o)
    c.load_checkpoint(str(tmp_path))
    assert first + [c.train_batch() for _ in range(2)] == straight
