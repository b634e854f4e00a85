"""Checkpoints: a resumed run repeats the uninterrupted run's losses; a killed save loses nothing."""

import hashlib
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from engine import checkpoint


@pytest.fixture
def run(make_engine):
    """`run(iters, overrides=(), load=None, save=None)`: the tiny config, `iters` iterations; (engine, losses)."""

    def run(iters, overrides=(), load=None, save=None):
        eng, _, _ = make_engine(overrides)
        if load:
            eng.load_checkpoint(load)
        losses = [eng.train_batch() for _ in range(iters)]
        if save:
            eng.save_checkpoint(save)
        return eng, losses

    return run


def test_resume_reproduces_uninterrupted_losses(tmp_path, run):
    _, straight = run(6)
    _, first = run(3, save=tmp_path)
    eng, second = run(3, load=tmp_path)
    assert first + second == straight
    assert eng.iteration == 6


def test_resume_in_bf16_autocast_and_fp16(tmp_path, run):
    for precision in ("bf16", "fp16"):
        o = [f"train.precision={precision}"]
        _, straight = run(4, o)
        _, first = run(2, o, save=tmp_path / precision)
        _, second = run(2, o, load=tmp_path / precision)
        assert first + second == straight, precision


def test_layout_and_latest_pointer(tmp_path, run):
    eng, _ = run(1, save=tmp_path)
    assert sorted(p.name for p in (tmp_path / "iter_0000001").iterdir()) == ["manifest.json", "state.pt"]
    assert (tmp_path / checkpoint.LATEST).read_text() == "1"  # Megatron's tracker: the bare integer
    eng.save_checkpoint(str(tmp_path))  # same iteration again: replaced, never left dangling
    assert checkpoint.load(tmp_path)["iteration"] == 1
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("iter_")]) == 1


def test_missing_checkpoint_is_a_clear_error(tmp_path, make_engine):
    eng, _, _ = make_engine()
    with pytest.raises(FileNotFoundError, match=r"checkpoint.load=.*nowhere.*does not exist"):
        eng.load_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"holds no latest_checkpointed_iteration.txt"):
        eng.load_checkpoint(str(tmp_path))


