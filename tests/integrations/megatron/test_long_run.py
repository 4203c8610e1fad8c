"""A long run under megatron-core's 1F1B schedule: 20 optimizer steps, PP=2, every dense module offloaded.

One spawn trains the tiny GPT twice in the same ranks, without and with offload, and records after
EVERY optimizer step (``Hooks.after_step``) each rank's parameters and, for the offload run, the
manager's memory counters. Checked on every rank:

- parameters bit-identical to the run without offload after every one of the 20 steps (not only at
  the end, so a divergence that later washes out or a late one both show, with the step named);
- no growth: device-resident saved bytes, host-only bytes, the resident high-water mark, the pool's
  allocated bytes (the pinned host memory on a GPU host), in-use bytes and its host buffers (the same
  buffers, by address) identical at the end of step 2 (the last stage: step 3, its first step keeps
  its chunks whole, NOTE [Kept tail]) and of step 20;
- no host allocation after the first iteration: ``pool.allocations`` after step 1 equals after step 20,
  and no fallback (unpooled) allocation ever;
- nothing left at a step's end: resident, host-only and in-use bytes 0, no live chunk, and the free
  buffers add up to the pool's allocated bytes.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

from tests._megatron import Hooks, RankResult, Run, TinyGPTConfig, spawn_runs, step_params
from tests._megatron_offload import OffloadHooks

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
_TIMEOUT_S = 150.0  # hang guard for the spawn (it takes ~20-40 s on 2 cores)
_STEPS = 20
_DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")
_CONFIG = TinyGPTConfig(pipeline_parallel=2, num_microbatches=4, iterations=_STEPS)
_MEMORY_KEYS = (
    "resident_bytes",
    "host_bytes",
    "peak_resident_bytes",
    "pool_allocated_bytes",
    "pool_in_use_bytes",
    "pool_free_bytes",
    "pool_buffer_ptrs",
)


@dataclass
class _Spawned:
    baseline: list[RankResult]
    offloaded: list[RankResult]


@pytest.fixture(scope="module")
def spawned() -> _Spawned:
    if _NO_MEGATRON:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    hooks = OffloadHooks(_DENSE)
    runs = [
        Run(config=_CONFIG, hooks=Hooks(after_step=step_params)),
        Run(config=_CONFIG, hooks=hooks.with_steps()),
    ]
    baseline, offloaded = spawn_runs(runs, world_size=2, timeout_s=_TIMEOUT_S)
    return _Spawned(baseline, offloaded)


def test_parameters_bit_identical_after_every_step(spawned: _Spawned):
    for base, off in zip(spawned.baseline, spawned.offloaded, strict=True):
        assert off.non_cpu_tensors == 0
        assert len(base.steps) == len(off.steps) == _STEPS
        for step, (pa, rec) in enumerate(zip(base.steps, off.steps, strict=True), start=1):
            pb = rec["params"]
            assert pa.keys() == pb.keys(), f"rank {off.rank} step {step}: different parameter names"
            differing = [name for name in pa if not torch.equal(pa[name], pb[name])]
            assert not differing, f"rank {off.rank} step {step}: parameters differ: {differing[:5]}"
        # The last step's record is the run's final parameters (the hook ran after the last step).
        assert all(torch.equal(off.steps[-1]["params"][n], off.params[n]) for n in off.params)
        if base.is_last_stage:
            assert len(base.losses) == len(off.losses) == _STEPS
            for i, (la, lb) in enumerate(zip(base.losses, off.losses, strict=True)):
                assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True)), f"step {i + 1}: losses differ"


def test_training_moves_the_parameters(spawned: _Spawned):
    """The comparison above is not vacuous: every step changes the parameters."""
    for base in spawned.baseline:
        for step in range(1, _STEPS):
            before, after = base.steps[step - 1], base.steps[step]
            assert any(not torch.equal(before[n], after[n]) for n in before), f"rank {base.rank} step {step + 1}"


def test_memory_does_not_grow(spawned: _Spawned):
    for off in spawned.offloaded:
        memory = [rec["memory"] for rec in off.steps]
        step1, last = memory[0], memory[-1]
        what = f"rank {off.rank}"
        # Under 1F1B each backward of the last stage follows its forward: the first step, its groups
        # not known yet, keeps every chunk (nothing copied, no host memory); from the second on the
        # plan copies all groups of a chunk but the last (NOTE [Kept tail]).
        first = 1 if off.is_last_stage else 0  # the first step that copies
        assert all(m["bytes_offloaded"] == 0 and m["pool_allocated_bytes"] == 0 for m in memory[:first]), what
        copied = memory[first]
        # The chunk's received input, saved by its layer 0's attn_norm, is held by the schedule until
        # the chunk's backward (NOTE [Storages held elsewhere]): the first copying step copies it in
        # its first chunk, learns it there, and keeps it on device in every later chunk. The first
        # stage embeds its input: nothing held elsewhere there.
        held = 0 if off.pipeline_rank == 0 else _CONFIG.seq_length * _CONFIG.micro_batch_size * _CONFIG.hidden_size * 4
        chunks = _CONFIG.num_microbatches * (_STEPS - first)  # chunks forwarded from the first copying step on
        assert [m["bytes_copied_held_elsewhere"] for m in memory[first:]] == [held] * (_STEPS - first), what
        assert [m["bytes_kept_held_elsewhere"] for m in memory[first:]] == [
            held * (_CONFIG.num_microbatches * (step - first + 1) - 1) for step in range(first, _STEPS)
        ], what
        assert last["bytes_kept_held_elsewhere"] == held * (chunks - 1), what
        # Each later step moves the same bytes: the first copying step's less what it copied for nothing.
        per_step = copied["bytes_offloaded"] - held
        assert per_step > 0 and last["bytes_offloaded"] == (_STEPS - first) * per_step + held, what
        assert copied["pool_allocated_bytes"] > 0 and copied["pool_allocations"] > 0, what
        for key in _MEMORY_KEYS:
            assert memory[first + 1][key] == last[key], (what, key, memory[first + 1][key], last[key])
        # No host allocation after the first copying iteration, and never an unpooled one.
        assert [m["pool_allocations"] for m in memory[first:]] == [copied["pool_allocations"]] * (_STEPS - first), what
        assert [m["pool_allocated_bytes"] for m in memory[first:]] == [copied["pool_allocated_bytes"]] * (_STEPS - first), what
        assert all(m["pool_fallback_allocations"] == 0 and m["pool_fallback_in_use_bytes"] == 0 for m in memory), what
        # Nothing is left at the end of any step; the free buffers are all the pool holds.
        for step, m in enumerate(memory, start=1):
            assert m["resident_bytes"] == 0 and m["host_bytes"] == 0 and m["pool_in_use_bytes"] == 0, (what, step, m)
            assert m["live_chunks"] == 0, (what, step)
            assert m["pool_free_bytes"] == m["pool_allocated_bytes"], (what, step)
            assert len(m["pool_buffer_ptrs"]) == m["pool_allocations"], (what, step)
        # The resident high-water mark is reached in the first iteration and never exceeded.
        assert [m["peak_resident_bytes"] for m in memory] == [step1["peak_resident_bytes"]] * _STEPS, what
