"""A storage saved by two groups of a chunk is copied, reloaded and accounted once.

NOTE [Shared storages] (core/handler.py): the first group (here ``exp``, which saves its output)
saves and copies it; the next group (a linear layer, which saves that output as its input) joins
the first group's storage instead of saving it again. Without this, both groups copied it and
the theory counted it twice (core attention's output with ``attn_proj``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chunk_offload import OffloadConfig, OffloadManager, SchedulePolicy
from chunk_offload.core.saved import SharedRef

from ._models import Fn, assert_clean

ROWS, COLS = 16, 64
NBYTES = ROWS * COLS * 4  # float32


class _KeepGroup(SchedulePolicy):
    """Copies every group of every chunk but the one at ``kept``."""

    def __init__(self, kept: int) -> None:
        self.kept = kept

    def offload_group(self, key, index: int) -> bool:
        return index != self.kept


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Fn(lambda x: (x * 1.0).exp()), nn.Linear(COLS, COLS), nn.Tanh())


def _train(manager: OffloadManager | None, iterations: int = 2) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    model = _model()
    if manager is not None:
        manager.offload_module(model[0], "exp")
        manager.offload_module(model[1], "linear")
    x = torch.randn(ROWS, COLS, requires_grad=True)  # so that exp saves its output
    results = []
    for _ in range(iterations):
        model.zero_grad(set_to_none=True)
        x.grad = None
        if manager is None:
            loss = model(x).sum()
            loss.backward()
        else:
            with manager.iteration():
                with manager.chunk(microbatch=0):
                    loss = model(x).sum()
                loss.backward()
        results.append((loss.detach(), [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]))
    return results


def _assert_identical(expected, got) -> None:
    for (loss_a, grads_a), (loss_b, grads_b) in zip(expected, got, strict=True):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_a_storage_two_groups_save_is_copied_once() -> None:
    reference = _train(None)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    made = []
    real_init = SharedRef.__init__
    SharedRef.__init__ = lambda self, *args: made.append(1) or real_init(self, *args)
    try:
        result = _train(manager)
        record = manager.last_iteration
    finally:
        SharedRef.__init__ = real_init
    _assert_identical(reference, result)
    assert len(made) == 2  # one shared view per iteration: the linear layer's input
    exp, linear = record.groups["exp"], record.groups["linear"]
    # exp copies its output; the linear layer, whose input that output is, copies nothing.
    assert (exp.bytes_offloaded, exp.bytes_reloaded) == (NBYTES, NBYTES)
    assert (linear.bytes_offloaded, linear.bytes_reloaded) == (0, 0)
    assert record.group_bytes[(0, 0)] == [NBYTES, 0]
    assert record.peak_resident_bytes == NBYTES  # accounted once
    manager.close()
    assert_clean(manager)


@pytest.mark.parametrize("setting", ["linear_kept", "exp_kept", "nothing_offloaded"])
def test_records_agree_whatever_is_copied(setting: str) -> None:
    """The storage belongs to the exp group however the chunk is run: copied by it, kept by it, or
    copied while the linear group is kept (whose backward then waits for exp's reload)."""
    reference = _train(None)
    config = OffloadConfig(min_offload_bytes=1, offload=setting != "nothing_offloaded")
    policy = {"linear_kept": _KeepGroup(kept=1), "exp_kept": _KeepGroup(kept=0)}.get(setting)
    manager = OffloadManager(config, schedule_policy=policy)
    result = _train(manager)
    record = manager.last_iteration
    _assert_identical(reference, result)
    assert record.group_bytes[(0, 0)] == [NBYTES, 0]
    assert record.groups["exp"].bytes_offloaded == (NBYTES if setting == "linear_kept" else 0)
    assert record.groups["linear"].bytes_offloaded == 0
    manager.close()
    assert_clean(manager)


@pytest.mark.parametrize("delay_on", [("d2h",), ("h2d",), ("d2h", "h2d", "compute")])
def test_shared_views_are_exact_under_random_delays(delay_on) -> None:
    from chunk_offload import CpuStreams

    reference = _train(None, iterations=3)
    for seed in range(3):
        streams = CpuStreams(max_delay_s=2e-4, delay_on=delay_on, seed=seed)
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=streams)
        _assert_identical(reference, _train(manager, iterations=3))
        manager.close()
        assert_clean(manager)
