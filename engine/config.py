"""Load, override, validate and freeze the engine configuration.

schemas/engine.schema.json is the single source of truth for keys, types, ranges and defaults; the frozen
dataclasses below mirror it by hand so editors and type checkers see real fields (tests/test_config.py holds
them equal to the schema). ``load_config`` merges a JSON file or dict with Megatron-Bridge style dotted
overrides, fills the schema's defaults, validates with jsonschema, runs the cross-field rules (the
reference's constraints with its exact messages) and the NOT_BUILT table, and reports every problem at once
in one ConfigError.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, get_type_hints

from jsonschema import Draft202012Validator

from engine import config_json
from engine.config_rules import NOT_BUILT, RULES, _blocked
from engine.resources import data_path

SCHEMA_PATH = data_path("schemas", "engine.schema.json")  # inside the wheel, or schemas/ in a checkout


@dataclass(frozen=True)
class ModelConfig:
    implementation: Literal["builtin", "megatron"] = "builtin"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    seq_length: int = 128
    vocab_size: int = 256
    init_method_std: float = 0.02
    use_te: bool = False
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int | str = 0  # or "auto": resolved by the memory plan in initialize
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_layers_path: str | None = None
    fine_grained_activation_offloading: bool = False
    offload_modules: tuple[str, ...] = ()
    pipeline_model_parallel_size: int = 1
    recompute_granularity: Literal["full", "selective"] | None = None
    cuda_graph_impl: Literal["none", "local", "transformer_engine"] = "none"


@dataclass(frozen=True)
class OptimizerConfig:
    implementation: Literal["engine", "megatron"] = "engine"
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float | str = 0.0  # or "auto": resolved by the memory plan in initialize
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_torch_optimizer_for_cpu_offload: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    use_distributed_optimizer: bool = False
    cpu_optimizer_threads: int | None = None
    cpu_optimizer_pin_threads: bool = False
    accumulate_allreduce_grads_in_fp32: bool = True
    delayed_param_update: bool = False
    delayed_param_update_warmup: int = 40
    speculation_buffer_mb: int = 2048
    cpu_offload_gpu_assist: bool = False


@dataclass(frozen=True)
class TrainConfig:
    train_iters: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 8
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    params_dtype: Literal["fp32", "half"] = "fp32"
    loss_scale: float | None = None
    initial_loss_scale: float = 65536.0
    loss_scale_window: int = 1000
    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_skipped_steps: int | None = 20


@dataclass(frozen=True)
class DataConfig:
    source: Literal["stdlib", "text", "tokens"] = "stdlib"
    path: str | None = None
    token_dtype: Literal["uint8", "uint16", "int32"] = "uint16"
    max_bytes: int = 16777216


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 1
    metrics_file: str | None = "runs/metrics.jsonl"
    progress_bar: bool = True
    tensorboard_dir: str | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    load_if_exists: bool = False
    keep_last: int | None = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every key of every section as plain JSON values (tuples become lists)."""
        return {
            f.name: {k.name: _plain(getattr(getattr(self, f.name), k.name)) for k in fields(getattr(self, f.name))}
            for f in fields(self)
        }


class ConfigError(ValueError):
    """Every problem of one configuration; ``str()`` is one line per problem."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


@functools.cache
def load_schema() -> dict[str, Any]:
    """The parsed schema, loaded once (callers must not mutate it)."""
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return schema


def section_properties() -> dict[str, dict[str, dict[str, Any]]]:
    """{section: {key: property schema}} in schema order."""
    return {name: spec["properties"] for name, spec in load_schema()["properties"].items()}


@functools.cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema())


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config,
    overrides: Sequence[str] = (),
    *,
    data_parallel_size: int | None = None,
) -> Config:
    """Read ``source`` (a JSON file path, a dict or a Config), apply ``section.key=value`` overrides, fill the
    schema's defaults and validate; raise ConfigError listing every problem at once."""
    raw = _read_source(source)
    errors = _apply_overrides(raw, overrides)
    dp = _data_parallel_size(data_parallel_size)
    _fill_defaults(raw)
    bad: set[str] = set()
    errors += _non_finite_errors(raw, bad)
    errors += _schema_errors(raw, bad)
    fired: set[str] = set()
    errors += _rule_errors(raw, dp, bad, fired)
    errors += _not_built_errors(raw, dp, bad | fired)
    if errors:
        raise ConfigError(errors)
    return _build(raw)


# --- sources and overrides ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A deep copy with Mappings as dicts and tuples as lists, the shapes jsonschema and JSON expect."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)


def _read_source(source: Any) -> dict[str, Any]:
    if isinstance(source, Config):
        return source.to_dict()
    if isinstance(source, Mapping):
        return _plain(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError([f"config source must be a JSON file path, a dict or a Config, not {type(source).__name__}"])
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{path}: cannot read config file: {e}"]) from None
    try:
        data, problems = config_json.loads(text, str(path))  # duplicate keys, depth and sizes: errors
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
    where = f"override {config_json.shorten(text)!r}"
    if not sep or len(parts) != 2 or not all(parts):
        raise ValueError(f"{where}: expected section.key=value (e.g. optimizer.optimizer_offload_fraction=0.5)")
    if len(value_text) > config_json.MAX_STRING:
        raise ValueError(f"{where}: a value of {len(value_text):,} characters; at most {config_json.MAX_STRING:,}")
    if value_text in _PYTHON_SPELLINGS:
        return parts[0], parts[1], _PYTHON_SPELLINGS[value_text]
    try:
        value, problems = config_json.loads(value_text, where)
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


def _show(value: Any) -> str:
    """`value` as JSON for a message, shortened when long (a message shows the value, not a megabyte of it)."""
    try:
        text = json.dumps(_plain(value))
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return config_json.shorten(text, 80)


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
    where = config_json.shorten(_dotted([*path, key]))
    what = f"{where}: unknown section" if section is None else f"{where}={_show(value)}: unknown key"
    hint = _suggest(section, key)
    if hint is None:
        return f"{what}; see the config reference (python -m engine.config_doc)"
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
        return f"expected {' or '.join(kinds)} or \"{limit[1:-1]}\""
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


def _rule_errors(raw: dict[str, Any], dp: int, bad: set[str], fired: set[str]) -> list[str]:
    view, errors = _namespace(raw), []
    for reads, rule in RULES:
        if _blocked(reads, bad):
            continue
        for where, text in rule(view, dp):
            fired.add(where)
            errors.append(f"{where}={_show(_lookup(raw, where))}: {text}")
    return errors


def _not_built_errors(raw: dict[str, Any], dp: int, skip: set[str]) -> list[str]:
    errors = []
    for row in NOT_BUILT:
        # A rule that already fired on this path (the reference's message) takes precedence.
        if _blocked([row.path], skip) or not row.rejects(value := _lookup(raw, row.path), dp):
            continue
        verdict = f"is not built yet in offload-engine (issue {row.issue})" if row.issue else "in offload-engine"
        errors.append(f"{row.path}={_show(value)}: {row.what} {verdict}; {row.fix}")
    return errors


# --- the typed result -------------------------------------------------------------------------------------


def _typed(value: Any, prop: dict[str, Any]) -> Any:
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


def _build(raw: dict[str, Any]) -> Config:
    hints = get_type_hints(Config)
    props = section_properties()
    return Config(**{
        name: hints[name](**{k: _typed(v, props[name][k]) for k, v in raw[name].items()}) for name in props
    })  # fmt: skip
