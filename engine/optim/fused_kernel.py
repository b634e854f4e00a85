"""Loads the fused CPU AdamW pass (csrc/fused_adamw.c) through ctypes, building it on first use.

The C file has no Python or torch headers, so it builds in about a second with the system C
compiler for the machine it runs on (-march=native) and works under any torch version. ctypes
releases the GIL for the call, so several Python threads run slices of one tensor in parallel.
Where it cannot be built or loaded, `load()` returns None, logs why once, and the caller uses torch's
ops; `status()` says which path runs and why (`bin/train --env` prints it).

The library is cached per user, keyed by everything the machine code depends on: the source, the
flags, the compiler's identity and version, and the CPU's features (-march=native). Builders on one
machine (ranks of a job) take a file lock, so one compiles and the others load its result.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine.optim import blockwise

try:
    import fcntl
except ImportError:  # not POSIX: builders still never see half a library (atomic rename), only duplicate work
    fcntl = None

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("csrc") / "fused_adamw.c"
# gcc's default 256-bit vectors on AVX-512 cores: -mprefer-vector-width=512 measured no faster on the
# device (3.56 against 3.67 G params/s in place, 2.94 against 3.42 out of place, 15 threads)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
KIND_NONE = 3
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_status = "not loaded yet"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "offload-engine"


def compiler() -> tuple[str, str] | None:
    """(path, first line of `--version`) of the C compiler: $CC, else cc, gcc or clang on PATH."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return None
    return cc, (out.splitlines() or ["unknown version"])[0]


def cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for), or the architecture where not listed."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_key(flags: list[str], compiler_version: str) -> str:
    parts = [_SRC.read_bytes(), " ".join(flags).encode(), compiler_version.encode(), cpu_features().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build(flags: list[str] = FLAGS) -> Path | None:
    """The shared library for these flags, compiled once per source, compiler and CPU into the user's cache;
    None where it cannot be built (the reason is in `status()` and the log)."""
    global _status
    cc = compiler()
    if cc is None:
        _status = "no C compiler found (install gcc or clang, or set CC)"
        return None
    out = _cache_dir() / f"fused_adamw-{cache_key(flags, cc[1])}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock_file:
        if fcntl is not None:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # another rank may be compiling the same library
        if out.exists():
            return out
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            res = subprocess.run([cc[0], *flags, str(_SRC), "-o", str(tmp_so)], capture_output=True, text=True)
            if res.returncode != 0:
                first = next((ln for ln in res.stderr.splitlines() if "error:" in ln), res.stderr.strip()[:300])
                _status = f"{cc[1]} did not compile {_SRC.name}: {first.strip()}"
                return None
            os.replace(tmp_so, out)  # atomic: a reader never sees half a library
    return out


def bind(path: Path) -> ctypes.CDLL:
    """Open a built library and declare its entry point's C signature (tests hold it equal to the C)."""
    lib = ctypes.CDLL(str(path))
    f = lib.fused_adamw_f32
    f.restype = ctypes.c_int
    f.argtypes = ARGTYPES
    f = lib.fused_adamw_f32_device
    f.restype = ctypes.c_int
    f.argtypes = DEVICE_ARGTYPES
    f = lib.fused_adamw_narrow
    f.restype = ctypes.c_int
    f.argtypes = NARROW_ARGTYPES
    f = lib.fused_adamw_blockwise
    f.restype = ctypes.c_int
    f.argtypes = BLOCKWISE_ARGTYPES
    return lib


ARGTYPES = [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p]
ARGTYPES += [ctypes.c_float] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_float] * 7
ARGTYPES += [ctypes.c_int]
_VP, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
DEVICE_ARGTYPES = [ctypes.c_int64] + [_VP] * 4 + [_I, _VP, _F, _F] + [_VP] * 4 + [_I, _I]
DEVICE_ARGTYPES += [ctypes.c_double] * 5 + [_F, _F, _I]
_DEVICE_TAIL = [_I] + [ctypes.c_double] * 5 + [_F, _F]  # math code, lr, beta1, beta2, eps, weight_decay, bc1, bc2_sqrt
NARROW_ARGTYPES = [ctypes.c_int64, _VP, _VP, _I, _VP, _I, _VP, _I, _VP, _I, _F, _F] + [_VP] * 5 + [_I] + [_F] * 7
NARROW_ARGTYPES += _DEVICE_TAIL
BLOCKWISE_ARGTYPES = [ctypes.c_int64, _VP, _VP, _I, _VP, _I, _VP, _VP, _I, _VP, _VP, _I, _F, _F] + [_VP] * 7
BLOCKWISE_ARGTYPES += [_I] + [_F] * 7 + [_VP] * 6 + _DEVICE_TAIL
NARROW_MATH = (0, 1)  # the narrow passes' arithmetics: single-tensor, and device_arith.CODE[FLOAT]
P_F32, P_REM = 0, 1  # the master's form in fused_adamw_narrow: fp32, or bf16 weight + int16 remainder
KIND_Q8 = 4  # a moment held as block-wise 8-bit codes (blockwise.py), in fused_adamw_blockwise


