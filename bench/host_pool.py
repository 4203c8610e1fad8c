"""Host pool memory under changing shapes: the exact-size pool of before against `HostPool` now.

One real training run (an `OffloadManager` with CPU streams, 1F1B over ``--microbatches``
microbatches, two blocks each with an MLP and a routed MoE-like expert) records every request
the engine makes of its pool: acquire ``nbytes``, release, and the iteration ends. The shapes
change every microbatch: ``random`` draws sequence lengths in ``--seq-min..--seq-max`` and a
routed token count in 1..tokens; ``growing`` grows the length linearly over the iterations.

The recorded requests are then replayed, each policy in a fresh process so that its RSS is its
own, against the exact-size pool of before (512-byte rounding, reuse only at the same size,
never freed) and against `HostPool`. It prints, per policy: pool bytes after the first and the
last iteration and at their peak, the floor (the most requested bytes in use at once: no pool
can hold less), allocations and releases, process RSS before and after the replay, and the cost
per acquire (served from a free buffer) and per allocation (a new buffer), in microseconds.

    python bench/host_pool.py [--iterations 200] [--shape random|growing] [--hidden 128]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import torch
import torch.nn.functional as F
from torch import nn

import chunk_offload
from chunk_offload.core import HostPool

ROUND = 512


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.expert = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(F.gelu(self.fc1(x)))
        flat = x.reshape(-1, x.shape[-1])
        return flat.index_add(0, routed, self.expert(flat.index_select(0, routed))).reshape(x.shape)


def record(args: argparse.Namespace) -> list[tuple]:
    """Train with offload and return the pool requests: ("a", key, nbytes), ("r", key), ("end",)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    blocks = nn.ModuleList([_Block(args.hidden) for _ in range(2)])
    manager = chunk_offload.OffloadManager(chunk_offload.OffloadConfig(min_offload_bytes=1))
    for block in blocks:
        manager.offload_module(block.fc1, "fc1")
        manager.offload_module(block.fc2, "fc2")
        manager.offload_module(block.expert, "expert")
    events: list[tuple] = []
    keys: dict[int, int] = {}
    pool = manager.pool
    acquire, release = pool.acquire, pool.release

    def traced_acquire(nbytes: int):
        buf = acquire(nbytes)
        keys[id(buf)] = len(events)
        events.append(("a", len(events), nbytes))
        return buf

    def traced_release(buf, fence) -> None:
        events.append(("r", keys.pop(id(buf))))
        release(buf, fence)

    pool.acquire, pool.release = traced_acquire, traced_release
    n = args.microbatches
    order = _one_f_one_b(n, warmup=min(n - 1, 2))
    try:
        for it in range(args.iterations):
            if args.shape == "growing":
                span = args.seq_max - args.seq_min
                seqs = [args.seq_min + span * it // max(args.iterations - 1, 1)] * n
            else:
                seqs = torch.randint(args.seq_min, args.seq_max + 1, (n,), generator=g).tolist()
            losses = {}
            with manager.iteration():
                for kind, m in order:
                    if kind == "F":
                        x = torch.randn(2, seqs[m], args.hidden, generator=g)
                        with manager.chunk(microbatch=m):
                            for block in blocks:
                                tokens = 2 * seqs[m]
                                count = int(torch.randint(1, tokens + 1, (1,), generator=g))
                                x = block(x, torch.randperm(tokens, generator=g)[:count])
                            losses[m] = x.pow(2).mean()
                    else:
                        losses.pop(m).backward()
            events.append(("end",))
    finally:
        manager.close()
    return events


def _one_f_one_b(n: int, warmup: int) -> list[tuple[str, int]]:
    """1F1B order of one stage: ``warmup`` forwards, then alternate, then the remaining backwards."""
    order = [("F", m) for m in range(warmup + 1)]
    for m in range(n):
        order.append(("B", m))
        if m + warmup + 1 < n:
            order.append(("F", m + warmup + 1))
    return order


class ExactBinPool:
    """The pool of before: 512-byte rounding, a free buffer reused only at the same size, never freed."""

    def __init__(self) -> None:
        self.free: dict[int, list[torch.Tensor]] = {}
        self.allocated = 0
        self.allocations = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // ROUND) * ROUND
        bufs = self.free.get(size)
        if bufs:
            return bufs.pop()
        self.allocated += size
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        self.free.setdefault(buf.numel(), []).append(buf)


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def replay(policy: str, events: list[tuple]) -> dict:
    """Run the recorded requests against one policy; pool bytes per iteration, RSS, costs."""
    pool = ExactBinPool() if policy == "exact-bin (before)" else HostPool()
    hold: dict[int, object] = {}
    per_iter: list[int] = []
    hit_ns, miss_ns = [], []
    rss_before = _rss_mib()
    for event in events:
        if event[0] == "a":
            before = pool.allocations if isinstance(pool, ExactBinPool) else pool.stats().allocations
            start = time.perf_counter_ns()
            buf = pool.acquire(event[2])
            took = time.perf_counter_ns() - start
            after = pool.allocations if isinstance(pool, ExactBinPool) else pool.stats().allocations
            (miss_ns if after > before else hit_ns).append(took)
            (buf if isinstance(pool, ExactBinPool) else buf.view())[: event[2]].fill_(1)  # the offload's write
            hold[event[1]] = buf
        elif event[0] == "r":
            buf = hold.pop(event[1])
            pool.release(buf) if isinstance(pool, ExactBinPool) else pool.release(buf, None)
        else:
            per_iter.append(pool.allocated if isinstance(pool, ExactBinPool) else pool.stats().allocated_bytes)
    stats = None if isinstance(pool, ExactBinPool) else pool.stats()
    return dict(
        per_iter=per_iter,
        peak=pool.allocated if stats is None else stats.peak_allocated_bytes,
        allocations=pool.allocations if stats is None else stats.allocations,
        evictions=0 if stats is None else stats.evictions,
        rss_before=rss_before,
        rss_after=_rss_mib(),
        hit_us=sum(hit_ns) / max(len(hit_ns), 1) / 1e3,
        miss_us=sum(miss_ns) / max(len(miss_ns), 1) / 1e3,
        misses=len(miss_ns),
    )


def _floor(events: list[tuple]) -> int:
    """Most requested bytes in use at once over the run."""
    in_use = most = 0
    sizes: dict[int, int] = {}
    for event in events:
        if event[0] == "a":
            sizes[event[1]] = event[2]
            in_use += event[2]
            most = max(most, in_use)
        elif event[0] == "r":
            in_use -= sizes.pop(event[1])
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description="host pool bytes and RSS under changing shapes")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--shape", choices=("random", "growing"), default="random")
    parser.add_argument("--seq-min", type=int, default=64)
    parser.add_argument("--seq-max", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    for name in ("iterations", "microbatches", "seq_min", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_max < args.seq_min:
        parser.error(f"--seq-max ({args.seq_max}) must be >= --seq-min ({args.seq_min})")
    start = time.perf_counter()
    events = record(args)
    floor = _floor(events)
    acquires = sum(1 for e in events if e[0] == "a")
    print(
        f"workload: {args.iterations} iterations, 1F1B over {args.microbatches} microbatches, shape={args.shape}, "
        f"seq {args.seq_min}..{args.seq_max}, hidden {args.hidden}; {acquires} acquires recorded in "
        f"{time.perf_counter() - start:.0f} s"
    )
    print(f"floor (most requested bytes in use at once): {floor / 2**20:.2f} MiB")
    print(
        f"{'policy':<20} {'pool MiB it1':>12} {'last':>8} {'peak':>8} {'peak/floor':>10} {'allocs':>7} {'evict':>6} "
        f"{'RSS MiB before':>14} {'after':>7} {'us/acquire':>10} {'us/alloc':>9}"
    )
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, maxtasksperchild=1) as workers:
        for policy in ("exact-bin (before)", "HostPool (now)"):
            r = workers.apply(replay, (policy, events))
            per = r["per_iter"]
            print(
                f"{policy:<20} {per[0] / 2**20:12.2f} {per[-1] / 2**20:8.2f} {r['peak'] / 2**20:8.2f} "
                f"{r['peak'] / floor:10.2f} {r['allocations']:7d} {r['evictions']:6d} {r['rss_before']:14.0f} "
                f"{r['rss_after']:7.0f} {r['hit_us']:10.2f} {r['miss_us']:9.2f}"
            )


if __name__ == "__main__":
    main()
