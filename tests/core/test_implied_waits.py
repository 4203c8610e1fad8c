"""NOTE [Implied waits] (core/streams/base.py): a wait on an event is not issued when the
waiting stream is already after it, and the clocks are merged all the same.

On `CpuStreams` (the rule lives in the base `Stream`, which `CudaStreams` shares): the
cases that imply a wait, the ones that do not, and the checker's view of a skipped wait.
"""

from __future__ import annotations

import pytest
import torch

from chunk_offload import CpuStreams, HappensBeforeError


@pytest.fixture
def streams():
    backend = CpuStreams()
    yield backend
    backend.close()


def _record_after_work(stream):
    """An event on ``stream`` after one launched piece of work, and that work's mark."""
    mark, _ = stream.launch(lambda: torch.zeros(4).add_(1))
    return stream.record_event(), mark


def test_a_wait_on_a_later_event_of_the_same_stream_implies_the_earlier_ones(streams) -> None:
    first, _ = _record_after_work(streams.d2h)
    second, _ = _record_after_work(streams.d2h)
    assert not streams.h2d.implies(first) and not streams.h2d.implies(second)
    streams.h2d.wait_event(second)
    assert streams.h2d.implies(first) and streams.h2d.implies(second)
    third, _ = _record_after_work(streams.d2h)
    assert not streams.h2d.implies(third)
    # Only the stream that waited is after them.
    assert not streams.compute.implies(first)
    streams.synchronize()


def test_a_host_wait_implies_the_event_and_earlier_ones_for_every_stream(streams) -> None:
    first, _ = _record_after_work(streams.h2d)
    second, _ = _record_after_work(streams.h2d)
    second.synchronize()
    for stream in (streams.compute, streams.d2h):
        assert stream.implies(first) and stream.implies(second)
    later, _ = _record_after_work(streams.h2d)
    assert not streams.d2h.implies(later)
    streams.h2d.synchronize()  # a stream's synchronize is a host wait on its newest work
    assert streams.d2h.implies(later)


def test_waiting_on_a_stream_implies_its_events_so_far_only(streams) -> None:
    before, _ = _record_after_work(streams.d2h)
    streams.h2d.wait_stream(streams.d2h)
    after, _ = _record_after_work(streams.d2h)
    assert streams.h2d.implies(before) and not streams.h2d.implies(after)
    streams.synchronize()


def test_a_skipped_wait_still_orders_the_access_for_the_checker(streams) -> None:
    """R3 on a reused buffer: its fence was waited on by the host, so d2h's wait is implied and
    not issued; the access is still known ordered after the fence's work."""
    fence, reload_mark = _record_after_work(streams.h2d)
    fence.synchronize()
    assert streams.d2h.implies(fence)
    streams.d2h.wait_event(fence)
    streams.d2h.require(reload_mark, rule="R3", what="offload writing a reused host buffer")


def test_without_the_wait_call_the_checker_still_raises(streams) -> None:
    """The skip is inside `wait_event`: an access with no wait call at all stays a violation."""
    fence, reload_mark = _record_after_work(streams.h2d)
    fence.synchronize()
    with pytest.raises(HappensBeforeError) as info:
        streams.d2h.require(reload_mark, rule="R3", what="offload writing a reused host buffer")
    assert info.value.rule == "R3"
