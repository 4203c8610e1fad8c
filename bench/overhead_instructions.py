"""`bench/overhead.py` counted in CPU instructions under valgrind: a noise-free host cost per group.

Wall-clock times on a shared host move by 10% from run to run, more than most changes to the
engine's hot path. Instructions executed do not depend on the host's load: each mode of
`bench/overhead.py` but offload_inline (each offload mode here copies inline) runs in its own
process under ``valgrind --tool=callgrind``, which counts instructions only while the iterations run
(switched on and off around them with ``callgrind_control``, after warm-up, with Python's
garbage collector paused so that a collection does not land in one mode's window only). One
iteration's count is the difference between a run of ``--iterations + 1`` iterations and a run
of one, which cancels the switching itself. It prints instructions per group over plain
autograd and the ratios bookkeeping / floor and copies / floor, like `bench/overhead.py`, and
offload / bookkeeping for each offload mode counted (offload_layer: layer groups of
``--modules-per-layer`` modules, NOTE [Layer groups]; instructions per module throughout). Its
offload modes copy through `InlineStreams` (bench/_inline_streams.py, as `bench/overhead.py`'s
offload_inline mode does): the engine's host path without the CPU backend's worker threads, whose
hand-offs are not what a CUDA host pays. Instructions are a proxy for time (cache misses are not counted); each mode takes about a
minute under valgrind.

    python bench/overhead_instructions.py [--layers 200] [--iterations 2] [--modules-per-layer 5] [--modes plain floor bookkeeping]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the bench this one counts)
from _inline_streams import InlineStreams  # noqa: E402  (the offload modes' backend here)

__all__ = ["main"]

MODES = tuple(mode for mode in overhead.MODES if mode != "offload_inline")  # every offload mode here runs inline
NEEDED = ("plain", "floor")  # every ratio is over plain autograd and against the floor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="offload bookkeeping cost per group in CPU instructions (valgrind)")
    parser.add_argument("--layers", type=overhead.positive_int, default=200, help="layers, one group each")
    parser.add_argument("--iterations", type=overhead.positive_int, default=2, help="iterations counted per mode")
    parser.add_argument("--modules-per-layer", type=overhead.positive_int, default=5, help="layers per group in the offload_layer mode")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["plain", "floor", "bookkeeping"])
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # one counted process
    parser.add_argument("--count", type=overhead.positive_int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for mode in NEEDED:
        if mode not in args.modes:
            args.modes.insert(NEEDED.index(mode), mode)
    return args


def run_child(mode: str, layers: int, count: int, modules_per_layer: int) -> None:
    """Build ``mode`` as `bench/overhead.py` does, warm it up, count ``count`` iterations."""
    import chunk_offload

    torch.set_num_threads(1)
    x = torch.randn(4, 64)
    model = overhead.build(layers, 64, torch.device("cpu"))
    manager = None
    if mode == "floor":
        overhead.install_floor(model)
    elif mode != "plain":
        copies = mode != "bookkeeping"
        config = chunk_offload.OffloadConfig(
            min_offload_bytes=1, offload=copies, measure_time=mode == "offload_timed", group_by="layer" if mode == "offload_layer" else "module",
            **({"group_slab_bytes": 0} if mode == "offload_unslabbed" else {}),
        )
        manager = chunk_offload.OffloadManager(config, streams=InlineStreams(torch.device("cpu")) if copies else None)
        overhead.register(manager, model, modules_per_layer)
    for _ in range(overhead.WARMUP):
        overhead.one_iteration(model, x, manager)
    gc.collect()
    gc.disable()
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "--instr=on", pid], check=True, capture_output=True)
    for _ in range(count):
        overhead.one_iteration(model, x, manager)
    subprocess.run(["callgrind_control", "--instr=off", pid], check=True, capture_output=True)
    if manager is not None:
        manager.close()


def count_instructions(mode: str, layers: int, count: int, modules_per_layer: int, workdir: str) -> int:
    """Instructions callgrind counted for ``count`` iterations of ``mode`` (plus the switching)."""
    out = os.path.join(workdir, f"callgrind.{mode}.{count}")
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        sys.executable, __file__, "--child", mode, "--layers", str(layers), "--count", str(count),
        "--modules-per-layer", str(modules_per_layer),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"valgrind run of mode {mode!r} failed:\n{done.stderr[-2000:]}")
    for line in Path(out).read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals line in {out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        run_child(args.child, args.layers, args.count, args.modules_per_layer)
        return 0
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"skipped: {', '.join(missing)} not found (install valgrind to count instructions)")
        return 0
    with tempfile.TemporaryDirectory() as workdir, ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            (mode, count): pool.submit(count_instructions, mode, args.layers, count, args.modules_per_layer, workdir)
            for mode in args.modes
            for count in (1, args.iterations + 1)
        }
        per_iteration = {
            mode: (runs[mode, args.iterations + 1].result() - runs[mode, 1].result()) / args.iterations for mode in args.modes
        }
    groups = args.layers
    extra = {mode: (per_iteration[mode] - per_iteration["plain"]) / groups for mode in args.modes}
    print(f"{groups} groups per iteration, {args.iterations} iterations counted per mode, garbage collector paused")
    print(f"{'mode':<17} {'instructions/iter':>18} {'per group over plain':>21}")
    for mode in args.modes:
        print(f"{mode:<17} {per_iteration[mode]:>18,.0f} {extra[mode]:>21,.0f}")
    for mode, label in (("bookkeeping", "bookkeeping"), ("offload", "copies")):
        if mode in extra:
            print(f"{label} / floor (instructions per group over plain): {extra[mode] / extra['floor']:.3f}")
    for mode in ("offload", "offload_layer", "offload_unslabbed"):
        if mode in extra and "bookkeeping" in extra:
            print(f"{mode} / bookkeeping (instructions per group over plain): {extra[mode] / extra['bookkeeping']:.3f}")
    if "offload" in extra and "offload_unslabbed" in extra:
        print(f"group slabs' saving (offload_unslabbed - offload, instructions per group): {extra['offload_unslabbed'] - extra['offload']:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
