"""A tiny transformer stack shared by the core tests, and `run_schedule`: the shared driver
(`tests._driver.drive`) training it for a few iterations with microbatch forwards and backwards
interleaved in a given order (1F1B, interleaved VPP), with or without an `OffloadManager`.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import chunk_offload
from chunk_offload.core.engine_context import WAIT_NAMES
from tests._driver import Hooks, RunResult, actions, drive

HIDDEN = 32
HEADS = 4
SEQ = 8
BATCH = 2

# Module kinds of a Megatron-like layer that the tests offload, by group name.
MODULE_KINDS = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")

ONE_F_ONE_B = ("F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3")
# Interleaved VPP with 2 model chunks and 4 microbatches, as stage 0 of PP=2 runs it:
# (kind, microbatch, vp_stage).
INTERLEAVED = (
    ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1), ("F", 3, 0),
    ("B", 1, 1), ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0), ("B", 2, 1), ("B", 3, 1),
    ("B", 2, 0), ("B", 3, 0),
)


class CoreAttention(nn.Module):
    """Softmax attention on q, k, v that are views of one qkv tensor (as in Megatron)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, h = q.shape
        d = h // self.heads

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(b, t, self.heads, d).transpose(1, 2)

        scores = split(q) @ split(k).transpose(-1, -2) / d**0.5
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return (probs @ split(v)).transpose(1, 2).reshape(b, t, h)


class Block(nn.Module):
    """Pre-norm attention + GELU MLP block with Megatron's submodule names as attributes."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.qkv_linear = nn.Linear(hidden, 3 * hidden)
        self.core_attn = CoreAttention(heads)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp_fc1 = nn.Linear(hidden, 4 * hidden)
        self.mlp_fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_linear(self.attn_norm(x)).chunk(3, dim=-1)
        x = x + self.attn_proj(self.core_attn(q, k, v))
        return x + self.mlp_fc2(F.gelu(self.mlp_fc1(self.mlp_norm(x))))


def no_saved_tensor_hooks() -> bool:
    """Whether no saved-tensor hooks are installed (a leak check after an iteration or an error)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class Fn(nn.Module):
    """A module whose forward is ``fn``; offloaded as one group."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def assert_clean(manager: chunk_offload.OffloadManager) -> None:
    """Nothing left: no saved-tensor hook, no pool buffer in use, no bytes accounted, no live chunk.

    Collects garbage first: several cases drop a graph, or keep one alive through an exception's
    traceback, and its saved tensors are freed only then.
    """
    gc.collect()
    assert no_saved_tensor_hooks(), "saved-tensor hooks left installed"
    stats = manager.stats()
    assert stats.pool.in_use_bytes == 0
    assert stats.pool.fallback_in_use_bytes == 0
    assert stats.resident_bytes == 0
    assert stats.host_bytes == 0
    assert manager.live_chunks() == []
    assert manager.current_handler is None


def manager_skipping_waits(
    skip: Sequence[str], *, streams: chunk_offload.StreamBackend | None = None, **fields
) -> chunk_offload.OffloadManager:
    """Test-only: an `OffloadManager` of ``OffloadConfig(min_offload_bytes=1, **fields)`` whose engine
    leaves out the waits named in ``skip`` (`chunk_offload.core.engine_context.WAIT_NAMES`), to prove
    the happens-before checker catches each missing one. Not a public constructor option."""
    bad = sorted(set(skip) - set(WAIT_NAMES))
    if bad:
        raise chunk_offload.ChunkOffloadError(f"unknown wait names {bad}; valid: {list(WAIT_NAMES)}")
    config = chunk_offload.OffloadConfig(min_offload_bytes=1, **fields)
    manager = chunk_offload.OffloadManager(config, streams=streams)
    manager._ctx.skip_waits = frozenset(skip)
    return manager


def make_stack(layers: int = 2, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(layers)])


def register(manager: chunk_offload.OffloadManager, model: nn.Module, kinds: Sequence[str] = MODULE_KINDS) -> None:
    """Offload the submodules named in ``kinds`` of every block of ``model``, each block their
    layer (one group per block with ``OffloadConfig.group_by="layer"``)."""
    for block in model.modules():
        if isinstance(block, Block):
            for kind in kinds:
                manager.offload_module(getattr(block, kind), kind, layer=block)


def microbatches(count: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, SEQ, HIDDEN, generator=g) for _ in range(count)]


def run_schedule(
    manager_factory: Callable[[], chunk_offload.OffloadManager | None],
    *,
    order: Sequence = ONE_F_ONE_B,
    model_chunks: int = 1,
    iterations: int = 3,
    layers: int = 2,
    kinds: Sequence[str] = MODULE_KINDS,
    seed: int = 0,
    after_iteration: Callable[[chunk_offload.OffloadManager | None, int], None] | None = None,
) -> RunResult:
    """`drive` over ``model_chunks`` stacks (virtual stages chained in order, stack v seeded
    ``seed + v``) with ``order`` per iteration, on `microbatches`, every block's ``kinds`` offloaded
    under the manager ``manager_factory`` makes (None: the reference run). Closes that manager, also
    when the run raises."""
    chunks = [make_stack(layers, seed + v) for v in range(model_chunks)]
    manager = manager_factory()
    try:
        if manager is not None:
            for chunk in chunks:
                register(manager, chunk, kinds)
        xs = microbatches(1 + max(m for _, m, _ in actions(order)))
        hooks = Hooks(after_iteration=after_iteration)
        return drive(chunks, inputs=xs, manager=manager, order=order, iterations=iterations, hooks=hooks)
    finally:
        if manager is not None:
            manager.close()


@dataclass
class ReuseOutcome:
    """What `reuse_during_reload` returns: the numbers with and without offload, and the pool's view."""

    reference: tuple  # loss A, loss B, gradients after B's backward, after A's: no offload
    result: tuple  # the same with offload
    stats: chunk_offload.OffloadStats
    pending_at_reuse: list[bool]  # per reuse of a fenced host buffer: was A's reload still pending?


