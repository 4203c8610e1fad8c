"""The Megatron-LM argument group (`add_arguments`) and `attach_from_args`, in one process.

Parsing tests need neither megatron nor a model. The last test builds a tiny megatron-core
GPTModel (MoE, 2 layers, 2 experts) on CPU under a single-process gloo group.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import typing
import warnings
from typing import Iterator

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadConfig, SchedulePolicy
from chunk_offload.integrations.megatron import ALIASES, ITERATION_MODES, OFFLOAD_MODULE_NAMES, add_arguments, attach_from_args
from chunk_offload.integrations.megatron import check_args
from chunk_offload.integrations.megatron.args import GROUP_TITLE

_HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None

LONG_FLAGS = (
    "--chunk-offload-modules",
    "--chunk-offload-min-offload-bytes",
    "--chunk-offload-host-pool-bytes",
    "--chunk-offload-on-exhausted",
    "--chunk-offload-baseline",
    "--chunk-offload-report",
    "--chunk-offload-schedule",
    "--chunk-offload-prefetch-bytes",
    "--chunk-offload-reload-ahead-bytes",
    "--chunk-offload-iterations",
    "--chunk-offload-device-budget",
    "--chunk-offload-host-budget",
    "--chunk-offload-profile-ranges",
)
SHORT_FLAGS = tuple(flag.replace("--chunk-offload-", "--offload-") for flag in LONG_FLAGS)
"""Spellings that 0.1.0 never released and that no longer exist."""


def parser() -> argparse.ArgumentParser:
    # Megatron-LM builds its parser with allow_abbrev=False; do the same.
    return add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False))


def megatron_like_parser() -> argparse.ArgumentParser:
    """The flags of Megatron-LM's own offloading, as its `parse_args` defines them before ours."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    p.add_argument("--fine-grained-activation-offloading", action="store_true")
    p.add_argument("--offload-modules", nargs="+", type=str, default=[])
    p.add_argument("--min-offloaded-tensor-size", type=int, default=1024 * 1024)
    p.add_argument("--cpu-offloading-num-layers", type=int, default=0)
    return p


def parse_error(p: argparse.ArgumentParser, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Parse ``argv`` expecting argparse's usage error; return its stderr."""
    with pytest.raises(SystemExit) as exc:
        p.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- parsing


def test_defaults_follow_offload_config() -> None:
    args = parser().parse_args([])
    defaults = OffloadConfig()
    assert args.chunk_offload_modules is None
    assert args.chunk_offload_min_offload_bytes == defaults.min_offload_bytes == 1 << 20
    assert args.chunk_offload_host_pool_bytes is None
    assert args.chunk_offload_on_exhausted == defaults.on_exhausted == "fallback"
    assert args.chunk_offload_baseline is False
    assert args.chunk_offload_report is None


def test_group_and_return_value() -> None:
    p = argparse.ArgumentParser()
    assert add_arguments(p) is p
    group = next(g for g in p._action_groups if g.title == GROUP_TITLE)
    flags = {o for a in group._group_actions for o in a.option_strings}
    assert flags == set(LONG_FLAGS)


@pytest.mark.parametrize("flag", SHORT_FLAGS)
def test_no_short_spellings(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Only --chunk-offload-* exists, with or without Megatron-LM's own --offload-* flags."""
    assert flag not in parser()._option_string_actions
    err = parse_error(parser(), [flag, "1"], capsys)
    assert f"unrecognized arguments: {flag}" in err


def test_flag_names_match_offload_config() -> None:
    """Every byte or choice flag is named after the OffloadConfig field it sets."""
    fields = set(typing.get_type_hints(OffloadConfig))
    for name in ("min_offload_bytes", "host_pool_bytes", "on_exhausted"):
        assert name in fields and "--chunk-offload-" + name.replace("_", "-") in LONG_FLAGS


def test_on_exhausted_choices_match_offload_config() -> None:
    action = parser()._option_string_actions["--chunk-offload-on-exhausted"]
    literal = typing.get_type_hints(OffloadConfig)["on_exhausted"]
    assert tuple(action.choices) == typing.get_args(literal)


def test_modules_comma_list_with_alias() -> None:
    args = parser().parse_args(["--chunk-offload-modules", "core_attn,router_fc1, qkv_linear"])
    assert args.chunk_offload_modules == ["core_attn", "expert_fc1", "qkv_linear"]


def test_modules_space_separated_and_repeats() -> None:
    args = parser().parse_args(["--chunk-offload-modules", "core_attn", "expert_fc1,router_fc1", "core_attn"])
    assert args.chunk_offload_modules == ["core_attn", "expert_fc1"]


def test_modules_equals_form_and_last_flag_wins() -> None:
    args = parser().parse_args(["--chunk-offload-modules=attn_norm", "--chunk-offload-modules=mlp_fc1,moe_act"])
    assert args.chunk_offload_modules == ["mlp_fc1", "moe_act"]


def test_unknown_module_lists_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), ["--chunk-offload-modules", "core_attn,flash_attn"], capsys)
    assert "--chunk-offload-modules" in err and "'flash_attn'" in err
    for name in (*OFFLOAD_MODULE_NAMES, *ALIASES):
        assert name in err, name


