"""Shared fixtures: the tiny engine config most engine tests start from, and bin/train as a user runs it.

Test modules take these as fixtures and never import from one another; plain helpers that are not
fixtures live in modules not named test_* (tests/optim_reference.py).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

import engine
from engine.config.rules import BUILTIN_ONLY_KEYS

ROOT = Path(__file__).resolve().parent.parent

_TINY = {
    "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 16, "vocab_size": 256},
    "optimizer": {"lr": 1e-3, "clip_grad": 1.0, "weight_decay": 0.1, "lr_warmup_iters": 2, "lr_decay_style": "linear"},
    "train": {"train_iters": 6, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32", "device": "cpu"},
    "data": {"max_bytes": 65536},
    "logging": {"metrics_file": None, "progress_bar": False},
}


@pytest.fixture(scope="session")
def tiny_config() -> dict:
    """A 2-layer, 32-wide GPT on CPU, 6 iterations of 2 micro-batches of 2. Shared by every test: change it
    with overrides (`make_engine([...])`), never in place."""
    return _TINY


@pytest.fixture(scope="session")
def make_engine(tiny_config) -> Callable[..., tuple]:
    """`make_engine(overrides=(), **kw)`: engine.initialize on the tiny config with dotted overrides (the built-in
    GPT's shape keys left out when a model is passed; seq_length and vocab_size stay, for the built-in data)."""

    def make(overrides: Sequence[str] = (), **kw) -> tuple:
        config = copy.deepcopy(tiny_config)
        if kw.get("model") is not None:  # a model of one's own brings its shape: the built-in GPT's keys are refused
            config["model"] = {k: v for k, v in config["model"].items() if k not in BUILTIN_ONLY_KEYS}
        return engine.initialize(config=config, overrides=list(overrides), **kw)

    return make


@pytest.fixture(scope="session")
def bin_train() -> Callable[..., subprocess.CompletedProcess]:
    """`bin_train(*args, cwd=None)`: bin/train in a subprocess, its output captured."""

    def run(*args: str, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(ROOT / "bin" / "train"), *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    return run


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine spinning OpenMP threads cost 10x: a module
    that trains them asks for this (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
