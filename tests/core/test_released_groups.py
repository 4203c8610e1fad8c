"""A released group lets go of its storages and events at once (`OffloadGroup._storage_released`).

A chunk's handler and its groups reference each other, so they are freed by the garbage collector,
not by reference counting. What a group holds past its release (each storage's record, its shape,
its copy events) would wait for a collection with them and weigh on every collection until then:
from the last release on, a group holds none of it.
"""

from __future__ import annotations

import gc

from chunk_offload.core import GroupState
from chunk_offload.core import group as group_module
from chunk_offload.core.saved import Storage
from tests._driver import Hooks, drive
from tests.core._models import make_stack, microbatches, register


class _CountedStorage(Storage):
    """`Storage`, of a type of its own: the records this test's groups make, told from any other."""


def test_released_groups_leave_nothing_for_the_collector(manager, monkeypatch) -> None:
    monkeypatch.setattr(group_module, "Storage", _CountedStorage)
    model = make_stack(2, seed=0)
    register(manager, model)
    handlers = []
    drive(model, inputs=microbatches(2), manager=manager, iterations=2, lr=None,
          hooks=Hooks(forwarded=lambda step, _: handlers.append(step.handler)))  # fmt: skip
    groups = [g for h in handlers for g in h.groups]
    assert groups and all(g.state is GroupState.RELEASED and g.storages == {} for g in groups)
    assert manager.stats().bytes_offloaded > 0
    del handlers, groups
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        drive(model, inputs=microbatches(2), manager=manager, lr=None)
        gc.collect()
        cyclic = [o for o in gc.garbage if type(o) is _CountedStorage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == [], f"{len(cyclic)} storage records left for the garbage collector"
