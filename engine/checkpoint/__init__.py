"""Atomic, verified checkpoints in Megatron's layout: `<dir>/iter_0000100/{state.pt,manifest.json}` plus
`<dir>/latest_checkpointed_iteration.txt` holding the newest complete iteration (`100`, or `release`).

A save writes a hidden temporary folder (the state, then `manifest.json` with every file's size and
sha256, itself sealed by the sha256 of its body), fsyncs it, renames it into place and only then
replaces the tracker file, so a run killed at any point of a save leaves the previous checkpoint
loadable; a failed write removes its temporary folder and says what ran out. A load resolves the
tracker (an integer as Megatron writes it, `release`, or this engine's older `iter_NNNNNNN`), verifies
every byte against the manifest and refuses a checkpoint that does not match, naming the file, the
iteration and the newest intact checkpoint to load instead.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from engine import locks

LATEST = "latest_checkpointed_iteration.txt"
STATE = "state.pt"
MANIFEST = "manifest.json"
FORMAT = "offload-engine checkpoint 1"
_ITER = re.compile(r"iter_(\d{7})(-[0-9a-f]{8})?")  # the suffix: folders of this engine's older re-saves
_CHUNK = 16 << 20


class CheckpointError(Exception):
    """A checkpoint that cannot be written or must not be loaded; the message is one line for users."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """`checkpoint.load` names a path that holds no checkpoint (a config error: exit code 2)."""


def folder_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _iteration_of(folder: Path) -> int | None:
    m = _ITER.fullmatch(folder.name)
    return int(m.group(1)) if m else None


# --- writing ---------------------------------------------------------------------------------------------


class _HashingWriter:
    """The file torch.save writes to: hashes and counts the bytes on their way and keeps the first OSError
    (torch reports a failed write as `RuntimeError: [enforce fail ...] unexpected pos`, without the errno)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.bytes, self.error = f, hashlib.sha256(), 0, None

    def write(self, data: bytes) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha.update(data)
        self.bytes += len(data)
        return n

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_file_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _write_synced(tmp, text.encode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _write_state(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        try:
            torch.save(state, w)
            f.flush()
            os.fsync(f.fileno())
        except RuntimeError:
            if w.error is not None:
                raise w.error from None
            raise
    return {"bytes": w.bytes, "sha256": w.sha.hexdigest()}


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _manifest_text(iteration: int, files: dict[str, dict[str, Any]]) -> str:
    body = {"format": FORMAT, "iteration": iteration, "files": files}
    return _canonical({"body": body, "sha256": _sha(_canonical(body))})


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _format_bytes(n: float) -> str:
    from engine.metrics import format_bytes

    return format_bytes(n)


def _write_error(root: Path, e: OSError, needed: int, writing: Path) -> CheckpointError:
    code = errno.errorcode.get(e.errno, "?") if e.errno else "?"
    try:
        free = f", {_format_bytes(shutil.disk_usage(root).free)} free there"
    except OSError:
        free = ""
    where = e.filename or writing
    return CheckpointError(
        f"checkpoint.save={str(root)!r}: writing {where} failed with errno {e.errno} ({code}: {e.strerror}); "
        f"the checkpoint needs about {_format_bytes(needed)}{free}; the previous checkpoint is intact and the "
        "partial one was removed; free space or set checkpoint.save to another disk"
    )


def _remove_leftovers(root: Path) -> None:
    """Temporary folders of saves that were killed (the lock is held: no save of another run is under way)."""
    for p in root.iterdir():
        if p.name.startswith(".tmp-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(".replaced-") and p.is_dir() and (root / p.name[10:-9]).is_dir():
            shutil.rmtree(p, ignore_errors=True)  # its replacement landed


def _install(root: Path, tmp: Path, name: str) -> Path:
    final = root / name
    old = None
    if final.exists():  # the same iteration again: `resolve` finds the old one if we stop between the renames
        old = root / f".replaced-{name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _prune(root: Path, keep_last: int, saved: int) -> None:
    """Keeps the newest `keep_last` checkpoints up to the one just saved (newer ones, from a run this one
    branched off, are not this run's to delete)."""
    ours = sorted(
        ((it, p) for p in root.iterdir() if (it := _iteration_of(p)) is not None and it <= saved and p.is_dir()),
        key=lambda x: x[0],
    )
    for _, p in ours[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)


def save(directory: str | os.PathLike, iteration: int, state: dict[str, Any], keep_last: int | None = None) -> Path:
    """Writes `state` (anything torch.save takes) as the checkpoint of `iteration`; returns its folder.

    Raises CheckpointError with one line (path, errno, bytes needed) when a write fails, after removing
    the partial folder; the previous checkpoint and the tracker are untouched then.
    """
    root = Path(directory)
    needed = _tensor_bytes(state) + (1 << 16)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(root, e, needed, root) from None
    with locks.holding(root, "checkpoint.save", directory=True):
        _remove_leftovers(root)
        name = folder_name(iteration)
        tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        writing = tmp
        try:
            tmp.mkdir()
            writing = tmp / STATE
            files = {STATE: _write_state(writing, state)}
            writing = tmp / MANIFEST
            _write_synced(writing, _manifest_text(iteration, files).encode())  # last: marks the folder complete
            _fsync_dir(tmp)
            writing = root / name
            final = _install(root, tmp, name)
            writing = root / LATEST
            _write_file_atomic(writing, str(iteration))  # Megatron's tracker: the bare integer
        except OSError as e:
            raise _write_error(root, e, needed, writing) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if keep_last:
            _prune(root, keep_last, iteration)
    return final


# --- finding and verifying -------------------------------------------------------------------------------


def _no_checkpoint(path: Path, why: str, key: str) -> NoCheckpointError:
    return NoCheckpointError(
        f"{key}={str(path)!r}: {why}; point it at a folder that checkpoint.save wrote (or one of its iter_* "
        "folders), or set checkpoint.load_if_exists=true to start fresh when there is none"
    )


def _folder_from_tracker(root: Path, text: str) -> Path:
    if text == "release":
        return root / "release"
    if text.isdigit():
        return root / folder_name(int(text))
    if _ITER.fullmatch(text):  # written by this engine before it wrote the integer
        return root / text
    raise CheckpointError(
        f"{root / LATEST} holds {text[:40]!r}; expected an iteration number or 'release' (Megatron's tracker): "
        f"write the iteration to load there, or set checkpoint.load to an iter_* folder"
    )


def _is_checkpoint_folder(p: Path) -> bool:
    return (p / MANIFEST).is_file() or _iteration_of(p) is not None or p.name == "release"


def resolve(path: str | os.PathLike, key: str = "checkpoint.load") -> Path:
    """The checkpoint folder `path` means: itself if it is one (`iter_*`, `release`), else the one its tracker
    names. Raises NoCheckpointError when there is none, CheckpointError when the tracker is unreadable."""
    p = Path(path)
    if not p.exists():
        raise _no_checkpoint(p, "does not exist", key)
    if not p.is_dir():
        raise _no_checkpoint(p, "is a file, not a checkpoint folder", key)
    if _is_checkpoint_folder(p):
        return p
    tracker = p / LATEST
    if not tracker.is_file():
        return_hint = [q.name for q in p.iterdir() if _iteration_of(q) is not None]
        why = f"holds no {LATEST}" + (f" (but {len(return_hint)} iter_* folders)" if return_hint else "")
        raise _no_checkpoint(p, why, key)
    folder = _folder_from_tracker(p, tracker.read_text(errors="replace").strip())
    if folder.is_dir():
        return folder
    replaced = sorted(p.glob(f".replaced-{folder.name}-*"))  # a re-save of the same iteration stopped midway
    if replaced:
        return replaced[-1]
    raise CheckpointError(f"{tracker} names {folder.name}, but {folder} is missing{_older_hint(p, None)}")


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest's body, or None when it is not byte for byte the one a save writes for that body."""
    raw = (folder / MANIFEST).read_bytes()
    try:
        doc = json.loads(raw)
        body = doc["body"]
        sealed = doc["sha256"] == _sha(_canonical(body)) and raw == _canonical(doc).encode()
        files = body["files"]
        well_formed = body["format"] == FORMAT and isinstance(body["iteration"], int) and isinstance(files, dict)
        names_ok = all("/" not in n and n not in ("", ".", "..", MANIFEST) for n in files)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return body if sealed and well_formed and names_ok else None


def _problem(folder: Path) -> tuple[Path, str] | None:
    """(file, what is wrong with it) for the first problem of a checkpoint folder, or None when intact."""
    if not (folder / MANIFEST).is_file():
        return folder, f"has no {MANIFEST} (a save that did not finish, or not a checkpoint of offload-engine)"
    body = _manifest(folder)
    if body is None:
        return folder / MANIFEST, "does not match its own sha256 (the manifest itself is corrupted)"
    it = _iteration_of(folder)
    if it is not None and it != body["iteration"]:
        return folder / MANIFEST, f"is for iteration {body['iteration']}, not {it}"
    for name, want in sorted(body["files"].items()):
        f = folder / name
        if not f.is_file():
            return f, "is missing"
        size = f.stat().st_size
        if size < want["bytes"]:
            return f, f"is truncated ({size} of {want['bytes']} bytes)"
        if size != want["bytes"]:
            return f, f"has {size} bytes, its manifest says {want['bytes']}"
        if _file_sha(f) != want["sha256"]:
            return f, "has changed since it was saved (its sha256 differs from the manifest)"
    return None


def _older_hint(root: Path, below: int | None) -> str:
    """'; the newest intact checkpoint is ...: set checkpoint.load=...', or that there is none."""
    older = sorted(
        ((it, p) for p in root.iterdir() if (it := _iteration_of(p)) is not None and (below is None or it < below)),
        key=lambda x: -x[0],
    )
    for it, p in older:
        if p.is_dir() and _problem(p) is None:
            return f"; the newest intact checkpoint there is iteration {it}: set checkpoint.load={str(p)!r}"
    return f"; no intact older checkpoint in {root}"


def verify(folder: Path) -> int:
    """The iteration of an intact checkpoint folder; CheckpointError naming the file and iteration otherwise."""
    found = _problem(folder)
    if found is None:
        return int(_manifest(folder)["iteration"])
    path, why = found
    it = _iteration_of(folder)
    label = f"iteration {it}" if it is not None else folder.name
    root = folder.parent
    raise CheckpointError(f"checkpoint {path} ({label}) {why}; refusing to load it{_older_hint(root, it)}")


def _readable(e: Exception) -> str:
    """torch.load's error without its advice to unpickle arbitrary code (weights_only=False)."""
    if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e):
        return "it holds objects other than tensors and plain containers"
    if isinstance(e, EOFError):
        return "file truncated"
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load(directory: str | os.PathLike, key: str = "checkpoint.load") -> dict[str, Any]:
    """The verified state of the checkpoint `directory` means (see `resolve`)."""
    folder = resolve(directory, key)
    iteration = verify(folder)
    try:
        return torch.load(folder / STATE, map_location="cpu", weights_only=True)
    except Exception as e:
        message = f"checkpoint {folder / STATE} (iteration {iteration}): cannot load it: {_readable(e)}"
        raise CheckpointError(message) from e


def latest_folder(directory: str | os.PathLike) -> Path | None:
    """The checkpoint folder `directory` means, or None when it holds none (see `resolve`)."""
    try:
        return resolve(directory)
    except NoCheckpointError:
        return None


def state_mismatch(expected: dict[str, Any], saved: dict[str, Any], limit: int = 3) -> str | None:
    """What differs between a module's state_dict and a saved one (missing and unexpected keys, shapes),
    in one line naming up to `limit` of each; None when every key and shape agrees."""

    def some(names: list[str]) -> str:
        return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")

    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k} (checkpoint {list(saved[k].shape)}, model {list(v.shape)})"
        for k, v in expected.items()
        if k in saved and isinstance(v, torch.Tensor) and isinstance(saved[k], torch.Tensor)
        and saved[k].shape != v.shape
    ]  # fmt: skip
    parts = [
        f"{len(shapes)} shapes differ: {some(shapes)}" if shapes else "",
        f"missing from the checkpoint: {some(missing)}" if missing else "",
        f"not in the model: {some(unexpected)}" if unexpected else "",
    ]
    return "; ".join(p for p in parts if p) or None
