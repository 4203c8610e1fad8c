"""Host-side cost of the offload bookkeeping per group, against plain autograd and the floor.

A stack of tiny layers (so that compute is negligible) runs forward + backward
``--repeats`` times in eight modes in one process:

- plain: no manager;
- floor: what any saved-tensor-hook design pays per group: each layer's call enters a
  ``saved_tensors_hooks`` context with identity pack/unpack (a forward pre-hook) and leaves
  it through one identity autograd Function on the layer's output (a forward hook);
- bookkeeping: every layer is an offload group (``group_by="module"``), copies switched off (``offload=False``):
  module hooks, group start/commit and the gradient hook on its output, saved-tensor packing
  with the policy and in-place checks, accounting;
- offload: the same with copies on (CPU worker-thread streams here, CUDA streams on a GPU);
- offload_layer: the same with ``OffloadConfig(group_by="layer")``, each ``--modules-per-layer``
  consecutive layers registered with one layer, so they form one group (NOTE [Layer groups] in
  core/marks.py): its copies, events and stream switches are issued once per layer;
- offload_inline: the offload mode's groups and copies through `InlineStreams`
  (bench/_inline_streams.py), which run each copy at once on the calling thread's stream: the
  engine's own offload work and the copies' calls, without the copy streams' machinery (worker
  threads on CPU; stream switches, events and stream waits on CUDA). offload - offload_inline is
  what the streams cost per group;
- offload_unslabbed: the offload mode with ``group_slab_bytes=0``: a host buffer, a device buffer and
  a copy back per storage instead of one per group (NOTE [Group slabs] in core/slab.py).
  offload_unslabbed - offload is what slabs save per group;
- offload_timed: the offload mode with ``measure_time=True``, the training default (every other
  mode runs without it): copy and wait times (three more timing events per group on CUDA) and a
  device sync at each end of the iteration. offload_timed - offload is what timing costs per group.

The modes take turns, one iteration each, so that a change of the host's load hits all of
them alike. It prints, per mode, the median and the fastest time per iteration and the extra
microseconds per group ((mode - plain) / groups) from both, then bookkeeping / floor and
copies / floor (copies: the offload mode), the ratios of those extra costs, and offload / bookkeeping
for the three offload modes ("group" is one module call throughout, also in layer groups). On a shared host
the medians move with the load; the fastest iterations are the steadier estimate of the cost.
Last, per mode, the objects one iteration leaves in reference cycles, per group: what only a
garbage collection frees (host time no profile shows as a function's own).

``--profile N`` then runs N more iterations of the offload and the bookkeeping modes under
cProfile and prints the functions whose own host time the copies add most, per group (offload
over bookkeeping): where the offload path's extra cost goes (backward on the calling thread, where
cProfile sees it: `chunk_offload.devkit.host_profile`); on CUDA then N more of both under
torch.profiler, for the CUDA API calls (copies, events, stream waits, allocations) the copies add
per group. On CPU the offload mode profiled is offload_inline: the CPU streams' worker threads
take the GIL from the calling thread mid-call, which cProfile counts in whatever function was
running (a ``detach`` of 70 us), while the engine's own path is what a CUDA host runs too.

    python bench/overhead.py [--layers 200] [--modules-per-layer 5] [--repeats 30] [--hidden 64] [--batch 4] [--profile 0]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import chunk_offload
from chunk_offload.devkit.host_profile import api_times, format_rows, over, own_times

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _inline_streams import InlineStreams  # noqa: E402  (this bench's backend)

__all__ = ["main"]

MODES = ("plain", "floor", "bookkeeping", "offload", "offload_layer", "offload_inline", "offload_unslabbed", "offload_timed")
WARMUP = 3  # iterations before timing: pool allocation, autograd caches


def build(layers: int, hidden: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)]).to(device)


def register(manager: chunk_offload.OffloadManager, model: nn.Sequential, modules_per_layer: int) -> None:
    """Each layer of ``model`` an offload module; each ``modules_per_layer`` consecutive ones share
    a layer (one group under ``group_by="layer"``; the last may hold fewer): the first of them stands for it."""
    for i, module in enumerate(model):
        manager.offload_module(module, "layer", layer=model[i - i % modules_per_layer])


class _Identity(torch.autograd.Function):
    """The one autograd node per group that any design needs to act when backward reaches the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def install_floor(model: nn.Sequential) -> None:
    """Make each layer a floor group: identity saved-tensor hooks around it, an identity Function after it."""
    for layer in model:
        contexts: list[saved_tensors_hooks] = []

        def pre(module, args, contexts=contexts):
            hooks = saved_tensors_hooks(_identity, _identity)
            hooks.__enter__()
            contexts.append(hooks)

        def post(module, args, output, contexts=contexts):
            contexts.pop().__exit__(None, None, None)
            return _Identity.apply(output)

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)


