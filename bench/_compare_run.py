"""One run of `bench/megatron_compare.py`: a fresh model, its offload, its training through
megatron's no-pipelining schedule and what is measured of it (`run_once`; `run_alone` in a
process of its own)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from chunk_offload.core.config import OffloadConfig
from chunk_offload.devkit.deterministic import deterministic_kernels
from chunk_offload.devkit.gpt import GPTShape, gpt_forward_step
from chunk_offload.devkit.host_profile import GcClock, api_times, engine_files, own_times
from chunk_offload.integrations.megatron import attach
from chunk_offload.replay import megatron_builtin as builtin
from chunk_offload.replay.stage import device_bytes_left, megatron_stage

from _inline_streams import InlineStreams  # bench/: on sys.path wherever this module is imported from

__all__ = ["DTYPES", "TIMED", "run_alone", "run_once"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TIMED = {"auto": "auto", "on": True, "off": False}
"""``--timed-reload-ahead``'s values as ``attach``'s ``timed_reload_ahead``."""


def _with_offload(stack: ExitStack, args: argparse.Namespace, model: torch.nn.Module, modules: list[str], run: str,
                  budget: int | None, device: torch.device) -> tuple[Callable, Callable, Any, dict[int, tuple[Any, int]]]:  # fmt: skip
    """``run``'s offload around ``model`` on ``device``: (forward_backward_func, forward_step_func, manager
    or None, megatron's host copies seen in the current iteration); undone when ``stack`` closes. On
    CPU, chunk-offload copies inline unless ``--cpu-copies threads`` (NOTE [Copies on CPU] in megatron_compare.py)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward, manager, seen = get_forward_backward_func(), None, {}
    if run.startswith("chunk-offload"):
        config = OffloadConfig(min_offload_bytes=args.min_offload_bytes)  # the library's grouping, but for the module run
        if run.endswith("module"):
            config = dataclasses.replace(config, group_by="module")
        manager = attach([model], modules, config=config,
                         device_budget_bytes=budget if run.endswith("budget") else None,
                         reload_ahead_bytes=args.reload_ahead_bytes if run.endswith("reload-ahead") else None,
                         timed_reload_ahead=TIMED[args.timed_reload_ahead],
                         streams=InlineStreams(device) if device.type == "cpu" and args.cpu_copies == "inline" else None)  # fmt: skip
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


GradsCheck = Callable[[dict[str, torch.Tensor]], dict[str, Any]]
"""Given a run's grads where they are (on its device), what to add to its row."""


def run_once(args: argparse.Namespace, shape: GPTShape, modules: list[str], run: str, budget: int | None,
             *, measure: bool = True, profile_steps: int = 0, check_grads: GradsCheck | None = None) -> dict[str, Any]:  # fmt: skip
    """One run: fresh model, warm-up, then (``measure``) the measured iterations through megatron's
    schedule, then ``profile_steps`` steps under each profiler (`_add_profiles`). The row holds the
    last measured iteration's grads as host copies (``_grads``), or what ``check_grads`` makes of them."""
    with deterministic_kernels() if args.deterministic else contextlib.nullcontext():
        return _train(args, shape, modules, run, budget, measure=measure, profile_steps=profile_steps, check_grads=check_grads)


def _train(args: argparse.Namespace, shape: GPTShape, modules: list[str], run: str, budget: int | None,
           *, measure: bool, profile_steps: int, check_grads: GradsCheck | None) -> dict[str, Any]:  # fmt: skip
    dtype = DTYPES[args.dtype]
    overrides = builtin.builtin_config(modules, min_offload_bytes=args.min_offload_bytes, dtype=dtype) if run == "megatron" else None
    times, peaks, copied, waits, gc_clocks, losses, row = [], [], [], [], [], None, {}
    started, left = time.perf_counter(), device_bytes_left()  # what earlier runs left: off the peak, onto the budget
    with ExitStack() as stack:
        stage = stack.enter_context(megatron_stage(shape, pp_size=1, pp_rank=0, seed=args.seed, config_overrides=overrides))
        # The whole model in the run's dtype (build_gpt_chunks' own dtype handling is being reworked).
        model = stage.chunks[0].to(dtype)
        cuda, device = stage.device.type == "cuda", stage.device
        # The budget is device memory this run's model and activations may take: over what is left.
        forward_backward, step, manager, seen = _with_offload(stack, args, model, modules, run, None if budget is None else budget + left, device)
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

        for i in range(args.warmup + (args.iterations if measure else 0)):
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
        if measure:
            row = {"run": run, "modules": ",".join(modules), "peak_bytes": None if None in peaks else max(peaks),
                   "median_step_s": statistics.median(times), "min_step_s": min(times), "bytes_copied": copied[-1],
                   "budget_bytes": budget if run.endswith("budget") else None,
                   "compute_wait_ms": None if None in waits else statistics.median(waits) * 1e3,
                   "saved_peak_bytes": record.peak_resident_bytes if record else None, "_losses": losses,
                   "timed_reload_ahead": manager.tracking.timed_reload_ahead if manager is not None else None,
                   "gc_ms": statistics.median(c.seconds for c in gc_clocks) * 1e3,
                   "gc_collections": [sum(c.collections[g] for c in gc_clocks) / len(gc_clocks) for g in range(3)],
                   "left_bytes": left, "wall_s": time.perf_counter() - started}  # fmt: skip
            grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
            # Before any profiled step changes them in place.
            row.update(check_grads(grads) if check_grads else {"_grads": {n: g.cpu().clone() for n, g in grads.items()}})
        if profile_steps:
            row.update(_profile=own_times(train_step, steps=profile_steps, engine=_engine_files(run)),
                       _api=api_times(train_step, steps=profile_steps))  # fmt: skip
    return row


def run_alone(args: argparse.Namespace, shape: GPTShape, modules: list[str], run: str, budget: int | None,
              base_file: Path, is_base: bool) -> dict[str, Any]:  # fmt: skip
    """`run_once` in a process of its own (`in_own_process`): measured, then profiled. The run
    without offload (``is_base``) saves its grads to ``base_file``; every other run compares its
    own with them on its device and answers ``grads_identical``: no model's worth of bytes copied
    to host, written and read back per run (3.8 GB at hidden 4096)."""

    def check(grads: dict[str, torch.Tensor]) -> dict[str, Any]:
        if is_base:
            torch.save({name: grad.cpu() for name, grad in grads.items()}, base_file)
            return {}
        base = torch.load(base_file, mmap=True)
        return {"grads_identical": base.keys() == grads.keys() and all(torch.equal(g, base[n].to(g.device)) for n, g in grads.items())}

    return run_once(args, shape, modules, run, budget, profile_steps=args.profile, check_grads=check)


def _engine_files(run: str) -> Callable[[str], bool] | None:
    """Which source files are ``run``'s offload engine (`engine_files`; None: no engine runs)."""
    if run.startswith("chunk-offload"):
        return engine_files("chunk_offload")
    return engine_files("megatron") if run == "megatron" else None
