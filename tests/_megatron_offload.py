"""Picklable hooks that attach an offload manager inside the harness's ranks (see ``tests._megatron.Hooks``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def attach_with(chunks: Any, modules: Any, **options: Any) -> Any:
    """`attach` from one dict of test options: `OffloadConfig` fields go into ``config``, the rest
    are `attach` keywords (the test parametrisations keep both in one dict)."""
    from chunk_offload import OffloadConfig
    from chunk_offload.integrations.megatron import attach

    fields = {name: options.pop(name) for name in list(options) if name in OffloadConfig.field_names()}
    return attach(chunks, modules, config=OffloadConfig(**fields), **options)


@dataclass
class OffloadHooks:
    """``wrap_model`` attaches a manager; ``wrap_forward_backward`` wraps Megatron's schedule with it.

    ``evaluate_between``: after each training call, run a ``forward_only=True`` call (under
    ``torch.no_grad()``, as Megatron's evaluation does) over the same microbatches.

    ``wrap_schedule=False`` leaves Megatron's schedule unwrapped, as Megatron-LM's own training
    loop does (for managers attached with ``iterations="auto"``).

    ``evaluation_forwards`` counts the model-chunk forwards run with gradients disabled.
    Independently of the engine, ``wrap_model`` also counts the calls of each local expert's
    ``linear_fc1`` with gradients enabled (training forwards) and the bytes of their inputs, so
    tests can check ``expert_fc1`` group counts and offloaded bytes against the routing.

    ``after_step`` (for ``Hooks.after_step``): after each optimizer step, the parameters and the
    manager's memory counters (see `step_record`).
    """

    modules: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=lambda: {"min_offload_bytes": 1})
    evaluate_between: bool = False
    wrap_schedule: bool = True
    manager: Any = None
    expert_fc1_calls: int = 0
    expert_fc1_input_bytes: int = 0
    evaluations: int = 0
    evaluation_forwards: int = 0

    def wrap_model(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        for chunk in chunks:
            chunk.register_forward_pre_hook(self._count_evaluation_forward)
            for name, module in chunk.named_modules():
                if ".experts.local_experts." in name and name.endswith(".linear_fc1"):
                    module.register_forward_pre_hook(self._count_expert_input)
        self.manager = attach_with(chunks, list(self.modules), **self.options)
        return chunks

    def _count_evaluation_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            self.evaluation_forwards += 1

    def _count_expert_input(self, module: torch.nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self.expert_fc1_calls += 1
            self.expert_fc1_input_bytes += args[0].numel() * args[0].element_size()

    def wrap_forward_backward(self, forward_backward):
        wrapped = self.manager.wrap(forward_backward) if self.wrap_schedule else forward_backward
        if not self.evaluate_between:
            return wrapped

        def train_then_evaluate(**kwargs):
            # The training call consumes the data iterator(s): keep the microbatches for the evaluation.
            data = kwargs["data_iterator"]
            if isinstance(data, list):
                kept = [list(it) for it in data]
                fresh = lambda: [iter(k) for k in kept]  # noqa: E731
            else:
                kept = list(data)
                fresh = lambda: iter(kept)  # noqa: E731
            out = wrapped(**{**kwargs, "data_iterator": fresh()})
            with torch.no_grad():
                wrapped(**{**kwargs, "data_iterator": fresh(), "forward_only": True})
            self.evaluations += 1
            return out

        return train_then_evaluate

    def with_steps(self) -> Any:
        """The harness's ``Hooks`` with all four of these hooks, ``after_step`` included."""
        from tests._megatron import Hooks

        return Hooks(wrap_model=self.wrap_model, wrap_forward_backward=self.wrap_forward_backward, report=self.report, after_step=self.after_step)

    def after_step(self, chunks: list[torch.nn.Module], iteration: int) -> dict[str, Any]:
        from tests._megatron import step_params

        return {"params": step_params(chunks, iteration), "memory": step_record(self.manager)}

    def report(self, chunks: list[torch.nn.Module]) -> dict[str, Any]:
        stats = self.manager.stats()
        self.manager.close()
        return {
            "registered": dict(self.manager.registered),
            "offloaded": {n: g.bytes_offloaded for n, g in stats.groups.items()},
            "reloaded": {n: g.bytes_reloaded for n, g in stats.groups.items()},
            # NOTE [Storages held elsewhere]: copied before the engine learned another reference
            # held them, and kept on device since (not in "offloaded").
            "copied_held_elsewhere": {n: g.bytes_copied_held_elsewhere for n, g in stats.groups.items()},
            "kept_held_elsewhere": {n: g.bytes_kept_held_elsewhere for n, g in stats.groups.items()},
            "groups": {n: g.groups for n, g in stats.groups.items()},
            "last_iteration_saved_bytes": sum(sum(b) for b in self.manager.group_bytes().values()),
            "pool_in_use": stats.pool.in_use_bytes,
            "resident": stats.resident_bytes,
            "host": stats.host_bytes,
            "live_chunks": self.manager.live_chunks(),
            "observed_order": list(self.manager.observed_order),
            "expert_fc1_calls": self.expert_fc1_calls,
            "expert_fc1_input_bytes": self.expert_fc1_input_bytes,
            "evaluations": self.evaluations,
            "evaluation_forwards": self.evaluation_forwards,
        }


def step_record(manager: Any) -> dict[str, Any]:
    """The manager's memory counters now (``stats()`` waits for the copies first)."""
    stats = manager.stats()
    return {
        "resident_bytes": stats.resident_bytes,
        "host_bytes": stats.host_bytes,
        "peak_resident_bytes": stats.peak_resident_bytes,
        "pool_allocated_bytes": stats.pool.allocated_bytes,
        "pool_in_use_bytes": stats.pool.in_use_bytes,
        "pool_allocations": stats.pool.allocations,
        "pool_fallback_allocations": stats.pool.fallback_allocations,
        "pool_fallback_in_use_bytes": stats.pool.fallback_in_use_bytes,
        "bytes_offloaded": stats.bytes_offloaded,
        # NOTE [Storages held elsewhere], summed over the group names.
        "bytes_copied_held_elsewhere": sum(g.bytes_copied_held_elsewhere for g in stats.groups.values()),
        "bytes_kept_held_elsewhere": sum(g.bytes_kept_held_elsewhere for g in stats.groups.values()),
        "live_chunks": len(manager.live_chunks()),
        # The host buffers themselves, read from the pool's free lists (private, test only):
        # their bytes must match the pool's own accounting, and the same buffers must be reused.
        "pool_free_bytes": sum(b.capacity for bufs in manager.pool._free.values() for b in bufs),
        "pool_buffer_ptrs": sorted(b.tensor.data_ptr() for bufs in manager.pool._free.values() for b in bufs),
    }


def offload_every_chunk(modules: Any, **options: Any) -> Any:
    """The harness's ``Hooks`` for a manager that offloads ``modules`` in every chunk (threshold 1 byte;
    no plan policy, which would keep the chunks whose backward follows their forward at once).
    ``options``: more `attach_with` options (``group_by="module"``)."""
    from tests._megatron import Hooks

    hooks = OffloadHooks(tuple(modules), options={"min_offload_bytes": 1, "schedule_policy": None, **options})
    return Hooks(wrap_model=hooks.wrap_model, wrap_forward_backward=hooks.wrap_forward_backward, report=hooks.report)


def spawn_with_and_without(
    cases: dict[str, tuple[Any, Any]], *, world_size: int, timeout_s: float, options: dict[str, Any] | None = None
) -> dict[str, tuple[list, list]]:
    """``{name: (config, modules)}`` -> ``{name: (results without offload, results with)}`` (each
    ``[rank]``), all in one spawn; skips the test without megatron-core or on a CUDA host.
    ``options``: more `attach_with` options for every offload run (`offload_every_chunk`)."""
    import importlib.util

    import pytest

    from tests._megatron import Run, spawn_runs

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    hooks = lambda modules: offload_every_chunk(modules, **(options or {}))  # noqa: E731
    runs = [run for cfg, modules in cases.values() for run in (Run(config=cfg), Run(config=cfg, hooks=hooks(modules)))]
    results = spawn_runs(runs, world_size=world_size, timeout_s=timeout_s)
    return {name: (results[2 * i], results[2 * i + 1]) for i, name in enumerate(cases)}


def assert_bit_identical(name: str, iterations: int, baseline: list, offloaded: list) -> None:
    """Per rank: the same losses (on the last stage, ``iterations`` of them), gradients and parameters
    with and without offload, something offloaded, every offloaded byte reloaded, nothing left over."""
    for a, b in zip(baseline, offloaded, strict=True):
        assert len(a.losses) == len(b.losses) == (iterations if a.is_last_stage else 0)
        for it, (la, lb) in enumerate(zip(a.losses, b.losses)):
            for m, (x, y) in enumerate(zip(la, lb, strict=True)):
                assert torch.equal(x, y), f"{name} rank {a.rank} iteration {it} microbatch {m}: {x.item()!r} vs {y.item()!r}"
        assert a.grads.keys() == b.grads.keys()
        for key in a.grads:
            assert torch.equal(a.grads[key], b.grads[key]), f"{name} rank {a.rank}: gradient of {key}"
        assert a.param_digest() == b.param_digest(), f"{name} rank {a.rank}: parameters differ"
        extra = b.extra
        assert sum(extra["offloaded"].values()) > 0, (name, b.rank, extra)
        assert all(extra["reloaded"][n] == extra["offloaded"][n] for n in extra["offloaded"]), (name, b.rank, extra)
        assert extra["pool_in_use"] == 0 and extra["resident"] == 0 and extra["host"] == 0, (name, b.rank, extra)
