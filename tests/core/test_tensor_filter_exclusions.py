"""What stays on device inside an offloaded module: parameters, buffers, small and marked tensors,
whether saved by custom Functions or native ops, or passed in as arguments (exact grads, exact bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from chunk_offload import mark_not_offloadable
from tests.core._models import Fn
from tests._driver import chunk_scope, iteration_scope
from tests.core._edge_cases import F32, H, N

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
    """Saves one tensor of every kind the tensor filter must keep, plus two eligible activations."""

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
        with iteration_scope(manager):
            with chunk_scope(manager):
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
