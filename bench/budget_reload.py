"""Compute wait on reloads under a device budget: one group ahead against the timed choice (NOTE [Reload room]).

On CPU streams whose links and backward compute take real time (`chunk_offload.devkit.slow_link`:
slept backward compute, a throttled link), each configuration trains the chain under a device
budget that `Budgets` decides after every iteration, as the integrations do, twice: reloading
one group ahead, and with ``timed_reload_ahead`` (once a copy timing is known the choice is made
again, for a lower budget where that leaves room, with the reload-ahead budgets that fit). The
budget lies between the lowest peak and the peak without offload (``--fraction``). Per run it
prints the last iteration's peak of device-resident saved bytes against the budget, the bytes
copied, the compute wait and whether the gradients equal a run without offload; then the wait
of one group ahead over the timed one's.

    python bench/budget_reload.py [--configs pp1 pp2 pp4 pp4_last] [--iterations 4] [--fraction 0.5]
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch

from chunk_offload import CpuStreams, OffloadConfig, OffloadManager
from chunk_offload.core import ActionKind
from chunk_offload.devkit.slow_link import LAYOUT, LINK, UNIT, chain, register
from chunk_offload.integrations.budgets import Budgets
from chunk_offload.schedule import Plan, choose_offload, megatron_plan

__all__ = ["main"]


@dataclass(frozen=True)
class Config:
    pp_size: int
    pp_rank: int
    microbatches: int
    offload_bytes_per_s: float
    reload_bytes_per_s: float


CONFIGS = {
    "pp1": Config(1, 0, 4, 1e9, LINK),
    "pp2": Config(2, 0, 4, 1e9, LINK),
    "pp4": Config(4, 0, 6, 26e6, 26e6),
    "pp4_last": Config(4, 3, 6, 26e6, 26e6),
}
"""Stage, microbatches and link rates (bytes/s to host and back) of each configuration."""


def train(plan: Plan, iterations: int, budgets: Budgets | None, config: Config):
    """The chain trained over ``plan``'s actions; the last iteration's gradients and record (None without budgets)."""
    torch.manual_seed(0)
    inputs = [torch.linspace(-1.0, 1.0, UNIT) + m for m in range(config.microbatches)]
    model = chain()
    manager = None
    if budgets is not None:
        streams = CpuStreams(link_bytes_per_s=config.offload_bytes_per_s, reload_link_bytes_per_s=config.reload_bytes_per_s)
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=streams)
        register(manager, model)
        manager.schedule_policy = budgets.policy(plan)
    try:
        for iteration in range(iterations):
            for p in model.parameters():
                p.grad = None
            losses: dict[int, torch.Tensor] = {}
            with manager.iteration(offload=iteration > 0) if manager else contextlib.nullcontext():
                for action in plan.actions:
                    if action.kind is ActionKind.FORWARD:
                        with manager.chunk(microbatch=action.microbatch) if manager else contextlib.nullcontext():
                            losses[action.microbatch] = model(inputs[action.microbatch]).square().mean()
                    else:
                        losses.pop(action.microbatch).backward()
            if manager is not None:
                policy = budgets.after_iteration(plan, manager.last_iteration, manager.schedule_policy, pp_rank=plan.pp_rank)
                if policy is not None:
                    manager.schedule_policy = policy
        return [p.grad.clone() for p in model.parameters()], manager.last_iteration if manager else None
    finally:
        if manager is not None:
            manager.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="compute wait on reloads under a device budget: one group ahead against the timed choice")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--iterations", type=int, default=4, help="iterations per run, the first a baseline (>= 3)")
    parser.add_argument("--fraction", type=float, default=0.5, help="budget: lowest peak + fraction x (peak without offload - lowest), in [0, 1]")
    args = parser.parse_args(argv)
    if args.iterations < 3:
        parser.error(f"--iterations must be an integer >= 3 (a baseline, a first timed iteration, one under the timed choice), got {args.iterations}")
    if not 0.0 <= args.fraction <= 1.0:
        parser.error(f"--fraction must be in [0, 1], got {args.fraction}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = {0: [4 * UNIT * k for k in LAYOUT]}
    print(f"{'config':<10}{'run':<14}{'budget':>10}{'peak':>10}{'copied':>11}{'wait ms':>9}  grads equal")
    for name in args.configs:
        config = CONFIGS[name]
        plan = megatron_plan(pp_size=config.pp_size, pp_rank=config.pp_rank, num_microbatches=config.microbatches)
        everything = choose_offload(plan, sizes, 0)
        budget = int(everything.lowest_peak_bytes + args.fraction * (everything.baseline_peak_bytes - everything.lowest_peak_bytes))
        reference, _ = train(plan, args.iterations, None, config)
        waits = []
        for timed in (False, True):
            budgets = Budgets(device_budget_bytes=budget, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=None, timed_reload_ahead=timed)
            grads, record = train(plan, args.iterations, budgets, config)
            wait = sum(g.wait_time_s for g in record.groups.values())
            copied = sum(g.bytes_offloaded for g in record.groups.values())
            waits.append(wait)
            equal = all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))
            run = "timed" if timed else "one ahead"
            print(f"{name:<10}{run:<14}{budget:>10}{record.peak_resident_bytes:>10}{copied:>11}{wait * 1e3:>9.1f}  {'yes' if equal else 'NO'}")
        ratio = waits[0] / waits[1] if waits[1] > 0 else float("inf")
        print(f"{name:<10}one ahead / timed wait: {ratio:.1f}")


if __name__ == "__main__":
    main()
