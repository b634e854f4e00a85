"""Checkpoints: a resumed run repeats the uninterrupted run's losses; a killed save loses nothing."""

import os
import subprocess
import sys
import textwrap

import torch

import engine
from engine import checkpoint
from tests.test_engine import TINY


def run(iters, overrides=(), load=None, save=None):
    eng, _, _ = engine.initialize(config=TINY, overrides=list(overrides))
    if load:
        eng.load_checkpoint(load)
    losses = [eng.train_batch() for _ in range(iters)]
    if save:
        eng.save_checkpoint(save)
    return eng, losses


def test_resume_reproduces_uninterrupted_losses(tmp_path):
    _, straight = run(6)
    _, first = run(3, save=tmp_path)
    eng, second = run(3, load=tmp_path)
    assert first + second == straight
    assert eng.iteration == 6


def test_resume_in_bf16_autocast_and_fp16(tmp_path):
    for precision in ("bf16", "fp16"):
        o = [f"train.precision={precision}"]
        _, straight = run(4, o)
        _, first = run(2, o, save=tmp_path / precision)
        _, second = run(2, o, load=tmp_path / precision)
        assert first + second == straight, precision


def test_layout_and_latest_pointer(tmp_path):
    eng, _ = run(1, save=tmp_path)
    assert (tmp_path / "iter_0000001" / "state.pt").is_file()
    assert (tmp_path / checkpoint.LATEST).read_text().strip() == "iter_0000001"
    eng.save_checkpoint(str(tmp_path))  # same iteration again: replaced, never left dangling
    assert checkpoint.load(tmp_path)["iteration"] == 1
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("iter_")]) == 1


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    eng, _, _ = engine.initialize(config=TINY)
    try:
        eng.load_checkpoint(str(tmp_path / "nowhere"))
    except FileNotFoundError as e:
        assert "checkpoint.load" in str(e) and "latest_checkpointed_iteration.txt" in str(e)
    else:
        raise AssertionError("expected FileNotFoundError")


def test_save_killed_midway_leaves_previous_checkpoint_loadable(tmp_path):
    _, _ = run(2, save=tmp_path)
    good = checkpoint.load(tmp_path)
    # a second process trains on and is SIGKILLed while torch.save is writing its checkpoint
    script = textwrap.dedent(f"""
        import os, signal, torch, engine
        from tests.test_engine import TINY
        eng, _, _ = engine.initialize(config=TINY)
        eng.load_checkpoint({str(tmp_path)!r})
        eng.train_batch()
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = dying_save
        eng.save_checkpoint({str(tmp_path)!r})
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert any(p.name.startswith(".tmp-iter_0000003") for p in tmp_path.iterdir())  # the save really began
    after = checkpoint.load(tmp_path)
    assert after["iteration"] == good["iteration"] == 2
    for k in good["model"]:
        assert torch.equal(after["model"][k], good["model"][k])
    _, more = run(1, load=tmp_path)  # and training continues from it
    assert len(more) == 1
