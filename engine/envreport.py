"""`bin/train --env`: what a bug report needs about this machine."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from engine.optim import affinity, fused_kernel


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_summary() -> dict[str, object]:
    """CPU model, logical cores and AVX-512 support, read by py-cpuinfo."""
    import cpuinfo  # slow (it probes the CPU), so only when asked

    info = cpuinfo.get_cpu_info()
    flags = set(info.get("flags", []))
    return {
        "model": info.get("brand_raw", "unknown"),
        "logical_cores": info.get("count", os.cpu_count()),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
    }


def env_report() -> str:
    cpu = cpu_summary()
    cuda = torch.cuda.is_available()
    lines = [
        f"offload-engine  {_version('offload-engine')}",
        f"python          {platform.python_version()} ({platform.platform()})",
        f"torch           {torch.__version__} (CUDA build {torch.version.cuda or 'none'})",
        f"CUDA available  {cuda}",
    ]
    if cuda:
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"GPU             {torch.cuda.device_count()} x {props.name}, {props.total_memory / 2**30:.1f} GiB"
        )
    lines += [
        f"CPU             {cpu['model']}",
        f"cores           {cpu['logical_cores']} logical, {cpu['usable_cores']} usable by this process",
        f"AVX-512         {'yes' if cpu['avx512f'] else 'no'} (bf16: {'yes' if cpu['avx512_bf16'] else 'no'})",
        f"CPU binding     {affinity.report()}",
        f"pinned memory   {'available' if cuda else 'unavailable (no CUDA): offload copies use pageable memory'}",
        f"CPU AdamW       {fused_kernel.status()} (torch's fused AdamW where "
        "optimizer.use_torch_optimizer_for_cpu_offload=true)",
        f"megatron-core   {_version('megatron-core')}",
        f"transformer-engine {_version('transformer-engine')}",
    ]
    return "\n".join(lines)
