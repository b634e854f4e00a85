"""Per-iteration metrics: the JSONL file, the progress bar's numbers and the end-of-run summary."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import IO, Any


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def strict(value: Any) -> Any:
    """`value` with every non-finite float as None, so the JSON is strict (`null`, never `NaN`/`Infinity`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def _loss(x: float | None) -> str:
    return "non-finite" if x is None or not math.isfinite(x) else f"{x:.4f}"


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
        record = strict(record)
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()

    def summary(self) -> str:
        """Loss first to last, skipped steps, median throughput and iteration time, peaks."""
        r = self.records
        if not r:
            return "no iterations run"
        first, last = r[0]["loss"], r[-1]["loss"]
        change = f" ({100.0 * (last - first) / first:+.1f}%)" if first and last is not None else ""
        skipped = r[-1].get("skipped_steps", 0)
        return (
            f"iterations {r[0]['iteration']}..{r[-1]['iteration']}: loss {_loss(first)} -> {_loss(last)}{change}, "
            + (f"{skipped} steps skipped (non-finite loss or gradient norm), " if skipped else "")
            + f"median {statistics.median(x['iteration_ms'] for x in r):.1f} ms/iter, "
            f"{statistics.median(x['tokens_per_s'] for x in r):,.0f} tokens/s, "
            f"peak memory {format_bytes(max(x['peak_memory_bytes'] for x in r))}, "
            f"host offload {format_bytes(max(x['host_offload_bytes'] for x in r))}"
            + (f", peak host RSS {format_bytes(r[-1]['peak_host_rss_bytes'])}" if "peak_host_rss_bytes" in r[-1] else "")
            + (f", metrics in {self.path}" if self.path else "")
        )
