"""``python -m chunk_offload.replay``: replay one pipeline stage with and without offload; print the table.

    python -m chunk_offload.replay --pp 4 --vpp 2 --stage 0 --layers 32 --hidden 4096 --seq 4096 \\
        --modules core_attn,qkv_linear --dtype bf16 --json out/stage0.json

Runs on the CUDA device when there is one (peaks: ``torch.cuda.max_memory_allocated``), else on
the CPU (peaks: the manager's accounting of saved bytes; ``--link-gbps`` simulates a host link).
Exit status 3 when the device runs out of memory, so scripts can retry a smaller shape.
``--compare megatron`` adds megatron-core's own fine-grained activation offloading as a third
mode on the same stage, plan, modules and seed (`chunk_offload.replay.compare`), and
``--budget-bytes BYTES|megatron`` a fourth: chunk-offload as training runs it under that device
budget (``megatron``: megatron's measured peak, for a comparison at equal memory). Each mode then
runs ``--host-profile-iterations`` (default 1) more iterations under cProfile for the row of its
engine's host time per group.
``--deterministic`` runs every mode on deterministic kernels (`chunk_offload.devkit.deterministic`),
so that on CUDA too the losses and grads rows say whether the offload changed a bit.

A co-planned stage (``chunk-offload plan --co-plan``): its offload modules and megatron's selective
recompute of its recompute modules, both modes built with the recompute::

    python -m chunk_offload.replay --pp 2 --stage 0 --layers 8 --hidden 1024 --heads 16 --seq 4096 \\
        --microbatches 8 --attention local --modules attn_norm,qkv_linear --recompute-modules core_attn

``--recompute-modules`` takes the planner's names (`chunk_offload.planner.dims.RECOMPUTE_MODULES`)
that the replay's dense GPT has: ``core_attn``. Megatron's other names are refused with the reason
(``mlp`` hangs on CPU in megatron-core 0.16.1), and so are a module both recomputed and offloaded
and the combinations `chunk_offload.module_names.combination_problem` refuses (exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from ..core.config import OffloadConfig
from ..core.errors import ChunkOffloadError
from ..core.option_table import option, parse_bytes
from ..core.streams import CpuStreams
from ..devkit.deterministic import deterministic_kernels
from ..devkit.gpt import ATTENTIONS, GPTShape
from ..option_flags import argparse_keywords
from ..module_names import check_combination
from ..planner import PipelineConfig, canonical_modules
from ..planner.dims import RECOMPUTE_MODULES
from .compare import compare_with_megatron
from .run import replay
from .stage import megatron_stage

__all__ = ["DETERMINISTIC_LINE", "main", "parse_args"]

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXIT_OUT_OF_MEMORY = 3
_NOT_HERE = {
    "moe": "it recomputes MoE layers, and the replay builds a dense GPT (no MoE layers)",
    "mlp": "megatron-core 0.16.1's mlp recompute hangs on CPU even without offload, and the planner does not model it",
    "layernorm": "it needs Transformer Engine's layer spec, and the planner does not model it",
    "moe_act": "it needs MoE layers with grouped GEMM, and the planner does not model it",
    "mla_up_proj": "it needs multi-latent attention, and the planner does not model it",
    "shared_experts": "it needs MoE shared experts, and the planner does not model it",
}
"""Recompute names the replay refuses -> why: megatron's that the planner does not model, and moe."""
_RECOMPUTE = tuple(m for m in RECOMPUTE_MODULES if m not in _NOT_HERE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of the stage replay."""
    p = argparse.ArgumentParser(prog="python -m chunk_offload.replay", description=__doc__.split("\n")[0])
    g = p.add_argument_group("pipeline")
    g.add_argument("--pp", type=int, required=True, help="pipeline stages of the job")
    g.add_argument("--vpp", type=int, default=1, help="model chunks per stage (interleaved schedule when > 1)")
    g.add_argument("--stage", type=int, required=True, help="the stage to replay, 0..pp-1")
    g.add_argument("--microbatches", type=int, default=None, help="microbatches per iteration (default 2 x pp)")
    g = p.add_argument_group("model (the whole GPT, before pipeline splitting)")
    g.add_argument("--layers", type=int, default=None, help="transformer layers (default 2 per chunk: 2 x pp x vpp)")
    g.add_argument("--hidden", type=int, default=64, help="hidden size")
    g.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 x hidden)")
    g.add_argument("--heads", type=int, default=None, help="attention heads (default hidden / 128, at least 1)")
    g.add_argument("--seq", type=int, default=32, help="sequence length")
    g.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch")
    g.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    g.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    g.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="sdpa",
        help="core attention: sdpa (torch's scaled_dot_product_attention: flash / memory-efficient kernels on "
        "CUDA; default) or local (megatron-core's DotProductAttention, which saves the s x s softmax)",
    )
    g = p.add_argument_group("offload")
    g.add_argument("--modules", required=True, help="comma-separated offload module names, e.g. core_attn,qkv_linear")
    g.add_argument("--min-offload-bytes", **argparse_keywords(option("min-offload-bytes"), dest="min_offload_bytes"))
    g.add_argument("--group-by", **argparse_keywords(option("group-by"), dest="group_by"))
    g.add_argument("--layer-group-bytes", **argparse_keywords(option("layer-group-bytes"), dest="layer_group_bytes"))
    g.add_argument(
        "--recompute-modules",
        nargs="+",
        type=_recompute_module,
        choices=_RECOMPUTE,
        default=None,
        help="megatron's selective recompute of these modules (--recompute-granularity selective) in both modes, the "
        f"planner's names the replay's GPT has: {', '.join(_RECOMPUTE)}",
    )
    g.add_argument("--link-gbps", type=float, default=None, help="CPU only: simulated host link, GB/s (copy time = bytes / rate)")
    g.add_argument("--d2h-gbps", type=float, default=None, help="CPU only: the simulated link to host, GB/s (default --link-gbps)")
    g.add_argument("--h2d-gbps", type=float, default=None, help="CPU only: the simulated link back, GB/s (default --link-gbps)")
    g = p.add_argument_group("run")
    g.add_argument("--iterations", type=int, default=3, help="measured iterations per mode")
    g.add_argument("--warmup", type=int, default=1, help="warm-up iterations per mode")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (torch.use_deterministic_algorithms), so that losses and grads compare bit for bit "
        "on CUDA too; step times are then those kernels'",
    )
    g.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    g.add_argument(
        "--compare",
        choices=["megatron"],
        default=None,
        help="megatron: also run megatron-core's built-in fine-grained activation offloading; one table of three modes",
    )
    g.add_argument(
        "--budget-bytes",
        type=_budget,
        default=None,
        metavar="BYTES|megatron",
        help="with --compare megatron: also run chunk-offload as training does under this device budget, its copy "
        "timing choosing the reload-ahead budgets (a fourth column); 'megatron': megatron's measured peak, for a "
        "comparison at equal memory (CUDA only)",
    )
    g.add_argument(
        "--host-profile-iterations",
        type=int,
        default=None,
        metavar="N",
        help="with --compare megatron: iterations each mode runs under cProfile after its measured ones, for the "
        "engines' host time per group (default 1; 0: no such row)",
    )
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _budget(text: str) -> int | str:
    """A ``--budget-bytes`` value: ``megatron`` or a byte count (`parse_bytes`)."""
    if text == "megatron":
        return text
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}, or 'megatron'") from None


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2) for values the replay, megatron or torch would fail on later."""
    positive = [("--pp", args.pp), ("--vpp", args.vpp), ("--hidden", args.hidden), ("--seq", args.seq),
                ("--micro-batch-size", args.micro_batch_size), ("--vocab", args.vocab), ("--iterations", args.iterations)]
    optional = [("--microbatches", args.microbatches), ("--layers", args.layers), ("--ffn", args.ffn), ("--heads", args.heads)]
    for flag, value in positive + [(f, v) for f, v in optional if v is not None]:
        if value < 1:
            p.error(f"{flag} must be an integer >= 1, got {value}")
    if args.warmup < 0:
        p.error(f"--warmup must be an integer >= 0, got {args.warmup}")
    for flag, rate in (("--link-gbps", args.link_gbps), ("--d2h-gbps", args.d2h_gbps), ("--h2d-gbps", args.h2d_gbps)):
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            p.error(f"{flag} must be a finite number > 0 (GB/s), got {rate}")
    if not 0 <= args.stage < args.pp:
        p.error(f"--stage must be in 0..{args.pp - 1} (--pp {args.pp}), got {args.stage}")
    layers = args.layers if args.layers is not None else 2 * args.pp * args.vpp
    if layers % (args.pp * args.vpp):
        p.error(f"--layers must be a multiple of --pp x --vpp ({args.pp} x {args.vpp}), got {layers}")
    heads = args.heads if args.heads is not None else max(1, args.hidden // 128)
    if args.hidden % heads:
        p.error(f"--hidden must be divisible by the attention heads ({heads}), got {args.hidden}")
    if args.budget_bytes is not None and args.compare != "megatron":
        p.error(f"--budget-bytes {args.budget_bytes} is a column of the comparison: add --compare megatron")
    if args.layer_group_bytes not in (None, option("layer-group-bytes").default) and args.group_by != "layer":
        p.error(f"--layer-group-bytes {args.layer_group_bytes} bounds layer groups: add --group-by layer")
    if args.host_profile_iterations is not None:
        if args.compare != "megatron":
            p.error(f"--host-profile-iterations {args.host_profile_iterations} is a row of the comparison: add --compare megatron")
        if args.host_profile_iterations < 0:
            p.error(f"--host-profile-iterations must be an integer >= 0, got {args.host_profile_iterations}")
    if args.budget_bytes == "megatron" and not torch.cuda.is_available():
        p.error("--budget-bytes megatron needs CUDA: megatron's path has no measured peak on CPU; give the budget in bytes")
    try:
        modules = canonical_modules(args.modules)
        # megatron-core's own checks of the interleaved schedule (the planner's pipeline model).
        PipelineConfig(
            pipeline_parallel=args.pp,
            virtual_pipeline=args.vpp,
            num_microbatches=args.microbatches if args.microbatches is not None else 2 * args.pp,
        )
    except ChunkOffloadError as e:
        flag = "--modules" if "module" in str(e) else "--microbatches"
        p.error(f"{flag}: {e}")
    recompute = args.recompute_modules or []
    both = [m for m in modules if m in recompute]
    if both:
        p.error(
            f"argument --recompute-modules: {','.join(both)} is offloaded too (--modules {args.modules}): a recomputed "
            "module's forward saves nothing to offload; drop it from --modules or from --recompute-modules"
        )
    try:
        check_combination(modules, recompute, modules_flag="--modules", recompute_flag="--recompute-modules")
    except ChunkOffloadError as e:
        p.error(str(e))


def _recompute_module(name: str) -> str:
    """A ``--recompute-modules`` name; megatron's names the replay cannot run are refused with the reason."""
    if name in _NOT_HERE:
        raise argparse.ArgumentTypeError(f"{name!r} cannot be recomputed in the replay: {_NOT_HERE[name]}; choose from {list(_RECOMPUTE)}")
    return name


def main(argv: list[str] | None = None) -> int:
    """Run the replay the command line asks for; print its table. Returns the exit status."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dtype = _DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    layers = args.layers if args.layers is not None else 2 * args.pp * args.vpp
    shape = GPTShape(
        num_layers=layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads if args.heads is not None else max(1, args.hidden // 128),
        vocab_size=args.vocab,
        seq_length=args.seq,
        micro_batch_size=args.micro_batch_size,
        dtype=dtype,
        attention=args.attention,
        recompute_granularity="selective" if args.recompute_modules else None,
        recompute_modules=tuple(args.recompute_modules) if args.recompute_modules else None,
    )
    make_streams = None  # each run's manager closes its streams: one set per run
    to_host = args.d2h_gbps if args.d2h_gbps is not None else args.link_gbps
    back = args.h2d_gbps if args.h2d_gbps is not None else args.link_gbps
    if to_host is not None or back is not None:
        if cuda:
            logger.warning("--link-gbps, --d2h-gbps and --h2d-gbps simulate a link on CPU copy streams; ignored on CUDA")
        else:
            rates = [None if r is None else r * 1e9 for r in (to_host, back)]
            make_streams = functools.partial(CpuStreams, link_bytes_per_s=rates[0], reload_link_bytes_per_s=rates[1])
    config = OffloadConfig(min_offload_bytes=args.min_offload_bytes, group_by=args.group_by, layer_group_bytes=args.layer_group_bytes)
    common = dict(modules=args.modules, num_microbatches=args.microbatches, iterations=args.iterations, warmup=args.warmup, config=config)
    try:
        with deterministic_kernels() if args.deterministic else contextlib.nullcontext():
            result = _run(args, shape, common, make_streams)
    except torch.OutOfMemoryError as e:
        print(f"out of device memory: {e}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    print(
        f"model: {layers} layers, hidden {args.hidden}, seq {args.seq}, micro batch {args.micro_batch_size}, {dtype}, "
        f"{args.attention} attention" + (f", recompute {' '.join(args.recompute_modules)}" if args.recompute_modules else "")
    )
    print(result.format())
    if args.deterministic:
        print(DETERMINISTIC_LINE)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, **result.summary()}
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


DETERMINISTIC_LINE = "kernels: deterministic (--deterministic): a difference in losses or grads is the offload's, not the kernels'"


def _run(args: argparse.Namespace, shape: GPTShape, common: dict[str, Any], make_streams: Callable[[], CpuStreams] | None) -> Any:
    """The replay, or the comparison with megatron's built-in, that the command line asks for."""
    if args.compare == "megatron":
        return compare_with_megatron(
            shape, pp_size=args.pp, pp_rank=args.stage, vp_size=args.vpp, seed=args.seed, budget_bytes=args.budget_bytes,
            streams=make_streams, host_profile_iterations=1 if args.host_profile_iterations is None else args.host_profile_iterations,
            **common,
        )  # fmt: skip
    with megatron_stage(shape, pp_size=args.pp, pp_rank=args.stage, vp_size=args.vpp, seed=args.seed) as stage:
        return replay(stage, streams=None if make_streams is None else make_streams(), **common)


if __name__ == "__main__":
    sys.exit(main())
