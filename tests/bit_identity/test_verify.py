"""`chunk_offload.verify_bit_identity` on the core API: a small transformer in two virtual stages under
the interleaved order of stage 0 of PP=2, every module kind offloaded, trained by the shared driver
(`tests._driver.drive`) one iteration per ``step``; the check passes, and corrupted runs (a gradient,
a parameter, a forward) report the iteration, the rank, what differs and by how much. The
comparison's own rules (bits, not values; missing names; the earliest mismatch over ranks) too."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
from torch import nn

import chunk_offload
from chunk_offload import BitIdentityResult, Mismatch, TrainingJob, verify_bit_identity
from chunk_offload.bit_identity import StepRecord, compare_records, flatten_losses, merge_results
from tests._driver import drive
from tests.core._models import INTERLEAVED, Block, assert_clean, microbatches, register

ITERATIONS = 3
Corrupt = Callable[[int, list[nn.Module]], None]  # (0-based iteration, chunks), in the run with offload


def _build(*, before_forward: Corrupt | None = None, before_step: Corrupt | None = None, after_step: Corrupt | None = None, managers: list | None = None):
    """``build(offload)`` of a fresh job: two stacks initialized from the global generator (the seed
    `verify_bit_identity` sets makes both runs start equal), an SGD optimizer, with offload a manager."""

    def build(offload: bool) -> TrainingJob:
        chunks = [nn.Sequential(Block(), Block()) for _ in range(2)]
        manager = chunk_offload.OffloadManager(chunk_offload.OffloadConfig(min_offload_bytes=1)) if offload else None
        for chunk in chunks if manager is not None else ():
            register(manager, chunk)
        optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.05)
        xs = microbatches(4)

        def hook(corrupt: Corrupt | None, i: int) -> None:
            if offload and corrupt is not None:
                with torch.no_grad():
                    corrupt(i, chunks)

        def step(i: int) -> list[torch.Tensor]:
            hook(before_forward, i)
            losses = drive(chunks, inputs=xs, manager=manager, order=INTERLEAVED, lr=None).losses
            hook(before_step, i)
            optimizer.step()
            hook(after_step, i)
            return losses

        if manager is not None and managers is not None:
            managers.append(manager)
        return TrainingJob(step=step, modules=chunks, optimizer=optimizer, manager=manager, close=manager.close if manager else None)

    return build


def _parameters() -> int:
    return 2 * len(list(nn.Sequential(Block(), Block()).parameters()))


def test_an_offloaded_run_passes() -> None:
    managers: list = []
    result = verify_bit_identity(_build(managers=managers), iterations=ITERATIONS)
    assert result.passed and result.first_mismatch is None
    assert (result.iterations, result.ranks, result.parameters) == (ITERATIONS, 1, _parameters())
    assert result.bytes_offloaded == managers[0].stats().bytes_offloaded > 0
    assert str(result) == f"chunk-offload verify: PASS ({ITERATIONS} iterations, 1 rank, {_parameters()} parameters compared, {result.bytes_offloaded} bytes offloaded)"
    assert managers[0].closed
    assert_clean(managers[0])


def test_a_corrupted_gradient_is_reported_with_its_iteration_name_and_difference() -> None:
    replaced: list[float] = []

    def zero_one_gradient(i: int, chunks: list[nn.Module]) -> None:
        if i == 1:
            grad = chunks[1][0].mlp_fc1.weight.grad
            replaced.append(grad[2, 3].item())
            grad[2, 3] = 0.0

    result = verify_bit_identity(_build(before_step=zero_one_gradient), iterations=ITERATIONS)
    assert not result.passed and result.iterations == ITERATIONS  # every iteration runs (ranks must not stop apart)
    assert result.first_mismatch == Mismatch(iteration=2, rank=0, kind="gradient", name="1.0.mlp_fc1.weight", max_abs_difference=abs(replaced[0]))
    assert str(result) == f"chunk-offload verify: MISMATCH at iteration 2, rank 0, gradient of parameter 1.0.mlp_fc1.weight: max abs difference {abs(replaced[0])!r}"


def test_a_corrupted_parameter_after_the_step_is_a_parameter_mismatch() -> None:
    replaced: list[float] = []

    def zero_one_weight(i: int, chunks: list[nn.Module]) -> None:
        if i == 2:
            replaced.append(chunks[0][1].attn_norm.weight[5].item())
            chunks[0][1].attn_norm.weight[5] = 0.0

    mismatch = verify_bit_identity(_build(after_step=zero_one_weight), iterations=ITERATIONS).first_mismatch
    assert mismatch == Mismatch(iteration=3, rank=0, kind="parameter", name="0.1.attn_norm.weight", max_abs_difference=abs(replaced[0]))


def test_a_changed_forward_shows_first_in_the_losses() -> None:
    def nudge(i: int, chunks: list[nn.Module]) -> None:
        if i == 1:
            chunks[0][0].qkv_linear.bias.add_(1e-3)

    mismatch = verify_bit_identity(_build(before_forward=nudge), iterations=ITERATIONS).first_mismatch
    assert (mismatch.iteration, mismatch.kind, mismatch.name) == (2, "loss", "loss[0]")
    assert 0 < mismatch.max_abs_difference < 1


def _record(**tensors: torch.Tensor) -> StepRecord:
    return StepRecord(iteration=4, params=tensors)


@pytest.mark.parametrize(
    "a, b, difference, detail",
    [
        (torch.tensor([0.0]), torch.tensor([-0.0]), 0.0, "only the bits differ (a signed zero or a NaN payload)"),
        (torch.tensor([1.0, math.nan]), torch.tensor([1.5, 0.0]), math.nan, ""),
        (torch.zeros(2, 3), torch.zeros(3, 2), None, "torch.float32 (2, 3) without offload, torch.float32 (3, 2) with it"),
        (torch.zeros(2), torch.zeros(2, dtype=torch.float64), None, "torch.float32 (2,) without offload, torch.float64 (2,) with it"),
    ],
)
def test_records_are_compared_as_bits(a: torch.Tensor, b: torch.Tensor, difference: float | None, detail: str) -> None:
    mismatch = compare_records(_record(w=a), _record(w=b), rank=3)
    assert (mismatch.iteration, mismatch.rank, mismatch.kind, mismatch.name, mismatch.detail) == (4, 3, "parameter", "w", detail)
    assert mismatch.max_abs_difference == difference or (math.isnan(difference or 0.0) and math.isnan(mismatch.max_abs_difference))


def test_equal_nans_and_missing_names() -> None:
    nan = torch.tensor([math.nan, 2.0])
    assert compare_records(_record(w=nan), _record(w=nan.clone()), rank=0) is None
    missing = compare_records(_record(w=nan, v=nan), _record(w=nan), rank=0)
    assert str(missing) == "iteration 4, rank 0, parameter v: missing in the run with offload"
    extra = compare_records(_record(w=nan), _record(w=nan, u=nan), rank=0)
    assert extra.detail == "missing in the run without offload" and extra.name == "u"


def test_losses_are_named_by_their_path() -> None:
    losses = flatten_losses([{"lm loss": torch.tensor([2.0, 8.0])}, None, (1.5, "text")])
    assert list(losses) == ["loss[0]['lm loss']", "loss[2][0]"]
    assert losses["loss[2][0]"].item() == 1.5


def test_merged_results_report_the_earliest_mismatch_over_ranks() -> None:
    late = Mismatch(iteration=3, rank=0, kind="loss", name="loss", max_abs_difference=1.0)
    early = Mismatch(iteration=2, rank=1, kind="gradient", name="w", max_abs_difference=0.5)
    results = [
        BitIdentityResult(iterations=3, parameters=4, bytes_offloaded=10, first_mismatch=late),
        BitIdentityResult(iterations=3, parameters=5, bytes_offloaded=7, first_mismatch=early),
        BitIdentityResult(iterations=3, parameters=6, bytes_offloaded=None),
    ]
    merged = merge_results(results)
    assert (merged.ranks, merged.parameters, merged.bytes_offloaded, merged.first_mismatch) == (3, 15, None, early)
    assert merge_results(results[2:]).passed


@pytest.mark.parametrize("iterations", [0, -1, True, 1.0])
def test_iterations_must_be_a_count(iterations: object) -> None:
    with pytest.raises(chunk_offload.ChunkOffloadError, match=rf"verify_bit_identity\(iterations={iterations!r}\): pass an int >= 1"):
        verify_bit_identity(_build(), iterations=iterations)


def test_build_must_return_a_training_job() -> None:
    with pytest.raises(chunk_offload.ChunkOffloadError, match=r"build\(offload=False\) returned dict; return a chunk_offload.TrainingJob"):
        verify_bit_identity(lambda offload: {}, iterations=1)