def one_iteration(model: nn.Sequential, x: torch.Tensor, manager: chunk_offload.OffloadManager | None) -> float:
    """Seconds of one forward + backward (and the copies it issued)."""
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
    return time.perf_counter() - start


def time_modes(runs: dict[str, tuple[nn.Sequential, chunk_offload.OffloadManager | None]], x: torch.Tensor, repeats: int) -> dict[str, tuple[float, float]]:
    """(median, fastest) seconds per iteration of each mode.

    The modes take turns, one iteration each, so that a change of the host's load during the
    run hits every mode alike; the first `WARMUP` turns are not timed.
    """
    samples: dict[str, list[float]] = {mode: [] for mode in runs}
    for turn in range(repeats + WARMUP):
        for mode, (model, manager) in runs.items():
            seconds = one_iteration(model, x, manager)
            if turn >= WARMUP:
                samples[mode].append(seconds)
    return {mode: (statistics.median(s), min(s)) for mode, s in samples.items()}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a usage error otherwise)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="offload bookkeeping cost per group, against plain autograd and the floor")
    parser.add_argument("--layers", type=positive_int, default=200, help="layers, one group each")
    parser.add_argument("--modules-per-layer", type=positive_int, default=5, help="layers per group in the offload_layer mode")
    parser.add_argument("--hidden", type=positive_int, default=64)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed iterations per mode")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more offload iterations (0: none)")
    args = parser.parse_args(argv)
    if args.profile < 0:
        parser.error(f"--profile: must be an integer >= 0, got {args.profile}")
    return args


def print_profile(runs: dict[str, tuple[nn.Sequential, chunk_offload.OffloadManager | None]], *, x: torch.Tensor, iterations: int,
                  groups: int) -> None:  # fmt: skip
    """The host time the offload mode (on CPU offload_inline) adds over bookkeeping by function (own
    time, cProfile), in microseconds per group; on CUDA also the CUDA API calls it adds (torch.profiler)."""

    def work(mode: str) -> Callable[[], None]:
        def iterations_of_mode() -> None:
            for _ in range(iterations):
                one_iteration(runs[mode][0], x, runs[mode][1])

        return iterations_of_mode

    offload = "offload" if torch.cuda.is_available() else "offload_inline"  # CPU: no worker thread takes the GIL mid-call
    print(f"profile of the {offload} mode over bookkeeping, {iterations} iterations each: the own host time per group (us) and "
          "calls per group that the copies add, by function")  # fmt: skip
    added = over(own_times(work(offload))[0], own_times(work("bookkeeping"))[0])
    print("\n".join(format_rows(added, iterations * groups, top=25)))
    if not torch.cuda.is_available():
        print("CUDA API calls (torch.profiler): none without CUDA")
        return
    added = over(api_times(work("offload")), api_times(work("bookkeeping")))
    print(f"CUDA API calls the offload mode adds over bookkeeping, {iterations} iterations (torch.profiler): host us per group, calls per group")
    print("\n".join(format_rows(added, iterations * groups, top=12)))


