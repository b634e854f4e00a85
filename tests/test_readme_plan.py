"""The README's memory-plan figures are the code's: its refusal example is run as written and must print the
README's error line; the 13 B paragraph's fraction and totals are the plan's (tests/test_readme_plan.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from engine.cli import train_main

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
SECTION = README.split("## Memory plan", 1)[1].split("\n## ", 1)[0]


def test_the_refusal_example_prints_the_readme_line(capsys):
    block = SECTION.split("```\n", 2)[1]
    command, _, printed = block.partition("\nerror: ")
    args = shlex.split(command.replace("\\\n", " "))
    assert args[:2] == ["$", "bin/train"] and "--plan" in args
    assert train_main(args[2:]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: " + printed.strip()]


def test_the_13b_paragraph_states_the_plans_figures(capsys):
    assert train_main(["configs/13b-h200.json", "--plan", "--gpu-memory", "139", "--host-memory", "125"]) == 0
    out = capsys.readouterr().out
    fraction = re.search(r"optimizer_offload_fraction = ([\d.]+) \(auto\)", out).group(1)
    gpu, host = re.findall(r"^  total +([\d.]+) GiB", out, re.M)
    paragraph = SECTION.split("**13 B on one H200**", 1)[1]
    assert f"fits at fraction {fraction} " in paragraph
    assert f"GPU {float(gpu):.1f} GiB of 139" in paragraph and f"host {float(host):.1f} GiB of 125" in paragraph
