"""The memory plan: its arithmetic against hand-computed bytes and against what the code really saves and holds."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import engine
from engine import offload
from engine.config import load_config
from engine.models.gpt import GPT, gpt_loss
from engine.offload.pool import host_buffer_bytes
from engine.optim import HybridDeviceOptimizer, HybridOptions
from engine.planning import planner, resolve
from engine.planning.activations import gpt_activations
from engine.planning.auto import NothingFits
from engine.planning.memory import GPU_MARGIN_FIXED, GPU_MARGIN_FRACTION, HOST_RUNTIME_CUDA

GIB = 1 << 30


def shape_overrides(layers=2, hidden=64, heads=4, seq=32, vocab=256, mbs=2, gbs=4):
    return [f"model.num_layers={layers}", f"model.hidden_size={hidden}", f"model.num_attention_heads={heads}",
            f"model.seq_length={seq}", f"model.vocab_size={vocab}", f"train.micro_batch_size={mbs}",
            f"train.global_batch_size={gbs}", "optimizer.lr_warmup_iters=0"]  # fmt: skip


# --- saved activations: the formula equals what the built-in GPT's forward saves (CPU kernels) ----------------


def saved_by_forward(model: GPT, tokens, labels, autocast: bool) -> tuple[list[int], int]:
    """(bytes each layer saves, bytes saved outside the layers), by a forward under saved-tensor hooks."""
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    where = ["head"]
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "head"))
    seen: dict = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if key not in params and key not in seen:
            seen[key] = (where[0], t.untyped_storage().nbytes())
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gpt_loss(model(tokens), labels)
    per_layer = [sum(b for w, b in seen.values() if w == i) for i in range(len(model.layers))]
    return per_layer, sum(b for w, b in seen.values() if w == "head")


@pytest.mark.parametrize(
    ("precision", "params_dtype", "b", "s", "h", "heads", "ffn", "recompute"),
    [
        ("fp32", "fp32", 2, 32, 64, 4, None, None),
        ("bf16", "fp32", 3, 48, 96, 6, None, None),  # autocast: fp32 residual, half matmuls, weight copies
        ("bf16", "half", 2, 64, 64, 2, 96, None),
        ("fp32", "fp32", 1, 40, 32, 4, None, "selective"),
    ],
)
def test_gpt_formula_equals_the_saved_tensors_of_its_forward(precision, params_dtype, b, s, h, heads, ffn, recompute):
    torch.manual_seed(0)
    vocab = 200
    model = GPT(num_layers=2, hidden_size=h, num_attention_heads=heads, seq_length=s, vocab_size=vocab,
                ffn_hidden_size=ffn, recompute_granularity=recompute)  # fmt: skip
    if params_dtype == "half":
        model = model.to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (b, s))
    labels = torch.randint(0, vocab, (b, s))
    per_layer, head = saved_by_forward(model, tokens, labels, autocast=precision != "fp32" and params_dtype == "fp32")
    acts = gpt_activations(num_layers=2, hidden=h, ffn=ffn or 4 * h, heads=heads, seq=s, vocab=vocab,
                           micro_batch=b, precision=precision, params_dtype=params_dtype, recompute=recompute,
                           cuda=False)  # fmt: skip
    assert [acts.layer_bytes(i) for i in range(2)] == per_layer
    assert sum(x.nbytes for x in acts.head) == head


def test_gpt_formula_by_hand():
    # bf16 half weights on CUDA, batch 2 x 1024 tokens, hidden 512, 8 heads, ffn 2048:
    # 2 residual copies + 6 [N, h] half tensors = 8*N*h*2, fc1 and gelu outputs 2*N*f*2, logsumexp b*heads*s*4,
    # four fp32 LayerNorm statistics 4*N*4
    n = 2 * 1024
    acts = gpt_activations(num_layers=3, hidden=512, ffn=2048, heads=8, seq=1024, vocab=256, micro_batch=2,
                           precision="bf16", params_dtype="half", recompute=None, cuda=True)  # fmt: skip
    assert acts.layer_bytes(0) == 16 * n * 512 + 4 * n * 2048 + 2 * 8 * 1024 * 4 + 16 * n
    full = gpt_activations(num_layers=3, hidden=512, ffn=2048, heads=8, seq=1024, vocab=256, micro_batch=2,
                           precision="bf16", params_dtype="half", recompute="full", cuda=True)  # fmt: skip
    assert sum(x.nbytes for x in full.checkpointed) == n * 512 * 2 and full.recompute_working == acts.layer_bytes(0)
    # fp32 on CUDA: the memory-efficient kernel pads logsumexp to a multiple of 32 (1000 -> 1024)
    f32 = gpt_activations(num_layers=1, hidden=512, ffn=2048, heads=8, seq=1000, vocab=256, micro_batch=1,
                          precision="fp32", params_dtype="fp32", recompute=None, cuda=True)  # fmt: skip
    assert f32.layer_bytes(0) == 32 * 1000 * 512 + 8 * 1000 * 2048 + 8 * 1024 * 4 + 16 * 1000


# --- the whole plan by hand ------------------------------------------------------------------------------------


def gpt_params(layers, h, vocab, seq):
    per_layer = 12 * h * h + 13 * h  # qkv 3h^2+3h, proj h^2+h, fc1 4h^2+4h, fc2 4h^2+h, two norms 4h
    return layers * per_layer + vocab * h + seq * h + 2 * h + vocab * h


@pytest.mark.parametrize(
    ("precision", "params_dtype", "fraction", "gbs"),
    [("bf16", "half", 0.5, 4), ("bf16", "half", 0.25, 2), ("fp32", "fp32", 0.7, 4), ("bf16", "fp32", 0.0, 2)],
)
def test_plan_equals_hand_computed_bytes(precision, params_dtype, fraction, gbs):
    L, h, heads, s, V, b = 2, 64, 4, 32, 256, 2
    cfg = load_config({}, shape_overrides(L, h, heads, s, V, b, gbs) + [
        f"train.precision={precision}", f"train.params_dtype={params_dtype}", "optimizer.optimizer_cpu_offload=true",
        "optimizer.use_distributed_optimizer=true", f"optimizer.optimizer_offload_fraction={fraction}",
        "optimizer.overlap_cpu_optimizer_d2h_h2d=true"])  # fmt: skip
    plan = engine.plan(cfg, gpu_budget_bytes=80 * GIB, host_budget_bytes=64 * GIB)
    P = gpt_params(L, h, V, s)
    assert plan.parameters == P
    # which parameters the CPU steps: what the hybrid optimizer itself chooses for this model
    torch.manual_seed(0)
    model = GPT(num_layers=L, hidden_size=h, num_attention_heads=heads, seq_length=s, vocab_size=V)
    opt = HybridDeviceOptimizer(list(model.named_parameters()), HybridOptions(lr=1e-3, offload_fraction=fraction))
    opt.attach_model(model)
    cpu = sum(model.get_parameter(n).numel() for n in opt.cpu_names)
    opt.close()
    assert plan.cpu_parameters == cpu
    half = params_dtype == "half"
    w, gpu_side, micro = (2 if half else 4), P - cpu, gbs // b
    main = half and micro > 1  # fp32 sums of half gradients over micro-batches
    n = b * s
    a = 4 if precision == "fp32" else 2
    r = 4 if (precision == "fp32" or not half) else 2
    weight_copies = (12 * h * h) * 2 if (precision != "fp32" and not half) else 0
    layer = 2 * n * h * r + 6 * n * h * a + 2 * n * 4 * h * a + b * heads * s * 4 + 4 * n * 4 + weight_copies
    head = 8 * n + 8 * s + n * h * r + 2 * n * 4 + n * h * a + n * V * 4 + 8 * n + 4  # + the loss's total weight
    head += V * h * 2 if weight_copies else 0
    forward = {
        "weights": w * P,
        "gradients": (4 if main else (w if micro > 1 else 0)) * P,
        "master_weights": 4 * gpu_side if half else 0,
        "optimizer_states": 8 * gpu_side,
        "activations": L * layer,
        "activations_outside_layers": head,
        "logits_and_loss": 2 * n * V * 4,
    }
    g = plan.gpu
    assert g.phases["forward"] == sum(forward.values())
    # the step: final gradients of the GPU side (the CPU side's left once copied: overlap is on), plus the
    # fp32 copies the GPU side's optimizer steps on when gradients are half and not summed in fp32
    step = w * P + (4 * gpu_side if half else 0) + 8 * gpu_side + (4 if main else w) * gpu_side
    step += 4 * gpu_side if (half and not main) else 0
    assert g.phases["step"] == step
    peak = max(g.phases.values())
    assert g.parts["allocator_margin"] == GPU_MARGIN_FIXED + int(GPU_MARGIN_FRACTION * peak)
    assert g.total_bytes == sum(g.parts.values()) == peak + g.parts["allocator_margin"]
    # host: 12 B per CPU-stepped parameter, its gradient as shipped, the runtime
    host = plan.host.parts
    assert host.get("optimizer.master", 0) == host.get("optimizer.exp_avg", 0) == 4 * cpu
    assert host.get("optimizer.grad_staging", 0) == (4 if main else w) * cpu
    assert host["runtime"] == HOST_RUNTIME_CUDA


def test_plan_json_shape_and_parts_sum():
    cfg = load_config({}, shape_overrides())
    out = engine.plan(cfg, gpu_budget_bytes=8 * GIB, host_budget_bytes=8 * GIB).to_json()
    json.dumps(out)
    for dev in ("gpu", "host"):
        assert {"total_bytes", "budget_bytes", "parts"} <= set(out[dev])
        assert sum(out[dev]["parts"].values()) == out[dev]["total_bytes"]
    assert out["fits"] is True and out["fraction"] == 0.0 and out["offloaded_layers"] == 0
    assert out["gpu"]["budget_bytes"] == 8 * GIB


def test_more_micro_batches_or_offload_change_the_plan_as_the_code_does():
    base = shape_overrides(gbs=2) + ["train.params_dtype=half", "optimizer.optimizer_cpu_offload=true",
                                     "optimizer.use_distributed_optimizer=true"]  # fmt: skip
    one = engine.plan(load_config({}, base), gpu_budget_bytes=GIB, host_budget_bytes=GIB)
    # without overlap the CPU side's gradients wait on the GPU for the step
    off = engine.plan(load_config({}, base + ["optimizer.optimizer_offload_fraction=0.5"]), gpu_budget_bytes=GIB,
                      host_budget_bytes=GIB)  # fmt: skip
    assert off.gpu.phases["step"] - (off.cpu_parameters * 2) < one.gpu.phases["step"]
    lap = engine.plan(load_config({}, base + ["optimizer.optimizer_offload_fraction=0.5",
                                              "optimizer.overlap_cpu_optimizer_d2h_h2d=true"]),
                      gpu_budget_bytes=GIB, host_budget_bytes=GIB)  # fmt: skip
    assert off.gpu.phases["step"] - lap.gpu.phases["step"] == 2 * lap.cpu_parameters


# --- activation offloading: the host pool is what the pool really allocates ----------------------------------


def _plan_and_pool(cfg, layers: int, apply_offload):
    """The plan of `cfg` (hidden 100, 4 x 129 tokens) and the offload handle of the same GPT after one backward,
    whose host pool must be the plan's activation_pool to the byte."""
    plan = engine.plan(cfg, device="cpu", host_budget_bytes=64 * GIB)
    torch.manual_seed(0)
    model = GPT(num_layers=layers, hidden_size=100, num_attention_heads=4, seq_length=129, vocab_size=256)
    handle = apply_offload(model)
    tokens = torch.randint(0, 256, (4, 129))
    gpt_loss(model(tokens), tokens).backward()
    assert handle.pool_bytes() > 0
    assert plan.host.parts["activation_pool"] == handle.pool_bytes()
    return plan, handle


