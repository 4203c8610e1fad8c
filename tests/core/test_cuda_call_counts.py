"""What one offload group issues on the streams: events, stream waits, event waits, copies.

A counting `StreamBackend` wraps the public `CpuStreams` and logs every operation the engine
issues, with the stream it goes to. On `CudaStreams` each operation is a fixed set of CUDA API
calls (docs/architecture.md, "What one group costs in CUDA API calls"), so these counts are the
CUDA path's per-group cost. The group under test saves three views of one storage: it must
issue exactly one device-to-host and one host-to-device copy, of that storage's span.

Each count below is derived from the engine's rules (NOTE [Happens-before rules] in
core/streams.py and NOTE [Release and prefetch order] in core/handler.py), not read off a run:

- offload (commit): d2h waits on compute (R1, one ``wait_stream``); per storage one copy; one
  event recorded on d2h after the copies. From the second iteration on, the reused host
  buffer's fence (R3) is a reload of the iteration before, which the manager's iteration end
  waited for: the wait is implied and not issued (NOTE [Implied waits] in core/streams/base.py);
- release (at the next group's commit, or the chunk's end for its last group): the device
  originals are handed to d2h, compute does not wait (R2, NOTE [Release by the copy stream]
  in core/copies.py);
- reload (backward reaches the group): h2d waits on compute (R4), one copy per storage, one
  event recorded on h2d; compute waits on it before the first unpack (R2). Its wait on the
  offload's event (R4) is implied: on these CPU streams the chunk's end waited for every copy
  to host; on CUDA, which has no such wait, the first reload of a backward waits and implies the
  others (backward reloads groups in the reverse of their offload order), which
  `test_implied_waits.py` checks on the streams themselves.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest
import torch
from torch import nn

from chunk_offload import CpuStreams, OffloadConfig, OffloadManager
from chunk_offload.core import Stream, StreamBackend

from tests._driver import Hooks, Step, drive

from ._models import Fn

HIDDEN = 48  # divisible by 3: the three views are equal thirds
ROWS = 16


class CountingStream:
    """Delegates to one stream of the wrapped backend and logs each operation issued to it."""

    def __init__(self, inner: Stream, log: Callable[[str, str, bool, int], None]) -> None:
        self.inner = inner
        self.name = inner.name
        self.id = inner.id
        self._log = log

    def launch(self, fn, *, timed: bool = False, nbytes: int = 0):
        self._log("copy", self.name, timed, nbytes)
        return self.inner.launch(fn, timed=timed, nbytes=nbytes)

    def record_event(self):
        self._log("record_event", self.name, False, 0)
        return self.inner.record_event()

    def launch_recorded(self, fn, *, timed: bool = False, nbytes: int = 0):
        self._log("copy", self.name, timed, nbytes)
        self._log("record_event", self.name, False, 0)
        return self.inner.launch_recorded(fn, timed=timed, nbytes=nbytes)

    def wait_event(self, event, *, timed: bool = False):
        if not self.inner.implies(event):  # an implied wait issues nothing (NOTE [Implied waits])
            self._log("wait_event", self.name, timed, 0)
        return self.inner.wait_event(event, timed=timed)

    def retain(self, tensors) -> None:
        self._log("retain", self.name, False, 0)
        self.inner.retain(tensors)

    def wait_stream(self, other: "CountingStream") -> None:
        self._log("wait_stream", self.name, False, 0)
        self.inner.wait_stream(other.inner)

    def synchronize(self) -> None:
        self._log("synchronize", self.name, False, 0)
        self.inner.synchronize()

    def tick(self):
        return self.inner.tick()

    def require(self, mark, *, rule: str, what: str, subject: object = None) -> None:
        self.inner.require(mark, rule=rule, what=what, subject=subject)


class CountingStreams(StreamBackend):
    """`CpuStreams` (ordering checks on) whose operations are logged as ``(op, stream, timed, nbytes)``."""

    def __init__(self) -> None:
        self._inner = CpuStreams()
        self.device = self._inner.device
        self.pin_memory = self._inner.pin_memory
        self.copies_hold_sources = self._inner.copies_hold_sources
        self.log: list[tuple[str, str, bool, int]] = []
        append = lambda *entry: self.log.append(entry)  # noqa: E731
        self.compute = CountingStream(self._inner.compute, append)
        self.d2h = CountingStream(self._inner.d2h, append)
        self.h2d = CountingStream(self._inner.h2d, append)

    def close(self) -> None:
        self._inner.close()

    def between(self, start: int, end: int) -> Counter:
        """Operations logged from entry ``start`` to ``end``, counted by ``(op, stream)``."""
        return Counter((op, stream) for op, stream, _, _ in self.log[start:end])


class SaveThreeViews(torch.autograd.Function):
    """``a * b * c`` of the three thirds of ``x``; saves the three views (one storage) for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        a, b, c = x.chunk(3, dim=-1)
        ctx.save_for_backward(a, b, c)
        return a * b * c

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        a, b, c = ctx.saved_tensors
        return torch.cat((grad * b * c, grad * a * c, grad * a * b), dim=-1)


