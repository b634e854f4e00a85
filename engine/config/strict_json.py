"""Strict JSON for configs: a duplicate key is an error naming its dotted path (JSON itself keeps the last
value silently), and size, nesting and string length are bounded, so a malformed file or override gets a
short message (exit code 2) instead of a wrong value, a RecursionError or a 12 MB value echoed back.
"""

from __future__ import annotations

import json
from typing import Any

MAX_TEXT = 1 << 20  # characters of a config file; real ones are a few KiB
MAX_DEPTH = 8  # sections, keys and lists nest 3 deep; room to spare, far from any recursion limit
MAX_STRING = 4096  # characters of one key or string value (paths are the longest real values)


class _Object(dict):
    """A JSON object that remembers the dotted paths of duplicate keys inside it (its own and nested ones)."""

    duplicates: list[str]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj, duplicates = _Object(), []
    for key, value in pairs:
        if key in obj:
            duplicates.append(key)
        obj[key] = value
        inner = [value] if isinstance(value, _Object) else [v for v in value if isinstance(v, _Object)] \
            if isinstance(value, list) else []  # fmt: skip
        duplicates += [f"{shorten(key)}.{d}" for v in inner for d in v.duplicates]
    obj.duplicates = duplicates
    return obj


def shorten(text: str, limit: int = 60) -> str:
    """`text`, or its first `limit` characters and how long it really is."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _bounds(value: Any, where: str) -> list[str]:
    """Problems with nesting depth and string lengths, walking iteratively (the value may be deep)."""
    problems, stack = [], [(value, "", 1)]
    while stack and len(problems) < 3:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return [f"{where}: nested more than {MAX_DEPTH} levels deep (at {shorten(path)}); a config is sections "
                    "of keys with plain values"]  # fmt: skip
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            sub = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else k
            if isinstance(k, str) and len(k) > MAX_STRING:
                problems.append(f"{where}: a key of {len(k):,} characters ({shorten(k)}); keys are short names")
                continue
            if isinstance(v, str) and len(v) > MAX_STRING:
                problems.append(f"{where}: {shorten(sub)} is a string of {len(v):,} characters; at most {MAX_STRING}")
            stack.append((v, sub, depth + 1))
    return problems


MAX_INT_DIGITS = 100  # no key needs more; Python refuses to convert past 4300 with advice meant for programmers


class _TooLong(ValueError):
    def __init__(self, text: str) -> None:
        super().__init__(text[:20])
        self.digits, self.head = len(text.lstrip("-")), text[:12]


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _TooLong(text)
    return int(text)


def loads(text: str, where: str) -> tuple[Any, list[str]]:
    """(value, problems) of a config's JSON `text`; `where` starts each problem (a file or an override).

    Raises json.JSONDecodeError for text that is not JSON, for the caller to place."""
    if len(text) > MAX_TEXT:
        return None, [f"{where}: {len(text):,} characters; a config is at most {MAX_TEXT:,} (is this a config?)"]
    try:
        value = json.loads(text, object_pairs_hook=_object, parse_int=_int)
    except RecursionError:
        return None, [f"{where}: nested too deeply to parse; a config nests at most {MAX_DEPTH} levels"]
    except _TooLong as e:
        return None, [f"{where}: an integer of {e.digits:,} digits ({e.head}...); a config's integers have at most "
                      f"{MAX_INT_DIGITS} digits"]  # fmt: skip
    problems = [
        f"{where}: duplicate key {d}; JSON would keep only its last value: remove the other"
        for d in getattr(value, "duplicates", [])
    ]
    return value, problems + _bounds(value, where)
