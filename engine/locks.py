"""One run per directory: advisory `fcntl.flock` locks on a checkpoint folder and a metrics file.

A lock is a hidden file beside what it guards (`<dir>/.lock`, `<dir>/.<metrics name>.lock`) holding the
holder's PID, so a second run fails at once with a message naming it. The kernel drops a flock when its
holder exits, however it exits (SIGKILL included), so a stale lock file never blocks a later run.
flock locks belong to an open file, and a second `open` in the same process would conflict with the
first, so this process's own locks are kept in a registry and taken again for free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


class LockedError(RuntimeError):
    """Another process holds the lock; the message names the key, the path and the holder's PID."""


class LockFileError(OSError):
    """The lock file cannot be made or written (a full disk, no permission); the message names the key and path."""


_HELD: dict[str, tuple[int, int]] = {}  # lock file's real path -> (fd, how many holders in this process)


def lock_path_for(path: str | os.PathLike, *, directory: bool) -> Path:
    """The lock file guarding `path`: `<path>/.lock` for a directory, `<parent>/.<name>.lock` for a file."""
    p = Path(path)
    return p / ".lock" if directory else p.parent / f".{p.name}.lock"


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode(errors="replace").strip()
    return f"PID {text}" if text.isdigit() else "PID unknown"


def acquire(path: str | os.PathLike, key: str, *, directory: bool) -> str:
    """Locks `path` for this process (non-blocking) and returns the lock's id for `release`.

    Raises LockedError naming `key`, `path` and the holder's PID when another process holds it.
    """
    lock = lock_path_for(path, directory=directory)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        real = os.path.realpath(lock)
        if real in _HELD:
            fd, n = _HELD[real]
            _HELD[real] = (fd, n + 1)
            return real
        fd = os.open(real, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _unwritable(key, path, lock, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise LockedError(
            f"{key}={str(path)!r} is in use by another run ({holder}); wait for it to finish, or set a different {key}"
        ) from None
    except OSError as e:
        os.close(fd)
        raise _unwritable(key, path, lock, e) from None
    except BaseException:
        os.close(fd)
        raise
    _HELD[real] = (fd, 1)
    return real


def _unwritable(key: str, path: str | os.PathLike, lock: Path, e: OSError) -> LockFileError:
    return LockFileError(
        f"{key}={str(path)!r}: cannot write its lock file {str(lock)!r} ({e.strerror or e}); free space "
        f"there or set a different {key}"
    )  # fmt: skip


def release(lock_id: str) -> None:
    """Drops one hold of `lock_id`; the lock goes when the last holder in this process releases it."""
    fd, n = _HELD[lock_id]
    if n > 1:
        _HELD[lock_id] = (fd, n - 1)
        return
    del _HELD[lock_id]
    os.close(fd)  # closing the only descriptor drops the flock; the file stays (deleting it would race)


@contextlib.contextmanager
def holding(path: str | os.PathLike, key: str, *, directory: bool) -> Iterator[None]:
    """`acquire` for the duration of a `with` block."""
    lock_id = acquire(path, key, directory=directory)
    try:
        yield
    finally:
        release(lock_id)
