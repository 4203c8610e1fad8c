"""Host-side cost of the offload bookkeeping per group, against plain autograd.

A stack of tiny layers (so that compute is negligible) runs forward + backward
``--repeats`` times in three modes in one process:

- plain: no manager;
- bookkeeping: every layer is an offload group, copies switched off (``offload=False``):
  hooks, group start/commit functions, saved-tensor packing, accounting;
- offload: the same with copies on (CPU worker-thread streams here, CUDA streams on a GPU).

It prints, per mode, the median and the fastest time per iteration and the extra microseconds
per group ((mode - plain) / groups) from both, as measured on this machine. On a shared host the
medians move with the load; the fastest iterations are the steadier estimate of the cost itself.

    python bench/overhead.py [--layers 200] [--repeats 30] [--hidden 64]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import nn

import chunk_offload


def build(layers: int, hidden: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)]).to(device)


def time_mode(model: nn.Sequential, x: torch.Tensor, manager: chunk_offload.OffloadManager | None, repeats: int) -> tuple[float, float]:
    """(median, fastest) seconds per iteration over ``repeats`` iterations after 3 warm-up ones."""
    if manager is not None:
        for layer in model:
            manager.offload_module(layer, "layer")
    samples = []
    for i in range(repeats + 3):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with manager.iteration() if manager else contextlib.nullcontext():
            with manager.chunk(microbatch=0) if manager else contextlib.nullcontext():
                loss = model(x).sum()
            loss.backward()
        if manager is not None:
            manager.streams.synchronize()
        if x.is_cuda:
            torch.cuda.synchronize()
        if i >= 3:  # warm-up: pool allocation, autograd caches
            samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description="offload bookkeeping cost per group")
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.hidden, device=device)

    plain = time_mode(build(args.layers, args.hidden, device), x, None, args.repeats)
    bookkeeping_mgr = chunk_offload.OffloadManager(chunk_offload.OffloadConfig(min_offload_bytes=1, offload=False, measure_time=False))
    bookkeeping = time_mode(build(args.layers, args.hidden, device), x, bookkeeping_mgr, args.repeats)
    offload_mgr = chunk_offload.OffloadManager(chunk_offload.OffloadConfig(min_offload_bytes=1, measure_time=False))
    offload = time_mode(build(args.layers, args.hidden, device), x, offload_mgr, args.repeats)
    groups = args.layers
    saved = offload_mgr.stats().groups["layer"]
    print(f"device {device}, {groups} groups per iteration, {args.repeats} iterations per mode")
    print(f"tensors offloaded per group: {saved.tensors_offloaded / saved.groups:.1f}")
    print(f"{'mode':<12} {'median ms/iter':>15} {'us/group over plain':>20} {'fastest ms/iter':>16} {'us/group over plain':>20}")
    for name, (median, fastest) in (("plain", plain), ("bookkeeping", bookkeeping), ("offload", offload)):
        print(
            f"{name:<12} {median * 1e3:>15.3f} {(median - plain[0]) / groups * 1e6:>20.2f} "
            f"{fastest * 1e3:>16.3f} {(fastest - plain[1]) / groups * 1e6:>20.2f}"
        )
    bookkeeping_mgr.close()
    offload_mgr.close()


if __name__ == "__main__":
    main()
