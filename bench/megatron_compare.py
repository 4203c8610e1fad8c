"""chunk-offload side by side with megatron-core's fine-grained activation offloading (issue 26).

One GPT on one device, trained through megatron's own no-pipelining schedule (PP=1,
``get_forward_backward_func()`` in a one-process world), which is how both offloads are meant
to be used. For each ``--modules`` set, three runs or more one after another, each on a fresh
build of the model from the same seed (so the same weights and inputs):

- none: no offload (one run, shown in every set: it offloads nothing, whatever the modules);
- chunk-offload: `chunk_offload.integrations.megatron.attach` with its defaults (at PP=1 every
  backward follows its forward at once: the default plan copies all but a chunk's last groups,
  NOTE [Kept tail] in chunk_offload/core/ordering.py);
- chunk-offload budget: the same with ``device_budget_bytes`` (``--budget-bytes``; default:
  megatron's measured peak for these modules on CUDA, i.e. the same memory, else half of
  chunk-offload's saved peak); with ``--timed-reload-ahead`` also ``timed_reload_ahead=True``
  (its chunks reload ahead by the timing where the predicted peak stays within the budget);
- chunk-offload reload-ahead (only with ``--reload-ahead-bytes``): the default run with that
  `PlanPolicy` reload-ahead budget (in backward, earlier groups are reloaded while their bytes fit);
- chunk-offload timed (only with ``--timed-reload-ahead``): the default run with
  ``timed_reload_ahead=True``: each chunk's reload-ahead budget from the copy timing its last
  iteration measured (NOTE [Timed reload ahead] in chunk_offload/core/ordering.py);
- chunk-offload layer (only with ``--layer-groups``): the default run with
  ``OffloadConfig(group_by="layer")``: each layer's offload modules one group, copied and
  reloaded together (NOTE [Layer groups] in chunk_offload/core/marks.py);
- megatron: megatron-core's built-in offload (``fine_grained_activation_offloading``, same
  modules, same minimum size), with a stand-in for Transformer Engine's flag where TE is
  missing (NOTE [ Transformer Engine stand-in ] in ``chunk_offload/replay/megatron_builtin.py``);
- none again (only with ``--none-again``): the run without offload once more, last: the
  overheads are then over the mean of both runs' median steps (and the faster of their fastest
  steps), and the two rows' own overheads show how far the host drifted during the set.

With ``--profile N``, once every run is timed, each run is built again and trains N steps under
cProfile, and the table is followed by what each run adds to the host time of a step over the
run without offload, by function (own time per layer call): where an engine's host path goes
(issue 26 item 4); on CUDA then N more under torch.profiler, for the CUDA runtime and driver
calls each run adds (copies, events, stream waits, allocations, synchronisations), which
cProfile sees only inside the Python calls that make them. The profiles come after the timed
runs so that no profiler's residue slows the times.

Each iteration is timed with the device synchronised before and after; the peak is
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less what was still
allocated before the run built its model (on CPU: chunk-offload's accounting of saved bytes,
n/a for the others); each row's ``wall_s`` in the JSON is the run's whole time, its build
included; the JSON is written after each module set too (``"complete": false`` until every set,
and the profiles, ran), so that a run a time limit stops leaves its finished sets. Losses are
those of the first measured iteration; grads those of the last; both are compared with
``torch.equal`` to the run without offload. On CUDA, flash attention's backward is
not deterministic, so grads may differ without any offload; the losses (forward only) are the
fair check there, or every run on deterministic kernels (``--deterministic``,
`chunk_offload.devkit.deterministic`; the step times are then those kernels').

    python bench/megatron_compare.py --layers 8 --hidden 4096 --heads 32 --seq 4096 --microbatches 4 \\
        --dtype bf16 --modules core_attn,qkv_linear --modules attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from chunk_offload.core.config import OffloadConfig
from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.devkit.deterministic import deterministic_kernels
from chunk_offload.devkit.gpt import ATTENTIONS, GPTShape, gpt_forward_step
from chunk_offload.devkit.host_profile import GcClock, api_times, engine_files, over, own_times
from chunk_offload.integrations.megatron import attach
from chunk_offload.module_names import canonical_modules
from chunk_offload.replay import megatron_builtin as builtin
from chunk_offload.replay.stage import device_bytes_left, megatron_stage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compare_text import format_profiles, format_table  # noqa: E402  (this bench's text)

__all__ = ["main", "parse_args"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RUNS = ("none", "chunk-offload", "chunk-offload budget", "chunk-offload reload-ahead", "chunk-offload timed", "chunk-offload layer", "megatron",
        "none again")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; usage errors exit with status 2."""
    p = argparse.ArgumentParser(prog="bench/megatron_compare.py", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per iteration")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="the whole model is cast to it")
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa", help="core attention (default sdpa)")
    p.add_argument("--modules", action="append", default=None, help="comma-separated offload modules; repeat for several sets")
    p.add_argument("--min-offload-bytes", type=int, default=1 << 20, help="saved tensors below this stay on device")
    p.add_argument("--budget-bytes", type=int, default=None, help="device budget of the budget run (default: see above)")
    p.add_argument("--reload-ahead-bytes", type=int, default=None, help="also run chunk-offload with this reload-ahead budget")
    p.add_argument("--timed-reload-ahead", action="store_true", help="also run chunk-offload with timed_reload_ahead=True")
    p.add_argument("--layer-groups", action="store_true", help="also run chunk-offload with group_by='layer'")
    p.add_argument("--none-again", action="store_true",
                   help="run 'none' again after each set's other runs; overheads over both (a drifting host shows)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N more steps per run: host time by function over 'none' (0: none)")
    p.add_argument("--iterations", type=int, default=4, help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations per run (megatron's offload needs >= 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--deterministic", action="store_true", help="every run on deterministic kernels: grads compare bit for bit on CUDA too")
    p.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    for flag in ("layers", "hidden", "heads", "seq", "micro_batch_size", "microbatches", "vocab", "iterations"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be an integer >= 1, got {getattr(args, flag)}")
    if args.warmup < 1:
        p.error(f"--warmup must be an integer >= 1 (megatron's offload warms up in its first iteration), got {args.warmup}")
    for flag in ("min_offload_bytes", "budget_bytes", "reload_ahead_bytes", "profile"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            p.error(f"--{flag.replace('_', '-')} must be an integer >= 0, got {value}")
    if args.hidden % args.heads:
        p.error(f"--hidden must be divisible by --heads ({args.heads}), got {args.hidden}")
    try:
        args.modules = [canonical_modules(m) for m in (args.modules or ["core_attn,qkv_linear"])]
    except ChunkOffloadError as e:
        p.error(f"--modules: {e}")
    return args


def _with_offload(stack: ExitStack, args: argparse.Namespace, model: torch.nn.Module, modules: list[str], run: str,
                  budget: int | None) -> tuple[Callable, Callable, Any, dict[int, tuple[Any, int]]]:  # fmt: skip
    """``run``'s offload around ``model``: (forward_backward_func, forward_step_func, manager or None,
    megatron's host copies seen in the current iteration); undone when ``stack`` closes."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward, manager, seen = get_forward_backward_func(), None, {}
    if run.startswith("chunk-offload"):
        config = OffloadConfig(min_offload_bytes=args.min_offload_bytes, group_by="layer" if run.endswith("layer") else "module")
        manager = attach([model], modules, config=config,
                         device_budget_bytes=budget if run.endswith("budget") else None,
                         reload_ahead_bytes=args.reload_ahead_bytes if run.endswith("reload-ahead") else None,
                         timed_reload_ahead=run.endswith("timed") or (run.endswith("budget") and args.timed_reload_ahead))  # fmt: skip
        stack.callback(manager.close)
        stack.callback(manager.detach)
        return manager.wrap(forward_backward), gpt_forward_step, manager, seen
    if run != "megatron":
        return forward_backward, gpt_forward_step, manager, seen
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off_interface,
    )

    stack.enter_context(builtin.te_cpu_offload_stand_in())
    stack.enter_context(builtin.megatron_offload_on_cpu())
    off_interface.reset_instance()  # megatron's manager is a process-wide singleton: start afresh
    stack.callback(off_interface.reset_instance)

    def step(data_iterator: Iterator, chunk: torch.nn.Module) -> Any:
        output = gpt_forward_step(data_iterator, chunk)
        builtin.collect_offloaded(seen)  # right after the chunk forward: every copy it made is held
        return output

    return forward_backward, step, manager, seen


def _run(args: argparse.Namespace, shape: GPTShape, modules: list[str], run: str, budget: int | None,
         *, profile: bool = False) -> dict[str, Any]:  # fmt: skip
    """One run: fresh model, warm-up, measured iterations through megatron's schedule; with
    ``profile``, the ``--profile`` steps instead of the measured iterations (`_add_profiles`)."""
    dtype = _DTYPES[args.dtype]
    overrides = builtin.builtin_config(modules, min_offload_bytes=args.min_offload_bytes, dtype=dtype) if run == "megatron" else None
    times, peaks, copied, waits, gc_clocks, losses = [], [], [], [], [], None
    started, left = time.perf_counter(), device_bytes_left()  # what earlier runs left: off the peak, onto the budget
    with ExitStack() as stack:
        stage = stack.enter_context(megatron_stage(shape, pp_size=1, pp_rank=0, seed=args.seed, config_overrides=overrides))
        # The whole model in the run's dtype (build_gpt_chunks' own dtype handling is being reworked).
        model = stage.chunks[0].to(dtype)
        cuda, device = stage.device.type == "cuda", stage.device
        # The budget is device memory this run's model and activations may take: over what is left.
        forward_backward, step, manager, seen = _with_offload(stack, args, model, modules, run, None if budget is None else budget + left)
        batches = stage.token_batches(args.microbatches, iteration=0)

        def train_step() -> list:
            model.zero_grad(set_to_none=False)
            seen.clear()
            with builtin.summary_to_log():
                store = forward_backward(forward_step_func=step, data_iterator=iter(batches), model=model,
                                         num_microbatches=args.microbatches, seq_length=args.seq,
                                         micro_batch_size=args.micro_batch_size, forward_only=False)  # fmt: skip
            if cuda:
                torch.cuda.synchronize(device)
            return store

        for i in range(args.warmup + (0 if profile else args.iterations)):
            if cuda:  # each iteration timed alone, its peak its own
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            with GcClock() as gc_clock:
                store = train_step()
            elapsed = time.perf_counter() - start
            if i < args.warmup:
                continue
            times.append(elapsed)
            gc_clocks.append(gc_clock)
            record = manager.engine.last_iteration if manager is not None else None
            peaks.append(torch.cuda.max_memory_allocated(device) - left if cuda else record.peak_bytes if record else None)
            copied.append(sum(g.bytes_offloaded for g in record.groups.values()) if record else sum(n for _, n in seen.values()))
            waits.append(sum(g.wait_time_s for g in record.groups.values()) if record else None)
            if losses is None:
                losses = [d["lm loss"].detach().cpu() for d in store]
        if profile:
            return {"_profile": own_times(train_step, steps=args.profile, engine=_engine_files(run)),
                    "_api": api_times(train_step, steps=args.profile)}  # fmt: skip
        grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"run": run, "modules": ",".join(modules), "peak_bytes": None if None in peaks else max(peaks),
            "median_step_s": statistics.median(times), "min_step_s": min(times), "bytes_copied": copied[-1],
            "budget_bytes": budget if run.endswith("budget") else None,
            "compute_wait_ms": None if None in waits else statistics.median(waits) * 1e3,
            "saved_peak_bytes": record.peak_resident_bytes if record else None, "_losses": losses, "_grads": grads,
            "gc_ms": statistics.median(c.seconds for c in gc_clocks) * 1e3,
            "gc_collections": [sum(c.collections[g] for c in gc_clocks) / len(gc_clocks) for g in range(3)],
            "left_bytes": left, "wall_s": time.perf_counter() - started}  # fmt: skip


def _same(a: dict[str, Any], b: dict[str, Any]) -> dict[str, bool]:
    losses = len(a["_losses"]) == len(b["_losses"]) and all(map(torch.equal, a["_losses"], b["_losses"]))
    grads = a["_grads"].keys() == b["_grads"].keys() and all(torch.equal(g, b["_grads"][k]) for k, g in a["_grads"].items())
    return {"losses_identical": losses, "grads_identical": grads}


def _module_set(args: argparse.Namespace, shape: GPTShape, modules: list[str], none: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The four (five) runs of one module set (megatron's replaced by one skip row where it cannot run).

    ``none``: an earlier set's run without offload, shown again in this set (``same_run_as``: its
    set): a run that offloads nothing does not depend on the modules, so it runs once.
    """
    rows = [_run(args, shape, modules, "none", None) if none is None else {**none, "modules": ",".join(modules), "same_run_as": none["modules"]}]
    skip = builtin.builtin_unavailable(modules)
    megatron = None if skip else _run(args, shape, modules, "megatron", None)
    rows.append(_run(args, shape, modules, "chunk-offload", None))
    budget = args.budget_bytes
    if budget is None:
        budget = megatron["peak_bytes"] if megatron and megatron["peak_bytes"] is not None and rows[0]["peak_bytes"] \
            else (rows[1]["saved_peak_bytes"] or 0) // 2  # fmt: skip
    rows.append(_run(args, shape, modules, "chunk-offload budget", budget))
    if args.reload_ahead_bytes is not None:
        rows.append(_run(args, shape, modules, "chunk-offload reload-ahead", None))
    if args.timed_reload_ahead:
        rows.append(_run(args, shape, modules, "chunk-offload timed", None))
    if args.layer_groups:
        rows.append(_run(args, shape, modules, "chunk-offload layer", None))
    rows.append(megatron if megatron is not None else {"run": "megatron", "modules": ",".join(modules), "skipped": skip})
    if args.none_again:
        rows.append(_run(args, shape, modules, "none again", None))
    base, nones = rows[0], [r for r in rows if r["run"] in ("none", "none again")]
    # Over both runs without offload where there are two: a host whose speed drifts during the set
    # moves both, and their own overheads (one below 0, one above) show by how much.
    median, fastest = statistics.mean(r["median_step_s"] for r in nones), min(r["min_step_s"] for r in nones)
    for row in rows:
        if "skipped" not in row:
            row.update(_same(base, row), overhead=row["median_step_s"] / median - 1, overhead_min=row["min_step_s"] / fastest - 1)
    return rows


def _add_profiles(args: argparse.Namespace, shape: GPTShape, rows: list[dict[str, Any]]) -> None:
    """``--profile``: each run once more, its profiled steps and what they add over its set's 'none'.

    After every timed run, not inside them: a profiler may leave the process slower after it
    (torch.profiler's CUDA activity tracing), which would tilt the times of the runs after it.
    For the same reason each set's 'none' is profiled first and megatron's second: whatever a
    profiler leaves behind then counts against chunk-offload's runs, never for them.
    """
    sets, first = list(dict.fromkeys(r["modules"] for r in rows)), {"none": 0, "megatron": 1}
    base, nones = None, {}
    for row in sorted(rows, key=lambda r: (sets.index(r["modules"]), first.get(r["run"], 2))):
        if "skipped" in row or row["run"] == "none again":
            continue
        if "same_run_as" in row:  # the run without offload of another set: profiled once, with it
            row.update({key: nones[row["same_run_as"]][key] for key in ("_profile", "_api")})
        else:
            row.update(_run(args, shape, row["modules"].split(","), row["run"], row["budget_bytes"], profile=True))
        if row["run"] == "none":
            base = nones[row["modules"]] = row
            continue
        (times, engine), (base_times, _) = row["_profile"], base["_profile"]
        row.update(_host_added=over(times, base_times), engine_host_ms=engine * 1e3, _api_added=over(row["_api"], base["_api"]))


def _engine_files(run: str) -> Callable[[str], bool] | None:
    """Which source files are ``run``'s offload engine (`engine_files`; None: no engine runs)."""
    if run.startswith("chunk-offload"):
        return engine_files("chunk_offload")
    return engine_files("megatron") if run == "megatron" else None


def main(argv: list[str] | None = None) -> int:
    """Run every module set; print the table (and write the JSON). Returns the exit status."""
    args = parse_args(argv)
    import megatron.core

    shape = GPTShape(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, vocab_size=args.vocab,
                     seq_length=args.seq, micro_batch_size=args.micro_batch_size, dtype=_DTYPES[args.dtype],
                     attention=args.attention)  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[dict[str, Any]] = []
    with deterministic_kernels() if args.deterministic else contextlib.nullcontext():
        for modules in args.modules:
            rows += _module_set(args, shape, modules, rows[0] if rows else None)
            _write_json(args, rows, device, complete=False)  # what a time limit that stops the run leaves
        if args.profile:
            _add_profiles(args, shape, rows)
    print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, micro batch "
          f"{args.micro_batch_size}, {args.microbatches} microbatches, {args.dtype}, {args.attention}; PP=1 "
          f"(megatron no-pipelining schedule); device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; "
          f"megatron-core {megatron.core.__version__}")  # fmt: skip
    print(format_table(rows, device, deterministic=args.deterministic))
    if args.profile:
        print("\n".join(format_profiles(rows, args.layers * args.microbatches)))
    _write_json(args, rows, device, complete=True)
    return 0


def _write_json(args: argparse.Namespace, rows: list[dict[str, Any]], device: str, *, complete: bool) -> None:
    """``--json``: the rows so far (``complete``: every set and profile ran); after each set too, for a run a limit stops."""
    if args.json is None:
        return
    from megatron.core import __version__ as megatron_core_version

    args.json.parent.mkdir(parents=True, exist_ok=True)
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    for row, r in zip(public, rows):
        if r.get("_host_added") is not None:  # the 15 functions adding most host time, seconds per step
            heaviest = sorted(r["_host_added"].items(), key=lambda item: item[1][1], reverse=True)[:15]
            row["host_added_s"] = {f"{name} ({file}:{line})": own for (file, line, name), (_, own) in heaviest}
            # Every CUDA API call's change over 'none', per step: [calls, host seconds].
            row["cuda_api_added"] = {name: [calls, seconds] for (_, _, name), (calls, seconds) in r["_api_added"].items()}
    args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                     "device": device, "megatron_core": megatron_core_version, "complete": complete,
                                     "rows": public}, indent=2))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
