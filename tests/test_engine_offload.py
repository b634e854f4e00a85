"""Activation offloading through the engine's config: same losses and weights, host bytes reported."""

import pytest
import torch

OFF = ["model.cpu_offloading=true", "model.cpu_offloading_num_layers=1"]


@pytest.fixture
def run(make_engine):
    """`run(overrides, steps=3)`: the tiny config trained for `steps` iterations; (engine, losses)."""

    def run(overrides, steps=3):
        eng, _, _ = make_engine(overrides)
        losses = [eng.train_batch() for _ in range(steps)]
        return eng, losses

    return run


@pytest.mark.parametrize(
    "extra",
    [
        OFF,
        OFF + ["model.cpu_offloading_double_buffering=true"],
        ["model.fine_grained_activation_offloading=true", 'model.offload_modules=["mlp"]'],
    ],
)
def test_offloaded_training_is_bitwise_equal(extra, run):
    base, base_losses = run([])
    off, off_losses = run(extra)
    assert off.offloader is not None
    assert off_losses == base_losses
    for p, q in zip(base.module.parameters(), off.module.parameters(), strict=True):
        assert torch.equal(p, q)


def test_host_bytes_are_reported_during_forward(run):
    # tensors of 64 KiB or less stay on the device: a shape whose activations are larger
    eng, _ = run(
        OFF + ["train.micro_batch_size=4", "train.global_batch_size=4", "model.seq_length=128", "model.hidden_size=64"],
        steps=0,
    )
    it = eng._data(None)
    loss = eng(next(it))
    assert eng.host_bytes() > 0  # the offloaded layer's saved tensors live on the host until backward
    eng.backward(loss)
