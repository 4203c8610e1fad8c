"""`attach_from_args` and `check_args`: refusals without a model, a tiny megatron-core GPTModel on CPU
under a single-process gloo group, and flags that contradict each other or do nothing."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import warnings
from typing import Iterator

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, SchedulePolicy
from chunk_offload.integrations.megatron import add_arguments, attach_from_args
from chunk_offload.integrations.megatron import check_args
from tests._driver import Step, drive, no_pipelining
from tests.integrations.megatron._args import megatron_like_parser, parser


_HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


# ----------------------------------------------------------------------------- attach_from_args without a model


def test_attach_from_args_none_without_modules() -> None:
    args = parser().parse_args(["--chunk-offload-min-offload-bytes", "0"])
    assert attach_from_args(nn.Linear(2, 2), args) is None


def test_attach_from_args_needs_our_arguments() -> None:
    args = argparse.Namespace(offload_modules=[])
    with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: args has no .*extra_args_provider=add_arguments"):
        attach_from_args(nn.Linear(2, 2), args)


def test_verify_is_the_launchers() -> None:
    args = parser().parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-verify", "2"])
    with pytest.raises(ChunkOffloadError, match=r"--chunk-offload-verify 2 is the launcher's: .*chunk_offload.verify_bit_identity"):
        attach_from_args(nn.Linear(2, 2), args)


def test_megatron_offload_modules_alone_is_a_mixup() -> None:
    """``--offload-modules`` under Megatron-LM is Megatron's flag; without its switch it would do nothing."""
    args = add_arguments(megatron_like_parser()).parse_args(["--offload-modules", "core_attn"])
    with pytest.raises(ChunkOffloadError, match=r"Pass --chunk-offload-modules core_attn instead"):
        attach_from_args(nn.Linear(2, 2), args)


def test_megatron_own_offloading_alone_is_fine() -> None:
    args = add_arguments(megatron_like_parser()).parse_args(
        ["--fine-grained-activation-offloading", "--offload-modules", "core_attn"]
    )
    assert attach_from_args(nn.Linear(2, 2), args) is None


@pytest.mark.parametrize("switch", ["fine_grained_activation_offloading", "cpu_offloading"])
def test_both_offloading_mechanisms_refused(switch: str) -> None:
    args = add_arguments(megatron_like_parser()).parse_args(["--chunk-offload-modules", "core_attn"])
    setattr(args, switch, True)  # Megatron-LM's validate_args sets cpu_offloading from --cpu-offloading-num-layers
    with pytest.raises(ChunkOffloadError, match="cannot be combined with Megatron-LM's own activation offloading"):
        attach_from_args(nn.Linear(2, 2), args)


# ----------------------------------------------------------------------------- a real GPTModel on CPU


