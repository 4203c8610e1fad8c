"""Ordering between compute and the copy streams, on CPU worker-thread streams.

`CpuStreams` runs the device-to-host and host-to-device copies on worker threads and can
sleep a random time before each operation, so a missing wait becomes a real race that shows
up as wrong numbers; its vector-clock checker raises `HappensBeforeError` at the access that
lacks a wait. These tests

- run the pipeline schedule under many random delay patterns and require exact parity,
- remove each wait of `chunk_offload.core.engine_context.WAIT_NAMES` in turn and require the checker
  to name the broken rule (and, with the checker off, show that a removed wait gives wrong
  numbers, so the delays really expose the race),
- drive the two rare paths by hand: backward reaching a group whose offload is still in
  flight, and a host buffer reused while the reload that reads it is still in flight.

Every comparison is `torch.equal` or an exact integer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch

import chunk_offload
from chunk_offload import CpuStreams, HappensBeforeError, OffloadConfig, OffloadManager
from chunk_offload.core import StreamBackend
from chunk_offload.core import GroupState
from chunk_offload.core.engine_context import WAIT_NAMES
from tests._driver import Hooks, RunResult, Step, assert_identical, assert_no_live_chunks, drive
from tests.core._models import (
    manager_skipping_waits,
    INTERLEAVED,
    MODULE_KINDS,
    ONE_F_ONE_B,
    assert_reuse_exact,
    make_stack,
    microbatches,
    register,
    reuse_during_reload,
    run_schedule,
)

ITERATIONS = 2
LAYERS = 2


def baseline(cache: dict, order: Sequence = ONE_F_ONE_B, model_chunks: int = 1) -> RunResult:
    key = ("races baseline", tuple(order), model_chunks)
    if key not in cache:
        cache[key] = run_schedule(
            lambda: None, order=order, model_chunks=model_chunks, iterations=ITERATIONS, layers=LAYERS
        )
    return cache[key]


def run_offloaded(
    streams: Callable[[], StreamBackend],
    *,
    skip: Sequence[str] = (),
    order: Sequence = ONE_F_ONE_B,
    model_chunks: int = 1,
    deterministic_memory: bool = False,
) -> tuple[RunResult, chunk_offload.OffloadStats]:
    """`run_schedule` with every kind offloaded under module groups (a group per kind and layer,
    many groups whose copies the delays reorder); the final stats."""
    final: list[chunk_offload.OffloadStats] = []

    def after_iteration(manager: OffloadManager, it: int) -> None:
        if it == ITERATIONS - 1:
            final.append(manager.stats())

    result = run_schedule(
        lambda: manager_skipping_waits(
            skip, streams=streams(), deterministic_memory=deterministic_memory, group_by="module"
        ),
        order=order,
        model_chunks=model_chunks,
        iterations=ITERATIONS,
        layers=LAYERS,
        after_iteration=after_iteration,
    )
    return result, final[0]


def same_numbers(a: RunResult, b: RunResult) -> bool:
    """Whether every loss and gradient is bit-identical (`assert_identical` as a predicate)."""
    try:
        assert_identical(a, b)
    except AssertionError:
        return False
    return True


def assert_really_offloaded(stats: chunk_offload.OffloadStats) -> None:
    assert set(stats.groups) == set(MODULE_KINDS)
    for kind, g in stats.groups.items():
        assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (kind, g)
    assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0


# ----------------------------------------------------------------------------- random delays

DELAY_PATTERNS = (("d2h",), ("h2d",), ("compute",), ("d2h", "h2d", "compute"))
# The compute stream sleeps before every saved tensor and every wait, so it gets shorter delays.
MAX_DELAY_S = {("d2h",): 5e-4, ("h2d",): 5e-4, ("compute",): 1e-4, ("d2h", "h2d", "compute"): 1e-4}
SEEDS = range(20)


@pytest.mark.parametrize("seed", SEEDS)
def test_parity_under_random_delays(run_cache, seed: int) -> None:
    delay_on = DELAY_PATTERNS[seed % len(DELAY_PATTERNS)]
    result, stats = run_offloaded(
        lambda: CpuStreams(max_delay_s=MAX_DELAY_S[delay_on], delay_on=delay_on, seed=seed)
    )
    assert_identical(baseline(run_cache), result)
    assert_really_offloaded(stats)


@pytest.mark.parametrize("seed", [0, 1])
def test_deterministic_memory_parity_under_random_delays(run_cache, seed: int) -> None:
    """`OffloadConfig.deterministic_memory`: compute waits on each copy before the release, exact too."""
    result, stats = run_offloaded(
        lambda: CpuStreams(max_delay_s=1e-4, delay_on=("d2h", "h2d", "compute"), seed=seed), deterministic_memory=True
    )
    assert_identical(baseline(run_cache), result)
    assert_really_offloaded(stats)
    assert sum(g.wait_time_s for g in stats.groups.values()) > 0  # the releases waited


@pytest.mark.parametrize("deterministic_memory", [False, True])
def test_missing_release_wait_is_caught_in_both_release_modes(deterministic_memory: bool) -> None:
    with pytest.raises(HappensBeforeError) as info:
        run_offloaded(lambda: CpuStreams(), skip=("release_after_offload",), deterministic_memory=deterministic_memory)
    assert info.value.rule == "R2", str(info.value)


@pytest.mark.parametrize("seed", [0, 1])
def test_interleaved_parity_under_random_delays(run_cache, seed: int) -> None:
    """The checker is not over-eager: with every wait present, the interleaved schedule raises nothing."""
    result, stats = run_offloaded(
        lambda: CpuStreams(max_delay_s=1e-4, delay_on=("d2h", "h2d", "compute"), seed=seed),
        order=INTERLEAVED,
        model_chunks=2,
    )
    assert_identical(baseline(run_cache, INTERLEAVED, 2), result)
    assert_really_offloaded(stats)


# ----------------------------------------------------------------------------- each wait removed

# Waits whose removal the 1F1B schedule itself exposes, and the rule the checker must name.
SCHEDULE_WAIT_RULES = {
    "offload_after_compute": "R1",
    "release_after_offload": "R2",
    "use_after_reload": "R2",
    "reload_after_alloc": "R4",
    "reload_after_offload": "R4",
}
# reuse_after_reload (R3) needs a buffer reused before compute waited on its reload; see below.
EXPECTED_RULES = {**SCHEDULE_WAIT_RULES, "reuse_after_reload": "R3"}


def test_every_wait_has_a_test() -> None:
    assert set(EXPECTED_RULES) == set(WAIT_NAMES)


@pytest.mark.parametrize("wait", list(SCHEDULE_WAIT_RULES))
def test_missing_wait_is_caught_in_schedule(wait: str) -> None:
    with pytest.raises(HappensBeforeError) as info:
        run_offloaded(lambda: CpuStreams(), skip=(wait,))
    assert info.value.rule == SCHEDULE_WAIT_RULES[wait], str(info.value)


def test_unknown_wait_name_is_rejected() -> None:
    with pytest.raises(chunk_offload.ChunkOffloadError, match="unknown wait names"):
        manager_skipping_waits(("no_such_wait",))


def test_reuse_wait_is_implied_in_plain_1f1b(run_cache) -> None:
    """In 1F1B compute waits on every reload before a later forward reuses its host buffer, so
    even without the reuse wait the offload is ordered after the reload (transitively) and
    nothing may fire; the numbers stay exact."""
    result, stats = run_offloaded(
        lambda: CpuStreams(max_delay_s=5e-4, delay_on=("d2h", "h2d"), seed=3), skip=("reuse_after_reload",)
    )
    assert_identical(baseline(run_cache), result)
    assert_really_offloaded(stats)


class _PoisonedReloadBuffers:
    """``torch`` as the group module sees it, with every buffer it allocates filled with 0xFF bytes
    (NaN as float32): on CPU, malloc often hands a reload buffer the memory the original just
    freed, still holding the right numbers, which would hide a read that comes before the copy."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs) -> torch.Tensor:
        return torch.empty(*args, **kwargs).fill_(255)


