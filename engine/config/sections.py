"""The config's sections as typed frozen dataclasses, generated from schemas/engine.schema.json.

Do not edit: after a schema change run `python -m engine.config.codegen --write` (tests/test_config.py fails while
this file differs from what the schema gives). engine.config fills, validates and builds these; the full key
reference is `python -m engine.config.doc`.
"""

from dataclasses import dataclass, field, fields
from typing import Any, Literal


@dataclass(frozen=True)
class ModelConfig:
    """The model and layer-level activation offloading (Megatron TransformerConfig names)."""

    implementation: Literal["builtin", "megatron"] = "builtin"
    """Which GPT to build when no model is passed: the built-in one or a megatron-core GPTModel."""

    num_layers: int = 4
    """Transformer layers of the built-in GPT."""

    hidden_size: int = 128
    """Hidden width of the built-in GPT."""

    num_attention_heads: int = 4
    """Attention heads; must divide hidden_size."""

    ffn_hidden_size: int | None = None
    """MLP width; null means 4 * hidden_size."""

    seq_length: int = 128
    """Tokens per training sequence."""

    vocab_size: int = 256
    """Vocabulary size; 256 for byte-level data."""

    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""

    use_te: bool = False
    """Build the built-in GPT's layers from Transformer Engine (needs the te extra)."""

    cpu_offloading: bool = False
    """Master switch for layer-level activation offloading to host memory."""

    cpu_offloading_num_layers: int | Literal["auto"] = 0
    """Number of transformer layers (the first ones, counted across layer stacks in forward order) whose saved..."""

    cpu_offloading_activations: bool = True
    """Offload the activations the offloaded layers save for backward."""

    cpu_offloading_weights: bool = False
    """Offload the weight tensors the offloaded layers save for backward."""

    cpu_offloading_double_buffering: bool = False
    """Double-buffer across layers while reloading in backward."""

    cpu_offloading_layers_path: str | tuple[str, ...] | None = None
    """Dotted path to the ModuleList of transformer layers (e.g. decoder.layers), or a list of them in forward..."""

    fine_grained_activation_offloading: bool = False
    """Module-level activation offloading of the sub-modules named in offload_modules."""

    offload_modules: tuple[str, ...] = ()
    """Sub-module names inside each layer to offload when fine_grained_activation_offloading is on."""

    fused_linear_cross_entropy: bool = False
    """A user's HF causal LM: the loss from the final hidden states and the output head over chunks of tokens..."""

    fused_linear_cross_entropy_chunk_size: int = 1024
    """Tokens per chunk of fused_linear_cross_entropy: one chunk's logits and their gradient are held at once."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation: null (off), full (whole layer) or selective (core attention)."""

    recompute_num_layers: int | Literal["auto"] | None = None
    """With recompute_granularity=\"full\": how many layers recompute (megatron-core's \"block\" method: the..."""

    cuda_graph_impl: Literal["none", "local", "transformer_engine"] = "none"
    """CUDA graph capture implementation."""


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its schedule and optimizer-state offloading (Megatron OptimizerConfig names)."""

    implementation: Literal["engine", "megatron"] = "engine"
    """Whose optimizer steps: ours, or megatron-core's HybridDeviceOptimizer (GPU only)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer: adam (AdamW, decoupled weight decay) or sgd."""

    lr: float = 0.0003
    """Peak learning rate."""

    min_lr: float = 0.0
    """Learning rate at the end of decay."""

    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norms)."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.999
    """Adam beta2."""

    adam_eps: float = 1e-08
    """Adam epsilon."""

    sgd_momentum: float = 0.9
    """SGD momentum."""

    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""

    lr_warmup_iters: int = 0
    """Linear warmup iterations from 0 to lr."""

    lr_decay_iters: int | None = None
    """Iterations over which lr decays to min_lr; null means train.train_iters."""

    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup."""

    optimizer_cpu_offload: bool = False
    """Master switch for optimizer-state offloading (HybridDeviceOptimizer)."""

    optimizer_offload_fraction: float | Literal["auto"] = 0.0
    """Fraction of master weights and optimizer states (by element count) stepped on the CPU (0.0-1.0)."""

    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Overlap gradient D2H, the CPU step and weight H2D with GPU compute."""

    use_torch_optimizer_for_cpu_offload: bool = False
    """Use plain torch.optim for the CPU part instead of the engine's fused CPU step."""

    pin_cpu_grads: bool = True
    """Pin the host gradient buffers of CPU-stepped parameters."""

    pin_cpu_params: bool = True
    """Pin the host parameter buffers of CPU-stepped parameters."""

    use_distributed_optimizer: bool = False
    """Shard master weights and optimizer states across data-parallel ranks."""

    cpu_optimizer_threads: int | None = None
    """Threads for the CPU optimizer step; null means physical cores minus one."""

    cpu_optimizer_pin_threads: bool = False
    """Bind the CPU step's worker threads to physical cores of one NUMA node (the GPU's), apart from the core of..."""

    accumulate_allreduce_grads_in_fp32: bool = True
    """Accumulate micro-batch gradients of half-precision weights in fp32 buffers."""

    delayed_param_update: bool = False
    """Opt-in, changes the numerics (ZeRO-Offload's delayed parameter update): after the warm-up, the CPU-stepped..."""

    delayed_param_update_warmup: int = 40
    """Exact steps before delayed_param_update starts delaying (steps that stepped; a skipped non-finite step..."""

    speculation_buffer_mb: int = 2048
    """Host memory (MiB) for the CPU part's speculative step: with overlap on, layers whose gradients reach the..."""

    cpu_offload_gpu_assist: bool = False
    """Let the GPU step some host-resident units alongside the CPU threads (states stream over PCIe through 3..."""

    use_precision_aware_optimizer: bool = False
    """Megatron's precision-aware optimizer: lets the keys below set the optimizer's tensors to lower precision..."""

    main_params_dtype: Literal["fp32", "fp16"] = "fp32"
    """dtype of the main (master) parameters. fp32 only here: megatron's fp16 masters are refused."""

    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of the main gradients."""

    exp_avg_dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8_blockwise"] = "fp32"
    """dtype of Adam's exp_avg on both parts of the split (needs use_precision_aware_optimizer): bf16 is stored..."""

    exp_avg_sq_dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8_blockwise"] = "fp32"
    """dtype of Adam's exp_avg_sq on both parts of the split (needs use_precision_aware_optimizer), as..."""

    store_param_remainders: bool = False
    """Hold the fp32 master as the bf16 weight plus a 16-bit remainder, on both parts of the split..."""