@contextlib.contextmanager
def _megatron_world_of_one() -> Iterator[None]:
    """cpu_compat + a one-rank gloo group + megatron's model-parallel state; all torn down on exit."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns that Apex / Transformer Engine are missing
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        from chunk_offload.devkit import cpu_compat

    if dist.is_initialized():
        pytest.fail("a torch.distributed process group is already initialised in this process (leak from another test)")
    with cpu_compat.megatron_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            parallel_state.initialize_model_parallel()
            try:
                model_parallel_cuda_manual_seed(1234)
                yield
            finally:
                get_cuda_rng_tracker().reset()
                parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()


needs_megatron = pytest.mark.skipif(not _HAS_MEGATRON, reason='megatron-core is not installed (pip install "chunk-offload[megatron]")')


@needs_megatron
def test_attach_from_args_on_tiny_moe_gpt() -> None:
    """Registration per layer and per local expert, and every option carried into the manager."""
    from tests._megatron import TinyGPTConfig, _build_chunks

    argv = [
        "--chunk-offload-modules", "core_attn,router_fc1", "attn_norm",
        "--chunk-offload-min-offload-bytes", "1",
        "--chunk-offload-host-pool-bytes", "64MiB",
        "--chunk-offload-on-exhausted", "error",
        "--chunk-offload-report", "report.json",
        "--chunk-offload-schedule", "group-start",
        "--chunk-offload-profile-ranges",
        "--chunk-offload-deterministic-memory",
        "--chunk-offload-group-slab-bytes", "0",
    ]  # fmt: skip
    args = add_arguments(megatron_like_parser()).parse_args(argv)
    with _megatron_world_of_one():
        chunks = _build_chunks(TinyGPTConfig(num_layers=2, num_experts=2))
        manager = attach_from_args(chunks, args)
        try:
            assert manager is not None
            layers = list(chunks[0].decoder.layers)
            experts = sum(len(layer.mlp.experts.local_experts) for layer in layers)
            assert (len(layers), experts) == (2, 4)
            assert manager.offload_modules == ["core_attn", "expert_fc1", "attn_norm"]
            assert manager.registered == {"core_attn": len(layers), "expert_fc1": experts, "attn_norm": len(layers)}
            assert manager.config.min_offload_bytes == 1 == manager.engine.tensor_filter.min_offload_bytes
            assert manager.config.host_pool_bytes == 64 << 20 == manager.pool.capacity_bytes
            assert manager.config.on_exhausted == "error" == manager.pool.on_exhausted
            assert manager.config.offload is True
            assert type(manager.schedule_policy) is SchedulePolicy  # group-start: the engine default, no PlanPolicy
            assert manager.baseline_iterations == 1 and manager.config.trace is True  # for the report
            assert manager.config.profile_ranges is True and manager.config.deterministic_memory is True
            assert manager.config.group_slab_bytes == 0
        finally:
            if manager is not None:
                manager.detach()
                manager.close()


@needs_megatron
@pytest.mark.parametrize("baseline", [False, True], ids=["offload", "baseline"])
def test_attach_from_args_trains_dense_gpt(baseline: bool) -> None:
    """The manager from the flags offloads (or, with --chunk-offload-baseline, only counts) in a real step."""
    from tests._megatron import TinyGPTConfig, _build_chunks

    from chunk_offload import CpuStreams

    cfg = TinyGPTConfig(num_layers=2)
    argv = ["--chunk-offload-modules", "core_attn,attn_norm", "--chunk-offload-min-offload-bytes", "1"]
    args = parser().parse_args(argv + (["--chunk-offload-baseline"] if baseline else []))
    streams = CpuStreams()
    with _megatron_world_of_one():
        chunks = _build_chunks(cfg)
        manager = attach_from_args(chunks, args, streams=streams, measure_time=False)
        try:
            assert manager is not None and manager.streams is streams
            assert manager.registered == {"core_attn": 2, "attn_norm": 2}
            assert manager.config.offload is (not baseline) and manager.config.measure_time is False
            assert manager.config.host_pool_bytes is None and manager.config.on_exhausted == "fallback"
            assert manager.config.group_by == "layer" and manager.config.layer_group_bytes == 16 << 20

            gen = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_length), generator=gen)
            positions = torch.arange(cfg.seq_length).expand(cfg.micro_batch_size, -1)
            with manager.iteration():
                chunks[0](tokens, positions, None, labels=tokens).float().mean().backward()
            stats = manager.stats()
            # The default groups, bounded layer groups: a tiny layer's two modules (under 16 MiB) form
            # one group per layer call, named by them in call order.
            assert list(stats.groups) == ["attn_norm+core_attn"]
            for name in stats.groups:
                g = stats.groups[name]
                assert g.groups == 2, (name, g)
                if baseline:
                    assert g.bytes_offloaded == 0 and g.bytes_reloaded == 0, (name, g)
                else:
                    assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (name, g)
            assert stats.peak_saved_bytes > 0
            assert stats.resident_bytes == 0 and stats.host_bytes == 0 and manager.live_chunks() == []
        finally:
            if manager is not None:
                manager.detach()
                manager.close()


def _float_mean(per_token_loss: torch.Tensor) -> torch.Tensor:
    return per_token_loss.float().mean()


@needs_megatron
def test_attach_from_args_auto_iterations_on_dense_gpt() -> None:
    """--chunk-offload-iterations auto: no wrap, no iteration(); the count comes from Megatron's calculator."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator, unset_num_microbatches_calculator

    from tests._megatron import TinyGPTConfig, _build_chunks

    cfg = TinyGPTConfig(num_layers=2)
    argv = ["--chunk-offload-modules", "core_attn", "--chunk-offload-min-offload-bytes", "1", "--chunk-offload-iterations", "auto"]
    # PP=1: every backward follows its forward, so the plan would keep every chunk; group-start offloads them.
    args = parser().parse_args([*argv, "--chunk-offload-schedule", "group-start"])
    microbatches = 2
    with _megatron_world_of_one():
        chunks = _build_chunks(cfg)
        init_num_microbatches_calculator(0, None, microbatches * cfg.micro_batch_size, cfg.micro_batch_size, 1)
        manager = attach_from_args(chunks, args)
        try:
            assert manager is not None and manager.iterations == "auto"
            gen = torch.Generator().manual_seed(0)
            positions = torch.arange(cfg.seq_length).expand(cfg.micro_batch_size, -1)

            def tokens(iteration: int, microbatch: int) -> torch.Tensor:
                return torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_length), generator=gen)

            def forward(chunk: torch.nn.Module, tokens: torch.Tensor, step: Step) -> torch.Tensor:
                return chunk(tokens, positions, None, labels=tokens)

            # Megatron's no-pipelining schedule: forward and backward in turn; the chunk hooks open the chunks.
            order = no_pipelining(microbatches)
            drive(chunks[0], inputs=tokens, order=order, forward=forward, loss=_float_mean, params=[], lr=None)
            assert manager.training_calls == 0  # open until the next forward or end_iteration()
            manager.end_iteration()
            assert manager.training_calls == 1
            assert manager.observed_order == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
            g = manager.last_iteration.groups["core_attn"]
            assert g.groups == 2 * microbatches and g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded
        finally:
            unset_num_microbatches_calculator()
            if manager is not None:
                manager.detach()
                manager.close()


