"""Forward-only passes between training iterations, inside the harness's ranks (``tests._megatron``).

`PassHooks` trains as `OffloadHooks` does and, after each training call, runs the forward-only
passes it names through Megatron's schedule (``forward_only=True``), each over its own number of
microbatches (`PASS_MICROBATCHES`, unlike training's):

- ``"evaluate"``: through ``manager.wrap(...)``, gradients enabled (``iterations="wrap"`` only);
- ``"evaluate_no_grad"``: unwrapped, under ``torch.no_grad()`` (Megatron-LM's ``evaluate``);
- ``"logprobs_no_grad"`` / ``"logprobs_inference"``: unwrapped, collecting each token's
  log-probability (``collect_non_loss_data=True``), under ``torch.no_grad()`` / inference mode
  (an RL log-probability pass);
- ``"scoped"``: unwrapped, gradients enabled, inside ``manager.forward_only()``.

It records what the manager holds around each pass (`pass_state`) and after each complete training
iteration (`iteration_state`, from the session's after-iteration sequence, whenever it closes), so
a run with passes can be compared with the same run without them.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from tests._megatron_config import TinyGPTConfig
from tests._megatron_offload import OffloadHooks
from tests.integrations._policy import policy_decisions
from tests.integrations.megatron._auto_iterations import comparable

__all__ = ["PASS_KINDS", "PASS_MICROBATCHES", "PassHooks", "iteration_state", "pass_state"]

PASS_KINDS = ("evaluate", "evaluate_no_grad", "logprobs_no_grad", "logprobs_inference", "scoped")
PASS_MICROBATCHES = (2, 6)
"""Microbatches of the passes, in turn (training runs 4)."""


def logprob_forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """A ``forward_step_func`` whose last stage yields each token's log-probability."""
    batch = next(data_iterator)
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), _logprobs


def _logprobs(per_token_loss: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
    return -per_token_loss.detach().clone()


def iteration_state(manager: Any) -> dict[str, Any]:
    """What the after-iteration sequence leaves: counts, record, plan, policies, budgets, host cap."""
    budgets, plan, record = manager.budgets, manager.plan, manager.last_iteration
    return {
        "training_calls": manager.training_calls,
        "baseline_records": [r.offload for r in manager.records],
        "record": None if record is None else comparable(record),
        "observed": list(manager.observed_order),
        "plan": None if plan is None else (plan.actions, plan.source),
        "policy": policy_decisions(manager.schedule_policy),
        "ran_policy": policy_decisions(manager.ran_policy),
        "budgets": {
            name: getattr(budgets, name)
            for name in ("leveled_budget", "choice", "host_cap", "host_needs", "host_caps", "shortfall_bytes")
        },
        "pool_cap": manager.pool.capacity_bytes,
    }


def pass_state(manager: Any) -> dict[str, Any]:
    """The engine's counters (times left out), live chunks and iteration; compared before and after a pass."""
    stats = manager.stats()
    groups = {
        name: {f.name: getattr(g, f.name) for f in fields(g) if not f.name.endswith("_time_s")} for name, g in stats.groups.items()
    }
    others = {f.name: getattr(stats, f.name) for f in fields(stats) if f.name != "groups"}
    return {"groups": groups, **others, "live_chunks": manager.live_chunks(), "in_iteration": manager.engine.in_iteration}


@dataclass
class PassHooks(OffloadHooks):
    """`OffloadHooks` that run forward-only passes (``passes``, see the module docstring) after each training call."""

    config: TinyGPTConfig | None = None
    passes: tuple[str, ...] = ()
    iterations: list[dict[str, Any]] = field(default_factory=list)
    """`iteration_state` after each complete training iteration."""
    pass_log: list[dict[str, Any]] = field(default_factory=list)
    """Per pass: kind, microbatches, chunk forwards run, outputs, `pass_state` before and after,
    training calls and observed order before and after."""
    warned: list[str] = field(default_factory=list)
    """chunk_offload warnings raised during training calls and passes."""
    chunk_forwards: int = 0

    def wrap_model(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        chunks = super().wrap_model(chunks)
        for chunk in chunks:
            chunk.register_forward_pre_hook(self._count_forward)
        session = self.manager.session
        after_iteration = session.after_iteration

        def recorded() -> None:
            after_iteration()
            self.iterations.append(iteration_state(self.manager))

        session.after_iteration = recorded  # the instance's: every close, wrap's or auto's, goes through it
        return chunks

    def _count_forward(self, module: torch.nn.Module, args: tuple) -> None:
        self.chunk_forwards += 1

    def wrap_forward_backward(self, forward_backward):
        wrapped = self.manager.wrap(forward_backward) if self.wrap_schedule else forward_backward

        def train_then_passes(**kwargs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = wrapped(**kwargs)
                for kind in self.passes:
                    self._run_pass(kind, wrapped if kind == "evaluate" else forward_backward, kwargs)
            self.warned += [str(w.message) for w in caught if "chunk_offload" in str(w.message)]
            return out

        return train_then_passes

    def _run_pass(self, kind: str, function: Any, kwargs: dict[str, Any]) -> None:
        from tests._megatron_train import gpt_shape, megatron_step

        count = PASS_MICROBATCHES[len(self.pass_log) % len(PASS_MICROBATCHES)]
        model = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
        logprobs = {"forward_step_func": logprob_forward_step, "collect_non_loss_data": True} if kind.startswith("logprobs") else {}
        seed, index = self.config.seed + 1, len(self.pass_log)
        call = dict(num_microbatches=count, seed=seed, iteration=index, forward_only=True, **logprobs)
        context = {
            "evaluate": contextlib.nullcontext,
            "evaluate_no_grad": torch.no_grad,
            "logprobs_no_grad": torch.no_grad,
            "logprobs_inference": torch.inference_mode,
            "scoped": self.manager.forward_only,
        }[kind]
        manager, forwards = self.manager, self.chunk_forwards
        before = (pass_state(manager), manager.training_calls, list(manager.observed_order))
        with context():
            store = megatron_step(function, model, gpt_shape(self.config), **call)
        after = (pass_state(manager), manager.training_calls, list(manager.observed_order))
        forwards = self.chunk_forwards - forwards
        self.pass_log.append(
            {"kind": kind, "microbatches": count, "forwards": forwards, "outputs": len(store), "before": before, "after": after}
        )

    def report(self, chunks: list[torch.nn.Module]) -> dict[str, Any]:
        if self.manager.iterations == "auto":
            self.manager.end_iteration()  # the last one, complete
        return {**super().report(chunks), "iterations": self.iterations, "passes": self.pass_log, "warned": self.warned}
