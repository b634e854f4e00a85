"""The model's side of the memory plan: its parameters in the optimizer's order, its layers, its activations.

The built-in GPT is built on the meta device (`with torch.device("meta")`): every parameter's name and shape,
no storage. A user's model is read as it is (names, shapes, dtypes and where it lives); its activations are
measured by engine.planning.activations when asked. Nothing here depends on the offload fraction or on how many
layers are offloaded, so "auto" evaluates many of those against one census.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from engine.build import gpt_shape
from engine.config import Config
from engine.models.linear_cross_entropy import fused_linear_cross_entropy_bytes
from engine.optim.distributed import partition
from engine.optim.partition import forward_order, unit_of
from engine.planning.activations import Activations, gpt_activations, measured_activations
from engine.planning.runs import ParamRun, runs_of
from engine.precision import autocast

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class Sized:
    """A parameter's element count where the split (engine.optim.partition) expects a tensor."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n


@dataclass(frozen=True)
class Census:
    """The model as the plan sees it. Its trainable parameters, in forward order (the hybrid optimizer's), are
    `runs` (engine.planning.runs: identical consecutive layers stored once with a count), given as such or
    derived from `named` and `layer_of`."""

    weight_bytes: int  # every parameter and buffer as training holds it on the device
    n_layers: int
    activations: Activations
    builtin: bool
    named: list[tuple[str, Sized]] | None = None  # trainable parameters, forward order (None: given as runs)
    layer_of: dict[str, int | None] | None = None  # the transformer layer of each name; None: outside the layers
    runs: tuple[ParamRun, ...] = ()
    host_model_bytes: int = 0  # a given model's bytes now in host memory (freed when it moves to the GPU)
    notes: tuple[str, ...] = ()
    batch_seen: bool = True  # a user's model: its activations measured at a batch of its own (else not claimed)
    split_cache: dict = field(default_factory=dict)  # the plan's per-fraction figures (engine.planning.memory)

    def __post_init__(self) -> None:
        if not self.runs and self.named:
            names = [n for n, _ in self.named]
            object.__setattr__(self, "runs", runs_of([(n, p.n) for n, p in self.named], _groups(names, self.layer_of)))

    @functools.cached_property
    def parameters(self) -> int:
        return sum(r.size * r.count for r in self.runs)

    @functools.cached_property
    def layer_pieces(self) -> list[tuple[int, int, int]]:
        """(first layer, end, elements per layer) covering every layer's parameters."""
        out = []
        for r in self.runs:
            if r.count > 1:
                out.append((r.layer(0), r.layer(r.count), r.size))
            else:
                out += [(g, g + 1, n) for g, n in zip(r.groups, r.numels, strict=True) if isinstance(g, int)]
        return out

    @functools.cached_property
    def side_numel(self) -> dict[str, int]:
        """Elements outside the layers: "input" (before the first layer) and "output" sides."""
        out = {"input": 0, "output": 0}
        for r in self.runs:
            for g, n in zip(r.groups, r.numels, strict=True):
                if isinstance(g, str):
                    out[g] += n * r.count
        return out

    @functools.cached_property
    def activation_runs(self) -> list[tuple[int, int, list]]:
        """(first layer, end, saved storages) of consecutive layers that save the same list."""
        out: list[tuple[int, int, list]] = []
        for i, entries in enumerate(self.activations.layers):
            if out and out[-1][2] is entries:
                out[-1] = (out[-1][0], i + 1, entries)
            else:
                out.append((i, i + 1, entries))
        return out

    def owned_runs(self, world: int) -> tuple[ParamRun, ...]:
        """The runs of the parameters the busiest of `world` ranks owns (engine.optim.distributed's partition),
        parameter by parameter: the distributed optimizer's shards do not repeat layer by layer."""
        key = ("owned", world)
        if key not in self.split_cache:
            named = self.expanded()
            owners = partition([x for _, x, _ in named], world)
            loads = [0] * world
            for (_, x, _), o in zip(named, owners, strict=True):
                loads[o] += x
            busiest = max(range(world), key=lambda r: loads[r])
            mine = [(n, x, g) for (n, x, g), o in zip(named, owners, strict=True) if o == busiest]
            self.split_cache[key] = runs_of([(n, x) for n, x, _ in mine], [g for _, _, g in mine], compress=False)
        return self.split_cache[key]

    def expanded(self) -> list[tuple[str, int, int | str]]:
        """Every trainable (name, numel, gradient group), forward order (slow at great depth: for tests)."""
        out = []
        for r in self.runs:
            for j in range(r.count):
                out += [(n, x, g + j if isinstance(g, int) else g)
                        for (n, x), g in zip(r.named(j), r.groups, strict=True)]  # fmt: skip
        return out

    def truncated(self, layers: int, weight_elem: int) -> Census:
        """The same model with only its first `layers` layers (for "what depth would fit"), each layer's
        weights taken as the first's parameters at weight_elem bytes each."""
        per_layer = weight_elem * sum(n for a, b, n in self.layer_pieces if a <= 0 < b)
        runs = []
        for r in self.runs:
            if r.count > 1:
                keep = max(0, min(r.count, layers - r.layer(0)))
                runs += [replace(r, count=keep)] if keep else []
                continue
            idx = [i for i, g in enumerate(r.groups) if not isinstance(g, int) or g < layers]
            if idx:
                runs.append(ParamRun(*(tuple(getattr(r, f)[i] for i in idx) for f in ("names", "numels", "units",
                                                                                       "groups"))))  # fmt: skip
        acts = replace(self.activations, layers=self.activations.layers[:layers])
        return Census(
            runs=tuple(runs),
            n_layers=layers,
            activations=acts,
            weight_bytes=self.weight_bytes - (self.n_layers - layers) * per_layer,
            builtin=self.builtin,
            host_model_bytes=self.host_model_bytes,
            notes=self.notes,
            batch_seen=self.batch_seen,
        )


