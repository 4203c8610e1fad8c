"""Training with offload under the 1F1B and interleaved schedules is bit-identical to training without it.

Every comparison is `torch.equal` or an exact integer: offload only moves bytes, so the
losses, every gradient of every iteration and the final parameters must not change by a
single bit. Each offloading run also checks that bytes really went to host and came back,
so a test cannot pass because nothing was offloaded.
"""

from __future__ import annotations

from typing import Sequence

import pytest

import chunk_offload
from chunk_offload import OffloadConfig, OffloadManager
from tests._driver import RunResult, assert_identical
from tests.core._models import INTERLEAVED, MODULE_KINDS, ONE_F_ONE_B, run_schedule

ITERATIONS = 3
LAYERS = 2
MICROBATCHES = 4

# (order, model_chunks), by test id.
ORDERS = {
    "1f1b": (ONE_F_ONE_B, 1),
    "interleaved": (INTERLEAVED, 2),
}
KIND_SETS = {
    "core_attn": ("core_attn",),
    "attention": ("qkv_linear", "core_attn", "attn_proj"),
    "all": MODULE_KINDS,
}


def baseline(cache: dict, order_id: str) -> RunResult:
    """The same training without any manager (cached per order)."""
    key = ("parity baseline", order_id)
    if key not in cache:
        order, model_chunks = ORDERS[order_id]
        cache[key] = run_schedule(
            lambda: None, order=order, model_chunks=model_chunks, iterations=ITERATIONS, layers=LAYERS
        )
    return cache[key]


def groups_per_kind(order_id: str) -> int:
    """Groups one module kind opens over the whole run: one per layer per chunk per iteration."""
    _, model_chunks = ORDERS[order_id]
    return ITERATIONS * MICROBATCHES * model_chunks * LAYERS


class Recorder:
    """`after_iteration` callback: snapshots the manager's counters after each iteration."""

    def __init__(self) -> None:
        self.stats: list[chunk_offload.OffloadStats] = []
        self.live_chunks: list[list] = []

    def __call__(self, manager: OffloadManager, iteration: int) -> None:
        assert len(self.stats) == iteration
        self.stats.append(manager.stats())
        self.live_chunks.append(manager.live_chunks())

    @property
    def final(self) -> chunk_offload.OffloadStats:
        return self.stats[-1]


def run_with(cache: dict, order_id: str, kinds: Sequence[str], **options) -> tuple[RunResult, Recorder]:
    """Train with offload of ``kinds`` (cached: several tests check one run; none mutates it)."""
    key = ("parity run", order_id, tuple(kinds), tuple(sorted(options.items())))
    if key not in cache:
        cache[key] = _run_with(order_id, kinds, **options)
    return cache[key]


def _run_with(order_id: str, kinds: Sequence[str], **options) -> tuple[RunResult, Recorder]:
    order, model_chunks = ORDERS[order_id]
    recorder = Recorder()
    result = run_schedule(
        # Module groups: the checks count each kind's groups and bytes under its own name.
        lambda: OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module", **options)),
        order=order,
        model_chunks=model_chunks,
        iterations=ITERATIONS,
        layers=LAYERS,
        kinds=kinds,
        after_iteration=recorder,
    )
    assert len(recorder.stats) == ITERATIONS
    return result, recorder


def assert_drained(recorder: Recorder) -> None:
    """After every iteration nothing is held: no live chunk, no pooled buffer in use, no saved bytes."""
    for it, (stats, live) in enumerate(zip(recorder.stats, recorder.live_chunks)):
        assert live == [], f"iteration {it}: chunks still live {live}"
        assert stats.pool.in_use_bytes == 0, f"iteration {it}: {stats.pool}"
        assert stats.pool.fallback_in_use_bytes == 0, f"iteration {it}: {stats.pool}"
        assert stats.resident_bytes == 0, f"iteration {it}: resident_bytes={stats.resident_bytes}"
        assert stats.host_bytes == 0, f"iteration {it}: host_bytes={stats.host_bytes}"


