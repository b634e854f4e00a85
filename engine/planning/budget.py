"""What the machine has for the memory plan, and what the process used: free CUDA memory, host memory available
to this process (cgroup v1/v2 limits honoured), and the process's peak resident set.

Host budget = min(MemAvailable, the cgroup's limit minus its reclaimable-excluded usage) + this process's own
resident set: the plan counts the whole process (its "runtime" part), so what the process already holds is
given back to the budget rather than counted twice.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 1 << 30
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number near 2^63


@dataclass(frozen=True)
class Budgets:
    """Bytes the plan may use; None: this machine's (free CUDA memory, host memory available to the process)."""

    gpu_bytes: int | None = None
    host_bytes: int | None = None


MAX_GIB = 1 << 20  # 1 PiB


def parse_gib(flag: str, text: str) -> int:
    """A --gpu-memory / --host-memory value in GiB -> bytes; ValueError naming the flag otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_GIB:  # NaN fails too; past MAX_GIB the byte count is no machine's
        raise ValueError(f"{flag} {text}: expected a positive number of GiB up to {MAX_GIB:,}, e.g. {flag} 139")
    return int(value * GIB)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def meminfo(root: Path = Path("/proc")) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in (_read(root / "meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the cgroup still lets this process take (limit - usage + inactive file cache), or None: no limit.

    v2: memory.max, memory.current, memory.stat's inactive_file; v1: memory/memory.limit_in_bytes,
    memory.usage_in_bytes, memory.stat's total_inactive_file."""
    for limit_f, usage_f, stat_f, key in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                          ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                           "memory/memory.stat", "total_inactive_file")):  # fmt: skip
        limit = _read(root / limit_f)
        if limit is None:
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= _UNLIMITED:
            return None
        usage = int(_read(root / usage_f) or 0)
        inactive = 0
        for line in (_read(root / stat_f) or "").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                inactive = int(value)
        return max(0, int(limit) - usage + inactive)
    return None


def current_rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_bytes("VmRSS") or 0


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM from /proc/self/status (ru_maxrss where there is no /proc)."""
    return _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(key: str) -> int | None:
    for line in (_read(Path("/proc/self/status")) or "").splitlines():
        if line.startswith(key + ":"):
            fields = line.split()
            return int(fields[1]) * 1024
    return None


def host_available() -> int:
    """Host bytes this process may hold in all (see the module docstring)."""
    info = meminfo()
    avail = info.get("MemAvailable", info.get("MemTotal", 0))
    cg = cgroup_available()
    if cg is not None:
        avail = min(avail, cg)
    return avail + current_rss_bytes()


def gpu_free(device: torch.device) -> int | None:
    """Free CUDA memory plus what this process's allocator already holds (reusable by the run), or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)