@pytest.mark.parametrize("k", [1, 2])
def test_activation_pool_equals_the_offload_pools_allocation(k):
    # sizes that are not multiples of the pool's 512-byte rounding: hidden 100, 4 x 129 tokens
    cfg = load_config({}, shape_overrides(layers=3, hidden=100, seq=129, mbs=4, gbs=4) + [
        "train.precision=fp32", "model.cpu_offloading=true", f"model.cpu_offloading_num_layers={k}"])  # fmt: skip
    plan, handle = _plan_and_pool(cfg, 3, lambda model: offload.apply_activation_offloading(model, k))
    # on the device an offloaded layer keeps only the storages of <= 64 KiB: here the four LayerNorm statistics
    # [516] and the attention's logsumexp [4, 4, 129], fp32
    keep = plan.layer_activation_bytes - plan.offloaded_layer_bytes
    assert keep == 4 * 516 * 4 + 4 * 4 * 129 * 4
    handle.remove()


def test_pinned_pool_rounds_to_powers_of_two():
    assert host_buffer_bytes(1000, pinned=False) == 1024
    assert host_buffer_bytes(80 << 20, pinned=False) == 80 << 20
    assert host_buffer_bytes(80 << 20, pinned=True) == 128 << 20  # torch's pinned allocator: next power of two