def assert_offloaded(stats: chunk_offload.OffloadStats, kinds: Sequence[str], order_id: str) -> None:
    """Every registered kind opened all its groups and moved bytes to host and all of them back."""
    assert set(stats.groups) == set(kinds)
    for kind in kinds:
        g = stats.groups[kind]
        assert g.groups == groups_per_kind(order_id), (kind, g)
        assert g.bytes_offloaded > 0, (kind, g)
        assert g.bytes_reloaded == g.bytes_offloaded, (kind, g)
        assert g.tensors_offloaded > 0, (kind, g)
    assert stats.peak_resident_bytes > 0
    assert stats.pool.allocations > 0
    assert stats.pool.fallback_allocations == 0


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("kind_set", list(KIND_SETS))
@pytest.mark.parametrize("order_id", list(ORDERS))
def test_parity_with_offload(run_cache, order_id: str, kind_set: str) -> None:
    kinds = KIND_SETS[kind_set]
    result, recorder = run_with(run_cache, order_id, kinds)
    assert_identical(baseline(run_cache, order_id), result)
    assert_offloaded(recorder.final, kinds, order_id)
    assert_drained(recorder)


@pytest.mark.parametrize("order_id", list(ORDERS))
def test_host_pool_is_reused_across_iterations(run_cache, order_id: str) -> None:
    result, recorder = run_with(run_cache, order_id, MODULE_KINDS)
    assert_identical(baseline(run_cache, order_id), result)
    first = recorder.stats[0].pool
    assert first.allocations > 0 and first.allocated_bytes > 0
    for it, stats in enumerate(recorder.stats):
        pool = stats.pool
        assert pool.allocations == first.allocations, f"iteration {it}: {pool} after {first}"
        assert pool.allocated_bytes == first.allocated_bytes, f"iteration {it}: {pool} after {first}"
        assert pool.fallback_allocations == 0
    # Each iteration offloads the same bytes again, through the same buffers; the first one also
    # copied what it then found held elsewhere (NOTE [Storages held elsewhere]), never again.
    totals = [sum(g.bytes_offloaded for g in stats.groups.values()) for stats in recorder.stats]
    learned = sum(g.bytes_copied_held_elsewhere for g in recorder.stats[0].groups.values())
    steady = totals[1] - totals[0]
    assert totals[0] == steady + learned
    assert all(later - earlier == steady for earlier, later in zip(totals[1:], totals[2:]))
    assert sum(g.bytes_copied_held_elsewhere for g in recorder.final.groups.values()) == learned
    assert_drained(recorder)
    assert recorder.final.resident_bytes == 0 and recorder.final.host_bytes == 0


@pytest.mark.parametrize("order_id", list(ORDERS))
def test_parity_accounting_only(run_cache, order_id: str) -> None:
    """offload=False tracks groups and saved bytes but copies nothing; numbers unchanged."""
    result, recorder = run_with(run_cache, order_id, MODULE_KINDS, offload=False)
    assert_identical(baseline(run_cache, order_id), result)
    stats = recorder.final
    assert set(stats.groups) == set(MODULE_KINDS)
    for kind, g in stats.groups.items():
        assert g.groups == groups_per_kind(order_id), (kind, g)
        assert g.bytes_offloaded == 0 and g.bytes_reloaded == 0, (kind, g)
    assert stats.peak_resident_bytes > 0
    assert stats.host_bytes_at_peak == 0
    assert stats.saved_bytes_at_peak == stats.peak_resident_bytes
    assert stats.pool.allocations == 0 and stats.pool.allocated_bytes == 0
    assert_drained(recorder)


@pytest.mark.parametrize("order_id", list(ORDERS))
def test_parity_without_timing(run_cache, order_id: str) -> None:
    result, recorder = run_with(run_cache, order_id, MODULE_KINDS, measure_time=False)
    assert_identical(baseline(run_cache, order_id), result)
    stats = recorder.final
    assert_offloaded(stats, MODULE_KINDS, order_id)
    for kind, g in stats.groups.items():
        assert g.offload_time_s == 0.0 and g.reload_time_s == 0.0 and g.wait_time_s == 0.0, (kind, g)
    assert_drained(recorder)


def test_offloaded_bytes_match_between_schedules_per_chunk(run_cache) -> None:
    """1F1B and interleaved offload the same bytes per (layer, microbatch): chunking changes only the order."""
    _, r1 = run_with(run_cache, "1f1b", MODULE_KINDS)
    _, r2 = run_with(run_cache, "interleaved", MODULE_KINDS)
    for kind in MODULE_KINDS:
        one, two = r1.final.groups[kind], r2.final.groups[kind]
        # Interleaved runs two model chunks of LAYERS layers each: twice the groups and bytes.
        assert two.groups == 2 * one.groups
        assert two.bytes_offloaded == 2 * one.bytes_offloaded, kind
