"""Atomic checkpoints in Megatron's layout: `<dir>/iter_0000100/state.pt` plus
`<dir>/latest_checkpointed_iteration.txt` naming the newest complete one.

A save writes a hidden temporary directory, fsyncs it, renames it into place and only then
replaces the `latest` file (itself written to a temporary file and `os.replace`d), so a run
killed at any point of a save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

LATEST = "latest_checkpointed_iteration.txt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save(directory: str | os.PathLike, iteration: int, state: dict[str, Any]) -> Path:
    """Writes `state` (anything torch.save takes) as the checkpoint of `iteration`; returns its folder."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"iter_{iteration:07d}"
    if (root / name).exists():
        # never touch the folder `latest` may still name: save beside it, then drop it
        name = f"{name}-{uuid.uuid4().hex[:8]}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / name
    os.rename(tmp, final)
    _fsync_dir(root)
    previous = latest_folder(root)
    _write_file_atomic(root / LATEST, name + "\n")
    if previous is not None and previous.name.startswith(f"iter_{iteration:07d}") and previous != final:
        shutil.rmtree(previous, ignore_errors=True)
    return final


def latest_folder(directory: str | os.PathLike) -> Path | None:
    """The folder `latest_checkpointed_iteration.txt` names, or None when there is no checkpoint."""
    root = Path(directory)
    marker = root / LATEST
    if not marker.is_file():
        return None
    return root / marker.read_text().strip()


def load(directory: str | os.PathLike) -> dict[str, Any]:
    """The state of the newest complete checkpoint under `directory`."""
    folder = latest_folder(directory)
    if folder is None:
        raise FileNotFoundError(f"checkpoint.load={str(directory)!r}: no {LATEST} there; point it at a save folder")
    return torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
