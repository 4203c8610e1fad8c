"""Usage checks of ``chunk-offload plan``: values, flags that contradict each other, and the flag
names errors use.

Every check ends in ``parser.error`` (usage, exit status 2) naming the flags as the user typed
them. Errors the library raises name its fields (``tensor_parallel``); `name_flags` rewrites
those to the flags that set them (``--tp``) before the command line prints them.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Sequence

from .dims import ATTENTION_KERNELS
from .estimate import POLICY_SCHEDULES

__all__ = ["check_args", "given_flags", "name_flags"]

_FIELD_DESTS = {
    "tensor_parallel": "tp",
    "pipeline_parallel": "pp",
    "virtual_pipeline": "vpp",
    "other_activation_bytes": "other_activation_gb",
    "budget_bytes": "budget_gb",
    "bias_swiglu_fusion": "bias_swiglu_fusion",
}
"""Library field -> the parser's destination, where the two names differ."""
_FIELD = re.compile(r"(?<![\w-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w-])")


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """Destination -> the option string the user typed, for each flag on the command line
    (unique abbreviations resolved, as argparse resolves them)."""
    by_option = {option: action.dest for action in parser._actions for option in action.option_strings}  # no public lookup
    given: dict[str, str] = {}
    for token in argv:
        if not token.startswith("--"):
            continue
        option = token.split("=", 1)[0]
        matches = [option] if option in by_option else [o for o in by_option if o.startswith(option)]
        if len({by_option[o] for o in matches}) == 1:
            given.setdefault(by_option[matches[0]], option)
    return given


def name_flags(message: str, parser: argparse.ArgumentParser, given: dict[str, str]) -> str:
    """``message`` with each library field that a flag sets replaced by that flag (as typed, else its long form)."""
    flags = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs:
            flags.setdefault(action.dest, given.get(action.dest, longs[0]))

    def flag(match: re.Match) -> str:
        field = match.group(1)
        return flags.get(_FIELD_DESTS.get(field, field), field)

    return _FIELD.sub(flag, message)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: dict[str, str]) -> None:
    """Usage errors (exit status 2) found before anything is computed; ``given``: `given_flags`."""
    for flag, value in (
        ("--budget-gb", args.budget_gb),
        ("--other-activation-gb", args.other_activation_gb),
        ("--host-bandwidth-gbs", args.host_bandwidth_gbs),
        ("--d2h-gbps", args.d2h_gbps),
        ("--h2d-gbps", args.h2d_gbps),
        ("--device-tflops", args.device_tflops),
    ):
        if value is not None and not math.isfinite(value):
            parser.error(f"argument {flag}: must be a finite number, got {value}")
    if args.json_path is not None:
        folder = os.path.dirname(os.path.abspath(args.json_path))
        if not os.path.isdir(folder):
            parser.error(f"argument --json: folder {folder!r} of {args.json_path!r} does not exist")
        if os.path.isdir(args.json_path):
            parser.error(f"argument --json: {args.json_path!r} is a folder; give a file path")
    kernels = ATTENTION_KERNELS[args.transformer_impl]
    if args.attention_kernel not in kernels:
        parser.error(
            f"argument --attention-kernel: {args.attention_kernel!r} is not a kernel of --transformer-impl "
            f"{args.transformer_impl}; choose from {list(kernels)}"
        )
    _translate_policy(parser, args, given)
    _check_contradictions(parser, args, given)
    if args.rope:
        args.position_embedding_type = "rope"


def _translate_policy(parser: argparse.ArgumentParser, args: argparse.Namespace, given: dict[str, str]) -> None:
    """The deprecated ``--policy plan|all`` as ``--schedule plan|group-start``, with a warning."""
    if args.policy is None:
        return
    schedule = POLICY_SCHEDULES[args.policy]
    if "schedule" in given and args.schedule != schedule:
        parser.error(
            f"argument {given['policy']}: cannot be combined with {given['schedule']} {args.schedule}: --policy is the "
            "deprecated spelling of --schedule; keep --schedule"
        )
    print(
        f"{parser.prog}: warning: {given['policy']} {args.policy} is deprecated and will be removed in the next release; "
        f"use --schedule {schedule}",
        file=sys.stderr,
    )
    args.schedule = schedule
    given.setdefault("schedule", given["policy"])


def _check_contradictions(parser: argparse.ArgumentParser, args: argparse.Namespace, given: dict[str, str]) -> None:
    """Flags that cannot both hold: one error naming both, with the way out."""

    def both(dest: str, other: str, why: str) -> None:
        parser.error(f"argument {given.get(dest, dest)}: cannot be combined with {other}: {why}")

    def needs(dest: str, other: str, why: str) -> None:
        parser.error(f"argument {given[dest]}: needs {other}: {why}")

    if args.budget_gb is not None and "schedule" in given and args.schedule == "group-start":
        both(
            "budget_gb",
            f"{given['schedule']} {args.policy or args.schedule}",
            "the budget chooses which groups of which chunks to offload from the plan (as "
            "--chunk-offload-device-budget does at run time), --schedule group-start offloads every chunk; drop one of them",
        )
    if args.rope and "position_embedding_type" in given and args.position_embedding_type != "rope":
        both("rope", f"{given['position_embedding_type']} {args.position_embedding_type}", "they set different position embeddings; keep one")
    if "bias_swiglu_fusion" in given and not args.swiglu:
        needs("bias_swiglu_fusion", "--swiglu", "the SwiGLU fusion exists only in a SwiGLU MLP; add --swiglu or drop it")
    if args.co_plan and args.budget_gb is None:
        needs("co_plan", "--budget-gb", "the co-plan chooses keep, offload and recompute to fit a budget; add --budget-gb GB")
    if args.co_plan and args.recompute_modules:
        both("co_plan", given["recompute_modules"], "the co-plan chooses the recompute modules itself; drop one of them")
    if "layer_group_bytes" in given and args.group_by != "layer":
        needs("layer_group_bytes", "--group-by layer", "it bounds layer groups; add --group-by layer or drop it")
    if "microbatch_group_size_per_vp_stage" in given and args.vpp is None:
        needs("microbatch_group_size_per_vp_stage", "--vpp", "it sizes the groups of the interleaved schedule; add --vpp N or drop it")
    for dest in ("moe_router_topk", "moe_layer_freq"):
        if dest in given and args.num_experts is None:
            needs(dest, "--num-experts", "it describes MoE layers; add --num-experts N or drop it")
    if "attention" in given and args.transformer_impl == "transformer_engine":
        both(
            "attention",
            f"{given.get('transformer_impl', '--transformer-impl')} transformer_engine",
            "Transformer Engine's spec has its own DotProductAttention (pick its kernel with --attention-kernel)",
        )
    if "attention_kernel" in given and args.attention == "local" and args.transformer_impl == "local":
        both("attention_kernel", f"{given.get('attention', '--attention')} local", "megatron's local attention has no kernel choice")
