"""Training data: the embedded default corpus (the Python standard library's own sources as bytes),
a user's text file, or a binary token file; served as deterministic random windows.

Every micro-batch is a pure function of (seed, global micro-batch index, rank), so a resumed run
sees exactly the batches the uninterrupted run saw: the iterator's whole state is one integer.
"""

from __future__ import annotations

import os
import stat
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

_TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "int32": np.int32}


def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """The standard library's .py files, in sorted path order, concatenated up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            data = (Path(dirpath) / name).read_bytes()[: max_bytes - total]
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if total == 0:
        raise FileNotFoundError(
            f"data.source='stdlib': no .py files under {root}; use data.source='text' with data.path"
        )
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def _token_file(path: str, token_dtype: str) -> np.ndarray:
    size, width = os.path.getsize(path), np.dtype(_TOKEN_DTYPES[token_dtype]).itemsize
    if size == 0:
        raise ValueError(f"data.path={path!r} is empty; give a file of {token_dtype} token ids")
    if size % width:
        raise ValueError(
            f"data.path={path!r}: {size} bytes is not a whole number of {token_dtype} tokens ({width} bytes each); "
            "set data.token_dtype to the file's element type"
        )
    return np.memmap(path, dtype=_TOKEN_DTYPES[token_dtype], mode="r")


def _check_regular_file(path: str | None, wanted: str) -> None:
    """data.path must be a regular file: a FIFO or a device (/dev/zero) has no size to window into."""
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"data.path={path!r}: no such file; give {wanted}")
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device",
                 stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}  # fmt: skip
        what = next((name for test, name in kinds.items() if test(mode)), "not a regular file")
        raise ValueError(f"data.path={path!r} is {what}, not a regular file; give {wanted}")


def load_tokens(source: str, path: str | None, token_dtype: str, max_bytes: int, vocab_size: int) -> np.ndarray:
    """The whole token stream as a 1-D array (memory-mapped for token files). Errors name the key, the file
    and the offending value."""
    if source == "stdlib":
        tokens = stdlib_bytes(max_bytes)
    elif source == "text":
        _check_regular_file(path, "a UTF-8 text file for data.source='text'")
        tokens = np.fromfile(path, dtype=np.uint8)
        if len(tokens) == 0:
            raise ValueError(f"data.path={path!r} is empty; give a UTF-8 text file for data.source='text'")
    else:
        _check_regular_file(path, "a binary token file for data.source='tokens'")
        tokens = _token_file(path, token_dtype)
    where = f"data.path={path!r}" if path else f"data.source={source!r}"
    low, top = int(tokens.min()), int(tokens.max())
    if low < 0:
        raise ValueError(f"{where}: token id {low} is negative; check data.token_dtype ({token_dtype!r})")
    if top >= vocab_size:
        raise ValueError(
            f"{where}: token id {top} >= model.vocab_size={vocab_size}; set model.vocab_size > {top}"
            + (f" or check data.token_dtype ({token_dtype!r})" if source == "tokens" else "")
        )
    return tokens


class TokenBatches(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """Yields (inputs, labels), each [micro_batch_size, seq_length] int64: random windows of the stream.

    Micro-batch i of rank r is drawn from a generator seeded by (seed, i * world_size + r), so the
    data-parallel ranks read disjoint shards of each global batch and `state_dict` is one counter.
    """

    def __init__(
        self, tokens: np.ndarray, seq_length: int, micro_batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        if len(tokens) < seq_length + 2:
            raise ValueError(
                f"data: {len(tokens)} tokens are too few for model.seq_length={seq_length}; "
                "use more data or a shorter sequence"
            )
        self.tokens = tokens
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.index = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = np.random.default_rng([self.seed, self.index * self.world_size + self.rank])
        self.index += 1
        starts = g.integers(0, len(self.tokens) - self.seq_length - 1, size=self.micro_batch_size)
        windows = np.stack([np.asarray(self.tokens[s : s + self.seq_length + 1], dtype=np.int64) for s in starts])
        window = torch.from_numpy(windows)
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])
