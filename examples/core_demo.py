"""Offload a small transformer's activations under a 1F1B microbatch order, and check it.

Runs the same training twice in one process, without and with an `OffloadManager`, on
whatever device is present (CPU worker-thread copy streams without a GPU), and prints every
loss with full precision, whether losses and gradients are bit-identical, per-module offload
statistics, and the drop of the device-resident saved-bytes high-water mark against the drop
the plan predicts (`chunk_offload.schedule.simulate`; R = 1 when the engine does what the plan
says). The offload run uses the plan-driven policy (`PlanPolicy`).

    python examples/core_demo.py [--layers 4] [--microbatches 8] [--stages 4] [--iterations 3]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

import chunk_offload
from chunk_offload.schedule import Plan, PlanPolicy, simulate

MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")


class CoreAttention(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, t, three_h = qkv.shape
        q, k, v = qkv.view(b, t, 3, self.heads, three_h // (3 * self.heads)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, three_h // 3)


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden)
        self.qkv_linear = nn.Linear(hidden, 3 * hidden, bias=False)
        self.core_attn = CoreAttention(heads)
        self.attn_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.mlp_fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.mlp_fc2 = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_proj(self.core_attn(self.qkv_linear(self.attn_norm(x))))
        return x + self.mlp_fc2(F.silu(self.mlp_fc1(self.mlp_norm(x))))


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The forward/backward order of one stage under non-interleaved 1F1B."""
    warmup = min(stages - stage - 1, microbatches)
    order = [("F", m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", m) for m in range(microbatches - warmup, microbatches)]
    return order


def train(args, device: torch.device, manager: chunk_offload.OffloadManager | None):
    torch.manual_seed(args.seed)
    model = nn.Sequential(*[Layer(args.hidden, args.heads) for _ in range(args.layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if manager is not None:
        for layer in model:
            for name in MODULES:
                manager.offload_module(getattr(layer, name), name)
    g = torch.Generator().manual_seed(args.seed + 1)
    data = [torch.randn(args.micro_batch_size, args.seq_length, args.hidden, generator=g).to(device) for _ in range(args.microbatches)]
    order = one_f_one_b(args.stage, args.stages, args.microbatches)
    losses, grads = [], []
    for _ in range(args.iterations):
        optimizer.zero_grad(set_to_none=True)
        pending: dict[int, torch.Tensor] = {}
        with manager.iteration() if manager else contextlib.nullcontext():
            for kind, m in order:
                if kind == "F":
                    with manager.chunk(microbatch=m) if manager else contextlib.nullcontext():
                        pending[m] = model(data[m]).float().pow(2).mean() / args.microbatches
                else:
                    loss = pending.pop(m)
                    loss.backward()
                    losses.append(loss.detach())
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages the order is taken from")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--min-offload-bytes", type=int, default=16 * 1024)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    print(f"device: {device}; order of stage {args.stage} of {args.stages} with {args.microbatches} microbatches:")
    print("  " + " ".join(f"{k}{m}" for k, m in one_f_one_b(args.stage, args.stages, args.microbatches)))

    plan = Plan.from_order([(k, m, 0) for k, m in one_f_one_b(args.stage, args.stages, args.microbatches)], source="1F1B")
    baseline_accounting = chunk_offload.OffloadManager(chunk_offload.OffloadConfig(min_offload_bytes=args.min_offload_bytes, offload=False))
    base_losses, base_grads, base_params = train(args, device, baseline_accounting)
    offload = chunk_offload.OffloadManager(chunk_offload.OffloadConfig(min_offload_bytes=args.min_offload_bytes), schedule_policy=PlanPolicy(plan))
    losses, grads, params = train(args, device, offload)

    print("\nloss per microbatch (no offload | offload):")
    for i, (a, b) in enumerate(zip(base_losses, losses)):
        print(f"  {i:3d}  {a.item()!r:>24} | {b.item()!r:<24}")
    identical = (
        all(torch.equal(a, b) for a, b in zip(base_losses, losses))
        and all(torch.equal(a, b) for ga, gb in zip(base_grads, grads) for a, b in zip(ga, gb))
        and all(torch.equal(a, b) for a, b in zip(base_params, params))
    )
    print(f"\nlosses, gradients and parameters bit-identical: {identical}")

    stats = offload.stats()
    print(f"\n{'module':<12} {'tensors':>8} {'MiB offloaded':>14} {'copy ms':>9} {'wait ms':>9}")
    for name, g in stats.groups.items():
        print(f"{name:<12} {g.tensors_offloaded:>8} {g.bytes_offloaded / 2**20:>14.3f} {g.copy_time_s * 1e3:>9.2f} {g.wait_time_s * 1e3:>9.2f}")
    base, last = baseline_accounting.last_iteration, offload.last_iteration  # the last iteration of each run
    drop = base.peak_resident_bytes - last.peak_resident_bytes
    theoretical = simulate(plan, base.group_bytes, policy=offload.schedule_policy).drop
    print("\ndevice-resident saved bytes of the offloaded modules, high-water mark (manager accounting, last iteration):")
    print(f"  without offload {base.peak_resident_bytes}  with offload {last.peak_resident_bytes}  measured drop {drop}")
    print(f"  predicted by the plan (theoretical drop) {theoretical}")
    if theoretical:
        print(f"  R = measured / theoretical drop = {drop / theoretical:.4f}")
    print(f"host pool: {stats.pool}")
    offload.close()
    baseline_accounting.close()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
