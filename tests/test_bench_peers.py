"""bin/bench peers on CPU at a tiny shape: a row per peer (measured, or why not), each in its own process, and a
loss column computed from the runs (a runner that perturbs one peer's update changes that row alone)."""

import json
import sys

import pytest

from engine.bench import peers
from engine.planning.budget import meminfo

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--micro-batch", "2", "--iters", "3",
        "--warmup", "1", "--fractions", "0.5", "--threads", "1", "--data-bytes", "200000",
        "--timeout", "900"]  # fmt: skip


def _rows(tmp_path, *argv, name="peers.json"):
    out = tmp_path / name
    assert peers.main([*TINY, *argv, "--json", str(out)]) == 0
    return {r["peer"]: r for r in json.load(open(out))["rows"]}


@pytest.mark.slow  # nine processes: about 3 min on 2 busy cores; .ci/run runs it with -m slow
def test_a_row_per_peer_measured_or_why_not(tmp_path, capsys):
    rows = _rows(tmp_path)
    text = capsys.readouterr().out
    assert set(rows) == set(peers.DEFAULT_PEERS.split(","))
    for r in rows.values():
        assert f"| {r['peer']} | {r['fraction']:g} |" in text
        if "error" in r:  # the first line of why, and the bench went on
            assert r["error"] and "\n" not in r["error"] and f"not run: {r['error']}" in text
        else:
            assert len(r["losses"]) == 4 and r["iter_ms"] > 0 and r["peak_rss_bytes"] > 0
            assert r["loss_delta"] == r["losses"][-1] - rows["plain"]["losses"][-1]
    for measured in ("plain", "ours", "ours-delayed", "fsdp2"):  # run on CPU wherever the tests run
        assert "error" not in rows[measured], rows[measured]
    assert rows["plain"]["loss_delta"] == 0.0
    assert rows["ours"]["fraction"] == 0.5 and rows["ds-zero2"]["fraction"] == 1.0
    assert "needs CUDA" in rows["megatron"]["error"]  # megatron-core's HybridDeviceOptimizer is CUDA-only
    assert rows["ours-delayed"]["semantics"].startswith("delayed")
    assert rows["ds-zenflow"]["semantics"].startswith("approximate")
    # the same model, data and update: ours (bf16 weights, fp32 masters) ends close to torch AdamW on fp32 weights
    assert abs(rows["ours"]["loss_delta"]) < 0.02 and abs(rows["fsdp2"]["loss_delta"]) < 0.02


PERTURBING_RUNNER = """
import json, sys
from engine.bench.peers import runner
spec = json.loads(sys.argv[1])
if spec["peer"] == "ours":
    spec["lr"] *= 100  # a wrong update: the row's loss must show it
runner.main([json.dumps(spec)])
"""


def test_the_loss_column_comes_from_the_runs(tmp_path, monkeypatch):
    honest = _rows(tmp_path, "--peers", "plain,ours")
    (tmp_path / "perturbing_runner.py").write_text(PERTURBING_RUNNER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    planted = _rows(tmp_path, "--peers", "plain,ours", "--runner", "perturbing_runner", name="planted.json")
    assert planted["plain"]["losses"] == honest["plain"]["losses"]  # one process per row: the others untouched
    assert abs(planted["ours"]["loss_delta"]) > 10 * abs(honest["ours"]["loss_delta"]) + 0.01


def test_a_child_that_dies_is_a_row_with_its_last_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "dying_runner.py").write_text("import sys\nprint('killed by the planted runner', file=sys.stderr)\n"
                                              "sys.exit(3)\n")  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    rows = _rows(tmp_path, "--peers", "plain", "--runner", "dying_runner")
    assert rows["plain"]["error"] == "exited 3: killed by the planted runner"
    assert "loss_delta" not in rows["plain"]


