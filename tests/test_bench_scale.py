"""bin/bench scale on CPU at a tiny shape: the rows, their fields, the FLOP formula and the freeing between rows."""

import json
import statistics

import pytest

from engine.bench import scale, scale_run
from engine.models.gpt import GPT
from engine.optim import fused_kernel

TINY = ["--layers-fit", "1", "--layers", "2", "--hidden", "32", "--seq", "16", "--global-batch", "2",
        "--iters", "2", "--warmup", "1", "--data-bytes", "100000", "--device", "cpu", "--lr-warmup", "3"]  # fmt: skip


@pytest.mark.parametrize("layers,hidden,seq", [(2, 64, 32), (3, 128, 16)])
def test_shape_counts_the_built_in_gpt(layers, hidden, seq):
    model = GPT(num_layers=layers, hidden_size=hidden, num_attention_heads=4, seq_length=seq, vocab_size=256)
    assert scale.Shape(layers, hidden, 4, seq).params() == sum(p.numel() for p in model.parameters())
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n)
    assert scale.Shape(layers, hidden, 4, seq).matmul_params() == matmul


def test_flops_per_token_at_the_issue_shape():
    f = scale.Shape(16, 4096, 32, 2048).flops_per_token()
    n = 16 * 12 * 4096**2 + 4096 * 256
    assert f["dense"] == 6 * n
    assert f["attention"] == 12 * 16 * 4096 * 2048
    assert f["causal_total"] == 6 * n + 6 * 16 * 4096 * 2049


