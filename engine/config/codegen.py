"""Generate engine/config/sections.py, the config's typed dataclasses, from schemas/engine.schema.json.

The schema stays the one source of keys, types, defaults and docs; the generated module is checked in so that
editors and type checkers see every field (``cfg.optimizer.lr: float``). ``python -m engine.config.codegen``
prints the module, ``--write`` rewrites engine/config/sections.py and ``--check`` exits 1 when it is stale
(tests/test_config.py fails the same way). The text is emitted already in ruff's format.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from engine.config.schema import load_schema, typed

SECTIONS_PATH = Path(__file__).resolve().parent / "sections.py"
COMMAND = "python -m engine.config.codegen --write"
LINE_LENGTH = 120  # pyproject.toml's [tool.ruff] line-length
_SCALARS = {"integer": "int", "number": "float", "boolean": "bool", "string": "str", "null": "None"}
_ONE_WORD = re.compile(r"\^(\w+)\$")  # a pattern admitting one word: the string is that literal ("auto")

HEADER = f'''"""The config's sections as typed frozen dataclasses, generated from schemas/engine.schema.json.

Do not edit: after a schema change run `{COMMAND}` (tests/test_config.py fails while
this file differs from what the schema gives). engine.config fills, validates and builds these; the full key
reference is `python -m engine.config.doc`.
"""

from dataclasses import dataclass, field, fields
from typing import Any, Literal
'''

FOOTER = '''

def _json_values(section: Any) -> dict[str, Any]:
    """A section's keys as plain JSON values (tuples become lists)."""
    values = {key.name: getattr(section, key.name) for key in fields(section)}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}
'''


def class_name(section: str) -> str:
    return f"{section.capitalize()}Config"


def _literal(value: Any) -> str:
    """Python source of a JSON scalar, a list (as a tuple) or None."""
    if isinstance(value, (list, tuple)):
        items = [_literal(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)  # None, True/False, int, float (repr round-trips)


def annotation(prop: dict[str, Any]) -> str:
    """The Python type of a schema property: Literal[...] for an enum or a one-word pattern, tuple[item, ...]
    for an array, `| None` where null is allowed."""
    if "enum" in prop:
        values = [_literal(v) for v in prop["enum"] if v is not None]
        return f"Literal[{', '.join(values)}]" + (" | None" if None in prop["enum"] else "")
    names = [prop["type"]] if isinstance(prop["type"], str) else prop["type"]
    word = _ONE_WORD.fullmatch(prop.get("pattern", ""))
    atoms = []
    for name in names:
        if name == "array":
            atoms.append(f"tuple[{_SCALARS[prop['items']['type']]}, ...]")
        elif name == "string" and word:
            atoms.append(f'Literal["{word.group(1)}"]')
        else:
            atoms.append(_SCALARS[name])
    return " | ".join(atoms)


def _doc_line(description: str, indent: int) -> str:
    """The description as a one-line docstring within the line length: whole, else its first sentence, else cut
    at a word with an ellipsis."""
    room = LINE_LENGTH - indent - 6
    text = " ".join(description.split()).replace("\\", "\\\\").replace('"', '\\"')
    if len(text) > room:
        first = re.split(r"(?<=[a-z0-9)\]]{2})\. (?=\S)", text, maxsplit=1)[0].rstrip(".") + "."
        text = first if len(first) <= room else text[: room - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
    return " " * indent + f'"""{text}"""'


def _section_source(section: str, spec: dict[str, Any]) -> list[str]:
    lines = ["", "", "@dataclass(frozen=True)", f"class {class_name(section)}:", _doc_line(spec["description"], 4)]
    for key, prop in spec["properties"].items():
        default = _literal(typed(prop["default"], prop))
        lines += ["", f"    {key}: {annotation(prop)} = {default}", _doc_line(prop["description"], 4)]
    return lines


def _config_source(sections: list[str]) -> list[str]:
    lines = ["", "", "@dataclass(frozen=True)", "class Config:"]
    lines.append('    """The validated run configuration: one frozen section per namespace."""')
    lines.append("")
    lines += [f"    {name}: {class_name(name)} = field(default_factory={class_name(name)})" for name in sections]
    lines += [
        "",
        "    def to_dict(self) -> dict[str, dict[str, Any]]:",
        '        """Every key of every section as plain JSON values (tuples become lists)."""',
        "        return {section.name: _json_values(getattr(self, section.name)) for section in fields(self)}",
    ]
    return lines


def render(schema: dict[str, Any] | None = None) -> str:
    """The text of engine/config/sections.py for `schema` (default: the shipped schema)."""
    sections = (schema or load_schema())["properties"]
    lines = HEADER.splitlines()
    for section, spec in sections.items():
        lines += _section_source(section, spec)
    lines += _config_source(list(sections))
    return "\n".join(lines) + "\n" + FOOTER


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.config.codegen", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"rewrite {SECTIONS_PATH.name} from the schema")
    group.add_argument("--check", action="store_true", help=f"exit 1 when {SECTIONS_PATH.name} is stale")
    args = parser.parse_args(argv)
    text = render()
    if not (args.write or args.check):
        sys.stdout.write(text)
        return 0
    current = SECTIONS_PATH.read_text(encoding="utf-8") if SECTIONS_PATH.is_file() else ""
    if args.check:
        if current != text:
            print(f"{SECTIONS_PATH}: stale against the schema; run {COMMAND}")
            return 1
        return 0
    if current != text:
        SECTIONS_PATH.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