KILLED_RUNNER = """
import os, signal
held = bytearray(300 << 20)  # touched: resident
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_child_says_what_it_held(tmp_path, monkeypatch):
    """A peer the kernel kills (SIGKILL: no last words) is a row naming the signal and its own peak host RSS."""
    (tmp_path / "killed_runner.py").write_text(KILLED_RUNNER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    error = _rows(tmp_path, "--peers", "plain", "--runner", "killed_runner")["plain"]["error"]
    assert error.startswith("killed by SIGKILL at ") and " GiB peak host RSS of " in error, error
    held = float(error.split("killed by SIGKILL at ")[1].split(" GiB")[0])
    assert 0.3 <= held < 2, error  # this child's 300 MiB and the interpreter, not an earlier row's peak


def test_a_kill_near_the_host_memory_is_out_of_memory():
    host = meminfo()["MemTotal"]
    assert peers._death(-9, int(0.95 * host), "a warning").endswith(": out of host memory (does not fit)")
    assert peers._death(-9, 1 << 30, "a warning").endswith(": a warning")  # killed, but not for memory
    assert peers._death(-15, int(0.95 * host), "bye").startswith("killed by SIGTERM at ")
    assert peers._death(3, 0, "bye") == "exited 3: bye"


def test_an_unknown_peer_is_refused():
    with pytest.raises(SystemExit, match="--peers 'zero9': not a peer; choose from plain, ours"):
        peers.main([*TINY, "--peers", "zero9"])


def test_runner_reports_an_error_as_its_row(capsys):
    from engine.bench.peers import runner

    assert runner.main([json.dumps({"peer": "nonexistent"})]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(runner.MARK) and json.loads(line[len(runner.MARK) :])["error"].startswith("KeyError")
    assert sys.modules["engine.bench.peers.runner"] is runner


def test_the_json_holds_each_finished_row_before_the_next(tmp_path, monkeypatch, capsys):
    """A bench stopped from outside (a device call's time limit) leaves the rows it finished, marked partial."""
    out = tmp_path / "peers.json"
    seen = []

    def fake_row(a, spec):
        if seen:  # the bench is stopped while the second row runs: the first must already be on disk
            raise KeyboardInterrupt
        seen.append(spec["peer"])
        measured = {"iter_ms": 12.5, "setup_s": 1.0, "peak_gpu_bytes": 3 << 30, "peak_rss_bytes": 1 << 30}
        return {"peer": spec["peer"], "fraction": spec["fraction"], "semantics": "exact", **measured,
                "losses": [5.5, 5.25]}  # fmt: skip

    monkeypatch.setattr(peers, "run_row", fake_row)
    with pytest.raises(KeyboardInterrupt):
        peers.main([*TINY, "--peers", "plain,ours", "--json", str(out)])
    saved = json.load(open(out))
    assert saved["partial"] is True and [r["peer"] for r in saved["rows"]] == ["plain"]
    assert saved["rows"][0]["loss_delta"] == 0.0
    assert "plain f=0: 12.5 ms/iter, setup 1.0 s, peak GPU 3.0 GiB, host RSS 1.0 GiB, last loss 5.2500" in (
        capsys.readouterr().out
    )


def test_a_row_whose_loss_rose_says_so(tmp_path, monkeypatch, capsys):
    """A comparison measured across a divergence says nothing: such a row is marked, in its line and the table."""

    def fake_row(a, spec):
        losses = [5.5, 14.5, 11.6] if spec["peer"] == "ours" else [5.5, 5.3, 5.25]
        measured = {"iter_ms": 12.5, "tokens_per_s": 1.0, "tflops": 1.0, "setup_s": 1.0, "peak_gpu_bytes": None,
                    "peak_rss_bytes": 1 << 30}  # fmt: skip
        return {"peer": spec["peer"], "fraction": spec["fraction"], "semantics": "exact", **measured,
                "losses": losses}  # fmt: skip

    monkeypatch.setattr(peers, "run_row", fake_row)
    assert peers.main([*TINY, "--peers", "plain,ours"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln for ln in lines if "ROSE" in ln] == [
        "  ours f=0.5: 12.5 ms/iter, setup 1.0 s, host RSS 1.0 GiB, last loss 11.6000 (+6.3500 vs plain); "
        "ROSE from 5.5000: lower --lr",
        "| ours | 0.5 | 12.5 | 1 | 1 | - | 1.00 GiB | 11.6000 (+6.3500; 9.2000); ROSE from 5.5000: lower --lr "
        "| exact |",
    ]


def test_every_peer_starts_from_the_same_weights():
    """The fp32-weight peers start from the bf16-rounded draw the bf16-weight peers must start from."""
    import torch

    from engine.bench.peers import models

    spec = {"model": "gpt", "layers": 1, "hidden": 64, "heads": 4, "seq": 16, "seed": 3}
    fp32 = models.build(spec, torch.device("cpu"))
    bf16 = models.build(spec, torch.device("cpu"), torch.bfloat16)
    for a, b in zip(fp32.parameters(), bf16.parameters(), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b.float())
    drawn = models.build({**spec, "bf16_start": False}, torch.device("cpu"))  # the fp32 draw, off the bf16 grid
    assert any(not torch.equal(p, p.bfloat16().float()) for p in drawn.parameters())
