"""Megatron-core GPT pretraining (random tokens) with chunk-offload, under PP, interleaved VPP and EP.

Launch with torchrun, one process per rank; without CUDA the ranks use gloo and the CPU
compatibility layer, with CUDA they use NCCL and one GPU each:

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py \\
        --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 \\
        --chunk-offload-modules attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,mlp_fc1

Prints every iteration's loss with full precision. With ``--chunk-offload-modules`` the first
iteration is a baseline that copies nothing, and rank 0 prints the per-stage memory report
(`chunk_offload.report`): per rank, the peak without offload (the baseline iteration) and with
it (the last iteration), the measured and the theoretical drop, R, the bytes offloaded per
module and the copy and wait times. ``--chunk-offload-report PATH`` also writes it to ``PATH.json``,
``PATH.png`` (memory over one iteration per stage) and ``PATH.md``. ``--save-state DIR`` writes
every rank's parameters after the last step, so two runs (with and without ``--chunk-offload-modules``)
can be compared bit for bit: the baseline iteration changes nothing in the numerics.
``--chunk-offload-device-budget BYTES|auto`` bounds each rank's peak: every rank chooses the fewest
groups to offload that fit (a rank that fits copies nothing), and the report adds a table of the
budgets, the groups chosen per module and the predicted and measured peaks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from chunk_offload.integrations.megatron import add_arguments, attach_from_args, check_args
from chunk_offload.devkit.gpt import (
    ATTENTIONS,
    GPTShape,
    average_data_parallel_grads,
    build_gpt_chunks,
    gpt_forward_step,
    random_token_batches,
)
from chunk_offload.report import format_table, gather_reports, write_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Megatron-core GPT pretraining with chunk-offload")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--num-experts", type=int, default=None, help="MoE experts per layer (every layer is MoE)")
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="sdpa",
        help="core attention: sdpa (torch's scaled_dot_product_attention, flash-style; default) or local "
        "(megatron-core's DotProductAttention, which materialises the s x s softmax)",
    )
    # --chunk-offload-modules, --chunk-offload-min-offload-bytes, ..., exactly as
    # Megatron-LM gets them through extra_args_provider=add_arguments.
    add_arguments(p)
    p.set_defaults(chunk_offload_min_offload_bytes=1024)  # this model is tiny: offload tensors from 1 KiB
    p.add_argument("--save-state", type=Path, default=None, help="directory for every rank's final parameters")
    p.add_argument(
        "--hang-timeout-s", type=float, default=0.0, help="print every thread's stack and exit after this long (0: off)"
    )
    args = p.parse_args(argv)
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length", "micro_batch_size",
                 "num_microbatches", "pipeline_model_parallel_size", "expert_model_parallel_size", "moe_router_topk"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be an integer >= 1, got {getattr(args, flag)}")
    if args.iterations < 1:
        p.error(f"--iterations must be an integer >= 1, got {args.iterations}")
    if args.num_experts is not None:
        if args.num_experts < 1 or args.num_experts % args.expert_model_parallel_size:
            p.error(
                f"--num-experts must be a positive multiple of --expert-model-parallel-size "
                f"({args.expert_model_parallel_size}), got {args.num_experts}"
            )
        if args.moe_router_topk > args.num_experts:
            p.error(f"--moe-router-topk must be at most --num-experts ({args.num_experts}), got {args.moe_router_topk}")
    elif args.expert_model_parallel_size != 1:
        p.error(f"--expert-model-parallel-size {args.expert_model_parallel_size} needs --num-experts (accepted without: 1)")
    if args.hidden_size % args.num_attention_heads:
        p.error(
            f"--hidden-size must be divisible by --num-attention-heads ({args.num_attention_heads}), got {args.hidden_size}"
        )
    if args.num_layers % args.pipeline_model_parallel_size:
        p.error(
            f"--num-layers must be divisible by --pipeline-model-parallel-size ({args.pipeline_model_parallel_size}), "
            f"got {args.num_layers}"
        )
    if args.chunk_offload_modules and not args.chunk_offload_baseline and args.iterations < 2:
        p.error(f"--chunk-offload-modules needs --iterations >= 2 (got {args.iterations}): the first iteration is the report's baseline without offload")
    check_args(args, p)  # --chunk-offload-* flags that contradict each other or do nothing: exit 2
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.hang_timeout_s > 0:
        faulthandler.dump_traceback_later(args.hang_timeout_s, exit=True)
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    compat = contextlib.nullcontext()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        from chunk_offload.devkit import cpu_compat

        compat = cpu_compat.megatron_on_cpu()
    with compat:
        run(args, device, rank)
    dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device, rank: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator, init_num_microbatches_calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    # As Megatron-LM's initialize_megatron does: --chunk-offload-iterations auto reads the count here.
    data_parallel = parallel_state.get_data_parallel_world_size()
    global_batch = args.num_microbatches * args.micro_batch_size * data_parallel
    init_num_microbatches_calculator(rank, None, global_batch, args.micro_batch_size, data_parallel)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    shape = GPTShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        attention=args.attention,
    )
    chunks = build_gpt_chunks(
        shape,
        pipeline_parallel=args.pipeline_model_parallel_size,
        virtual_pipeline=args.virtual_pipeline_model_parallel_size,
        expert_parallel=args.expert_model_parallel_size,
        device=device,
    )
    forward_backward = get_forward_backward_func()
    # The first iteration runs without copies: the report's peak without offload.
    manager = attach_from_args(chunks, args, baseline_iterations=1, trace=True)
    if manager is not None and manager.iterations == "wrap":
        forward_backward = manager.wrap(forward_backward)
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=args.lr)
    interleaved = len(chunks) > 1
    losses = []
    for iteration in range(args.iterations):
        optimizer.zero_grad(set_to_none=True)
        batches = random_token_batches(shape, num_microbatches=args.num_microbatches, seed=args.seed, iteration=iteration, device=device)
        store = forward_backward(
            forward_step_func=gpt_forward_step,
            data_iterator=[iter(batches) for _ in chunks] if interleaved else iter(batches),
            model=chunks if interleaved else chunks[0],
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        average_data_parallel_grads(chunks)
        optimizer.step()
        if store:
            losses.append(torch.stack([d["lm loss"] for d in store]).mean().item())

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rank, losses))
    # A collective: every rank builds its own report and rank 0 gets them all.
    reports = gather_reports(manager.report()) if manager is not None and manager.config.offload else None
    if rank == 0:
        print_summary(args, gathered, reports)
    if args.save_state is not None:
        args.save_state.mkdir(parents=True, exist_ok=True)
        params = {f"chunk{i}.{n}": p.detach().cpu() for i, c in enumerate(chunks) for n, p in c.named_parameters()}
        torch.save({"rank": rank, "pp_rank": pp_rank, "losses": losses, "params": params}, args.save_state / f"rank{rank}.pt")
    if manager is not None:
        manager.close()
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()


def print_summary(args: argparse.Namespace, gathered: list, reports: list | None) -> None:
    modules = ",".join(args.chunk_offload_modules or []) or "none"
    print(
        f"PP={args.pipeline_model_parallel_size} VPP={args.virtual_pipeline_model_parallel_size or 1} "
        f"EP={args.expert_model_parallel_size} experts={args.num_experts or 0} attention={args.attention} offload={modules}"
    )
    for rank, losses in gathered:
        for iteration, loss in enumerate(losses):
            print(f"iteration {iteration + 1} loss {loss!r} (rank {rank})")
    if reports is None:
        return
    print("per-stage memory report:")
    print(format_table(reports))
    if args.chunk_offload_report is not None:
        files = write_report(reports, args.chunk_offload_report)
        written = [str(f) for f in (files.table, files.json, files.png) if f is not None]  # png: None without matplotlib
        print(f"report written to {', '.join(written)}")


if __name__ == "__main__":
    main()
