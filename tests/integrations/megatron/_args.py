"""Parsers and flag lists shared by tests/integrations/megatron/test_args.py and test_from_args.py."""

from __future__ import annotations

import argparse

import pytest

from chunk_offload.integrations.megatron import add_arguments


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
    "--chunk-offload-timed-reload-ahead",
    "--chunk-offload-iterations",
    "--chunk-offload-device-budget",
    "--chunk-offload-host-budget",
    "--chunk-offload-profile-ranges",
    "--chunk-offload-deterministic-memory",
    "--chunk-offload-group-by",
    "--chunk-offload-layer-group-bytes",
    "--chunk-offload-group-slab-bytes",
    "--chunk-offload-plan",
    "--chunk-offload-verify",
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
