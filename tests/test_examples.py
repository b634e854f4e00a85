"""The examples run: each on a tiny shape on the CPU, as a user would start them (their main with arguments)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_hf_causal_lm_offloads_and_saves_a_loadable_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    result = load("hf_causal_lm").main(["--preset", "tiny", "--device", "cpu", "--steps", "3", "--seq", "128",
                                        "--activation-layers", "2", "--optimizer-fraction", "0.5",
                                        "--save", str(tmp_path)])  # fmt: skip
    assert result["last_loss"] < result["first_loss"]
    assert result["predicted_s_per_iter"] > 0  # the plan's step-time model, beside the measured s/iter
    act, opt = result["offload"]
    assert act.startswith("activation offload model.layers: 2 of 3 layers wrapped: ") and "per step" in act
    assert opt.startswith("optimizer offload: ")
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.config.num_hidden_layers == 3


def test_hf_causal_lm_reads_a_local_directory(tmp_path):
    pytest.importorskip("transformers")
    from engine.bench.hf_models import hf_config

    example = load("hf_causal_lm")
    hf_config(example.PRESETS["tiny"]).save_pretrained(tmp_path)  # a config, no weights
    result = example.main(["--model", str(tmp_path), "--device", "cpu", "--steps", "2", "--seq", "32"])
    assert result["model"] == str(tmp_path) and result["offload"] == []


def test_custom_model_trains_with_both_offloads(tmp_path):
    losses = load("custom_model").main(["--device", "cpu", "--steps", "6", "--save", str(tmp_path)])
    assert losses[-1] < losses[0]
    assert any(tmp_path.iterdir())


def test_hf_causal_lm_auto_plans_at_its_first_batch():
    pytest.importorskip("transformers")
    result = load("hf_causal_lm").main(["--preset", "tiny", "--device", "cpu", "--steps", "2", "--seq", "64",
                                        "--optimizer-fraction", "auto", "--activation-layers", "auto",
                                        "--params-dtype", "half"])  # fmt: skip
    assert set(result["auto"]) == {"optimizer.optimizer_offload_fraction", "model.cpu_offloading_num_layers"}
    assert result["plan_fits"] and result["tflops"] > 0
