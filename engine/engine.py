"""The Engine: one training step (micro-batches, gradient accumulation, loss scaling, clipping,
optimizer step, LR schedule) and its DeepSpeed-shaped loop API, plus checkpoints.

It composes the mechanisms (model builder, optimizer, activation offload, data) and owns none of
their logic: everything it needs from an optimizer is `EngineOptimizer` (optim/protocol.py); a plain
torch optimizer is wrapped once, at construction, in the adapter that implements it.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine import checkpoint, dist, extras, first_batch, report, user_model
from engine.batch import BatchLoss, fused_loss_head, is_causal_lm, takes_labels
from engine.build import build_model, place_model
from engine.checkpoint import resume
from engine.config import Config, check_world_size, load_config, written_keys
from engine.data import TokenBatches, load_tokens
from engine.models.gpt import GPT
from engine.optim.protocol import EngineOptimizer, as_engine_optimizer
from engine.planning import oom, preflight
from engine.planning.budget import Budgets
from engine.precision import DTYPES, LossScaler, forward_context
from engine.skips import SkippedSteps
from engine.weights import ReadableWeights

DEEP_LAYERS = 1000  # building a GPT costs ~10 ms per layer on the meta device alone: say so before a silent minute


def _pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but torch sees no CUDA device; set train.device='auto' or 'cpu'")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class Engine:
    """Trains `module` with `optimizer` under `config`; see `initialize` for how it is built. `optimizer` is an
    EngineOptimizer, or a torch optimizer that `self.optimizer` wraps in one."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: EngineOptimizer | torch.optim.Optimizer | None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        config: Config,
        device: torch.device,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        offloader: Any = None,
        data_parallel_size: int | None = None,
        find_unused_parameters: bool = False,
        pending: first_batch.Pending | None = None,
    ) -> None:
        self._module, self.config, self.device, self.loss_fn = module, config, device, loss_fn
        self._pending = pending  # the plan and the parts below wait for the first micro-batch (engine.first_batch)
        self._optimizer: EngineOptimizer | None = None
        self._lr_scheduler, self._offloader, self._find_unused = None, None, find_unused_parameters
        self._forward_module = module  # DDP's wrapper once the optimizer exists (its gradient hook); state: self.module
        t = config.train
        self.data_parallel_size = data_parallel_size or dist.world_size()
        self.micro_batches_per_step = t.global_batch_size // (t.micro_batch_size * self.data_parallel_size)
        half = DTYPES[t.precision] if t.params_dtype == "half" else None  # float inputs follow half weights
        self._batch_loss = BatchLoss(loss_fn, takes_labels(module, loss_fn), half, is_causal_lm(module))
        self._readable = ReadableWeights(module, self.synchronize)
        self.scaler = LossScaler(t.precision == "fp16", t.loss_scale, t.initial_loss_scale, t.loss_scale_window)
        self.iteration = 0  # optimizer steps taken (skipped fp16 steps count, as in Megatron)
        self.micro_step = 0  # backward passes into the current global batch
        self.data_iter: Iterator | None = None
        self.last_grad_norm = 0.0  # the last step's pre-clip norm of the unscaled gradients
        self.last_step_skipped = False
        self.skips = SkippedSteps(config)  # non-finite steps: counted; too many in a row end the run
        self._loss_sum: torch.Tensor | None = None  # this global batch's micro-batch losses, for the finite check
        self.last_step_delayed = False  # optimizer.delayed_param_update: this step's CPU-side update lands late
        self._autocast = forward_context(device, t, module)  # half autocast, and TE's FP8 under train.fp8
        self.planned: tuple[Config, Any] | None = None  # (resolved config, plan) of the pre-flight, for OOM errors
        if pending is None:
            self._attach(first_batch.Built(config, optimizer, lr_scheduler, offloader))

    @property
    def optimizer(self) -> EngineOptimizer:
        """The optimizer. A model planned at its first micro-batch gets it there; read before, it is built at once
        when no "auto" value waits on the batch, else ValueError says what is needed (as for the two below)."""
        return self._built("the optimizer")._optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self._built("the LR schedule")._lr_scheduler

    @property
    def offloader(self) -> Any:
        """The activation offload's handle (engine.offload), or None."""
        return self._built("the activation offload")._offloader

    def _built(self, what: str) -> Engine:
        if self._optimizer is None:
            self._attach(self._pending.early(what))
        return self

    def _attach(self, built: first_batch.Built) -> None:
        """Takes the optimizer, schedule and activation offload; then the checkpoint state that waited for them."""
        self.config, self._offloader, self._lr_scheduler = built.cfg, built.offloader, built.scheduler
        self._optimizer = as_engine_optimizer(built.optimizer)
        self._forward_module = dist.wrap_model(self._module, self.device, self._optimizer, self._find_unused)
        self._optimizer.attach_model(self._module)
        while self._pending is not None and self._pending.restore:
            self._pending.restore.pop(0)()

    def _plan_first_batch(self, batch: Any) -> None:
        """The plan of the first micro-batch: refused with its one line, or "auto" chosen and the rest built."""
        built = self._pending.at_batch(batch)
        if self._optimizer is None:
            self._attach(built)
        self.config, self._pending = built.cfg, None
        self.planned = preflight.last()

    @property
    def module(self) -> nn.Module:
        """The model, its weights current: an update still on its way from the CPU is waited for first."""
        self._readable.wait()
        return self._module

    # -- the loop API ---------------------------------------------------------------------------
    def forward(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch: `(inputs, labels)`, a dict (HF's `input_ids`, ..., `labels`), or a tensor.
        How labels reach the model and how its output becomes the loss: engine.batch."""
        if self._pending is not None:
            self._plan_first_batch(batch)
        model = self._forward_module
        dist.set_grad_sync(model, self.micro_step + 1 >= self.micro_batches_per_step)  # reduce on the last only
        self._readable.inside_engine = True
        try:
            with self._autocast(first=self.micro_step == 0):  # TE casts its FP8 weights once per global batch
                return self._batch_loss(model, batch, self.device)
        except torch.OutOfMemoryError as e:
            raise self._oom(e, "forward") from e
        except RuntimeError as e:
            if "Expected to have finished reduction" in str(e):  # DDP's, on the step after an unused parameter
                raise RuntimeError(
                    f"train.find_unused_parameters={self.config.train.find_unused_parameters!r}: a parameter of the "
                    "model got no gradient in the last step (a conditional branch, an unused head), which DDP must "
                    "be told about; set train.find_unused_parameters=true"
                ) from e
            raise
        finally:
            self._readable.inside_engine = False

    __call__ = forward

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, averaged over the accumulation steps and loss-scaled."""
        self.optimizer.set_grad_final(self.micro_step + 1 == self.micro_batches_per_step)
        try:
            (loss * (self.scaler.scale / self.micro_batches_per_step)).backward()
        except torch.OutOfMemoryError as e:
            raise self._oom(e, "backward") from e
        self.micro_step += 1
        detached = loss.detach().float()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.micro_step >= self.micro_batches_per_step

    def step(self) -> bool:
        """At the accumulation boundary: unscale, clip, step, advance the schedule. Returns True if it stepped.

        A non-finite loss or gradient norm skips the step (nothing is updated) and counts it in `skips`;
        `train.max_skipped_steps` consecutive skips raise TrainingDiverged."""
        if not self.is_gradient_accumulation_boundary():
            return False
        clip = self.config.optimizer.clip_grad
        loss_sum, self._loss_sum = self._loss_sum, None
        loss_finite = None if loss_sum is None else torch.isfinite(dist.average(loss_sum))  # the same on every rank
        # skips (and discards what it began) on a non-finite norm or loss, read in the step's one synchronisation
        try:
            norm, stepped = self.optimizer.clip_and_step(clip, grad_scale=self.scaler.scale, finite=loss_finite)
        except torch.OutOfMemoryError as e:
            raise self._oom(e, "the optimizer step") from e
        self.scaler.update(stepped)
        self._readable.pending |= stepped  # CPU-stepped weights may still be on their way back
        if stepped:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_grad_norm, self.last_step_skipped = norm, not stepped
        self.last_step_delayed = self.optimizer.last_step_delayed
        self.micro_step = 0
        self.iteration += 1
        if stepped:
            self.skips.update(True, self.iteration, 0.0, 0.0, self.scaler.scale)
        else:  # the values only name the problem: read them (a synchronisation) on skipped steps alone
            mean = math.nan if loss_sum is None else float(dist.average(loss_sum)) / self.micro_batches_per_step
            self.skips.update(False, self.iteration, mean, float(norm), self.scaler.scale)
        return stepped

    def train_batch(self, data_iter: Iterator | None = None) -> float:
        """All micro-batches of one global batch drawn from `data_iter` (an iterator: the same one on every call;
        None: the config's data section), then one step; returns the mean loss. An out-of-memory error raises
        engine.oom.PlannedOutOfMemoryError (a torch.OutOfMemoryError) naming the plan and the keys to change."""
        it = self._data(data_iter)
        total = torch.zeros((), device=self.device)
        for _ in range(self.micro_batches_per_step):
            loss = self.forward(next(it))
            self.backward(loss)
            total += loss.detach().float()
        self.step()
        return dist.average(total).item() / self.micro_batches_per_step

    def _oom(self, error: torch.OutOfMemoryError, where: str) -> torch.OutOfMemoryError:
        """torch's out-of-memory error as the engine's one line (still a torch.OutOfMemoryError)."""
        if isinstance(error, oom.PlannedOutOfMemoryError):
            return error
        return oom.planned_error(error, self.planned, where)

    def _data(self, data_iter: Iterator | None) -> Iterator:
        if data_iter is not None:
            if not isinstance(data_iter, Iterator):  # iter() anew on each call would restart at the first batch
                raise TypeError(
                    f"train_batch(data_iter) takes an iterator, as DeepSpeed's does, and was given a "
                    f"{type(data_iter).__name__}, which each call would restart from its first batch; create "
                    "it = iter(batches) once and pass the same it to every train_batch(it)"
                )
            return data_iter
        if self.data_iter is None:
            self.data_iter = self.default_data()
        return self.data_iter

    def default_data(self, rank: int | None = None, world_size: int | None = None) -> TokenBatches:
        """The config's data section as an iterator of micro-batches (this rank's shard of each global batch)."""
        rank = dist.rank() if rank is None else rank
        world_size = self.data_parallel_size if world_size is None else world_size
        d, m = self.config.data, self.config.model
        tokens = load_tokens(d.source, d.path, d.token_dtype, d.max_bytes, m.vocab_size)
        return TokenBatches(
            tokens, m.seq_length, self.config.train.micro_batch_size, self.config.train.seed, rank, world_size
        )

    def synchronize(self) -> None:
        """Waits until every pending update is in the model's weights (CPU-stepped layers are written back
        asynchronously; the next forward waits per layer on its own). Reads through `state_dict()`, a forward
        of the model or `eng.module` wait by themselves (engine.weights); a tensor kept across steps does not.
        Under optimizer.delayed_param_update a delayed update is not pending here: it lands in the next step."""
        self._readable.pending = False
        if self._optimizer is not None:
            self._optimizer.synchronize()

    # -- accounting -----------------------------------------------------------------------------
    def host_bytes(self) -> int:
        """Bytes held in host memory by offloading: optimizer states, and activations at their peak (the end of
        forward; after backward the host holds none)."""
        return self.activation_offload_bytes() + (self._optimizer.host_bytes() if self._optimizer is not None else 0)

    def activation_offload_bytes(self) -> int:
        """The most activation bytes held in host memory at once so far: GPU memory the forward did not hold."""
        return self._offloader.peak_host_bytes() if self._offloader is not None else 0

    def peak_memory_bytes(self) -> int:
        """Peak device memory: CUDA's allocator peak, or the process's peak RSS on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def offload_report(self) -> list[str]:
        """What offloading did, one line per offloaded layer stack and one for the optimizer (engine.report)."""
        mbs = self.micro_batches_per_step
        what = "sub-modules" if self.config.model.fine_grained_activation_offloading else "layers"
        return report.stack_lines(self.offloader, mbs, what) + report.optimizer_lines(self.optimizer, mbs)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_pretrained(self, save_dir: str, **kwargs: Any) -> str:
        """The model's own `save_pretrained` (a transformers PreTrainedModel: config and safetensors weights that
        `from_pretrained` loads), after pending updates; rank 0 writes. For resuming use `save_checkpoint`."""
        self.synchronize()
        return dist.on_main(lambda: user_model.save_pretrained(self._module, save_dir, **kwargs))

    def save_checkpoint(self, save_dir: str, client_state: dict | None = None) -> str:
        """Atomically saves everything a resumed run needs to continue with the same losses
        (engine.checkpoint.resume.engine_state); rank 0 writes."""
        self.synchronize()
        state, keep = resume.engine_state(self, client_state), self.config.checkpoint.keep_last
        return str(dist.on_main(lambda: checkpoint.save(save_dir, self.iteration, state, keep)))

    def load_checkpoint(self, load_dir: str) -> dict:
        """Restores the newest checkpoint under `load_dir` (or the `iter_*` folder it names) after verifying
        every byte against its manifest; returns its client_state."""
        return resume.restore(self, checkpoint.load(load_dir), load_dir)


def initialize(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    model_parameters: Iterable[torch.nn.Parameter] | None = None,
    config: str | dict | Config | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    overrides: Iterable[str] = (),
    memory_budgets: Budgets | None = None,
    example_batch: Any = None,
) -> tuple[Engine, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """DeepSpeed's `initialize`: returns `(engine, optimizer, lr_scheduler)`.

    `model=None` builds the model `model.*` describes. A model of your own (HF transformers or any nn.Module)
    brings its shape: the built-in GPT's `model.*` shape keys are refused, and layer counts are checked against
    the layer stacks found in it (engine.user_model). `optimizer=None` builds the one `optimizer.*` describes
    over `model_parameters` (default: all trainable parameters); a given optimizer is used as-is, with the
    config's schedule applied to each group's own lr. `loss_fn(output, labels)` turns the model's output into
    the loss; without it the output's own loss is used (HF: `labels` in the batch), see engine.batch. Before
    anything large is allocated the memory plan resolves "auto" values and refuses what cannot fit
    (engine.planning.preflight; memory_budgets: plan against other budgets than this machine's). With a model of
    your own, `example_batch` (one micro-batch as `train_batch` gets it) is what the plan measures its
    activations, logits and loss on; without it the first micro-batch is (engine.first_batch: the optimizer and
    schedule returned are then built there).
    """
    in_hand = model is not None  # its shape comes from the model; the built-in GPT's model.* keys are refused
    if isinstance(config, Config) and not overrides and not in_hand:
        cfg = config
    else:
        cfg = load_config(config or {}, list(overrides), model_in_hand=in_hand)
    if in_hand:
        user_model.check(model, cfg.model, written_keys(cfg))  # model.* against the model in hand, before allocation
    world = dist.setup(cfg.train.device)  # joins torchrun's process group; a no-op for one process
    if world > 1:  # the rules that read the data-parallel size, at the size the group has
        check_world_size(cfg, world)
    device = _pick_device(cfg.train.device)
    if optimizer is not None:
        first_batch.check_given_optimizer(cfg, world)
    loaded = cfg
    waits = in_hand and example_batch is None and not isinstance(model, GPT) and not extras.is_megatron_gpt(model)
    if not (waits and first_batch.auto_keys(cfg)):  # a model planned at its first micro-batch: refused now if it can
        cfg = preflight.check(cfg, model, device, world, memory_budgets, example_batch if in_hand else None, loss_fn)
    torch.manual_seed(cfg.train.seed)
    half = DTYPES[cfg.train.precision] if cfg.train.params_dtype == "half" else None
    if model is None:  # built on the meta device, materialised on `device` in its final dtype
        if cfg.model.num_layers >= DEEP_LAYERS and (planned := preflight.last()) is not None:
            dist.log(f"building the GPT: {cfg.model.num_layers} layers, {planned[1].parameters / 1e9:.1f} B "
                     f"parameters, on {device.type} (at this depth building takes minutes)", flush=True)  # fmt: skip
        model = build_model(cfg.model, device, cfg.train.seed, half or torch.float32)
    elif extras.is_megatron_gpt(model):  # a user's megatron-core GPTModel gets the adapter
        from engine import megatron

        model = megatron.as_engine_module(model, seed=cfg.train.seed, device=device)
    model = place_model(model, device, half, cfg.train.seed)  # a no-op for a model already placed
    unused = cfg.train.find_unused_parameters
    pending = first_batch.Pending.start(loaded, model, optimizer, model_parameters, device, world, memory_budgets,
                                        loss_fn) if waits else None  # fmt: skip
    built = first_batch.Built(cfg, optimizer, None, None) if waits else first_batch.build(
        cfg, model, optimizer, model_parameters, world, in_hand)  # fmt: skip
    eng = Engine(model, built.optimizer, built.scheduler, cfg, device, loss_fn, built.offloader, world,
                 in_hand if unused == "auto" else unused, pending=pending)  # fmt: skip
    if cfg.model.fused_linear_cross_entropy:  # the loss from the output head over chunks of tokens
        chunk = cfg.model.fused_linear_cross_entropy_chunk_size
        eng._batch_loss.fused = fused_loss_head(model, in_hand, loss_fn, chunk)
    if waits:
        given = optimizer if optimizer is not None else first_batch.Deferred(lambda: first_batch.raw(eng.optimizer))
        return eng, given, first_batch.Deferred(lambda: eng.lr_scheduler)
    eng.planned = preflight.last()  # what the plan predicted, named by an out-of-memory error
    return eng, built.optimizer, built.scheduler
