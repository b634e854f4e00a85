"""The data iterator's position in a checkpoint, across data-parallel sizes: saved with the size it was drawn
at, rescaled for the size that resumes it."""

from __future__ import annotations

from engine.dist.group import world_size


def data_state(state: dict | None) -> dict | None:
    """The data iterator's state with the data-parallel size it was saved at."""
    return None if state is None else {**state, "data_parallel_size": world_size()}


def rescale_data_state(state: dict, new_world_size: int | None = None) -> dict:
    """A data state saved with N ranks, for M ranks: each rank has drawn index micro-batches, so the global count
    index * N is the same stream position, of which each of M ranks has drawn index * N / M."""
    m = new_world_size or world_size()
    n = int(state.get("data_parallel_size", 1))
    consumed = int(state["index"]) * n
    if consumed % m:
        raise ValueError(f"checkpoint: {consumed} micro-batches drawn over {n} ranks do not split evenly over {m} "
                         "ranks; keep train.micro_batch_size and choose a data-parallel size dividing "
                         "global_batch_size / micro_batch_size")  # fmt: skip
    return {k: v for k, v in state.items() if k != "data_parallel_size"} | {"index": consumed // m}
