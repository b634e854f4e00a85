"""Benchmarks behind `bin/bench <name>`: each module has `main(argv) -> int` and prints its table and command."""


def no_cuda(command: str) -> str | None:
    """The one line a GPU benchmark prints (to stderr, exit 2) before doing anything on a machine without CUDA."""
    import torch

    if torch.cuda.is_available():
        return None
    return f"{command}: torch sees no CUDA device; this benchmark measures a GPU (run it on a machine with one)"