@dataclass(frozen=True)
class TrainConfig:
    """The training loop (Megatron TrainingConfig names)."""

    train_iters: int = 100
    """Optimizer steps to run."""

    global_batch_size: int = 8
    """Sequences per optimizer step across all data-parallel ranks."""

    micro_batch_size: int = 8
    """Sequences per forward/backward pass on one rank."""

    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Compute precision."""

    params_dtype: Literal["fp32", "half"] = "fp32"
    """Model weights: fp32 with half-precision autocast, or half (bf16/fp16 per precision) weights with fp32..."""

    loss_scale: float | None = None
    """fp16 only: static loss scale; null means dynamic."""

    initial_loss_scale: float = 65536.0
    """fp16 only: initial dynamic loss scale."""

    loss_scale_window: int = 1000
    """fp16 only: steps without overflow before the dynamic scale doubles."""

    fp8: Literal["e4m3", "hybrid"] | None = None
    """FP8 compute through Transformer Engine (built-in GPT with model.use_te=true, or megatron-core's TE spec..."""

    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    """FP8 scaling recipe: delayed (per-tensor scale from an amax history), tensorwise (per-tensor current..."""

    fp8_margin: int = 0
    """Delayed recipe only: margin for the scaling factor computation."""

    fp8_amax_history_len: int = 1
    """Delayed recipe only: length of the amax history window the scaling factor is computed from."""

    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    """Delayed recipe only: the amax the scale uses: the most recent one, or the largest in the history window."""

    seed: int = 1234
    """Random seed for weights and data order."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: cuda when available (auto), or forced."""

    max_skipped_steps: int | None = 20
    """Stop the run (exit code 1) after this many consecutive skipped steps: a step is skipped when its loss or..."""

    find_unused_parameters: Literal["auto", True, False] = "auto"
    """Data parallel: let DDP find parameters a step did not use (a conditional branch, MoE routing, an unused..."""


@dataclass(frozen=True)
class DataConfig:
    """Training data."""

    source: Literal["stdlib", "text", "tokens"] = "stdlib"
    """stdlib: byte-level tokens of the Python standard library's sources; text: a UTF-8 file as bytes; tokens: a..."""

    path: str | None = None
    """File for source text or tokens (only read by those sources; rejected with stdlib)."""

    token_dtype: Literal["uint8", "uint16", "int32"] = "uint16"
    """Element type of a tokens file."""

    max_bytes: int = 16777216
    """Upper bound on the bytes of the stdlib corpus to read."""


@dataclass(frozen=True)
class LoggingConfig:
    """Progress and metrics."""

    log_interval: int = 1
    """Iterations between metric records."""

    metrics_file: str | None = "runs/metrics.jsonl"
    """JSONL metrics: a header record per run (run_id, start_time, config_sha256, resumed_from), then one record..."""

    progress_bar: bool = True
    """Show a tqdm progress bar."""

    tensorboard_dir: str | None = None
    """Also write the metrics as TensorBoard scalars (torch.utils.tensorboard) to this directory; needs the..."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints (Megatron CheckpointConfig names)."""

    save: str | None = None
    """Directory to save checkpoints to; null disables saving."""

    save_interval: int | None = None
    """Iterations between saves; null saves only at the end."""

    load: str | None = None
    """Checkpoint to resume from: a folder checkpoint.save wrote (its newest checkpoint) or one of its iter_*..."""

    load_if_exists: bool = False
    """Start fresh (with a one-line note) when checkpoint.load holds no checkpoint yet, as when it equals..."""

    keep_last: int | None = None
    """Keep only the newest N checkpoints under checkpoint.save (older ones are deleted after each save); null..."""


@dataclass(frozen=True)
class PlanConfig:
    """The rates the memory plan prices \"auto\"'s candidates with (engine.planning.step_time): measured on the..."""

    measure_rates: bool | None = None
    """Measure this machine's rates on CUDA (well under two seconds, once per process): pinned copies each way..."""

    pcie_d2h_gb_per_s: float | None = None
    """Device-to-host copy rate (pinned, GB/s) the plan prices with; null: measured, else stated (55)."""

    pcie_h2d_gb_per_s: float | None = None
    """Host-to-device copy rate (pinned, GB/s) the plan prices with; null: measured, else stated (55)."""

    cpu_adam_g_params_per_s: float | None = None
    """The CPU AdamW step's rate over the CPU-stepped part (G parameters/s) the plan prices with; null: measured..."""

    gpu_tflops: float | None = None
    """The model's matmul rate in the training dtype (TFLOP/s) the plan prices with; null: measured, else stated..."""


@dataclass(frozen=True)
class Config:
    """The validated run configuration: one frozen section per namespace."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every key of every section as plain JSON values (tuples become lists)."""
        return {section.name: _json_values(getattr(self, section.name)) for section in fields(self)}


def _json_values(section: Any) -> dict[str, Any]:
    """A section's keys as plain JSON values (tuples become lists)."""
    values = {key.name: getattr(section, key.name) for key in fields(section)}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}
