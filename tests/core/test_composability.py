"""Offload composes with activation checkpointing (`torch.utils.checkpoint`), bit-exactly.

Three placements of a checkpointed region relative to the offloaded modules, each with
``use_reentrant=False`` and ``use_reentrant=True``:

- ``inside``: an offloaded module checkpoints part of its own forward (its group holds what the
  rest of the module saves, plus the inputs the checkpoint keeps);
- ``around_block``: a whole block whose submodules are offloaded is checkpointed;
- ``around_attn``: a region holding the offloaded ``core_attn`` and ``attn_proj`` is checkpointed;
  its recomputation runs their forwards again during backward (no chunk is open then, so no group
  may be opened, and the recomputed tensors must land where checkpoint expects them).

Every case trains two microbatches in a 1F1B-like order (F0 F1 B0 B1) for two iterations with an
SGD step and compares losses, every gradient and the final parameters with `torch.equal` against
the very same code run without a manager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from chunk_offload import OffloadConfig, OffloadManager
from tests._driver import Hooks, RunResult, assert_identical, assert_no_live_chunks, drive
from tests.core._models import HIDDEN, MODULE_KINDS, Block, microbatches

ORDER = ("F0", "F1", "B0", "B1")
ITERATIONS = 2
LAYERS = 2
MICROBATCHES = 2


class CheckpointingMLP(nn.Module):
    """An MLP whose activation is checkpointed inside its own forward."""

    def __init__(self, hidden: int, reentrant: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.reentrant = reentrant

    @staticmethod
    def _act(u: torch.Tensor) -> torch.Tensor:
        return F.gelu(u) * torch.sigmoid(u)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.fc1(self.norm(x))
        return self.fc2(checkpoint(self._act, u, use_reentrant=self.reentrant))


class CkptBlock(Block):
    """`Block` with a checkpointed region placed according to ``placement``."""

    def __init__(self, placement: str, reentrant: bool) -> None:
        super().__init__()
        self.placement = placement
        self.reentrant = reentrant
        if placement == "inside":
            hidden = self.mlp_norm.normalized_shape[0]
            self.mlp = CheckpointingMLP(hidden, reentrant)
            del self.mlp_norm, self.mlp_fc1, self.mlp_fc2

    def _attn_tail(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn_proj(self.core_attn(q, k, v))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_linear(self.attn_norm(x)).chunk(3, dim=-1)
        if self.placement == "around_attn":
            a = checkpoint(self._attn_tail, q, k, v, use_reentrant=self.reentrant)
        else:
            a = self._attn_tail(q, k, v)
        x = x + a
        if self.placement == "inside":
            return x + self.mlp(x)
        return x + self.mlp_fc2(F.gelu(self.mlp_fc1(self.mlp_norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement == "around_block":
            return checkpoint(self._body, x, use_reentrant=self.reentrant)
        return self._body(x)


def offloaded_kinds(placement: str) -> tuple[str, ...]:
    if placement == "inside":
        return ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp")
    return MODULE_KINDS


def make_model(placement: str, reentrant: bool) -> nn.Sequential:
    """An input projection, then the blocks: every block input requires grad (a reentrant checkpoint
    whose inputs and outputs do not would cut the graph, with or without offload)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), *[CkptBlock(placement, reentrant) for _ in range(LAYERS)])


class CallLog:
    """Forward pre-hook on every offloaded module: was a chunk open, was grad on, during backward?"""

    def __init__(self, manager: OffloadManager) -> None:
        self.manager = manager
        self.in_backward = False
        self.backward_calls = 0
        self.backward_calls_with_chunk = 0

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.in_backward:
            self.backward_calls += 1
            if self.manager.current_handler is not None:
                self.backward_calls_with_chunk += 1


def train(placement: str, reentrant: bool, manager: OffloadManager | None) -> tuple[RunResult, CallLog | None]:
    model = make_model(placement, reentrant)
    log = None
    if manager is not None:
        log = CallLog(manager)
        for block in model[1:]:
            for kind in offloaded_kinds(placement):
                module = getattr(block, kind)
                module.register_forward_pre_hook(log)  # before the manager's: sees the state it sees
                manager.offload_module(module, kind)
    hooks = Hooks(after_iteration=assert_no_live_chunks)
    if log is not None:
        hooks.before_backward = lambda step: setattr(log, "in_backward", True)
        hooks.after_backward = lambda step: setattr(log, "in_backward", False)
    result = drive(model, inputs=microbatches(MICROBATCHES), manager=manager, order=ORDER, iterations=ITERATIONS, hooks=hooks)
    return result, log


def expected_groups(placement: str) -> dict[str, int]:
    """Groups per kind: one per layer per microbatch per iteration for each offloaded module that
    does not run inside a checkpointed region. What a checkpointed region saves is recomputed, not
    offloaded, whichever checkpoint flavour: a reentrant checkpoint runs its forward under no_grad,
    and a non-reentrant one owns the saved-tensor hooks of its region (a group that took them over
    would break its recomputation); the recomputation itself runs outside any chunk."""
    calls = ITERATIONS * MICROBATCHES * LAYERS
    kinds = offloaded_kinds(placement)
    if placement == "around_block":
        return {}
    if placement == "around_attn":
        return {k: calls for k in kinds if k not in ("core_attn", "attn_proj")}
    return {k: calls for k in kinds}


PLACEMENTS = ("inside", "around_block", "around_attn")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_checkpoint_composes_with_offload(placement: str, reentrant: bool) -> None:
    reference, _ = train(placement, reentrant, None)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        result, log = train(placement, reentrant, manager)
        stats = manager.stats()
    finally:
        manager.close()
    assert_identical(reference, result)

    expected = expected_groups(placement)
    assert {n: g.groups for n, g in stats.groups.items() if g.groups} == expected
    for name in expected:
        g = stats.groups[name]
        assert g.bytes_offloaded > 0 and g.bytes_reloaded == g.bytes_offloaded, (name, g)
    assert stats.resident_bytes == 0 and stats.host_bytes == 0
    assert stats.pool.in_use_bytes == 0 and stats.pool.fallback_in_use_bytes == 0

    # Recomputation runs the checkpointed modules' forwards again during backward, with no chunk open.
    recomputed = placement != "inside"
    assert (log.backward_calls > 0) == recomputed, log.backward_calls
    assert log.backward_calls_with_chunk == 0


def test_checkpoint_inside_offloaded_module_saves_checkpoint_inputs_in_group() -> None:
    """The inputs a non-reentrant checkpoint keeps belong to the enclosing module's group: offloaded."""
    model = make_model("inside", reentrant=False)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    try:
        manager.offload_module(model[1].mlp, "mlp")
        (x,) = microbatches(1)
        drive(model, inputs=[x], manager=manager, lr=None)
        stats = manager.stats()
    finally:
        manager.close()
    # norm input + mean/rstd, fc1 input, checkpoint input u, fc2 input: u is 4x hidden.
    g = stats.groups["mlp"]
    assert g.groups == 1
    u_bytes = x.numel() * 4 * x.element_size()
    assert g.bytes_offloaded >= 2 * u_bytes, g  # u (checkpoint input) and fc2's input are both offloaded
    assert g.bytes_reloaded == g.bytes_offloaded