def load() -> ctypes.CDLL | None:
    """The compiled library, or None when it cannot be built here (OFFLOAD_ENGINE_NO_FUSED_ADAM=1 forces None)."""
    global _lib, _tried, _status
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("OFFLOAD_ENGINE_NO_FUSED_ADAM") == "1":
            _status = "disabled by OFFLOAD_ENGINE_NO_FUSED_ADAM=1"
            return None
        try:
            path = build()
            if path is not None:
                _lib = bind(path)
                _status = f"compiled C pass ({path})"
        except OSError as e:  # a read-only cache, a library the loader refuses, ...
            _status = f"the compiled C pass did not load: {e}"
            _lib = None
        if _lib is None:
            log.warning("CPU AdamW uses torch's ops: %s", _status)
        return _lib


def status() -> str:
    """Which CPU AdamW path runs here and why: building the library if that was not tried yet."""
    load()
    return _status if _lib is not None else f"torch ops: {_status}"


def pass_bytes(m: torch.dtype, v: torch.dtype, grad: torch.dtype, half: torch.dtype | None, remainders: bool) -> float:
    """Bytes per parameter one pass reads and writes in host memory, as the code touches them: the gradient read;
    the master (fp32, or the bf16 weight + int16 remainder), m and v read and written (a block-wise 8-bit moment,
    blockwise.CODES: its code and its share of the block's fp32 maximum); the half weights written (the remainder
    form's weight is its master's high half, already counted). 28 for the fp32 pass with bf16 gradient and
    weights, 18 for bf16 moments with the remainder master, 14.0625 for 8-bit ones. In place or out of place alike
    (the fp32 pass streams new buffers, skipping the write-allocate read); a plain store to the half weights may
    add that read (2 B) in the narrow pass."""
    master = 2 + 2 if remainders else 4
    written_half = 0 if remainders or half is None else half.itemsize
    scales = sum(2 * blockwise.SCALE_BYTES / blockwise.BLOCK for d in (m, v) if d == blockwise.CODES)
    total = grad.itemsize + 2 * (master + m.itemsize + v.itemsize) + written_half
    return total + scales if scales else total


def _ptr(t: torch.Tensor | None, offset: int = 0) -> int | None:
    return None if t is None else t.data_ptr() + offset * t.element_size()


