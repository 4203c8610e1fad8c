"""Bad input and lifecycle, tried as a new user would (issue 13 section 1).

Pytree outputs are compared bit for bit with a run without offload; every refusal is a
`ChunkOffloadError` checked by its message.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import re
import threading
import weakref

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadConfig, OffloadManager
from tests._driver import RunResult, assert_identical, drive
from tests.core._bad_input import _forward_in_open_chunk, _offloaded_manager
from tests.core._models import assert_clean


Pair = collections.namedtuple("Pair", ["hidden", "gate"])


class DictBlock(nn.Module):
    """HF-style block: returns a dict holding a nested tuple, a namedtuple and a non-tensor."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x).tanh()
        return {"hidden": h, "extra": (h.sin(), [h.cos()]), "pair": Pair(h * 2, h.sigmoid()), "n": 3}


class DictStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DictBlock(0), DictBlock(1)])

    def forward(self, x):
        for block in self.blocks:
            out = block(x)
            assert out["n"] == 3
            x = out["hidden"] + out["extra"][0] * out["extra"][1][0] + out["pair"].hidden * out["pair"].gate
        return x


def _square_sum(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


def _dict_run(offload: bool) -> RunResult:
    """One forward and backward; the loss and the gradients of the input and of every parameter."""
    model = DictStack()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1)) if offload else None
    if manager is not None:
        for i, block in enumerate(model.blocks):
            manager.offload_module(block, f"block{i}")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    result = drive(model, inputs=[x], manager=manager, loss=_square_sum, params=[x, *model.parameters()], lr=None)
    if manager is not None:
        assert manager.stats().bytes_offloaded > 0  # the groups with dict outputs did move
        assert_clean(manager)
        manager.close()
    return result


def test_module_returning_a_dict_pytree_is_offloaded_bit_exact():
    assert_identical(_dict_run(False), _dict_run(True))


def test_group_marks_pass_a_dict_through(make_manager):
    manager = make_manager()
    x = torch.randn(4, requires_grad=True)
    with manager.iteration():
        with manager.chunk(microbatch=0):
            inputs = manager.group_start({"x": x}, "a")
            out = manager.group_commit({"y": inputs["x"].sin(), "k": "keep"}, "a")
        assert out["k"] == "keep"
        out["y"].sum().backward()
    assert torch.equal(x.grad, x.detach().cos())
    assert_clean(manager)


@pytest.mark.parametrize("second", ["lin", "other"])
def test_offload_module_twice_is_refused_at_registration(make_manager, second):
    manager = make_manager()
    module = nn.Linear(2, 2)
    manager.offload_module(module, "lin")
    with pytest.raises(
        ChunkOffloadError,
        match=rf"^chunk_offload: offload_module: this Linear is already offloaded as group 'lin'; "
        rf"cannot register it again as '{second}'",
    ):
        manager.offload_module(module, second)
    assert [r.name for r in manager.module_offloads] == ["lin"]
    manager.module_offloads[0].remove()
    manager.offload_module(module, second)  # after remove() it may be registered again


@pytest.mark.parametrize("in_chunk_scope", [False, True])
def test_close_mid_iteration_without_error_ends_it_cleanly(in_chunk_scope):
    manager, module = _offloaded_manager()
    with manager.iteration():
        with manager.chunk(microbatch=0):
            module(torch.randn(3, 4, requires_grad=True))
        if in_chunk_scope:  # the with-blocks exit quietly after close
            with manager.chunk(microbatch=1):
                module(torch.randn(3, 4, requires_grad=True))
                manager.close()
        else:
            _forward_in_open_chunk(manager, module)
            manager.close()
    assert manager.closed and not manager.in_iteration
    assert manager.last_iteration is None  # discarded, no record
    assert_clean(manager)


def test_streams_must_be_a_stream_backend():
    with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: OffloadManager\(streams=...\) takes a StreamBackend .* got 'cpu'"):
        OffloadManager(streams="cpu")


def test_chunk_microbatch_bool_is_refused(make_manager):
    manager = make_manager()
    with manager.iteration():
        with pytest.raises(ChunkOffloadError, match=r"chunk\(\) needs microbatch as an int >= 0, got True"):
            manager.begin_chunk(microbatch=True)
    assert_clean(manager)


def test_mark_not_offloadable_needs_a_tensor():
    from chunk_offload import mark_not_offloadable

    with pytest.raises(ChunkOffloadError, match=r"mark_not_offloadable\(tensor=...\) takes a torch.Tensor, got \[1, 2\]"):
        mark_not_offloadable([1, 2])


@pytest.mark.parametrize("bad", ["x", -1.0, float("nan"), float("inf"), True])
def test_cpu_streams_max_delay_is_checked(bad):
    from chunk_offload import CpuStreams

    with pytest.raises(ChunkOffloadError, match=rf"CpuStreams\(max_delay_s=...\) takes a finite number of seconds >= 0, got {bad!r}"):
        CpuStreams(max_delay_s=bad)


