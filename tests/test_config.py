"""The config loader: schema mirror, overrides, validation messages, cross-field rules, NOT_BUILT, docs."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin, get_type_hints

import pytest

from engine import config as config_module
from engine.config import (
    NOT_BUILT,
    RULES,
    SCHEMA_PATH,
    Config,
    ConfigError,
    codegen,
    load_config,
    load_schema,
    parse_override,
    section_properties,
)
from engine.config.doc import END, START, main, render_markdown

ROOT = Path(__file__).resolve().parent.parent
CONFIG_FILES = sorted((ROOT / "configs").glob("*.json"))


def errors_of(overrides: list[str], source: dict | None = None, dp: int = 1) -> list[str]:
    """The ConfigError lines of a load, or [] when it loads."""
    try:
        load_config(source or {}, overrides, data_parallel_size=dp)
    except ConfigError as e:
        return e.errors
    return []


# --- the dataclasses mirror the schema ----------------------------------------------------------------------


def _schema_atoms(prop: dict) -> set:
    if "enum" in prop:
        return {type(None) if v is None else ("literal", v) for v in prop["enum"]}
    names = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
    scalar = {"integer": int, "number": float, "boolean": bool, "string": str, "null": type(None)}
    word = re.fullmatch(r"\^(\w+)\$", prop.get("pattern", ""))  # a string that may only be this word ("auto")
    scalar["string"] = ("literal", word.group(1)) if word else str
    return {("tuple", scalar[prop["items"]["type"]]) if n == "array" else scalar[n] for n in names}


def _hint_atoms(hint: object) -> set:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return set().union(*(_hint_atoms(a) for a in get_args(hint)))
    if origin is Literal:
        return {("literal", a) for a in get_args(hint)}
    if origin is tuple:
        item, ellipsis = get_args(hint)
        assert ellipsis is Ellipsis
        return {("tuple", item)}
    return {hint}


def test_config_sections_are_the_schema_sections():
    assert [f.name for f in dataclasses.fields(Config)] == list(load_schema()["properties"])


@pytest.mark.parametrize("section", list(section_properties()))
def test_section_dataclass_equals_schema(section):
    cls = get_type_hints(Config)[section]
    props = section_properties()[section]
    hints = get_type_hints(cls)
    assert [f.name for f in dataclasses.fields(cls)] == list(props)
    instance = cls()
    for key, prop in props.items():
        default = getattr(instance, key)
        assert default == (tuple(prop["default"]) if isinstance(prop["default"], list) else prop["default"]), key
        assert type(default) is not int or "integer" in prop.get("type", ""), f"{key}: int default for a number"
        assert _hint_atoms(hints[key]) == _schema_atoms(prop), key


def test_the_sections_module_is_generated_from_the_schema():
    """engine/config/sections.py is checked in for editors and type checkers; the schema stays the source."""
    assert codegen.SECTIONS_PATH.read_text(encoding="utf-8") == codegen.render(), (
        f"{codegen.SECTIONS_PATH} differs from what the schema gives; run {codegen.COMMAND}"
    )
    assert codegen.main(["--check"]) == 0


def _planted_schema() -> dict:
    schema = copy.deepcopy(load_schema())
    schema["properties"]["train"]["properties"]["new_knob"] = {"type": ["integer", "null"], "default": 3,
                                                                "description": "A test key. More words."}  # fmt: skip
    return schema


def _module_of(text: str) -> types.ModuleType:
    module = types.ModuleType("planted_sections")
    exec(compile(text, "planted_sections.py", "exec", dont_inherit=True), module.__dict__)
    return module


def test_a_key_added_to_the_schema_is_a_typed_field_once_regenerated(monkeypatch, capsys):
    text = codegen.render(_planted_schema())
    assert text != codegen.render()
    assert '    new_knob: int | None = 3\n    """A test key. More words."""\n' in text
    train = _module_of(text).TrainConfig
    assert [f.name for f in dataclasses.fields(train)][-1] == "new_knob"
    assert train().new_knob == 3 and get_type_hints(train)["new_knob"] == int | None
    monkeypatch.setattr(codegen, "load_schema", _planted_schema)
    assert codegen.main(["--check"]) == 1  # the checked-in module is stale now
    assert f"stale against the schema; run {codegen.COMMAND}" in capsys.readouterr().out


def test_a_stale_sections_module_is_one_line_naming_the_command(monkeypatch):
    from engine.config import schema as config_schema

    monkeypatch.setattr(config_schema, "load_schema", _planted_schema)  # the schema edited, the module not rebuilt
    with pytest.raises(
        RuntimeError, match=re.escape(f"sections.py is stale against {SCHEMA_PATH}; run {codegen.COMMAND}")
    ):
        load_config({})


def test_the_generated_types_and_defaults(tmp_path):
    """Each schema shape becomes its Python type; the text is ruff-clean even for awkward descriptions."""
    props = {
        "word_or_int": {"type": ["integer", "string"], "pattern": "^auto$", "default": "auto", "description": "x"},
        "maybe_enum": {"enum": [None, "a", "b"], "default": None, "description": 'Quoted "end"'},
        "names": {"type": ["string", "array", "null"], "items": {"type": "string"}, "default": ["one"],
                  "description": "back\\slash " + "long words " * 40},
        "rate": {"type": "number", "default": 1, "description": "e.g. a number. Then more. " + "z" * 200},
        "free_text": {"type": "string", "pattern": "^[a-z]+$", "default": "ab", "description": "y"},
    }  # fmt: skip
    schema = {"properties": {"extra": {"description": "A section.", "properties": props}}}
    text = codegen.render(schema)
    extra = _module_of(text).ExtraConfig
    hints = get_type_hints(extra)
    assert hints["word_or_int"] == int | Literal["auto"]
    assert hints["maybe_enum"] == Literal["a", "b"] | None
    assert hints["names"] == str | tuple[str, ...] | None
    assert hints["rate"] is float and hints["free_text"] is str
    instance = extra()
    assert (instance.word_or_int, instance.names, instance.free_text) == ("auto", ("one",), "ab")
    assert type(instance.rate) is float and instance.rate == 1.0
    assert extra.__doc__ == "A section."
    assert all(len(line) <= codegen.LINE_LENGTH for line in text.splitlines())
    assert '    """e.g. a number."""' in text
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the test extra has it)")
    path = tmp_path / "sections.py"
    path.write_text(text, encoding="utf-8")
    config = ["--config", str(ROOT / "pyproject.toml")]
    for command in (["format", "--check"], ["check"]):
        done = subprocess.run([ruff, *command, *config, str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_checkout_reads_the_top_level_schema():
    # schemas/ is the source of truth; a wheel carries a copy inside the package (tests/test_install.py)
    assert SCHEMA_PATH == ROOT / "schemas" / "engine.schema.json"
    assert load_schema() is load_schema()  # loaded once


def test_empty_source_gives_defaults():
    cfg = load_config({})
    assert cfg == Config()
    assert cfg.to_dict() == {
        s: {k: p["default"] for k, p in props.items()} for s, props in section_properties().items()
    }


def test_config_is_frozen():
    cfg = load_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.optimizer_offload_fraction = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = cfg.model


def test_round_trip_through_dict_and_json():
    overrides = ["optimizer.lr=0.001", "train.seed=7", "checkpoint.save=ckpt", "model.ffn_hidden_size=64"]
    cfg = load_config({"train": {"global_batch_size": 16, "micro_batch_size": 4}}, overrides)
    assert cfg != Config()
    assert load_config(cfg.to_dict()) == cfg
    assert load_config(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert load_config(cfg) == cfg
    assert load_config(cfg, ["train.seed=8"]).train.seed == 8


def test_tuples_round_trip(monkeypatch):
    monkeypatch.setattr(config_module, "NOT_BUILT", ())  # the day module-level offloading lands
    cfg = load_config({}, ["model.fine_grained_activation_offloading=true", 'model.offload_modules=["mlp", "attn"]'])
    assert cfg.model.offload_modules == ("mlp", "attn")
    assert cfg.to_dict()["model"]["offload_modules"] == ["mlp", "attn"]
    assert load_config(json.loads(json.dumps(cfg.to_dict()))) == cfg


# --- sources ------------------------------------------------------------------------------------------------


def test_file_source_with_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"optimizer": {"lr": 0.01, "min_lr": 0.001, "lr_decay_style": "cosine"}}))
    assert load_config(path).optimizer.lr == 0.01
    cfg = load_config(str(path), ["optimizer.lr=0.002"])
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (0.002, 0.001)


def test_dict_source_is_not_mutated():
    source = {"optimizer": {"lr": 0.01}}
    load_config(source, ["optimizer.lr=0.02", "train.seed=3"])
    assert source == {"optimizer": {"lr": 0.01}}


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=re.escape(f"{path}: config file not found")):
        load_config(path)


def test_bad_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "model": {\n    "num_layers": 2,\n  }\n}\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}:4:3: invalid JSON")):
        load_config(path)


def test_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object, not array"):
        load_config(path)


def test_unsupported_source_type():
    with pytest.raises(ConfigError, match="config source must be a JSON file path, a dict or a Config, not int"):
        load_config(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_shipped_config_loads(path):
    cfg = load_config(path, data_parallel_size=1)
    assert load_config(cfg.to_dict()) == cfg


def test_a_shipped_config_name_loads_from_any_directory(tmp_path, monkeypatch):
    """load_config (and so engine.initialize) resolves a shipped config's name as the CLI does; a file of that
    name in the working directory wins; an unknown name is reported as typed."""
    shipped = load_config(ROOT / "configs" / "13b-h200.json")
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/13b-h200.json") == shipped
    assert load_config(Path("13b-h200.json")) == shipped
    with pytest.raises(ConfigError, match=r"^configs/none\.json: config file not found$"):
        load_config("configs/none.json")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "13b-h200.json").write_text('{"train": {"seed": 7}}')
    assert load_config("configs/13b-h200.json") == load_config({"train": {"seed": 7}})


def test_initialize_reads_a_shipped_config_from_any_directory(tmp_path, monkeypatch):
    import engine

    monkeypatch.chdir(tmp_path)
    tiny = ["model.num_layers=1", "model.hidden_size=16", "model.seq_length=16", "train.device=cpu"]
    eng, _, _ = engine.initialize(config="configs/default.json", overrides=tiny)
    assert eng.config.optimizer.lr == load_config(ROOT / "configs" / "default.json").optimizer.lr == 0.002


# --- overrides ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "section", "key", "expected"),
    [
        ("optimizer.optimizer_offload_fraction=0.5", "optimizer", "optimizer_offload_fraction", 0.5),
        ("optimizer.lr=1", "optimizer", "lr", 1.0),  # JSON integer for a number field becomes a float
        ("train.train_iters=20.0", "train", "train_iters", 20),  # integral float for an integer field
        ("optimizer.overlap_cpu_optimizer_d2h_h2d=True", "optimizer", "overlap_cpu_optimizer_d2h_h2d", True),
        ("optimizer.pin_cpu_grads=false", "optimizer", "pin_cpu_grads", False),
        ("model.recompute_granularity=None", "model", "recompute_granularity", None),
        ("logging.metrics_file=null", "logging", "metrics_file", None),
        ("checkpoint.save=ckpt/run1", "checkpoint", "save", "ckpt/run1"),
        ('checkpoint.save="true"', "checkpoint", "save", "true"),
        ("model.recompute_granularity=selective", "model", "recompute_granularity", "selective"),
    ],
)
def test_override_is_typed(override, section, key, expected):
    source = {
        "model": {"recompute_granularity": "full"},
        "logging": {"metrics_file": "m.jsonl"},
        "optimizer": {"optimizer_cpu_offload": True, "use_distributed_optimizer": True},
    }
    value = getattr(getattr(load_config(source, [override]), section), key)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("a.b=[1,2]", [1, 2]), ("a.b=x y", "x y"), ("a.b=", ""), ("a.b=1e-3", 1e-3), ("a.b=a=b", "a=b")],
)
def test_parse_override_values(text, expected):
    assert parse_override(text) == ("a", "b", expected)


def test_override_type_error_names_the_key():
    with pytest.raises(ConfigError, match=r'^optimizer\.optimizer_offload_fraction="abc": expected number or "auto"$'):
        load_config({}, ["optimizer.optimizer_offload_fraction=abc"])
    with pytest.raises(ConfigError, match=r"^model\.cpu_offloading_num_layers=true: expected integer or string$"):
        load_config({}, ["model.cpu_offloading_num_layers=true"])


@pytest.mark.parametrize("bad", ["optimizer_offload_fraction=0.5", "optimizer.lr", "a.b.c=1", "=1", ".lr=1"])
def test_malformed_override_is_named(bad):
    with pytest.raises(ConfigError, match=re.escape(f"override {bad!r}: expected section.key=value")):
        load_config({}, [bad])


def test_override_into_a_non_object_section():
    with pytest.raises(ConfigError, match=r"override 'model.num_layers=2': model=3 is not an object"):
        load_config({"model": 3}, ["model.num_layers=2"])


# --- schema errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.optimizer_offload_fraction=1.5", "optimizer.optimizer_offload_fraction=1.5: "
         "optimizer_offload_fraction must be in [0.0, 1.0]"),
        ("optimizer.optimizer_offload_fraction=-0.25", "optimizer.optimizer_offload_fraction=-0.25: "
         "optimizer_offload_fraction must be in [0.0, 1.0]"),
        ("optimizer.optimizer_offload_fraction=NaN", "optimizer.optimizer_offload_fraction=NaN: "
         "expected a finite number"),
        ("train.precision=fp8", 'train.precision="fp8": expected one of "bf16", "fp16", "fp32"'),
        ("model.recompute_granularity=partial", 'model.recompute_granularity="partial": '
         'expected one of null, "full", "selective"'),
        ("model.num_layers=0", "model.num_layers=0: num_layers must be >= 1"),
        ("model.num_layers=true", "model.num_layers=true: expected integer"),
        ("model.num_layers=2.5", "model.num_layers=2.5: expected integer"),
        ("model.ffn_hidden_size=wide", 'model.ffn_hidden_size="wide": expected integer or null'),
        ("optimizer.adam_eps=0", "optimizer.adam_eps=0: adam_eps must be > 0"),
        ("model.offload_modules=mlp", 'model.offload_modules="mlp": expected array'),
        ('model.offload_modules=["mlp", "mlp"]', 'model.offload_modules=["mlp", "mlp"]: items must be unique'),
        ('model.offload_modules=[""]', 'model.offload_modules[0]="": expected a non-empty string'),
    ],
)  # fmt: skip
def test_schema_error_names_path_value_and_expectation(override, message):
    assert message in errors_of([override])


def test_section_of_wrong_type():
    assert errors_of([], {"model": 3}) == ["model=3: expected object"]


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("model.num_layer=2", "model.num_layer=2: unknown key; did you mean 'model.num_layers'?"),
        ("optimizer.cpu_offloading=true",
         "optimizer.cpu_offloading=true: unknown key; did you mean 'model.cpu_offloading'?"),
        ("model.optimizer_offload_fraction=0.5", "did you mean 'optimizer.optimizer_offload_fraction'?"),
        ("train.lr=0.1", "train.lr=0.1: unknown key; did you mean 'optimizer.lr'?"),
        ("modle.num_layers=2", "modle: unknown section; did you mean 'model'?"),
        ("model.zzzzzz=1", "model.zzzzzz=1: unknown key; see the config reference (python -m engine.config.doc)"),
    ],
)  # fmt: skip
def test_unknown_key_did_you_mean(override, suggestion):
    (error,) = errors_of([override])
    assert suggestion in error


def test_unknown_top_level_key_suggests_a_dotted_key():
    assert errors_of([], {"cpu_offloading": True}) == [
        "cpu_offloading: unknown section; did you mean 'model.cpu_offloading'?"
    ]


def test_every_error_is_reported_at_once():
    overrides = [
        "optimizer.optimizer_offload_fraction=abc",  # schema: type
        "optimizer.cpu_offloadin=true",  # unknown key
        "model.hidden_size=130",  # rule: heads do not divide
        "train.global_batch_size=12",  # rule: batch arithmetic
        "train.loss_scale=128",  # rule: fp16-only key
        "bad-override",  # malformed
    ]
    with pytest.raises(ConfigError) as info:
        load_config({}, overrides)
    errors = info.value.errors
    assert len(errors) == 6, errors
    assert str(info.value).splitlines() == errors
    for needle in ['optimizer_offload_fraction="abc"', "cpu_offloadin", "model.hidden_size=130", "global_batch_size=12",
                   "train.loss_scale=128", "bad-override"]:  # fmt: skip
        assert sum(needle in e for e in errors) == 1, needle


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config({}, ["model.num_layers=0"])


def test_rule_is_skipped_when_its_input_failed_the_schema():
    # num_layers has the wrong type, so the layer-count rule cannot judge it; only the type error shows.
    errors = errors_of(["model.num_layers=four", "model.cpu_offloading=true", "model.cpu_offloading_num_layers=9"])
    assert not any("CPU offloading can be done only" in e for e in errors)
    assert 'model.num_layers="four": expected integer' in errors


# --- cross-field rules --------------------------------------------------------------------------------------

CPU_OFFLOAD = ["model.cpu_offloading=true"]
FULL = ["model.recompute_granularity=full"]
DPU = ["optimizer.delayed_param_update=true", "optimizer.optimizer_cpu_offload=true",
       "optimizer.use_distributed_optimizer=true", "optimizer.optimizer_offload_fraction=0.5"]  # fmt: skip

# rule name -> cases (overrides, data-parallel size, message regex); every rule in RULES needs an entry.
RULE_CASES: dict[str, list[tuple[list[str], int, str]]] = {
    "_offloaded_layer_count": [
        (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=4"], 1,
         r"model\.cpu_offloading_num_layers=4: CPU offloading can be done only for layers less than 4;"),
        (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=-1"], 1,
         r"CPU offloading can be done only for layers less than 4; "
         r"set model\.cpu_offloading_num_layers between 0 and 3"),
    ],
    "_auto_needs_its_switch": [
        (["model.cpu_offloading_num_layers=auto"], 1,
         r'model\.cpu_offloading_num_layers="auto": is chosen by the memory plan only with model\.cpu_offloading=true'),
        (["optimizer.optimizer_offload_fraction=auto"], 1,
         r'optimizer\.optimizer_offload_fraction="auto": is chosen by the memory plan only with '
         r"optimizer\.optimizer_cpu_offload=true"),
    ],
    "_switched_keys_need_their_switch": [
        (["optimizer.optimizer_offload_fraction=0.5"], 1,
         r"optimizer\.optimizer_offload_fraction=0\.5: acts only on the CPU-stepped part, which exists only with "
         r"optimizer\.optimizer_cpu_offload=true; set it, or set optimizer\.optimizer_offload_fraction=0\.0 "
         r"\(the default\)"),
        (["optimizer.cpu_optimizer_threads=4"], 1,
         r"optimizer\.cpu_optimizer_threads=4: acts only on the CPU-stepped part.*or unset "
         r"optimizer\.cpu_optimizer_threads"),
        (["model.cpu_offloading_num_layers=2"], 1,
         r"model\.cpu_offloading_num_layers=2: acts only on offloaded layers, which exist only with "
         r"model\.cpu_offloading=true"),
        (["optimizer.delayed_param_update_warmup=3"], 1,
         r"optimizer\.delayed_param_update_warmup=3: counts the exact steps before the delayed update starts; it "
         r"acts only with optimizer\.delayed_param_update=true"),
        (["model.fused_linear_cross_entropy_chunk_size=512"], 1,
         r"model\.fused_linear_cross_entropy_chunk_size=512: sizes the fused loss's chunks; it acts only with "
         r"model\.fused_linear_cross_entropy=true"),
    ],
    "_other_optimizers_keys": [
        (["optimizer.sgd_momentum=0.5"], 1,
         r'optimizer\.sgd_momentum=0\.5: is read only by the sgd optimizer, not optimizer\.optimizer="adam"; set '
         r"optimizer\.sgd_momentum=0\.9 \(the default\), or choose that optimizer"),
        (["optimizer.optimizer=sgd", "optimizer.adam_beta2=0.95"], 1,
         r'optimizer\.adam_beta2=0\.95: is read only by the adam optimizer, not optimizer\.optimizer="sgd"'),
    ],
    "_min_lr_needs_a_decay": [
        (["optimizer.min_lr=1e-5"], 1,
         r'optimizer\.min_lr=1e-05: is where a decaying schedule ends; optimizer\.lr_decay_style="constant" never '
         r'reaches it: set optimizer\.lr_decay_style="cosine" or "linear", or optimizer\.min_lr=0\.0'),
    ],
    "_offload_without_pipeline": [
        (CPU_OFFLOAD + ["model.pipeline_model_parallel_size=2"], 1,
         r"model\.pipeline_model_parallel_size=2: Currently there is no support for Pipeline parallelism with CPU "
         r"offloading"),
    ],
    "_offload_without_recompute": [
        (CPU_OFFLOAD + ["model.recompute_granularity=full"], 1,
         r'model\.recompute_granularity="full": CPU offloading does not work when activation recomputation is enabled'),
        (CPU_OFFLOAD + ["model.recompute_granularity=selective"], 1,
         r"CPU offloading does not work when activation recomputation is enabled; "
         r"set model\.recompute_granularity=null"),
    ],
    "_recomputed_layer_count": [
        (["model.recompute_num_layers=2"], 1,
         r'model\.recompute_num_layers=2: is read only with model\.recompute_granularity="full" \(now None\)'),
        (["model.recompute_granularity=selective", "model.recompute_num_layers=auto"], 1,
         r'model\.recompute_num_layers="auto": is read only with model\.recompute_granularity="full"'),
        (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=2", "model.recompute_granularity=full",
                        "model.recompute_num_layers=3"], 1,
         r"model\.recompute_num_layers=3: CPU offloading does not work when activation recomputation is enabled on "
         r"the same layer: 2 of 4 layers are offloaded and 3 would recompute after them; set "
         r"model\.recompute_num_layers between 0 and 2"),
        (["model.recompute_granularity=full", "model.recompute_num_layers=5"], 1,
         r"model\.recompute_num_layers=5: the model has 4 layers; set model\.recompute_num_layers between 0 and 4"),
        (CPU_OFFLOAD + ["model.implementation=megatron", "model.recompute_granularity=full",
                        "model.recompute_num_layers=1"], 1,
         r"model\.recompute_num_layers=1: CPU offloading does not work when activation recomputation is enabled in "
         r"megatron-core's GPT"),
    ],
    "_one_activation_offloading": [
        (CPU_OFFLOAD + ["model.fine_grained_activation_offloading=true", 'model.offload_modules=["mlp"]'], 1,
         r"fine_grained_activation_offloading cannot be enabled with cpu_offloading\."),
    ],
    "_offload_without_cuda_graphs": [
        (CPU_OFFLOAD + ["model.cuda_graph_impl=local"], 1,
         r'model\.cuda_graph_impl="local": CUDA graphs not supported with CPU offloading\.'),
        (CPU_OFFLOAD + ["model.cuda_graph_impl=transformer_engine"], 1,
         r"CUDA graphs not supported with CPU offloading\."),
    ],
    "_optimizer_offload_needs_distributed": [
        (["optimizer.optimizer_cpu_offload=True"], 1, re.escape(
            "optimizer.optimizer_cpu_offload=true: optimizer_cpu_offload requires use_distributed_optimizer=True "
            "(Megatron builds HybridDeviceOptimizer only inside the distributed optimizer)")),
    ],
    "_batch_arithmetic": [
        (["train.global_batch_size=12"], 1, re.escape(
            "train.global_batch_size=12: must be divisible by train.micro_batch_size (8) x data-parallel size (1) = 8; "
            "set train.global_batch_size to a multiple of 8")),
        (["train.global_batch_size=8"], 2, re.escape(
            "train.global_batch_size=8: must be divisible by train.micro_batch_size (8) "
            "x data-parallel size (2) = 16")),
    ],
    "_heads_divide_hidden": [
        (["model.hidden_size=130"], 1,
         r"model\.hidden_size=130: must be divisible by model\.num_attention_heads \(4\)"),
    ],
    "_min_lr_below_lr": [
        (["optimizer.min_lr=0.1"], 1, r"optimizer\.min_lr=0\.1: must be <= optimizer\.lr \(0\.0003\)"),
    ],
    "_file_sources_need_path": [
        (["data.source=text"], 1, r'data\.path=null: data\.source="text" reads a file; set data\.path'),
        (["data.source=tokens"], 1, r'data\.path=null: data\.source="tokens" reads a file'),
        (["data.path=corpus.txt"], 1,
         r'data\.path="corpus\.txt": is read only by data\.source "text" or "tokens"; set data\.source to the kind'),
        (["data.source=text", "data.path=x", "data.token_dtype=int32"], 1,
         r'data\.token_dtype="int32": is read only by data\.source "tokens", not "text"; unset'),
    ],
    "_half_params_need_half_precision": [
        (["train.params_dtype=half", "train.precision=fp32"], 1,
         r'train\.params_dtype="half": half weights need train\.precision "bf16" or "fp16", not "fp32"'),
    ],
    "_fp16_only_keys": [
        (["train.loss_scale=1024"], 1,
         r'train\.loss_scale=1024: is used only with train\.precision="fp16", not "bf16"'),
        (["train.initial_loss_scale=1024", "train.precision=fp32"], 1,
         r'train\.initial_loss_scale=1024: is used only with train\.precision="fp16", not "fp32"'),
        (["train.loss_scale_window=10"], 1, r'train\.loss_scale_window=10: is used only with train\.precision="fp16"'),
    ],
    "_fine_grained_needs_modules": [
        (["model.fine_grained_activation_offloading=true"], 1,
         r"model\.offload_modules=\[\]: model\.fine_grained_activation_offloading=true needs the sub-modules"),
        (['model.offload_modules=["mlp"]'], 1,
         r'model\.offload_modules=\["mlp"\]: are offloaded only with model\.fine_grained_activation_offloading=true'),
    ],
    "_megatron_optimizer_options": [
        (["optimizer.implementation=megatron", "optimizer.cpu_optimizer_threads=4"], 1,
         r"optimizer\.cpu_optimizer_threads=4: applies only to optimizer\.implementation='engine'"),
        (["optimizer.implementation=megatron", "optimizer.use_torch_optimizer_for_cpu_offload=true"], 1,
         r"optimizer\.use_torch_optimizer_for_cpu_offload=true: applies only to"),
        (["optimizer.implementation=megatron", "optimizer.cpu_optimizer_pin_threads=true"], 1,
         r"optimizer\.cpu_optimizer_pin_threads=true: applies only to optimizer\.implementation='engine'"),
        (["optimizer.implementation=megatron"] + DPU, 1,
         r"optimizer\.delayed_param_update=true: applies only to optimizer\.implementation='engine'"),
        (["optimizer.implementation=megatron", "optimizer.cpu_offload_gpu_assist=true",
          "optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true"], 1,
         r"optimizer\.cpu_offload_gpu_assist=true: applies only to optimizer\.implementation='engine'"),
    ],
    "_gpu_assist_needs_engine_adam_offload": [
        (["optimizer.cpu_offload_gpu_assist=true"], 1,
         r"optimizer\.cpu_offload_gpu_assist=true: assists the CPU-stepped part, which exists only with"),
        (["optimizer.cpu_offload_gpu_assist=true", "optimizer.optimizer_cpu_offload=true",
          "optimizer.use_distributed_optimizer=true", "optimizer.optimizer=sgd"], 1,
         r"optimizer\.cpu_offload_gpu_assist=true: works with the engine's own AdamW only"),
    ],
    "_precision_aware_optimizer": [
        (["optimizer.main_params_dtype=fp16"], 1, r"optimizer\.main_params_dtype=\"fp16\": is built for fp32 only"),
        (["optimizer.main_grads_dtype=bf16"], 1, r"optimizer\.main_grads_dtype=\"bf16\": is built for fp32 only"),
        (["optimizer.exp_avg_dtype=fp8"], 1, r"optimizer\.exp_avg_dtype=\"fp8\": fp8 states are not built here"),
        (["optimizer.exp_avg_dtype=bf16"], 1, r"needs optimizer\.use_precision_aware_optimizer=true"),
        (["optimizer.exp_avg_sq_dtype=fp16", "optimizer.use_precision_aware_optimizer=true"], 1,
         r"optimizer\.exp_avg_sq_dtype=\"fp16\": fp16 moments are stored unscaled here: the second moments of "
         r"small gradients underflow to 0"),
        (["optimizer.exp_avg_dtype=fp16", "optimizer.use_precision_aware_optimizer=true"], 1,
         r"optimizer\.exp_avg_dtype=\"fp16\": fp16 moments are stored unscaled here: small first moments lose "
         r"their precision .*; use 'bf16'"),
        (["optimizer.exp_avg_dtype=fp16"], 1, r"optimizer\.exp_avg_dtype=\"fp16\": fp16 moments are stored "
                                              r"unscaled"),  # the reason, not the switch: setting it would not help
        (["optimizer.exp_avg_sq_dtype=bf16", "optimizer.use_precision_aware_optimizer=true",
          "optimizer.cpu_offload_gpu_assist=true"], 1,
         r"optimizer\.exp_avg_sq_dtype=\"bf16\": does not combine with optimizer\.cpu_offload_gpu_assist=true"),
        (["optimizer.exp_avg_sq_dtype=bf16", "optimizer.use_precision_aware_optimizer=true",
          "optimizer.optimizer=sgd"], 1, r"narrows the engine's own AdamW's states only \(both parts"),
    ],
    "_layers_path_needs_offloading": [
        (["model.cpu_offloading_layers_path=layers"], 1,
         r"model\.cpu_offloading_layers_path=\"layers\": is read only by activation offloading"),
    ],
    "_use_te": [
        (["model.use_te=true", "model.recompute_granularity=selective"], 1,
         r"model\.recompute_granularity=\"selective\": the built-in GPT's selective recompute is not built for "
         r"Transformer Engine layers"),
    ],
    "_fp8": [  # the rest (TE, CUDA, the GPU's compute capability, a model of your own): tests/test_fp8.py
        (["train.fp8=e4m3"], 1, r"train\.fp8=\"e4m3\": FP8 runs in Transformer Engine layers only; set model\.use_te"),
        (["train.fp8=hybrid", "model.recompute_granularity=full"], 1,
         r"model\.recompute_granularity=\"full\": recompute re-runs layers in backward, outside the forward's FP8"),
    ],
    "_fp8_delayed_only_keys": [
        (["train.fp8_margin=1"], 1, r"train\.fp8_margin=1: acts only with train\.fp8 set and "
                                    r"train\.fp8_recipe=\"delayed\""),
        (["train.fp8_recipe=tensorwise"], 1, r'train\.fp8_recipe="tensorwise": acts only with train\.fp8 set; set '
                                             r'train\.fp8, or set train\.fp8_recipe="delayed" \(the default\)'),
    ],
    "_checkpoint_keys_need_their_folder": [
        (["checkpoint.keep_last=2"], 1, r"checkpoint\.keep_last=2: acts only with checkpoint\.save set; set "),
        (["checkpoint.save_interval=5"], 1, r"checkpoint\.save_interval=5: acts only with checkpoint\.save set"),
        (["checkpoint.load_if_exists=true"], 1,
         r"checkpoint\.load_if_exists=true: acts only with checkpoint\.load set; set checkpoint\.load or unset"),
    ],
    "_delayed_update_needs_a_cpu_part": [
        (["optimizer.delayed_param_update=true"], 1, re.escape(
            "optimizer.delayed_param_update=true: delays the update of the CPU-stepped part, which exists only with "
            "optimizer.optimizer_cpu_offload=true and optimizer.optimizer_offload_fraction > 0; set them, or set "
            "optimizer.delayed_param_update=false")),
        (DPU[:-1] + ["optimizer.optimizer_offload_fraction=0"], 1, r"delayed_param_update=true: delays the update"),
        (DPU + ["train.global_batch_size=16"], 2, re.escape(
            "optimizer.delayed_param_update=true: is built for one rank; with 2 data-parallel ranks")),
        (DPU + ["optimizer.cpu_offload_gpu_assist=true"], 1, re.escape(
            "optimizer.delayed_param_update=true: does not combine with optimizer.cpu_offload_gpu_assist=true")),
    ],
    "_megatron_optimizer_unsharded": [
        (["optimizer.implementation=megatron", "optimizer.use_distributed_optimizer=true",
          "train.global_batch_size=16"], 2, re.escape(
            "optimizer.use_distributed_optimizer=true: shards only optimizer.implementation='engine'; megatron-core's "
            "optimizer across 2 data-parallel ranks is not built in offload-engine: set "
            "optimizer.implementation='engine' or run one rank")),
    ],
    # fires only where tensorboard does not import: tests/test_reliability.py hides it and checks the message
    "_tensorboard_installed": [],
    "_warmup_within_the_schedule": [
        (["optimizer.lr_warmup_iters=101"], 1,
         r"optimizer\.lr_warmup_iters=101: must be <= train\.train_iters \(100\)"),
        (["optimizer.lr_warmup_iters=2001", "optimizer.lr_decay_iters=2000"], 1,
         r"optimizer\.lr_warmup_iters=2001: must be <= optimizer\.lr_decay_iters \(2000\)"),
    ],
}  # fmt: skip

# The same rules on values that must pass them (the rule's message must be absent).
RULE_PASSES: list[tuple[list[str], int, str]] = [
    (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=3"], 1, "CPU offloading can be done only"),
    (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=0"], 1, "CPU offloading can be done only"),
    (["model.cpu_offloading_num_layers=9"], 1, "CPU offloading can be done only"),  # offloading off: not checked
    (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=auto"], 1, "CPU offloading can be done only"),
    (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=auto"], 1, "is chosen by the memory plan"),
    (
        [
            "optimizer.optimizer_cpu_offload=true",
            "optimizer.use_distributed_optimizer=true",
            "optimizer.optimizer_offload_fraction=auto",
        ],
        1,
        "is chosen by the memory plan",
    ),
    (["model.recompute_granularity=full"], 1, "activation recomputation"),
    # a counted block of recomputed layers after the offloaded ones: disjoint, so the seed's rule does not fire
    (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=2", *FULL, "model.recompute_num_layers=2"], 1, "recomputation"),
    (CPU_OFFLOAD + ["model.cpu_offloading_num_layers=auto", *FULL, "model.recompute_num_layers=auto"], 1, "recomput"),
    (["model.recompute_granularity=full", "model.recompute_num_layers=4"], 1, "recompute_num_layers"),
    (["optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true"], 1, "requires use_distrib"),
    (DPU, 1, "delayed_param_update"),
    (["train.global_batch_size=16", "train.micro_batch_size=4"], 2, "must be divisible"),
    (["train.global_batch_size=24", "train.micro_batch_size=4"], 1, "must be divisible"),
    (["optimizer.min_lr=0.0003", "optimizer.lr_decay_style=linear"], 1, "min_lr"),
    (["train.precision=fp16", "train.loss_scale=1024", "train.loss_scale_window=10"], 1, "fp16"),
    (["train.params_dtype=half", "train.precision=fp16"], 1, "half weights need"),
    (["optimizer.lr_warmup_iters=100"], 1, "lr_warmup_iters"),
    (["optimizer.lr_warmup_iters=2000", "optimizer.lr_decay_iters=20000"], 1, "lr_warmup_iters"),  # a run's start
    (["data.source=tokens", "data.path=x", "data.token_dtype=int32"], 1, "is read only by"),
    (["checkpoint.save=x", "checkpoint.keep_last=2", "checkpoint.save_interval=5"], 1, "acts only with"),
    (["checkpoint.load=x", "checkpoint.load_if_exists=true"], 1, "acts only with"),
    (
        [
            "optimizer.optimizer_cpu_offload=true",
            "optimizer.use_distributed_optimizer=true",
            "optimizer.optimizer_offload_fraction=0.5",
            "optimizer.pin_cpu_grads=false",
            "optimizer.cpu_optimizer_threads=2",
            "optimizer.speculation_buffer_mb=64",
        ],
        1,
        "acts only on the CPU-stepped part",
    ),
    (
        CPU_OFFLOAD + ["model.cpu_offloading_num_layers=2", "model.cpu_offloading_double_buffering=true"],
        1,
        "acts only on offloaded layers",
    ),
    (DPU + ["optimizer.delayed_param_update_warmup=3"], 1, "counts the exact steps"),
    (["optimizer.optimizer=sgd", "optimizer.sgd_momentum=0.5"], 1, "is read only by"),
    (["optimizer.adam_beta2=0.95", "optimizer.adam_eps=1e-6"], 1, "is read only by"),
    (["optimizer.lr_decay_style=cosine", "optimizer.min_lr=1e-5"], 1, "decaying schedule"),
]


def test_every_rule_has_cases():
    assert {rule.__name__ for _, rule in RULES} == set(RULE_CASES)


@pytest.mark.parametrize(
    ("overrides", "dp", "pattern"),
    [case for cases in RULE_CASES.values() for case in cases],
    ids=[f"{name}-{i}" for name, cases in RULE_CASES.items() for i in range(len(cases))],
)
def test_rule_message(overrides, dp, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config({}, overrides, data_parallel_size=dp)


@pytest.mark.parametrize(("overrides", "dp", "absent"), RULE_PASSES)
def test_rule_passes(overrides, dp, absent):
    errors = errors_of(overrides, dp=dp)
    assert not any(absent in e for e in errors), errors


# a value other than the default for every key read only under a switch
SWITCHED_VALUES = {
    "optimizer.optimizer_offload_fraction": 0.25, "optimizer.overlap_cpu_optimizer_d2h_h2d": True,
    "optimizer.use_torch_optimizer_for_cpu_offload": True, "optimizer.pin_cpu_grads": False,
    "optimizer.pin_cpu_params": False, "optimizer.cpu_optimizer_threads": 3,
    "optimizer.cpu_optimizer_pin_threads": True,
    "optimizer.speculation_buffer_mb": 64, "model.cpu_offloading_num_layers": 1,
    "model.cpu_offloading_activations": False, "model.cpu_offloading_weights": True,
    "model.cpu_offloading_double_buffering": True, "optimizer.delayed_param_update_warmup": 3,
    "model.fused_linear_cross_entropy_chunk_size": 256,
}  # fmt: skip


def test_every_key_read_only_under_a_switch_is_refused_while_the_switch_is_off():
    from engine.config.rules import SWITCHED_KEYS

    table = {key: switch for switch, _, keys in SWITCHED_KEYS for key in keys}
    assert set(table) == set(SWITCHED_VALUES)
    for key, value in SWITCHED_VALUES.items():
        errors = errors_of([f"{key}={json.dumps(value)}"])
        assert len(errors) == 1 and errors[0].startswith(f"{key}=") and f"{table[key]}=true" in errors[0], errors


def test_a_mechanism_states_its_rule_in_the_config_rule_s_words():
    """The built-in GPT and the CPU side check what the config's rules check, for callers without a config: one
    text each (engine.messages), so the two never drift apart."""
    from engine.models.gpt import GPT
    from engine.optim import HybridDeviceOptimizer, HybridOptions

    rule = errors_of(["model.hidden_size=30", "model.num_attention_heads=4"])
    with pytest.raises(ValueError) as built:
        GPT(num_layers=1, hidden_size=30, num_attention_heads=4, seq_length=8, vocab_size=16)
    assert (
        [str(built.value)]
        == rule
        == [
            "model.hidden_size=30: must be divisible by model.num_attention_heads (4); change model.hidden_size or "
            "model.num_attention_heads"
        ]
    )
    rule = errors_of(
        [
            "optimizer.cpu_offload_gpu_assist=true",
            "optimizer.optimizer=sgd",
            "optimizer.optimizer_cpu_offload=true",
            "optimizer.use_distributed_optimizer=true",
        ]
    )
    model = GPT(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=8, vocab_size=16)
    with pytest.raises(ValueError) as built:
        HybridDeviceOptimizer(model.named_parameters(), HybridOptions(optimizer="sgd", lr=0.1, offload_fraction=0.5,
                              gpu_assist=True))._build()  # fmt: skip
    assert len(rule) == 1 and rule[0].split(": ", 1)[1] == str(built.value).removeprefix("gpu_assist=True ")
    from engine.offload import apply_activation_offloading

    rule = errors_of(["model.num_layers=1", "model.cpu_offloading=true", "model.cpu_offloading_num_layers=1"])
    with pytest.raises(ValueError) as built:
        apply_activation_offloading(model, num_layers=1)
    said, (rule_start, rule_fix) = str(built.value), rule[0].split("; ")
    assert said.startswith(rule_start + " (found ") and said.endswith("; " + rule_fix), (said, rule)


def test_world_size_rules_run_again_on_the_validated_config():
    """initialize checks a loaded Config at the process group's size with the rules that read it, only those."""
    from engine.config import check_world_size

    cfg = load_config({}, ["train.global_batch_size=8", "train.micro_batch_size=4"])
    check_world_size(cfg, 2)
    with pytest.raises(ConfigError) as caught:
        check_world_size(cfg, 4)
    assert caught.value.errors == [
        "train.global_batch_size=8: must be divisible by train.micro_batch_size (4) x data-parallel size (4) = 16; "
        "set train.global_batch_size to a multiple of 16 (e.g. 16) or lower train.micro_batch_size"
    ]
    megatron = load_config(cfg, ["optimizer.implementation=megatron", "optimizer.use_distributed_optimizer=true"])
    check_world_size(megatron, 1)
    with pytest.raises(ConfigError, match=r"^optimizer.use_distributed_optimizer=true: shards only [^\n]*$"):
        check_world_size(megatron, 2)


