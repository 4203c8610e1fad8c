"""Joined calls (NOTE [Joined calls] in core/marks.py): a storage two calls save is copied once.

``proj`` is registered with ``joins="core"``: with ``group_by="module"`` its call joins the group
of the ``core`` call before it in its layer when its first tensor to copy is a storage of that
group (here ``tanh``'s output, saved by ``core`` as its output and by ``proj`` as its input, as
SDPA's output is by core_attn and attn_proj). Training stays bit-identical to training without
offload; the shared storage is copied and reloaded once instead of twice (``group_by="call"``);
a join whose condition fails is undone, and the calls are the groups they would be without it.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, CpuStreams, OffloadConfig, OffloadManager
from tests.core._models import Fn, assert_clean
from tests.core.test_cuda_call_counts import CountingStreams

HIDDEN, ROWS, LAYERS, MICROBATCHES = 8, 6, 2, 3


class Pair(nn.Module):
    """``post(x + proj(core(pre(x))))`` (``proj``: a factory); ``between`` (if any) runs between ``core`` and ``proj``."""

    def __init__(self, core: Callable = torch.tanh, proj: Callable[[], nn.Module] | None = None, between: Callable | None = None) -> None:
        super().__init__()
        self.pre = nn.Linear(HIDDEN, HIDDEN)
        self.core = Fn(core)
        self.between = Fn(between) if between is not None else None
        self.proj = proj() if proj is not None else nn.Linear(HIDDEN, HIDDEN)
        self.post = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.core(self.pre(x))
        if self.between is not None:
            h = self.between(h)
        return self.post(x + self.proj(h))


def _model(**pair) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Pair(**pair) for _ in range(LAYERS)])


def _register(manager: OffloadManager, model: nn.Sequential) -> None:
    for layer in model:
        manager.offload_module(layer.core, "core", layer=layer)
        manager.offload_module(layer.proj, "proj", layer=layer, joins="core")
        manager.offload_module(layer.post, "post", layer=layer)
        if layer.between is not None:
            manager.offload_module(layer.between, "between")


def _train(manager: OffloadManager | None, device: torch.device | None = None, **pair) -> tuple[list[torch.Tensor], list[str]]:
    """One iteration of ``MICROBATCHES`` chunks (on ``device``, default the CPU): the gradients, and
    the group names of the first chunk."""
    model = _model(**pair).to(device)
    if manager is not None:
        _register(manager, model)
    names: list[str] = []
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(ROWS, HIDDEN, generator=g).to(device) for _ in range(MICROBATCHES)]
    if manager is None:
        for x in xs:
            model(x).square().sum().backward()
    else:
        with manager.iteration():
            for m, x in enumerate(xs):
                with manager.chunk(microbatch=m) as handler:
                    loss = model(x).square().sum()
                names = names or [group.name for group in handler.groups]
                loss.backward()
    return [p.grad for p in model.parameters()], names


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_storage_saved_by_two_calls_is_copied_once(make_manager) -> None:
    reference, _ = _train(None)
    by_call = make_manager(group_by="call")
    grads_call, names_call = _train(by_call)
    joined = make_manager(group_by="module")
    grads_joined, names_joined = _train(joined)
    _assert_same(reference, grads_call)
    _assert_same(reference, grads_joined)
    assert names_call == ["core", "proj", "post"] * LAYERS
    assert names_joined == ["core+proj", "post"] * LAYERS
    call, module = by_call.stats(), joined.stats()
    shared = ROWS * HIDDEN * 4  # tanh's output, fp32: copied twice per layer call by "call", once joined
    copied = lambda stats: sum(g.bytes_offloaded for g in stats.groups.values())  # noqa: E731
    assert copied(call) - copied(module) == shared * LAYERS * MICROBATCHES
    assert module.groups["core+proj"].bytes_reloaded == module.groups["core+proj"].bytes_offloaded > 0
    assert module.groups["core+proj"].groups == LAYERS * MICROBATCHES
    assert sum(g.tensors_offloaded for g in call.groups.values()) == sum(g.tensors_offloaded for g in module.groups.values())
    assert_clean(by_call)
    assert_clean(joined)


@pytest.mark.parametrize(
    ("pair", "names"),
    [
        ({"core": torch.sin}, ["core", "proj", "post"]),  # core saves its input, proj sin's output
        ({"core": lambda t: t * 2.0}, ["core", "proj", "post"]),  # core saves nothing
        ({"proj": lambda: Fn(lambda t: t + 1.0)}, ["core", "proj", "post"]),  # proj saves nothing: undone at its end
        ({"between": torch.exp}, ["core", "between", "proj", "post"]),  # another group between: core commits alone
    ],
    ids=["not-shared", "target-empty", "joiner-empty", "interrupted"],
)
def test_a_join_whose_condition_fails_is_undone(make_manager, pair: dict, names: list[str]) -> None:
    reference, _ = _train(None, **pair)
    by_call, names_call = _train(make_manager(group_by="call"), **pair)
    manager = make_manager(group_by="module")
    grads, names_module = _train(manager, **pair)
    _assert_same(reference, by_call)
    _assert_same(reference, grads)
    assert names_module == names_call == names * LAYERS
    assert_clean(manager)


def test_layer_groups_join_every_call_and_call_groups_none(make_manager) -> None:
    reference, _ = _train(None)
    manager = make_manager(group_by="layer")
    grads, names = _train(manager)
    _assert_same(reference, grads)
    assert names == ["core+proj+post"] * LAYERS
    assert_clean(manager)


def _stream_ops(group_by: str) -> Counter:
    streams = CountingStreams()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1, measure_time=False, group_by=group_by), streams=streams)
    try:
        _train(manager)
    finally:
        manager.close()
    return Counter((op, stream) for op, stream, _, _ in streams.log)


def test_a_joined_pair_issues_its_stream_work_once() -> None:
    by_call, joined = _stream_ops("call"), _stream_ops("module")
    for op in (("copy", "d2h"), ("record_event", "d2h"), ("copy", "h2d"), ("record_event", "h2d")):
        assert by_call[op] == 3 * LAYERS * MICROBATCHES, op
        assert joined[op] == 2 * LAYERS * MICROBATCHES, op


@pytest.mark.parametrize("side", ["d2h", "h2d", "compute"])
@pytest.mark.parametrize("seed", range(3))
def test_joined_calls_under_delayed_streams(side: str, seed: int) -> None:
    reference, _ = _train(None)
    manager = OffloadManager(
        OffloadConfig(min_offload_bytes=1, group_by="module"), streams=CpuStreams(max_delay_s=2e-4, delay_on=(side,), seed=seed)
    )
    try:
        grads, names = _train(manager)
        assert_clean(manager)
    finally:
        manager.close()
    _assert_same(reference, grads)
    assert names == ["core+proj", "post"] * LAYERS


class _Boom(RuntimeError):
    pass


def _raise(*args: torch.Tensor) -> torch.Tensor:
    raise _Boom("forward failed")


def test_an_error_in_the_joining_call_leaves_nothing(make_manager) -> None:
    """An error in ``proj``'s forward, after its call joined ``core``'s group tentatively and before
    it saved anything, aborts the chunk: no hook, buffer or byte left; the next iteration runs."""
    manager = make_manager(group_by="module")
    model = _model()
    _register(manager, model)
    x = torch.randn(ROWS, HIDDEN)
    original, model[0].proj.forward = model[0].proj.forward, _raise
    with pytest.raises(_Boom):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                model(x)
    assert_clean(manager)
    model[0].proj.forward = original
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            loss = model(x).sum()
        loss.backward()
    assert [g.name for g in handler.groups] == ["core+proj", "post"] * LAYERS
    assert_clean(manager)


@pytest.mark.parametrize(
    ("joins", "layer", "message"),
    [
        ("core", None, "offload_module(joins=...) needs the name of another module of the same layer"),
        ("proj", nn.Linear(1, 1), "other than 'proj') and layer=..., got joins='proj'"),
        ("", nn.Linear(1, 1), "got joins=''"),
        (3, nn.Linear(1, 1), "got joins=3"),
    ],
    ids=["no-layer", "itself", "empty", "not-a-str"],
)
def test_joins_is_checked(make_manager, joins: object, layer: nn.Module | None, message: str) -> None:
    manager = make_manager()
    with pytest.raises(ChunkOffloadError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        manager.offload_module(nn.Linear(2, 2), "proj", layer=layer, joins=joins)