class ThreeViews(nn.Module):
    """One offload group: a fresh storage (``x * 1.5`` saves nothing) seen through three saved views."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SaveThreeViews.apply(x * 1.5)


def _counts(**by_stream: int) -> Counter:
    """``copy__d2h=1`` -> ``Counter({("copy", "d2h"): 1})``."""
    return Counter({tuple(key.split("__")): n for key, n in by_stream.items() if n})


# Per group, from the rules in the module docstring (one storage).
OFFLOAD_OPS = _counts(wait_stream__d2h=1, copy__d2h=1, record_event__d2h=1)


RELEASE_OPS = _counts(retain__d2h=1)
# At the chunk's end, where copies hold their sources (these CPU streams; not CUDA), the
# held-elsewhere check first waits for the copies (NOTE [Release by the copy stream]).
HELD_CHECK_OPS = _counts(synchronize__d2h=1)
DETERMINISTIC_RELEASE_OPS = _counts(wait_event__compute=1)  # OffloadConfig.deterministic_memory
RELOAD_OPS = _counts(wait_stream__h2d=1, copy__h2d=1, record_event__h2d=1, wait_event__compute=1)
# Each iteration's start and end: the manager waits until both copy streams are idle.
ITERATION_OPS = _counts(synchronize__d2h=2, synchronize__h2d=2)


def _run(streams: CountingStreams, groups: int, iterations: int, *, measure_time: bool, deterministic_memory: bool = False) -> list[dict[str, Counter]]:
    """Train ``groups`` chained ThreeViews groups in one chunk; the ops of each phase per iteration."""
    config = OffloadConfig(min_offload_bytes=1, measure_time=measure_time, deterministic_memory=deterministic_memory)
    manager = OffloadManager(config, streams=streams)
    model = nn.Sequential(*[ThreeViews() for _ in range(groups)])
    for i, layer in enumerate(model):
        manager.offload_module(layer, f"g{i}")
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    phases = []
    marks = [len(streams.log)]  # before the iteration, then at each hook

    def forward(model: nn.Sequential, x: torch.Tensor, step: Step) -> torch.Tensor:
        # Outputs keep 1/3 of the hidden size: pad back so the next group sees HIDDEN.
        y = x
        for layer in model:
            y = layer(y).repeat(1, 3)
        return y

    def mark(*_) -> None:
        marks.append(len(streams.log))

    def phase(manager: OffloadManager, iteration: int) -> None:
        mark()
        log, between = streams.log[marks[0] :], streams.between
        phases.append(
            {
                "forward": between(marks[1], marks[2]),
                "chunk_end": between(marks[2], marks[3]),
                "backward": between(marks[3], marks[4]),
                "iteration": between(marks[0], marks[1]) + between(marks[4], marks[5]),
                "timed": Counter(op for op, _, timed, _ in log if timed),
                "copy_bytes": [(stream, n) for op, stream, _, n in log if op == "copy"],
            }
        )
        marks[:] = [len(streams.log)]

    hooks = Hooks(iteration_begun=mark, forwarded=mark, chunk_ended=mark, after_backward=mark, after_iteration=phase)
    try:
        drive(model, inputs=[x], manager=manager, iterations=iterations, forward=forward, loss=torch.sum, lr=None, hooks=hooks)
        stats = manager.stats()
    finally:
        manager.close()
    assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0
    return phases


def _times(counter: Counter, n: int) -> Counter:
    return Counter({key: value * n for key, value in counter.items()})


@pytest.mark.parametrize("deterministic_memory", [False, True])
@pytest.mark.parametrize("groups", [1, 3])
def test_ops_per_group(groups: int, deterministic_memory: bool) -> None:
    phases = _run(CountingStreams(), groups, iterations=2, measure_time=False, deterministic_memory=deterministic_memory)
    release = DETERMINISTIC_RELEASE_OPS if deterministic_memory else RELEASE_OPS
    for iteration, phase in enumerate(phases):
        # Committing a group releases the one before it; the chunk's end releases the last.
        offload = _times(OFFLOAD_OPS, groups) + _times(release, groups - 1)
        assert phase["forward"] == offload, (iteration, phase)
        assert phase["chunk_end"] == release + HELD_CHECK_OPS, (iteration, phase)
        assert phase["backward"] == _times(RELOAD_OPS, groups), (iteration, phase)
        assert phase["iteration"] == ITERATION_OPS, (iteration, phase)
        assert phase["timed"] == Counter()


def test_one_copy_per_storage_span() -> None:
    """Three saved views of one storage: one D2H and one H2D copy, each of the storage's bytes."""
    (phase,) = _run(CountingStreams(), 1, iterations=1, measure_time=False)
    span = ROWS * HIDDEN * torch.tensor([], dtype=torch.float32).element_size()
    assert phase["copy_bytes"] == [("d2h", span), ("h2d", span)]


