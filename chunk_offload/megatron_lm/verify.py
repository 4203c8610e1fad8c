"""``--chunk-offload-verify N``: the job's first N iterations without and with offload, compared bit for bit.

NOTE [Verify runs]
Megatron-LM keeps its state in process globals (arguments, parallel groups, the microbatch
calculator, timers, the RNG tracker) and a training script may change things as it is imported,
so ``pretrain`` cannot run twice in one process. Each rank's launcher therefore runs the script
twice as a child process of its own, one after the other, and the child runs of all ranks form a
fresh job each time:

* the run without offload gets the command line with every ``--chunk-offload-*`` flag removed
  (no manager is attached: the strongest reference), the run with offload gets it without
  ``--chunk-offload-verify``; both without Megatron-LM's ``--save`` (a check must not write
  checkpoints). The seed, data and everything else are the user's;
* the launchers (one per rank) agree through a gloo group of their own (``torchrun``'s store, or
  ``MASTER_ADDR:MASTER_PORT``): before each run, rank 0 picks a free port that the children use as
  ``MASTER_PORT`` (rank 0's child hosts the store: ``TORCHELASTIC_USE_AGENT_STORE`` is removed),
  so the second run never meets the first one's rendezvous keys; after it, the ranks' exit
  statuses are gathered, and a failed run ends the check on every rank;
* a child (``--verify-record DIR --verify-iterations N``, hidden) records each training iteration
  (`recording.Recorder`) to a temporary folder of its launcher and ends training after the N-th
  through Megatron-LM's ``exit_interval``; it dies with its launcher (``PR_SET_PDEATHSIG`` on Linux);
* each launcher compares its rank's records (`chunk_offload.bit_identity.compare_records`), the
  results are gathered, rank 0 prints PASS or the first mismatch, and every rank exits 0 or 1.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ..bit_identity import BitIdentityResult, compare_records, merge_results
from ..core import OPTIONS
from .recording import load_record

__all__ = ["die_with_parent", "reference_args", "run_verify", "verified_args"]

logger = logging.getLogger(__name__)  # the launcher's console (cli.py) prints what it says

_PREFIX = "--chunk-offload-"
_ROWS = {row.name: row for row in OPTIONS if row.flag}
_TIMEOUT = timedelta(hours=6)  # the launchers wait in a collective only while their children finish


def _drop(args: Sequence[str], drop: Callable[[str], bool]) -> list[str]:
    """``args`` without the flags ``drop(flag)`` says yes to, their values included."""
    kept, i = [], 0
    while i < len(args):
        token = args[i]
        flag = token.split("=", 1)[0]
        if not token.startswith("--") or not drop(flag):
            kept.append(token)
            i += 1
            continue
        i += 1
        if "=" in token:
            continue
        row = _ROWS.get(flag.removeprefix(_PREFIX)) if flag.startswith(_PREFIX) else None
        if row is not None and row.kind == "switch":
            continue
        if row is not None and row.kind == "switch_or_auto":  # nargs="?": a value only if one of its choices
            i += i < len(args) and args[i] in row.choices
            continue
        if row is not None and row.kind == "module_names":  # nargs="+"
            while i < len(args) and not args[i].startswith("-"):
                i += 1
            continue
        i += 1  # one value
    return kept


def _is_ours(flag: str) -> bool:
    return flag.startswith(_PREFIX) and flag.removeprefix(_PREFIX) in _ROWS


def reference_args(args: Sequence[str]) -> list[str]:
    """The command line of the run without offload: no ``--chunk-offload-*`` flag, no ``--save``."""
    return _drop(args, lambda flag: _is_ours(flag) or flag == "--save")


def verified_args(args: Sequence[str]) -> list[str]:
    """The command line of the run with offload: no ``--chunk-offload-verify``, no ``--save``."""
    return _drop(args, lambda flag: flag in (_PREFIX + "verify", "--save"))


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the launcher that started it dies (killed by torchrun)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class _Launchers:
    """The launchers of the job's ranks, for three small exchanges (a gloo group when there are several)."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.world > 1:
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world, timeout=_TIMEOUT)

    def all_gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered

    def close(self) -> None:
        if self.world > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _child(script: str, args: list[str], folder: Path, iterations: int, port: int | None) -> int:
    """One run of the script on this rank; its exit status."""
    env = dict(os.environ)
    if port is not None:
        env["MASTER_PORT"] = str(port)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    command = [sys.executable, "-m", "chunk_offload.megatron_lm", "--verify-record", str(folder), "--verify-iterations", str(iterations)]
    return subprocess.run([*command, script, *args], env=env).returncode


