"""`bin/train --plan`, the pre-flight's refusals and the CUDA out-of-memory line, as a user meets them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import engine
from engine import cli
from engine.planning import preflight
from engine.planning.budget import Budgets, cgroup_available, meminfo, parse_gib, peak_rss_bytes

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "configs" / "13b-h200.json")
H200 = ["--gpu-memory", "139", "--host-memory", "125"]
GIB = 1 << 30


def run(capsys, *argv):
    rc = cli.train_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_table_and_json_for_the_demo(capsys):
    rc, out, err = run(capsys, DEMO, "--plan", *H200)
    assert rc == 0, err
    assert "optimizer.optimizer_offload_fraction = " in out and "(auto)" in out and "fits: yes" in out
    rc, out, err = run(capsys, DEMO, "--plan", "--json", *H200)
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["fits"] is True and 0 < plan["fraction"] < 1 and isinstance(plan["offloaded_layers"], int)
    assert plan["gpu"]["budget_bytes"] == 139 * GIB and plan["host"]["budget_bytes"] == 125 * GIB
    assert plan["gpu"]["device"] == "cuda"  # a GPU budget plans for CUDA, whatever this machine has
    assert plan["gpu"]["total_bytes"] <= plan["gpu"]["budget_bytes"]


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["optimizer.optimizer_offload_fraction=0.2", "model.cpu_offloading_num_layers=0"],
         r"^error: GPU memory: plan needs [\d.]+ GiB, 139\.0 GiB available; raise "
         r"optimizer\.optimizer_offload_fraction to >= 0\.\d\d \(or \"auto\"\)$"),
        (["optimizer.optimizer_offload_fraction=0.95", "model.cpu_offloading_num_layers=0"],
         r"^error: host memory: plan needs [\d.]+ GiB, 125\.0 GiB available; lower "
         r"optimizer\.optimizer_offload_fraction to <= 0\.\d\d, or set optimizer\.use_precision_aware_optimizer=true "
         r"optimizer\.exp_avg_dtype=bf16 optimizer\.exp_avg_sq_dtype=bf16 \(host [\d.]+ GiB\); at the current state "
         r"dtypes, at hidden 5120, seq 2048, micro-batch 1 at most \d+ layers \([\d.]+ B parameters\) fit"),
        (["optimizer.optimizer_cpu_offload=false", "optimizer.optimizer_offload_fraction=0.0",
          "optimizer.overlap_cpu_optimizer_d2h_h2d=false",
          "model.cpu_offloading_num_layers=0"],
         r"^error: GPU memory: plan needs [\d.]+ GiB, 139\.0 GiB available; set optimizer\.optimizer_cpu_offload=true "
         r"and optimizer\.use_distributed_optimizer=true with optimizer\.optimizer_offload_fraction >= 0\.\d\d"),
        (["model.num_layers=24", "model.hidden_size=1024", "model.num_attention_heads=16", "train.micro_batch_size=8",
          "optimizer.optimizer_cpu_offload=false", "optimizer.optimizer_offload_fraction=0.0",
          "optimizer.overlap_cpu_optimizer_d2h_h2d=false",
          "model.cpu_offloading_num_layers=23", "--host-memory", "12"],  # the last --host-memory wins
         r"^error: host memory: plan needs [\d.]+ GiB, 12\.0 GiB available; lower "
         r"model\.cpu_offloading_num_layers to <= \d+$"),
        (["optimizer.accumulate_allreduce_grads_in_fp32=true"],
         r'^error: no optimizer\.optimizer_offload_fraction and model\.cpu_offloading_num_layers fits \("auto"\): '
         r"where the GPU fits .* the host needs [\d.]+ GiB, 125\.0 GiB available; at hidden 5120, seq 2048, "
         r"micro-batch 1 at most \d+ layers \([\d.]+ B parameters\) fit"),
    ],
    ids=["fraction-too-low", "fraction-too-high", "no-optimizer-offload", "too-many-layers", "auto-nothing-fits"],
)  # fmt: skip
def test_what_cannot_fit_is_one_line_exit_2(capsys, overrides, pattern):
    rc, out, err = run(capsys, DEMO, "--plan", *H200, *overrides)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert re.match(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("value", ["0", "-3", "abc", "nan", "inf"])
def test_budget_flags_must_be_positive_numbers(capsys, value):
    rc, out, err = run(capsys, "--plan", "--gpu-memory", value)
    assert rc == 2
    expected = f"error: --gpu-memory {value}: expected a positive number of GiB up to 1,048,576, e.g. --gpu-memory 139"
    assert err.strip() == expected
    with pytest.raises(ValueError, match="--host-memory"):
        parse_gib("--host-memory", value)
    assert parse_gib("--host-memory", "0.5") == GIB // 2


def test_initialize_refuses_an_oversized_model_before_allocating(capsys):
    # ~300 M parameters trained on the CPU: some GiB of weights, gradients and AdamW states, against 3 GiB
    big = ["model.num_layers=6", "model.hidden_size=2048", "model.num_attention_heads=16", "train.device=cpu",
           "optimizer.lr_warmup_iters=0", "train.train_iters=1", "logging.metrics_file=null"]  # fmt: skip
    before = peak_rss_bytes()
    start = time.perf_counter()
    rc, out, err = run(capsys, "--host-memory", "3", *big)
    assert rc == 2 and time.perf_counter() - start < 30
    assert peak_rss_bytes() - before < 256 << 20  # nothing the size of the model was allocated
    line = err.strip()
    assert "\n" not in line and line.startswith("error: host memory: plan needs ")
    assert re.search(
        r", 3\.0 GiB available; nothing fits at this shape: at hidden 2048, seq 128, micro-batch 8 at "
        r"most [1-5] layers \([\d.]+ B parameters\) fit",
        line,
    ), line


def test_auto_is_resolved_printed_and_recorded(capsys, tmp_path):
    metrics = tmp_path / "m.jsonl"
    tiny = ["model.num_layers=2", "model.hidden_size=32", "model.seq_length=32", "data.max_bytes=65536",
            "train.device=cpu", "train.train_iters=2", "optimizer.lr_warmup_iters=0", "logging.progress_bar=false",
            f"logging.metrics_file={metrics}", "optimizer.optimizer_cpu_offload=true",
            "optimizer.use_distributed_optimizer=true", "optimizer.optimizer_offload_fraction=auto",
            "model.cpu_offloading=true", "model.cpu_offloading_num_layers=auto"]  # fmt: skip
    rc, out, err = run(capsys, *tiny)
    assert rc == 0, err
    assert "memory plan chose optimizer.optimizer_offload_fraction=0.0, model.cpu_offloading_num_layers=0" in out
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert rows[-1]["optimizer_offload_fraction"] == 0.0 and rows[-1]["cpu_offloading_num_layers"] == 0
    assert rows[-1]["peak_host_rss_bytes"] > 0 and "peak host RSS " in out  # the record and the summary


def test_auto_against_a_gpu_budget_resolves_in_the_preflight():
    # what initialize does on a GPU, checked on the CPU: the pre-flight against a CUDA plan with a small budget
    cfg = engine.load_config({}, ["model.num_layers=4", "model.hidden_size=256", "model.seq_length=256",
                                  "train.params_dtype=half", "optimizer.optimizer_cpu_offload=true",
                                  "optimizer.use_distributed_optimizer=true",
                                  "optimizer.optimizer_offload_fraction=auto"])  # fmt: skip
    roomy = engine.plan(cfg, gpu_budget_bytes=16 * GIB, host_budget_bytes=8 * GIB, device="cuda")
    assert roomy.fraction == 0.0
    budget = roomy.gpu.total_bytes - 4 * 2**20  # a little less than the plan needs without offload
    resolved = preflight.check(cfg, None, torch.device("cuda"), 1, Budgets(budget, 8 * GIB))
    f = resolved.optimizer.optimizer_offload_fraction
    assert isinstance(f, float) and 0 < f <= 1
    assert preflight.last()[1].fits and preflight.last()[1].fraction == f


def test_cuda_out_of_memory_is_one_line_naming_the_plan(capsys, monkeypatch):
    cfg = engine.load_config({}, ["optimizer.lr_warmup_iters=0"])
    preflight.check(cfg, None, torch.device("cpu"), 1, Budgets(None, 64 * GIB))

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity ...")

    monkeypatch.setattr(cli, "train", oom)
    rc, out, err = run(capsys, "optimizer.lr_warmup_iters=0")
    assert rc == 1
    line = err.strip()
    assert "\n" not in line
    assert line.startswith("error: CUDA out of memory: allocating 2.00 GiB failed where the plan said ")
    assert (
        "raise optimizer.optimizer_offload_fraction (now 0.00) or model.cpu_offloading_num_layers (now 0), "
        "or lower train.micro_batch_size (now 8)" in line
    )


def test_host_budget_honours_cgroup_limits(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")
    (v2 / "memory.current").write_text("2147483648\n")
    (v2 / "memory.stat").write_text("anon 1\ninactive_file 1073741824\n")
    assert cgroup_available(v2) == 8 * GIB - 2 * GIB + GIB
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_available(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(4 * GIB))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(GIB))
    (v1 / "memory" / "memory.stat").write_text("total_inactive_file 0\n")
    assert cgroup_available(v1) == 3 * GIB
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    assert cgroup_available(v1) is None
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal:       16 kB\nMemAvailable:    8 kB\n")
    assert meminfo(proc)["MemAvailable"] == 8192


def test_bin_train_refuses_in_a_subprocess_without_traceback():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bin" / "train"), DEMO, "train.device=cpu", "--host-memory",
                           "100"], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    # the device is this host: the whole model's training state is host memory, which 100 GiB cannot hold
    assert proc.stderr.startswith("error: ") and "100.0 GiB available" in proc.stderr


def test_plan_says_what_activation_offload_moves(capsys):
    rc, out, err = run(capsys, DEMO, "--plan", *H200, "model.cpu_offloading_num_layers=2")
    assert rc == 0, err
    assert re.search(r"activation offload: 2 layers move [\d.]+ GiB to the host and back per step, [\d.]+ GiB off "
                     r"the GPU by the end of forward", out), out  # fmt: skip
    tiny = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
            "train.micro_batch_size=2",
            "train.global_batch_size=2", "model.cpu_offloading=true", "model.cpu_offloading_num_layers=1",
            "optimizer.optimizer_cpu_offload=false", "optimizer.optimizer_offload_fraction=0.0",
          "optimizer.overlap_cpu_optimizer_d2h_h2d=false"]  # fmt: skip
    rc, out, err = run(capsys, DEMO, "--plan", *H200, *tiny)
    assert rc == 0, err
    assert "activation offload: 1 layers wrapped, but nothing moves: every storage they save is at most 65536" in out
