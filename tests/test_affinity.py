"""Binding the CPU step's threads: the topology read from sysfs, the plan, and real pinning of pool threads."""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.optim import affinity

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Requires: Linux sched_setaffinity")


def fake_sysfs(root: Path, nodes: dict[int, list[tuple[int, int, int]]]) -> Path:
    """nodes: node -> [(cpu, package, core_id)]."""
    for node, cpus in nodes.items():
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(",".join(str(c) for c, _, _ in cpus) + "\n")
        for cpu, package, core in cpus:
            topo = root / "cpu" / f"cpu{cpu}" / "topology"
            topo.mkdir(parents=True)
            (topo / "core_id").write_text(f"{core}\n")
            (topo / "physical_package_id").write_text(f"{package}\n")
    return root


def two_sockets(root: Path) -> Path:
    """2 nodes x 4 cores x 2 hyperthreads: CPUs 0-3 and 8-11 on node 0 (siblings c and c+8), 4-7, 12-15 node 1."""
    n0 = [(c, 0, c) for c in range(4)] + [(c + 8, 0, c) for c in range(4)]
    n1 = [(c, 1, c - 4) for c in range(4, 8)] + [(c + 8, 1, c - 4) for c in range(4, 8)]
    return fake_sysfs(root, {0: n0, 1: n1})


def test_physical_cores_group_hyperthreads_by_node(tmp_path):
    cores = affinity.physical_cores(set(range(16)), two_sockets(tmp_path))
    assert [k.cpus for k in cores] == [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15)]
    assert [k.node for k in cores] == [0] * 4 + [1] * 4


def test_binding_on_the_gpu_node_apart_from_the_driver(tmp_path):
    sysfs = two_sockets(tmp_path)
    b = affinity.plan_binding(gpu_node=1, allowed=set(range(16)), sysfs=sysfs)
    assert b.node == 1 and b.nodes == 2
    assert b.driver.cpus == (4, 12)
    assert [w.cpus for w in b.workers] == [(5, 13), (6, 14), (7, 15)]
    assert (
        "driver/copy thread on CPU 4,12; worker threads on 3 physical cores, CPUs 5-7,13-15 (NUMA node 1 of 2)"
        == b.describe()
    )


def test_binding_without_gpu_node_takes_the_node_with_most_usable_cores(tmp_path):
    sysfs = two_sockets(tmp_path)
    b = affinity.plan_binding(gpu_node=None, allowed={0, 4, 5, 6, 13}, sysfs=sysfs)
    assert b.node == 1 and b.driver.cpus == (4,) and [w.cpus for w in b.workers] == [(5, 13), (6,)]
    # a GPU node with fewer than two usable cores is passed over
    assert affinity.plan_binding(gpu_node=0, allowed={0, 4, 5, 6}, sysfs=sysfs).node == 1


def test_nothing_to_bind_on_one_core_or_without_topology(tmp_path):
    sysfs = two_sockets(tmp_path)
    assert affinity.plan_binding(allowed={0, 8}, sysfs=sysfs) is None  # one physical core, two hyperthreads
    assert affinity.plan_binding(allowed={0, 1}, sysfs=tmp_path / "missing") is None


@linux
def test_pool_threads_pin_themselves_and_the_process_is_untouched():
    allowed = set(os.sched_getaffinity(0))
    b = affinity.plan_binding(allowed=allowed)
    if b is None:
        pytest.skip("Requires: two usable physical cores")
    workers = ThreadPoolExecutor(3, initializer=affinity.worker_initializer(b))
    driver = ThreadPoolExecutor(1, initializer=affinity.driver_initializer(b))
    try:
        seen = {frozenset(f.result()) for f in [workers.submit(os.sched_getaffinity, 0) for _ in range(3)]}
        assert seen <= {frozenset(w.cpus) for w in b.workers} and seen
        assert set(driver.submit(os.sched_getaffinity, 0).result()) == set(b.driver.cpus)
    finally:
        workers.shutdown()
        driver.shutdown()
    assert set(os.sched_getaffinity(0)) == allowed  # the main thread keeps its CPUs


def test_initializers_off_bind_nothing():
    assert affinity.initializers(False) == (None, None)


@linux
def test_the_hybrid_optimizer_pins_its_cpu_threads_when_asked():
    from optim_reference import tiny_gpt

    from engine.optim import HybridDeviceOptimizer, HybridOptions

    b = affinity.plan_binding(affinity.gpu_numa_node())
    if b is None:
        pytest.skip("Requires: two usable physical cores")
    for pin in (True, False):
        opt = HybridDeviceOptimizer(tiny_gpt().named_parameters(), HybridOptions(
                                    lr=1e-3, offload_fraction=0.5, cpu_threads=2,
                                    pin_cpu_threads=pin))  # fmt: skip
        opt.host_bytes()  # builds both sides
        try:
            worker = set(opt.cpu.arith.pool.submit(os.sched_getaffinity, 0).result())
            driver = set(opt.cpu.driver.submit(os.sched_getaffinity, 0).result())
        finally:
            opt.close()
        if pin:
            assert worker <= {c for w in b.workers for c in w.cpus} and driver == set(b.driver.cpus)
        else:
            assert worker == driver == set(os.sched_getaffinity(0))
