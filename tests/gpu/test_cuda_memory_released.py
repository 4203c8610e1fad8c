"""A chunk-offload run gives its device memory back once it ends.

The H200 run of 2026-11-27 (bench/results/2026-11-27-h200) measured, in `bench/megatron_compare.py`,
the runs right after a chunk-offload run peaking higher by exactly the previous run's model
(parameters and gradients: 7.56 GB at hidden 4096, 1.07 GB at hidden 1024), although the bench
collects garbage between runs; on CPU nothing of a run outlives it. This test runs the bench's
own run twice in one process and asserts that nothing of the first is still allocated when the
second starts; when something is, it names what holds the CUDA tensors still alive.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from .conftest import REQUIRES_CUDA_REASON

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=REQUIRES_CUDA_REASON),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("megatron_compare", BENCH / "megatron_compare.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def _holders() -> list[str]:
    """What refers to each CUDA tensor the garbage collector still sees (types, for the message)."""
    gc.collect()
    found = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            kinds = sorted({type(r).__qualname__ for r in gc.get_referrers(obj) if r is not found})
            found.append(f"{tuple(obj.shape)} {obj.dtype}: held by {', '.join(kinds) or 'nothing Python sees'}")
    return found[:20]


@pytest.mark.parametrize("run", ["chunk-offload", "chunk-offload timed", "chunk-offload layer"])
def test_a_run_leaves_no_device_memory_behind(run: str) -> None:
    bench = _bench()
    args = bench.parse_args(["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "256", "--dtype", "bf16",
                             "--min-offload-bytes", "1", "--warmup", "1", "--iterations", "1", "--timed-reload-ahead"])  # fmt: skip
    shape = bench.GPTShape(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=args.vocab, seq_length=256,
                           micro_batch_size=1, dtype=torch.bfloat16, attention="sdpa")  # fmt: skip
    before = bench.device_bytes_left()
    row = bench._run(args, shape, ["core_attn", "qkv_linear"], run, None)
    assert row["left_bytes"] == before and row["bytes_copied"] > 0
    left = bench.device_bytes_left()
    assert left == before, f"{left - before} bytes of the run still allocated after it: {_holders()}"