@pytest.mark.parametrize(("k", "double_buffering"), [(1, False), (2, False), (3, False), (2, True)])
def test_reload_lookahead_and_slabs_are_what_the_offload_session_uses(monkeypatch, k, double_buffering):
    """The plan's reload window and double-buffer bytes come from engine.offload (reload_lookahead,
    double_buffer_bytes); here they are held equal to the session's lookahead and to the slabs it allocates."""
    from engine.offload.api import reload_lookahead
    from engine.offload.groups import RELOADING
    from engine.offload.session import DoubleBuffer, double_buffer_bytes

    slabs = []
    take = DoubleBuffer.take

    def recording(self, group):
        out = take(self, group)
        slabs.append(sum(t.numel() for t in self.slabs if t is not None))
        return out

    monkeypatch.setattr(DoubleBuffer, "take", recording)
    torch.manual_seed(0)
    model = GPT(num_layers=5, hidden_size=100, num_attention_heads=4, seq_length=129, vocab_size=256)
    handle = offload.apply_activation_offloading(model, k, double_buffering=double_buffering)
    assert handle.session.lookahead == reload_lookahead(5, k, double_buffering=double_buffering)
    tokens = torch.randint(0, 256, (4, 129))
    sizes = []
    group_init = offload.groups.Group.reload

    live = []  # groups back on the device (reloaded, not yet used up) at each reload: the plan's window

    def sizes_of(self, dests):
        sizes.append([st.nbytes for st in self.stashes])
        chain = self.session.chain.groups
        live.append(1 + sum(1 for r in chain if r is not None and r() is not None and r().state == RELOADING))
        return group_init(self, dests)

    monkeypatch.setattr(offload.groups.Group, "reload", sizes_of)
    gpt_loss(model(tokens), tokens).backward()
    assert len(sizes) == k
    assert max(live) == min(k, 1 + reload_lookahead(5, k, double_buffering=double_buffering))
    if double_buffering:
        assert max(slabs) == double_buffer_bytes(sizes) > 0
    fine = offload.apply_fine_grained_offloading(GPT(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                     seq_length=32, vocab_size=256), ["mlp"])  # fmt: skip
    assert fine.session.lookahead == reload_lookahead(2, 2, fine_grained=True) == 1
    handle.remove()
    fine.remove()


