"""`attach(..., iterations="auto")` in one process, on plain modules shaped like a GPTModel chunk
(megatron's pipeline size and rank set through its public setters): option checks, the microbatch count
(fixed, from Megatron's calculator, callable), a forward too many or too few, ``wrap``/``iteration``/
``end_iteration`` in the wrong mode, discarding, closing, and the warning in explicit mode when a
training forward runs outside any iteration.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings
from typing import Any

import pytest
import torch

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.integrations.megatron import attach
from tests.core._models import assert_clean
from tests.integrations.megatron._auto_iterations import GPTLikeChunk, comparable, microbatch, train_step

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
pytestmark = pytest.mark.skipif(_NO_MEGATRON, reason='megatron-core is not installed (pip install "chunk-offload[megatron]")')


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"iterations": "sometimes"},
            "iterations must be 'wrap' (each manager.wrap(forward_backward_func) call is one iteration) or 'auto' "
            "(the chunk hooks delimit iterations, for Megatron-LM's own training loop), got 'sometimes'",
        ),
        (
            {"num_microbatches": 4},
            "num_microbatches=4 applies to iterations='auto'; with iterations='wrap' each call's num_microbatches= "
            "keyword is used.",
        ),
        (
            {"iterations": "auto", "num_microbatches": 0},
            "num_microbatches must be an int >= 1, a callable returning one, or None (Megatron's get_num_microbatches()), "
            "got 0",
        ),
        (
            {"iterations": "auto", "num_microbatches": True},
            "num_microbatches must be an int >= 1, a callable returning one, or None (Megatron's get_num_microbatches()), "
            "got True",
        ),
    ],
)
def test_options_are_checked(options: dict[str, Any], message: str):
    with pytest.raises(ChunkOffloadError, match="^" + re.escape("chunk_offload: " + message) + "$"):
        attach(GPTLikeChunk(), "qkv_linear", **options)


def test_auto_offloads_like_wrap_and_closes_at_the_next_forward(managed):
    """Two steps without wrap: gradients and bytes equal those of the same steps through wrap."""
    torch.manual_seed(0)
    reference = GPTLikeChunk()  # the same initial weights as the managed chunks, never offloaded
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    wrapped_chunk, wrapped = managed()
    step = wrapped.wrap(lambda *, num_microbatches, first: train_step(wrapped_chunk, num_microbatches, first=first))
    for first in (0, 2):
        for module in (chunk, wrapped_chunk, reference):
            module.zero_grad(set_to_none=True)
        losses = train_step(chunk, 2, first=first)
        assert manager.training_calls == first // 2, "the step's iteration stays open until the next forward"
        assert manager.observed_order == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
        for a, b, c in zip(losses, step(num_microbatches=2, first=first), train_step(reference, 2, first=first), strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
        for (name, p), q, r in zip(chunk.named_parameters(), wrapped_chunk.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad) and torch.equal(p.grad, r.grad), name
    with torch.no_grad():
        chunk(microbatch(0))  # an evaluation forward: closes the finished iteration, opens none
    assert manager.training_calls == wrapped.training_calls == 2
    assert manager.live_chunks() == [] and manager.observed_order == wrapped.observed_order
    assert comparable(manager.last_iteration) == comparable(wrapped.last_iteration)
    # Each qkv_linear saves its [4, 8] fp32 input (128 bytes), and another reference holds both on
    # device (NOTE [Storages held elsewhere]): layer 0's is the chunk's input, which the caller
    # holds; layer 1's is layer 0's tanh output, which tanh saves. The first microbatch of the
    # first iteration copies both and learns it; every later group keeps them on device.
    nbytes = 4 * 8 * 4
    last = manager.last_iteration.groups["qkv_linear"]
    assert (last.groups, last.bytes_offloaded, last.bytes_copied_held_elsewhere, last.bytes_kept_held_elsewhere) == (
        4, 0, 0, 4 * nbytes
    )
    for m in (manager, wrapped):
        total = m.stats().groups["qkv_linear"]
        assert (total.groups, total.bytes_offloaded, total.bytes_reloaded) == (8, 2 * nbytes, 2 * nbytes)
        assert (total.bytes_copied_held_elsewhere, total.bytes_kept_held_elsewhere) == (2 * nbytes, 6 * nbytes)
    assert manager.plan == wrapped.plan and manager.plan.diff(manager.observed_order) is None


def test_evaluation_forwards_open_no_iteration(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    with torch.no_grad():
        chunk(microbatch(0))
    with torch.inference_mode():
        chunk(microbatch(1))
    assert manager.training_calls == 0 and manager.last_iteration is None and manager.observed_order == []
    assert manager.stats().groups == {}
    manager.end_iteration()  # none open: nothing to do
    assert manager.training_calls == 0


def test_default_count_needs_megatrons_calculator(managed):
    chunk, manager = managed(iterations="auto")
    message = (
        "chunk_offload: iterations='auto' without num_microbatches reads megatron.core.num_microbatches_calculator."
        "get_num_microbatches(), but that calculator is not initialised (Megatron-LM's initialize_megatron initialises "
        "it; megatron-core alone does not). Pass attach(..., num_microbatches=N), or a callable returning the current count."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(message) + "$"):
        chunk(microbatch(0))
    assert manager.training_calls == 0 and manager.live_chunks() == [] and manager.observed_order == []


def test_default_count_follows_megatrons_calculator(managed):
    """The count is read for each iteration: a reconfigured calculator (batch-size ramp-up) is followed."""
    from megatron.core import num_microbatches_calculator as calculator

    from chunk_offload.schedule import megatron_plan

    calculator.init_num_microbatches_calculator(0, None, 3, 1, 1)  # global batch 3, micro batch 1, DP 1: 3 microbatches
    chunk, manager = managed(iterations="auto")
    train_step(chunk, 3)
    manager.end_iteration()
    assert manager.training_calls == 1
    assert manager.plan == megatron_plan(pp_size=1, pp_rank=0, num_microbatches=3)
    calculator.reconfigure_num_microbatches_calculator(0, None, 2, 1, 1)
    train_step(chunk, 2)
    manager.end_iteration()
    assert manager.training_calls == 2
    assert manager.plan == megatron_plan(pp_size=1, pp_rank=0, num_microbatches=2)
    assert manager.plan.diff(manager.observed_order) is None


def test_callable_count_is_checked(managed):
    counts = [2, 0]
    chunk, manager = managed(iterations="auto", num_microbatches=lambda: counts.pop(0))
    train_step(chunk, 2)
    message = r"^chunk_offload: the num_microbatches callable <function .*> returned 0; the number of microbatches must be an int >= 1$"
    with pytest.raises(ChunkOffloadError, match=message):
        chunk(microbatch(2))
    assert manager.training_calls == 1  # the complete iteration was closed before the count was read


def test_a_forward_too_many_names_the_counts(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    outputs = [chunk(microbatch(0)), chunk(microbatch(1))]  # two forwards whose backwards have not run
    message = (
        "chunk_offload: model chunk 0 starts training forward 3 of an iteration of num_microbatches=2 (training forwards "
        "per model chunk so far: [2]), but that iteration is not complete (2 chunk backward(s) not begun; 2 chunk(s) "
        "still holding saved tensors). Set attach(..., num_microbatches=...) to the number of microbatches of each "
        "forward_backward_func call (an int, or a callable returning the current count); run evaluation under "
        "torch.no_grad() or inside manager.forward_only() (a forward_only=True call with gradients enabled looks like "
        "training); after a step that failed part-way, call manager.end_iteration(discard=True)."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(message) + "$"):
        chunk(microbatch(2))
    incomplete = (
        "chunk_offload: end_iteration(): the open iteration of num_microbatches=2 is not complete (1 chunk backward(s) "
        "not begun; 1 chunk(s) still holding saved tensors); finish the step's forwards and backwards first, or call "
        "end_iteration(discard=True) to drop it."
    )
    outputs[0].sum().backward()
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(incomplete) + "$"):
        manager.end_iteration()
    outputs[1].sum().backward()
    with pytest.warns(RuntimeWarning, match=re.escape("observed: 0F0 [0F1] 0B0 0B1")):
        manager.end_iteration()  # F0 F1 B0 B1 is not megatron's no-pipelining order: the plan check says so
    assert manager.training_calls == 1 and manager.live_chunks() == []
    moved = manager.last_iteration.groups["qkv_linear"]
    assert moved.bytes_reloaded == moved.bytes_offloaded > 0


def test_too_few_forwards_is_incomplete(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=3)
    train_step(chunk, 2)
    with pytest.raises(ChunkOffloadError, match=re.escape("(training forwards per model chunk [2] of 3 each)")):
        manager.end_iteration()


def test_discard_drops_the_open_iteration(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    dropped = chunk(microbatch(0))
    manager.end_iteration(discard=True)
    assert manager.training_calls == 0 and manager.last_iteration is None and manager.live_chunks() == []
    with pytest.raises(ChunkOffloadError, match=r"discarded \(its chunk or iteration raised"):
        dropped.sum().backward()  # its saved tensors were discarded
    train_step(chunk, 2)  # the next forward opens a fresh iteration
    manager.end_iteration()
    assert manager.training_calls == 1 and manager.observed_order == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]


def test_a_forward_that_raises_discards_the_open_iteration(managed, caplog):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    held = chunk(microbatch(0))  # the step's first microbatch: its saved tensors are held
    layer = chunk.decoder.layers[1]
    failing = layer.register_forward_hook(lambda module, args, output: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="chunk_offload.integrations.megatron.chunk_hooks"), pytest.raises(ZeroDivisionError):
        chunk(microbatch(1))
    failing.remove()
    assert [r.getMessage() for r in caplog.records] == ["chunk_offload: a forward of model chunk 0 raised; discarding the open iteration."]
    assert manager.live_chunks() == [] and manager.training_calls == 0
    assert_clean(manager)
    with pytest.raises(ChunkOffloadError, match=r"discarded \(its chunk or iteration raised"):
        held.sum().backward()
    chunk.zero_grad(set_to_none=True)
    losses = train_step(chunk, 2)  # the next step runs in a fresh iteration, exactly
    manager.end_iteration()
    assert manager.training_calls == 1
    torch.manual_seed(0)
    reference = GPTLikeChunk()  # the same parameters, no offload
    assert all(torch.equal(a, b) for a, b in zip(losses, train_step(reference, 2), strict=True))
    for (name, p), q in zip(chunk.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_wrap_and_iteration_are_refused_in_auto_mode(managed):
    chunk, manager = managed(iterations="auto", num_microbatches=1)
    wrap_message = (
        "chunk_offload: wrap() on a manager attached with iterations='auto', which opens an iteration at the first "
        "training chunk forward of each step by itself; call get_forward_backward_func() unwrapped, or attach with "
        "iterations='wrap' to delimit iterations by the wrapped calls."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(wrap_message) + "$"):
        manager.wrap(lambda **kwargs: None)
    iteration_message = (
        "chunk_offload: iteration() on a manager attached with iterations='auto', which opens and closes its "
        "iterations itself; run the training steps without it, or attach with iterations='wrap'."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(iteration_message) + "$"):
        manager.iteration()


def test_end_iteration_is_refused_in_wrap_mode(managed):
    chunk, manager = managed()
    message = (
        "chunk_offload: end_iteration() is for managers attached with iterations='auto'; with iterations='wrap' each "
        "call of the wrapped forward_backward_func is one iteration and ends with the call."
    )
    with pytest.raises(ChunkOffloadError, match="^" + re.escape(message) + "$"):
        manager.end_iteration()


def test_close_ends_a_complete_iteration_and_discards_an_incomplete_one(managed, caplog):
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    train_step(chunk, 2)
    manager.close()
    assert manager.training_calls == 1 and manager.last_iteration.order == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    chunk, manager = managed(iterations="auto", num_microbatches=2)
    output = chunk(microbatch(0))  # kept: its saved tensors are held
    with caplog.at_level(logging.WARNING, logger="chunk_offload.integrations.megatron.attach"):
        manager.close()
    assert manager.training_calls == 0 and manager.live_chunks() == [] and output.requires_grad
    assert [r.getMessage() for r in caplog.records] == [
        "chunk_offload: discarding the open incomplete iteration (training forwards per model chunk [1] of 2 each; "
        "1 chunk backward(s) not begun; 1 chunk(s) still holding saved tensors) at close()."
    ]


def test_explicit_mode_warns_once_about_a_training_forward_outside_any_iteration(managed):
    chunk, manager = managed()
    message = (
        "chunk_offload: a training forward (gradients enabled) of model chunk 0 ran outside any offload iteration, so "
        "nothing it saves is offloaded. Run training through manager.wrap(get_forward_backward_func()), or, when the "
        "training loop calls get_forward_backward_func() itself (Megatron-LM's pretrain), attach with "
        "iterations='auto' (--chunk-offload-iterations auto). A forward-only pass (forward_only=True, evaluation) is "
        "not training: run it under torch.no_grad(), through the wrapped function or inside manager.forward_only(). "
        "Shown once per manager."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            chunk(microbatch(0))  # evaluation: no warning
        with manager.iteration():
            train_step(chunk, 1)  # inside an iteration: no warning
        chunk(microbatch(1)).sum().backward()
        chunk(microbatch(2)).sum().backward()
    assert [(w.category, str(w.message)) for w in caught] == [(RuntimeWarning, message)]
    assert manager.stats().groups["qkv_linear"].groups == 2  # the one step inside the iteration (2 layers)
    other_chunk, other = managed()
    with pytest.warns(RuntimeWarning, match="^" + re.escape(message) + "$"):
        other_chunk(microbatch(0))
