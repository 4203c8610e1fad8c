"""A chunk-offload run gives its device memory back once it ends.

The H200 run of 2026-11-27 (bench/results/2026-11-27-h200) measured, in `bench/megatron_compare.py`,
the runs right after a chunk-offload run peaking higher by exactly the previous run's model
(parameters and gradients: 7.56 GB at hidden 4096, 1.07 GB at hidden 1024), although the bench
collects garbage between runs; on CPU nothing of a run outlives it. This test runs the bench's
own run twice in one process (as ``--processes one`` does; by default each run now has a process
of its own) and asserts that nothing of the first is still allocated when the second starts;
when something is, it names what holds the CUDA tensors still alive.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys
import weakref

import pytest
import torch

from tests.bench._scripts import load_bench_script

from .conftest import REQUIRES_CUDA_REASON

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=REQUIRES_CUDA_REASON),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

def _referrer_chain(obj: object, depth: int = 4) -> str:
    """The types on one path of referrers up from ``obj`` (for the failure message)."""
    chain, seen = [], {id(obj)}
    for _ in range(depth):
        referrers = [r for r in gc.get_referrers(obj) if id(r) not in seen and not isinstance(r, type(sys._getframe()))]
        if not referrers:
            break
        obj = referrers[0]
        seen.update((id(obj), id(referrers)))  # this lookup's own list refers to the next object too
        chain.append(type(obj).__qualname__)
    return " <- ".join(chain) or "nothing Python sees"


def _holders() -> list[str]:
    """What refers to each CUDA tensor the garbage collector still sees (types, for the message)."""
    gc.collect()
    return [f"{tuple(t.shape)} {t.dtype}: {_referrer_chain(t)}" for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.is_cuda][:20]


def _watched_bench(monkeypatch) -> tuple[object, dict]:
    """The bench's run module (`bench/_compare_run.py`, whose runs are here in this process, as
    ``--processes one`` runs them), with weak references to each run's model, a weight and its
    manager in the dict."""
    load_bench_script("megatron_compare")  # puts bench/ on sys.path and imports its run module
    bench = sys.modules["_compare_run"]
    built = {}
    stage_of, with_offload = bench.megatron_stage, bench._with_offload

    @contextlib.contextmanager
    def watched_stage(*args, **kwargs):
        with stage_of(*args, **kwargs) as stage:
            built["model"] = weakref.ref(stage.chunks[0])
            built["weight"] = weakref.ref(next(stage.chunks[0].parameters()))
            yield stage

    def watched_offload(*args, **kwargs):
        made = with_offload(*args, **kwargs)
        built["manager"] = weakref.ref(made[2]) if made[2] is not None else None
        return made

    monkeypatch.setattr(bench, "megatron_stage", watched_stage)
    monkeypatch.setattr(bench, "_with_offload", watched_offload)
    return bench, built


def _run_twice(bench, run: str) -> tuple[int, dict]:
    """The run without offload (what a process allocates once: cuDNN, NCCL), then ``run``; the bytes left before it, and its row."""
    args = sys.modules["megatron_compare"].parse_args(
        ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "256", "--dtype", "bf16", "--min-offload-bytes", "1",
         "--warmup", "1", "--iterations", "1", "--processes", "one"])  # fmt: skip
    shape = bench.GPTShape(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=args.vocab, seq_length=256,
                           micro_batch_size=1, dtype=torch.bfloat16, attention="sdpa")  # fmt: skip
    bench.run_once(args, shape, ["core_attn", "qkv_linear"], "none", None)
    before = bench.device_bytes_left()
    return before, bench.run_once(args, shape, ["core_attn", "qkv_linear"], run, None)


def test_a_run_leaves_no_manager_behind(monkeypatch) -> None:
    """Nothing keeps a detached and closed manager once its run returns: on CPU nothing does. Were
    something on CUDA to (autograd's device thread, an event's callback), it would keep the engine's
    session and records, and, before the managers held their models weakly, the model with its
    gradients too: the leftover model of 2026-11-27; the message names what holds it."""
    bench, built = _watched_bench(monkeypatch)
    _run_twice(bench, "chunk-offload")
    bench.device_bytes_left()  # a garbage collection
    manager = built["manager"]()
    if manager is not None:
        pytest.fail(f"the manager outlived its run: {_referrer_chain(manager, depth=8)}")


@pytest.mark.parametrize("run", ["chunk-offload", "chunk-offload module"])  # on CUDA both time their reloads (the default)
def test_a_run_leaves_no_device_memory_behind(run: str, monkeypatch) -> None:
    bench, built = _watched_bench(monkeypatch)
    before, row = _run_twice(bench, run)
    assert row["left_bytes"] == before and row["bytes_copied"] > 0
    left = bench.device_bytes_left()
    if left == before:
        return
    model, weight = built["model"](), built["weight"]()
    held = (f"the model is {'alive: ' + _referrer_chain(model) if model is not None else 'gone'}; a weight is "
            f"{'alive: ' + _referrer_chain(weight) if weight is not None else 'gone'}; CUDA tensors: {_holders()}")  # fmt: skip
    del model, weight
    # A backward on the device runs on autograd's CUDA worker thread: if the memory goes with one,
    # that thread's state held on to the run's last backward (C++ references, not Python's).
    torch.ones(1, device="cuda", requires_grad=True).sum().backward()
    after_backward = bench.device_bytes_left()
    pytest.fail(f"{left - before} bytes of the run still allocated after it ({after_backward - before} after one more "
                f"backward on the device); {held}")  # fmt: skip
