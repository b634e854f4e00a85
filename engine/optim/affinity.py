"""Binding the CPU step's threads to cores (Linux): worker threads on physical cores of one NUMA node,
apart from the core the driver thread (which issues the copies and waits on them) runs on.

Why: the CPU step is bound by host memory bandwidth and shares the host with the thread that feeds the
GPU; a worker the scheduler moves onto the driver's core delays the copies the next forward waits for, and
a worker on another NUMA node reads the host buffers across the socket interconnect. The host buffers are
first touched by the main thread, so their pages sit on its node; the binding picks the GPU's node (its
PCI device's `numa_node`), else the node with the most usable physical cores.

The topology comes from sysfs (`/sys/devices/system/{cpu,node}`): py-cpuinfo reports the processor's
model and flags, not which logical CPUs share a core or a node. Only CPUs this process may run on
(`os.sched_getaffinity`) are used. On Linux `os.sched_setaffinity(0, cpus)` binds the calling thread only,
so each pool thread binds itself from the executor's `initializer`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys/devices/system")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Core:
    """One physical core: its NUMA node and the logical CPUs (hyperthreads) of it this process may use."""

    node: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Binding:
    """Where each thread of the CPU step runs: the driver on one core, worker i on workers[i % len(workers)]."""

    node: int
    nodes: int  # NUMA nodes with usable cores
    driver: Core
    workers: tuple[Core, ...]

    def describe(self) -> str:
        cores = f"{len(self.workers)} physical core{'s' if len(self.workers) > 1 else ''}"
        cpus = _ranges(c for w in self.workers for c in w.cpus)
        return (f"driver/copy thread on CPU {_ranges(self.driver.cpus)}; worker threads on {cores}, CPUs {cpus} "
                f"(NUMA node {self.node} of {self.nodes})")  # fmt: skip


def _ranges(cpus) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for _, grp in itertools.groupby(enumerate(sorted(set(cpus))), lambda ic: ic[1] - ic[0]):
        ids = [c for _, c in grp]
        out.append(str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}")
    return ",".join(out)


def _parse_list(text: str) -> set[int]:
    """sysfs CPU lists: '0-3,8,10-11'."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def physical_cores(allowed: set[int] | None = None, sysfs: Path = SYSFS) -> list[Core]:
    """The physical cores with at least one usable CPU, in (node, first CPU) order; [] where sysfs says nothing."""
    if allowed is None:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    node_of: dict[int, int] = {}
    for d in sorted(sysfs.glob("node/node[0-9]*")):
        for c in _parse_list(_read(d / "cpulist") or ""):
            node_of[c] = int(d.name[4:])
    cores: dict[tuple[int, int], list[int]] = {}
    for c in sorted(allowed):
        topo = sysfs / "cpu" / f"cpu{c}" / "topology"
        core_id, package = _read(topo / "core_id"), _read(topo / "physical_package_id")
        if core_id is None or package is None:
            return []
        cores.setdefault((int(package), int(core_id)), []).append(c)
    found = [Core(node_of.get(cpus[0], 0), tuple(cpus)) for cpus in cores.values()]
    return sorted(found, key=lambda k: (k.node, k.cpus[0]))


def gpu_numa_node(device: int = 0) -> int | None:
    """The NUMA node of CUDA device `device`'s PCI slot, or None where unknown."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(device)
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        node = int((_read(Path("/sys/bus/pci/devices") / bus / "numa_node") or "-1").strip())
    except (AttributeError, RuntimeError, ValueError):
        return None
    return node if node >= 0 else None


def plan_binding(gpu_node: int | None = None, allowed: set[int] | None = None, sysfs: Path = SYSFS) -> Binding | None:
    """The binding on this machine, or None where fewer than two physical cores are usable (or no topology)."""
    cores = physical_cores(allowed, sysfs)
    by_node: dict[int, list[Core]] = {}
    for k in cores:
        by_node.setdefault(k.node, []).append(k)
    if not by_node:
        return None
    node = gpu_node if len(by_node.get(gpu_node, [])) >= 2 else max(by_node, key=lambda n: (len(by_node[n]), -n))
    local = by_node[node]
    if len(local) < 2:
        return None
    return Binding(node=node, nodes=len(by_node), driver=local[0], workers=tuple(local[1:]))


def pin_current_thread(cpus: tuple[int, ...]) -> None:
    """Bind the calling thread (not the process: Linux applies pid 0 to the caller) to `cpus`."""
    os.sched_setaffinity(0, cpus)


def worker_initializer(binding: Binding | None) -> Callable[[], None] | None:
    """A ThreadPoolExecutor initializer: each new worker thread binds itself to the next worker core."""
    if binding is None:
        return None
    counter, lock = itertools.count(), threading.Lock()

    def init() -> None:
        with lock:
            i = next(counter)
        pin_current_thread(binding.workers[i % len(binding.workers)].cpus)

    return init


def driver_initializer(binding: Binding | None) -> Callable[[], None] | None:
    """A ThreadPoolExecutor initializer for the driver thread: its own core, apart from the workers."""
    if binding is None:
        return None
    return lambda: pin_current_thread(binding.driver.cpus)


def initializers(enabled: bool) -> tuple[Callable[[], None] | None, Callable[[], None] | None]:
    """(worker, driver) initializers for the CPU step's thread pools; (None, None) when off or nothing to bind."""
    binding = plan_binding(gpu_numa_node()) if enabled and hasattr(os, "sched_setaffinity") else None
    if enabled:
        log.info("optimizer.cpu_optimizer_pin_threads: %s", binding.describe() if binding else "nothing to bind")
    return worker_initializer(binding), driver_initializer(binding)


def report() -> str:
    """For `bin/train --env`: the binding optimizer.cpu_optimizer_pin_threads=true gives on this machine."""
    if not hasattr(os, "sched_setaffinity"):
        return "unavailable (needs Linux's sched_setaffinity)"
    b = plan_binding(gpu_numa_node())
    if b is None:
        return "nothing to bind: fewer than two usable physical cores"
    return f"with optimizer.cpu_optimizer_pin_threads=true: {b.describe()}"