# --- a user's model ----------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab=100, h=16, n=3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def test_user_model_parameters_counted_and_one_layer_measured():
    model = TinyLM()
    seq, mbs = 256, 3  # longer than the measured lengths (32, 64, 128): the fit extrapolates
    cfg = load_config({}, [f"model.seq_length={seq}", f"train.micro_batch_size={mbs}", "train.global_batch_size=3",
                           "train.precision=fp32"])  # fmt: skip
    plan = engine.plan(cfg, model, device="cpu", host_budget_bytes=8 * GIB)
    assert plan.parameters == sum(p.numel() for p in model.parameters())
    # up saves its input [N, h], relu saves its output [N, 4h] (which down saves too): fp32
    n = mbs * seq
    assert plan.layer_activation_bytes == n * 16 * 4 + n * 64 * 4
    assert plan.activations_source.startswith("measured")
    assert plan.gpu.parts["activations"] >= 3 * plan.layer_activation_bytes


def test_user_model_measurement_agrees_with_the_gpt_formula():
    torch.manual_seed(0)
    model = GPT(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=256, vocab_size=256)
    cfg = load_config({}, shape_overrides(seq=256) + ["train.precision=fp32"])
    measured = engine.plan(cfg, model, device="cpu", host_budget_bytes=8 * GIB)
    formula = engine.plan(cfg, device="cpu", host_budget_bytes=8 * GIB)
    assert measured.layer_activation_bytes == formula.layer_activation_bytes
    assert measured.parameters == formula.parameters