def test_save_killed_midway_leaves_previous_checkpoint_loadable(tmp_path, run, tiny_config):
    _, _ = run(2, save=tmp_path)
    good = checkpoint.load(tmp_path)
    # a second process trains on and is SIGKILLed while torch.save is writing its checkpoint
    script = textwrap.dedent(f"""
        import json, os, signal, torch, engine
        eng, _, _ = engine.initialize(config=json.loads({json.dumps(tiny_config)!r}))
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


# --- integrity: every byte of every file is verified ------------------------------------------------------


def flip(path, offset, mask):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def test_every_flipped_byte_in_every_file_is_refused(tmp_path, run):
    eng, _ = run(1, save=tmp_path)
    folder = tmp_path / "iter_0000001"
    rng = random.Random(0)
    files = sorted(folder.iterdir())
    assert [f.name for f in files] == ["manifest.json", "state.pt"]
    for f in files:
        size = f.stat().st_size
        offsets = {0, size - 1} | {rng.randrange(size) for _ in range(40)}
        for offset in sorted(offsets):
            mask = rng.randrange(1, 256)
            flip(f, offset, mask)
            with pytest.raises(checkpoint.CheckpointError) as caught:
                eng.load_checkpoint(str(tmp_path))
            message = str(caught.value)
            assert f.name in message and "(iteration 1)" in message and "refusing to load it" in message, (
                f.name, offset, message)  # fmt: skip
            assert "\n" not in message
            flip(f, offset, mask)  # restore: the next flip is tested alone
    eng.load_checkpoint(str(tmp_path))  # restored bytes load again


def test_corrupted_checkpoint_names_the_newest_intact_one(tmp_path, run):
    eng, _ = run(1, save=tmp_path)
    eng.train_batch()
    eng.save_checkpoint(str(tmp_path))
    state = tmp_path / "iter_0000002" / "state.pt"
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError) as caught:
        eng.load_checkpoint(str(tmp_path))
    message = str(caught.value)
    assert f"{state} (iteration 2) is truncated ({len(data) // 2} of {len(data)} bytes)" in message
    older = str(tmp_path / "iter_0000001")
    assert f"the newest intact checkpoint there is iteration 1: set checkpoint.load={older!r}" in message
    eng.load_checkpoint(older)  # the advice works: an iter_* folder loads as itself
    assert eng.iteration == 1
    state.write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match=r"is truncated \(0 of"):
        eng.load_checkpoint(str(tmp_path))


def test_unreadable_but_sealed_file_keeps_the_useful_part(tmp_path, run):
    """A state.pt whose manifest matches but torch cannot read: one line, no advice to unpickle code."""
    run(1, save=tmp_path)
    folder = tmp_path / "iter_0000001"
    payload = bytes(random.Random(1).randrange(256) for _ in range(4096))
    (folder / "state.pt").write_bytes(payload)
    sha = hashlib.sha256(payload).hexdigest()
    (folder / "manifest.json").write_text(checkpoint._manifest_text(1, {"state.pt": {"bytes": 4096, "sha256": sha}}))
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.load(tmp_path)
    assert "state.pt (iteration 1): cannot load it" in str(caught.value)
    assert "weights_only" not in str(caught.value) and "\n" not in str(caught.value)


def test_shape_mismatch_names_keys_and_shapes(tmp_path, run, make_engine):
    run(1, save=tmp_path)
    eng, _, _ = make_engine(["model.hidden_size=64"])
    with pytest.raises(checkpoint.CheckpointError) as caught:
        eng.load_checkpoint(str(tmp_path))
    message = str(caught.value)
    assert "(iteration 1) does not fit this model" in message
    assert re.search(r"shapes differ: \S+ \(checkpoint \[\d+(, 32)?\], model \[\d+(, 64)?\]\)", message), message
    eng, _, _ = make_engine(["model.num_layers=1"])
    with pytest.raises(checkpoint.CheckpointError, match=r"not in the model: layers\.1\."):
        eng.load_checkpoint(str(tmp_path))


# --- Megatron's tracker ------------------------------------------------------------------------------------


def test_tracker_written_either_way_loads(tmp_path, run):
    run(2, save=tmp_path)
    tracker = tmp_path / checkpoint.LATEST
    for text in ("2", "2\n", "iter_0000002", "iter_0000002\n"):  # Megatron's integer; this engine's older name
        tracker.write_text(text)
        assert checkpoint.load(tmp_path)["iteration"] == 2, text
    (tmp_path / "iter_0000002").rename(tmp_path / "release")
    tracker.write_text("release")
    assert checkpoint.load(tmp_path)["iteration"] == 2
    tracker.write_text("latest please")
    with pytest.raises(checkpoint.CheckpointError, match=r"holds 'latest please'; expected an iteration number or "
                                                           r"'release'"):  # fmt: skip
        checkpoint.load(tmp_path)
    tracker.write_text("7")
    with pytest.raises(checkpoint.CheckpointError, match=r"names iter_0000007, but .* is missing"):
        checkpoint.load(tmp_path)


def test_keep_last_keeps_the_newest(tmp_path, run):
    eng, _ = run(1, ["checkpoint.save=x", "checkpoint.keep_last=2"])
    for _ in range(4):
        eng.save_checkpoint(str(tmp_path))
        eng.train_batch()
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert checkpoint.load(tmp_path)["iteration"] == 4


def test_failed_write_removes_the_partial_folder_and_says_why(tmp_path, run):
    """A real I/O error from the OS (RLIMIT_FSIZE: writes past the limit fail with EFBIG, as ENOSPC would)."""
    eng, _ = run(1, save=tmp_path)
    eng.train_batch()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of failing the write
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))
    try:
        with pytest.raises(checkpoint.CheckpointError) as caught:
            eng.save_checkpoint(str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message = str(caught.value)
    assert f"checkpoint.save={str(tmp_path)!r}: writing " in message
    assert "state.pt failed with errno 27 (EFBIG" in message
    assert re.search(r"needs about \d+\.\d\d KiB, .* free there; the previous checkpoint is intact", message)
    assert {p.name for p in tmp_path.iterdir()} == {".lock", checkpoint.LATEST, "iter_0000001"}  # no partial folder
    assert checkpoint.load(tmp_path)["iteration"] == 1
    eng.save_checkpoint(str(tmp_path))  # and the next save succeeds
    assert checkpoint.load(tmp_path)["iteration"] == 2
