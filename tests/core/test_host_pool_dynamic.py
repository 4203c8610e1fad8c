"""`HostPool` under changing shapes, driven through a real `OffloadManager` (CPU streams, 1F1B).

Each iteration draws a random sequence length per microbatch and a random MoE-like routed token
count per microbatch and block. The pool must stay bounded by the run's largest need (NOTE [Host
pool bound]), numbers must be bit-identical to training without offload, nothing may leak after
an iteration, and under a cap the pool never exceeds it and falls back only when no free buffer
could serve. The "need" is measured from outside the pool: the requested bytes of the buffers
handed out and not yet released, tracked by wrapping the pool's ``acquire`` and ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chunk_offload import OffloadConfig, OffloadManager
from tests._driver import Hooks, RunResult, Step, assert_identical, drive
from tests.core._models import BATCH, HIDDEN, ONE_F_ONE_B, Block, assert_clean

ITERATIONS = 200
LAYERS = 2
MICROBATCHES = 4
SEQ_RANGE = (4, 40)
ROUND = 512
KINDS = ("attn_norm", "core_attn", "mlp_fc1")  # per block, plus the routed expert: sizes from both


class MoeBlock(nn.Module):
    """A `Block` followed by one routed expert: only the routed tokens go through it (MoE-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.expert_fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.expert_fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        flat = x.reshape(-1, HIDDEN)
        out = self.expert_fc2(F.gelu(self.expert_fc1(flat.index_select(0, routed))))
        return flat.index_add(0, routed, out).reshape(x.shape)


@dataclass
class Shapes:
    """Per iteration and microbatch: the input, and per block the indices of the routed tokens."""

    inputs: list[list[torch.Tensor]]
    routed: list[list[list[torch.Tensor]]]


def _shapes(seed: int) -> Shapes:
    g = torch.Generator().manual_seed(seed)
    inputs, routed = [], []
    for _ in range(ITERATIONS):
        seqs = torch.randint(SEQ_RANGE[0], SEQ_RANGE[1] + 1, (MICROBATCHES,), generator=g).tolist()
        inputs.append([torch.randn(BATCH, s, HIDDEN, generator=g) for s in seqs])
        tokens = [
            [torch.randperm(BATCH * s, generator=g)[: int(torch.randint(1, BATCH * s + 1, (1,), generator=g))] for _ in range(LAYERS)]
            for s in seqs
        ]
        routed.append(tokens)
    return Shapes(inputs, routed)


@dataclass
class Trace:
    """What the wrapped pool saw: need per iteration, buffers in use, and each fallback's legitimacy."""

    in_use: int = 0
    buffers: int = 0
    need: list[int] = field(default_factory=lambda: [0])  # per iteration: most requested bytes in use at once
    most_buffers: int = 0
    free: dict[int, object] = field(default_factory=dict)  # id -> pooled buffer given back, not handed out again
    fallbacks: int = 0
    sizes: list[tuple[str, int]] = field(default_factory=list)  # ("a"|"r", rounded bytes): replayed as the old pool
    free_at_end: int = 0  # the free buffers' capacities after the last iteration, before the manager closed


def _instrument(manager: OffloadManager, trace: Trace) -> None:
    pool = manager.pool
    acquire, release = pool.acquire, pool.release

    def wrapped_acquire(nbytes: int):
        before = pool.stats()
        free_capacities = [b.capacity for b in trace.free.values() if b.tensor is not None]
        buf = acquire(nbytes)
        trace.free.pop(id(buf), None)
        if not buf.pooled:
            trace.fallbacks += 1
            assert all(c < nbytes for c in free_capacities), "fell back while a free buffer could hold the request"
            assert before.in_use_bytes + buf.capacity > pool.capacity_bytes, "fell back while releasing free buffers made room"
        trace.in_use += nbytes
        trace.buffers += 1
        trace.need[-1] = max(trace.need[-1], trace.in_use)
        trace.most_buffers = max(trace.most_buffers, trace.buffers)
        trace.sizes.append(("a", -(-nbytes // ROUND) * ROUND))
        return buf

    def wrapped_release(buf, fence) -> None:
        trace.in_use -= buf.nbytes
        trace.buffers -= 1
        trace.sizes.append(("r", -(-buf.nbytes // ROUND) * ROUND))
        release(buf, fence)
        if buf.pooled:
            trace.free[id(buf)] = buf

    pool.acquire, pool.release = wrapped_acquire, wrapped_release  # instance attributes: this pool only


def _train(manager: OffloadManager | None, shapes: Shapes, trace: Trace | None = None, stats: list | None = None) -> RunResult:
    torch.manual_seed(0)
    model = nn.ModuleList([MoeBlock() for _ in range(LAYERS)])
    if manager is not None:
        for block in model:
            for kind in KINDS:
                manager.offload_module(getattr(block.block, kind), kind)
            manager.offload_module(block.expert_fc1, "expert_fc1")
        if trace is not None:
            _instrument(manager, trace)

    def batch(it: int, m: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return shapes.inputs[it][m], shapes.routed[it][m]

    def forward(model: nn.ModuleList, batch: tuple, step: Step) -> torch.Tensor:
        x, routed = batch
        for block, tokens in zip(model, routed):
            x = block(x, tokens)
        return x

    def after(manager: OffloadManager | None, it: int) -> None:
        if manager is not None:
            assert_clean(manager)
            if stats is not None:
                stats.append(manager.stats().pool)
            if trace is not None:
                trace.need.append(0)

    hooks = Hooks(after_iteration=after)
    return drive(model, inputs=batch, manager=manager, order=ONE_F_ONE_B, iterations=ITERATIONS, forward=forward, lr=0.01, hooks=hooks)


def _old_pool_bytes(sizes: list[tuple[str, int]]) -> int:
    """What the exact-size pool of before held after this trace: per rounded size, the most in use at once."""
    in_use: dict[int, int] = {}
    most: dict[int, int] = {}
    for op, size in sizes:
        in_use[size] = in_use.get(size, 0) + (1 if op == "a" else -1)
        most[size] = max(most.get(size, 0), in_use[size])
    return sum(size * count for size, count in most.items())


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the runs are many tiny ops, and the host's cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_baseline: dict[int, tuple] = {}
_uncapped: dict[int, tuple] = {}


def _reference(seed: int, shapes: Shapes):
    """The same training without offload (cached per seed)."""
    if seed not in _baseline:
        _baseline[seed] = _train(None, shapes)
    return _baseline[seed]


def _run_uncapped(seed: int, shapes: Shapes) -> tuple:
    """(result, trace, per-iteration pool stats) of the run with an uncapped pool (cached per seed)."""
    if seed not in _uncapped:
        trace, stats = Trace(), []
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
        try:
            result = _train(manager, shapes, trace, stats)
            trace.free_at_end = sum(b.capacity for b in trace.free.values() if b.tensor is not None)
        finally:
            manager.close()
        assert all(b.tensor is None for b in trace.free.values()), "close() releases every free buffer"
        _uncapped[seed] = (result, trace, stats)
    return _uncapped[seed]


def _assert_exact(result: RunResult, reference: RunResult) -> None:
    assert len(result.losses) == len(reference.losses) == ITERATIONS * MICROBATCHES
    assert_identical(reference, result)


@pytest.mark.parametrize("seed", [3])
def test_pool_stays_within_twice_the_largest_need(seed: int) -> None:
    shapes = _shapes(seed)
    result, trace, stats = _run_uncapped(seed, shapes)
    _assert_exact(result, _reference(seed, shapes))
    largest = 0
    for it, pool in enumerate(stats):
        largest = max(largest, trace.need[it])
        # NOTE [Host pool bound]: between iterations nothing is in use, so the pool holds at most
        # twice the largest need so far; inside one, at most that or what is in use (<= 2x the
        # requested bytes in use plus < 512 rounding bytes per buffer).
        assert pool.in_use_bytes == 0
        assert pool.allocated_bytes <= 2 * largest, (it, pool, largest)
        assert pool.peak_allocated_bytes <= 2 * largest + (ROUND - 1) * trace.most_buffers, (it, pool, largest)
        assert pool.peak_requested_bytes == largest, (it, pool.peak_requested_bytes, largest)
        assert pool.fallback_allocations == 0
    final = stats[-1]
    old = _old_pool_bytes(trace.sizes)
    # The workload really changes shapes: the exact-size pool would hold several times the bound.
    assert old > 4 * largest, (old, largest)
    assert final.evictions > 0 and final.freed_bytes > 0
    assert final.allocated_bytes == trace.free_at_end, "the pool's byte count must equal its free buffers' capacities after an iteration"


def test_capped_pool_never_exceeds_the_cap_and_falls_back_only_when_nothing_free_serves(make_manager) -> None:
    seed = 3
    shapes = _shapes(seed)
    _, probe, _ = _run_uncapped(seed, shapes)
    need = max(probe.need)
    # One 512-byte unit under the need, so some request must fall back: pooled bytes in use are
    # >= requested bytes in use, which reach the need at some moment of the run.
    cap = (need // ROUND - 1) * ROUND
    assert cap < _old_pool_bytes(probe.sizes), "the cap must be below the exact-size pool's growth"
    trace, stats = Trace(), []
    manager = make_manager(host_pool_bytes=cap, on_exhausted="fallback")
    with pytest.warns(UserWarning, match="host pool at its cap"):
        result = _train(manager, shapes, trace, stats)
    _assert_exact(result, _reference(seed, shapes))
    for it, pool in enumerate(stats):
        assert pool.peak_allocated_bytes <= cap, (it, pool, cap)
        assert pool.fallback_in_use_bytes == 0
    # Every fallback was checked as legitimate when it happened (see `_instrument`).
    assert stats[-1].fallback_allocations == trace.fallbacks
    assert 0 < trace.fallbacks


def test_cap_with_room_for_the_bound_never_errors(make_manager) -> None:
    """A cap of twice the need plus rounding leaves room for whatever the rules hand out: no exhaustion."""
    seed = 3
    shapes = _shapes(seed)
    _, probe, _ = _run_uncapped(seed, shapes)
    cap = 2 * max(probe.need) + ROUND * probe.most_buffers
    stats: list = []
    manager = make_manager(host_pool_bytes=cap, on_exhausted="error")
    _assert_exact(_train(manager, shapes, Trace(), stats), _reference(seed, shapes))
    assert all(pool.peak_allocated_bytes <= cap and pool.fallback_allocations == 0 for pool in stats)