def adamw_slice(
    lib: ctypes.CDLL,
    start: int,
    stop: int,
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    acc: torch.Tensor | None,
    p_out: torch.Tensor,
    m_out: torch.Tensor,
    v_out: torch.Tensor,
    half_out: torch.Tensor | None,
    scalars: tuple[float, ...] | None,
    stream: bool = True,
    device: tuple[float, ...] | None = None,
) -> None:
    """One slice [start, stop) of contiguous flat tensors (all 1-D, same length).

    scalars = (inv_scale, coef, decay, w1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size), torch's
    single-tensor arithmetic; or, given `device` instead (device_arith.DeviceArith.scalars: inv_scale, coef, math
    code, lr, beta1, beta2, eps, weight_decay, bc1, bc2_sqrt), the GPU's fused AdamW arithmetic.
    stream: write the outputs that alias no input with non-temporal stores (same results, no
    write-allocate reads); False only to measure the difference.
    """
    if device is not None:
        inv_scale, coef, code, lr, b1, b2, eps, wd, bc1, bc2s = device
        rc = lib.fused_adamw_f32_device(
            stop - start, _ptr(p, start), _ptr(m, start), _ptr(v, start), _ptr(g, start), KIND[g.dtype],
            _ptr(acc, start), inv_scale, coef, _ptr(p_out, start), _ptr(m_out, start), _ptr(v_out, start),
            _ptr(half_out, start), KIND_NONE if half_out is None else KIND[half_out.dtype], int(code),
            lr, b1, b2, eps, wd, bc1, bc2s, int(stream),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"fused_adamw_f32_device rejected grad={g.dtype} or arithmetic {code}")
        return
    inv_scale, coef, decay, w1, beta2, omb2, bc2s, eps, nss = scalars
    rc = lib.fused_adamw_f32(
        stop - start, _ptr(p, start), _ptr(m, start), _ptr(v, start), _ptr(g, start), KIND[g.dtype],
        _ptr(acc, start), inv_scale, coef, _ptr(p_out, start), _ptr(m_out, start), _ptr(v_out, start),
        _ptr(half_out, start), KIND_NONE if half_out is None else KIND[half_out.dtype],
        decay, w1, beta2, omb2, bc2s, eps, nss, int(stream),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(
            f"fused_adamw_f32 rejected dtypes grad={g.dtype} half={None if half_out is None else half_out.dtype}"
        )


def _device_tail(s) -> tuple:
    """The narrow passes' last arguments: the fused arithmetic's code and scalars where s.device is set."""
    if s.device is None:
        return (0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0)
    _, _, code, lr, b1, b2, eps, wd, bc1, bc2s = s.device
    if code not in NARROW_MATH:
        raise ValueError(f"the narrow passes compute arithmetics {NARROW_MATH}, not {code}")
    return (int(code), lr, b1, b2, eps, wd, bc1, bc2s)


def narrow_slice(lib: ctypes.CDLL, start: int, stop: int, s) -> None:
    """One slice [start, stop) of a cpu_arith.TensorStep whose moments are narrow (bf16/fp16) or whose master is
    the remainder form (s.rem set: s.p and s.p_out are the bf16 weights), in one pass of fused_adamw_narrow."""
    inv_scale, coef, decay, w1, beta2, omb2, bc2s, eps, nss = s.scalars
    rem = s.rem is not None
    if (s.m_out.dtype, s.v_out.dtype, s.p_out.dtype) != (s.m.dtype, s.v.dtype, s.p.dtype) or rem != (
        s.rem_out is not None
    ):
        raise ValueError("the narrow pass writes each state in the form it reads it: outputs' dtypes must match")
    half = s.half_out
    if s.coded:
        _blockwise_slice(lib, start, stop, s)
        return
    rc = lib.fused_adamw_narrow(
        stop - start, _ptr(s.p, start), _ptr(s.rem, start), P_REM if rem else P_F32, _ptr(s.m, start),
        KIND[s.m.dtype], _ptr(s.v, start), KIND[s.v.dtype], _ptr(s.g, start), KIND[s.g.dtype], inv_scale, coef,
        _ptr(s.p_out, start), _ptr(s.rem_out, start), _ptr(s.m_out, start), _ptr(s.v_out, start),
        _ptr(half, start), KIND_NONE if half is None else KIND[half.dtype], decay, w1, beta2, omb2, bc2s, eps, nss,
        *_device_tail(s),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"fused_adamw_narrow rejected dtypes m={s.m.dtype} v={s.v.dtype} grad={s.g.dtype}")


def _blockwise_slice(lib: ctypes.CDLL, start: int, stop: int, s) -> None:
    """narrow_slice with a moment in the block-wise 8-bit form: start on a block boundary of the parameter."""
    if start % blockwise.BLOCK:
        raise ValueError(f"a block-wise 8-bit slice starts on a block boundary, not at element {start}")
    inv_scale, coef, decay, w1, beta2, omb2, bc2s, eps, nss = s.scalars
    half, b = s.half_out, start // blockwise.BLOCK
    kinds = [KIND_Q8 if scale is not None else KIND[t.dtype] for t, scale in ((s.m, s.ms), (s.v, s.vs))]
    rc = lib.fused_adamw_blockwise(
        stop - start, _ptr(s.p, start), _ptr(s.rem, start), P_F32 if s.rem is None else P_REM,
        _ptr(s.m, start), kinds[0], _ptr(s.ms, b), _ptr(s.v, start), kinds[1], _ptr(s.vs, b),
        _ptr(s.g, start), KIND[s.g.dtype], inv_scale, coef, _ptr(s.p_out, start), _ptr(s.rem_out, start),
        _ptr(s.m_out, start), _ptr(s.ms_out, b), _ptr(s.v_out, start), _ptr(s.vs_out, b), _ptr(half, start),
        KIND_NONE if half is None else KIND[half.dtype], decay, w1, beta2, omb2, bc2s, eps, nss,
        *(t.data_ptr() for t in blockwise.tables()), *_device_tail(s),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"fused_adamw_blockwise rejected dtypes m={s.m.dtype} v={s.v.dtype} grad={s.g.dtype}")