@pytest.mark.parametrize("budget", ["--chunk-offload-prefetch-bytes", "--chunk-offload-reload-ahead-bytes"])
def test_group_start_refuses_plan_budgets(budget: str) -> None:
    args = parser().parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-schedule", "group-start", budget, "2MiB"])
    with pytest.raises(
        ChunkOffloadError,
        match=rf"^chunk_offload: {budget} 2MiB is never used by --chunk-offload-schedule group-start, which reloads "
        r"each group when backward reaches the group after it; use --chunk-offload-schedule plan \(the default\) or drop it$",
    ):
        attach_from_args([torch.nn.Linear(2, 2)], args)


# ----------------------------------------------------------------------------- flags that contradict or do nothing (check_args)

_BUDGET_ARGS = [
    ["--chunk-offload-device-budget", "1MiB"],
    ["--chunk-offload-device-budget", "auto"],
    ["--chunk-offload-host-budget", "1GiB"],
    ["--chunk-offload-host-pool-bytes", "1GiB"],
    ["--chunk-offload-prefetch-bytes", "0"],
    ["--chunk-offload-reload-ahead-bytes", "1MiB"],
]


@pytest.mark.parametrize("budget", _BUDGET_ARGS)
def test_budget_flags_without_modules_are_a_usage_error_at_the_command_line(budget, capsys) -> None:
    p = parser()
    args = p.parse_args(budget)
    with pytest.raises(SystemExit) as info:
        check_args(args, p)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{budget[0]} " in err and "given without --chunk-offload-modules: nothing will be offloaded" in err


@pytest.mark.parametrize("budget", _BUDGET_ARGS)
def test_budget_flags_without_modules_warn_in_the_library(budget) -> None:
    args = parser().parse_args(budget)
    with pytest.warns(UserWarning, match=rf"^chunk_offload: {budget[0]} .* given without --chunk-offload-modules: nothing will"):
        assert attach_from_args(nn.Linear(2, 2), args) is None


def test_several_plan_flags_under_group_start_are_named_together(capsys) -> None:
    p = parser()
    args = p.parse_args(
        ["--chunk-offload-modules", "core_attn", "--chunk-offload-schedule", "group-start",
         "--chunk-offload-prefetch-bytes", "1MiB", "--chunk-offload-device-budget", "auto"]
    )  # fmt: skip
    with pytest.raises(SystemExit):
        check_args(args, p)
    err = capsys.readouterr().err
    assert "--chunk-offload-prefetch-bytes 1MiB, --chunk-offload-device-budget auto is never used by" in err
    assert "drop them" in err


def test_budget_flags_with_a_baseline_run_warn_that_nothing_uses_them() -> None:
    args = parser().parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-baseline", "--chunk-offload-device-budget", "1MiB"])
    with pytest.warns(UserWarning, match=r"--chunk-offload-device-budget 1MiB with --chunk-offload-baseline, which copies nothing"):
        check_args(args, parser())


def test_plain_flags_pass_the_checks_quietly() -> None:
    p = parser()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_args(p.parse_args([]), p)
        check_args(p.parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-device-budget", "1MiB"]), p)
        check_args(p.parse_args(["--chunk-offload-min-offload-bytes", "0"]), p)
