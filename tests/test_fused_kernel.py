"""The C pass's build: it builds here (CI fails when it does not), its ctypes signature equals the C
prototype, the cache key follows what the machine code depends on, failures say why, ranks compile once."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.optim import fused_kernel

ROOT = Path(__file__).resolve().parent.parent
C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double}


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """fused_kernel as if never loaded, with its cache in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("OFFLOAD_ENGINE_NO_FUSED_ADAM", raising=False)
    for name, value in (("_tried", False), ("_lib", None), ("_status", "not loaded yet")):
        monkeypatch.setattr(fused_kernel, name, value)
    return fused_kernel


def test_the_c_pass_builds_here():
    if os.environ.get("OFFLOAD_ENGINE_NO_FUSED_ADAM") == "1":
        pytest.skip("OFFLOAD_ENGINE_NO_FUSED_ADAM=1")
    assert fused_kernel.load() is not None, fused_kernel.status()
    assert fused_kernel.status().startswith("compiled C pass")


@pytest.mark.parametrize(("entry", "argtypes"), [("fused_adamw_f32", fused_kernel.ARGTYPES),
                                                 ("fused_adamw_f32_device", fused_kernel.DEVICE_ARGTYPES),
                                                 ("fused_adamw_narrow", fused_kernel.NARROW_ARGTYPES)])  # fmt: skip
def test_ctypes_signature_equals_the_c_prototype(entry, argtypes):
    src = fused_kernel._SRC.read_text()
    params = re.search(rf"\bint {entry}\(([^)]*)\)", src).group(1)
    expected = []
    for param in params.split(","):
        words = param.replace("restrict", "").split()
        expected.append(ctypes.c_void_p if "*" in param else C_TYPES[words[-2]])
    assert argtypes == expected


def test_cache_key_follows_source_flags_compiler_and_cpu_not_the_host(monkeypatch):
    key = fused_kernel.cache_key(["-O3"], "gcc 12.2.0")
    assert fused_kernel.cache_key(["-O2"], "gcc 12.2.0") != key
    assert fused_kernel.cache_key(["-O3"], "gcc 11.4.0") != key
    monkeypatch.setattr("platform.node", lambda: "another-container")
    assert fused_kernel.cache_key(["-O3"], "gcc 12.2.0") == key
    monkeypatch.setattr(fused_kernel, "cpu_features", lambda: "sse2")
    assert fused_kernel.cache_key(["-O3"], "gcc 12.2.0") != key


def test_no_compiler_is_said(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "compiler", lambda: None)
    assert fresh.load() is None
    assert fresh.status() == "torch ops: no C compiler found (install gcc or clang, or set CC)"


