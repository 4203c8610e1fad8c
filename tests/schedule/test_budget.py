"""`choose_offload`: per-group choices that meet a device budget, measured against the engine.

Each case trains the core test stack under a Megatron plan for one rank (all virtual stages in
this process, CPU streams with random delays): a baseline measures the group bytes and the
peak; budgets between the last stage's baseline peak and the first's are derived from those
measured peaks; the engine then runs `PlanPolicy(plan, offload_groups=choice)` and its measured
peak must equal the predicted one and fit the budget, numerics bit-identical.
"""

from __future__ import annotations

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.schedule import (
    CopyTiming,
    OffloadChoice,
    Plan,
    PlanPolicy,
    budget_exceeded_message,
    budget_shortfall_message,
    choose_offload,
    level_budget,
    megatron_plan,
    simulate,
)
from tests._driver import assert_identical
from tests.schedule._train import train_plan

PIPELINES = {
    "pp4": [dict(pp_size=4, pp_rank=r, num_microbatches=6) for r in range(4)],
    "pp2_vpp2": [dict(pp_size=2, pp_rank=r, num_microbatches=4, vp_size=2) for r in range(2)],
}


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def pipeline(request):
    """Per rank: (plan, reference run of 3 iterations without a manager, baseline record, kept bytes).

    The kept bytes are what each group keeps on device once learned (NOTE [Storages held
    elsewhere]: the driver holds each chunk's input, which layer 0's attn_norm saves): from the
    second iteration of a run that copies every group. A run learns them in its first iteration,
    so its records from the second on are the ones the choice predicts."""
    ranks = []
    for fields in PIPELINES[request.param]:
        plan = megatron_plan(**fields)
        reference, _ = train_plan(plan, offload=None, iterations=3)
        _, baseline = train_plan(plan, offload=False, iterations=1)
        _, learned = train_plan(plan, PlanPolicy(plan, min_lifespan=0), iterations=2)
        ranks.append((plan, reference, baseline[0], learned[-1].kept_bytes_of))
    return ranks


