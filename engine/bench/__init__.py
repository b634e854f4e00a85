"""Benchmarks behind `bin/bench <name>`: each module has `main(argv) -> int` and prints its table and command."""