def test_missing_reload_wait_gives_wrong_numbers(run_cache, monkeypatch) -> None:
    """With the checker off, using reloaded tensors without waiting reads them before the delayed
    copy wrote them: the race is real, not only a checker finding."""
    import chunk_offload.core.group as group_module

    reference = baseline(run_cache)
    monkeypatch.setattr(group_module, "torch", _PoisonedReloadBuffers())
    with_wait, _ = run_offloaded(lambda: CpuStreams(check_order=False, max_delay_s=5e-4, delay_on=("h2d",), seed=0))
    assert same_numbers(reference, with_wait), "poisoned buffers must not change a run that waits"
    outcomes = []
    for seed in range(4):
        result, _ = run_offloaded(
            lambda: CpuStreams(check_order=False, max_delay_s=5e-4, delay_on=("h2d",), seed=seed),
            skip=("use_after_reload",),
        )
        outcomes.append(same_numbers(reference, result))
        if not outcomes[-1]:
            break
    assert not all(outcomes), f"no mismatch over seeds {list(range(len(outcomes)))}"


# ----------------------------------------------------------------------------- reuse during reload


def test_missing_reuse_wait_is_caught() -> None:
    with pytest.raises(HappensBeforeError) as info:
        reuse_during_reload(CpuStreams(), skip=("reuse_after_reload",))
    assert info.value.rule == "R3", str(info.value)
    assert "reused host buffer" in str(info.value)