def _budgets(ranks) -> list[int]:
    """Budgets between the last stage's measured baseline peak and the first's."""
    first, last = ranks[0][2].peak_resident_bytes, ranks[-1][2].peak_resident_bytes
    assert last < first
    return sorted({last, (2 * last + first) // 3, (last + 2 * first) // 3})


def test_budgeted_ranks_meet_the_budget(pipeline):
    for budget in _budgets(pipeline):
        for rank, (plan, reference, baseline, kept) in enumerate(pipeline):
            choice = choose_offload(plan, baseline.group_bytes, budget, kept_bytes=kept)
            assert choice.baseline_peak_bytes == baseline.peak_resident_bytes
            if choice.lowest_peak_bytes > budget:
                assert not choice.fits
                continue
            assert choice.fits and choice.predicted_peak_bytes <= budget
            result, records = train_plan(plan, PlanPolicy(plan, offload_groups=choice), iterations=3)
            assert_identical(reference, result)
            for measured in records[1:]:
                assert measured.peak_resident_bytes == choice.predicted_peak_bytes
                copied = sum(g.bytes_offloaded for g in measured.groups.values())
                assert copied == choice.bytes_offloaded
                if baseline.peak_resident_bytes <= budget:
                    assert copied == 0 and choice.offloaded == {}
                else:
                    assert copied > 0


def test_reload_budgets_and_measured_timing(pipeline):
    """Prefetch and reload-ahead budgets, and the copy timing of an offloaded iteration: the
    choice still fits, as predicted, numerics exact."""
    plan, reference, baseline, kept = pipeline[0]
    budget = _budgets(pipeline)[1]
    _, offloaded = train_plan(plan, PlanPolicy(plan, min_lifespan=0), iterations=1)
    timing = CopyTiming.from_record(offloaded[0], plan)
    assert timing is not None and timing.bytes_per_s > 0 and len(timing.action_starts_s) == len(plan.actions)
    groups = offloaded[0].groups.values()  # each direction's rate from its own copies
    assert timing.bytes_per_s == sum(g.bytes_offloaded for g in groups) / sum(g.offload_time_s for g in groups)
    assert timing.reload_bytes_per_s == sum(g.bytes_reloaded for g in groups) / sum(g.reload_time_s for g in groups)
    assert CopyTiming.from_record(baseline, plan) is None  # a baseline copies nothing
    budgets = dict(prefetch_bytes=20_000, reload_ahead_bytes=12_000)
    choice = choose_offload(plan, baseline.group_bytes, budget, timing=timing, kept_bytes=kept, **budgets)
    assert choice.fits
    result, records = train_plan(plan, PlanPolicy(plan, offload_groups=choice, **budgets), iterations=3)
    assert_identical(reference, result)
    assert [r.peak_resident_bytes for r in records[1:]] == [choice.predicted_peak_bytes] * 2
    names = choice.offloaded_by_name(baseline.group_names)
    assert sum(names.values()) == choice.groups_offloaded and set(names) <= set(baseline.group_names[(0, 0)])


def test_infeasible_budget_reports_the_lowest_peak(pipeline):
    plan, _, baseline, _ = pipeline[0]
    everything = PlanPolicy(plan, min_lifespan=0)
    lowest = simulate(plan, baseline.group_bytes, policy=everything).peak_resident_bytes
    choice = choose_offload(plan, baseline.group_bytes, lowest - 1)
    assert not choice.fits
    assert choice.lowest_peak_bytes == choice.predicted_peak_bytes == lowest
    message = budget_shortfall_message(choice, rank=3)
    assert message.startswith("chunk_offload: pipeline rank 3: device_budget_bytes ")
    assert f"({lowest - 1} bytes)" in message and f"lowest peak reachable is " in message and f"({lowest} bytes)" in message
    assert f"), 1 bytes over; to reach it, offload more modules" in message


def test_shortfall_and_exceeded_messages_say_by_how_much_and_what_reaches_it():
    choice = OffloadChoice(
        budget_bytes=9_000, offloaded={}, predicted_peak_bytes=11_000, baseline_peak_bytes=20_000, lowest_peak_bytes=11_000, bytes_offloaded=0
    )
    assert budget_shortfall_message(choice, rank=1) == (
        "chunk_offload: pipeline rank 1: device_budget_bytes 8.8 KiB (9000 bytes) cannot be met: the lowest peak reachable "
        "is 10.7 KiB (11000 bytes) (every group offloaded; without offload 19.5 KiB (20000 bytes)), 2000 bytes over; "
        "to reach it, offload more modules (--chunk-offload-modules), recompute activations (--recompute-granularity), "
        "use a smaller micro batch or fewer microbatches in flight, or raise the budget (to at least 11000 bytes, or 'auto')"
    )
    assert budget_exceeded_message(rank=0, budget_bytes=9_000_000_000, peak_bytes=11_000_000_000) == (
        "chunk_offload: pipeline rank 0: device_budget_bytes 8.4 GiB (9000000000 bytes) was not met: the iteration "
        "peaked at 10.2 GiB (11000000000 bytes), 2000000000 bytes over; to reach it, offload more modules "
        "(--chunk-offload-modules), recompute activations (--recompute-granularity), use a smaller micro batch or "
        "fewer microbatches in flight, or raise the budget"
    )


def test_level_budget_levels_the_peaks(pipeline):
    lowest = [choose_offload(plan, b.group_bytes, 0).lowest_peak_bytes for plan, _, b, _ in pipeline]
    budget = level_budget(lowest)
    assert budget == max(lowest)
    peaks = [choose_offload(plan, b.group_bytes, budget) for plan, _, b, _ in pipeline]
    assert all(c.fits for c in peaks)
    assert max(c.predicted_peak_bytes for c in peaks) == budget
    with pytest.raises(ChunkOffloadError, match=r"lowest_peaks must be a non-empty sequence of ints >= 0, got \[\]"):
        level_budget([])


def test_timing_prefers_groups_that_hide():
    """Chunks 0 and 1 are both held at the peak (chunk 2's forward) and alike but for the compute
    between their forward and backward: the copy that hides behind it is the one chosen (no
    prefetch, so one group of either chunk is enough)."""
    plan = Plan.from_order(["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"], source="t")
    sizes = {0: [100, 100]}
    baseline = simulate(plan, sizes, offload=False).peak_saved_bytes
    # 100 bytes out and back at 100 B/s: 2 s. Chunk 0's window runs from F1 to B0, chunk 1's from F2 to B1.
    second_hides = CopyTiming(bytes_per_s=100.0, action_starts_s=(0.0, 1.0, 2.0, 2.5, 10.0, 11.0), iteration_s=12.0)
    choice = choose_offload(plan, sizes, baseline - 100, prefetch_bytes=0, timing=second_hides)
    assert choice.fits and choice.offloaded == {(1, 0): frozenset({0})}
    first_hides = CopyTiming(bytes_per_s=100.0, action_starts_s=(0.0, 1.0, 5.0, 5.5, 6.0, 11.0), iteration_s=12.0)
    # Chunk 1 no longer hides: 100 of its bytes would do, but two hiding groups are taken
    # (chunk 0's for chunk 2's forward, chunk 2's for the reload that starts chunk 0's backward).
    choice = choose_offload(plan, sizes, baseline - 100, prefetch_bytes=0, timing=first_hides)
    assert choice.fits and choice.offloaded == {(0, 0): frozenset({0}), (2, 0): frozenset({0})}
    assert all(first_hides.hides(plan, chunk, 100) >= 0 for chunk in choice.offloaded)


def test_bad_arguments():
    plan = Plan.from_order(["0F0", "0B0"], source="t")
    with pytest.raises(ChunkOffloadError, match=r"budget_bytes must be an int >= 0 \(bytes\), got -1"):
        choose_offload(plan, {0: [1]}, -1)
    with pytest.raises(ChunkOffloadError, match="timing has 3 action starts, the plan has 2 actions"):
        choose_offload(plan, {0: [1]}, 0, timing=CopyTiming(bytes_per_s=1.0, action_starts_s=(0, 1, 2), iteration_s=3.0))


def test_groups_that_saved_one_storage_are_copied_together():
    """``shared`` (`IterationRecord.group_shared`): a copy of one group of a set frees nothing while
    another holds the storage, so the choice takes or leaves the set whole. Without it the same
    budget is met by groups 0 or 1 alone."""
    plan = megatron_plan(pp_size=2, pp_rank=0, num_microbatches=4)
    sizes = [64, 48, 32]
    baseline = simulate(plan, lambda mb, vp: sizes).peak_saved_bytes
    alone = choose_offload(plan, lambda mb, vp: sizes, baseline - 48)
    assert alone.fits and any(groups & {0, 1} in ({0}, {1}) for groups in alone.offloaded.values())
    shared = {chunk: [(0, 1)] for chunk in plan.chunks}
    together = choose_offload(plan, lambda mb, vp: sizes, baseline - 48, shared=shared)
    assert together.fits and together.offloaded
    assert all(groups & {0, 1} in (set(), {0, 1}) for groups in together.offloaded.values()), together.offloaded
    policy = PlanPolicy(plan, offload_groups=together)
    assert simulate(plan, lambda mb, vp: sizes, policy=policy).peak_resident_bytes == together.predicted_peak_bytes
