"""Activation offloading on CPU: bitwise-equal gradients, host-byte accounting, pool reuse, discovery, modes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.gpt import GPT, gpt_loss
from engine.offload import (
    ActivationOffloadModule,
    apply_activation_offloading,
    apply_fine_grained_offloading,
    find_layers,
)

L, H, HEADS, S, V, B = 4, 32, 4, 16, 64, 2


def make_gpt(layers: int = L) -> GPT:
    torch.manual_seed(0)
    return GPT(num_layers=layers, hidden_size=H, num_attention_heads=HEADS, seq_length=S, vocab_size=V)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def step(model: nn.Module, seed: int, autocast: bool = False) -> torch.Tensor:
    tokens, labels = batch(seed)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = gpt_loss(model(tokens), labels)
    loss.backward()
    return loss.detach()


def assert_same_grads(ref: nn.Module, off: nn.Module) -> None:
    for (name, a), b in zip(ref.named_parameters(), off.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def saved_bytes(model: GPT, layers: int, seed: int, min_bytes: int, autocast: bool = False) -> int:
    """Reference count, independent of the offload code: unique non-parameter storages the layers save."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # alive, so no address is reused while counting

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if ptr not in params and n > min_bytes:
            seen[ptr] = n
        keep.append(t)
        return t

    originals = [layer.forward for layer in model.layers[:layers]]
    for layer, fwd in zip(model.layers[:layers], originals, strict=True):

        def wrapped(*a, _fwd=fwd, **k):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return _fwd(*a, **k)

        layer.forward = wrapped
    tokens, _ = batch(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(tokens)
    for layer in model.layers[:layers]:
        del layer.forward
    return sum(seen.values())


@pytest.mark.parametrize("double_buffering", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_gradients_and_loss_bitwise_equal(k: int, double_buffering: bool) -> None:
    ref, model = make_gpt(), make_gpt()
    off = apply_activation_offloading(model, num_layers=k, double_buffering=double_buffering, min_bytes=0)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(3):
        assert torch.equal(step(ref, it), step(model, it))
        assert_same_grads(ref, model)
        assert off.host_bytes() == 0  # everything came back and was released
        opt_ref.step()
        opt.step()
        if double_buffering:  # the reloads went through the two buffers, given back once layer 0 was done
            assert off.session.double_buffer.served == (it + 1) * k
            assert off.session.double_buffer.slabs == [None, None]


def test_host_bytes_at_end_of_forward_equal_saved_bytes() -> None:
    for k in (1, 3):
        for min_bytes in (0, 4096):
            model = make_gpt()
            expected = saved_bytes(make_gpt(), k, seed=7, min_bytes=min_bytes)
            off = apply_activation_offloading(model, num_layers=k, min_bytes=min_bytes)
            tokens, labels = batch(7)
            loss = gpt_loss(model(tokens), labels)
            assert expected > 0 and off.host_bytes() == expected, (k, min_bytes)
            loss.backward()
            assert off.host_bytes() == 0


def test_pool_allocated_once_and_reused() -> None:
    model = make_gpt()
    off = apply_activation_offloading(model, num_layers=3, min_bytes=0)
    step(model, 0)
    allocated = off.pool_bytes()
    assert allocated >= saved_bytes(make_gpt(), 3, seed=0, min_bytes=0)
    for it in range(1, 5):
        step(model, it)
        assert off.pool_bytes() == allocated
        assert off.session.pool.leased_bytes == 0


def test_forward_without_backward_returns_buffers() -> None:
    model = make_gpt()
    off = apply_activation_offloading(model, num_layers=2, min_bytes=0)
    tokens, _ = batch(0)
    for _ in range(3):  # graphs dropped unused: buffers come back with them, the pool stays flat
        model(tokens).sum()
        allocated = off.pool_bytes()
    assert off.host_bytes() == 0 and off.pool_bytes() == allocated


def test_no_grad_offloads_nothing() -> None:
    ref, model = make_gpt(), make_gpt()
    off = apply_activation_offloading(model, num_layers=3, min_bytes=0)
    tokens, _ = batch(1)
    with torch.no_grad():
        out = model(tokens)
    assert torch.equal(out, ref(tokens).detach())
    assert off.host_bytes() == 0 and off.pool_bytes() == 0 and off.session.chain is None


def test_autocast_bitwise_and_weight_copies() -> None:
    ref, acts, both = make_gpt(), make_gpt(), make_gpt()
    off_a = apply_activation_offloading(acts, num_layers=2, min_bytes=0)
    off_w = apply_activation_offloading(both, num_layers=2, weights=True, min_bytes=0)
    tokens, labels = batch(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [gpt_loss(m(tokens), labels) for m in (ref, acts, both)]
    held_a, held_w = off_a.host_bytes(), off_w.host_bytes()
    # weights=True also moves autocast's bf16 copies of the four weight matrices of each offloaded layer
    matrices = [p for layer in both.layers[:2] for p in layer.parameters() if p.dim() == 2]
    everything = saved_bytes(make_gpt(), 2, seed=3, min_bytes=0, autocast=True)  # casts included
    assert held_w == everything and held_a == everything - sum(2 * p.numel() for p in matrices)
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])
    assert_same_grads(ref, acts)
    assert_same_grads(ref, both)


def test_parameters_never_copied() -> None:
    # fp32, no autocast: autograd saves the weights themselves (and their transposes); weights=True moves nothing more
    a, b = make_gpt(), make_gpt()
    off_a = apply_activation_offloading(a, num_layers=2, min_bytes=0)
    off_b = apply_activation_offloading(b, num_layers=2, weights=True, min_bytes=0)
    tokens, _ = batch(0)
    outs = a(tokens), b(tokens)  # the graphs hold the groups
    assert off_a.host_bytes() == off_b.host_bytes() > 0 and len(outs) == 2
    activations_off = apply_activation_offloading(c := make_gpt(), num_layers=2, activations=False, min_bytes=0)
    out = c(tokens)
    assert activations_off.host_bytes() == 0 and out.requires_grad


class SharedViews(nn.Module):
    """Saves two views of one storage (like q, k, v of one qkv output)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, q = (x @ self.w).chunk(2, dim=-1)
        return x + (p * q).sum(-1, keepdim=True)


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


def test_shared_storage_copied_once() -> None:
    ref, model = Stack(SharedViews, 3), Stack(SharedViews, 3)
    off = apply_activation_offloading(model, num_layers=1, min_bytes=0)
    x = torch.randn(5, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = model(x2)
    # layer 0 saves x (through matmul) and p, q: x's storage plus the one [5, 16] storage of x @ w
    assert off.host_bytes() == 5 * 8 * 4 + 5 * 16 * 4
    out.sum().backward()
    ref(x).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert_same_grads(ref, model)


def test_retain_graph_twice_is_refused_clearly() -> None:
    model = make_gpt()
    apply_activation_offloading(model, num_layers=1, min_bytes=0)
    tokens, labels = batch(0)
    loss = gpt_loss(model(tokens), labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True is not supported"):
        loss.backward()


def test_remove_restores_the_model() -> None:
    ref, model = make_gpt(), make_gpt()
    off = apply_activation_offloading(model, num_layers=3, min_bytes=0)
    assert all(isinstance(m, ActivationOffloadModule) for m in model.layers[:3])
    assert not isinstance(model.layers[3], ActivationOffloadModule)
    assert list(model.state_dict()) == list(ref.state_dict())
    off.remove()
    assert all(type(m).__name__ == "TransformerLayer" for m in model.layers)
    assert not model.layers[3]._forward_hooks and not model.layers[3]._forward_pre_hooks
    assert torch.equal(step(ref, 0), step(model, 0))
    assert_same_grads(ref, model)


def test_num_layers_range() -> None:
    model = make_gpt()
    assert apply_activation_offloading(model, num_layers=0).host_bytes() == 0
    assert not any(isinstance(m, ActivationOffloadModule) for m in model.modules())
    with pytest.raises(ValueError, match="CPU offloading can be done only for layers less than 4"):
        apply_activation_offloading(make_gpt(), num_layers=4)


# ---- layer discovery --------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))  # nested list: not the layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) + sum(e(x) for e in self.experts)


class TransformerBlock(nn.Module):  # megatron-core's name, found by name when megatron-core is absent
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.extra = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))


class Megatronish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = TransformerBlock()


def test_find_layers() -> None:
    gpt = make_gpt()
    assert find_layers(gpt) is gpt.layers
    assert find_layers(nn.Sequential(gpt)) is gpt.layers  # inside a wrapper
    stack = Stack(Block, 3)
    assert find_layers(stack) is stack.blocks
    meg = Megatronish()
    assert find_layers(meg) is meg.decoder.layers
    assert find_layers(meg, "decoder.extra") is meg.decoder.extra
    with pytest.raises(ValueError, match="no transformer layers found in Linear.*cpu_offloading_layers_path"):
        find_layers(nn.Linear(2, 2))
    two = nn.Module()
    two.enc, two.dec = Stack(Block, 2), Stack(Block, 2)
    with pytest.raises(ValueError, match="several ModuleLists.*'enc.blocks', 'dec.blocks'"):
        find_layers(two)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        find_layers(meg, "decoder.nope")
    with pytest.raises(ValueError, match="names a Linear, not a ModuleList"):
        find_layers(meg, "decoder.extra.0")


def test_generic_stack_bitwise() -> None:
    ref, model = Stack(Block, 4), Stack(Block, 4)
    apply_activation_offloading(model, num_layers=3, double_buffering=True, min_bytes=0)
    x = torch.randn(6, 8)
    ref(x).square().sum().backward()
    model(x).square().sum().backward()
    assert_same_grads(ref, model)


# ---- fine-grained -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "modules", [("mlp",), ("attn_norm", "attn", "mlp_norm", "mlp"), ("MLP", "CausalSelfAttention"), ("attn.proj",)]
)
def test_fine_grained_bitwise(modules: tuple[str, ...]) -> None:
    ref, model = make_gpt(), make_gpt()
    fg = apply_fine_grained_offloading(model, modules=modules, min_bytes=0)
    for it in range(2):
        assert torch.equal(step(ref, it), step(model, it))
        assert_same_grads(ref, model)
        assert fg.host_bytes() == 0
    tokens, labels = batch(0)
    loss = gpt_loss(model(tokens), labels)  # the graph holds the groups
    assert fg.host_bytes() > 0 and loss.requires_grad


@pytest.mark.parametrize("order", ["1F1B", "reverse"])
def test_fine_grained_interleaved_microbatches(order: str) -> None:
    # a pipeline schedule runs several forwards before their backwards; each forward keeps its own chain
    ref, model = make_gpt(), make_gpt()
    fg = apply_fine_grained_offloading(model, modules=("attn", "mlp"), min_bytes=0)
    losses = {}
    for name, m in (("ref", ref), ("off", model)):
        l1 = gpt_loss(m(batch(1)[0]), batch(1)[1])
        l2 = gpt_loss(m(batch(2)[0]), batch(2)[1])
        first, second = (l1, l2) if order == "1F1B" else (l2, l1)
        first.backward()
        second.backward()
        losses[name] = (l1.detach(), l2.detach())
    assert all(torch.equal(a, b) for a, b in zip(losses["ref"], losses["off"], strict=True))
    assert_same_grads(ref, model)
    assert fg.host_bytes() == 0


def test_fine_grained_errors() -> None:
    with pytest.raises(ValueError, match="model.offload_modules is empty"):
        apply_fine_grained_offloading(make_gpt(), modules=[])
    with pytest.raises(ValueError, match=r"offload_modules=\['nope'\] matches no sub-module of TransformerLayer"):
        apply_fine_grained_offloading(make_gpt(), modules=("nope",))
    with pytest.raises(ValueError, match="chooses both 'attn' and 'attn.proj'"):
        apply_fine_grained_offloading(make_gpt(), modules=("attn", "attn.proj"))


class ReadsTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        return x.square()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return 2 * grad * x + 0 * again


class TwiceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + ReadsTwice.apply(self.lin(x))


def test_custom_function_reading_saved_tensors_twice() -> None:
    ref, model = Stack(TwiceBlock, 3), Stack(TwiceBlock, 3)
    off = apply_activation_offloading(model, num_layers=2, min_bytes=0)
    x = torch.randn(4, 8)
    ref(x).sum().backward()
    model(x).sum().backward()
    assert_same_grads(ref, model)
    assert off.host_bytes() == 0


class InPlaceAfterSave(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = h.sin()  # saves h
        h.add_(1)  # changes it afterwards: autograd refuses this, and so must offloading
        return x + y + h


def test_in_place_change_of_a_saved_tensor_is_refused() -> None:
    for k in (0, 1):
        model = Stack(InPlaceAfterSave, 2)
        apply_activation_offloading(model, num_layers=k, min_bytes=0)
        out = model(torch.randn(4, 8))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