def test_user_model_measurement_leaves_the_rng_alone():
    model = TinyLM()
    cfg = load_config({}, ["model.seq_length=16", "train.micro_batch_size=2", "train.global_batch_size=2"])
    torch.manual_seed(5)
    engine.plan(cfg, nn.Sequential(nn.Dropout(0.5), model), device="cpu", host_budget_bytes=8 * GIB)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


# --- "auto" --------------------------------------------------------------------------------------------------------


def auto_cfg(extra=()):
    return load_config({}, shape_overrides(layers=4, hidden=256, seq=256, mbs=4, gbs=8) + [
        "train.params_dtype=half", "optimizer.optimizer_cpu_offload=true", "optimizer.use_distributed_optimizer=true",
        "optimizer.overlap_cpu_optimizer_d2h_h2d=true", *extra])  # fmt: skip


def gpu_at(cfg, fraction, k=0):
    return planner(cfg, gpu_budget_bytes=8 * GIB, host_budget_bytes=8 * GIB).evaluate(fraction, k).gpu.total_bytes


def test_auto_fraction_is_the_smallest_that_fits():
    cfg = auto_cfg(["optimizer.optimizer_offload_fraction=auto"])
    budget = (gpu_at(cfg, 0.0) + gpu_at(cfg, 1.0)) // 2
    p = planner(cfg, gpu_budget_bytes=budget, host_budget_bytes=8 * GIB)
    plan = resolve(p)
    assert plan.fits and plan.auto["optimizer.optimizer_offload_fraction"]
    assert 0 < plan.fraction < 1
    assert not p.evaluate(round(plan.fraction - 0.01, 2), 0).gpu.fits  # one step less does not fit
    assert p.evaluate(plan.fraction, 0).gpu.total_bytes == plan.gpu.total_bytes


def test_auto_layers_come_in_only_when_the_fraction_alone_cannot_fit():
    cfg = auto_cfg(["optimizer.optimizer_offload_fraction=auto", "model.cpu_offloading=true",
                    "model.cpu_offloading_num_layers=auto"])  # fmt: skip
    roomy = resolve(planner(cfg, gpu_budget_bytes=(gpu_at(cfg, 0.0) + gpu_at(cfg, 1.0)) // 2,
                            host_budget_bytes=8 * GIB))  # fmt: skip
    assert roomy.offloaded_layers == 0 and roomy.fraction > 0
    tight = resolve(planner(cfg, gpu_budget_bytes=gpu_at(cfg, 1.0) - 2**20, host_budget_bytes=8 * GIB))
    assert tight.fits and tight.offloaded_layers > 0


def test_auto_where_nothing_fits_names_the_largest_model():
    cfg = auto_cfg(["optimizer.optimizer_offload_fraction=auto"])
    least = gpu_at(cfg, 1.0)
    with pytest.raises(NothingFits, match=r'^no optimizer\.optimizer_offload_fraction fits \("auto"\): the least GPU '
                       r"memory it reaches is .*; at hidden 256, seq 256, micro-batch 4 at most 3 layers "
                       r"\(0\.0 B parameters\) fit"):  # fmt: skip
        resolve(planner(cfg, gpu_budget_bytes=least - 2**20, host_budget_bytes=8 * GIB))


