"""The plan of configs/13b-h200.json, pinned: `bin/train configs/13b-h200.json --plan [--json]` must print the
checked-in text byte for byte, so a refactoring of the planner cannot move a figure unnoticed.

A deliberate change of the planner's arithmetic (or of the recipe) regenerates both files:
    bin/train configs/13b-h200.json --plan --gpu-memory 139.2 --host-memory 125 > tests/expected/plan-13b-h200.txt
    bin/train configs/13b-h200.json --plan --json --gpu-memory 139.2 --host-memory 125 \
        > tests/expected/plan-13b-h200.json
and the commit says why the figures moved.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ROOT / "tests" / "expected"


@pytest.mark.parametrize(("flags", "expected"), [((), "plan-13b-h200.txt"), (("--json",), "plan-13b-h200.json")])
def test_13b_plan_is_byte_identical(flags, expected):
    cmd = [sys.executable, str(ROOT / "bin" / "train"), "configs/13b-h200.json", "--plan", *flags,
           "--gpu-memory", "139.2", "--host-memory", "125"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=300, check=True)
    assert out.stdout == (EXPECTED / expected).read_bytes(), out.stdout.decode()
