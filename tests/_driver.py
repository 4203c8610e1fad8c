"""The one training loop of the engine-level tests: iterations of (kind, microbatch, vp_stage) actions.

`drive` runs ``iterations`` optimizer steps of a schedule over one model chunk per virtual stage,
under an `OffloadManager` (``manager.iteration()`` around each step, ``manager.chunk(...)``
around each forward) or without one, the reference run. It returns every loss, every gradient of
every iteration and the final parameters (`RunResult`), so tests compare two runs with
`assert_identical` (``torch.equal`` throughout). Where a test looks in or steps in (a handler's
group states, a prefetch before a backward, a record after the step) it passes `Hooks`.

Framework loops have their own one place: Megatron's schedules ``tests/_megatron_train.py``
(``train``, ``megatron_step``), ``torch.distributed.pipelining`` ``tests/integrations/pipelining/_pipe.py``.
Plain torch only: tests/core imports this module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, NamedTuple, Sequence

import torch
from torch import nn

from chunk_offload import OffloadManager
from chunk_offload.core import ChunkOffloadHandler

__all__ = [
    "Hooks",
    "RunResult",
    "Step",
    "actions",
    "assert_identical",
    "assert_no_live_chunks",
    "chunk_scope",
    "drive",
    "iteration_scope",
    "no_pipelining",
    "snapshot",
]

ActionLike = Any  # "F0", ("B", 1, 0), ("FB", 2, 0), or a `chunk_offload.schedule` Action


class Step(NamedTuple):
    """Where the driver is when it calls a hook, a custom forward or a custom backward."""

    kind: str
    """"F", "B" or "FB" (forward, then backward inside the same chunk: the last virtual stage only)."""
    iteration: int
    microbatch: int
    vp_stage: int
    handler: ChunkOffloadHandler | None
    """The chunk's handler from its forward (None without a manager, or when grad was off)."""


@dataclass(kw_only=True)
class Hooks:
    """Where a test looks in or steps in; every hook is optional."""

    iteration_begun: Callable[[OffloadManager | None, int], None] | None = None
    """Inside the iteration scope, before its first action."""
    forwarded: Callable[[Step, torch.Tensor], None] | None = None
    """Inside the chunk, after the forward (and the loss on the last virtual stage), with its output."""
    chunk_ended: Callable[[Step], None] | None = None
    """Right after the chunk scope of an "F" or "FB" action closed."""
    before_backward: Callable[[Step], None] | None = None
    """Before each backward ("B", and inside the chunk for "FB")."""
    after_backward: Callable[[Step], None] | None = None
    """After each backward."""
    after_iteration: Callable[[OffloadManager | None, int], None] | None = None
    """After the iteration scope closed and the optimizer stepped."""


@dataclass
class RunResult:
    losses: list[torch.Tensor]
    """Every loss of the last virtual stage, in backward order, over all iterations."""
    grads: list[list[torch.Tensor | None]]
    """Per iteration, every parameter's gradient before the optimizer step."""
    params: list[torch.Tensor] = field(default_factory=list)
    """After the last optimizer step."""


def actions(order: Sequence[ActionLike]) -> list[tuple[str, int, int]]:
    """``order`` as ``(kind, microbatch, vp_stage)``: "F0" / "FB3" strings (vp_stage 0), tuples, or plan actions."""
    out = []
    for a in order:
        if isinstance(a, str):
            kind = a.rstrip("0123456789")
            out.append((kind, int(a[len(kind) :]), 0))
        elif hasattr(a, "kind"):
            out.append((a.kind.value, a.microbatch, a.vp_stage))
        else:
            out.append(tuple(a))
    return out


def no_pipelining(microbatches: int) -> list[tuple[str, int, int]]:
    """Megatron's no-pipelining order: each microbatch's forward, then its backward."""
    return [(kind, m, 0) for m in range(microbatches) for kind in ("F", "B")]


def iteration_scope(manager: OffloadManager | None, *, offload: bool | None = None) -> ContextManager:
    """``manager.iteration(offload=...)``, or nothing without a manager."""
    return manager.iteration(offload=offload) if manager is not None else contextlib.nullcontext()


def chunk_scope(manager: OffloadManager | None, microbatch: int = 0, vp_stage: int = 0) -> ContextManager:
    """``manager.chunk(...)`` (its handler as the ``with`` value), or nothing (None) without a manager."""
    return manager.chunk(microbatch=microbatch, vp_stage=vp_stage) if manager is not None else contextlib.nullcontext()


def snapshot(t: torch.Tensor | None) -> torch.Tensor | None:
    """What the drivers record of a loss, gradient or parameter: a detached copy (None stays None)."""
    return None if t is None else t.detach().clone()