def test_empty_module_list_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), ["--chunk-offload-modules", ","], capsys)
    assert "no offload module given" in err


@pytest.mark.parametrize("flag", ["--chunk-offload-min-offload-bytes", "--chunk-offload-host-pool-bytes"])
@pytest.mark.parametrize("value", ["-1", "-1048576", "1.5", "one", "1MB", "1 mib x"])
def test_bad_byte_counts_rejected(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), [flag, value], capsys)
    assert flag in err and "byte count >= 0" in err and repr(value) in err


@pytest.mark.parametrize(
    "value, expected", [("0", 0), ("4096", 4096), ("512KiB", 512 << 10), ("1MiB", 1 << 20), ("64gib", 64 << 30), ("2TiB", 2 << 40)]
)
def test_byte_counts(value: str, expected: int) -> None:
    args = parser().parse_args(["--chunk-offload-min-offload-bytes", value, "--chunk-offload-host-pool-bytes", value])
    assert args.chunk_offload_min_offload_bytes == expected
    assert args.chunk_offload_host_pool_bytes == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "60GB", "automatic", "600 KiB x", ""])
def test_bad_device_budget_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), ["--chunk-offload-device-budget", value], capsys)
    assert "--chunk-offload-device-budget" in err and "expected 'auto' or a byte count >= 0" in err and repr(value) in err


@pytest.mark.parametrize("value", ["-1", "auto", "2 GB", "x"])
def test_bad_host_budget_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), ["--chunk-offload-host-budget", value], capsys)
    assert "--chunk-offload-host-budget" in err and "byte count >= 0" in err and repr(value) in err


def test_budget_flags() -> None:
    assert (parser().parse_args([]).chunk_offload_device_budget, parser().parse_args([]).chunk_offload_host_budget) == (None, None)
    args = parser().parse_args(["--chunk-offload-device-budget", "600KiB", "--chunk-offload-host-budget", "64GiB"])
    assert (args.chunk_offload_device_budget, args.chunk_offload_host_budget) == (600 << 10, 64 << 30)
    assert parser().parse_args(["--chunk-offload-device-budget", "AUTO"]).chunk_offload_device_budget == "auto"


def test_device_budget_needs_the_plan() -> None:
    args = parser().parse_args(
        ["--chunk-offload-modules", "core_attn", "--chunk-offload-schedule", "group-start", "--chunk-offload-device-budget", "1MiB"]
    )
    with pytest.raises(
        ChunkOffloadError,
        match=r"^chunk_offload: --chunk-offload-device-budget 1048576 is never used by --chunk-offload-schedule group-start",
    ):
        attach_from_args(nn.Linear(2, 2), args)


def test_on_exhausted_baseline_report() -> None:
    args = parser().parse_args(
        ["--chunk-offload-on-exhausted", "error", "--chunk-offload-baseline", "--chunk-offload-report", "out/report.json"]
    )
    assert args.chunk_offload_on_exhausted == "error"
    assert args.chunk_offload_baseline is True
    assert args.chunk_offload_report == "out/report.json"


def test_profile_ranges_flag() -> None:
    assert parser().parse_args([]).chunk_offload_profile_ranges is False
    assert parser().parse_args(["--chunk-offload-profile-ranges"]).chunk_offload_profile_ranges is True


def test_schedule_flags() -> None:
    args = parser().parse_args([])
    assert args.chunk_offload_schedule == "plan" and args.chunk_offload_prefetch_bytes is None
    args = parser().parse_args(["--chunk-offload-schedule", "group-start", "--chunk-offload-prefetch-bytes", "2MiB", "--chunk-offload-reload-ahead-bytes", "1GiB"])
    assert args.chunk_offload_schedule == "group-start" and args.chunk_offload_prefetch_bytes == 2 << 20
    assert args.chunk_offload_reload_ahead_bytes == 1 << 30


def test_schedule_rejects_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--chunk-offload-schedule", "zero-bubble"])
    assert "invalid choice: 'zero-bubble' (choose from 'plan', 'group-start')" in capsys.readouterr().err


def test_iterations_flag() -> None:
    assert parser().parse_args([]).chunk_offload_iterations == "wrap"
    assert parser().parse_args(["--chunk-offload-iterations", "auto"]).chunk_offload_iterations == "auto"
    assert tuple(parser()._option_string_actions["--chunk-offload-iterations"].choices) == ITERATION_MODES == ("wrap", "auto")


def test_iterations_rejects_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), ["--chunk-offload-iterations", "manual"], capsys)
    assert "invalid choice: 'manual' (choose from 'wrap', 'auto')" in err


def test_on_exhausted_rejects_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), ["--chunk-offload-on-exhausted", "wait"], capsys)
    assert "invalid choice: 'wait'" in err


