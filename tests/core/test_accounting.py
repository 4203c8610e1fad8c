"""The manager's accounting of saved bytes: high-water mark, bytes on host at that mark, counters.

On CPU the report's "measured drop" is the baseline's ``peak_resident_bytes`` (a run with
``offload=False``, identical accounting, nothing copied) minus the offload run's, and the
"theoretical drop" is the offload run's ``host_bytes_at_peak``. The two must be equal whenever
the offload run's high-water mark is taken at the moment the most bytes are saved.

Sizes used below: a block's ``mlp_fc1`` (an ``nn.Linear``) saves its input, ``BATCH * seq *
HIDDEN`` float32 values (its weight is protected), so with one offloaded ``mlp_fc1`` per block a
chunk's group bytes are ``layers * BATCH * seq * HIDDEN * 4``.

Every manager here takes module groups (``group_by="module"``): the accounting is checked per module
kind, each call of a kind one group under its name.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from chunk_offload import OffloadConfig, OffloadManager, OffloadStats
from tests._driver import drive, no_pipelining
from tests.core._models import (
    BATCH,
    HIDDEN,
    INTERLEAVED,
    MODULE_KINDS,
    ONE_F_ONE_B,
    SEQ,
    make_stack,
    register,
    run_schedule,
)

F32 = 4
LINEAR_INPUT = BATCH * SEQ * HIDDEN * F32  # bytes one call of an offloaded Linear saves
NORM_STATS = 2 * BATCH * SEQ * 1 * F32  # LayerNorm also saves its mean and rstd, (BATCH, SEQ, 1) each


@dataclass
class Peaks:
    peak: int
    host_at_peak: int
    saved_at_peak: int


def _peaks(stats: OffloadStats) -> Peaks:
    return Peaks(stats.peak_resident_bytes, stats.host_bytes_at_peak, stats.saved_bytes_at_peak)


def _per_iteration_peaks(*, offload: bool, **schedule) -> tuple[list[Peaks], list[OffloadStats]]:
    """Run a schedule; return each iteration's peaks (the mark is restarted after each iteration)."""
    peaks: list[Peaks] = []
    stats: list[OffloadStats] = []

    def after(manager: OffloadManager, it: int) -> None:
        s = manager.stats()
        peaks.append(_peaks(s))
        stats.append(s)
        manager.reset_stats()

    run_schedule(lambda: OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module", offload=offload)), after_iteration=after, **schedule)
    return peaks, stats


def test_baseline_peak_is_the_group_bytes_of_the_chunks_alive():
    # F0 F1 F2 then B0 B1 B2, one offloaded Linear per block: the most saved bytes are three
    # whole chunks, right after F2.
    layers = 2
    schedule = dict(order=("F0", "F1", "F2", "B0", "B1", "B2"), kinds=("mlp_fc1",), layers=layers, iterations=2)
    base, base_stats = _per_iteration_peaks(offload=False, **schedule)
    off, off_stats = _per_iteration_peaks(offload=True, **schedule)
    chunk_bytes = layers * LINEAR_INPUT
    for it in range(2):
        assert base[it] == Peaks(peak=3 * chunk_bytes, host_at_peak=0, saved_at_peak=3 * chunk_bytes)
        # With offload at most two adjacent groups are on device at once (the one just committed
        # and the one before, whose copy is still in flight).
        assert off[it].peak == 2 * LINEAR_INPUT
        assert off[it].saved_at_peak == off[it].peak + off[it].host_at_peak
        # The high-water mark of saved bytes wherever they live is the same in both runs; at its
        # latest moment (F2's forward done) the offload run holds all three chunks on host.
        assert (base_stats[it].peak_saved_bytes, base_stats[it].host_bytes_at_saved_peak) == (3 * chunk_bytes, 0)
        assert (off_stats[it].peak_saved_bytes, off_stats[it].host_bytes_at_saved_peak) == (3 * chunk_bytes, 3 * chunk_bytes)
        assert base_stats[it].groups["mlp_fc1"].groups == 3 * layers
        assert base_stats[it].groups["mlp_fc1"].bytes_offloaded == 0
        assert off_stats[it].groups["mlp_fc1"].bytes_offloaded == 3 * chunk_bytes
        assert off_stats[it].groups["mlp_fc1"].bytes_reloaded == 3 * chunk_bytes


def _check_drop_equals_host_bytes(base: Peaks, off: Peaks) -> None:
    assert base.saved_at_peak == base.peak + base.host_at_peak
    assert off.saved_at_peak == off.peak + off.host_at_peak
    assert base.host_at_peak == 0
    # The condition under which measured and theoretical drop must agree ...
    assert off.saved_at_peak == base.peak
    # ... and the agreement itself.
    assert base.peak - off.peak == off.host_at_peak


def test_peak_drop_equals_host_bytes_at_peak_plain_1f1b():
    # Equal microbatches, the plain 1F1B order. The offload run's device high-water mark (two
    # adjacent groups) is reached in every chunk's forward; the stage's peak is the moment the most
    # saved bytes are alive (after F2, and again after F3), and that is the moment whose host
    # bytes the report needs: three chunks saved, two adjacent groups on device, the rest on host.
    layers = 3
    schedule = dict(order=ONE_F_ONE_B, kinds=("mlp_fc1",), layers=layers, iterations=2)
    base, _ = _per_iteration_peaks(offload=False, **schedule)
    off, _ = _per_iteration_peaks(offload=True, **schedule)
    chunk_bytes = layers * LINEAR_INPUT
    for it in range(2):
        assert base[it].peak == 3 * chunk_bytes
        assert off[it].peak == 2 * LINEAR_INPUT
        _check_drop_equals_host_bytes(base[it], off[it])
        assert off[it].host_at_peak == 3 * chunk_bytes - 2 * LINEAR_INPUT


def _run_variable_lengths(manager: OffloadManager, order, seqs: dict[int, int], layers: int) -> None:
    """1F1B-like driver whose microbatches differ in sequence length."""
    model = make_stack(layers, seed=0)
    register(manager, model, ("mlp_fc1",))
    g = torch.Generator().manual_seed(1)
    xs = {m: torch.randn(BATCH, s, HIDDEN, generator=g) for m, s in seqs.items()}
    drive(model, inputs=xs, manager=manager, order=order, lr=None)


def test_peak_drop_equals_host_bytes_at_peak_when_the_peak_chunk_is_unique():
    # With equal microbatches the offload run's device high-water mark is first reached in F0
    # (see the test above). Here microbatch 2 is twice as long, so its two groups (one Linear per
    # block, two blocks) are the unique largest device footprint, reached when F2 commits its last
    # group: exactly when the most bytes are saved (chunks 0 and 1 on host, chunk 2 on device).
    layers = 2
    seqs = {0: SEQ, 1: SEQ, 2: 2 * SEQ, 3: SEQ}
    results = {}
    for offload in (False, True):
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module", offload=offload))
        try:
            _run_variable_lengths(manager, ONE_F_ONE_B, seqs, layers)
            results[offload] = _peaks(manager.stats())
        finally:
            manager.close()
    base, off = results[False], results[True]
    group = {m: BATCH * s * HIDDEN * F32 for m, s in seqs.items()}
    assert base.peak == layers * (group[0] + group[1] + group[2])
    assert off.peak == layers * group[2]
    _check_drop_equals_host_bytes(base, off)
    assert off.host_at_peak == layers * (group[0] + group[1])


@pytest.mark.parametrize(
    "order, model_chunks",
    [(ONE_F_ONE_B, 1), (INTERLEAVED, 2)],
    ids=["1f1b", "interleaved"],
)
def test_offload_run_saves_the_same_bytes_as_the_baseline(order, model_chunks):
    schedule = dict(order=order, model_chunks=model_chunks, layers=2, iterations=2)
    _, base = _per_iteration_peaks(offload=False, **schedule)
    _, off = _per_iteration_peaks(offload=True, **schedule)
    for b, o in zip(base, off):
        assert b.peak_resident_bytes == b.peak_saved_bytes == b.saved_bytes_at_peak
        assert b.host_bytes_at_peak == 0 and b.host_bytes_at_saved_peak == 0
        assert o.peak_saved_bytes == b.peak_resident_bytes
        assert o.saved_bytes_at_peak == o.peak_resident_bytes + o.host_bytes_at_peak
        assert o.saved_bytes_at_peak <= o.peak_saved_bytes
        assert 0 < o.peak_resident_bytes < b.peak_resident_bytes
        assert o.peak_resident_bytes + o.host_bytes_at_saved_peak >= o.peak_saved_bytes
        assert o.bytes_offloaded == sum(g.bytes_offloaded for g in o.groups.values()) > 0


@pytest.mark.parametrize(
    "order, model_chunks",
    [(ONE_F_ONE_B, 1), (INTERLEAVED, 2)],
    ids=["1f1b", "interleaved"],
)
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "baseline"])
def test_bytes_return_to_zero_and_groups_count_calls(order, model_chunks, offload):
    layers = 2
    iterations = 2
    forwards = sum(1 for a in order if (a[0] if isinstance(a, str) else a[0]) == "F")
    calls_per_iteration = forwards * layers  # every offloaded kind runs once per block per chunk forward
    seen: list[OffloadStats] = []

    def after(manager: OffloadManager, it: int) -> None:
        stats = manager.stats()
        seen.append(stats)
        assert stats.resident_bytes == 0, f"iteration {it}: resident bytes left"
        assert stats.host_bytes == 0, f"iteration {it}: host bytes left"
        assert stats.pool.in_use_bytes == 0
        assert stats.pool.fallback_in_use_bytes == 0
        assert manager.live_chunks() == []
        for kind in MODULE_KINDS:
            g = stats.groups[kind]
            assert g.groups == calls_per_iteration * (it + 1), kind
            assert g.bytes_reloaded == g.bytes_offloaded, kind
            if not offload:
                assert g.bytes_offloaded == 0
        calls = calls_per_iteration * (it + 1)
        if offload:
            for kind in ("qkv_linear", "attn_proj", "mlp_fc1"):
                assert stats.groups[kind].bytes_offloaded == calls * LINEAR_INPUT, kind
                assert stats.groups[kind].tensors_offloaded == calls, kind
            # Layer 0's attn_norm saves the chunk's input, which the driver holds until the
            # chunk's backward: after the first chunk of each model chunk it stays on device
            # (NOTE [Storages held elsewhere]); every other saved byte is copied.
            for kind in ("attn_norm", "mlp_norm"):
                g = stats.groups[kind]
                assert g.bytes_offloaded + g.bytes_kept_held_elsewhere == calls * (LINEAR_INPUT + NORM_STATS), kind
                assert g.bytes_kept_held_elsewhere % LINEAR_INPUT == 0, kind  # whole inputs only
            assert stats.groups["mlp_norm"].bytes_kept_held_elsewhere == 0
            assert stats.groups["attn_norm"].bytes_kept_held_elsewhere > 0

    run_schedule(
        lambda: OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module", offload=offload)),
        order=order,
        model_chunks=model_chunks,
        layers=layers,
        iterations=iterations,
        after_iteration=after,
    )
    assert len(seen) == iterations
    # After the first iteration every host buffer is reused: no new host allocation.
    assert seen[-1].pool.allocations == seen[0].pool.allocations
    assert seen[-1].pool.allocated_bytes == seen[0].pool.allocated_bytes
    assert seen[-1].pool.fallback_allocations == 0
    if not offload:
        assert seen[-1].pool.allocations == 0


def test_stats_are_counted_per_group_name():
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module"))
    try:
        model = make_stack(2, seed=0)
        register(manager, model, ("mlp_fc1",))
        blocks = list(model)
        manager.offload_module(blocks[0].attn_proj, "proj_first")  # one name for one module only
        x = torch.randn(BATCH, SEQ, HIDDEN)
        drive(model, inputs=[x] * 3, manager=manager, order=no_pipelining(3), lr=None)
        stats = manager.stats()
        assert set(stats.groups) == {"mlp_fc1", "proj_first"}
        assert stats.groups["mlp_fc1"].groups == 3 * 2
        assert stats.groups["proj_first"].groups == 3
        assert stats.groups["proj_first"].bytes_offloaded == 3 * LINEAR_INPUT
        assert stats.bytes_offloaded == 3 * 2 * LINEAR_INPUT + 3 * LINEAR_INPUT
        assert (stats.resident_bytes, stats.host_bytes) == (0, 0)
        manager.reset_stats()
        assert manager.stats().groups == {}
    finally:
        manager.close()
