"""bin/train's promises, run in-process through `engine.cli.train_main` (exit code, one-line message, files):
what `checkpoint.load` accepts, and the checkpoint keys' rules."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import checkpoint
from engine.cli import train_main
from engine.engine import Engine
from engine.models.gpt import GPT, gpt_loss
from engine.skips import TrainingDiverged

ROOT = Path(__file__).resolve().parent.parent
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


# --- non-finite steps -------------------------------------------------------------------------------------

HYBRID = ["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true",
          "optimizer.optimizer_offload_fraction=0.5"]  # fmt: skip


@pytest.mark.parametrize("precision, extra", [("fp32", []), ("bf16", []), ("fp16", []), ("fp32", HYBRID)])
def test_divergence_skips_then_stops_naming_iteration_and_cause(make_engine, precision, extra):
    eng, _, _ = make_engine([f"train.precision={precision}", "optimizer.lr=1e10", "train.max_skipped_steps=3", *extra])
    losses = [eng.train_batch()]  # a finite first step with an absurd learning rate
    assert math.isfinite(losses[0])
    weights = {k: v.clone() for k, v in eng.module.state_dict().items()}
    losses += [eng.train_batch(), eng.train_batch()]
    assert all(math.isnan(x) for x in losses[1:]) and eng.skips.total == 2 and eng.last_step_skipped
    for k, v in eng.module.state_dict().items():  # skipped steps left the weights of the good step alone
        assert torch.equal(v, weights[k]), k
    with pytest.raises(TrainingDiverged) as caught:
        eng.train_batch()
    assert str(caught.value) == (
        "train.max_skipped_steps=3: stopping at iteration 4 after 3 consecutive skipped steps (loss nan, gradient "
        "norm nan); likely cause: training diverged after 1 good step: the learning rate is too high "
        "(optimizer.lr=1e+10); lower it, or raise optimizer.lr_warmup_iters (2)"
    )
    assert all(torch.equal(v, weights[k]) for k, v in eng.module.state_dict().items())


def test_non_finite_from_the_start_names_the_init(make_engine):
    eng, _, _ = make_engine(["model.init_method_std=1e30", "train.max_skipped_steps=2"])
    eng.train_batch()
    with pytest.raises(TrainingDiverged, match=r"stopping at iteration 2 after 2 consecutive skipped steps .*likely "
                       r"cause: the model is non-finite from this run's first step: check model.init_method_std "
                       r"\(1e\+30\)"):  # fmt: skip
        eng.train_batch()


@pytest.mark.parametrize("optimizer", ["engine", "torch", "hybrid"])
def test_non_finite_loss_alone_skips_the_step(make_engine, optimizer):
    """A loss that is NaN while every gradient is finite (a NaN constant in the loss) must not step."""
    kw = {"loss_fn": lambda out, y: gpt_loss(out, y) + math.nan}
    model = GPT(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=256)
    if optimizer == "torch":
        kw.update(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    eng, opt, sched = make_engine(HYBRID if optimizer == "hybrid" else [], **kw)
    before = {k: v.clone() for k, v in eng.module.state_dict().items()}
    assert math.isnan(eng.train_batch())
    assert eng.last_step_skipped and eng.skips.total == 1 and eng.iteration == 1  # spent, as Megatron counts it
    eng.synchronize()
    assert all(torch.equal(v, before[k]) for k, v in eng.module.state_dict().items())
    assert sched.last_epoch == 0  # no schedule step either
    if optimizer == "torch":
        assert opt.state_dict()["state"] == {}  # no moments


def test_bin_train_diverging_exits_1_with_strict_json_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    code, out, err = bin_train(capsys, "optimizer.lr=1e10", "train.max_skipped_steps=3", "train.train_iters=20",
                               f"logging.metrics_file={metrics}")  # fmt: skip
    assert code == 1
    assert err.strip().splitlines() == [
        "error: train.max_skipped_steps=3: stopping at iteration 4 after 3 consecutive skipped steps (loss nan, "
        "gradient norm nan); likely cause: training diverged after 1 good step: the learning rate is too high "
        "(optimizer.lr=1e+10); lower it, or raise optimizer.lr_warmup_iters (0)"]

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    rows = [json.loads(line, parse_constant=refuse) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "iteration" in r]
    assert [(r["iteration"], r["skipped"], r["skipped_steps"]) for r in steps] == [(1, False, 0), (2, True, 1),
                                                                                  (3, True, 2)]  # fmt: skip
    assert steps[1]["loss"] is None and steps[1]["grad_norm"] is None and math.isfinite(steps[0]["loss"])
    # without a limit the run goes on; the progress bar and the summary count the skipped steps
    code, out, err = bin_train(capsys, "optimizer.lr=1e10", "train.max_skipped_steps=null", "train.train_iters=4",
                               "logging.metrics_file=null", "logging.progress_bar=true")  # fmt: skip
    assert code == 0, err
    assert "skipped=3" in err  # tqdm's postfix
    assert "loss 5.5" in out and "-> non-finite, 3 steps skipped (non-finite loss or gradient norm)" in out


# --- signals and locks ------------------------------------------------------------------------------------


def steps_of(path):
    return [r for r in map(json.loads, path.read_text().splitlines()) if "iteration" in r]


def test_sigterm_saves_and_resumes_to_the_uninterrupted_losses(tmp_path, capsys):
    """bin/train in a subprocess gets SIGTERM mid-run: it finishes the step, saves, says so, exits 143; while it
    runs, a second run on its checkpoint folder or metrics file fails at once naming its PID; the resumed
    run's losses are the uninterrupted run's."""
    ck, m1 = tmp_path / "ck", tmp_path / "m1.jsonl"
    schedule = "optimizer.lr_decay_iters=500"  # the schedule of the 500-iteration run, whatever train_iters says
    proc = subprocess.Popen([sys.executable, str(ROOT / "bin" / "train"), *TINY, "train.train_iters=500", schedule,
                             f"checkpoint.save={ck}", f"logging.metrics_file={m1}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (m1.exists() and len(m1.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        code, _, err = bin_train(capsys, "train.train_iters=2", f"checkpoint.save={ck}", "logging.metrics_file=null")
        assert code == 1 and err.strip().splitlines() == [
            f"error: checkpoint.save={str(ck)!r} is in use by another run (PID {proc.pid}); wait for it to finish, "
            "or set a different checkpoint.save"]  # fmt: skip
        code, _, err = bin_train(capsys, "train.train_iters=2", f"logging.metrics_file={m1}")
        assert code == 1 and f"logging.metrics_file={str(m1)!r} is in use by another run (PID {proc.pid})" in err
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    stopped = steps_of(m1)[-1]["iteration"]
    assert stopped < 500 and checkpoint.load(ck)["iteration"] == stopped
    assert err.strip().splitlines()[-1] == (
        f"stopped by SIGTERM after iteration {stopped}: checkpoint saved in {ck / f'iter_{stopped:07d}'}; resume "
        f"with checkpoint.load={ck}")  # fmt: skip
    assert "Traceback" not in err
    total, m0, m2 = stopped + 2, tmp_path / "m0.jsonl", tmp_path / "m2.jsonl"
    assert bin_train(capsys, f"train.train_iters={total}", schedule, f"logging.metrics_file={m0}")[0] == 0
    assert bin_train(capsys, f"train.train_iters={total}", schedule, f"logging.metrics_file={m2}",
                     f"checkpoint.load={ck}")[0] == 0  # fmt: skip
    straight = [r["loss"] for r in steps_of(m0)]
    assert [r["loss"] for r in steps_of(m1)] + [r["loss"] for r in steps_of(m2)] == straight
    assert len(straight) == total


def test_sigint_finishes_the_step_saves_and_exits_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C (SIGINT, delivered in-process during iteration 3) stops after that step with a checkpoint."""
    real = Engine.train_batch

    def interrupted(self, *a, **k):
        if self.iteration == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while iteration 3 is in progress
        return real(self, *a, **k)

    monkeypatch.setattr(Engine, "train_batch", interrupted)
    code, out, err = bin_train(capsys, "train.train_iters=10", f"checkpoint.save={tmp_path}", "logging.metrics_file=null")
    assert code == 130
    assert err.strip().splitlines() == [
        f"stopped by SIGINT after iteration 3: checkpoint saved in {tmp_path / 'iter_0000003'}; resume with "
        f"checkpoint.load={tmp_path}"]  # fmt: skip
    assert "iterations 1..3" in out  # the summary of what ran
    assert checkpoint.load(tmp_path)["iteration"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    code, _, err = bin_train(capsys, "train.train_iters=10", "logging.metrics_file=null")
    assert code == 130 and err.strip().endswith("nothing saved (checkpoint.save is not set)")


def test_a_second_signal_exits_at_once(tmp_path):
    script = ("import time, engine.signals as s\nwith s.GracefulStop():\n    print('ready', flush=True)\n"
              "    time.sleep(60)\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # the first one only asks the loop to stop
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.strip() == "SIGTERM again: exiting now, without saving"
