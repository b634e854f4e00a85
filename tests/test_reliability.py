"""bin/train's promises, run in-process through `engine.cli.train_main` (exit code, one-line message, files):
what `checkpoint.load` accepts, and the checkpoint keys' rules."""

from __future__ import annotations

from engine import checkpoint
from engine.cli import train_main

TINY = ["train.device=cpu", "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
        "model.seq_length=32", "data.max_bytes=65536", "train.global_batch_size=2", "train.micro_batch_size=2",
        "optimizer.lr_warmup_iters=0", "logging.progress_bar=false", "train.precision=fp32"]  # fmt: skip


def bin_train(capsys, *args: str) -> tuple[int, str, str]:
    code = train_main([*TINY, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_checkpoint_load_without_a_checkpoint_is_an_error(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "typo", "does not exist"), (tmp_path / "a_file", "is a file, not a checkpoint folder"),
             (tmp_path / "empty", "holds no latest_checkpointed_iteration.txt")]  # fmt: skip
    for where, why in cases:
        code, _, err = bin_train(capsys, "train.train_iters=1", "logging.metrics_file=null", f"checkpoint.load={where}")
        assert code == 2, err
        assert err.strip().splitlines() == [
            f"error: checkpoint.load={str(where)!r}: {why}; point it at a folder that checkpoint.save wrote (or one "
            "of its iter_* folders), or set checkpoint.load_if_exists=true to start fresh when there is none"]
    code, out, err = bin_train(capsys, "train.train_iters=1", "logging.metrics_file=null",
                               f"checkpoint.load={tmp_path / 'ck'}", f"checkpoint.save={tmp_path / 'ck'}",
                               "checkpoint.load_if_exists=true")  # fmt: skip
    assert code == 0, err
    assert "holds no checkpoint yet: starting from iteration 0 (checkpoint.load_if_exists=true)" in out
    assert checkpoint.load(tmp_path / "ck")["iteration"] == 1
    code, out, err = bin_train(capsys, "train.train_iters=2", "logging.metrics_file=null",
                               f"checkpoint.load={tmp_path / 'ck' / 'iter_0000001'}")  # fmt: skip
    assert code == 0 and "at iteration 1" in out, err


def test_corrupted_checkpoint_exits_1_with_one_line(tmp_path, capsys):
    code, _, err = bin_train(capsys, "train.train_iters=1", "logging.metrics_file=null", f"checkpoint.save={tmp_path}")
    assert code == 0, err
    state = tmp_path / "iter_0000001" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 3] ^= 0x10
    state.write_bytes(data)
    code, _, err = bin_train(capsys, "train.train_iters=2", "logging.metrics_file=null", f"checkpoint.load={tmp_path}")
    assert code == 1
    assert err.strip().splitlines() == [
        f"error: checkpoint {state} (iteration 1) has changed since it was saved (its sha256 differs from the "
        f"manifest); refusing to load it; no intact older checkpoint in {tmp_path}"]
