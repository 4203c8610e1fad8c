"""`ChunkOffloadHandler` driven exactly as Transformer Engine drives its offload handler.

As TE's ``CpuOffloadHookWithOffloadHandler`` and ``GroupCommitFunction`` do (every saved tensor
through ``tensor_push`` / ``tensor_pop``, ``on_group_commit_forward`` at each layer's end,
``on_group_commit_backward`` in the commit function's backward), training is bit-identical to
training without it; protocol misuse raises. Transformer Engine itself is never imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import chunk_offload
from chunk_offload import ChunkOffloadError, CpuStreams, OffloadConfig, OffloadManager
from chunk_offload.core import ChunkOffloadHandler
from chunk_offload.core import GroupState
from tests._driver import Hooks, RunResult, Step, assert_identical, assert_no_live_chunks, drive
from tests.core._models import make_stack, microbatches


# ----------------------------------------------------------------------------- driven as TE drives it


class GroupCommit(torch.autograd.Function):
    """TE's ``GroupCommitFunction``: identity; commits in forward, reaches the group in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, handler: ChunkOffloadHandler) -> torch.Tensor:
        handler.on_group_commit_forward()
        ctx.handler = handler
        return tensor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.handler.on_group_commit_backward()
        return grad_output, None


class ObservedGroupCommit(GroupCommit):
    """`GroupCommit` that records every group's state right after ``on_group_commit_backward``."""

    log: list[list[GroupState]] = []

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.handler.on_group_commit_backward()
        ObservedGroupCommit.log.append([g.state for g in ctx.handler.groups])
        return grad_output, None


# What TE's hook passes as ``handler_extra_kwargs`` is up to its caller: pass some, as **kwargs.
EXTRA_KWARGS = {"te_extra": True}


@contextlib.contextmanager
def te_offload_hook(handler: ChunkOffloadHandler) -> Iterator[None]:
    """TE's ``CpuOffloadHookWithOffloadHandler``, on the public saved-tensor hooks API."""
    with saved_tensors_hooks(
        lambda tensor: handler.tensor_push(tensor, **EXTRA_KWARGS),
        lambda tag: handler.tensor_pop(tag, **EXTRA_KWARGS),
    ):
        yield


def te_forward(model: torch.nn.Sequential, x: torch.Tensor, handler: ChunkOffloadHandler | None, commit=GroupCommit) -> torch.Tensor:
    """Each layer under the hook, then its commit, as TE's ``get_cpu_offload_context`` is used."""
    h = x
    for layer in model:
        if handler is None:
            h = layer(h)
        else:
            with te_offload_hook(handler):
                h = layer(h)
            h = commit.apply(h, handler)
    return h.pow(2).mean()


LAYERS = 3
MICROBATCHES = 2
ITERATIONS = 2
GPIPE = ("F0", "F1", "B0", "B1")  # all forwards, then all backwards
INSIDE = ("FB0", "FB1")  # each microbatch's backward inside its chunk


def train(
    manager: OffloadManager | None, *, order=GPIPE, groupid_reset: bool = True, hooks: Hooks | None = None
) -> tuple[RunResult, list[chunk_offload.OffloadStats]]:
    """``order`` per iteration, every forward as TE drives it; the manager's stats after each iteration."""
    stats = []

    def forward(model: torch.nn.Sequential, x: torch.Tensor, step: Step) -> torch.Tensor:
        if groupid_reset and step.handler is not None:
            step.handler.groupid_reset()  # TE resets its handler before each iteration's forwards
        return te_forward(model, x, step.handler)

    def after(manager: OffloadManager | None, iteration: int) -> None:
        assert_no_live_chunks(manager, iteration)
        if manager is not None:
            stats.append(manager.stats())

    hooks = dataclasses.replace(hooks or Hooks(), after_iteration=after)
    model = make_stack(LAYERS, seed=0)
    inputs = microbatches(MICROBATCHES)
    result = drive(model, inputs=inputs, manager=manager, order=order, iterations=ITERATIONS, forward=forward, loss=_as_is, hooks=hooks)
    return result, stats


def _as_is(loss: torch.Tensor) -> torch.Tensor:
    return loss  # te_forward returns the loss


@pytest.mark.parametrize("seed", range(3))
def test_te_driven_training_is_bit_identical(seed: int) -> None:
    reference, _ = train(None)
    streams = CpuStreams(max_delay_s=5e-4, delay_on=("d2h", "h2d"), seed=seed) if seed else CpuStreams()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=streams)
    try:
        result, stats = train(manager)
    finally:
        manager.close()
    assert_identical(reference, result)
    final = stats[-1]
    assert set(final.groups) == {"te_group"}  # groups opened by tensor_push, named by the handler
    g = final.groups["te_group"]
    assert g.groups == LAYERS * MICROBATCHES * ITERATIONS
    # Every layer's group went to host and came back: the last one too, released at the chunk's end.
    assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, g
    assert g.tensors_kept > 0  # parameters (and views of them) stay on device
    assert final.resident_bytes == 0 and final.host_bytes == 0 and final.pool.in_use_bytes == 0


