"""Per-iteration metrics: the JSONL file, the progress bar's numbers and the end-of-run summary."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import IO, Any


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class MetricsLog:
    """Appends one JSON object per record to `path` (None: keeps them in memory only)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()

    def summary(self) -> str:
        """Loss first to last, median throughput and iteration time, peaks."""
        r = self.records
        if not r:
            return "no iterations run"
        first, last = r[0]["loss"], r[-1]["loss"]
        change = 100.0 * (last - first) / first if first else 0.0
        return (
            f"iterations {r[0]['iteration']}..{r[-1]['iteration']}: loss {first:.4f} -> {last:.4f} ({change:+.1f}%), "
            f"median {statistics.median(x['iteration_ms'] for x in r):.1f} ms/iter, "
            f"{statistics.median(x['tokens_per_s'] for x in r):,.0f} tokens/s, "
            f"peak memory {format_bytes(max(x['peak_memory_bytes'] for x in r))}, "
            f"host offload {format_bytes(max(x['host_offload_bytes'] for x in r))}"
            + (f", metrics in {self.path}" if self.path else "")
        )
