"""The optional extras' gates: with megatron-core or Transformer Engine absent, asking for them fails with one
line that names the option and the extra to install. Runs everywhere (no megatron-core needed)."""

from types import SimpleNamespace

import pytest

from engine import megatron
from engine.models.te import build_te_layers

SHAPE = SimpleNamespace(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=None,
    seq_length=16,
    vocab_size=64,
    init_method_std=0.02,
    use_te=False,
)


def test_package_imports_without_megatron_core_and_answers_available():
    assert isinstance(megatron.available(), bool)
    assert megatron.version() is None or megatron.version().startswith("0.")


@pytest.mark.skipif(megatron.available(), reason="megatron-core is installed: the missing-extra error cannot show")
def test_megatron_model_without_megatron_core_names_the_extra():
    with pytest.raises(megatron.MissingExtraError) as e:
        megatron.build_gpt(SHAPE, device="cpu")
    # a broken install (megatron-core 0.19 without triton, say) appends the import error after the hint
    assert str(e.value).startswith("model.implementation='megatron' needs megatron-core: pip install -e '.[megatron]'")


@pytest.mark.skipif(megatron.available(), reason="megatron-core is installed: the missing-extra error cannot show")
def test_megatron_optimizer_without_megatron_core_names_the_extra():
    cfg = SimpleNamespace(optimizer="adam", optimizer_cpu_offload=True)
    with pytest.raises(
        megatron.MissingExtraError,
        match=r"optimizer.implementation='megatron' needs megatron-core: "
        r"pip install -e '\.\[megatron\]'",
    ):
        megatron.build_megatron_optimizer([], cfg)


def test_plain_modules_are_not_megatron_models():
    import torch

    m = torch.nn.Linear(2, 2)
    assert not megatron.is_gpt_model(m)
    assert megatron.as_engine_module(m) is m


def test_a_plain_model_never_imports_megatron_core():
    """initialize() asks extras.is_megatron_gpt of every user model: for any other model it must not pay for
    importing megatron-core (seconds) nor fail where megatron-core is installed but broken."""
    import subprocess
    import sys

    script = ("import sys, torch, engine; from engine import extras; "
              "assert not extras.is_megatron_gpt(torch.nn.Linear(2, 2)); "
              "engine.initialize(model=torch.nn.Linear(2, 2), config={'train': {'device': 'cpu'}}, "
              "loss_fn=torch.nn.functional.mse_loss); "
              "assert 'megatron.core' not in sys.modules, 'imported'")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.skipif(megatron.te_available(), reason="Transformer Engine is installed: the error cannot show")
def test_te_layers_without_transformer_engine_name_the_te_extra():
    with pytest.raises(megatron.MissingExtraError) as e:
        build_te_layers(num_layers=2, hidden_size=32, num_attention_heads=4)
    assert str(e.value).startswith("model.use_te=true needs Transformer Engine: pip install -e '.[te]'")


@pytest.mark.skipif(
    megatron.te_available() or not megatron.available(), reason="Requires: megatron-core without Transformer Engine"
)
def test_megatron_te_spec_without_transformer_engine_names_the_te_extra():
    import torch

    from engine.megatron.gpt import layer_spec

    with pytest.raises(megatron.MissingExtraError, match=r"model.use_te=true needs Transformer Engine"):
        layer_spec(True, "auto", torch.device("cuda"))
