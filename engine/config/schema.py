"""The config schema (schemas/engine.schema.json, the one source of keys, types, defaults and docs) and how a
value is shown in a message. Imported by the loader (__init__.py), the rules (rules.py) and the docs
(config_doc.py); it imports none of them.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator

from engine.config import strict_json
from engine.resources import data_path

SCHEMA_PATH = data_path("schemas", "engine.schema.json")  # inside the wheel, or schemas/ in a checkout


@functools.cache
def load_schema() -> dict[str, Any]:
    """The parsed schema, loaded once (callers must not mutate it)."""
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return schema


def section_properties() -> dict[str, dict[str, dict[str, Any]]]:
    """{section: {key: property schema}} in schema order."""
    return {name: spec["properties"] for name, spec in load_schema()["properties"].items()}


def default(dotted: str) -> Any:
    """The schema's default of `section.key`."""
    section, key = dotted.split(".")
    return copy.deepcopy(section_properties()[section][key]["default"])


def typed(value: Any, prop: dict[str, Any]) -> Any:
    """Schema value -> dataclass value: arrays become tuples, JSON 1 is 1.0 for numbers and 2.0 is 2 for integers."""
    types = prop.get("type", [])
    types = [types] if isinstance(types, str) else types
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, int) and not isinstance(value, bool) and "number" in types:
        return float(value)
    if isinstance(value, float) and "integer" in types:
        return int(value)
    return value


def plain(value: Any) -> Any:
    """A deep copy with Mappings as dicts and tuples as lists, the shapes jsonschema and JSON expect."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return copy.deepcopy(value)


def show(value: Any) -> str:
    """`value` as JSON for a message, shortened when long (a message shows the value, not a megabyte of it)."""
    try:
        text = json.dumps(plain(value))
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return strict_json.shorten(text, 80)
