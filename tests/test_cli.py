"""bin/train as a user runs it: a short training run, --print-config, --env, one-line errors."""

import json
from pathlib import Path

import engine

ROOT = Path(__file__).resolve().parent.parent


def test_short_run_writes_metrics(tmp_path, bin_train):
    metrics = tmp_path / "m.jsonl"
    small = ["train.device=cpu", "optimizer.lr_warmup_iters=0", f"logging.metrics_file={metrics}", "model.num_layers=1",
             "model.hidden_size=32", "model.seq_length=32", "data.max_bytes=65536"]  # fmt: skip
    proc = bin_train(
        "train.train_iters=3",
        *small,
        f"checkpoint.save={tmp_path / 'ckpt'}",
    )
    assert proc.returncode == 0, proc.stderr
    header, *rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert header["record"] == "run" and header["resumed_from"] is None
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    keys = {
        "iteration",
        "loss",
        "lr",
        "grad_norm",
        "iteration_ms",
        "tokens_per_s",
        "peak_memory_bytes",
        "host_offload_bytes",
    }
    assert keys <= rows[0].keys()
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 for r in rows)
    assert "loss" in proc.stdout and "tokens/s" in proc.stdout  # the summary
    assert (tmp_path / "ckpt" / "iter_0000003" / "state.pt").is_file()
    # resuming from the checkpoint with a longer run continues at iteration 4
    proc = bin_train(
        "train.train_iters=4",
        *small,
        f"checkpoint.load={tmp_path / 'ckpt'}",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(metrics.read_text().splitlines()[-1])["iteration"] == 4


def test_print_config_reloads_to_an_equal_object(bin_train):
    proc = bin_train("--print-config", "optimizer.lr=0.01")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert engine.load_config(printed) == engine.load_config(ROOT / "configs" / "default.json", ["optimizer.lr=0.01"])


def test_bad_input_is_one_line_and_nonzero(bin_train):
    proc = bin_train("optimizer.optimizer_offload_fraction=1.5")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "optimizer_offload_fraction" in proc.stderr and "1.5" in proc.stderr
    proc = bin_train("no/such/config.json")
    assert proc.returncode == 2 and "no/such/config.json" in proc.stderr and "Traceback" not in proc.stderr
    proc = bin_train("data.source=text", "data.path=/no/such/file.txt", "train.device=cpu")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "data.path" in proc.stderr


def test_debug_shows_the_traceback(bin_train):
    proc = bin_train("--debug", "data.source=text", "data.path=/no/such/file.txt", "train.device=cpu")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_env_report(bin_train):
    proc = bin_train("--env")
    assert proc.returncode == 0, proc.stderr
    for field in ("torch", "CUDA available", "CPU", "cores", "AVX-512", "pinned memory", "CPU binding"):
        assert field in proc.stdout
    assert "CPU AdamW       compiled C pass (" in proc.stdout  # which path runs (tests/test_fused_kernel.py: why not)


def test_summary_says_what_offloading_did(bin_train):
    proc = bin_train("train.device=cpu", "train.train_iters=2", "optimizer.lr_warmup_iters=0", "model.num_layers=2",
                     "model.hidden_size=32", "model.seq_length=32", "data.max_bytes=65536", "logging.metrics_file=null",
                     "model.cpu_offloading=true", "model.cpu_offloading_num_layers=1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "activation offload layers: 1 of 2 layers wrapped" in proc.stdout, proc.stdout