def test_measure_time_times_each_copy_and_compute_wait() -> None:
    """``measure_time=True`` (the default) times every copy and every compute wait, nothing else."""
    groups = 2
    (phase,) = _run(CountingStreams(), groups, iterations=1, measure_time=True)
    assert phase["forward"] + phase["chunk_end"] == _times(OFFLOAD_OPS + RELEASE_OPS, groups) + HELD_CHECK_OPS
    assert phase["backward"] == _times(RELOAD_OPS, groups)
    # Per group: its D2H copy, its H2D copy and the compute wait before its first use (the
    # release does not wait).
    assert phase["timed"] == Counter({"copy": 2 * groups, "wait_event": groups})


class SaveTwoStorages(torch.autograd.Function):
    """``x.exp() * x.sin()`` saving both factors: two fresh storages in one group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        e, s = x.exp(), x.sin()
        ctx.save_for_backward(e, s, x)
        return e * s

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        e, s, x = ctx.saved_tensors
        return grad * (e * s + e * x.cos())


def _scaled(model: nn.Module, x: torch.Tensor, step: Step) -> torch.Tensor:
    return model(x * 1.0)


def test_one_launch_per_group_whatever_its_storages_and_no_host_allocation_after_warmup() -> None:
    """NOTE [CUDA host path]: a group's copies go out in one launch per direction (one stream
    switch, one timing); from the second iteration on the pool allocates nothing."""
    streams = CountingStreams()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1, measure_time=True), streams=streams)
    layers = 3
    model = nn.Sequential(*[Fn(SaveTwoStorages.apply) for _ in range(layers)])
    for i, layer in enumerate(model):
        manager.offload_module(layer, f"g{i}")
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    allocations = []
    start = [len(streams.log)]  # where the iteration's operations begin

    def copies_of_the_iteration(manager: OffloadManager, iteration: int) -> None:
        copies = [(stream, n) for op, stream, _, n in streams.log[start[0] :] if op == "copy"]
        start[0] = len(streams.log)
        allocations.append(manager.stats().pool.allocations)
        # Each group's input (x * 1.0, or the previous group's output) and its two factors: 3 storages, 1 launch.
        assert copies == [("d2h", 3 * ROWS * HIDDEN * 4)] * layers + [("h2d", 3 * ROWS * HIDDEN * 4)] * layers

    hooks = Hooks(after_iteration=copies_of_the_iteration)
    try:
        drive(model, inputs=[x], manager=manager, iterations=3, forward=_scaled, loss=torch.sum, lr=None, hooks=hooks)
    finally:
        manager.close()
    assert allocations[1] == allocations[2] == allocations[0] > 0