def test_no_message_cites_an_issue_number():
    """User-facing text names keys and fixes; internal issue numbers mean nothing to a user."""
    root = Path(__file__).resolve().parent.parent / "engine"
    cited = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bissue \d", line, re.IGNORECASE)]  # fmt: skip
    assert cited == []


def test_valid_file_dataset_loads(tmp_path):
    cfg = load_config({"data": {"source": "tokens", "path": str(tmp_path / "t.bin")}})
    assert cfg.data.path == str(tmp_path / "t.bin")


def test_data_parallel_size_defaults_to_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"x data-parallel size \(2\) = 16"):
        load_config({})
    assert load_config({}, ["train.micro_batch_size=4"]).train.micro_batch_size == 4
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two': expected an integer"):
        load_config({})


def test_several_rules_fire_together():
    errors = errors_of(CPU_OFFLOAD + ["model.recompute_granularity=full", "model.cuda_graph_impl=local",
                                      "model.cpu_offloading_num_layers=4"])  # fmt: skip
    for text in ["CPU offloading can be done only for layers less than 4",
                 "CPU offloading does not work when activation recomputation is enabled",
                 "CUDA graphs not supported with CPU offloading."]:  # fmt: skip
        assert sum(text in e for e in errors) == 1, errors


# --- options whose mechanism is not built yet ------------------------------------------------------------

