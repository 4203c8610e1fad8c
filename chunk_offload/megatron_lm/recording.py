"""`Recorder`: one child run of ``--chunk-offload-verify N`` writes a `StepRecord` per training iteration.

The launcher's child runs (NOTE [Verify runs] in ``verify.py``) install it around Megatron-LM's
training loop, at the names ``megatron.training.training`` looks up when it trains:

* ``get_forward_backward_func``: the schedule it returns is wrapped; after a training call
  (``forward_only`` False) the microbatch losses it returns (the last stage's) and every
  parameter's gradient are copied to host. The schedule reduces the gradients before it returns
  (``finalize_model_grads``), so these are the gradients the optimizer steps with: ``main_grad``
  where Megatron's DDP keeps one, else ``grad``.
* ``train_step``: after it returns (the optimizer stepped), the parameters are copied and the
  iteration's record is written to ``FOLDER/step<I>.pt`` (plain dicts of tensors, read back with
  ``torch.load(weights_only=True)``). After the N-th, ``args.exit_interval`` is set to the next
  iteration number, so Megatron-LM's own loop ends the run there (whatever iteration it started
  from, e.g. after ``--load``).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..bit_identity import StepRecord, flatten_losses

__all__ = ["Recorder", "load_record", "save_record"]

_TRAINING = "megatron.training.training"


def _name(chunk: int, chunks: int, name: str) -> str:
    while name.startswith("module."):  # Megatron's DDP and Float16Module wrappers
        name = name[len("module.") :]
    return name if chunks == 1 else f"{chunk}.{name}"


def _named_parameters(model: Any) -> dict[str, nn.Parameter]:
    chunks = [model] if isinstance(model, nn.Module) else list(model or ())
    return {_name(i, len(chunks), n): p for i, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class Recorder:
    """Records ``iterations`` training iterations of a Megatron-LM run into ``folder``, then ends it.

    ``manager()`` returns the run's offload manager (None without offload): its copied bytes go
    into each record. ``install()`` / ``restore()`` (or ``with``) wrap and unwrap the two names.
    """

    def __init__(self, folder: str | Path, iterations: int, manager: Callable[[], Any]) -> None:
        self.folder = Path(folder)
        self.iterations = iterations
        self._manager = manager
        self._module: Any = None
        self._originals: dict[str, Any] = {}
        self._model: Any = None
        self._losses: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] = {}
        self.recorded = 0
        """Iterations recorded so far."""

    def install(self) -> Recorder:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._module = importlib.import_module(_TRAINING)
        wraps = {"get_forward_backward_func": self._wrap_getter, "train_step": self._wrap_train_step}
        for name, wrap in wraps.items():
            self._originals[name] = getattr(self._module, name)
            setattr(self._module, name, wrap(self._originals[name]))
        return self

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(self._module, name, original)
        self._originals.clear()

    def __enter__(self) -> Recorder:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def _wrap_getter(self, getter: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(getter)
        def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
            return self._wrap_schedule(getter(*args, **kwargs))

        return get_forward_backward_func

    def _wrap_schedule(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(schedule)
        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            result = schedule(*args, **kwargs)
            if not kwargs.get("forward_only", False):  # Megatron-LM's train_step and evaluate pass it by keyword
                self._model = kwargs.get("model")
                self._losses = flatten_losses(result)
                self._grads = {}
                for name, p in _named_parameters(self._model).items():
                    grad = getattr(p, "main_grad", None)
                    grad = p.grad if grad is None else grad
                    if grad is not None:
                        self._grads[name] = _host(grad)
            return result

        return forward_backward

    def _wrap_train_step(self, train_step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(train_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            result = train_step(*args, **kwargs)
            self._write()
            return result

        return step

    def _write(self) -> None:
        self.recorded += 1
        manager = self._manager()
        record = StepRecord(
            iteration=self.recorded,
            losses=self._losses,
            grads=self._grads,
            params={name: _host(p) for name, p in _named_parameters(self._model).items()},
            bytes_offloaded=None if manager is None else manager.stats().bytes_offloaded,
        )
        save_record(self.folder, record)
        self._losses, self._grads = {}, {}
        if self.recorded >= self.iterations:
            from megatron.training import get_args

            args = get_args()
            args.exit_interval = args.curr_iteration + 1  # the loop's exit check right after this step


def save_record(folder: str | Path, record: StepRecord) -> None:
    """Write ``record`` to ``folder/step<iteration>.pt`` as plain dicts (`load_record` reads it back)."""
    fields = dict(losses=record.losses, grads=record.grads, params=record.params, bytes_offloaded=record.bytes_offloaded)
    torch.save(dict(iteration=record.iteration, **fields), Path(folder) / f"step{record.iteration}.pt")


def load_record(folder: str | Path, iteration: int) -> StepRecord | None:
    """The record of ``iteration`` (1-based) in ``folder``; None when the run did not get that far."""
    path = Path(folder) / f"step{iteration}.pt"
    if not path.is_file():
        return None
    return StepRecord(**torch.load(path, weights_only=True))
