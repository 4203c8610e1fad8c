"""Where backward reaches a group: the gradient hook on its outputs (NOTE [Group backward hook]).

A committed group adds no autograd node: its outputs are returned as they are, and the hook on
each output the group created begins the group's backward (resident, reload of the group before
it, the chunk's B action). Where torch drops the hook (an output view modified in place after
the group) the group's first unpack begins it instead. Gradients are compared with `torch.equal`
against the same computation without a manager.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chunk_offload.core.actions import ActionKind
from chunk_offload.core.group_state import GroupState
from tests._driver import Hooks, Step, chunk_scope, drive, iteration_scope

H = 16


class ViewOut(nn.Module):
    """A layer whose output is a view of what it computed (as attention's ``.view(...)``), saved
    by none of its own nodes (so that an in-place change of it after the layer is legal)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x.tanh()) * 2).view(-1, H)


def _run(manager, *, inplace_on_view: bool):
    """One forward and backward of 3 `ViewOut` layers; the gradients, and whether each group began its
    backward, seen right before and right after the backward."""
    torch.manual_seed(0)
    layers = nn.ModuleList([ViewOut() for _ in range(3)])
    if manager is not None:
        for layer in layers:
            manager.offload_module(layer, "layer")
    x = torch.randn(4, H, requires_grad=True)
    seen: list[list[bool]] = []

    def forward(layers: nn.ModuleList, h: torch.Tensor, step: Step) -> torch.Tensor:
        for layer in layers:
            h = layer(h)
            if inplace_on_view:
                h.mul_(1.5)  # in place on the group's output view: torch rebuilds its node, dropping the hook
            h = h * 1.0
        return h

    def begun(step: Step) -> None:
        if step.handler is not None:
            seen.append([g.backward_begun for g in step.handler.groups])

    hooks = Hooks(before_backward=begun, after_backward=begun)
    run = drive(layers, inputs=[x], manager=manager, forward=forward, loss=torch.sum, params=[x, *layers.parameters()], lr=None, hooks=hooks)
    return run.grads[0], seen


@pytest.mark.parametrize("inplace_on_view", [False, True], ids=["hook", "hook_dropped"])
def test_every_group_begins_backward_and_gradients_are_exact(make_manager, inplace_on_view):
    expected, _ = _run(None, inplace_on_view=inplace_on_view)
    manager = make_manager()
    got, (before, after) = _run(manager, inplace_on_view=inplace_on_view)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"gradient {i} differs"
    assert before == [False, False, False]
    assert after == [True, True, True]
    record = manager.last_iteration
    assert [a.kind for a in record.order] == [ActionKind.FORWARD, ActionKind.BACKWARD]
    stats = manager.stats().groups["layer"]
    assert stats.bytes_reloaded == stats.bytes_offloaded > 0


def test_a_committed_group_adds_no_autograd_node(make_manager):
    manager = make_manager()
    lin = nn.Linear(H, H)
    manager.offload_module(lin, "lin")
    x = torch.randn(4, H, requires_grad=True)
    with manager.iteration():
        with manager.chunk(microbatch=0):
            out = lin(x)
            assert type(out.grad_fn).__name__ == "AddmmBackward0", "the group's output is the module's own output"
            y = torch.randn(4, H, requires_grad=True) * 2
            assert manager.group_commit(manager.group_start(y, "g"), "g") is y
        out.sum().backward()


def test_a_group_whose_output_is_its_input_begins_backward_at_its_unpack(make_manager):
    """An output the group did not create gets no hook (its gradient completes after the group's
    backward): the group's first unpack begins it."""

    class SavesAndPassesThrough(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.saved = x.exp()  # saves x; used by the caller, not returned
            return x

    def run(manager):
        torch.manual_seed(0)
        module = SavesAndPassesThrough()
        if manager is not None:
            manager.offload_module(module, "pass")
        x = torch.randn(4, H, requires_grad=True)
        with iteration_scope(manager):
            with chunk_scope(manager):
                h = x * 2
                out = module(h)
                loss = (out * module.saved).sum()
            if manager is not None:
                group = manager.iteration_handlers[0].groups[0]
            loss.backward()
        if manager is not None:
            assert group.backward_begun and group.state is GroupState.RELEASED
        return x.grad

    assert torch.equal(run(make_manager()), run(None))


@pytest.mark.parametrize("user_hook_first", [False, True], ids=["user_hook_after", "user_hook_before"])
def test_user_gradient_hooks_on_a_group_output_still_run(make_manager, user_hook_first):
    """Our hook shares the output's hook dict with the user's: both run, and removing the user's
    handle leaves ours."""
    manager = make_manager()
    lin = nn.Linear(H, H)
    calls: list[str] = []
    if user_hook_first:

        def user_forward_hook(module, args, out) -> None:
            out.register_hook(lambda g: calls.append("user"))

        lin.register_forward_hook(user_forward_hook)  # runs before the offload's own hook
    manager.offload_module(lin, "lin")
    removed: list[str] = []
    x = torch.randn(4, H, requires_grad=True)
    with manager.iteration():
        with manager.chunk(microbatch=0):
            out = lin(x.tanh())
            if not user_hook_first:
                out.register_hook(lambda g: calls.append("user"))
                out.register_hook(lambda g: removed.append("removed")).remove()
            group = manager.iteration_handlers[0].groups[0]
        (out * 2).sum().backward()
    assert calls == ["user"] and removed == []
    assert group.backward_begun and group.state is GroupState.RELEASED