def test_bench_scale_rows_on_cpu(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert scale.main([*TINY, "--json", str(out), "--pin-threads", "both"]) == 0
    text = capsys.readouterr().out
    assert "FLOPs per token = 6*N + 12*L*h*s" in text
    assert "| run | layers | params | f | ms/iter | tokens/s | TFLOP/s | vs fit |" in text
    rows = {r["name"]: r for r in json.load(open(out))["rows"]}
    assert set(rows) == {"fit", "exact", "exact+pin", "dpu"}
    assert rows["exact+pin"]["pin"] and not rows["exact"]["pin"] and rows["exact+pin"]["cpu_step_ms"] is not None
    fit, exact = rows["fit"], rows["exact"]
    assert fit["fraction"] == 0.0 and exact["fraction"] == 0.3
    assert fit["layers"] == 1 and exact["layers"] == 2
    for r in (fit, exact):
        assert r["iter_ms"] > 0 and r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["host_rss_bytes"] > 0
        assert len(r["losses"]) == 3
    assert fit["vs_fit"] == 1.0
    assert fit["cpu_step_ms"] is None and fit["host_engine_bytes"] == 0
    assert exact["cpu_step_ms"] is not None and exact["host_engine_bytes"] > 0
    assert exact["hidden_ms"] <= exact["cpu_step_ms"]
    if fused_kernel.load() is not None:  # the C pass's bytes: fp32 states, bf16 weights, a bf16 or fp32 gradient
        assert exact["cpu_pass_bytes"] in (28, 30) and exact["cpu_gbs"] > 0 and fit["cpu_gbs"] is None
        assert f" ms ({exact['cpu_pass_bytes']:g} B, {exact['cpu_gbs']:.0f} GB/s) |" in text
    assert rows["dpu"]["unavailable"] is None and rows["dpu"]["iter_ms"] > 0
    assert rows["dpu"]["delayed_steps"] == [3] and not exact["delayed_steps"]  # 2 exact warm-up steps, then delayed
    # a delayed row's figure is its delayed steps' only (--warmup 1 would also time its second, exact, step)
    assert rows["dpu"]["measured_from"] == 2 and exact["measured_from"] == 1
    for r in (rows["dpu"], exact):
        assert r["iter_ms"] == statistics.median(r["step_ms"][r["measured_from"] :]) and len(r["step_ms"]) == 3


def test_a_delayed_row_without_a_delayed_step_to_measure_says_so(tmp_path):
    out = tmp_path / "scale.json"
    assert scale.main([*TINY, "--rows", "dpu", "--dpu-warmup", "3", "--json", str(out)]) == 0
    (row,) = json.load(open(out))["rows"]
    assert "--warmup 1 --iters 2 measure no delayed step of the dpu row" in row["unavailable"]
    assert "raise --iters above 2" in row["unavailable"]


def test_each_model_is_freed_before_the_next(monkeypatch):
    """The bench refuses to go on while a previous model is still referenced (it would not fit on a GPU)."""
    kept = []
    real = scale.Shape.build

    def keep(*args):
        kept.append(real(*args))
        return kept[-1]

    monkeypatch.setattr(scale.Shape, "build", keep)
    with pytest.raises(RuntimeError, match="still referenced"):
        scale.main([*TINY, "--rows", "fit"])


def test_variants_overrides_and_refusals_as_rows(tmp_path, capsys):
    """--set reaches every row, a --variant is one more row of the deep shape with its overrides (its fraction
    read back from the engine), and a config the engine refuses is a row saying why, not a crash."""
    out = tmp_path / "scale.json"
    argv = [*TINY, "--rows", "fit,exact", "--json", str(out), "--set", "optimizer.adam_beta2=0.99",
            "--variant", "half:optimizer.optimizer_offload_fraction=0.5,optimizer.clip_grad=0",
            "--variant",
            "refused:optimizer.delayed_param_update=true,optimizer.cpu_offload_gpu_assist=true"]  # fmt: skip
    assert scale.main(argv) == 0
    rows = {r["name"]: r for r in json.load(open(out))["rows"]}
    assert list(rows) == ["fit", "exact", "half", "refused"]
    assert rows["exact"]["fraction"] == 0.3 and rows["half"]["fraction"] == 0.5
    assert rows["half"]["overrides"] == {"optimizer.optimizer_offload_fraction": 0.5, "optimizer.clip_grad": 0}
    assert rows["half"]["losses"] != rows["exact"]["losses"]  # unclipped at another fraction: another run
    assert rows["refused"]["unavailable"] and "gpu_assist" in rows["refused"]["unavailable"]
    assert "half: optimizer.optimizer_offload_fraction=0.5, optimizer.clip_grad=0" in capsys.readouterr().out
    cfg = scale_run.row_config(scale.parse_args(argv), scale.Shape(2, 32, 4, 16), 0.3, False)
    assert cfg["optimizer"]["adam_beta2"] == 0.99 and cfg["optimizer"]["clip_grad"] == 1.0  # --set: every row


@pytest.mark.parametrize("bad", [["--set", "clip_grad=0"], ["--set", "optimizer.clip_grad"], ["--variant", "x"]])
def test_malformed_overrides_are_one_line(bad):
    with pytest.raises(SystemExit, match="expected"):
        scale.main([*TINY, *bad])


def test_auto_fraction_is_resolved_per_row(tmp_path):
    """--fraction auto: each row's engine asks the plan, and the row records the fraction it chose."""
    out = tmp_path / "scale.json"
    assert scale.main([*TINY, "--rows", "exact", "--fraction", "auto", "--json", str(out)]) == 0
    (row,) = json.load(open(out))["rows"]
    assert isinstance(row["fraction"], float) and 0.0 <= row["fraction"] <= 1.0


def test_without_cuda_a_gpu_benchmark_refuses_at_once(monkeypatch, capsys):
    """No CUDA: one line, exit 2, before any data is read or model built (not an 8 B run on the CPU)."""
    from engine.bench import activations, floors, optimizer

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(scale, "stdlib_bytes", lambda n: pytest.fail("read data without CUDA"))
    monkeypatch.setattr(scale, "resolve_fraction", lambda a, s: pytest.fail("planned without CUDA"))
    for main in (scale.main, optimizer.main, activations.main, floors.main):
        assert main([]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no CUDA device" in err[0], err


def test_bench_help_exits_0(capsys):
    from engine.cli import bench_main

    assert bench_main(["--help"]) == 0 and "scale" in capsys.readouterr().out
    assert bench_main([]) == 2 and "usage" in capsys.readouterr().err


def test_json_keeps_the_finished_rows_of_a_stopped_run(tmp_path, monkeypatch):
    """A run stopped by a time limit (the device scripts' timeout) still leaves the rows it finished in --json."""
    out, real, calls = tmp_path / "scale.json", scale_run.run_row, []

    def stop_at_the_second(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(scale_run, "run_row", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        scale.main([*TINY, "--rows", "fit,exact", "--json", str(out)])
    data = json.load(open(out))
    assert data["partial"] and [r["name"] for r in data["rows"]] == ["fit"] and data["rows"][0]["iter_ms"] > 0
