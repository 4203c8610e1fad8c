"""`chunk_offload.verify_bit_identity` for torch.distributed.pipelining users, 2 gloo ranks.

One spawn, `ScheduleInterleaved1F1B` with `attach` in the run with offload: the check passes on
every rank; a run whose last stage zeroes one gradient element before the 2nd optimizer step
reports that iteration, the last stage's rank, the parameter and the value zeroed, on every rank
(`all_gather_results`).
"""

from __future__ import annotations

import pytest

from ._pipe import ITERATIONS
from ._pipe_verify import spawn_verify


@pytest.fixture(scope="module")
def spawned():
    return spawn_verify("ScheduleInterleaved1F1B", [None, 1])


def test_the_check_passes_on_every_rank(spawned) -> None:
    for rank, runs in enumerate(spawned):
        result, _, _ = runs[0]
        assert result.passed, (rank, result)
        assert (result.iterations, result.ranks) == (ITERATIONS, 2) and result.parameters > 0 and result.bytes_offloaded > 0
        assert str(result).startswith(f"chunk-offload verify: PASS ({ITERATIONS} iterations, 2 ranks, {result.parameters} parameters compared")


def test_a_corrupted_gradient_is_found_on_the_last_stage(spawned) -> None:
    last = len(spawned) - 1  # ScheduleInterleaved1F1B: the last rank holds the last stage
    _, replaced, name = spawned[last][1]
    assert len(replaced) == 1
    for runs in spawned:
        mismatch = runs[1][0].first_mismatch
        assert (mismatch.iteration, mismatch.rank, mismatch.kind, mismatch.name) == (2, last, "gradient", name)
        assert mismatch.max_abs_difference == abs(replaced[0]) > 0
