"""Render the config reference (a Markdown table) from schemas/engine.schema.json.

``python -m engine.config.doc`` prints it; ``--write README.md`` replaces the text between the
config-reference markers in a file, and ``--check README.md`` exits 1 when that text is stale, so the README
can never drift from the schema.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.config.schema import load_schema

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def _type(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        names = {"string" if isinstance(v, str) else "null" for v in prop["enum"]}
        return " or ".join(sorted(names, key=lambda n: n == "null"))
    types = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
    word = prop.get("pattern", "")
    if word.startswith("^") and word.endswith("$"):  # a number or one word ("auto")
        types = [f'"{word[1:-1]}"' if t == "string" else t for t in types]
    if "array" in types and "items" in prop:
        types = [f"array of {prop['items']['type']}" if t == "array" else t for t in types]
    return " or ".join(types)


def _allowed(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return ", ".join(_code(v) for v in prop["enum"])
    low, high = prop.get("minimum"), prop.get("maximum")
    if low is not None and high is not None:
        return f"[{low}, {high}]"
    ops = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
    return ", ".join(f"{op} {prop[k]}" for k, op in ops.items() if k in prop)


def render_markdown() -> str:
    """One row per key: section, key, type, default, range or values, description."""
    rows = ["| section | key | type | default | range / values | description |", "|---|---|---|---|---|---|"]
    for section, spec in load_schema()["properties"].items():
        for key, prop in spec["properties"].items():
            cells = [section, f"`{key}`", _type(prop), _code(prop["default"]), _allowed(prop), prop["description"]]
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def replace_between_markers(text: str, table: str) -> str:
    """``text`` with everything between START and END replaced by ``table``; ValueError without the markers."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"expected {START} followed by {END}")
    return text[: start + len(START)] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.config.doc", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", type=Path, help="replace the reference between the markers")
    group.add_argument("--check", metavar="FILE", type=Path, help="exit 1 when the reference in FILE is stale")
    args = parser.parse_args(argv)
    table = render_markdown()
    target = args.write or args.check
    if target is None:
        sys.stdout.write(table)
        return 0
    try:
        text = target.read_text(encoding="utf-8")
        updated = replace_between_markers(text, table)
    except (OSError, ValueError) as e:
        print(f"{target}: {e}", file=sys.stderr)
        return 2
    if args.check:
        if updated != text:
            print(f"{target}: config reference is stale; run python -m engine.config.doc --write {target}")
            return 1
        return 0
    if updated != text:
        target.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
