"""bin/train's promises, run in-process through `engine.cli.train_main` (exit code, one-line message, files):
what `checkpoint.load` accepts, and the checkpoint keys' rules."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import checkpoint, locks, plot
from engine.cli import train_main
from engine.engine import Engine
from engine.metrics import format_bytes, read_runs
from engine.models.gpt import GPT, gpt_loss
from engine.skips import TrainingDiverged

ROOT = Path(__file__).resolve().parent.parent
TINY = ["train.device=cpu", "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
        "model.seq_length=32", "data.max_bytes=65536", "train.global_batch_size=2", "train.micro_batch_size=2",
        "optimizer.lr_warmup_iters=0", "logging.progress_bar=false", "train.precision=fp32"]  # fmt: skip


def bin_train(capsys, *args: str) -> tuple[int, str, str]:
    """bin/train's exit code, stdout and stderr for TINY plus `args` (a config file first, as bin/train takes it)."""
    config = list(args[:1]) if args and "=" not in args[0] else []
    code = train_main([*config, *TINY, *args[len(config) :]])
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
            "of its iter_* folders), or set checkpoint.load_if_exists=true to start fresh when there is none"
        ]
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
        f"manifest); refusing to load it; no intact older checkpoint in {tmp_path}"
    ]


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
        "(optimizer.lr=1e+10); lower it, or raise optimizer.lr_warmup_iters (0)"
    ]

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    rows = [json.loads(line, parse_constant=refuse) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "iteration" in r]
    got = [(r["iteration"], r["skipped"], r["skipped_steps"]) for r in steps]
    assert got == [(1, False, 0), (2, True, 1), (3, True, 2), (4, True, 3)]  # the iteration that stopped it too
    assert steps[1]["loss"] is None and steps[1]["grad_norm"] is None and math.isfinite(steps[0]["loss"])
    # without a limit the run goes on; the progress bar and the summary count the skipped steps
    code, out, err = bin_train(capsys, "optimizer.lr=1e10", "train.max_skipped_steps=null", "train.train_iters=4",
                               "logging.metrics_file=null", "logging.progress_bar=true")  # fmt: skip
    assert code == 0, err
    assert "skipped=3" in err  # tqdm's postfix
    assert "loss 5.5" in out and "-> non-finite, 3 steps skipped (non-finite loss or gradient norm)" in out


def test_the_metrics_lr_is_the_lr_its_step_used(tmp_path, capsys):
    """Iteration k logs lr_at(k), the rate of its own step (warm-up 2 at 3e-4: 1.5e-4, 3e-4, then cosine)."""
    from engine.schedule import lr_at

    metrics = tmp_path / "m.jsonl"
    code, _, err = bin_train(capsys, "optimizer.lr=3e-4", "optimizer.min_lr=3e-5", "optimizer.lr_warmup_iters=2",
                             "optimizer.lr_decay_style=cosine", "train.train_iters=5",
                             f"logging.metrics_file={metrics}")  # fmt: skip
    assert code == 0, err
    logged = [r["lr"] for r in steps_of(metrics)]
    expected = [lr_at(k, lr=3e-4, min_lr=3e-5, warmup_iters=2, decay_iters=5, style="cosine") for k in range(1, 6)]
    assert logged == pytest.approx(expected, rel=1e-12) and logged[0] == pytest.approx(1.5e-4, rel=1e-12)


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
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # CPU losses depend on torch's thread count: the same as the in-process runs below
                            env=dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads())))  # fmt: skip
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
    code, out, err = bin_train(capsys, "train.train_iters=10", f"checkpoint.save={tmp_path}",
                               "logging.metrics_file=null")  # fmt: skip
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


