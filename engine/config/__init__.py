"""Load, override, validate and freeze the engine configuration.

schemas/engine.schema.json is the single source of truth for keys, types, ranges and defaults; the frozen
dataclasses (engine/config/sections.py) are generated from it by ``python -m engine.config.codegen --write`` and
checked in, so editors and type checkers see every field; a test fails while they differ from the schema.
``load_config`` merges a JSON file or dict with Megatron-Bridge style dotted overrides, fills the schema's
defaults, validates with jsonschema, runs the cross-field rules (engine/config/rules.py: the reference's
constraints with its exact messages) and the NOT_BUILT table, and reports every problem at once in one
ConfigError.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jsonschema import Draft202012Validator

from engine.config import strict_json
from engine.config.rules import NOT_BUILT, RULES, WORLD_SIZE_RULES, blocked, rules_for  # noqa: F401
from engine.config.schema import SCHEMA_PATH, load_schema, section_properties  # noqa: F401 - re-exported
from engine.config.schema import plain as _plain
from engine.config.schema import show as _show
from engine.config.schema import typed as _typed
from engine.config.sections import (  # noqa: F401 - re-exported
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
)
from engine.resources import config_file

# --- the typed config: engine/config/sections.py, generated from the schema (python -m engine.config.codegen) --

_SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}


def _sections_match_schema() -> None:
    """The generated classes against the schema (a schema edited without regenerating): one line with the fix
    rather than a TypeError from a dataclass. Checked at each load, not at import, so the command that
    regenerates the module can still import the package."""
    generated = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in _SECTIONS.items()}
    if generated != {name: list(props) for name, props in section_properties().items()}:
        from engine.config import codegen  # only here: `python -m engine.config.codegen` imports this package

        raise RuntimeError(f"engine/config/sections.py is stale against {SCHEMA_PATH}; run {codegen.COMMAND}")


class ConfigError(ValueError):
    """Every problem of one configuration; ``str()`` is one line per problem."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


@functools.cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema())


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config,
    overrides: Sequence[str] = (),
    *,
    data_parallel_size: int | None = None,
    model_in_hand: bool = False,
) -> Config:
    """Read ``source`` (a JSON file path, a dict or a Config), apply ``section.key=value`` overrides, fill the
    schema's defaults and validate; raise ConfigError listing every problem at once. A path that names no file
    here but a shipped config (`configs/13b-h200.json`, `13b-h200.json`) reads the one the install carries.

    model_in_hand: the config is for a model passed to engine.initialize, not the built-in GPT: the built-in's
    shape rules are skipped (engine.user_model checks model.* against the model, the layer count against its
    discovered layers)."""
    raw = _read_source(source)
    errors = _apply_overrides(raw, overrides)
    written = frozenset(f"{name}.{k}" for name, section in raw.items() if isinstance(section, dict) for k in section)
    dp = _data_parallel_size(data_parallel_size)
    _fill_defaults(raw)
    bad: set[str] = set()
    errors += _non_finite_errors(raw, bad)
    errors += _schema_errors(raw, bad)
    fired: set[str] = set()
    errors += _rule_errors(raw, dp, bad, fired, model_in_hand)
    errors += _not_built_errors(raw, dp, bad | fired)
    if errors:
        raise ConfigError(errors)
    cfg = _build(raw)
    object.__setattr__(cfg, "_written", written)  # frozen; not a field: equality and to_dict are the values alone
    return cfg


def written_keys(cfg: Config) -> frozenset[str]:
    """The dotted keys the user wrote (in the file, the dict or an override), whatever their value; for a Config
    not made by load_config, the keys whose values differ from the schema's defaults."""
    written = getattr(cfg, "_written", None)
    if written is not None:
        return written
    props = section_properties()
    defaults = {name: {k: _plain(p["default"]) for k, p in keys.items()} for name, keys in props.items()}
    return frozenset(f"{name}.{key}" for name, section in cfg.to_dict().items()
                     for key, value in section.items() if value != defaults[name][key])  # fmt: skip


# --- sources and overrides ------------------------------------------------------------------------------


