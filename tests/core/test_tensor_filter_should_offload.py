"""`TensorFilter.should_offload` case by case (parameters, buffers, views, leaves, subclasses, size
threshold, marks), the public mark API, the marks of Transformer Engine and Megatron, protection refresh.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import chunk_offload
from chunk_offload import mark_not_offloadable
from chunk_offload.core import TensorFilter, is_marked_not_offloadable

# ----------------------------------------------------------------------------- should_offload


class MyTensor(torch.Tensor):
    pass


@pytest.fixture
def filter_and_module():
    torch.manual_seed(0)
    module = nn.Linear(8, 8)
    module.register_buffer("running", torch.randn(8, 8))
    tensor_filter = TensorFilter(min_offload_bytes=64, device_type="cpu")
    tensor_filter.protect(module)
    return tensor_filter, module


def test_should_offload_parameters_and_their_views(filter_and_module):
    tensor_filter, module = filter_and_module
    weight = module.weight
    assert tensor_filter.should_offload(weight) is False
    assert type(weight.t()) is torch.Tensor
    assert tensor_filter.should_offload(weight.t()) is False
    assert tensor_filter.should_offload(weight[0:2]) is False
    # Same storage, plain type, no autograd link: only storage identity can tell.
    detached = weight.detach()
    assert type(detached) is torch.Tensor and detached._base is None and not detached.requires_grad
    assert tensor_filter.should_offload(detached) is False
    assert tensor_filter.should_offload(weight.detach()[2:]) is False


def test_should_offload_buffers_and_their_views(filter_and_module):
    tensor_filter, module = filter_and_module
    assert tensor_filter.should_offload(module.running) is False
    assert tensor_filter.should_offload(module.running[1:]) is False
    assert tensor_filter.should_offload(module.running.t()) is False


def test_should_offload_activations_and_leaves(filter_and_module):
    tensor_filter, _ = filter_and_module
    leaf = torch.randn(8, 8, requires_grad=True)
    assert tensor_filter.should_offload(leaf) is False  # a leaf requiring grad is a parameter in all but type
    assert tensor_filter.should_offload(leaf[1:]) is False  # and so are its views
    activation = leaf * 2
    assert not activation.is_leaf
    assert tensor_filter.should_offload(activation) is True
    assert tensor_filter.should_offload(activation.t()) is True
    assert tensor_filter.should_offload(torch.randn(8, 8)) is True  # data that needs no grad


def test_a_leaf_handed_to_the_group_is_an_activation(filter_and_module):
    """A pipeline stage's received input is a leaf that requires grad: among the group's inputs it
    (and views of it) is offloaded; the same leaf not handed to the group is kept as a parameter."""
    tensor_filter, module = filter_and_module
    received = torch.randn(8, 8, requires_grad=True)
    other = torch.randn(8, 8) * 2
    assert tensor_filter.should_offload(received) is False
    assert tensor_filter.should_offload(received, [other, received]) is True
    assert tensor_filter.should_offload(received[1:], [received]) is True
    assert tensor_filter.should_offload(received, [received[2:]]) is True  # a view of it handed in
    assert tensor_filter.should_offload(module.weight.detach(), [module.weight]) is False  # protected storage
    assert tensor_filter.decide(received, [received]) == (True, received.untyped_storage()._cdata)
    assert tensor_filter.decide(received) == (False, received.untyped_storage()._cdata)  # kept: the group keeps views of it
    assert tensor_filter.decide(module.weight.detach()) == (False, 0)  # protected: no view of it is offloaded


def test_should_offload_view_made_without_grad_mode_of_an_activation(filter_and_module):
    # Inside a custom Function's forward (no grad mode) a view of a non-leaf input reports
    # is_leaf=True and requires_grad=True; it is still an activation, not a parameter.
    tensor_filter, _ = filter_and_module
    activation = torch.randn(8, 8, requires_grad=True) * 2
    with torch.no_grad():
        view = activation[1:]
    assert view.is_leaf and view.requires_grad and view._base is activation
    assert tensor_filter.should_offload(view) is True


def test_should_offload_subclass_sparse_and_other_device(filter_and_module):
    tensor_filter, _ = filter_and_module
    assert tensor_filter.should_offload(torch.randn(8, 8).as_subclass(MyTensor)) is False
    assert tensor_filter.should_offload(torch.randn(8, 8).to_sparse()) is False
    assert tensor_filter.should_offload(torch.empty(64, 64, device="meta")) is False


def test_should_offload_size_threshold_is_inclusive(filter_and_module):
    tensor_filter, _ = filter_and_module
    assert tensor_filter.should_offload(torch.randn(16)) is True  # 16 * 4 == 64 bytes
    assert tensor_filter.should_offload(torch.randn(15)) is False  # 60 bytes
    assert tensor_filter.should_offload(torch.randn(32, dtype=torch.float16)) is True
    assert tensor_filter.should_offload(torch.randn(31, dtype=torch.float16)) is False
    assert tensor_filter.should_offload(torch.randn(64).view(4, 16)[:, :4]) is True  # the view's bytes count
    assert tensor_filter.should_offload(torch.randn(64)[:15]) is False


def test_should_offload_marked(filter_and_module):
    tensor_filter, _ = filter_and_module
    marked = mark_not_offloadable(torch.randn(8, 8) * 2)
    assert is_marked_not_offloadable(marked)
    assert tensor_filter.should_offload(marked) is False
    assert tensor_filter.should_offload(marked[1:]) is False
    assert tensor_filter.should_offload(marked.t()) is False
    assert tensor_filter.should_offload(torch.randn(8, 8) * 2) is True


def test_mark_covers_views_of_a_marked_view():
    base = torch.randn(8, 8) * 2
    view = mark_not_offloadable(base[2:])
    assert is_marked_not_offloadable(view)
    assert is_marked_not_offloadable(view[1:]), "a view of a marked view is a view of it"


def test_refresh_follows_reallocated_parameters():
    module = nn.Linear(8, 8)
    tensor_filter = TensorFilter(min_offload_bytes=1, device_type="cpu")
    tensor_filter.protect(module)
    module.double()  # new storages
    stale = module.weight.detach()
    assert tensor_filter.should_offload(stale) is True  # not known yet
    tensor_filter.refresh()
    assert tensor_filter.should_offload(stale) is False


def test_manager_refreshes_protection_each_iteration(make_manager):
    manager = make_manager(min_offload_bytes=1)
    module = nn.Linear(8, 8)
    manager.offload_module(module, "lin")
    module.double()
    with manager.iteration():
        pass
    assert manager.tensor_filter.should_offload(module.weight.detach()) is False


def test_public_mark_api():
    t = torch.randn(4)
    assert chunk_offload.mark_not_offloadable(t) is t
    assert is_marked_not_offloadable(t)
    assert not is_marked_not_offloadable(torch.randn(4))


@pytest.mark.parametrize(
    "attribute, value",
    [("_TE_do_not_offload", True), ("offloading_activation", False)],
    ids=["transformer_engine", "megatron_core"],
)
def test_marks_of_transformer_engine_and_megatron_are_honoured(attribute, value):
    from chunk_offload.core.tensor_filter import TensorFilter

    tensor_filter = TensorFilter(min_offload_bytes=1, device_type="cpu")
    x = torch.randn(8, 8) * 2
    assert tensor_filter.should_offload(x)
    setattr(x, attribute, value)
    assert not tensor_filter.should_offload(x)
    assert not tensor_filter.should_offload(x[1:])  # a view of the marked tensor
    other = torch.randn(8, 8) * 2
    setattr(other, attribute, not value)
    assert tensor_filter.should_offload(other)


def test_a_replaced_buffer_keeps_its_address_until_the_next_refresh():
    """A module that replaces a registered buffer in forward (as MoE routers do with their token
    counters) frees the old storage. While the tensor_filter lists its address as protected, that memory
    must not be reusable by a new activation, which would then wrongly be kept on device: the
    tensor_filter holds the storage itself until the next refresh."""
    import gc
    import weakref

    from chunk_offload.core.tensor_filter import TensorFilter

    module = nn.Module()
    module.register_buffer("counts", torch.zeros(64))
    tensor_filter = TensorFilter(min_offload_bytes=1, device_type="cpu")
    tensor_filter.protect(module)
    old = weakref.ref(module.counts.untyped_storage())
    module.counts = torch.zeros(64)
    gc.collect()
    assert old() is not None, "the protected storage was freed while the tensor_filter still listed its address"
    tensor_filter.refresh()
    gc.collect()
    assert old() is None, "a refresh must drop storages the module no longer has"
