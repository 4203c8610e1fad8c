"""Run a function in real gloo ranks (spawned processes) and hand back what each rank returned.

Shared by the multi-process tests. Every rank arms ``faulthandler.dump_traceback_later``: a hang
prints every thread's stack to stderr and exits; a rank terminated because another one failed
(SIGTERM from torch) dumps its stacks too. The parent joins with a deadline of its own, kills
what is left and raises with a pointer to the stacks.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks"]


def run_ranks(target: Callable[..., Any], args: tuple = (), *, world_size: int, timeout_s: float, what: str = "ranks") -> list[Any]:
    """``[target(rank, world_size, *args) for each rank]``, each run in its own gloo rank.

    ``target`` must be picklable (a module-level function) and return a picklable value.
    """
    with tempfile.TemporaryDirectory(prefix="chunk_offload_ranks_") as out_dir:
        ctx = mp.start_processes(
            _rank_main,
            args=(world_size, _free_port(), out_dir, timeout_s, target, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s + 30.0
        try:
            while not ctx.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{what} did not finish within {timeout_s + 30:.0f} s; every rank's stacks are on stderr")
        except mp.ProcessExitedException as e:
            raise RuntimeError(
                f"rank {e.error_index} of {what} exited with code {e.exit_code} without a Python exception; "
                f"if it hung for {timeout_s:.0f} s, every rank's stacks are on stderr (faulthandler)"
            ) from e
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, timeout_s: float, target: Callable, args: tuple) -> None:
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    # When another rank fails first, torch terminates this one: dump its stacks as well.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
        )
        torch.set_num_threads(1)  # ranks share the host's cores
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = target(rank, world_size, *args)
            torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()
        faulthandler.unregister(signal.SIGTERM)
