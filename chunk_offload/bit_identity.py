"""`verify_bit_identity`: train a job's first iterations twice, without and with offload, and compare bit for bit.

What a user runs to check, on their own model and schedule, the guarantee the test suite checks on
ours: losses, gradients and parameters are bit-identical with and without offload. The job is
given as a factory, ``build(offload) -> TrainingJob``, which builds a fresh model, optimizer and
(with ``offload=True``) the manager: an `OffloadManager` with its scopes, or
``chunk_offload.integrations.pipelining.attach`` over a schedule. Each run starts from the same
seed. Per iteration the record is every loss the step returns, every parameter's gradient just
before the optimizer steps and every parameter after it (`StepRecord`); records are compared as
bytes (``-0.0`` and ``0.0`` differ, equal NaNs agree), and the first difference is reported as a
`Mismatch`: iteration, rank, what and its largest absolute difference.

The launcher's ``--chunk-offload-verify N`` (``python -m chunk_offload.megatron_lm``) records the
same `StepRecord` in two child runs of a Megatron-LM job and compares them with `compare_records`.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .core import ChunkOffloadError

__all__ = [
    "BitIdentityResult",
    "Mismatch",
    "StepRecord",
    "TrainingJob",
    "all_gather_results",
    "compare_records",
    "flatten_losses",
    "merge_results",
    "verify_bit_identity",
]


class _Counted(Protocol):
    def stats(self) -> Any: ...


@dataclass(kw_only=True, slots=True)
class TrainingJob:
    """One run of the job `verify_bit_identity` trains: what ``build(offload)`` returns."""

    step: Callable[[int], Any]
    """Trains iteration ``i`` (0-based): forwards, backwards and the optimizer step. Returns its
    losses: a tensor, a number, any nesting of lists, tuples and dicts of them, or None (a pipeline
    rank that computes no loss)."""
    modules: nn.Module | Sequence[nn.Module]
    """The modules whose named parameters are compared (this rank's model chunks or stages)."""
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None
    """Gradients are recorded when it steps (a step pre-hook). None: they are read after ``step``
    returns, which must then leave them in ``.grad``."""
    manager: _Counted | None = None
    """The run's manager (the offload run's; None in the other), whose ``stats()`` say how many
    bytes were copied: a check in which nothing moved proves little."""
    close: Callable[[], None] | None = None
    """Called after the run's last iteration, also when it stops early (e.g. ``manager.close``)."""


@dataclass(kw_only=True, slots=True)
class StepRecord:
    """What one rank's run looked like after one training iteration (CPU copies)."""

    iteration: int
    """1-based, as training logs count."""
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Loss name (`flatten_losses`) -> value."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameter name -> gradient before the optimizer step (absent: it had none)."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameter name -> value after the optimizer step."""
    bytes_offloaded: int | None = None
    """Bytes the run had copied to host so far (None: no manager in the run)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mismatch:
    """The first difference between the runs."""

    iteration: int
    rank: int
    kind: str
    """``"loss"``, ``"gradient"`` or ``"parameter"``."""
    name: str
    """The loss's or the parameter's name."""
    max_abs_difference: float | None
    """Largest absolute difference (as float64); None where the tensors cannot be compared."""
    detail: str = ""
    """Why they cannot be compared (missing in one run, another shape or dtype), or that only the
    bits differ (a signed zero, a NaN payload)."""

    def __str__(self) -> str:
        what = {"loss": "loss", "gradient": "gradient of parameter", "parameter": "parameter"}[self.kind]
        found = self.detail if self.max_abs_difference is None else f"max abs difference {self.max_abs_difference!r}"
        if self.detail and self.max_abs_difference is not None:
            found += f" ({self.detail})"
        return f"iteration {self.iteration}, rank {self.rank}, {what} {self.name}: {found}"


@dataclass(kw_only=True, slots=True)
class BitIdentityResult:
    """The outcome of a check, of one rank or merged over ranks (`merge_results`)."""

    iterations: int
    """Training iterations each run trained and compared."""
    ranks: int = 1
    parameters: int = 0
    """Parameters compared, summed over the ranks."""
    bytes_offloaded: int | None = None
    """Bytes the run with offload copied to host, summed over the ranks (None: not known)."""
    first_mismatch: Mismatch | None = None
    """The earliest difference (lowest iteration, then rank); None when the runs are identical."""

    @property
    def passed(self) -> bool:
        return self.first_mismatch is None

    def __str__(self) -> str:
        if self.first_mismatch is not None:
            return f"chunk-offload verify: MISMATCH at {self.first_mismatch}"
        moved = "" if self.bytes_offloaded is None else f", {self.bytes_offloaded} bytes offloaded"
        ranks = f"{self.ranks} rank" + ("" if self.ranks == 1 else "s")
        return f"chunk-offload verify: PASS ({self.iterations} iterations, {ranks}, {self.parameters} parameters compared{moved})"


def flatten_losses(value: Any, name: str = "loss") -> dict[str, torch.Tensor]:
    """The tensor and number leaves of ``value`` (nested lists, tuples, dicts) as detached CPU copies,
    named by their path (``loss[0]['lm loss']``); other leaves (None, strings, objects) are skipped."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        found[name] = _copy(value)
    elif isinstance(value, (bool, int, float)):
        found[name] = torch.tensor(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            found.update(flatten_losses(item, f"{name}[{key!r}]"))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found.update(flatten_losses(item, f"{name}[{i}]"))
    return found


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat_a, flat_b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


def _difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float | None, str]:
    """(largest absolute difference, detail) of tensors whose bits differ."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return None, f"{a.dtype} {tuple(a.shape)} without offload, {b.dtype} {tuple(b.shape)} with it"
    wide = torch.complex128 if a.is_complex() else torch.float64
    diff = (a.to(wide) - b.to(wide)).abs()
    largest = float(diff.max()) if diff.numel() else 0.0
    if torch.isnan(diff).any():
        largest = math.nan
    return largest, ("only the bits differ (a signed zero or a NaN payload)" if largest == 0.0 else "")


def _compare(kind: str, reference: dict[str, torch.Tensor], found: dict[str, torch.Tensor], iteration: int, rank: int) -> Mismatch | None:
    for name in [*reference, *(n for n in found if n not in reference)]:
        if name not in found or name not in reference:
            where = "with" if name not in found else "without"
            return Mismatch(iteration=iteration, rank=rank, kind=kind, name=name, max_abs_difference=None, detail=f"missing in the run {where} offload")
        a, b = reference[name], found[name]
        if a.dtype == b.dtype and a.shape == b.shape and _same_bits(a, b):
            continue
        largest, detail = _difference(a, b)
        return Mismatch(iteration=iteration, rank=rank, kind=kind, name=name, max_abs_difference=largest, detail=detail)
    return None


def compare_records(reference: StepRecord, offloaded: StepRecord, *, rank: int) -> Mismatch | None:
    """The first difference of one iteration, run without offload (``reference``) against the run
    with it: losses first, then gradients, then parameters, each in the reference's order."""
    iteration = reference.iteration
    return (
        _compare("loss", reference.losses, offloaded.losses, iteration, rank)
        or _compare("gradient", reference.grads, offloaded.grads, iteration, rank)
        or _compare("parameter", reference.params, offloaded.params, iteration, rank)
    )


def merge_results(results: Sequence[BitIdentityResult]) -> BitIdentityResult:
    """One result of the ranks' ``results``: counts summed, the earliest mismatch (iteration, then rank)."""
    if not results:
        raise ChunkOffloadError("chunk_offload: merge_results needs at least one result")
    mismatches = [r.first_mismatch for r in results if r.first_mismatch is not None]
    moved = [r.bytes_offloaded for r in results]
    return BitIdentityResult(
        iterations=min(r.iterations for r in results),
        ranks=sum(r.ranks for r in results),
        parameters=sum(r.parameters for r in results),
        bytes_offloaded=None if None in moved else sum(moved),
        first_mismatch=min(mismatches, key=lambda m: (m.iteration, m.rank), default=None),
    )


def all_gather_results(result: BitIdentityResult, *, group: dist.ProcessGroup | None = None) -> BitIdentityResult:
    """`merge_results` of every rank's ``result``: a collective (``all_gather_object``), every rank
    of ``group`` calls it and gets the whole job's result."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, result, group=group)
    return merge_results(gathered)


def _named_parameters(modules: nn.Module | Sequence[nn.Module]) -> dict[str, nn.Parameter]:
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    if len(modules) == 1:
        return dict(modules[0].named_parameters())
    return {f"{i}.{name}": p for i, m in enumerate(modules) for name, p in m.named_parameters()}


def _runs(build: Callable[[bool], TrainingJob], *, offload: bool, iterations: int, seed: int | None) -> Iterator[StepRecord]:
    """One run's `StepRecord` per iteration; the job is closed when the generator is."""
    if seed is not None:
        torch.manual_seed(seed)
        random.seed(seed)
    job = build(offload)
    if not isinstance(job, TrainingJob):
        raise ChunkOffloadError(f"chunk_offload: build(offload={offload}) returned {type(job).__name__}; return a chunk_offload.TrainingJob")
    params = _named_parameters(job.modules)
    names = {id(p): n for n, p in params.items()}
    grads: dict[str, torch.Tensor] = {}

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:  # every grad is final here
        for group in optimizer.param_groups:
            grads.update({names[id(p)]: _copy(p.grad) for p in group["params"] if id(p) in names and p.grad is not None})

    optimizers = [job.optimizer] if isinstance(job.optimizer, torch.optim.Optimizer) else list(job.optimizer or ())
    handles = [o.register_step_pre_hook(before_step) for o in optimizers]
    try:
        for i in range(iterations):
            grads.clear()
            losses = flatten_losses(job.step(i))
            if not grads:  # no optimizer, or it did not step: the gradients left in .grad
                grads.update({n: _copy(p.grad) for n, p in params.items() if p.grad is not None})
            moved = job.manager.stats().bytes_offloaded if job.manager is not None else None
            yield StepRecord(iteration=i + 1, losses=losses, grads=dict(grads), params={n: _copy(p) for n, p in params.items()}, bytes_offloaded=moved)
    finally:
        for handle in handles:
            handle.remove()
        if job.close is not None:
            job.close()


def verify_bit_identity(build: Callable[[bool], TrainingJob], *, iterations: int, seed: int | None = 0) -> BitIdentityResult:
    """Train ``iterations`` iterations of ``build(False)`` and of ``build(True)`` and compare them bit for bit.

    ``build(offload)`` returns a fresh `TrainingJob`: its model, optimizer and, with ``offload``, the
    manager (core API: an `OffloadManager` whose scopes ``step`` opens; torch pipelining:
    ``integrations.pipelining.attach`` over the schedule). Before each build, ``seed`` (None:
    leave the generators alone) seeds torch's generators (every device) and Python's ``random``;
    anything else the job draws from must be seeded by ``build``. The run without offload is kept in
    host memory (every gradient and parameter of every iteration); the run with offload is compared
    as it goes and trains every iteration also after a mismatch (in a pipeline, a rank that stopped
    would leave the others waiting). This rank's result: merge the ranks' with `all_gather_results`.

    Returns a `BitIdentityResult` (``passed``, ``first_mismatch``); a mismatch raises nothing.
    Raises `ChunkOffloadError` when ``iterations`` is not an int >= 1 or ``build`` returns no
    `TrainingJob`.
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ChunkOffloadError(f"chunk_offload: verify_bit_identity(iterations={iterations!r}): pass an int >= 1")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    with contextlib.closing(_runs(build, offload=False, iterations=iterations, seed=seed)) as run:
        reference = list(run)
    result = BitIdentityResult(iterations=0, parameters=len(reference[-1].params))
    with contextlib.closing(_runs(build, offload=True, iterations=iterations, seed=seed)) as run:
        for before, after in zip(reference, run):  # to the end: a rank that stopped would leave its peers waiting
            result.iterations, result.bytes_offloaded = after.iteration, after.bytes_offloaded
            result.first_mismatch = result.first_mismatch or compare_records(before, after, rank=rank)
    return result