def _groups(names: list[str], layer_of: dict[str, int | None] | None) -> list[int | str]:
    """Each name's gradient group: its layer, else "input" before the first layer's parameters, "output" after."""
    layer_of = layer_of or {}
    first = next((i for i, n in enumerate(names) if layer_of.get(n) is not None), len(names))
    return [g if (g := layer_of.get(n)) is not None else ("output" if i > first else "input")
            for i, n in enumerate(names)]  # fmt: skip


def _training_bytes(t: torch.Tensor, half: bool) -> int:
    # initialize casts the whole model to the half dtype under train.params_dtype="half"
    size = 2 if half and t.dtype in _FLOATS else t.element_size()
    return t.numel() * size


def builtin_census(cfg: Config, *, cuda: bool, num_layers: int | None = None) -> Census:
    """The built-in GPT of `model.*` (num_layers: another depth, for "what would fit"), on the meta device."""
    from engine.models.gpt import GPT

    m, t = cfg.model, cfg.train
    layers = m.num_layers if num_layers is None else num_layers
    shape = gpt_shape(m, layers)
    ffn = shape["ffn_hidden_size"]
    # identical layers are counted once: the GPT is built at two layers and its layer run given the depth
    built = min(layers, 2)
    with torch.device("meta"):
        model = GPT(**gpt_shape(m, built))
    half = t.params_dtype == "half"
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    order = forward_order([n for n, _ in named])
    by_name = dict(named)
    runs = runs_of([(n, by_name[n].numel()) for n in order], _groups(order, {n: _layer_index(n) for n in order}))
    runs = tuple(replace(r, count=layers) if r.count == built > 1 else r for r in runs)
    tensors = [(n, x) for n, x in [*model.named_parameters(), *model.named_buffers()]]
    per_layer = sum(_training_bytes(x, half) for n, x in tensors if n.startswith("layers.0."))
    outside = sum(_training_bytes(x, half) for n, x in tensors if _layer_index(n) is None)
    acts = gpt_activations(num_layers=layers, hidden=m.hidden_size, ffn=ffn, heads=m.num_attention_heads,
                           seq=m.seq_length, vocab=m.vocab_size, micro_batch=t.micro_batch_size,
                           precision=t.precision, params_dtype=t.params_dtype, recompute=m.recompute_granularity,
                           cuda=cuda)  # fmt: skip
    notes = []
    if m.use_te:
        notes.append("Transformer Engine layers are planned as the built-in GPT's of the same shape")
    return Census(
        runs=runs,
        weight_bytes=outside + layers * per_layer,
        n_layers=layers,
        activations=acts,
        builtin=True,
        notes=tuple(notes),
    )


def _layer_index(name: str) -> int | None:
    unit = unit_of(name)
    head, _, idx = unit.rpartition(".")
    return int(idx) if head == "layers" and idx.isdigit() else None


