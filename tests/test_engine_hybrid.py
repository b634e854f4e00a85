"""The hybrid device optimizer through the engine's config: bin/train's default job at f=0.5 against the
non-offloaded run, determinism with overlap on, half weights with fp32 masters, checkpoints across fractions."""

import json

import pytest
import torch

OFFLOAD = ["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true"]


@pytest.mark.slow  # ~100 s alone on 2 cores, 300 s on busy ones: .ci/run runs it after the suite
def test_bin_train_default_100_iterations_offloaded_within_0_001_of_plain(tmp_path, bin_train):
    losses = {}
    for name, extra in {
        "plain": [],
        "f0.5": [*OFFLOAD, "optimizer.optimizer_offload_fraction=0.5", "optimizer.overlap_cpu_optimizer_d2h_h2d=true"],
    }.items():
        metrics = tmp_path / f"{name}.jsonl"
        proc = bin_train(
            "train.train_iters=100", f"logging.metrics_file={metrics}", "logging.progress_bar=false", *extra
        )
        assert proc.returncode == 0, proc.stderr
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()[1:]]  # after the header
    assert len(losses["plain"]) == len(losses["f0.5"]) == 100
    worst = max(abs(a - b) for a, b in zip(losses["plain"], losses["f0.5"], strict=True))
    assert worst < 1e-3, worst
    assert losses["plain"][-1] < 0.7 * losses["plain"][0]


def test_offloaded_run_follows_the_plain_run(make_engine):
    """The fast twin of the slow test above: the tiny config at f=0.5 with overlap, every loss and every
    final weight against the non-offloaded run's (clipping, warmup and decay all active)."""
    plain, _, _ = make_engine()
    off, _, _ = make_engine(
        [*OFFLOAD, "optimizer.optimizer_offload_fraction=0.5", "optimizer.overlap_cpu_optimizer_d2h_h2d=true"]
    )
    a = [plain.train_batch() for _ in range(6)]
    b = [off.train_batch() for _ in range(6)]
    off.synchronize()
    assert b == pytest.approx(a, rel=0, abs=1e-6)
    for (name, p), q in zip(plain.module.named_parameters(), off.module.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=name)


@pytest.fixture
def run(make_engine):
    """`run(overrides, steps=4)`: the tiny config trained for `steps` iterations, synchronized; (engine, losses)."""

    def run(overrides, steps=4):
        eng, _, _ = make_engine(overrides)
        losses = [eng.train_batch() for _ in range(steps)]
        eng.synchronize()
        return eng, losses

    return run


@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_overlapped_runs_are_deterministic(fraction, run):
    o = [*OFFLOAD, f"optimizer.optimizer_offload_fraction={fraction}", "optimizer.overlap_cpu_optimizer_d2h_h2d=true"]
    a, la = run(o)
    b, lb = run(o)
    assert la == lb
    for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(p, q)


def test_half_weights_with_fp32_masters(run):
    eng, losses = run(
        [
            "train.precision=bf16",
            "train.params_dtype=half",
            *OFFLOAD,
            "optimizer.optimizer_offload_fraction=0.5",
            "optimizer.lr=3e-3",
        ],
        steps=8,
    )
    assert eng.module.layers[0].mlp.fc1.weight.dtype == torch.bfloat16
    masters = eng.optimizer.state_dict()
    assert masters  # fp32 masters by name live in the optimizer
    assert losses[-1] < losses[0]


def test_checkpoint_saved_at_one_fraction_resumes_at_another(tmp_path, run, make_engine):
    at = lambda f: [*OFFLOAD, f"optimizer.optimizer_offload_fraction={f}"]  # noqa: E731
    _, straight = run(at(0.25), steps=4)
    first_eng, first = run(at(0.25), steps=2)
    first_eng.save_checkpoint(str(tmp_path))
    eng, _, _ = make_engine(at(0.75))
    eng.load_checkpoint(str(tmp_path))
    second = [eng.train_batch() for _ in range(2)]
    assert first + second == pytest.approx(straight, rel=1e-6)


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_a_dropped_engine_frees_its_model_and_optimizer_states(make_engine, fraction):
    """Several engines in one process (a bench's rows, a sweep, tests): dropping one without close() frees its
    weights and optimizer states. The gradient hooks on the parameters once held the optimizer, a cycle through
    autograd that the garbage collector cannot see, so every earlier row's GPU memory counted in the next row's
    peak (the FP8 bench read ~2x bf16's peak that way)."""
    import gc
    import weakref

    overrides = [*OFFLOAD, f"optimizer.optimizer_offload_fraction={fraction}",
                 "optimizer.overlap_cpu_optimizer_d2h_h2d=true"] if fraction else []  # fmt: skip
    eng, optimizer, schedule = make_engine(overrides)
    for _ in range(2):
        eng.train_batch()
    eng.synchronize()
    held = [weakref.ref(p) for p in eng.module.parameters()]
    states = [weakref.ref(t) for t in _tensors_held(eng.optimizer) if not isinstance(t, torch.nn.Parameter)]
    assert held and len(states) >= 2 * len(held)  # masters and moments at least
    del eng, optimizer, schedule
    gc.collect()
    assert [r for r in held if r() is not None] == []
    assert [r for r in states if r() is not None] == []


def _tensors_held(obj, depth: int = 6, seen: set | None = None) -> list[torch.Tensor]:
    """The tensors reachable from obj through attributes, dicts, lists and tuples (the live optimizer states)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("engine", "torch.optim")):
        items = list(vars(obj).values())
    else:
        return []
    return [t for x in items for t in _tensors_held(x, depth - 1, seen)]
