"""`OffloadConfig.profile_ranges`: profiler ranges around each group's copies and waits.

On, every offloaded group shows exactly one ``offload`` and one ``reload`` range, and one range
for each compute wait on them, in a `torch.profiler` trace; a policy prefetch shows one
``prefetch`` range per prefetched group. Off (the default), no range appears and no
`record_function` is even made.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadConfig
from chunk_offload.core import engine_context as ranges_module
from chunk_offload.core.schedule_policy import SchedulePolicy
from tests._driver import drive

LAYERS = 4
_RANGE = re.compile(r"^chunk_offload::(\w+) (\w+)\[(\d+)\] mb=(\d+) vp=(\d+)$")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(LAYERS)])


def _run(
    make_manager, *, profile_ranges: bool, microbatches: int = 1, schedule_policy: SchedulePolicy | None = None, **config
):
    """Forwards of ``microbatches`` chunks, then their backwards (last first), under the profiler.

    Returns the ranges (step -> Counter of (group index, microbatch)) and the iteration's record.
    """
    manager = make_manager(profile_ranges=profile_ranges, measure_time=False, **config)
    if schedule_policy is not None:
        manager.schedule_policy = schedule_policy
    model = _model()
    for layer in model:
        manager.offload_module(layer, "layer")
    x = torch.randn(4, 16)
    order = [("F", mb, 0) for mb in range(microbatches)] + [("B", mb, 0) for mb in reversed(range(microbatches))]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        drive(model, inputs=[x] * microbatches, manager=manager, order=order, loss=torch.sum, lr=None)
    ranges: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for event in prof.events():
        if event.name.startswith("chunk_offload::"):
            match = _RANGE.match(event.name)
            assert match, f"range name not in the documented form: {event.name!r}"
            step, name, index, mb, vp = match.groups()
            assert (name, vp) == ("layer", "0")
            ranges[step][(int(index), int(mb))] += 1
    return ranges, manager.last_iteration


def test_one_offload_and_one_reload_range_per_offloaded_group(make_manager) -> None:
    ranges, record = _run(make_manager, profile_ranges=True, microbatches=2)
    stats = record.groups["layer"]
    assert stats.bytes_offloaded > 0 and stats.groups == 2 * LAYERS
    every_group = {(index, mb): 1 for index in range(LAYERS) for mb in range(2)}
    # Every group is offloaded (min_offload_bytes=1), released at the end of its chunk's forward
    # without a compute wait (NOTE [Release by the copy stream]), reloaded in backward: one
    # range of each step per group, none twice.
    assert ranges["offload"] == every_group
    assert ranges["reload"] == every_group
    assert ranges["wait_reload"] == every_group
    assert "prefetch" not in ranges  # the default policy prefetches nothing
    assert set(ranges) == {"offload", "reload", "wait_reload"}


def test_deterministic_memory_names_each_release_wait(make_manager) -> None:
    """With ``deterministic_memory`` each release waits on its offload: one ``wait_offload`` range per group."""
    ranges, _ = _run(make_manager, profile_ranges=True, microbatches=2, deterministic_memory=True)
    assert ranges["wait_offload"] == {(index, mb): 1 for index in range(LAYERS) for mb in range(2)}


def test_no_range_and_no_record_function_when_off(make_manager, monkeypatch) -> None:
    made = []
    real = ranges_module.record_function
    monkeypatch.setattr(ranges_module, "record_function", lambda name: made.append(name) or real(name))
    ranges, record = _run(make_manager, profile_ranges=False)
    assert record.groups["layer"].bytes_offloaded > 0
    assert dict(ranges) == {} and made == []
    ranges, _ = _run(make_manager, profile_ranges=True)  # the counter does see ranges when on
    assert len(made) == sum(sum(c.values()) for c in ranges.values()) > 0


class _PrefetchFirstChunk(SchedulePolicy):
    """When chunk 1's backward starts (it runs first), prefetch chunk 0 within ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def prefetch_on(self, kind, key):
        return [((0, 0), self.budget)] if (kind, tuple(key)) == ("B", (1, 0)) else []


def test_a_policy_prefetch_is_one_range_per_prefetched_group(make_manager) -> None:
    group_bytes = 4 * 16 * 4 * 2  # a Linear's input and a Tanh's output, float32
    policy = _PrefetchFirstChunk(budget=2 * group_bytes)  # the chunk's last two groups
    ranges, record = _run(make_manager, profile_ranges=True, microbatches=2, schedule_policy=policy)
    assert record.group_bytes[(0, 0)] == [group_bytes] * LAYERS
    assert ranges["prefetch"] == {(LAYERS - 1, 0): 1, (LAYERS - 2, 0): 1}
    # A prefetched group is still reloaded once: its reload range sits inside the prefetch range.
    assert ranges["reload"] == {(index, mb): 1 for index in range(LAYERS) for mb in range(2)}


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_profile_ranges_must_be_a_bool(value) -> None:
    with pytest.raises(ChunkOffloadError, match=re.escape(f"profile_ranges must be True or False, got {value!r}")):
        OffloadConfig(profile_ranges=value).validate()
