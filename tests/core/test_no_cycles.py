"""NOTE [No cycles per iteration]: a training iteration leaves no reference cycle for the garbage collector.

Every object the engine makes for an iteration (chunk handlers, groups, saved references, events)
is freed by reference counting once the iteration ends: the garbage collector, run with
``DEBUG_SAVEALL`` around one steady-state iteration, finds nothing, whether groups copy or only
keep, group by module call or by layer, run 1F1B or interleaved, or the iteration is discarded.
"""

from __future__ import annotations

import gc

import pytest
import torch

import chunk_offload
from chunk_offload import OffloadConfig, OffloadManager

from ._models import INTERLEAVED, ONE_F_ONE_B, run_schedule


def _cyclic_garbage_of_iteration(config: OffloadConfig, order, model_chunks: int, *, discard: bool = False) -> list[str]:
    """Type names of what the collector finds after the third iteration (the first two warm up)."""
    found: list[str] = []

    def after_iteration(manager: OffloadManager | None, iteration: int) -> None:
        if iteration == 1:
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
        elif iteration == 2:
            gc.collect()
            found.extend(type(obj).__name__ for obj in gc.garbage)
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()

    try:
        run_schedule(lambda: OffloadManager(config), order=order, model_chunks=model_chunks, iterations=3, after_iteration=after_iteration)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found


@pytest.mark.parametrize("group_by", ["module", "layer", "call"])
@pytest.mark.parametrize("offload", [True, False])
def test_an_iteration_leaves_no_reference_cycle(group_by: str, offload: bool) -> None:
    config = OffloadConfig(min_offload_bytes=1, offload=offload, group_by=group_by)
    assert _cyclic_garbage_of_iteration(config, ONE_F_ONE_B, 1) == []


def test_an_interleaved_iteration_leaves_no_reference_cycle() -> None:
    assert _cyclic_garbage_of_iteration(OffloadConfig(min_offload_bytes=1), INTERLEAVED, 2) == []


def test_a_discarded_iteration_leaves_no_reference_cycle() -> None:
    """A chunk handler let go of after `end_iteration(discard=True)` holds nothing either."""
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        layer = torch.nn.Linear(8, 8)
        manager.offload_module(layer, "layer")
        for step in range(3):
            if step == 2:
                gc.collect()
                gc.disable()
                gc.set_debug(gc.DEBUG_SAVEALL)
            manager.begin_iteration()
            with manager.chunk(microbatch=0):
                loss = layer(torch.randn(4, 8)).sum()
            if step < 2:
                loss.backward()
                manager.end_iteration()
            else:
                manager.end_iteration(discard=True)  # the graph is dropped without a backward
                del loss
                gc.collect()
                assert [type(obj).__name__ for obj in gc.garbage] == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        manager.close()


def test_a_graph_of_a_discarded_iteration_still_says_so_after_its_handler_let_go() -> None:
    """The handler let go of its discarded groups at the iteration's end; a backward over the graph
    kept from that iteration still gets the discarded group's error, not a missing handler."""
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        layer = torch.nn.Linear(8, 8)
        manager.offload_module(layer, "layer")
        manager.begin_iteration()
        with manager.chunk(microbatch=0) as handler:
            loss = layer(torch.randn(4, 8, requires_grad=True)).sum()
        manager.end_iteration(discard=True)
        assert [group.handler for group in handler.groups] == [None]
        with pytest.raises(chunk_offload.ChunkOffloadError, match=r"cannot unpack a tensor of group 'layer' .*: the group was discarded"):
            loss.backward()
    finally:
        manager.close()