def reuse_during_reload(streams, *, skip: Sequence[str] = (), hold_reload: bool = False) -> ReuseOutcome:
    """Chunk A offloads one group; its reload is prefetched (``bulk_reload_group``) and nothing waits
    on it; chunk B, of identical shapes, offloads into the same host buffer; then B's backward and A's.

    ``skip``: engine waits left out (`chunk_offload.core.engine_context.WAIT_NAMES`). ``hold_reload``: A's
    reload is queued behind an event on the h2d stream that opens only when B's offload acquires
    the buffer, so the reload is pending at the reuse on every run.
    """
    from chunk_offload.core import GroupState

    reference = make_stack(1, seed=0)
    model = make_stack(1, seed=0)
    xa, xb = microbatches(2)
    ref_a = reference(xa).pow(2).mean()
    ref_b = reference(xb).pow(2).mean()
    ref_b.backward()
    ref_grads_b = [p.grad.clone() for p in reference.parameters()]
    ref_a.backward()
    ref_grads_a = [p.grad.clone() for p in reference.parameters()]

    manager = manager_skipping_waits(skip, streams=streams)
    pending_at_reuse: list[bool] = []
    held = threading.Event()
    original_acquire = manager.pool.acquire

    def acquire(nbytes: int):
        buf = original_acquire(nbytes)
        if buf.fence is not None:
            pending_at_reuse.append(not buf.fence.query())
            held.set()  # B's offload now waits on the fence: let A's reload run
        return buf

    manager.pool.acquire = acquire  # instance attribute: only this manager's pool
    try:
        manager.offload_module(model[0].mlp_fc1, "mlp_fc1")
        with manager.iteration():
            with manager.chunk(microbatch=0) as handler_a:
                loss_a = model(xa).pow(2).mean()
            group_a = handler_a.groups[0]
            assert group_a.state is GroupState.ON_HOST
            if hold_reload:
                manager.streams.h2d.launch(lambda: held.wait(timeout=30.0))
            handler_a.bulk_reload_group(0)  # prefetch; compute does not wait on it yet
            assert group_a.state is GroupState.RELOADING
            with manager.chunk(microbatch=1) as handler_b:  # reuses A's host buffer
                loss_b = model(xb).pow(2).mean()
            loss_b.backward()
            grads_b = [p.grad.clone() for p in model.parameters()]
            loss_a.backward()
            grads_a = [p.grad.clone() for p in model.parameters()]
            assert handler_b.groups[0].state is GroupState.RELEASED
            assert group_a.state is GroupState.RELEASED
        stats = manager.stats()
    finally:
        held.set()
        manager.close()
    return ReuseOutcome((ref_a, ref_b, ref_grads_b, ref_grads_a), (loss_a, loss_b, grads_b, grads_a), stats, pending_at_reuse)


def assert_reuse_exact(outcome: ReuseOutcome) -> None:
    """Bit-identical numbers, and one host buffer really served both chunks."""
    ref_a, ref_b, ref_grads_b, ref_grads_a = outcome.reference
    loss_a, loss_b, grads_b, grads_a = outcome.result
    assert torch.equal(loss_a, ref_a) and torch.equal(loss_b, ref_b)
    for i, (x, y) in enumerate(zip(grads_b, ref_grads_b)):
        assert torch.equal(x, y), f"gradient {i} after chunk B's backward differs"
    for i, (x, y) in enumerate(zip(grads_a, ref_grads_a)):
        assert torch.equal(x, y), f"gradient {i} after chunk A's backward differs"
    stats = outcome.stats
    g = stats.groups["mlp_fc1"]
    assert g.groups == 2 and g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded
    # One host buffer served both chunks: B's offload really reused the buffer A's reload read.
    assert stats.pool.allocations == 1 and len(outcome.pending_at_reuse) == 1
    assert stats.pool.in_use_bytes == 0 and stats.resident_bytes == 0 and stats.host_bytes == 0