# path -> (overrides that need the mechanism, data-parallel size); every NOT_BUILT row needs an example.
NOT_BUILT_EXAMPLES: dict[str, tuple[list[str], int]] = {
    "model.cuda_graph_impl": (["model.cuda_graph_impl=local"], 1),
    "model.pipeline_model_parallel_size": (["model.pipeline_model_parallel_size=2"], 1),
}  # fmt: skip


@pytest.mark.parametrize("row", NOT_BUILT, ids=[row.path for row in NOT_BUILT])
def test_not_built_is_rejected_with_its_issue(row):
    overrides, dp = NOT_BUILT_EXAMPLES[row.path]
    errors = errors_of(overrides, dp=dp)
    expected = re.compile(re.escape(f"{row.path}=") + r".+: " + re.escape(f"{row.what} in offload-engine; {row.fix}"))
    assert errors == [e for e in errors if expected.fullmatch(e)] and len(errors) == 1, errors


def test_not_built_messages_read_well():
    assert errors_of(["model.cuda_graph_impl=local"]) == [
        'model.cuda_graph_impl="local": CUDA graphs are not supported in offload-engine; '
        'set model.cuda_graph_impl="none"'
    ]


def test_distributed_optimizer_on_one_rank_is_accepted():
    assert load_config({}, ["optimizer.use_distributed_optimizer=true"]).optimizer.use_distributed_optimizer