def _started(script: str, marker: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    assert proc.stdout.readline() == marker + "\n", proc.stderr.read()
    return proc


def test_a_signal_during_initialize_stops_at_once_saving_nothing(tmp_path):
    """bin/train gets SIGTERM while initialize is still working (planning a deep model: minutes of Python): it
    stops there, saves nothing, exits 143 with one line. The stand-in initialize never finishes on its own."""
    args = [*TINY, "train.train_iters=5", f"checkpoint.save={tmp_path / 'ck'}", "logging.metrics_file=null"]
    script = (
        "import sys, time, engine.cli as cli\n"
        "def initialize(*a, **k):\n"
        "    print('initializing', flush=True)\n"
        "    while True:\n"
        "        sum(range(1000))\n"
        f"cli.initialize = initialize\nsys.exit(cli.train_main({args!r}))\n"
    )
    proc = _started(script, "initializing")
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["stopped by SIGTERM before the first iteration: nothing saved"]
    assert not list((tmp_path / "ck").glob("iter_*"))


def test_a_second_signal_exits_at_once_inside_a_long_torch_operation():
    """The first SIGTERM arrives while one torch call runs (hours of matrix products, holding the main thread
    in C++ where no Python handler can run); the second ends the process at once all the same."""
    script = ("import torch, engine.signals as s\ntorch.set_num_threads(1)\n"
              "a = torch.eye(1500, dtype=torch.float64)\n"
              "with s.GracefulStop():\n    print('ready', flush=True)\n"
              "    torch.linalg.matrix_power(a, 10**15)\n    print('finished', flush=True)\n")  # fmt: skip
    proc = _started(script, "ready")
    try:
        time.sleep(0.5)  # inside the call by now
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # the first one only asks the loop to stop
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.strip() == "SIGTERM again: exiting now, without saving"
    assert "finished" not in out


# --- data and config errors: one line naming the key, the file and the value --------------------------------


@pytest.mark.parametrize(
    "content, dtype, message",
    [
        (b"abc", "uint16", "{p}: 3 bytes is not a whole number of uint16 tokens (2 bytes each); set data.token_dtype "
                           "to the file's element type"),
        (b"", "uint16", "{p} is empty; give a file of uint16 token ids"),
        (np.array([1, 2, 300] * 50, np.uint16).tobytes(), "uint16",
         "{p}: token id 300 >= model.vocab_size=256; set model.vocab_size > 300 or check data.token_dtype ('uint16')"),
        (np.array([1, -5, 3] * 50, np.int32).tobytes(), "int32",
         "{p}: token id -5 is negative; check data.token_dtype ('int32')"),
    ],
)  # fmt: skip
def test_token_file_errors_name_key_file_and_value(tmp_path, capsys, content, dtype, message):
    path = tmp_path / "tokens.bin"
    path.write_bytes(content)
    code, _, err = bin_train(capsys, "train.train_iters=1", "logging.metrics_file=null", "data.source=tokens",
                             f"data.path={path}", f"data.token_dtype={dtype}", "data.max_bytes=16777216")  # fmt: skip
    assert code == 1
    assert err.strip().splitlines() == ["error: " + message.format(p=f"data.path={str(path)!r}")]


@pytest.mark.parametrize("source", ["text", "tokens"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory"])
def test_data_path_that_is_not_a_regular_file_says_what_it_is(tmp_path, capsys, source, kind):
    path = {"fifo": tmp_path / "pipe", "/dev/zero": Path("/dev/zero"), "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    code, _, err = bin_train(capsys, "train.train_iters=1", "logging.metrics_file=null", f"data.source={source}",
                             f"data.path={path}")  # fmt: skip
    what = {"fifo": "a FIFO (named pipe)", "/dev/zero": "a character device", "directory": "a directory"}[kind]
    assert code == 1 and err.strip().splitlines() == [
        f"error: data.path={str(path)!r} is {what}, not a regular file; give "
        + (
            "a UTF-8 text file for data.source='text'"
            if source == "text"
            else "a binary token file for data.source='tokens'"
        )  # fmt: skip
    ]


def test_data_path_without_a_file_source_is_rejected(capsys):
    code, _, err = bin_train(capsys, "data.path=corpus.txt")
    assert code == 2 and err.strip().splitlines() == [
        'error: data.path="corpus.txt": is read only by data.source "text" or "tokens"; set data.source to the kind '
        "of file it is, or unset data.path"]  # fmt: skip


def test_config_json_edge_cases_exit_2_with_a_short_line(tmp_path, capsys):
    cases = {
        '{"optimizer": {"lr": 0.1, "lr": 0.2}}': ["{f}: duplicate key optimizer.lr; JSON would keep only its last "
                                                  "value: remove the other"],
        '{"train": {}, "train": {}}': ["{f}: duplicate key train; JSON would keep only its last value: remove the "
                                       "other"],
        "[" * 100_000 + "]" * 100_000: ["{f}: nested too deeply to parse; a config nests at most 8 levels"],
        '{"model": {"offload_modules": [[[[[[[[["mlp"]]]]]]]]]}}': [
            "{f}: nested more than 8 levels deep (at model.offload_modules[0][0][0][0][0][0]); a config is "
            "sections of keys with plain values"],
        '{"data": {"path": "' + "x" * 13_000_000 + '"}}': [
            "{f}: 13,000,022 characters; a config is at most 1,048,576 (is this a config?)"],
        '{"data": {"path": "' + "x" * 5000 + '"}}': ["{f}: data.path is a string of 5,000 characters; at most 4096"],
    }  # fmt: skip
    for i, (text, lines) in enumerate(cases.items()):
        f = tmp_path / f"c{i}.json"
        f.write_text(text)
        code, _, err = bin_train(capsys, str(f))
        assert code == 2, err[:300]
        assert err.strip().splitlines() == ["error: " + line.format(f=f) for line in lines]


def test_override_edge_cases_exit_2_with_a_short_line(capsys):
    code, _, err = bin_train(capsys, "data.path=" + "y" * 5000)
    assert code == 2 and err.strip().splitlines() == [
        f"error: override 'data.path={'y' * 50}... (5,010 characters)': a value of 5,000 characters; at most 4,096"
    ]
    code, _, err = bin_train(capsys, "model.offload_modules=" + "[" * 2000 + "]" * 2000)
    assert code == 2 and "nested too deeply to parse" in err and len(err) < 300
    code, _, err = bin_train(capsys, "model.num_layers=" + json.dumps(list(range(500))))
    assert code == 2 and err.startswith("error: model.num_layers=[0, 1, 2, ") and "characters): expected integer" in err
    assert len(err) < 300  # the value is shown shortened, not whole


# --- metrics: run headers, activation offload peak, TensorBoard, bin/plot ----------------------------------


def test_each_run_appends_a_header_and_resumed_runs_say_from_where(tmp_path, capsys):
    m, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    assert bin_train(capsys, "train.train_iters=2", f"logging.metrics_file={m}", f"checkpoint.save={ck}")[0] == 0
    assert bin_train(capsys, "train.train_iters=3", f"logging.metrics_file={m}", f"checkpoint.load={ck}")[0] == 0
    runs = read_runs(m)
    assert [[r["iteration"] for r in run["records"]] for run in runs] == [[1, 2], [3]]
    first, second = (run["header"] for run in runs)
    assert first["resumed_from"] is None
    assert second["resumed_from"] == {"checkpoint": str(ck / "iter_0000002"), "iteration": 2}
    assert first["run_id"] != second["run_id"] and first["start_time"] <= second["start_time"]
    digest = hashlib.sha256(json.dumps(second["config"], sort_keys=True).encode()).hexdigest()
    assert second["config_sha256"] == digest != first["config_sha256"]  # train_iters and checkpoint.* differ
    assert second["config"]["train"]["train_iters"] == 3


def test_activation_offload_bytes_are_measured_at_their_peak(tmp_path, capsys):
    m = tmp_path / "m.jsonl"
    code, out, err = bin_train(capsys, "train.train_iters=2", f"logging.metrics_file={m}", "model.num_layers=2",
                               "model.hidden_size=64", "model.seq_length=64", "model.cpu_offloading=true",
                               "model.cpu_offloading_num_layers=1")  # fmt: skip
    assert code == 0, err
    recs = read_runs(m)[0]["records"]
    # the offloaded layer's MLP activation [2, 64, 256] fp32 at least (smaller tensors than 64 KiB stay), all held
    # at the end of forward; after backward, when the metrics are read, the host holds none
    assert all(r["activation_offload_bytes"] >= 2 * 64 * 256 * 4 for r in recs), recs
    assert all(r["host_offload_bytes"] >= r["activation_offload_bytes"] for r in recs)
    peak = format_bytes(recs[-1]["activation_offload_bytes"])
    assert f"(activations {peak} at the end of forward, not held on the device then)" in out


def test_tensorboard_gets_the_jsonl_scalars(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    code, _, err = bin_train(capsys, "train.train_iters=3", f"logging.metrics_file={m}",
                             f"logging.tensorboard_dir={tb}")  # fmt: skip
    assert code == 0, err
    events = EventAccumulator(str(tb))
    events.Reload()
    recs = read_runs(m)[0]["records"]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes", "skipped_steps"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["iteration"], pytest.approx(float(r[key]), rel=1e-6)) for r in recs], key


def test_tensorboard_dir_without_tensorboard_is_a_config_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now fails as if not installed
    code, _, err = bin_train(capsys, "logging.tensorboard_dir=tb")
    assert code == 2 and err.strip().splitlines() == [
        "error: logging.tensorboard_dir=\"tb\": needs the tensorboard package: pip install "
        "'offload-engine[tensorboard]', or unset it"]  # fmt: skip


def test_bin_plot_draws_runs_to_a_png(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ck = tmp_path / "ck"
    assert bin_train(capsys, "train.train_iters=2", f"logging.metrics_file={a}", f"checkpoint.save={ck}")[0] == 0
    assert bin_train(capsys, "train.train_iters=4", f"logging.metrics_file={a}", f"checkpoint.load={ck}")[0] == 0
    assert bin_train(capsys, "train.train_iters=3", f"logging.metrics_file={b}", "optimizer.lr=1e10",
                     "train.max_skipped_steps=null")[0] == 0  # fmt: skip
    assert bin_train(capsys, "train.train_iters=2", f"logging.metrics_file={b}")[0] == 0
    # a resumed run continues its line; a fresh run in the same file is a line of its own
    assert [(label, [r["iteration"] for r in recs]) for label, recs in plot.series(a)] == [("a", [1, 2, 3, 4])]
    assert [label for label, _ in plot.series(b)] == ["b (run 1)", "b (run 2)"]
    out = tmp_path / "fig" / "runs.png"
    assert plot.main([str(a), str(b), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert plot.main([str(tmp_path / "missing.jsonl")]) == 1
    assert "missing.jsonl" in capsys.readouterr().err


def test_bin_plot_leaves_out_a_cut_short_last_line_and_names_file_and_line_of_a_bad_one(tmp_path, capsys):
    m = tmp_path / "m.jsonl"
    assert bin_train(capsys, "train.train_iters=3", f"logging.metrics_file={m}")[0] == 0
    whole = m.read_text()
    m.write_text(whole[: len(whole) - 40])  # a crash or a full disk cut the last record short
    out = tmp_path / "m.png"
    assert plot.main([str(m), "-o", str(out)]) == 0 and out.is_file()
    assert [r["iteration"] for r in read_runs(m)[0]["records"]] == [1, 2]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {m}:4: the last line is cut short (a crash or a full disk?); left out"]
    lines = whole.splitlines()
    for bad, message in [
        (lines[2][:30], "not a JSON line ("),
        ("[1, 2]", "not a metrics record"),
        ('{"loss": 1.0}', "not a metrics record"),
    ]:
        m.write_text("\n".join([lines[0], lines[1], bad, lines[3]]) + "\n")  # the bad line is line 3
        assert plot.main([str(m), "-o", str(out)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {m}:3: {message}"), err
    m.write_text(lines[0] + "\n" + json.dumps({"iteration": 1, "loss": 2.0}) + "\n")
    assert plot.main([str(m), "-o", str(out)]) == 1
    assert capsys.readouterr().err.strip() == f"error: {m}: the record of iteration 1 has no 'tokens_per_s'"


# --- a full disk: one line naming the key and the path; no cut-short line left behind ------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs (root only; elsewhere these tests use the injected ENOSPC below)."""
    root = tmp_path / "small"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    yield root
    subprocess.run(["umount", "-l", str(root)], check=True)  # lazy: a failed test may still hold a file open


def fill(root: Path) -> None:
    with open(root / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError, match="No space left"):
            while True:
                f.write(b"x" * 4096)


def whole_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert not text or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_a_full_disk_under_the_metrics_file_is_one_line_and_leaves_whole_lines(small_fs, capsys):
    m = small_fs / "m.jsonl"
    m.write_text('{"record": "run"}\n')  # a page of its own: what a write may still fill before ENOSPC
    locks.lock_path_for(m, directory=False).write_text("1\n")
    fill(small_fs)
    code, _, err = bin_train(capsys, "train.train_iters=20", f"logging.metrics_file={m}")
    assert code == 1 and err.strip().splitlines() == [
        f"error: logging.metrics_file={str(m)!r}: cannot write it (No space left on device); free space there or "
        "set logging.metrics_file to another place (null: no file)"
    ]
    assert whole_lines(m)[0] == {"record": "run"}  # every line whole: the one cut short was taken back


def test_a_full_disk_under_the_lock_is_one_line(small_fs, capsys):
    (small_fs / "ck").mkdir()
    fill(small_fs)
    code, _, err = bin_train(capsys, "train.train_iters=2", f"checkpoint.save={small_fs / 'ck'}",
                             "logging.metrics_file=null")  # fmt: skip
    lock = small_fs / "ck" / ".lock"
    assert code == 1 and err.strip().splitlines() == [
        f"error: checkpoint.save={str(small_fs / 'ck')!r}: cannot write its lock file {str(lock)!r} (No space left "
        "on device); free space there or set a different checkpoint.save"
    ]


def test_an_injected_enospc_mid_line_takes_the_line_back(tmp_path, monkeypatch):
    """The same without a small filesystem: a write that stores half a line, then ENOSPC."""
    from engine import metrics

    m = tmp_path / "m.jsonl"
    log = metrics.MetricsLog(str(m), {"record": "run"})
    real = os.write

    def half_then_full(fd, data):
        if len(data) > 8:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    with pytest.raises(metrics.MetricsWriteError, match=r"logging.metrics_file=.*m.jsonl.*No space left on device"):
        log.write({"iteration": 1, "loss": 2.0})
    monkeypatch.undo()
    log.close()
    assert whole_lines(m) == [{"record": "run"}]


@pytest.mark.parametrize("value", ["1e300", "1e7", "nan", "inf", "-1", "0", "lots"])
def test_an_absurd_memory_budget_is_one_line_exit_2(value, capsys):
    assert train_main(["--plan", "--gpu-memory", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --gpu-memory {value}: expected a positive number of GiB up to 1,048,576, e.g. "
                   "--gpu-memory 139"]  # fmt: skip


def test_a_5000_digit_integer_in_a_config_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "big.json"
    path.write_text('{"train": {"seed": ' + "9" * 5000 + "}}")
    assert train_main([str(path), "--print-config"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {path}: an integer of 5,000 digits (999999999999...); a config's integers have at most 100 digits"
    ]


def test_a_static_loss_scale_that_overflows_is_blamed_not_the_learning_rate():
    """fp16 at train.loss_scale=1e38 overflows on the scale alone: the message names the scale, not the lr."""
    from engine.config import load_config
    from engine.skips import SkippedSteps, TrainingDiverged

    base = ["train.precision=fp16", "train.max_skipped_steps=2"]
    static = SkippedSteps(load_config({}, [*base, "train.loss_scale=1e38"]))
    static.update(False, 1, 5.0, float("inf"), 1e38)
    with pytest.raises(TrainingDiverged) as caught:
        static.update(False, 2, 5.0, float("inf"), 1e38)
    cause = str(caught.value).split("likely cause: ")[1]
    assert cause.startswith("the static train.loss_scale (1e+38) makes the fp16 gradients overflow")
    assert "optimizer.lr" not in cause
    dynamic = SkippedSteps(load_config({}, base))
    dynamic.update(False, 1, 5.0, float("inf"), 1.0)
    with pytest.raises(TrainingDiverged, match=r"overflow even at loss scale 1; .*lower optimizer.lr"):
        dynamic.update(False, 2, 5.0, float("inf"), 1.0)
