"""Measured gain of plan-driven prefetch over reloading at group start, on a simulated host link.

The CPU copy streams take ``bytes / link rate`` seconds per copy (``CpuStreams(link_bytes_per_s=...)``),
so copies cost what a slow link would, while compute is the real CPU compute of the stage. The
stage replay (`chunk_offload.replay`) runs stage 0 of a PP=4 GPT job (megatron's 1F1B plan, real
megatron-core chunks, synthetic received gradients) three ways in one process:

- no offload (the replay's baseline iterations);
- offload, each group reloaded when backward reaches the group after it (the default policy);
- offload, reloads started from the plan (``schedule_policy=PlanPolicy(plan)``): a chunk's
  groups are brought back while the actions before its backward still run;
- with ``--reload-ahead-mib``, a fourth way: the plan-driven policy that also keeps up to that
  many MiB of a chunk's earlier groups reloading ahead of its running group (a large group
  behind small ones then starts its copy early).

It prints, per way, the time compute waited on copies and the step time (medians over
``--iterations``), and the ratios of plan-driven to group-start. Measured figures only.

    python bench/prefetch.py [--link-gbps 0.5] [--hidden 256] [--seq 256] [--iterations 2] [--prefetch-mib 8]
        [--modules attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,mlp_fc1 --reload-ahead-mib 16]
"""

from __future__ import annotations

import argparse

import torch

from chunk_offload import CpuStreams, OffloadConfig
from chunk_offload.devkit.gpt import GPTShape
from chunk_offload.replay import megatron_stage, replay
from chunk_offload.schedule import PlanPolicy

_MODULES = "core_attn,qkv_linear"  # a chunk's last group (core_attn) is its largest: what prefetch hides


def main() -> None:
    parser = argparse.ArgumentParser(description="plan-driven prefetch against reload at group start (simulated link)")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8, help="of the whole model (layers per stage: layers / pp)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--modules", default=_MODULES)
    parser.add_argument("--link-gbps", type=float, default=0.5, help="simulated host link, GB/s")
    parser.add_argument("--iterations", type=int, default=2, help="measured iterations per mode (medians)")
    parser.add_argument("--prefetch-mib", type=float, default=None, help="PlanPolicy prefetch budget per chunk (default: its last group)")
    parser.add_argument("--reload-ahead-mib", type=float, default=None, help="also run PlanPolicy(reload_ahead_bytes=...)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (compute)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = GPTShape(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=max(1, args.hidden // 64),
        vocab_size=1024,
        seq_length=args.seq,
        micro_batch_size=args.micro_batch_size,
    )
    link = args.link_gbps * 1e9
    with megatron_stage(shape, pp_size=args.pp, pp_rank=args.stage) as stage:
        plan = stage.plan(args.microbatches)
        runs = {}
        prefetch = None if args.prefetch_mib is None else int(args.prefetch_mib * 2**20)
        policies = [("reload at group start", None), ("plan-driven prefetch", PlanPolicy(plan, prefetch_bytes=prefetch))]
        if args.reload_ahead_mib is not None:
            ahead = int(args.reload_ahead_mib * 2**20)
            policies.append(("plan + reload ahead", PlanPolicy(plan, prefetch_bytes=prefetch, reload_ahead_bytes=ahead)))
        for name, policy in policies:
            runs[name] = replay(
                stage,
                modules=args.modules,
                plan=plan,
                iterations=args.iterations,
                streams=CpuStreams(link_bytes_per_s=link),
                schedule_policy=policy,
                config=OffloadConfig(min_offload_bytes=1),
            )
    group_start, planned = runs["reload at group start"], runs["plan-driven prefetch"]
    print(
        f"{group_start.stage} of a {args.layers}-layer GPT (hidden {args.hidden}, seq {args.seq}, micro batch "
        f"{args.micro_batch_size}), {args.microbatches} microbatches, {plan.source}; modules {args.modules}"
    )
    print(f"simulated link {args.link_gbps} GB/s; {group_start.offload.bytes_offloaded / 2**20:.1f} MiB offloaded per iteration")
    print(f"plan: {plan.format()}")
    # Each policy runs in its own replay, with its own no-offload iterations interleaved with
    # the offload ones: "step / no offload" compares within one replay, whatever else the
    # host runs meanwhile.
    print(f"{'':<24}{'wait (ms)':>11}{'step (ms)':>11}{'no offload (ms)':>17}{'step / no offload':>19}{'drop (MiB)':>12}")
    for name, result in runs.items():
        o, base = result.offload, result.baseline
        print(
            f"{name:<24}{o.wait_time_s * 1e3:>11.1f}{o.step_time_s * 1e3:>11.1f}{base.step_time_s * 1e3:>17.1f}"
            f"{result.step_time_ratio:>19.3f}{result.measured_drop / 2**20:>12.2f}"
        )
    a, b = group_start, planned
    wait_ratio = b.offload.wait_time_s / a.offload.wait_time_s if a.offload.wait_time_s else float("nan")
    print(
        f"plan-driven / group-start: wait {wait_ratio:.3f}, step {b.offload.step_time_s / a.offload.step_time_s:.3f}, "
        f"step / no offload {b.step_time_ratio / a.step_time_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