def test_reference_pipeline_message_takes_precedence():
    errors = errors_of(CPU_OFFLOAD + ["model.pipeline_model_parallel_size=2"])
    assert any("Currently there is no support for Pipeline parallelism with CPU offloading" in e for e in errors)
    assert not any("pipeline parallelism is not supported" in e for e in errors), errors


def test_not_built_table_shrinks_cleanly(monkeypatch):
    monkeypatch.setattr(config_module, "NOT_BUILT", ())
    cfg = load_config({}, CPU_OFFLOAD + ["model.cpu_offloading_num_layers=2", "model.cuda_graph_impl=none"])
    assert (cfg.model.cpu_offloading, cfg.model.cpu_offloading_num_layers) == (True, 2)


# --- the generated reference --------------------------------------------------------------------------------


def test_rendered_reference_has_every_key():
    table = render_markdown()
    for section, props in section_properties().items():
        for key, prop in props.items():
            assert f"| {section} | `{key}` |" in table, key
            assert prop["description"].replace("|", "\\|") in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == sum(len(p) for p in section_properties().values())
    assert '| optimizer | `optimizer_offload_fraction` | number or "auto" | `0.0` | [0.0, 1.0] |' in table


def test_write_and_check(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{START}\nold table\n{END}\n\nafter\n")
    assert main(["--check", str(readme)]) == 1
    assert "stale" in capsys.readouterr().out
    assert main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"# title\n\n{START}\n| section |") and text.endswith(f"{END}\n\nafter\n")
    assert "old table" not in text
    assert main(["--check", str(readme)]) == 0
    assert main(["--write", str(readme)]) == 0 and readme.read_text() == text  # idempotent


def test_write_without_markers_fails(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert main(["--write", str(readme)]) == 2
    assert "config-reference:start" in capsys.readouterr().err
    assert readme.read_text() == "# no markers\n"


@pytest.mark.parametrize("installed", [False, True])
def test_use_te_needs_transformer_engine_and_cuda(monkeypatch, installed):
    from engine import extras as availability

    monkeypatch.setattr(availability, "te_available", lambda: installed)
    monkeypatch.setattr(availability, "_import_error", lambda module: "absent")
    errors = errors_of(["model.use_te=true", "train.device=cpu"])
    if installed:
        assert any(
            re.fullmatch(
                r"model\.use_te=true: Transformer Engine layers run on CUDA only; set train\.device="
                r'"auto" or "cuda", or model\.use_te=false',
                e,
            )
            for e in errors
        ), errors
        assert not errors_of(["model.use_te=true", "train.device=auto"])
    else:
        want = "model.use_te=true: needs Transformer Engine: pip install -e '.[te]', or set model.use_te=false"
        assert want in errors
