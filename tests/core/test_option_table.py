"""The option table (`chunk_offload.core.OPTIONS`): one row per option, and everything read from it
agrees with it: `OffloadConfig`'s fields and defaults, `ScheduleOptions`', the launcher's flags and
the planner's offload flags; each kind's check names the field, the value and what is accepted."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from chunk_offload import ChunkOffloadError, OffloadConfig
from chunk_offload.core import OPTIONS, check_value, option, parse_bytes
from chunk_offload.integrations.megatron import add_arguments
from chunk_offload.integrations.options import ScheduleOptions
from chunk_offload.planner.cli import build_parser


@pytest.mark.parametrize("owner", [OffloadConfig, ScheduleOptions])
def test_every_field_has_one_row_with_its_default(owner: type) -> None:
    rows = [row for row in OPTIONS if row.owner == owner.__name__]
    assert sorted(row.field_name for row in rows) == sorted(f.name for f in dataclasses.fields(owner))
    defaults = owner()
    for row in rows:
        assert row.to_field(row.default) == getattr(defaults, row.field_name), row


def test_names_and_destinations_are_unique() -> None:
    assert len({row.name for row in OPTIONS}) == len({row.dest for row in OPTIONS}) == len(OPTIONS)
    assert all(not row.choices or row.default in row.choices for row in OPTIONS)


def test_the_launcher_has_one_flag_per_row_with_its_default_and_help() -> None:
    parser = add_arguments(argparse.ArgumentParser())
    actions = {a.dest: a for a in parser._actions}
    flagged = [row for row in OPTIONS if row.flag]
    assert {row.dest for row in flagged} <= set(actions)
    assert not {row.dest for row in OPTIONS if not row.flag} & set(actions)
    for row in flagged:
        action = actions[row.dest]
        assert action.option_strings == ["--chunk-offload-" + row.name]
        assert action.default == row.default and action.help.startswith(row.help.split("{")[0]), row
        if row.kind == "choice":
            assert tuple(action.choices) == row.choices


def test_the_planner_reads_the_same_rows() -> None:
    plan = build_parser().plan_parser
    actions = {a.dest: a for a in plan._actions}
    assert actions["min_offload_bytes"].default == option("min-offload-bytes").default == OffloadConfig().min_offload_bytes
    assert actions["min_offload_bytes"].type("2MiB") == 2 << 20
    assert tuple(actions["schedule"].choices) == option("schedule").choices and actions["schedule"].default == "plan"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("min-offload-bytes", -1, r"^chunk_offload: min_offload_bytes must be an int number of bytes >= 0, got -1"),
        ("min-offload-bytes", None, r"min_offload_bytes must be an int number of bytes >= 0, got None"),
        ("host-pool-bytes", float("inf"), r"host_pool_bytes must be an int number of bytes >= 0 or None \(not nan or inf\), got inf"),
        ("device-budget", "Auto", r"device_budget_bytes must be an int number of bytes >= 0, 'auto' .* got 'Auto'"),
        ("on-exhausted", "wait", r"on_exhausted='wait' is not valid; choose one of \('fallback', 'error'\)"),
        ("profile-ranges", "yes", r"profile_ranges must be True or False, got 'yes'"),
        ("report", 3, r"chunk_offload_report must be a path \(str\) or None, got 3"),
        ("verify", 0, r"chunk_offload_verify must be an int count >= 1 or None, got 0"),
        ("verify", True, r"chunk_offload_verify must be an int count >= 1 or None, got True"),
    ],
)
def test_each_kind_refuses_with_the_field_the_value_and_what_is_accepted(name: str, value: object, message: str) -> None:
    with pytest.raises(ChunkOffloadError, match=message):
        check_value(option(name), value)


@pytest.mark.parametrize(("name", "value"), [("host-pool-bytes", None), ("device-budget", "auto"), ("prefetch-bytes", 0), ("schedule", "group-start"), ("verify", 2), ("verify", None)])
def test_accepted_values_pass_through(name: str, value: object) -> None:
    assert check_value(option(name), value) == value


def test_config_validation_is_the_table_check() -> None:
    with pytest.raises(ChunkOffloadError, match=r"deterministic_memory must be True or False, got 1"):
        OffloadConfig(deterministic_memory=1).validate()


@pytest.mark.parametrize(("text", "expected"), [("0", 0), ("512KiB", 512 << 10), (" 3 gib ", 3 << 30)])
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["-1", "1.5MiB", "1MB", ""])
def test_parse_bytes_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=rf"expected a byte count >= 0 .*got {text!r}"):
        parse_bytes(text)


def test_unknown_option_lists_the_options() -> None:
    with pytest.raises(KeyError, match=r"no option 'min-bytes'; options: \["):
        option("min-bytes")
