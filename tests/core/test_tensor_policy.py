"""What is offloaded and how: storage dedup of views, the policy's exclusions, views and aliasing,
in-place modification checks.

Every test compares gradients with `torch.equal` against the same computation without a manager,
and byte counts as exact integers computed from shapes.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import pytest
import torch
from torch import nn

import chunk_offload
from chunk_offload import OffloadManager, mark_not_offloadable
from chunk_offload.core import OffloadPolicy, is_marked_not_offloadable
from tests.core._models import CoreAttention, Fn

B, T, H = 2, 8, 32
N = B * T
F32 = 4
SPAN_ALIGN = 16  # the group code aligns a copied span's start down to 16 bytes


def _scope(manager: OffloadManager | None, cm: str):
    if manager is None:
        return contextlib.nullcontext()
    return manager.iteration() if cm == "iteration" else manager.chunk(microbatch=0)


def _grads_of(fn: Callable, inputs: Sequence[torch.Tensor], cotangent_seed: int, manager: OffloadManager | None, name: str = "g"):
    """Run ``fn`` as an (optionally offloaded) module on fresh leaf copies of ``inputs``."""
    module = Fn(fn)
    if manager is not None:
        manager.offload_module(module, name)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    with _scope(manager, "iteration"):
        with _scope(manager, "chunk"):
            out = module(*leaves)
        g = torch.Generator().manual_seed(cotangent_seed)
        cot = torch.randn(out.shape, generator=g, dtype=out.dtype)
        out.backward(cot)
    return out.detach(), [x.grad for x in leaves if x.requires_grad]


def _assert_same(a, b) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b)
    for i, (x, y) in enumerate(zip(grads_a, grads_b)):
        assert x is not None and y is not None, f"gradient {i} missing"
        assert torch.equal(x, y), f"gradient {i} differs"


# ----------------------------------------------------------------------------- q, k, v views


SEEN: list[tuple[torch.Tensor, ...]] = []


class QKVMix(torch.autograd.Function):
    """Saves q, k, v (views of one qkv tensor) and records what backward gets back."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q * k + v.sin()

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        SEEN.append((q, k, v))
        return g * k, g * q, g * v.cos()


class QKVBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv_linear = nn.Linear(H, 3 * H)
        self.core_attn = Fn(QKVMix.apply)
        self.qkv_storage: list[torch.Tensor] = []

    def forward(self, x):
        qkv = self.qkv_linear(x)
        self.qkv_storage.append(qkv)  # keep the original alive: a reload must get other memory
        q, k, v = qkv.chunk(3, dim=-1)
        return self.core_attn(q, k, v)