def model_census(
    cfg: Config,
    model: nn.Module,
    *,
    cuda: bool,
    measure: bool = True,
    example_input: Callable[[int, int, torch.device], tuple[Any, ...]] | None = None,
    example_batch: Any = None,
    loss_fn: Any = None,
    batch_name: str = "example batch",
) -> Census:
    """A user's model: its parameters counted; its activations measured at `example_batch` (one micro-batch,
    engine.planning.batch), else its first layer's at model.seq_length (measure=False: not), which is a guess: the
    plan then claims no fit."""
    from engine.offload.discovery import find_layer_stacks

    t = cfg.train
    half = t.params_dtype == "half"
    named_all = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    order = forward_order([n for n, _ in named_all])
    by_name = dict(named_all)
    notes: list[str] = []
    try:
        # every stack in forward order (an encoder-decoder's two), as activation offloading counts them
        stacks = find_layer_stacks(model, cfg.model.cpu_offloading_layers_path)
        layers = [layer for _, stack in stacks for layer in stack]
    except ValueError as e:
        layers = None
        notes.append(f"no transformer layers found ({e}); activations not planned")
    layer_of: dict[str, int | None] = dict.fromkeys(order)
    if layers is not None:
        index = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
        layer_of = {n: index.get(id(by_name[n])) for n in order}
    tensors = [*model.parameters(), *model.buffers()]
    host = sum(x.numel() * x.element_size() for x in tensors if x.device.type == "cpu")
    acts = Activations(layers=[[] for _ in range(len(layers) if layers is not None else 0)], head=[],
                       logits_transient=0, backward_working=0, source="not measured")  # fmt: skip
    seen = example_batch is not None
    if layers is not None and seen:
        acts = _measure_batch(cfg, model, layers, example_batch, loss_fn, notes, batch_name)
    elif layers is not None and not measure and _is_builtin_gpt(model):
        acts = _builtin_gpt_activations(cfg, model, cuda)  # its batches are model.seq_length x the micro-batch
    elif layers is not None and measure:
        acts = _measure(cfg, model, layers, example_input, notes)
        notes.append(f"activations measured at model.seq_length={cfg.model.seq_length}, a guess: no batch of "
                     "the model's own was seen, so the plan claims no fit; pass example_batch=")  # fmt: skip
    elif layers is not None:
        notes.append("activations of the given model not measured (a CPU run's pre-flight skips the forward)")
    return Census(
        named=[(n, Sized(by_name[n].numel())) for n in order],
        layer_of=layer_of,
        weight_bytes=sum(_training_bytes(x, half) for x in tensors),
        n_layers=len(layers) if layers is not None else 0,
        activations=acts,
        builtin=False,
        host_model_bytes=host,
        notes=tuple(notes),
        batch_seen=seen or layers is None or _is_builtin_gpt(model),
    )


def _is_builtin_gpt(model: nn.Module) -> bool:
    """An instance of the built-in GPT: model.seq_length and the micro-batch describe its batches."""
    from engine.models.gpt import GPT

    return isinstance(model, GPT)


def _builtin_gpt_activations(cfg: Config, model: nn.Module, cuda: bool) -> Activations:
    """A built-in GPT given to initialize without a batch: the saved storages of the formula the plan of the GPT it
    builds counts (builtin_census), at the given model's own widths; the config's where its layers do not tell
    (Transformer Engine layers)."""
    m, t = cfg.model, cfg.train
    first = model.layers[0] if len(model.layers) else None
    attn, mlp = getattr(first, "attn", None), getattr(first, "mlp", None)
    shape = gpt_shape(m, len(model.layers))
    selective = bool(getattr(attn, "recompute_core", False)) or m.recompute_granularity == "selective"
    acts = gpt_activations(num_layers=len(model.layers), hidden=model.embedding.embedding_dim,
                           ffn=mlp.fc1.out_features if hasattr(mlp, "fc1") else shape["ffn_hidden_size"],
                           heads=getattr(attn, "num_heads", m.num_attention_heads), seq=m.seq_length,
                           vocab=model.output.out_features, micro_batch=t.micro_batch_size, precision=t.precision,
                           params_dtype=t.params_dtype, recompute="selective" if selective else m.recompute_granularity,
                           cuda=cuda)  # fmt: skip
    return _with_fused_loss(cfg, model, acts, t.micro_batch_size * m.seq_length)


def _precision_context(cfg: Config, model: nn.Module, notes: list[str]):
    """(autocast context or None, float dtype of the inputs) the training forward will run under."""
    t = cfg.train
    first = next(model.parameters())
    half_now = first.dtype in (torch.float16, torch.bfloat16)
    ctx = None
    if t.precision != "fp32" and not half_now and first.device.type in ("cpu", "cuda"):
        ctx = autocast(first.device, t.precision, "fp32")
        if t.params_dtype == "half":
            notes.append("fp32 model measured under autocast before its cast to half weights: the residual "
                         "stream is counted at fp32")  # fmt: skip
    return ctx, (first.dtype if half_now else None)


