"""The Megatron-LM argument group (`add_arguments`): flag names and defaults, values and usage errors,
and composing with Megatron-LM's own parser. None of these tests needs megatron or a model."""

from __future__ import annotations

import argparse
import typing

import pytest
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadConfig
from chunk_offload.core import option
from chunk_offload.integrations.megatron import (
    ALIASES,
    ITERATION_MODES,
    OFFLOAD_MODULE_NAMES,
    add_arguments,
    attach_from_args,
    check_args,
)
from chunk_offload.integrations.megatron.args import GROUP_TITLE
from tests.integrations.megatron._args import LONG_FLAGS, SHORT_FLAGS, megatron_like_parser, parse_error, parser


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


@pytest.mark.parametrize("flag", ["--chunk-offload-min-offload-bytes", "--chunk-offload-host-pool-bytes", "--chunk-offload-group-slab-bytes"])
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
        match=r"^chunk_offload: --chunk-offload-device-budget 1MiB is never used by --chunk-offload-schedule group-start",
    ):
        attach_from_args(nn.Linear(2, 2), args)


def test_check_args_quotes_values_as_typed() -> None:
    """What the command line typed (``4MiB``, ``=2KiB``), not what it parsed to; a namespace built in
    code has no typed text and is quoted as it holds the value."""
    args = parser().parse_args(["--chunk-offload-host-budget", "4MiB", "--chunk-offload-reload-ahead-bytes=2KiB"])
    with pytest.warns(UserWarning) as caught:
        check_args(args)
    assert [str(w.message) for w in caught] == [
        "chunk_offload: --chunk-offload-host-budget 4MiB, --chunk-offload-reload-ahead-bytes 2KiB given without "
        "--chunk-offload-modules: nothing will be offloaded, so they do nothing; add --chunk-offload-modules NAMES or drop them"
    ]
    args = parser().parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-schedule", "group-start",
                                "--chunk-offload-device-budget", "600KiB"])
    with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: --chunk-offload-device-budget 600KiB is never used by "):
        check_args(args)
    built = argparse.Namespace(**{**vars(args), "chunk_offload_typed": None})
    with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: --chunk-offload-device-budget 614400 is never used by "):
        check_args(built)


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


def test_timed_reload_ahead_flag() -> None:
    """``auto`` unless given; the flag alone is ``on`` (it was a plain switch); each maps to the
    library's value (NOTE [Timed reload ahead by default] in integrations/plan_tracking.py)."""
    row = option("timed-reload-ahead")
    cases = {(): "auto", ("--chunk-offload-timed-reload-ahead",): "on", ("--chunk-offload-timed-reload-ahead", "off"): "off",
             ("--chunk-offload-timed-reload-ahead=auto",): "auto"}  # fmt: skip
    for argv, value in cases.items():
        assert parser().parse_args(list(argv)).chunk_offload_timed_reload_ahead == value, argv
    assert [row.to_field(v) for v in ("auto", "on", "off")] == ["auto", True, False]
    # The flag alone does not take the next flag as its value.
    args = parser().parse_args(["--chunk-offload-timed-reload-ahead", "--chunk-offload-schedule", "group-start"])
    assert (args.chunk_offload_timed_reload_ahead, args.chunk_offload_schedule) == ("on", "group-start")


def test_timed_reload_ahead_off_or_auto_asks_nothing_of_the_schedule() -> None:
    """Only ``on`` needs the plan: ``off`` and ``auto`` under ``group-start`` are accepted."""
    for value in ("off", "auto"):
        args = parser().parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-schedule", "group-start",
                                    "--chunk-offload-timed-reload-ahead", value])  # fmt: skip
        check_args(args)
    args = parser().parse_args(["--chunk-offload-modules", "core_attn", "--chunk-offload-schedule", "group-start",
                                "--chunk-offload-device-budget", "auto"])  # fmt: skip
    with pytest.raises(ChunkOffloadError, match="--chunk-offload-device-budget auto is never used by"):
        check_args(args)


def test_timed_reload_ahead_rejects_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), ["--chunk-offload-timed-reload-ahead", "yes"], capsys)
    assert "argument --chunk-offload-timed-reload-ahead: invalid choice: 'yes' (choose from 'auto', 'on', 'off')" in err


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


def test_group_by_rejects_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert parser().parse_args(["--chunk-offload-group-by", "layer"]).chunk_offload_group_by == "layer"
    err = parse_error(parser(), ["--chunk-offload-group-by", "block"], capsys)
    assert "argument --chunk-offload-group-by: invalid choice: 'block' (choose from 'call', 'module', 'layer')" in err


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


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "two", ""])
def test_bad_verify_count_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(parser(), ["--chunk-offload-verify", value], capsys)
    assert "--chunk-offload-verify" in err and "expected a whole number >= 1" in err and repr(value) in err


def test_verify_count() -> None:
    assert parser().parse_args(["--chunk-offload-verify", "3"]).chunk_offload_verify == 3
    assert parser().parse_args([]).chunk_offload_verify is None