def _read_source(source: Any) -> dict[str, Any]:
    if isinstance(source, Config):  # what its user wrote: the written keys read back from it
        full, written = source.to_dict(), written_keys(source)
        return {name: {k: v for k, v in section.items() if f"{name}.{k}" in written} for name, section in full.items()}
    if isinstance(source, Mapping):
        return _plain(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError([f"config source must be a JSON file path, a dict or a Config, not {type(source).__name__}"])
    path = Path(config_file(os.fspath(source)))  # a shipped config's name from any directory; a file here wins
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{path}: cannot read config file: {e}"]) from None
    try:
        data, problems = strict_json.loads(text, str(path))  # duplicate keys, depth and sizes: errors
    except json.JSONDecodeError as e:
        raise ConfigError([f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}"]) from None
    if problems:
        raise ConfigError(problems)
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a JSON object, not {_json_type(data)}"])
    return data


_PYTHON_SPELLINGS = {"True": True, "False": False, "None": None}


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is JSON, True/False/None, else a string."""
    dotted, sep, value_text = text.partition("=")
    parts = [p.strip() for p in dotted.split(".")]
    where = f"override {strict_json.shorten(text)!r}"
    if not sep or len(parts) != 2 or not all(parts):
        raise ValueError(f"{where}: expected section.key=value (e.g. optimizer.optimizer_offload_fraction=0.5)")
    if len(value_text) > strict_json.MAX_STRING:
        raise ValueError(f"{where}: a value of {len(value_text):,} characters; at most {strict_json.MAX_STRING:,}")
    if value_text in _PYTHON_SPELLINGS:
        return parts[0], parts[1], _PYTHON_SPELLINGS[value_text]
    try:
        value, problems = strict_json.loads(value_text, where)
    except ValueError:
        return parts[0], parts[1], value_text
    if problems:
        raise ValueError(problems[0])
    return parts[0], parts[1], value


def _apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> list[str]:
    if isinstance(overrides, str):  # a lone string would otherwise be split into characters
        overrides = [overrides]
    errors = []
    for text in overrides:
        try:
            section, key, value = parse_override(text)
        except ValueError as e:
            errors.append(str(e))
            continue
        target = raw.setdefault(section, {})
        if not isinstance(target, dict):
            errors.append(f"override {text!r}: {section}={_show(target)} is not an object")
            continue
        target[key] = value
    return errors


def _data_parallel_size(value: int | None) -> int:
    if value is None:
        text = os.environ.get("WORLD_SIZE", "1")
        try:
            value = int(text)
        except ValueError:
            raise ConfigError([f"WORLD_SIZE={text!r}: expected an integer"]) from None
    if value < 1:
        raise ConfigError([f"data_parallel_size={value}: must be >= 1"])
    return value


def _fill_defaults(raw: dict[str, Any]) -> None:
    for name, spec in load_schema()["properties"].items():
        section = raw.setdefault(name, copy.deepcopy(spec.get("default", {})))
        if isinstance(section, dict):
            for key, prop in spec["properties"].items():
                section.setdefault(key, copy.deepcopy(prop["default"]))


# --- schema validation ------------------------------------------------------------------------------------


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _dotted(path: Sequence[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _non_finite_errors(raw: dict[str, Any], bad: set[str]) -> list[str]:
    # jsonschema compares NaN with every bound as False, so NaN would pass minimum/maximum unnoticed.
    errors = []
    for name, section in raw.items():
        for key, value in section.items() if isinstance(section, dict) else ():
            if isinstance(value, float) and not math.isfinite(value):
                bad.add(f"{name}.{key}")
                errors.append(f"{name}.{key}={_show(value)}: expected a finite number")
    return errors


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _suggest(section: str | None, key: str) -> str | None:
    """The closest valid section or dotted key to an unknown ``key`` found in ``section`` (None: top level)."""
    best, best_score = None, 0.0
    for name, props in section_properties().items():
        candidates = [(name, name)] if section is None else []
        candidates += [(f"{name}.{k}", k) for k in props]
        for dotted, leaf in candidates:
            score = max(_similarity(key, leaf), _similarity(key, dotted))
            score += 0.01 if name == section else 0.0  # ties go to the section the user wrote
            if score > best_score:
                best, best_score = dotted, score
    return best if best_score >= 0.6 else None


def _unknown_key_error(path: list[str | int], key: str, value: Any) -> str:
    section = str(path[0]) if path else None
    where = strict_json.shorten(_dotted([*path, key]))
    what = f"{where}: unknown section" if section is None else f"{where}={_show(value)}: unknown key"
    hint = _suggest(section, key)
    if hint is None:
        return f"{what}; see the config reference (python -m engine.config.doc)"
    return f"{what}; did you mean '{hint}'?"


def _expected(error: Any, path: list[str | int]) -> str:
    spec, kind, limit = error.schema, error.validator, error.validator_value
    leaf = str(path[-1])
    if kind == "type":
        return "expected " + " or ".join([limit] if isinstance(limit, str) else limit)
    if kind == "enum":
        return "expected one of " + ", ".join(_show(v) for v in limit)
    if kind in ("minimum", "maximum") and "minimum" in spec and "maximum" in spec:
        return f"{leaf} must be in [{spec['minimum']}, {spec['maximum']}]"
    bounds = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
    if kind in bounds:
        return f"{leaf} must be {bounds[kind]} {limit}"
    if kind == "pattern" and limit.startswith("^") and limit.endswith("$"):  # a number or a word ("auto")
        kinds = [t for t in ([spec["type"]] if isinstance(spec["type"], str) else spec["type"]) if t != "string"]
        return f'expected {" or ".join(kinds)} or "{limit[1:-1]}"'
    if kind == "minLength":
        return "expected a non-empty string"
    if kind == "uniqueItems":
        return "items must be unique"
    return error.message


def _schema_errors(raw: dict[str, Any], bad: set[str]) -> list[str]:
    errors = []
    for error in _validator().iter_errors(raw):
        path = list(error.absolute_path)
        if error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            errors += [_unknown_key_error(path, k, v) for k, v in error.instance.items() if k not in known]
            continue
        where = _dotted(path)
        if where in bad:  # already reported as non-finite
            continue
        bad.add(where)
        errors.append(f"{where}={_show(error.instance)}: {_expected(error, path)}")
    return errors


def _lookup(raw: dict[str, Any], dotted: str) -> Any:
    section, key = dotted.split(".")
    return raw[section][key]


def _namespace(raw: dict[str, Any]) -> SimpleNamespace:
    views = {}
    for name, props in section_properties().items():
        section = raw.get(name)
        values = {k: section[k] for k in props if k in section} if isinstance(section, dict) else {}
        views[name] = SimpleNamespace(**values)
    return SimpleNamespace(**views)


def check_world_size(cfg: Config, data_parallel_size: int) -> None:
    """The rules that read the data-parallel size, run on a validated Config at the size the process group has (a
    Config loaded before the group existed saw WORLD_SIZE from the environment). Raises ConfigError."""
    errors = []
    for rule in WORLD_SIZE_RULES:
        for where, text in rule(cfg, data_parallel_size):
            section, key = where.split(".")
            errors.append(f"{where}={_show(getattr(getattr(cfg, section), key))}: {text}")
    if errors:
        raise ConfigError(errors)


def _rule_errors(raw: dict[str, Any], dp: int, bad: set[str], fired: set[str], model_in_hand: bool) -> list[str]:
    view, errors = _namespace(raw), []
    view.model_in_hand = model_in_hand
    for reads, rule in rules_for(model_in_hand):
        if blocked(reads, bad):
            continue
        for where, text in rule(view, dp):
            fired.add(where)
            errors.append(f"{where}={_show(_lookup(raw, where))}: {text}")
    return errors


def _not_built_errors(raw: dict[str, Any], dp: int, skip: set[str]) -> list[str]:
    errors = []
    for row in NOT_BUILT:
        # A rule that already fired on this path (the reference's message) takes precedence.
        if blocked([row.path], skip) or not row.rejects(value := _lookup(raw, row.path), dp):
            continue
        errors.append(f"{row.path}={_show(value)}: {row.what} in offload-engine; {row.fix}")
    return errors


# --- the typed result -------------------------------------------------------------------------------------


def _build(raw: dict[str, Any]) -> Config:
    _sections_match_schema()
    props = section_properties()
    return Config(**{
        name: cls(**{k: _typed(v, props[name][k]) for k, v in raw[name].items()}) for name, cls in _SECTIONS.items()
    })  # fmt: skip
