"""Pinned host <-> device copy bandwidth of this machine's link: the denominator of every ratio.

Copies between a pinned host buffer and a device buffer, issued on a side stream (the copy
engines' path, as the offload streams use it) and timed with CUDA events on that stream, for
several sizes: device to host (D2H, what offload does), host to device (H2D, reload), and both
at once on two streams (duplex: an offload overlapping a reload). Each size and direction is
copied ``--repeats`` times after one warm-up copy; the median and the best GB/s (1e9 bytes/s)
are printed and, with ``--json``, written out. Without CUDA it prints that it skipped and exits 0.

    python bench/bandwidth.py [--sizes-mib 16,64,256,1024] [--repeats 10] [--json out/bandwidth.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

__all__ = ["main", "gigabytes_per_s"]

DIRECTIONS = ("d2h", "h2d", "duplex")


def gigabytes_per_s(nbytes: int, seconds: float) -> float:
    """Bytes per second in GB/s (1e9 bytes)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _timed(stream: torch.cuda.Stream, copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]) -> float:
    """Seconds from a start event on ``stream`` to the end of every copy (each on its own stream)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for side, dst, src in copies:
        side.wait_event(start)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        if side is not stream:
            stream.wait_stream(side)
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure(nbytes: int, repeats: int) -> dict[str, dict[str, float]]:
    """GB/s per direction for copies of ``nbytes``: {direction: {median_gbps, best_gbps, ...}}."""
    device = torch.device("cuda", torch.cuda.current_device())
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.full((nbytes,), 7, dtype=torch.uint8).pin_memory()
    dev_in = torch.full((nbytes,), 3, dtype=torch.uint8, device=device)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if not (host_out.is_pinned() and host_in.is_pinned()):
        raise RuntimeError("host buffers are not pinned: the copies would not be asynchronous")
    d2h, h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
    for side in (d2h, h2d):  # the side streams see the buffers' initialisation
        side.wait_stream(torch.cuda.current_stream(device))
    plans = {
        "d2h": (nbytes, [(d2h, host_out, dev_in)]),
        "h2d": (nbytes, [(h2d, dev_out, host_in)]),
        "duplex": (2 * nbytes, [(d2h, host_out, dev_in), (h2d, dev_out, host_in)]),
    }
    results = {}
    for direction in DIRECTIONS:
        moved, copies = plans[direction]
        _timed(d2h, copies)  # warm-up
        seconds = [_timed(d2h, copies) for _ in range(repeats)]
        results[direction] = {
            "bytes": moved,
            "median_s": statistics.median(seconds),
            "best_s": min(seconds),
            "median_gbps": gigabytes_per_s(moved, statistics.median(seconds)),
            "best_gbps": gigabytes_per_s(moved, min(seconds)),
        }
    torch.cuda.synchronize(device)
    if not (torch.equal(host_out[:64], dev_in[:64].cpu()) and torch.equal(dev_out[:64].cpu(), host_in[:64])):
        raise RuntimeError("the copied bytes differ from their source")
    return results


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated integers (MiB), got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1 MiB, got {text!r}")
    return sizes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pinned host <-> device copy bandwidth (side stream, CUDA events)")
    parser.add_argument("--sizes-mib", type=_sizes, default=[16, 64, 256, 1024], help="copy sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=_positive, default=10, help="timed copies per size and direction")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: folder {str(args.json.parent)!r} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        print("bandwidth: skipped, CUDA is not available")
        summary["skipped"] = "CUDA is not available"
    else:
        summary["device"] = torch.cuda.get_device_name()
        summary["results"] = []
        print(f"device {summary['device']}, torch {torch.__version__}, CUDA {torch.version.cuda}, {args.repeats} copies each")
        print(f"{'MiB':>6} {'direction':>9} {'median GB/s':>12} {'best GB/s':>10}")
        for mib in args.sizes_mib:
            for direction, row in measure(mib << 20, args.repeats).items():
                summary["results"].append({"mib": mib, "direction": direction, **row})
                print(f"{mib:>6} {direction:>9} {row['median_gbps']:>12.2f} {row['best_gbps']:>10.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
