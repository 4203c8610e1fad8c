"""Parity of the paths beside the schedules: blocks that mark their own groups (`group_start` /
`group_commit`), and forwards with gradients off, outside a chunk or after `remove` (exact, `torch.equal`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chunk_offload import OffloadConfig, OffloadManager
from tests._driver import Hooks, RunResult, Step, assert_identical, assert_no_live_chunks, drive
from tests.core._models import (
    HEADS,
    HIDDEN,
    MODULE_KINDS,
    ONE_F_ONE_B,
    CoreAttention,
    make_stack,
    microbatches,
    register,
)

ITERATIONS = 3
LAYERS = 2
MICROBATCHES = 4


# ----------------------------------------------------------------------------- low-level marks


class MarkedBlock(nn.Module):
    """A block that opens and commits its groups itself with `group_start` / `group_commit`.

    Groups are marked on a single tensor, on a tuple and on a list, and one group's inputs are
    views of another group's output (q, k, v of one qkv tensor).
    """

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.attn = CoreAttention(HEADS)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)
        self.manager: OffloadManager | None = None

    def _start(self, tensors, name):
        return tensors if self.manager is None else self.manager.group_start(tensors, name)

    def _commit(self, tensors, name):
        return tensors if self.manager is None else self.manager.group_commit(tensors, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._start(x, "g_qkv")
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        q, k, v = self._commit((q, k, v), "g_qkv")
        q, k, v = self._start([q, k, v], "g_attn")
        a = self._commit(self.attn(q, k, v), "g_attn")
        x = x + self.proj(a)
        h = self._start((x,), "g_mlp")[0]
        y = self._commit(self.fc2(F.gelu(self.fc1(h))), "g_mlp")
        return x + y


def _make_marked(layers: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[MarkedBlock() for _ in range(layers)])


def _train_marked(manager: OffloadManager | None, *, protect: bool) -> RunResult:
    model = _make_marked(LAYERS)
    if manager is not None:
        for block in model:
            block.manager = manager
        if protect:
            manager.protect_module(model)
    inputs = microbatches(MICROBATCHES)
    hooks = Hooks(after_iteration=assert_no_live_chunks)
    return drive(model, inputs=inputs, manager=manager, order=ONE_F_ONE_B, iterations=ITERATIONS, hooks=hooks)


@pytest.mark.parametrize("protect", [False, True], ids=["unprotected", "protected"])
def test_parity_low_level_group_marks(protect: bool) -> None:
    reference = _train_marked(None, protect=False)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        result = _train_marked(manager, protect=protect)
        stats = manager.stats()
    finally:
        manager.close()
    assert_identical(reference, result)
    assert set(stats.groups) == {"g_qkv", "g_attn", "g_mlp"}
    for name, g in stats.groups.items():
        assert g.groups == ITERATIONS * MICROBATCHES * LAYERS, (name, g)
        assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (name, g)
    assert stats.resident_bytes == 0 and stats.host_bytes == 0
    assert stats.pool.in_use_bytes == 0


def test_low_level_marks_outside_chunk_are_identity() -> None:
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        x = torch.randn(3, requires_grad=True)
        pair = (x, x * 2)
        assert manager.group_start(x, "g") is x
        assert manager.group_commit(pair, "g") is pair
        with manager.iteration():
            assert manager.group_start(x, "g") is x
            with torch.no_grad(), manager.chunk(microbatch=0) as handler:
                assert handler is None
                assert manager.group_start(pair, "g") is pair
                assert manager.group_commit(x, "g") is x
        assert manager.stats().groups == {}
    finally:
        manager.close()


# ----------------------------------------------------------------------------- no grad, evaluation


def _plain_and_registered(kinds=MODULE_KINDS):
    reference = make_stack(LAYERS, seed=0)
    model = make_stack(LAYERS, seed=0)
    # Module groups: the checks count each kind's groups under its own name.
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module"))
    register(manager, model, kinds)
    return reference, model, manager


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_forward_in_chunk_tracks_nothing(mode: str) -> None:
    reference, model, manager = _plain_and_registered()
    x = microbatches(1)[0]
    grad_off = torch.no_grad if mode == "no_grad" else torch.inference_mode
    try:
        before = manager.stats()
        with manager.iteration():
            with grad_off():
                with manager.chunk(microbatch=0, vp_stage=0) as handler:
                    assert handler is None
                    assert manager.current_handler is None
                    y = model(x)
                expected = reference(x)
            assert manager.live_chunks() == []
        assert torch.equal(y, expected)
        assert manager.stats() == before
        assert manager.live_chunks() == []

        # The manager is usable with gradients afterwards: a tracked chunk offloads and is exact.
        def tracked(step: Step, loss: torch.Tensor) -> None:
            assert step.handler is not None

        hooks = Hooks(forwarded=tracked)
        assert_identical(drive(reference, inputs=[x], lr=None), drive(model, inputs=[x], manager=manager, lr=None, hooks=hooks))
        stats = manager.stats()
        for kind in MODULE_KINDS:
            assert stats.groups[kind].groups == LAYERS
            assert stats.groups[kind].bytes_offloaded == stats.groups[kind].bytes_reloaded > 0
        assert manager.live_chunks() == []
    finally:
        manager.close()


def test_registered_module_outside_chunk_runs_without_offload() -> None:
    """Evaluation (and plain training steps) outside any chunk: hooks pass through, nothing tracked."""
    reference, model, manager = _plain_and_registered()
    x = microbatches(1)[0]
    try:
        before = manager.stats()
        # Evaluation outside any iteration.
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        model.eval()
        reference.eval()
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        model.train()
        reference.train()
        # Gradients enabled but no chunk: outside an iteration and inside one.
        model(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        with manager.iteration():
            model(x).sum().backward()
        reference(x).sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert manager.stats() == before
        assert manager.stats().groups == {}
        assert manager.live_chunks() == []
    finally:
        manager.close()


def test_unregistered_after_remove_runs_without_offload() -> None:
    reference = make_stack(1, seed=0)
    model = make_stack(1, seed=0)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        handles = [manager.offload_module(getattr(model[0], kind), kind) for kind in MODULE_KINDS]
        for handle in handles:
            handle.remove()
        xs = microbatches(1)

        def nothing_offloaded(step: Step) -> None:
            assert step.handler.groups == []

        hooks = Hooks(chunk_ended=nothing_offloaded)
        assert_identical(drive(reference, inputs=xs, lr=None), drive(model, inputs=xs, manager=manager, lr=None, hooks=hooks))
        assert manager.stats().groups == {}
    finally:
        manager.close()
