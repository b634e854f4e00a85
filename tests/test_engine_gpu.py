"""The engine on CUDA: the same step as on CPU, bf16 autocast, and checkpoint resume."""

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


def test_cuda_matches_cpu_in_fp32(tiny_config):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runs = {}
    for device in ("cpu", "cuda"):
        eng, _, _ = engine.initialize(config=tiny_config, overrides=[f"train.device={device}", "train.precision=fp32"])
        runs[device] = [eng.train_batch() for _ in range(4)]
    assert runs["cuda"] == pytest.approx(runs["cpu"], rel=1e-4)


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