def test_a_compile_error_is_said(fresh, monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("int fused_adamw_f32(void) { return undeclared_name; }\n")
    monkeypatch.setattr(fresh, "_SRC", bad)
    assert fresh.load() is None
    assert re.match(r"torch ops: .* did not compile bad.c: .*undeclared_name", fresh.status()), fresh.status()


def test_concurrent_builders_compile_once(tmp_path):
    """Two processes build into an empty cache at once (two ranks): one compiles, both load the library."""
    calls = tmp_path / "calls"
    cc = tmp_path / "cc"
    real = fused_kernel.compiler()
    if real is None:
        pytest.skip("Requires: a C compiler")
    cc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nsleep 1\nexec {real[0]} "$@"\n')
    cc.chmod(0o755)
    script = textwrap.dedent("""
        from engine.optim import fused_kernel
        assert fused_kernel.load() is not None, fused_kernel.status()
    """)
    env = dict(os.environ, CC=str(cc), XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    env.pop("OFFLOAD_ENGINE_NO_FUSED_ADAM", None)
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    compiles = [line for line in calls.read_text().splitlines() if "fused_adamw.c" in line]
    assert len(compiles) == 1, compiles
    assert len(list((tmp_path / "cache" / "offload-engine").glob("*.so"))) == 1


def test_bench_cpass_rows(tmp_path):
    """`bin/bench cpass` at a tiny size: every path in and out of place, rates that are rates."""
    import json

    from engine.bench import cpass

    out = tmp_path / "cpass.json"
    threads = torch.get_num_threads()
    assert cpass.main(["--numel", "70000", "--reps", "1", "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    have = {(r["path"], r["where"]) for r in rows}
    assert have >= {(p, w) for p in ("torch", "c", "torch-ops") for w in ("in place", "out of place")}
    assert all(r["gparams_s"] > 0 for r in rows)
    assert torch.get_num_threads() == threads  # left as found: later in-process runs compute as before
    forms = json.loads(out.read_text())["forms"]
    assert {(r["form"], r["path"]) for r in forms} >= {(f, "torch-ops") for f in cpass.FORMS}
    by_form = {r["form"]: r["bytes_per_param"] for r in forms}
    assert by_form == {
        "fp32": 28,
        "bf16-m/v": 20,
        "fp16-m/v": 20,
        "fp32-m/v+remainder": 26,
        "bf16-m/v+remainder": 18,
        "int8-m/v": 16.0625,
        "int8-m/v+remainder": 14.0625,
    }  # 8-bit: + 2 x 4 B / 256 per moment
    for r in forms:
        assert r["gbs"] == pytest.approx(r["bytes_per_param"] * 70000 / r["s"] / 1e9) and r["floor_gbs"] > 0
        assert (r["cores_gparams_s"] > 0) if r["path"] == "c" else r["cores_gparams_s"] is None


@pytest.mark.parametrize("form", ["fp32", "bf16-m/v+remainder", "int8-m/v"])
def test_bench_cores_rate_steps_as_the_slice_functions_do(form):
    """The in-cache rate's prepared call (its arguments built once) is the call the engine's slice functions
    make: the same step, bit for bit."""
    from engine.bench import cpass

    lib = fused_kernel.load()
    if lib is None:
        pytest.skip(f"the C pass did not build here: {fused_kernel.status()}")
    n = 3 * 256 + 7
    a = cpass._form_step(n, form, torch.randn(n).bfloat16(), torch.Generator().manual_seed(2))
    clones = {}  # one clone per distinct tensor: an in-place step's outputs stay its inputs
    fields = [f.name for f in dataclasses.fields(a) if isinstance(getattr(a, f.name), torch.Tensor)]
    b = dataclasses.replace(a, **{k: clones.setdefault(id(getattr(a, k)), getattr(a, k).clone()) for k in fields})
    cpass._prepared(lib, a)()
    if form == "fp32":
        fused_kernel.adamw_slice(lib, 0, n, b.p, b.m, b.v, b.g, None, b.p_out, b.m_out, b.v_out, b.half_out, b.scalars)
    else:
        fused_kernel.narrow_slice(lib, 0, n, b)
    for k in fields:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert not torch.equal(a.m.float(), cpass._form_step(n, form, a.g, torch.Generator().manual_seed(2)).m.float())


def test_pass_bytes_by_hand():
    """What each pass moves per parameter, counted from the C loop's loads and stores."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert fused_kernel.pass_bytes(f32, f32, bf16, bf16, False) == 2 + 2 * 12 + 2  # the C source's 28
    assert fused_kernel.pass_bytes(f32, f32, f32, None, False) == 4 + 2 * 12  # fp32 weights: no half copy
    assert fused_kernel.pass_bytes(bf16, f16, bf16, bf16, False) == 2 + 2 * 8 + 2
    assert fused_kernel.pass_bytes(bf16, bf16, bf16, bf16, True) == 2 + 2 * (2 + 2 + 4)  # weight+remainder
    q8 = torch.uint8  # block-wise 8-bit codes: 1 B each, and a 4 B maximum per 256 read and written
    assert fused_kernel.pass_bytes(q8, q8, bf16, None, True) == 2 + 2 * (2 + 2 + 1 + 1) + 2 * 2 * 4 / 256
