"""CPU cost of timed reload-ahead budgets per iteration on a 70B-like plan, with and without holding them.

With timed reload ahead (on by default on CUDA streams), the policy's per-chunk reload-ahead
budgets come from the latest iteration's copy timing (NOTE [Timed reload ahead]); deriving them is
CPU work on the training loop's path between iterations. The plan is rank 0 or 7 of PP=8, VPP=2,
32 microbatches, 10 groups per layer and 5 layers per chunk (64 chunks, 3,200 groups: the plan of
NOTE [Budget choice]); the timing has forwards of 10 ms, backwards of 20 ms and a link of
``--link-gbs`` each way. It prints the CPU milliseconds of one `PlanPolicy` with the timing and
without, then, over ``--iterations`` timings each jittered by up to ``--jitter`` (every rate and
action duration, seeded), how many derivations the integrations make: one per iteration without
the rule of NOTE [Timed reload ahead by default] (`CopyTiming.close_to` the timing of the last
derivation), and with it; and the CPU seconds each way, in one run.

    python bench/timed_refit.py [--ranks 0 7] [--iterations 50] [--jitter 0.03] [--link-gbs 25]
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from chunk_offload.core import ActionKind
from chunk_offload.schedule import CopyTiming, Plan, PlanPolicy, megatron_plan

__all__ = ["main"]

LAYER_MB = (16, 48, 64, 16, 16, 16, 64, 64, 32, 8)
"""One layer's groups (MiB), as NOTE [Budget choice]'s plan has them."""


def timing_of(plan: Plan, link_bytes_per_s: float, jitter: float, rng: random.Random) -> CopyTiming:
    """Forwards 10 ms, backwards 20 ms, the link both ways: each scaled by a factor in [1 - jitter, 1 + jitter]."""
    scale = lambda: 1.0 + rng.uniform(-jitter, jitter)  # noqa: E731
    durations = [(0.010 if a.kind is ActionKind.FORWARD else 0.020) * scale() for a in plan.actions]
    starts = tuple(itertools.accumulate(durations[:-1], initial=0.0))
    return CopyTiming(bytes_per_s=link_bytes_per_s * scale(), reload_bytes_per_s=link_bytes_per_s * scale(),
                      action_starts_s=starts, iteration_s=sum(durations))  # fmt: skip


def cpu_seconds(make) -> tuple[float, object]:
    started = time.process_time()
    made = make()
    return time.process_time() - started, made


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, choices=range(8), default=[0, 7], metavar="RANK", help="pipeline ranks (0-7)")
    parser.add_argument("--iterations", type=int, default=50, help="timings per rank (>= 1)")
    parser.add_argument("--jitter", type=float, default=0.03, help="each duration and rate within +-this share (in [0, 1))")
    parser.add_argument("--link-gbs", type=float, default=25.0, help="link rate each way, GB/s (> 0)")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations must be an integer >= 1, got {args.iterations}")
    if not 0 <= args.jitter < 1:
        parser.error(f"--jitter must be in [0, 1), got {args.jitter}")
    if not args.link_gbs > 0:
        parser.error(f"--link-gbs must be > 0, got {args.link_gbs}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(0)
    print(f"PP=8 VPP=2, 32 microbatches, 3,200 groups per rank; link {args.link_gbs:g} GB/s; "
          f"{args.iterations} timings jittered by up to {args.jitter:.0%}")  # fmt: skip
    print(f"{'rank':>4}  {'ms with timing':>14}  {'ms without':>10}  {'derivations':>11}  {'held':>4}  {'s every time':>12}  "
          f"{'s held':>7}  {'ratio':>6}")  # fmt: skip
    for rank in args.ranks:
        plan = megatron_plan(pp_size=8, pp_rank=rank, num_microbatches=32, vp_size=2)
        sizes = {chunk: [mb << 20 for mb in LAYER_MB * 5] for chunk in plan.chunks}
        timings = [timing_of(plan, args.link_gbs * 1e9, args.jitter, rng) for _ in range(args.iterations)]
        plain, _ = cpu_seconds(lambda: PlanPolicy(plan, group_bytes=sizes))
        every = [cpu_seconds(lambda t=t: PlanPolicy(plan, group_bytes=sizes, reload_timing=t))[0] for t in timings]
        basis, held = None, []
        for seconds, timing in zip(every, timings):  # the integrations' rule: derive only when the timing moved
            if not timing.close_to(basis):
                basis = timing
                held.append(seconds)
        print(f"{rank:>4}  {every[0] * 1e3:>14.1f}  {plain * 1e3:>10.1f}  {len(every):>11}  {len(held):>4}  {sum(every):>12.2f}  "
              f"{sum(held):>7.2f}  {sum(every) / max(sum(held), 1e-9):>6.1f}")  # fmt: skip
    print("derivations: one per timing (every time) and under CopyTiming.close_to the last one (held); "
          "s: CPU seconds over all the timings; ratio: every time / held")


if __name__ == "__main__":
    main()
