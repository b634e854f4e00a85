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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, NamedTuple, get_type_hints

from jsonschema import Draft202012Validator

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "engine.schema.json"


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
    cpu_offloading_num_layers: int = 0
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
    optimizer_offload_fraction: float = 0.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_torch_optimizer_for_cpu_offload: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    use_distributed_optimizer: bool = False
    cpu_optimizer_threads: int | None = None
    accumulate_allreduce_grads_in_fp32: bool = True
    delayed_param_update: bool = False


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


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None


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
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError([f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a JSON object, not {_json_type(data)}"])
    return data


_PYTHON_SPELLINGS = {"True": True, "False": False, "None": None}


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is JSON, True/False/None, else a string."""
    dotted, sep, value_text = text.partition("=")
    parts = [p.strip() for p in dotted.split(".")]
    if not sep or len(parts) != 2 or not all(parts):
        raise ValueError(
            f"override {text!r}: expected section.key=value (e.g. optimizer.optimizer_offload_fraction=0.5)"
        )
    if value_text in _PYTHON_SPELLINGS:
        return parts[0], parts[1], _PYTHON_SPELLINGS[value_text]
    try:
        return parts[0], parts[1], json.loads(value_text)
    except ValueError:
        return parts[0], parts[1], value_text


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
    try:
        return json.dumps(_plain(value))
    except (TypeError, ValueError):
        return repr(value)


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
    where = _dotted([*path, key])
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


# --- cross-field rules: the reference's constraints first, then our own ----------------------------------


class Problem(NamedTuple):
    path: str  # the dotted key the message is about; its value is shown before the text
    text: str


Rule = Callable[[SimpleNamespace, int], Iterator[Problem]]
RULES: list[tuple[tuple[str, ...], Rule]] = []


def _rule(*reads: str) -> Callable[[Rule], Rule]:
    """Register a rule with the paths it reads; it is skipped when one of them failed the schema."""

    def register(fn: Rule) -> Rule:
        RULES.append((reads, fn))
        return fn

    return register


@_rule("model.cpu_offloading", "model.cpu_offloading_num_layers", "model.num_layers")
def _offloaded_layer_count(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    m = c.model
    if m.cpu_offloading and (m.cpu_offloading_num_layers < 0 or m.cpu_offloading_num_layers >= m.num_layers):
        yield Problem(
            "model.cpu_offloading_num_layers",
            f"CPU offloading can be done only for layers less than {m.num_layers}; "
            f"set model.cpu_offloading_num_layers between 0 and {m.num_layers - 1}",
        )


@_rule("model.cpu_offloading", "model.pipeline_model_parallel_size")
def _offload_without_pipeline(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.cpu_offloading and c.model.pipeline_model_parallel_size > 1:
        yield Problem(
            "model.pipeline_model_parallel_size",
            "Currently there is no support for Pipeline parallelism with CPU offloading; "
            "set model.pipeline_model_parallel_size=1, "
            "or offload the optimizer instead (optimizer.optimizer_cpu_offload)",
        )


@_rule("model.cpu_offloading", "model.recompute_granularity")
def _offload_without_recompute(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.cpu_offloading and c.model.recompute_granularity is not None:
        yield Problem(
            "model.recompute_granularity",
            "CPU offloading does not work when activation recomputation is enabled; "
            "set model.recompute_granularity=null or model.cpu_offloading=false",
        )


@_rule("model.cpu_offloading", "model.fine_grained_activation_offloading")
def _one_activation_offloading(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.fine_grained_activation_offloading and c.model.cpu_offloading:
        yield Problem(
            "model.fine_grained_activation_offloading",
            "fine_grained_activation_offloading cannot be enabled with cpu_offloading. "
            "Set model.fine_grained_activation_offloading=false or model.cpu_offloading=false",
        )


@_rule("model.cpu_offloading", "model.cuda_graph_impl")
def _offload_without_cuda_graphs(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.cpu_offloading and c.model.cuda_graph_impl != "none":
        yield Problem(
            "model.cuda_graph_impl",
            "CUDA graphs not supported with CPU offloading. "
            'Set model.cuda_graph_impl="none" or model.cpu_offloading=false',
        )


@_rule("optimizer.optimizer_cpu_offload", "optimizer.use_distributed_optimizer")
def _optimizer_offload_needs_distributed(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.optimizer.optimizer_cpu_offload and not c.optimizer.use_distributed_optimizer:
        yield Problem(
            "optimizer.optimizer_cpu_offload",
            "optimizer_cpu_offload requires use_distributed_optimizer=True (Megatron builds HybridDeviceOptimizer "
            "only inside the distributed optimizer); set optimizer.use_distributed_optimizer=true",
        )


@_rule("train.global_batch_size", "train.micro_batch_size")
def _batch_arithmetic(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    gbs, mbs = c.train.global_batch_size, c.train.micro_batch_size
    step = mbs * dp
    if gbs % step:
        nearest = max(1, round(gbs / step)) * step
        yield Problem(
            "train.global_batch_size",
            f"must be divisible by train.micro_batch_size ({mbs}) x data-parallel size ({dp}) = {step}; "
            f"set train.global_batch_size to a multiple of {step} (e.g. {nearest}) or lower train.micro_batch_size",
        )


@_rule("model.hidden_size", "model.num_attention_heads")
def _heads_divide_hidden(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.hidden_size % c.model.num_attention_heads:
        yield Problem(
            "model.hidden_size",
            f"must be divisible by model.num_attention_heads ({c.model.num_attention_heads}); "
            "change model.hidden_size or model.num_attention_heads",
        )


@_rule("optimizer.lr", "optimizer.min_lr")
def _min_lr_below_lr(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.optimizer.min_lr > c.optimizer.lr:
        yield Problem("optimizer.min_lr", f"must be <= optimizer.lr ({c.optimizer.lr}); lower optimizer.min_lr")


@_rule("data.source", "data.path")
def _file_sources_need_path(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.data.source in ("text", "tokens") and c.data.path is None:
        yield Problem(
            "data.path", f'data.source="{c.data.source}" reads a file; set data.path to it or data.source="stdlib"'
        )


@_rule("train.params_dtype", "train.precision")
def _half_params_need_half_precision(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.train.params_dtype == "half" and c.train.precision not in ("bf16", "fp16"):
        yield Problem(
            "train.params_dtype",
            f'half weights need train.precision "bf16" or "fp16", not "{c.train.precision}"; '
            'set train.params_dtype="fp32" or train.precision="bf16"',
        )


@_rule("train.precision", "train.loss_scale", "train.initial_loss_scale", "train.loss_scale_window")
def _fp16_only_keys(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    # An fp16 knob under bf16/fp32 would be accepted and silently ignored; reject it instead.
    if c.train.precision == "fp16":
        return
    train_props = section_properties()["train"]
    for key in ("loss_scale", "initial_loss_scale", "loss_scale_window"):
        default = train_props[key]["default"]
        if getattr(c.train, key) != default:
            yield (
                f"train.{key}",
                (
                    f'is used only with train.precision="fp16", not "{c.train.precision}"; '
                    f'set train.{key}={_show(default)} or train.precision="fp16"'
                ),
            )


@_rule("model.fine_grained_activation_offloading", "model.offload_modules")
def _fine_grained_needs_modules(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.model.fine_grained_activation_offloading and not c.model.offload_modules:
        yield Problem(
            "model.offload_modules",
            'model.fine_grained_activation_offloading=true needs the sub-modules to offload; list them (e.g. ["mlp"])',
        )
    if c.model.offload_modules and not c.model.fine_grained_activation_offloading:
        yield Problem(
            "model.offload_modules",
            "are offloaded only with model.fine_grained_activation_offloading=true; "
            "set it, or set model.offload_modules=[]",
        )


@_rule("optimizer.lr_warmup_iters", "train.train_iters")
def _warmup_within_training(c: SimpleNamespace, dp: int) -> Iterator[Problem]:
    if c.optimizer.lr_warmup_iters > c.train.train_iters:
        yield Problem(
            "optimizer.lr_warmup_iters",
            f"must be <= train.train_iters ({c.train.train_iters}); lower optimizer.lr_warmup_iters",
        )


def _blocked(reads: Sequence[str], bad: set[str]) -> bool:
    """True when a path the rule reads (or its section, or one of its items) failed validation."""
    return any(r == b or r.startswith(b + ".") or b.startswith(r + "[") for r in reads for b in bad)


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


# --- options whose mechanism is not built yet: delete a row when its mechanism lands ------------------------


@dataclass(frozen=True)
class NotBuilt:
    path: str
    rejects: Callable[[Any, int], bool]  # (value, data_parallel_size) -> True when the value needs the mechanism
    what: str  # "<what> is not built yet ..."; with issue None a whole sentence ("... are not supported")
    issue: int | None  # the issue that builds it; None: not planned
    fix: str


NOT_BUILT: tuple[NotBuilt, ...] = (
    NotBuilt("model.implementation", lambda v, dp: v == "megatron", "the megatron-core GPTModel", 7,
             'set model.implementation="builtin"'),
    NotBuilt("model.use_te", lambda v, dp: v, "the Transformer Engine GPT", 7, "set model.use_te=false"),
    NotBuilt("model.cpu_offloading", lambda v, dp: v, "layer-level activation offloading", 4,
             "set model.cpu_offloading=false"),
    NotBuilt("model.fine_grained_activation_offloading", lambda v, dp: v, "module-level activation offloading", 4,
             "set model.fine_grained_activation_offloading=false"),
    NotBuilt("model.cpu_offloading_layers_path", lambda v, dp: v is not None, "choosing the offloaded layers by path",
             4, "set model.cpu_offloading_layers_path=null to find the layers automatically"),
    NotBuilt("model.cuda_graph_impl", lambda v, dp: v != "none", "CUDA graphs are not supported", None,
             'set model.cuda_graph_impl="none"'),
    NotBuilt("model.pipeline_model_parallel_size", lambda v, dp: v > 1, "pipeline parallelism is not supported", None,
             "set model.pipeline_model_parallel_size=1"),
    NotBuilt("optimizer.implementation", lambda v, dp: v == "megatron", "megatron-core's HybridDeviceOptimizer", 7,
             'set optimizer.implementation="engine"'),
    NotBuilt("optimizer.optimizer_cpu_offload", lambda v, dp: v, "optimizer-state offloading (HybridDeviceOptimizer)",
             3, "set optimizer.optimizer_cpu_offload=false"),
    NotBuilt("optimizer.delayed_param_update", lambda v, dp: v, "the delayed CPU parameter update", 3,
             "set optimizer.delayed_param_update=false"),
    NotBuilt("train.params_dtype", lambda v, dp: v == "half", "half-precision weights with fp32 master weights", 3,
             'set train.params_dtype="fp32"'),
)  # fmt: skip


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
