"""`chunk_offload.verify_bit_identity` on a pipelined job (the `_pipe` model and schedules), in gloo ranks."""

from __future__ import annotations

import torch

from chunk_offload import BitIdentityResult, OffloadConfig, TrainingJob, all_gather_results, verify_bit_identity
from chunk_offload.integrations.pipelining import attach

from ..._spawn import run_ranks
from ._pipe import ITERATIONS, OFFLOAD_MODULES, _batches, _build

__all__ = ["spawn_verify"]


def spawn_verify(schedule: str, corrupt: list[int | None], *, world_size: int = 2, timeout_s: float = 150.0) -> list[list[tuple]]:
    """`chunk_offload.verify_bit_identity` of ``schedule`` once per entry of ``corrupt`` (None, or the
    0-based iteration before whose optimizer step the run with offload zeroes one gradient element of
    the last stage). ``results[rank][k]``: (every rank's merged result, the values zeroed, their parameter)."""
    return run_ranks(_rank_verify, (schedule, corrupt), world_size=world_size, timeout_s=timeout_s, what="pipelining ranks")


def _rank_verify(rank: int, world_size: int, schedule_name: str, corrupt: list[int | None]) -> list[tuple[BitIdentityResult, list[float], str]]:
    found = []
    for corrupt_at in corrupt:
        replaced: list[float] = []
        names: list[str] = []

        def build(offload: bool) -> TrainingJob:
            schedule, stages, num_stages = _build(schedule_name, rank, world_size)
            manager = attach(schedule, OFFLOAD_MODULES, config=OffloadConfig(min_offload_bytes=0)) if offload else None
            optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.05)
            first, last = stages[0].stage_index == 0, stages[-1].stage_index == num_stages - 1
            names.append(f"{len(stages) - 1}." * (len(stages) > 1) + f"{len(stages[-1].submod) - 1}.mlp_fc1.weight")

            def step(i: int) -> list[torch.Tensor]:
                optimizer.zero_grad(set_to_none=True)
                x, y = _batches(i)
                losses: list[torch.Tensor] = []
                schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
                if offload and last and i == corrupt_at:
                    grad = stages[-1].submod[-1].mlp_fc1.weight.grad
                    replaced.append(grad[0, 0].item())
                    grad[0, 0] = 0.0
                optimizer.step()
                return losses

            close = None if manager is None else (lambda: (manager.detach(), manager.close()))
            return TrainingJob(step=step, modules=[s.submod for s in stages], optimizer=optimizer, manager=manager, close=close)

        result = all_gather_results(verify_bit_identity(build, iterations=ITERATIONS))
        found.append((result, replaced, names[-1]))
    return found