def _offload_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("chunk_offload")]


def test_dropped_managers_leave_no_threads_and_no_hooks():
    from chunk_offload import CpuStreams

    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4)
    expected = module(x)
    gc.collect()
    start = len(_offload_threads())
    for _ in range(10):
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=CpuStreams())
        manager.offload_module(module, "m")
        with manager.iteration():
            with manager.chunk(microbatch=0):
                module(x).sum()
        del manager
    gc.collect()
    for thread in _offload_threads():
        thread.join(timeout=10)  # the finalizer asked each worker to stop; wait for it to exit
    assert len(_offload_threads()) == start
    assert not module._forward_pre_hooks and not module._forward_hooks
    assert torch.equal(module(x), expected)


def test_a_closed_manager_keeps_no_model_alive() -> None:
    """close() drops the protected modules and their parameters' storages: the model (and its
    device memory) goes when the user drops it, while the manager object may live on."""
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    manager.offload_module(model[1], "tanh")
    manager.protect_module(model)
    with manager.iteration():
        with manager.chunk(microbatch=0):
            loss = model(torch.randn(4, 8)).sum()
        loss.backward()
    for registration in manager.module_offloads:
        registration.remove()
    manager.close()
    alive = weakref.ref(model), weakref.ref(model[0].weight)
    del model, loss
    gc.collect()
    assert [ref() for ref in alive] == [None, None]
    assert manager.closed


# ----------------------------------------------------------------------------- group marks of a wrong type


@pytest.mark.parametrize("mark", ["group_start", "group_commit"])
@pytest.mark.parametrize("tensors, shown", [(42, "42 (int)"), ("x", "'x' (str)"), (None, "None (NoneType)"), ((), "() (tuple)"), ({"a": 1}, "{'a': 1} (dict)")])
@pytest.mark.parametrize("in_chunk", [True, False])
def test_group_marks_without_a_tensor_fail_at_the_call(make_manager, mark, tensors, shown, in_chunk):
    manager = make_manager()
    with manager.iteration():
        scope = manager.chunk(microbatch=0) if in_chunk else contextlib.nullcontext()
        with scope:
            with pytest.raises(ChunkOffloadError) as info:
                getattr(manager, mark)(tensors, "g")
    message = str(info.value)
    assert message.startswith(f"chunk_offload: {mark}(tensors, name='g') needs tensors as a tensor or a tuple, list, dict")
    assert f"got {shown}" in message
    assert_clean(manager)


@pytest.mark.parametrize("mark", ["group_start", "group_commit"])
@pytest.mark.parametrize("name, shown", [(42, "42 (int)"), ("", "'' (str)"), (None, "None (NoneType)")])
def test_group_marks_with_a_bad_name_fail_at_the_call(make_manager, mark, name, shown):
    manager = make_manager()
    x = torch.randn(2, requires_grad=True)
    with manager.iteration():
        with manager.chunk(microbatch=0):
            with pytest.raises(ChunkOffloadError, match=re.escape(f"{mark}(tensors, name) needs name as a non-empty str, got {shown}")):
                getattr(manager, mark)(x, name)
    assert_clean(manager)


def test_a_module_returning_no_tensor_is_still_offloaded_quietly(make_manager):
    class Side(nn.Module):
        def forward(self, x):
            x.sin()
            return None

    manager = make_manager()
    manager.offload_module(Side(), "side")
    with manager.iteration():
        with manager.chunk(microbatch=0):
            manager.module_offloads[0].module(torch.randn(3, requires_grad=True))
    assert_clean(manager)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m.protect_module(3), "protect_module expects an nn.Module, got int 3"),
        (lambda m: m.protect_module(torch.zeros(2)), "protect_module expects an nn.Module, got Tensor"),
        (lambda m: m.end_iteration(discard="no"), "end_iteration(discard=...) takes True or False, got 'no'"),
        (lambda m: m.end_chunk(abort=1), "end_chunk(abort=...) takes True or False, got 1"),
    ],
)
def test_other_arguments_of_a_wrong_type_fail_at_the_call_and_leave_the_manager_usable(make_manager, call, message):
    manager = make_manager()
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    manager.offload_module(module, "m")
    manager.begin_iteration()
    manager.begin_chunk(microbatch=0)
    with pytest.raises(ChunkOffloadError, match=re.escape(message)):
        call(manager)
    out = module(torch.randn(3, 4, requires_grad=True))
    manager.end_chunk()
    out.sum().backward()
    manager.end_iteration()
    with manager.iteration():  # a refused protect_module left nothing behind
        with manager.chunk(microbatch=0):
            module(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert_clean(manager)