def cyclic_objects(model: nn.Sequential, x: torch.Tensor, manager: chunk_offload.OffloadManager | None) -> int:
    """Objects one iteration leaves in reference cycles: freed only by a garbage collection, each of
    them host time (traversals) that no function's profile shows as its own."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        one_iteration(model, x, manager)
        gc.collect()
        return len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.hidden, device=device)

    def manager(streams: chunk_offload.StreamBackend | None = None, *, measure_time: bool = False, **options: object) -> chunk_offload.OffloadManager:
        # Module groups but in offload_layer: every layer one group, what the per-group figures count.
        config = chunk_offload.OffloadConfig(min_offload_bytes=1, measure_time=measure_time, **({"group_by": "module"} | options))
        return chunk_offload.OffloadManager(config, streams=streams)

    bookkeeping_mgr, offload_mgr, layer_mgr = manager(offload=False), manager(), manager(group_by="layer")
    managers = {"plain": None, "floor": None, "bookkeeping": bookkeeping_mgr, "offload": offload_mgr, "offload_layer": layer_mgr,
                "offload_inline": manager(InlineStreams(device)), "offload_unslabbed": manager(group_slab_bytes=0),
                "offload_timed": manager(measure_time=True)}  # fmt: skip
    runs = {}
    for mode in MODES:
        model = build(args.layers, args.hidden, device)
        if mode == "floor":
            install_floor(model)
        elif managers[mode] is not None:
            register(managers[mode], model, args.modules_per_layer)
        runs[mode] = (model, managers[mode])
    try:
        times = time_modes(runs, x, args.repeats)
        cyclic = {mode: cyclic_objects(runs[mode][0], x, runs[mode][1]) for mode in MODES}
        saved = offload_mgr.stats().groups["layer"]
        layer_groups = layer_mgr.stats().groups["layer"].groups
        if args.profile:
            print_profile(runs, x=x, iterations=args.profile, groups=args.layers)
    finally:
        for mgr in managers.values():
            if mgr is not None:
                mgr.close()
    groups = args.layers
    plain = times["plain"]
    extra = {mode: tuple((t - p) / groups for t, p in zip(times[mode], plain)) for mode in MODES}
    print(f"device {device}, {groups} groups per iteration, {args.repeats} iterations per mode")
    print(f"tensors offloaded per group: {saved.tensors_offloaded / saved.groups:.1f}; offload_layer: {layer_groups / saved.groups:.2f} groups per module group")
    print(f"{'mode':<17} {'median ms/iter':>15} {'us/group over plain':>20} {'fastest ms/iter':>16} {'us/group over plain':>20}")
    for mode in MODES:
        (median, fastest), (extra_median, extra_fastest) = times[mode], extra[mode]
        print(f"{mode:<17} {median * 1e3:>15.3f} {extra_median * 1e6:>20.2f} {fastest * 1e3:>16.3f} {extra_fastest * 1e6:>20.2f}")
    for mode, label in (("bookkeeping", "bookkeeping"), ("offload", "copies")):
        ratios = [e / f if f > 0 else float("nan") for e, f in zip(extra[mode], extra["floor"])]
        print(f"{label} / floor (us/group over plain): {ratios[1]:.2f} fastest, {ratios[0]:.2f} median")
    for mode in ("offload", "offload_layer", "offload_inline", "offload_unslabbed", "offload_timed"):
        ratios = [e / b if b > 0 else float("nan") for e, b in zip(extra[mode], extra["bookkeeping"])]
        print(f"{mode} / bookkeeping (us/group over plain): {ratios[1]:.2f} fastest, {ratios[0]:.2f} median")
    for label, more, less in (("copy streams' machinery", "offload", "offload_inline"), ("group slabs' saving", "offload_unslabbed", "offload"),
                              ("timing", "offload_timed", "offload")):  # fmt: skip
        added = [(m - l) * 1e6 for m, l in zip(extra[more], extra[less])]
        print(f"{label} ({more} - {less}, us/group): {added[1]:.2f} fastest, {added[0]:.2f} median")
    print("objects left in reference cycles per group and iteration (freed only by the garbage collector): "
          + ", ".join(f"{mode} {cyclic[mode] / groups:.2f}" for mode in MODES))


if __name__ == "__main__":
    main()
