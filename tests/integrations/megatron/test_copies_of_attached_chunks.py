"""Copies of a model chunk with the Megatron chunk hooks on it (`ChunkHooks`): the hooks pickle and
deep-copy as hooks that do nothing, so a copy's forwards never reach the manager's session.

(A megatron-core GPTModel itself does not pickle, attached or not: it holds process groups. The
hooks must not be what stops a model that otherwise would, nor travel with a copy.)
"""

from __future__ import annotations

import copy
import io
import pickle

import torch
from torch import nn

from chunk_offload.integrations.megatron.chunk_hooks import ChunkHooks


class _Session:
    """Counts what the hooks tell a session."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def is_training_pass(self) -> bool:
        self.calls.append("is_training_pass")
        return False  # the original's forward below is not training: nothing else is asked


def test_copies_of_a_hooked_chunk_do_nothing_at_their_forwards() -> None:
    chunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    session = _Session()
    hooks = ChunkHooks(session, [chunk], None)  # type: ignore[arg-type]
    buffer = io.BytesIO()
    torch.save(chunk, buffer)  # closures as hooks could not be pickled
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False), copy.deepcopy(chunk), pickle.loads(pickle.dumps(chunk))]
    x = torch.randn(2, 4, requires_grad=True)
    expected = chunk(x)
    assert session.calls == ["is_training_pass"]  # the original's hooks run
    for clone in copies:
        out = clone(x)
        assert torch.equal(out, expected)
        out.sum().backward()
    assert session.calls == ["is_training_pass"]  # no copy reached the session
    hooks.remove()
    chunk(x)
    assert session.calls == ["is_training_pass"]