def test_report_help_says_where_the_report_goes() -> None:
    help_text = " ".join(parser().format_help().split())
    assert "--chunk-offload-report PATH" in help_text
    assert "per-stage memory report will be written" in help_text


# ----------------------------------------------------------------------------- composing with Megatron-LM


def test_composes_with_megatron_offload_flags() -> None:
    """Megatron-LM's parser already has --offload-modules: ours must not collide, or shadow it."""
    p = megatron_like_parser()
    assert add_arguments(p) is p  # no "conflicting option string"
    for flag in SHORT_FLAGS:
        assert flag == "--offload-modules" or flag not in p._option_string_actions, flag
    assert p._option_string_actions["--offload-modules"].dest == "offload_modules"  # still Megatron's
    args = p.parse_args(
        [
            "--offload-modules", "core_attn", "attn_norm",
            "--chunk-offload-modules", "qkv_linear,router_fc1",
            "--chunk-offload-min-offload-bytes", "0",
            "--chunk-offload-host-pool-bytes", "1GiB",
            "--chunk-offload-on-exhausted", "error",
            "--min-offloaded-tensor-size", "7",
        ]
    )  # fmt: skip
    assert args.offload_modules == ["core_attn", "attn_norm"]
    assert args.min_offloaded_tensor_size == 7
    assert args.chunk_offload_modules == ["qkv_linear", "expert_fc1"]
    assert args.chunk_offload_min_offload_bytes == 0
    assert args.chunk_offload_host_pool_bytes == 1 << 30
    assert args.chunk_offload_on_exhausted == "error"


def test_short_spelling_under_megatron_is_megatrons(capsys: pytest.CaptureFixture[str]) -> None:
    p = add_arguments(megatron_like_parser())
    err = parse_error(p, ["--offload-min-offload-bytes", "0"], capsys)
    assert "unrecognized arguments: --offload-min-offload-bytes" in err


def test_extra_args_provider_protocol() -> None:
    """Megatron-LM's parse_args: ``parser = extra_args_provider(parser)``, then parse."""
    extra_args_provider = add_arguments
    p = extra_args_provider(megatron_like_parser())
    args, unknown = p.parse_known_args(["--chunk-offload-modules", "core_attn", "--not-ours", "1"])
    assert args.chunk_offload_modules == ["core_attn"] and unknown == ["--not-ours", "1"]


def test_adding_twice_is_an_error() -> None:
    p = parser()
    with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: the parser already defines .*--chunk-offload-modules"):
        add_arguments(p)


def test_add_arguments_rejects_non_parsers() -> None:
    with pytest.raises(ChunkOffloadError, match="argparse.ArgumentParser"):
        add_arguments(object())  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- attach_from_args without a model


def test_attach_from_args_none_without_modules() -> None:
    args = parser().parse_args(["--chunk-offload-min-offload-bytes", "0"])
    assert attach_from_args(nn.Linear(2, 2), args) is None


def test_attach_from_args_needs_our_arguments() -> None:
    args = argparse.Namespace(offload_modules=[])
    with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: args has no .*extra_args_provider=add_arguments"):
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
            assert manager.config.min_offload_bytes == 1 == manager.engine.policy.min_offload_bytes
            assert manager.config.host_pool_bytes == 64 << 20 == manager.pool.capacity_bytes
            assert manager.config.on_exhausted == "error" == manager.pool.on_exhausted
            assert manager.config.offload is True
            assert type(manager.schedule_policy) is SchedulePolicy  # group-start: the engine default, no PlanPolicy
            assert manager.baseline_iterations == 1 and manager.config.trace is True  # for the report
            assert manager.config.profile_ranges is True
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

            gen = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_length), generator=gen)
            positions = torch.arange(cfg.seq_length).expand(cfg.micro_batch_size, -1)
            with manager.iteration():
                chunks[0](tokens, positions, None, labels=tokens).float().mean().backward()
            stats = manager.stats()
            for name in ("core_attn", "attn_norm"):
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
            for _ in range(microbatches):  # megatron's no-pipelining schedule: forward and backward in turn
                tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_length), generator=gen)
                chunks[0](tokens, positions, None, labels=tokens).float().mean().backward()
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
        match=rf"^chunk_offload: {budget} 2097152 is never used by --chunk-offload-schedule group-start, which reloads "
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
    assert "--chunk-offload-prefetch-bytes 1048576, --chunk-offload-device-budget auto is never used by" in err
    assert "drop them" in err


def test_budget_flags_with_a_baseline_run_warn_that_nothing_uses_them() -> None:
    args = parser().parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-baseline", "--chunk-offload-device-budget", "1MiB"])
    with pytest.warns(UserWarning, match=r"--chunk-offload-device-budget 1048576 with --chunk-offload-baseline, which copies nothing"):
        check_args(args, parser())


def test_plain_flags_pass_the_checks_quietly() -> None:
    p = parser()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_args(p.parse_args([]), p)
        check_args(p.parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-device-budget", "1MiB"]), p)
        check_args(p.parse_args(["--chunk-offload-min-offload-bytes", "0"]), p)