def test_auto_on_the_13b_demo_config_fits_an_h200():
    plan = engine.plan("configs/13b-h200.json", gpu_budget_bytes=139 * GIB, host_budget_bytes=125 * GIB)
    assert plan.fits and plan.auto["optimizer.optimizer_offload_fraction"]
    assert plan.parameters > 12.5e9 and plan.gpu.budget_bytes == 139 * GIB


@pytest.mark.parametrize("modules", [["mlp"], ["attn"], ["MLP", "attn_norm"]])
def test_fine_grained_pool_equals_the_offload_pools_allocation(modules):
    cfg = load_config({}, shape_overrides(layers=2, hidden=100, seq=129, mbs=4, gbs=4) + [
        "train.precision=fp32", "model.fine_grained_activation_offloading=true",
        f"model.offload_modules={json.dumps(modules)}"])  # fmt: skip
    _, handle = _plan_and_pool(cfg, 2, lambda model: offload.apply_fine_grained_offloading(model, modules))
    handle.remove()


def test_nothing_fits_names_the_least_gpu_memory_reachable_at_a_zero_budget():
    """A budget of 0 bytes (--gpu-memory 1e-12) is still a budget: the message names the least GPU memory any
    setting reaches (offloaded layers included), not the first one tried."""
    cfg = auto_cfg(["optimizer.optimizer_offload_fraction=auto", "model.cpu_offloading=true",
                    "model.cpu_offloading_num_layers=auto"])  # fmt: skip
    p = planner(cfg, gpu_budget_bytes=0, host_budget_bytes=8 * GIB)
    least = min(p.evaluate(1.0, k).gpu.total_bytes for k in range(p.max_layers() + 1))
    assert least < p.evaluate(1.0, 0).gpu.total_bytes  # offloading layers lowers it: the two differ
    with pytest.raises(NothingFits) as caught:
        resolve(p)
    assert f"the least GPU memory it reaches is {least / GIB:.1f} GiB" in str(caught.value)


def test_host_refusal_advises_unsetting_checkpoint_save_only_where_that_fits():
    from engine.planning.preflight import refusal

    cfg = auto_cfg(["checkpoint.save=/tmp/ckpt", "optimizer.optimizer_offload_fraction=1.0"])
    plan_at = lambda host: resolve(planner(cfg, gpu_budget_bytes=8 * GIB, host_budget_bytes=host))  # noqa: E731
    phases = plan_at(8 * GIB).host.phases
    assert phases["checkpoint"] > phases["training"]
    budget = int(phases["training"] * 1.021) + 1  # training and its 2% margin fit; the checkpoint does not
    between = plan_at(budget)
    assert between.host.phase == "checkpoint" and not between.host.fits
    p = planner(cfg, gpu_budget_bytes=8 * GIB, host_budget_bytes=between.host.budget_bytes)
    assert "unset checkpoint.save" in refusal(p, between)
    too_small = phases["training"] // 2  # not even training fits: unsetting checkpoint.save would not help
    p = planner(cfg, gpu_budget_bytes=8 * GIB, host_budget_bytes=too_small)
    said = refusal(p, resolve(p))
    assert "checkpoint.save" not in said


def test_the_mechanisms_state_the_gpu_bytes_they_allocate():
    """The plan's gpu_assist_slots and delayed_update_shadow come from the mechanisms' own functions; each
    function equals what its mechanism allocates (the assist's slots before any gradient dtype is staged)."""
    from engine.optim.delayed import DelayedUpdate, shadow_gpu_bytes
    from engine.optim.gpu_assist import SLOTS, GpuAssist, assist_gpu_bytes

    n = 1000
    staged = GpuAssist(n, torch.device("cpu")).staging_bytes()
    assert staged == assist_gpu_bytes(n, grad_bytes=0) - SLOTS * 4 * n  # less the ops' temporaries
    delayed = DelayedUpdate(warmup=0)
    params = {"a": nn.Parameter(torch.zeros(7, 3, dtype=torch.bfloat16)), "b": nn.Parameter(torch.zeros(5))}
    delayed.bind(params)
    held = sum(t.numel() * t.element_size() for t in delayed.shadow.values())
    assert held == shadow_gpu_bytes(21, 2) + shadow_gpu_bytes(5, 4)