def _mean_square(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


def _call(chunk: nn.Module, x: Any, step: Step) -> torch.Tensor:
    return chunk(x)


def drive(
    chunks: nn.Module | Sequence[nn.Module],
    *,
    inputs: Sequence[Any] | Callable[[int, int], Any],
    manager: OffloadManager | None = None,
    order: Sequence[ActionLike] = ("F0", "B0"),
    iterations: int = 1,
    forward: Callable[[nn.Module, Any, Step], torch.Tensor] = _call,
    loss: Callable[[torch.Tensor], torch.Tensor] = _mean_square,
    backward: Callable[[Step, torch.Tensor], None] | None = None,
    params: Sequence[torch.Tensor] | None = None,
    lr: float | None = 0.05,
    offload: bool | Callable[[int], bool | None] | None = None,
    copy: Callable[[torch.Tensor | None], torch.Tensor | None] = snapshot,
    hooks: Hooks | None = None,
) -> RunResult:
    """Train ``chunks`` (one per virtual stage, chained in order) for ``iterations`` steps of ``order``.

    ``inputs``: microbatch m's input, a sequence (the same every iteration) or ``(iteration, m) ->
    input``; the driver holds each stage's input until that stage's backward. ``forward(chunk, x,
    step)`` runs one chunk (default ``chunk(x)``); on the last stage ``loss`` turns its output into
    the loss (default mean square), inside the chunk, so the output itself is not held at the chunk's
    end. A stage v < last takes the detached output of stage v - 1, and its backward is driven by the
    gradient of its output, recorded when the next stage's backward ran (as a pipeline stage
    receives it). ``backward(step, loss)`` replaces ``loss.backward()``. ``params`` (default: every
    chunk's) get their gradients reset before each iteration and recorded, through ``copy``, after
    it; ``lr=None``: no optimizer step, else SGD. ``offload``: ``manager.iteration(offload=...)``,
    fixed or per iteration. The driver never closes ``manager``.
    """
    chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    params = [p for c in chunks for p in c.parameters()] if params is None else list(params)
    optimizer = torch.optim.SGD(params, lr=lr) if lr is not None else None
    hooks = hooks or Hooks()
    steps = actions(order)
    last = len(chunks) - 1
    input_of = inputs if callable(inputs) else (lambda it, m: inputs[m])
    result = RunResult(losses=[], grads=[])

    for it in range(iterations):
        for p in params:
            p.grad = None
        held: dict[tuple[int, int], Any] = {}  # stage inputs, until the stage's backward
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        out_grads: dict[tuple[int, int], torch.Tensor] = {}
        handlers: dict[tuple[int, int], ChunkOffloadHandler | None] = {}

        def run_backward(y: torch.Tensor, step: Step) -> None:
            m, v = step.microbatch, step.vp_stage
            if hooks.before_backward is not None:
                hooks.before_backward(step)
            if v == last:
                result.losses.append(snapshot(y))
                y.backward() if backward is None else backward(step, y)
            else:
                y.backward(out_grads.pop((m, v)))
            x = held.pop((m, v))
            if v > 0:
                out_grads[(m, v - 1)] = x.grad
            if hooks.after_backward is not None:
                hooks.after_backward(step)

        flag = offload(it) if callable(offload) else offload
        with iteration_scope(manager, offload=flag):
            if hooks.iteration_begun is not None:
                hooks.iteration_begun(manager, it)
            for kind, m, v in steps:
                if kind == "B":
                    run_backward(outputs.pop((m, v)), Step(kind, it, m, v, handlers.pop((m, v))))
                    continue
                if kind not in ("F", "FB"):
                    raise ValueError(f"unknown action kind {kind!r} in {(kind, m, v)}: use F, B or FB")
                x = input_of(it, m) if v == 0 else outputs[(m, v - 1)].detach().requires_grad_(True)
                held[(m, v)] = x
                with chunk_scope(manager, m, v) as handler:
                    step = Step(kind, it, m, v, handler)
                    y = forward(chunks[v], x, step)
                    if v == last:
                        y = loss(y)  # the stage's output is not held past here
                    if hooks.forwarded is not None:
                        hooks.forwarded(step, y)
                    if kind == "FB":
                        run_backward(y, step)
                if hooks.chunk_ended is not None:
                    hooks.chunk_ended(step)
                if kind == "F":
                    outputs[(m, v)], handlers[(m, v)] = y, handler
                del y
        result.grads.append([copy(p.grad) for p in params])
        if optimizer is not None:
            optimizer.step()
        if hooks.after_iteration is not None:
            hooks.after_iteration(manager, it)
    result.params = [copy(p) for p in params]
    return result


def assert_no_live_chunks(manager: OffloadManager | None, iteration: int) -> None:
    """An ``after_iteration`` hook: no chunk of the iteration still holds saved tensors."""
    if manager is not None:
        assert manager.live_chunks() == [], f"iteration {iteration}: chunks still live {manager.live_chunks()}"


def assert_identical(a: RunResult, b: RunResult) -> None:
    """Every loss, every gradient of every iteration and every final parameter bit-identical."""
    assert len(a.losses) == len(b.losses) and len(a.grads) == len(b.grads)
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(x, y), f"loss {i} differs: {x.item()!r} vs {y.item()!r}"
    for it, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        assert len(ga) == len(gb), f"iteration {it}: {len(ga)} vs {len(gb)} gradients"
        for j, (x, y) in enumerate(zip(ga, gb)):
            assert x is not None and y is not None, f"iteration {it}: gradient of parameter {j} missing"
            assert torch.equal(x, y), f"iteration {it}: gradient of parameter {j} differs"
    for j, (x, y) in enumerate(zip(a.params, b.params)):
        assert torch.equal(x, y), f"parameter {j} differs after training"