def _run_qkv(manager: OffloadManager | None):
    SEEN.clear()
    block = QKVBlock()
    if manager is not None:
        manager.offload_module(block.core_attn, "core_attn")
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with _scope(manager, "iteration"):
        with _scope(manager, "chunk"):
            out = block(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return block, out.detach(), grads, SEEN[0]


def test_qkv_views_of_one_storage_are_copied_once(make_manager):
    _, ref_out, ref_grads, _ = _run_qkv(None)
    manager = make_manager(min_offload_bytes=1)
    block, out, grads, (q, k, v) = _run_qkv(manager)
    assert torch.equal(out, ref_out)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert torch.equal(a, b), f"gradient {i} differs"

    stats = manager.stats().groups["core_attn"]
    qkv_bytes = B * T * 3 * H * F32  # q starts at byte 0 and v ends at the end of the qkv storage
    assert stats.groups == 1
    assert stats.tensors_offloaded == 3
    assert stats.tensors_kept == 0
    assert stats.bytes_offloaded == qkv_bytes
    assert stats.bytes_reloaded == qkv_bytes

    # Rebuilt as the same three views of one new storage.
    original = block.qkv_storage[0]
    storages = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    assert len(storages) == 1
    assert storages != {original.untyped_storage().data_ptr()}
    assert q.data_ptr() != original.data_ptr()
    for i, t in enumerate((q, k, v)):
        assert t.shape == (B, T, H)
        assert t.stride() == (T * 3 * H, 3 * H, 1)
        assert t.data_ptr() - q.data_ptr() == i * H * F32
        assert torch.equal(t, original.detach().chunk(3, dim=-1)[i])


def test_qkv_with_the_models_core_attention_keeps_exact_grads(make_manager):
    def run(manager):
        torch.manual_seed(0)
        lin = nn.Linear(H, 3 * H)
        attn = CoreAttention(4)
        if manager is not None:
            manager.offload_module(attn, "core_attn")
        x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
        with _scope(manager, "iteration"):
            with _scope(manager, "chunk"):
                out = attn(*lin(x).chunk(3, dim=-1))
            out.pow(2).sum().backward()
        return [out.detach(), x.grad, lin.weight.grad, lin.bias.grad]

    ref = run(None)
    manager = make_manager(min_offload_bytes=1)
    got = run(manager)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    stats = manager.stats().groups["core_attn"]
    assert stats.groups == 1 and stats.tensors_offloaded > 0
    assert stats.bytes_reloaded == stats.bytes_offloaded > 0
    s = manager.stats()
    assert (s.resident_bytes, s.host_bytes, s.pool.in_use_bytes) == (0, 0, 0)


# ----------------------------------------------------------------------------- exclusions


UNPACKED: list[list[torch.Tensor]] = []


class SaveAll(torch.autograd.Function):
    """Saves every input; backward records the tensors autograd hands back."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.save_for_backward(*tensors)
        out = torch.zeros(())
        for t in tensors:
            out = out + t.double().sum().float()
        return out

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        UNPACKED.append(list(saved))
        return tuple(g.expand(t.shape).clone() if need else None for t, need in zip(saved, ctx.needs_input_grad))


class Exclusions(nn.Module):
    """Saves one tensor of every kind the policy must keep, plus two eligible activations."""

    MIN = 256  # bytes; activations are N*H*4 = 2048, weight[0:2] 2*H*4 = 256, the small one N*1*4 = 64

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(H, H, bias=False)
        self.register_buffer("scale", torch.randn(N, H))
        self.marked: torch.Tensor | None = None
        self.originals: dict[str, torch.Tensor] = {}

    def forward(self, x):
        tensors = {
            "x": x,  # eligible (the module's input)
            "weight_t": self.lin.weight.t(),  # a view of a parameter
            "weight_slice": self.lin.weight[0:2],  # a view of a parameter
            "buffer": self.scale,  # a buffer (as large as an activation)
            "buffer_view": self.scale[1:],  # a view of a buffer
            "small": x[:, :1] * 3,  # 64 bytes < MIN
            "marked": self.marked,  # mark_not_offloadable
            "activation": x * 2,  # eligible
        }
        self.originals = tensors
        return SaveAll.apply(*tensors.values())


ELIGIBLE = ("x", "activation")


def test_parameters_buffers_small_and_marked_tensors_stay_on_device(make_manager):
    manager = make_manager(min_offload_bytes=Exclusions.MIN)
    module = Exclusions()
    manager.offload_module(module, "mixed")
    source = torch.randn(N, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    UNPACKED.clear()
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            x = source * 1
            module.marked = mark_not_offloadable(source * 5)
            out = module(x)
        assert len(handler.groups) == 1
        out.backward()
    stats = manager.stats().groups["mixed"]
    assert stats.tensors_offloaded == len(ELIGIBLE)
    assert stats.tensors_kept == len(module.originals) - len(ELIGIBLE)
    assert stats.bytes_offloaded == len(ELIGIBLE) * N * H * F32
    assert stats.bytes_reloaded == stats.bytes_offloaded

    (unpacked,) = UNPACKED
    for (label, original), back in zip(module.originals.items(), unpacked):
        assert torch.equal(back, original), label
        if label in ELIGIBLE:
            assert back.data_ptr() != original.data_ptr(), f"{label} was not offloaded"
        else:
            assert back.data_ptr() == original.data_ptr(), f"{label} was offloaded"
            assert back.untyped_storage().data_ptr() == original.untyped_storage().data_ptr(), label


def test_parameter_and_buffer_saved_by_native_ops_are_kept(make_manager):
    """``x @ weight.t()`` saves the weight's view, ``h * buffer`` the buffer, ``h * gate`` a small gate."""

    def body(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h1 = (x @ module.lin.weight.t()) * module.scale  # saves x, weight.t(); then the buffer
        gate = h1.sum(-1, keepdim=True)  # (N, 1): 64 bytes
        return (h1 * gate) * module.marked  # saves h1 and gate; then h1 * gate and marked

    module = Exclusions()
    module.forward = lambda x: body(module, x)
    source = torch.randn(N, H, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def run(manager):
        for p in module.parameters():
            p.grad = None
        leaf = source.detach().clone().requires_grad_(True)
        with _scope(manager, "iteration"):
            with _scope(manager, "chunk"):
                module.marked = mark_not_offloadable(leaf * 5)
                out = module(leaf * 1)
            out.sum().backward()
        return [out.detach(), leaf.grad, module.lin.weight.grad]

    ref = run(None)
    manager = make_manager(min_offload_bytes=Exclusions.MIN)
    manager.offload_module(module, "native")
    got = run(manager)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    stats = manager.stats().groups["native"]
    # saved: x, weight.t(), buffer, h1, gate, h1 * gate, marked
    assert stats.tensors_offloaded == 3  # x, h1, h1 * gate
    assert stats.tensors_kept == 4  # weight.t(), buffer, gate, marked
    assert stats.bytes_offloaded == 3 * N * H * F32


def test_marked_tensor_passed_as_module_argument_is_kept(make_manager):
    """A tensor marked before it is handed to an offloaded module stays on device."""
    manager = make_manager(min_offload_bytes=1)
    module = Fn(lambda a, b: SaveAll.apply(a, b))
    manager.offload_module(module, "args")
    source = torch.randn(N, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    UNPACKED.clear()
    with manager.iteration():
        with manager.chunk(microbatch=0):
            marked = mark_not_offloadable(source * 2)
            plain = source * 3
            out = module(marked, plain)
        out.backward()
    stats = manager.stats().groups["args"]
    assert stats.tensors_kept == 1
    assert stats.tensors_offloaded == 1
    assert stats.bytes_offloaded == N * H * F32
    (unpacked,) = UNPACKED
    assert unpacked[0].data_ptr() == marked.data_ptr()
    assert unpacked[1].data_ptr() != plain.data_ptr()


# ----------------------------------------------------------------------------- should_offload


class MyTensor(torch.Tensor):
    pass


@pytest.fixture
def policy_and_module():
    torch.manual_seed(0)
    module = nn.Linear(8, 8)
    module.register_buffer("running", torch.randn(8, 8))
    policy = OffloadPolicy(min_offload_bytes=64, device_type="cpu")
    policy.protect(module)
    return policy, module


def test_should_offload_parameters_and_their_views(policy_and_module):
    policy, module = policy_and_module
    weight = module.weight
    assert policy.should_offload(weight) is False
    assert type(weight.t()) is torch.Tensor
    assert policy.should_offload(weight.t()) is False
    assert policy.should_offload(weight[0:2]) is False
    # Same storage, plain type, no autograd link: only storage identity can tell.
    detached = weight.detach()
    assert type(detached) is torch.Tensor and detached._base is None and not detached.requires_grad
    assert policy.should_offload(detached) is False
    assert policy.should_offload(weight.detach()[2:]) is False


def test_should_offload_buffers_and_their_views(policy_and_module):
    policy, module = policy_and_module
    assert policy.should_offload(module.running) is False
    assert policy.should_offload(module.running[1:]) is False
    assert policy.should_offload(module.running.t()) is False


def test_should_offload_activations_and_leaves(policy_and_module):
    policy, _ = policy_and_module
    leaf = torch.randn(8, 8, requires_grad=True)
    assert policy.should_offload(leaf) is False  # a leaf requiring grad is a parameter in all but type
    assert policy.should_offload(leaf[1:]) is False  # and so are its views
    activation = leaf * 2
    assert not activation.is_leaf
    assert policy.should_offload(activation) is True
    assert policy.should_offload(activation.t()) is True
    assert policy.should_offload(torch.randn(8, 8)) is True  # data that needs no grad


def test_a_leaf_handed_to_the_group_is_an_activation(policy_and_module):
    """A pipeline stage's received input is a leaf that requires grad: among the group's inputs it
    (and views of it) is offloaded; the same leaf not handed to the group is kept as a parameter."""
    policy, module = policy_and_module
    received = torch.randn(8, 8, requires_grad=True)
    other = torch.randn(8, 8) * 2
    assert policy.should_offload(received) is False
    assert policy.should_offload(received, [other, received]) is True
    assert policy.should_offload(received[1:], [received]) is True
    assert policy.should_offload(received, [received[2:]]) is True  # a view of it handed in
    assert policy.should_offload(module.weight.detach(), [module.weight]) is False  # protected storage
    assert policy.offload_key(received, [received]) == received.untyped_storage()._cdata
    assert policy.offload_key(received) == -received.untyped_storage()._cdata  # kept: the group keeps views of it
    assert policy.offload_key(module.weight.detach()) == 0  # protected: no view of it is offloaded


def test_should_offload_view_made_without_grad_mode_of_an_activation(policy_and_module):
    # Inside a custom Function's forward (no grad mode) a view of a non-leaf input reports
    # is_leaf=True and requires_grad=True; it is still an activation, not a parameter.
    policy, _ = policy_and_module
    activation = torch.randn(8, 8, requires_grad=True) * 2
    with torch.no_grad():
        view = activation[1:]
    assert view.is_leaf and view.requires_grad and view._base is activation
    assert policy.should_offload(view) is True


def test_should_offload_subclass_sparse_and_other_device(policy_and_module):
    policy, _ = policy_and_module
    assert policy.should_offload(torch.randn(8, 8).as_subclass(MyTensor)) is False
    assert policy.should_offload(torch.randn(8, 8).to_sparse()) is False
    assert policy.should_offload(torch.empty(64, 64, device="meta")) is False


def test_should_offload_size_threshold_is_inclusive(policy_and_module):
    policy, _ = policy_and_module
    assert policy.should_offload(torch.randn(16)) is True  # 16 * 4 == 64 bytes
    assert policy.should_offload(torch.randn(15)) is False  # 60 bytes
    assert policy.should_offload(torch.randn(32, dtype=torch.float16)) is True
    assert policy.should_offload(torch.randn(31, dtype=torch.float16)) is False
    assert policy.should_offload(torch.randn(64).view(4, 16)[:, :4]) is True  # the view's bytes count
    assert policy.should_offload(torch.randn(64)[:15]) is False


def test_should_offload_marked(policy_and_module):
    policy, _ = policy_and_module
    marked = mark_not_offloadable(torch.randn(8, 8) * 2)
    assert is_marked_not_offloadable(marked)
    assert policy.should_offload(marked) is False
    assert policy.should_offload(marked[1:]) is False
    assert policy.should_offload(marked.t()) is False
    assert policy.should_offload(torch.randn(8, 8) * 2) is True


def test_mark_covers_views_of_a_marked_view():
    base = torch.randn(8, 8) * 2
    view = mark_not_offloadable(base[2:])
    assert is_marked_not_offloadable(view)
    assert is_marked_not_offloadable(view[1:]), "a view of a marked view is a view of it"


def test_refresh_follows_reallocated_parameters():
    module = nn.Linear(8, 8)
    policy = OffloadPolicy(min_offload_bytes=1, device_type="cpu")
    policy.protect(module)
    module.double()  # new storages
    stale = module.weight.detach()
    assert policy.should_offload(stale) is True  # not known yet
    policy.refresh()
    assert policy.should_offload(stale) is False


def test_manager_refreshes_protection_each_iteration(make_manager):
    manager = make_manager(min_offload_bytes=1)
    module = nn.Linear(8, 8)
    manager.offload_module(module, "lin")
    module.double()
    with manager.iteration():
        pass
    assert manager.policy.should_offload(module.weight.detach()) is False


# ----------------------------------------------------------------------------- views and aliasing


def _sin_of(view_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: view_fn(x).sin()  # sin saves exactly its input: the view


def _span_bytes(offset: int, size: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride))
    start = offset * itemsize // SPAN_ALIGN * SPAN_ALIGN
    return (offset + extent) * itemsize - start


VIEW_CASES = {
    "transpose": ((N, H), lambda x: x.t(), N * H * F32),
    "slice_with_offset": ((N, H), lambda x: x[2:, 5:], _span_bytes(2 * H + 5, (N - 2, H - 5), (H, 1), F32)),
    "as_strided": ((N, H), lambda x: x.as_strided((4, 8), (9, 1), 3), _span_bytes(3, (4, 8), (9, 1), F32)),
    "square_transpose": ((H, H), lambda x: x.t(), H * H * F32),
    "expand": ((1, H), lambda x: x.expand(N, H), H * F32),
    "small_view_of_large_storage": ((64, 64), lambda x: x[10:12], 2 * 64 * F32),
}


@pytest.mark.parametrize("case", list(VIEW_CASES))
def test_saved_views_round_trip_exactly(make_manager, case):
    shape, view_fn, expected_bytes = VIEW_CASES[case]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    fn = _sin_of(view_fn)
    ref = _grads_of(fn, [x], 12, None)
    manager = make_manager(min_offload_bytes=1)
    got = _grads_of(fn, [x], 12, manager)
    _assert_same(got, ref)
    stats = manager.stats()
    group = stats.groups["g"]
    assert group.tensors_offloaded == 1
    assert group.bytes_offloaded == expected_bytes
    assert group.bytes_reloaded == expected_bytes
    assert (stats.resident_bytes, stats.host_bytes, stats.pool.in_use_bytes) == (0, 0, 0)


def test_small_view_copies_only_its_span(make_manager):
    shape, view_fn, expected = VIEW_CASES["small_view_of_large_storage"]
    manager = make_manager(min_offload_bytes=1)
    _grads_of(_sin_of(view_fn), [torch.randn(shape)], 0, manager)
    storage_bytes = shape[0] * shape[1] * F32
    assert manager.stats().groups["g"].bytes_offloaded == expected < storage_bytes


def test_square_transpose_comes_back_with_its_strides(make_manager):
    seen: list[torch.Tensor] = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            seen.append(a)
            return g * a

    x = torch.randn(H, H, generator=torch.Generator().manual_seed(2))
    fn = lambda x: Keep.apply(x.t())  # noqa: E731
    ref = _grads_of(fn, [x], 3, None)
    manager = make_manager(min_offload_bytes=1)
    got = _grads_of(fn, [x], 3, manager)
    _assert_same(got, ref)
    back = seen[-1]
    assert back.shape == (H, H) and back.stride() == (1, H)
    assert torch.equal(back, x.t())


DTYPE_SEEN: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []


class FloatAndBytes(torch.autograd.Function):
    """Saves a float view and a uint8 view of one storage; backward checks both came back intact."""

    @staticmethod
    def forward(ctx, x):
        f = x[1:]  # storage offset H floats
        u = f.view(torch.uint8)
        ctx.save_for_backward(f, u)
        ctx.expected = (f.clone(), u.clone())
        return f * 2

    @staticmethod
    def backward(ctx, g):
        f, u = ctx.saved_tensors
        DTYPE_SEEN.append((f, u, *ctx.expected))
        grad = torch.zeros(g.shape[0] + 1, g.shape[1])
        grad[1:] = g * 2
        return grad


def test_two_dtypes_viewing_one_storage(make_manager):
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(9))
    DTYPE_SEEN.clear()
    ref = _grads_of(FloatAndBytes.apply, [x], 1, None)
    manager = make_manager(min_offload_bytes=1)
    got = _grads_of(FloatAndBytes.apply, [x], 1, manager)
    _assert_same(got, ref)
    f, u, f_expected, u_expected = DTYPE_SEEN[-1]
    assert f.dtype == torch.float32 and u.dtype == torch.uint8
    assert torch.equal(f, f_expected)
    assert torch.equal(u, u_expected)
    assert torch.equal(u, f.view(torch.uint8))
    assert f.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
    assert f.data_ptr() == u.data_ptr()
    stats = manager.stats().groups["g"]
    assert stats.tensors_offloaded == 2
    assert stats.bytes_offloaded == (N - 1) * H * F32  # one span: rows 1.. (offset 128 bytes, aligned)


# ----------------------------------------------------------------------------- in-place checks


class SinModule(nn.Module):
    def forward(self, y):
        return y.sin()


def _inplace_after_save(manager: OffloadManager | None, *, modify_inside_chunk: bool, shape=(N, H)):
    module = SinModule()
    if manager is not None:
        manager.offload_module(module, "sin")
    x = torch.randn(shape, requires_grad=True)
    with _scope(manager, "iteration"):
        with _scope(manager, "chunk"):
            y = x * 2
            out = module(y)
            if modify_inside_chunk:
                y.mul_(3)
        if not modify_inside_chunk:
            y.mul_(3)
        out.sum().backward()


def test_inplace_modification_is_detected_without_offload():
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _inplace_after_save(None, modify_inside_chunk=False)


@pytest.mark.parametrize("inside", [False, True], ids=["after_chunk", "inside_chunk"])
def test_inplace_modification_of_an_offloaded_saved_tensor_raises(make_manager, inside):
    manager = make_manager(min_offload_bytes=1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _inplace_after_save(manager, modify_inside_chunk=inside)


def test_inplace_modification_of_a_kept_saved_tensor_raises(make_manager):
    manager = make_manager(min_offload_bytes=1 << 20)  # the default: the saved (N, H) tensor is kept by the policy
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _inplace_after_save(manager, modify_inside_chunk=False)
    assert manager.stats().groups["sin"].tensors_kept == 1


def test_inplace_modification_with_offload_disabled_raises(make_manager):
    manager = make_manager(min_offload_bytes=1, offload=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _inplace_after_save(manager, modify_inside_chunk=False)


def test_inplace_on_an_unsaved_module_output_keeps_exact_grads(make_manager):
    def run(manager):
        torch.manual_seed(0)
        lin = nn.Linear(H, H)  # its output is not needed for its own backward
        if manager is not None:
            manager.offload_module(lin, "lin")
        x = torch.randn(N, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with _scope(manager, "iteration"):
            with _scope(manager, "chunk"):
                out = lin(x * 1)
                out.add_(1)
                out = out.tanh()
            out.sum().backward()
        return [out.detach(), x.grad, lin.weight.grad, lin.bias.grad]

    ref = run(None)
    manager = make_manager(min_offload_bytes=1)
    got = run(manager)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert manager.stats().groups["lin"].tensors_offloaded == 1


def test_public_mark_api():
    t = torch.randn(4)
    assert chunk_offload.mark_not_offloadable(t) is t
    assert is_marked_not_offloadable(t)
    assert not is_marked_not_offloadable(torch.randn(4))


@pytest.mark.parametrize(
    "attribute, value",
    [("_TE_do_not_offload", True), ("offloading_activation", False)],
    ids=["transformer_engine", "megatron_core"],
)
def test_marks_of_transformer_engine_and_megatron_are_honoured(attribute, value):
    from chunk_offload.core.tensor_policy import OffloadPolicy

    policy = OffloadPolicy(min_offload_bytes=1, device_type="cpu")
    x = torch.randn(8, 8) * 2
    assert policy.should_offload(x)
    setattr(x, attribute, value)
    assert not policy.should_offload(x)
    assert not policy.should_offload(x[1:])  # a view of the marked tensor
    other = torch.randn(8, 8) * 2
    setattr(other, attribute, not value)
    assert policy.should_offload(other)


def test_a_replaced_buffer_keeps_its_address_until_the_next_refresh():
    """A module that replaces a registered buffer in forward (as MoE routers do with their token
    counters) frees the old storage. While the policy lists its address as protected, that memory
    must not be reusable by a new activation, which would then wrongly be kept on device: the
    policy holds the storage itself until the next refresh."""
    import gc
    import weakref

    from chunk_offload.core.tensor_policy import OffloadPolicy

    module = nn.Module()
    module.register_buffer("counts", torch.zeros(64))
    policy = OffloadPolicy(min_offload_bytes=1, device_type="cpu")
    policy.protect(module)
    old = weakref.ref(module.counts.untyped_storage())
    module.counts = torch.zeros(64)
    gc.collect()
    assert old() is not None, "the protected storage was freed while the policy still listed its address"
    policy.refresh()
    gc.collect()
    assert old() is None, "a refresh must drop storages the module no longer has"
