"""Per-iteration metrics: the JSONL file (a header record per run, then one record per iteration; strict
JSON), the same scalars for TensorBoard, the progress bar's numbers and the end-of-run summary."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


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


def run_header(config: dict[str, Any], resumed_from: dict[str, Any] | None,
               plan: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The record a run appends first, so runs in one file can be told apart: a fresh id, the start time, the
    config and its digest, the checkpoint it resumed from (None for a fresh start) and, when the memory plan ran,
    the mix it chose and its predicted step (engine.planning's Plan.choice)."""
    return {
        "record": "run",
        "run_id": uuid.uuid4().hex[:12],
        "start_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "resumed_from": resumed_from,
        "config": config,
        **({} if plan is None else {"plan": plan}),
    }


class MetricsFileError(ValueError):
    """A metrics file line that is not a record; the message names the file and the line."""


def _records(path: str | Path, warn: Callable[[str], None] | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each line; a cut-short last line (a crash or a full disk) is left out with a
    warning, any other line that is not a JSON object is an error naming the file and the line."""
    text = Path(path).read_text(errors="replace")
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not text.endswith("\n"):
                if warn:
                    warn(f"{path}:{number}: the last line is cut short (a crash or a full disk?); left out")
                return
            raise MetricsFileError(f"{path}:{number}: not a JSON line ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict) or not ("record" in rec or isinstance(rec.get("iteration"), int)):
            raise MetricsFileError(f"{path}:{number}: not a metrics record (a run header or an iteration record)")
        yield number, rec


def read_runs(path: str | Path, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """A metrics file as its runs: [{"header": run header or None, "records": [iteration records]}].

    Raises MetricsFileError naming the file and the line of a line that is not a record."""
    runs: list[dict[str, Any]] = []
    for _, rec in _records(path, warn):
        if rec.get("record") == "run":
            runs.append({"header": rec, "records": []})
        else:
            if not runs:  # written before runs had headers
                runs.append({"header": None, "records": []})
            runs[-1]["records"].append(rec)
    return runs


class MetricsWriteError(OSError):
    """The metrics file cannot be written (a full disk, no permission); the message names the key and the path."""


class MetricsLog:
    """Appends one JSON object per record to `path` (None: keeps them in memory only), after the run's
    header record; with `tensorboard_dir`, the same scalars as TensorBoard events (torch.utils.tensorboard)."""

    def __init__(
        self, path: str | None, header: dict[str, Any] | None = None, tensorboard_dir: str | None = None
    ) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._file: Any = None
        self._tb: Any = None
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._file = open(path, "ab", buffering=0)  # whole lines through os.write: a failed one is undone
            except OSError as e:
                raise self._unwritable(e) from None
            if header is not None:
                self._write_line(header)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # the tensorboard extra; the config rule checked it

            self._tb = SummaryWriter(tensorboard_dir)
            if header is not None:
                self._tb.add_text("run", json.dumps(strict(header), indent=1))

    def _unwritable(self, e: OSError) -> MetricsWriteError:
        return MetricsWriteError(
            f"logging.metrics_file={self.path!r}: cannot write it ({e.strerror or e}); free space there "
            "or set logging.metrics_file to another place (null: no file)"
        )  # fmt: skip

    def _write_line(self, record: dict[str, Any]) -> None:
        """One whole line, or nothing: a write cut short (a full disk) is truncated away before the error."""
        data = (json.dumps(strict(record), allow_nan=False) + "\n").encode()
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise self._unwritable(e) from None

    def write(self, record: dict[str, Any]) -> None:
        record = strict(record)
        self.records.append(record)
        if self._file:
            self._write_line(record)
        if self._tb is not None:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):  # None (non-finite) is left out
                    self._tb.add_scalar(key, float(value), record["iteration"])
            self._tb.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()

    def summary(self) -> str:
        """Loss first to last, skipped steps, median throughput and iteration time, peaks."""
        r = self.records
        if not r:
            return "no iterations run"
        first, last = r[0]["loss"], r[-1]["loss"]
        change = f" ({100.0 * (last - first) / first:+.1f}%)" if first and last is not None else ""
        skipped = r[-1].get("skipped_steps", 0)
        activations = max(x.get("activation_offload_bytes", 0) for x in r)
        return (
            f"iterations {r[0]['iteration']}..{r[-1]['iteration']}: loss {_loss(first)} -> {_loss(last)}{change}, "
            + (f"{skipped} steps skipped (non-finite loss or gradient norm), " if skipped else "")
            + f"median {statistics.median(x['iteration_ms'] for x in r):.1f} ms/iter, "
            f"{statistics.median(x['tokens_per_s'] for x in r):,.0f} tokens/s, "
            f"peak memory {format_bytes(max(x['peak_memory_bytes'] for x in r))}, "
            f"host offload {format_bytes(max(x['host_offload_bytes'] for x in r))}"
            + (
                f" (activations {format_bytes(activations)} at the end of forward, not held on the device then)"
                if activations
                else ""
            )  # fmt: skip
            + (
                f", peak host RSS {format_bytes(r[-1]['peak_host_rss_bytes'])}"
                if "peak_host_rss_bytes" in r[-1]
                else ""
            )  # fmt: skip
            + (f", metrics in {self.path}" if self.path else "")
        )
