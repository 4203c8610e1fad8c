"""`torch.save` and `copy.deepcopy` of a model with offload attached: both work, and the copy is a
plain model that is not offloaded."""

from __future__ import annotations

import copy
import io

import torch
from torch import nn

from tests.core._models import assert_clean


# ----------------------------------------------------------------------------- saving a model with offload attached


def test_torch_save_of_a_model_with_offload_attached_works_and_the_copy_is_not_offloaded(make_manager):
    manager = make_manager()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    manager.offload_module(model[0], "lin")
    loaded = torch.load(_saved(model), weights_only=False)
    x = torch.randn(3, 4, requires_grad=True)
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            out = model(x)
            copy_out = loaded(x)
        assert [g.name for g in handler.groups] == ["lin"], "the original is still offloaded, the copy is not"
        assert torch.equal(out, copy_out)
        (out + copy_out).sum().backward()
    assert_clean(manager)


def _saved(model: nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer


def test_deepcopy_of_a_model_with_offload_attached_gives_a_plain_copy(make_manager):
    manager = make_manager()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    manager.offload_module(model, "m")
    clone = copy.deepcopy(model)
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            clone(torch.randn(3, 4, requires_grad=True)).sum().backward()
        assert handler.groups == []
    assert manager.offload_module(clone, "clone").module is clone  # the copy can be registered itself
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(torch.load(_saved(model), weights_only=False)), buffer)  # a copy of a copy saves too
