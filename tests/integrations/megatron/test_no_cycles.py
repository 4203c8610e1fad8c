"""NOTE [No cycles per iteration] through the Megatron integration: auto iterations of an attached
chunk, its session and records included, leave nothing of chunk-offload to the garbage collector."""

from __future__ import annotations

import gc
import importlib.util
import types

import pytest

from tests.integrations.megatron.conftest import managed, pipeline_of_one  # noqa: F401 (fixtures)

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None


def _ours(obj: object) -> bool:
    """Whether ``obj`` is chunk-offload's: an instance of one of its classes, or a method bound to one."""
    owner = obj.__self__ if isinstance(obj, types.MethodType) else obj
    return type(owner).__module__.startswith("chunk_offload.")


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron-core is not installed")
@pytest.mark.parametrize("group_by", ["module", "layer"])
def test_training_iterations_leave_nothing_of_ours_in_reference_cycles(managed, group_by: str) -> None:
    from tests.integrations.megatron._auto_iterations import train_step

    chunk, manager = managed(iterations="auto", num_microbatches=2, group_by=group_by, schedule_policy="plan")
    for first in (0, 2, 4):  # a first iteration, then the plan's policy
        train_step(chunk, 2, first=first)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        train_step(chunk, 2, first=6)
        train_step(chunk, 2, first=8)  # its first chunk closes the iteration before (NOTE [Automatic iterations])
        gc.collect()
        found = sorted({type(obj).__qualname__ for obj in gc.garbage if _ours(obj)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert manager.training_calls == 4 and found == []  # the fifth is still open