def test_te_driven_backward_inside_the_chunk() -> None:
    """``with mgr.iteration(), mgr.chunk(microbatch=0) as handler:`` around forward and backward."""
    reference, _ = train(None, order=INSIDE)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        result, stats = train(manager, order=INSIDE)
    finally:
        manager.close()
    assert_identical(reference, result)
    g = stats[-1].groups["te_group"]
    # The last layer's group is still being offloaded when backward reaches it: its copy is
    # cancelled, so the others' bytes come back and its own stay on device.
    assert 0 < g.bytes_reloaded < g.bytes_offloaded, g
    assert stats[-1].resident_bytes == 0 and stats[-1].host_bytes == 0


def test_commit_backward_prefetches_the_previous_group() -> None:
    """``on_group_commit_backward`` makes its group resident and starts the reload of the one before."""
    model = make_stack(LAYERS, seed=0)
    (x,) = microbatches(1)
    ObservedGroupCommit.log = []
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        with manager.iteration():
            with manager.chunk(microbatch=0) as handler:
                loss = te_forward(model, x, handler, commit=ObservedGroupCommit)
            assert [g.state for g in handler.groups] == [GroupState.ON_HOST] * LAYERS
            loss.backward()
    finally:
        manager.close()
    log = ObservedGroupCommit.log
    assert len(log) == LAYERS
    for step, states in enumerate(log):
        current = LAYERS - 1 - step
        assert states[current] is GroupState.RESIDENT, (step, states)
        if current > 0:
            assert states[current - 1] in (GroupState.RELOADING, GroupState.RESIDENT), (step, states)
        assert all(s is GroupState.ON_HOST for s in states[: max(current - 1, 0)]), (step, states)


def test_bulk_reload_and_offload_by_group_id() -> None:
    """TE's bulk calls by group id: reload ahead of backward, offload of a committed group is a no-op."""
    reference, _ = train(None)

    def reload_ahead(step: Step) -> None:
        step.handler.bulk_reload_group(LAYERS - 1)
        step.handler.bulk_reload_group(LAYERS - 1)  # idempotent
        assert step.handler.groups[LAYERS - 1].state is GroupState.RELOADING

    hooks = Hooks(
        forwarded=lambda step, loss: step.handler.bulk_offload_group(0),  # already issued at commit: no-op
        before_backward=reload_ahead,
    )
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        result, _ = train(manager, groupid_reset=False, hooks=hooks)
        stats = manager.stats()
    finally:
        manager.close()
    assert_identical(reference, result)
    g = stats.groups["te_group"]
    assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded


def test_protocol_misuse_raises() -> None:
    model = make_stack(1, seed=0)
    (x,) = microbatches(1)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        with manager.iteration(), manager.chunk(microbatch=0) as handler:
            with te_offload_hook(handler):
                h = model(x)
            with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: groupid_reset on chunk .* while group 'te_group' is open"):
                handler.groupid_reset()
            with pytest.raises(ChunkOffloadError, match=r"bulk_offload_group\(0\) .* the group is still open"):
                handler.bulk_offload_group(0)
            h = GroupCommit.apply(h, handler)
            with pytest.raises(ChunkOffloadError, match=r"group id 1 is out of range for chunk .* with 1 groups"):
                handler.bulk_reload_group(1)
            with pytest.raises(ChunkOffloadError, match="tensor_pop got an unknown tag"):
                handler.tensor_pop(("not", "ours"), **EXTRA_KWARGS)
        h.pow(2).mean().backward()
        with pytest.raises(ChunkOffloadError, match="on_group_commit_backward on chunk .* with no committed group left"):
            handler.on_group_commit_backward()
        assert manager.live_chunks() == []
    finally:
        manager.close()


def test_handler_refuses_groups_after_its_chunk_ended() -> None:
    model = make_stack(2, seed=0)
    (x,) = microbatches(1)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        with manager.iteration():
            with manager.chunk(microbatch=0) as handler:
                loss = te_forward(model, x, handler)
            loss.backward()
        with manager.iteration():
            handler.groupid_reset()  # what a TE user does with a long-lived handler
            with pytest.raises(ChunkOffloadError, match=r"after that chunk's forward ended"):
                te_forward(model, x, handler)
    finally:
        for group in handler.groups:
            group.discard()  # break the leak of the unfixed code, so later tests start clean
        manager.close()