def _measure_batch(cfg: Config, model: nn.Module, layers: list, batch: Any, loss_fn: Any, notes: list[str],
                   name: str) -> Activations:  # fmt: skip
    from engine.planning.batch import batch_rows, measure_batch

    rows, mbs = batch_rows(batch), cfg.train.micro_batch_size
    if rows is not None and rows != mbs:
        given = "example_batch" if name == "example batch" else f"the {name}"
        raise ValueError(f"{given} has {rows} rows and train.micro_batch_size={mbs}: pass one "
                         f"micro-batch of {mbs} rows (the plan measures what one micro-batch holds)")  # fmt: skip
    ctx, float_dtype = _precision_context(cfg, model, notes)
    acts = measure_batch(model, layers, batch, loss_fn=loss_fn, autocast=ctx, float_dtype=float_dtype,
                         fused=_fused_loss(cfg, model, loss_fn), batch_name=name)  # fmt: skip
    if cfg.train.params_dtype == "half" and ctx is not None:  # the cast's copies will not exist under half weights
        acts = replace(acts, layers=[[s for s in ly if not s.weight_copy] for ly in acts.layers],
                       head=[s for s in acts.head if not s.weight_copy])  # fmt: skip
    return acts


def _fused_loss(cfg: Config, model: nn.Module, loss_fn: Any) -> tuple[nn.Module, int] | None:
    """(output head, chunk tokens) when model.fused_linear_cross_entropy computes the loss (beside a loss_fn the
    engine refuses it; so does engine.batch.fused_loss_head for a model without an output head)."""
    if not cfg.model.fused_linear_cross_entropy or loss_fn is not None:
        return None
    from engine.batch import fused_loss_head

    return fused_loss_head(model, True, None, cfg.model.fused_linear_cross_entropy_chunk_size)


def _with_fused_loss(cfg: Config, model: nn.Module, acts: Activations, tokens: int) -> Activations:
    """The guessed activations with the fused loss's bytes in place of the whole logits' (log-softmax and its
    gradients), where model.fused_linear_cross_entropy is on."""
    fused = _fused_loss(cfg, model, None)
    if fused is None:
        return acts
    head, chunk = fused
    itemsize = 4 if cfg.train.precision == "fp32" else 2
    held = fused_linear_cross_entropy_bytes(tokens, head.in_features, head.out_features, chunk, itemsize)
    return replace(acts, head=[s for s in acts.head if s.what != "log_softmax.out"], logits_transient=held)


def _measure(cfg: Config, model: nn.Module, layers: nn.ModuleList, example_input, notes: list[str]) -> Activations:
    t, m = cfg.train, cfg.model
    first = next(model.parameters())
    half_now = first.dtype in (torch.float16, torch.bfloat16)
    precision = t.precision
    a = 4 if precision == "fp32" else 2
    will_be_half = half_now or t.params_dtype == "half"
    r = 4 if (precision == "fp32" or not will_be_half) else 2  # the residual stream: fp32 beside fp32 weights
    # what the forward runs in during training: half weights compute in half; fp32 weights under autocast
    ctx = None
    if precision != "fp32" and not half_now:
        ctx = autocast(first.device, precision, "fp32") if first.device.type in ("cpu", "cuda") else None
        if t.params_dtype == "half":
            notes.append("fp32 model measured under autocast before its cast to half weights: the residual "
                         "stream is counted at fp32")  # fmt: skip
    hidden, vocab = _embedding_shape(model, m.hidden_size, m.vocab_size)
    kwargs = {"make_input": example_input} if example_input is not None else {}
    try:
        acts = measured_activations(model, layers, seq=m.seq_length, micro_batch=t.micro_batch_size, hidden=hidden,
                                    vocab=vocab, a=a, r=r, autocast=ctx, **kwargs)  # fmt: skip
    except Exception as e:  # any model: the plan says what it could not do rather than failing
        first_line = str(e).splitlines()[0] if str(e) else ""
        notes.append(f"activations not measured: the forward of {type(model).__name__} on token ids failed "
                     f"({type(e).__name__}: {first_line}); pass example_input")  # fmt: skip
        return Activations(layers=[[] for _ in layers], head=[], logits_transient=0, backward_working=0,
                           source="not measured")  # fmt: skip
    if t.params_dtype == "half" and ctx is not None:
        acts = Activations(layers=[[s for s in acts.layers[0] if not s.weight_copy]] * len(layers), head=acts.head,
                           logits_transient=acts.logits_transient, backward_working=acts.backward_working,
                           source=acts.source, notes=acts.notes)  # fmt: skip
    notes.extend(acts.notes)
    return _with_fused_loss(cfg, model, acts, t.micro_batch_size * m.seq_length)


def _embedding_shape(model: nn.Module, hidden: int, vocab: int) -> tuple[int, int]:
    """(hidden, vocab) from the model's input embedding and output projection; the config's where absent."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None:
        hidden, vocab = emb.embedding_dim, emb.num_embeddings
    if isinstance(out, nn.Linear):
        vocab = out.out_features
    return hidden, vocab