def _compare(folders: list[Path], iterations: int, rank: int) -> tuple[BitIdentityResult | None, str | None]:
    """This rank's result, or why the runs cannot be compared (never raises: the other ranks wait for it)."""
    try:
        return _compare_records(folders, iterations, rank)
    except Exception as e:  # noqa: BLE001 (any failure here must reach the exchange, not leave the peers waiting)
        return None, f"the records of rank {rank} could not be compared: {type(e).__name__}: {e}"


def _compare_records(folders: list[Path], iterations: int, rank: int) -> tuple[BitIdentityResult | None, str | None]:
    result = BitIdentityResult(iterations=iterations)
    for i in range(1, iterations + 1):
        reference, offloaded = (load_record(folder, i) for folder in folders)
        if reference is None or offloaded is None:
            trained = i - 1
            return None, (
                f"the job trained {trained} of the {iterations} iterations --chunk-offload-verify {iterations} asks for on rank "
                f"{rank} (its --train-iters or --exit-interval ends it sooner); pass --chunk-offload-verify {max(trained, 1)}"
            )
        result.parameters, result.bytes_offloaded = len(reference.params), offloaded.bytes_offloaded
        if result.first_mismatch is None:
            result.first_mismatch = compare_records(reference, offloaded, rank=rank)
    return result, None


def _train_twice(launchers: _Launchers, script: str, script_args: Sequence[str], folders: list[Path], iterations: int, prog: str) -> bool:
    """The two runs, one after the other on every rank; False (said on rank 0) when one failed anywhere."""
    runs = (("without offload", reference_args(script_args)), ("with offload", verified_args(script_args)))
    first = launchers.rank == 0
    for k, ((label, args), folder) in enumerate(zip(runs, folders)):
        if first:
            logger.info("chunk-offload verify: run %d of 2, %s, %d training iterations", k + 1, label, iterations)
        given = "MASTER_PORT" in os.environ
        port = launchers.all_gather(_free_port() if first and given else None)[0]
        try:
            status = _child(script, args, folder, iterations, port)
        except OSError as e:  # reported with the exchange below, so that no rank waits for this one
            logger.error("%s: error: chunk-offload verify: cannot start the run %s: %s", prog, label, e)
            status = 1
        failed = [f"rank {r} (exit status {s})" for r, s in enumerate(launchers.all_gather(status)) if s != 0]
        if failed:
            if first:
                logger.error("%s: error: chunk-offload verify: the run %s failed on %s", prog, label, ", ".join(failed))
            return False
    return True


def _outcome(outcomes: list[tuple[BitIdentityResult | None, str | None]], prog: str, *, say: bool) -> int:
    """The exit status of the check; ``say``: report its outcome (rank 0)."""
    problems = [problem for _, problem in outcomes if problem is not None]
    if problems:
        if say:
            logger.error("%s: error: chunk-offload verify: %s", prog, problems[0])
        return 1
    result = merge_results([r for r, _ in outcomes])
    if say:
        logger.info("%s", result)
    if say and result.passed and not result.bytes_offloaded:
        logger.warning(
            "%s: warning: chunk-offload verify: the run with offload copied nothing, so two runs without copies were "
            "compared; see its summary above for why",
            prog,
        )
    return 0 if result.passed else 1


def run_verify(script: str, script_args: Sequence[str], iterations: int, *, prog: str) -> int:
    """Run the check (NOTE [Verify runs]) on this rank; the exit status, the same on every rank: 0 PASS,
    1 a mismatch, a failed run or one that ended before ``iterations``."""
    launchers = _Launchers()
    try:
        with tempfile.TemporaryDirectory(prefix="chunk-offload-verify-") as tmp:
            folders = [Path(tmp) / "without", Path(tmp) / "with"]
            if not _train_twice(launchers, script, script_args, folders, iterations, prog):
                return 1
            outcomes = launchers.all_gather(_compare(folders, iterations, launchers.rank))
    finally:
        launchers.close()
    return _outcome(outcomes, prog, say=launchers.rank == 0)
