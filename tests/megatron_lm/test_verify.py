"""``--chunk-offload-verify N`` without Megatron-LM: the command lines of the two runs, and the
launcher's side of the check (`run_verify`) over child runs that write their records directly,
one rank: PASS, a mismatch, a failed run, a job shorter than N, a run that copied nothing.
The real runs are in test_launcher_v019.py (megatron.training needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunk_offload.bit_identity import StepRecord
from chunk_offload.megatron_lm import verify
from chunk_offload.megatron_lm.recording import save_record
from chunk_offload.megatron_lm.cli import _console
from chunk_offload.megatron_lm.verify import reference_args, run_verify, verified_args

PROG = "python -m chunk_offload.megatron_lm"
ARGV = [
    "--num-layers", "2", "--chunk-offload-modules", "core_attn", "qkv_linear", "--chunk-offload-baseline",
    "--chunk-offload-min-offload-bytes=0", "--save", "/ckpt", "--save-interval", "5", "--chunk-offload-verify", "3",
    "--chunk-offload-report", "r", "--save=/other", "--seed", "7",
]


def test_the_run_without_offload_has_no_flag_of_ours_and_neither_run_saves() -> None:
    assert reference_args(ARGV) == ["--num-layers", "2", "--save-interval", "5", "--seed", "7"]
    assert verified_args(ARGV) == [
        "--num-layers", "2", "--chunk-offload-modules", "core_attn", "qkv_linear", "--chunk-offload-baseline",
        "--chunk-offload-min-offload-bytes=0", "--save-interval", "5", "--chunk-offload-report", "r", "--seed", "7",
    ]


def test_the_flags_own_values_go_with_it_and_nothing_else() -> None:
    """``--chunk-offload-timed-reload-ahead`` takes a value only if one of its choices follows."""
    argv = ["--chunk-offload-timed-reload-ahead", "off", "--seed", "7", "--chunk-offload-timed-reload-ahead", "--num-layers", "2"]
    assert reference_args(argv) == ["--seed", "7", "--num-layers", "2"]
    assert reference_args(["--chunk-offload-timed-reload-ahead"]) == []


def _fake_runs(monkeypatch, *, statuses=(0, 0), trained=(3, 3), corrupt: str | None = None, moved: int = 100) -> list:
    """`verify._child` replaced: run k returns ``statuses[k]`` after recording ``trained[k]`` iterations;
    the run with offload has ``corrupt`` (a parameter name) changed from iteration 2 on."""
    calls = []

    def child(script: str, args: list[str], folder: Path, iterations: int, port: int | None) -> int:
        k = len(calls)
        calls.append((args, port))
        folder.mkdir(parents=True)
        for i in range(1, trained[k] + 1):
            params = {"w": torch.full((2,), float(i)), "b": torch.zeros(3)}
            if k == 1 and corrupt and i >= 2:
                params[corrupt] = params[corrupt] + 0.25
            losses = {"loss[0]['lm loss']": torch.tensor([float(i), 4.0])}
            save_record(folder, StepRecord(iteration=i, losses=losses, params=params, bytes_offloaded=(None, moved * i)[k]))
        return statuses[k]

    monkeypatch.setattr(verify, "_child", child)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    return calls


def _verify(iterations: int) -> int:
    """`run_verify` with the launcher's console, which prints what it logs (stdout, stderr)."""
    with _console():
        return run_verify("train.py", ARGV, iterations, prog=PROG)


def test_pass(monkeypatch, capsys) -> None:
    calls = _fake_runs(monkeypatch)
    assert _verify(3) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "chunk-offload verify: run 1 of 2, without offload, 3 training iterations",
        "chunk-offload verify: run 2 of 2, with offload, 3 training iterations",
        "chunk-offload verify: PASS (3 iterations, 1 rank, 2 parameters compared, 300 bytes offloaded)",
    ]
    assert [args for args, _ in calls] == [reference_args(ARGV), verified_args(ARGV)]
    assert all(port not in (None, 29500) for _, port in calls)  # a fresh rendezvous per run


def test_mismatch(monkeypatch, capsys) -> None:
    _fake_runs(monkeypatch, corrupt="b")
    assert _verify(3) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "chunk-offload verify: MISMATCH at iteration 2, rank 0, parameter b: max abs difference 0.25"


def test_a_failed_run_ends_the_check(monkeypatch, capsys) -> None:
    calls = _fake_runs(monkeypatch, statuses=(3, 0))
    assert _verify(3) == 1
    assert len(calls) == 1
    assert capsys.readouterr().err == f"{PROG}: error: chunk-offload verify: the run without offload failed on rank 0 (exit status 3)\n"


def test_a_job_shorter_than_n(monkeypatch, capsys) -> None:
    _fake_runs(monkeypatch, trained=(2, 2))
    assert _verify(3) == 1
    assert capsys.readouterr().err == (
        f"{PROG}: error: chunk-offload verify: the job trained 2 of the 3 iterations --chunk-offload-verify 3 asks for on rank 0 "
        "(its --train-iters or --exit-interval ends it sooner); pass --chunk-offload-verify 2\n"
    )


def test_a_pass_that_copied_nothing_warns(monkeypatch, capsys) -> None:
    _fake_runs(monkeypatch, moved=0)
    assert _verify(3) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1].endswith("2 parameters compared, 0 bytes offloaded)")
    assert captured.err.startswith(f"{PROG}: warning: chunk-offload verify: the run with offload copied nothing")
