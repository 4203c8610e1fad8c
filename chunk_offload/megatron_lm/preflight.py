"""What the launcher checks in a command line before anything runs (usage errors: exit status 2).

Megatron-LM parses the command line only inside the script, after its imports, and a few
mistakes surface as late as model build (an expert count that expert parallelism cannot divide:
an assertion with a traceback, in Megatron-LM's argument checks or in megatron-core's MoE layer),
at attach (contradicting ``--chunk-offload-*`` flags: exit status 1 after Megatron's set-up), or
after training (a report path that cannot be written). `preflight` parses what it
needs of the script's arguments first and refuses those with the flags as typed:

* our flags, parsed with `add_arguments` and checked by
  `chunk_offload.integrations.megatron.check_args` (with the parser: its usage errors exit 2);
* ``--chunk-offload-iterations wrap``, which Megatron-LM's ``pretrain`` cannot use (its
  ``train_step`` calls ``get_forward_backward_func()`` itself: the launcher delimits iterations,
  ``auto``); ``--chunk-offload-report`` without ``--chunk-offload-modules`` (nothing to report);
* ``--chunk-offload-verify N`` without ``--chunk-offload-modules`` or with ``--chunk-offload-baseline``
  (the run "with offload" would copy nothing); N < 1 is refused by the flag's parser;
* Megatron's ``--num-experts`` not divisible by ``--expert-model-parallel-size`` (or absent);
* Megatron's CUDA graphs capturing whole layers (``--cuda-graph-impl`` with no or a full scope)
  when something is offloaded: no offload group may run inside a graph;
* a ``--chunk-offload-report`` path whose JSON, Markdown or PNG file cannot be written;
* a ``--chunk-offload-plan`` FILE that is not a plan, or a plan with ``--chunk-offload-verify``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

from ..core import ChunkOffloadError
from ..integrations.megatron import add_arguments, check_args
from ..integrations.megatron.modules import whole_layer_graphs
from ..report import report_files
from .plan import load_plan

__all__ = ["USAGE", "LauncherParser", "preflight", "unwritable"]

USAGE = "%(prog)s [-h] SCRIPT [SCRIPT_ARGS ...] (Megatron-LM's arguments and the --chunk-offload-* flags)"


class LauncherParser(argparse.ArgumentParser):
    """An argument parser whose messages are printed once per node: under ``torchrun`` every rank
    runs the launcher and refuses the same command line; only local rank 0 says why."""

    def _quiet(self) -> bool:
        return os.environ.get("LOCAL_RANK", "0") != "0"

    def print_usage(self, file=None) -> None:  # noqa: ANN001 (argparse's signature)
        if not self._quiet():
            super().print_usage(file)

    def exit(self, status: int = 0, message: str | None = None):  # noqa: ANN201 (argparse's signature)
        super().exit(status, None if self._quiet() else message)


def preflight(script_args: Sequence[str], *, prog: str) -> argparse.Namespace:
    """Parse and check the ``--chunk-offload-*`` flags and Megatron's expert split in ``script_args``.

    Returns our flags as parsed (the script parses them again, with Megatron-LM's). Exits with
    status 2 and a usage line on the first problem.
    """
    parser = LauncherParser(prog=prog, usage=USAGE, add_help=False, allow_abbrev=False)
    add_arguments(parser)
    parser.set_defaults(chunk_offload_iterations=None)  # None: not given on the command line
    args, _ = parser.parse_known_args(list(script_args))
    with warnings.catch_warnings():  # its warnings come once more where the script attaches
        warnings.simplefilter("ignore")
        check_args(args, parser)
    if args.chunk_offload_iterations == "wrap":
        parser.error(
            "--chunk-offload-iterations wrap: Megatron-LM's train_step calls get_forward_backward_func() itself, so "
            "under the launcher chunk-offload delimits the iterations (--chunk-offload-iterations auto); drop the flag"
        )
    plan = args.chunk_offload_plan
    if plan is not None and plan != "auto":
        try:
            load_plan(plan)
        except ChunkOffloadError as e:
            parser.error(str(e).removeprefix("chunk_offload: "))
    if plan is not None and args.chunk_offload_verify is not None:
        parser.error(
            f"--chunk-offload-verify cannot be combined with --chunk-offload-plan {plan}: its reference run drops every "
            "--chunk-offload-* flag, the plan's recompute with it; verify the plan's choice given by hand "
            "(--chunk-offload-modules and Megatron's recompute flags, as the plan prints them)"
        )
    report = args.chunk_offload_report
    if report and not args.chunk_offload_modules and plan is None:
        parser.error(
            f"--chunk-offload-report {report} given without --chunk-offload-modules: nothing is offloaded, so there is "
            "nothing to report; add --chunk-offload-modules NAMES or drop it"
        )
    verify = args.chunk_offload_verify
    if verify is not None and (not args.chunk_offload_modules or args.chunk_offload_baseline):
        if args.chunk_offload_modules:
            why, fix = "--chunk-offload-baseline copies nothing", "drop --chunk-offload-baseline"
        else:
            why, fix = "without --chunk-offload-modules nothing is offloaded", "add --chunk-offload-modules NAMES"
        parser.error(f"--chunk-offload-verify {verify} compares a run without offload with one with offload, but {why}; {fix}")
    _check_experts(script_args, parser)
    if args.chunk_offload_modules or plan is not None:
        _check_cuda_graphs(script_args, parser)
    if report:
        problem = unwritable(report)
        if problem:
            parser.error(f"argument --chunk-offload-report: {problem}")
    return args


def _check_experts(script_args: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """Megatron-LM asserts (in validate_args at core_v0.19, in megatron-core's MoE layer at model build)
    that expert parallelism divides the experts, and that it has experts to divide."""
    megatron = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    megatron.add_argument("--num-experts", default=None)
    megatron.add_argument("--expert-model-parallel-size", default="1")
    given, _ = megatron.parse_known_args(list(script_args))
    try:
        ep = int(given.expert_model_parallel_size)
        experts = None if given.num_experts is None else int(given.num_experts)
    except ValueError:
        return  # not a number: Megatron-LM's own parser answers
    if experts is None and ep > 1:
        parser.error(
            f"--expert-model-parallel-size {ep} without --num-experts: expert parallelism splits the experts of a MoE "
            "model; add --num-experts N (a multiple of it) or drop it"
        )
    if experts is not None and ep > 0 and experts % ep:
        lower = experts - experts % ep
        parser.error(
            f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}: each expert-parallel rank "
            f"holds the same number of experts; use a multiple of {ep} for --num-experts ("
            + (f"{lower} or " if lower else "")
            + f"{lower + ep}) or an --expert-model-parallel-size that divides {experts}"
        )


def _check_cuda_graphs(script_args: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """Megatron's CUDA graphs that capture every transformer layer whole (`whole_layer_graphs`), where
    no offload group may run (NOTE [CUDA graph capture]); ``attach`` refuses them too, after set-up."""
    megatron = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    megatron.add_argument("--cuda-graph-impl", default="none")
    for flag in ("--cuda-graph-scope", "--cuda-graph-modules"):
        megatron.add_argument(flag, nargs="+", default=None)
    for flag in ("--enable-cuda-graph", "--external-cuda-graph"):
        megatron.add_argument(flag, action="store_true")
    given, _ = megatron.parse_known_args(list(script_args))
    flag, scopes = ("--cuda-graph-modules", given.cuda_graph_modules) if given.cuda_graph_modules else ("--cuda-graph-scope", given.cuda_graph_scope)
    impl = whole_layer_graphs(given.cuda_graph_impl, scopes or [], enable_cuda_graph=given.enable_cuda_graph,
                              external_cuda_graph=given.external_cuda_graph)  # fmt: skip
    if impl is not None:
        parser.error(
            f"Megatron's CUDA graphs (--cuda-graph-impl {impl}, {flag} {' '.join(scopes) if scopes else 'not given: the whole layer'}) "
            "capture every transformer layer, and a graph's replays run without the hooks that offload; use "
            f"--cuda-graph-impl none, or a {flag} that leaves the offloaded modules out, or drop --chunk-offload-modules"
        )


def unwritable(path: str | os.PathLike) -> str | None:
    """Why the report files of ``path`` (``PATH.json``, ``PATH.md``, ``PATH.png``) cannot be written; None if they can.

    Missing folders are fine where the nearest existing one is writable (`write_report` creates them).
    """
    files = report_files(path)
    for target in (files.json, files.table, files.png):
        if target.is_dir():
            return f"{str(target)!r} is a folder; give a file path (the report writes PATH.json, PATH.md and PATH.png)"
        if target.exists() and not os.access(target, os.W_OK):
            return f"{str(target)!r} exists and cannot be overwritten"
        folder = target.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            return f"cannot write {str(target)!r}: {str(folder)!r} is not a folder"
        problem = _probe(folder)
        if problem:
            return f"cannot write {str(target)!r}: folder {str(folder)!r} is not writable ({problem})"
    return None


def _probe(folder: Path) -> str | None:
    """Create and remove a file in ``folder`` (``os.access`` says yes to root on a read-only file system)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return e.strerror or str(e)
