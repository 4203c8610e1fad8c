"""Offload under data parallelism: DDP and FSDP2 (`fully_shard`), 2 gloo ranks on CPU, bit-exact.

One spawn runs every case in both ranks; each case trains the tiny stack of `_models` (all of
`MODULE_KINDS` offloaded, ``min_offload_bytes=1``, ``group_by="module"``: a group per kind and call)
for 2 iterations with two microbatches and an SGD step, once without and once with an
`OffloadManager`, from the same seed and per-rank data:

- ``ddp``: `DistributedDataParallel`, gradient accumulation (microbatch 0 under ``no_sync``);
- ``fsdp2``: `fully_shard` on every block and on the root (parameters are DTensors, all-gathered
  into plain unsharded parameters for each forward and backward, resharded after forward),
  1F1B-like order F0 F1 B0 B1.

On each rank: losses, gradients and final (full) parameters are `torch.equal` to the run without
offload, and the bytes offloaded per group are exactly the activation bytes that the unwrapped
stack offloads for the same calls: unsharded parameters that FSDP2 gathers during forward are
never offloaded. Every child arms ``faulthandler.dump_traceback_later``; the parent joins with a
deadline, so a hang fails with every rank's stacks on stderr.
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch

from chunk_offload import OffloadConfig, OffloadManager
from tests._driver import Hooks, Step, drive, no_pipelining
from tests._spawn import run_ranks
from tests.core._models import MODULE_KINDS, make_stack, microbatches, register

WORLD_SIZE = 2
ITERATIONS = 2
LAYERS = 2
MICROBATCHES = 2
TIMEOUT_S = 60.0
WRAPPERS = ("ddp", "fsdp2")


# --------------------------------------------------------------------------------------------
# Child side.
# --------------------------------------------------------------------------------------------


def _data(rank: int) -> list[torch.Tensor]:
    return microbatches(MICROBATCHES, seed=100 + rank)  # different data per data-parallel rank


def _train(wrapper: str, offload: bool, rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = make_stack(LAYERS, seed=0)  # the same initial parameters on every rank
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for block in model:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    manager = None
    if offload:
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module"))
        register(manager, model)  # after wrapping, as a training script would
    live: list[list] = []

    def accumulating(step: Step):
        """Gradient accumulation: DDP reduces once, in the last microbatch's backward."""
        last = wrapper != "ddp" or step.microbatch == MICROBATCHES - 1
        return contextlib.nullcontext() if last else wrapped.no_sync()

    def forward(module: torch.nn.Module, x: torch.Tensor, step: Step) -> torch.Tensor:
        with accumulating(step):
            return module(x)

    def backward(step: Step, loss: torch.Tensor) -> None:
        with accumulating(step):
            loss.backward()

    def after(manager: OffloadManager | None, iteration: int) -> None:
        if manager is not None:
            live.append(manager.live_chunks())

    order = no_pipelining(MICROBATCHES) if wrapper == "ddp" else ("F0", "F1", "B0", "B1")
    hooks = Hooks(after_iteration=after)
    run = drive(
        wrapped, inputs=_data(rank), manager=manager, order=order, iterations=ITERATIONS, forward=forward, backward=backward, copy=_full, hooks=hooks
    )
    result = {"losses": run.losses, "grads": run.grads, "params": run.params, "live": live}
    if manager is not None:
        stats = manager.stats()
        manager.close()
        result["groups"] = {n: g.groups for n, g in stats.groups.items()}
        # Copied, or kept on device because another reference holds it (NOTE [Storages held elsewhere]).
        result["offloaded"] = {n: g.bytes_offloaded + g.bytes_kept_held_elsewhere for n, g in stats.groups.items()}
        result["copied"] = {n: g.bytes_offloaded for n, g in stats.groups.items()}
        result["reloaded"] = {n: g.bytes_reloaded for n, g in stats.groups.items()}
        result["resident"] = stats.resident_bytes
        result["host"] = stats.host_bytes
        result["pool_in_use"] = stats.pool.in_use_bytes
    return result


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor copy (the full tensor of a DTensor: a collective, run in the same order on every rank)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def _rank_cases(rank: int, world_size: int) -> dict:
    results = {}
    for wrapper in WRAPPERS:
        for offload in (False, True):
            # A case that raises is reported by its tests; the next cases still run. (Both
            # ranks raise alike here; a rank left alone in a collective hits the deadline.)
            try:
                results[(wrapper, offload)] = _train(wrapper, offload, rank)
            except Exception:
                results[(wrapper, offload)] = {"error": traceback.format_exc()}
    return results


# --------------------------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_rank_cases, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S, what="DDP/FSDP2 ranks")


def _activation_bytes_per_call() -> dict[str, int]:
    """What one call of each module kind offloads in the unwrapped stack (same shapes, one chunk)."""
    model = make_stack(LAYERS, seed=0)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1, group_by="module"))
    try:
        register(manager, model)
        with manager.iteration():
            with manager.chunk(microbatch=0):
                loss = model(_data(0)[0]).pow(2).mean()
            loss.backward()
        stats = manager.stats()
    finally:
        manager.close()
    for name, g in stats.groups.items():
        assert g.groups == LAYERS and g.bytes_offloaded % LAYERS == 0, (name, g)
    return {name: g.bytes_offloaded // LAYERS for name, g in stats.groups.items()}


def _case(results: dict, wrapper: str, offload: bool) -> dict:
    result = results[(wrapper, offload)]
    if "error" in result:
        pytest.fail(f"{wrapper} (offload={offload}) raised in the rank:\n{result['error']}")
    return result


def _assert_equal_lists(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what} {i} differs"


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_offload_is_exact_under_data_parallel(ranks: list[dict], wrapper: str) -> None:
    for rank, results in enumerate(ranks):
        base, off = _case(results, wrapper, False), _case(results, wrapper, True)
        assert len(base["losses"]) == ITERATIONS * MICROBATCHES
        _assert_equal_lists(base["losses"], off["losses"], f"rank {rank}: loss")
        for it, (ga, gb) in enumerate(zip(base["grads"], off["grads"], strict=True)):
            _assert_equal_lists(ga, gb, f"rank {rank} iteration {it}: gradient")
        _assert_equal_lists(base["params"], off["params"], f"rank {rank}: parameter")
    # Data parallel really ran: the ranks saw different data, yet hold the same parameters.
    assert not torch.equal(ranks[0][(wrapper, True)]["losses"][0], ranks[1][(wrapper, True)]["losses"][0])
    _assert_equal_lists(ranks[0][(wrapper, True)]["params"], ranks[1][(wrapper, True)]["params"], "rank 0 vs 1: parameter")


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_only_activations_are_offloaded_under_data_parallel(ranks: list[dict], wrapper: str) -> None:
    """Offloaded bytes are the unwrapped stack's activation bytes: no (unsharded) parameter moved."""
    per_call = _activation_bytes_per_call()
    calls = ITERATIONS * MICROBATCHES * LAYERS
    for rank, results in enumerate(ranks):
        off = _case(results, wrapper, True)
        assert off["groups"] == {k: calls for k in MODULE_KINDS}, (rank, off["groups"])
        assert off["offloaded"] == {k: calls * per_call[k] for k in MODULE_KINDS}, (rank, off["offloaded"], per_call)
        assert off["reloaded"] == off["copied"], rank
        assert off["resident"] == 0 and off["host"] == 0 and off["pool_in_use"] == 0, rank
        assert off["live"] == [[]] * ITERATIONS, rank