def test_reuse_during_reload_with_wait_is_exact() -> None:
    assert_reuse_exact(reuse_during_reload(CpuStreams()))


# Chunk B's forward takes about 1 to 10 ms here; reload delays of up to 100 ms make the reload
# of A's buffer still pending when B's offload is issued for most seeds.
REUSE_MAX_DELAY_S = 0.1


@pytest.mark.parametrize("seed", range(6))
def test_reuse_during_delayed_reload_is_exact(seed: int) -> None:
    """The reload that reads the buffer is delayed; the next offload must wait for it."""
    assert_reuse_exact(reuse_during_reload(CpuStreams(max_delay_s=REUSE_MAX_DELAY_S, delay_on=("h2d",), seed=seed)))


def test_missing_reuse_wait_gives_wrong_numbers() -> None:
    """With the checker off and the reuse wait removed, B's offload overwrites the host buffer
    before A's delayed reload read it, so A's backward sees B's activations."""
    outcomes = []
    for seed in range(6):
        streams = CpuStreams(check_order=False, max_delay_s=REUSE_MAX_DELAY_S, delay_on=("h2d",), seed=seed)
        outcome = reuse_during_reload(streams, skip=("reuse_after_reload",))
        ref_grads_a, grads_a = outcome.reference[3], outcome.result[3]
        outcomes.append(all(torch.equal(x, y) for x, y in zip(grads_a, ref_grads_a)))
        if not outcomes[-1]:
            break
    assert not all(outcomes), f"no mismatch over seeds {list(range(len(outcomes)))}"


# ----------------------------------------------------------------------------- backward during offload


def _train_backward_inside_chunk(manager: OffloadManager | None, iterations: int = 2) -> RunResult:
    """Each microbatch's backward starts right where its forward ends, inside the chunk, so the
    chunk's last group is still offloading (never released) when backward reaches it."""
    model = make_stack(LAYERS, seed=0)
    if manager is not None:
        register(manager, model, MODULE_KINDS)

    def offloading(step: Step, loss: torch.Tensor) -> None:
        if step.handler is not None:
            assert step.handler.groups[-1].state is GroupState.OFFLOADING
            assert all(g.state is GroupState.ON_HOST for g in step.handler.groups[:-1])

    hooks = Hooks(forwarded=offloading, after_iteration=assert_no_live_chunks)
    order = ("FB0", "FB1", "FB2", "FB3")
    return drive(model, inputs=microbatches(4), manager=manager, order=order, iterations=iterations, hooks=hooks)


@pytest.mark.parametrize("seed", range(4))
def test_backward_reaches_group_while_offloading(seed: int) -> None:
    reference = _train_backward_inside_chunk(None)
    manager = OffloadManager(
        OffloadConfig(min_offload_bytes=1, group_by="module"), streams=CpuStreams(max_delay_s=2e-3, delay_on=("d2h",), seed=seed)
    )
    try:
        result = _train_backward_inside_chunk(manager)
        stats = manager.stats()
    finally:
        manager.close()
    assert_identical(reference, result)
    # The last group of every chunk (layer 1's mlp_fc1) kept its device tensors: its offload was
    # cancelled, so mlp_fc1 reloaded only layer 0's half. Every other kind went through host.
    fc1 = stats.groups["mlp_fc1"]
    assert fc1.bytes_offloaded > 0 and 2 * fc1.bytes_reloaded == fc1.bytes_offloaded
    for kind in MODULE_KINDS:
        if kind != "mlp_fc1":
            g = stats.groups[kind]
            assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (kind, g)
    assert stats.resident_bytes == 0 and stats.host_bytes == 0
    assert stats.pool.in_use_bytes == 0
