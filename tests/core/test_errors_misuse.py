"""Misuse raises `ChunkOffloadError` naming the values involved: group marks, nesting, tags, pool
exhaustion, options and chunk arguments."""

from __future__ import annotations

import gc
import re
import threading
import warnings

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadConfig, OffloadManager
from tests.core._errors import CHUNK0
from tests.core._models import assert_clean, manager_skipping_waits


# ----------------------------------------------------------------------------- misuse


def test_group_commit_without_group_start(manager):
    x = torch.randn(4, requires_grad=True) * 1
    with pytest.raises(ChunkOffloadError, match=rf"group 'a' committed in chunk {CHUNK0} but no group is open"):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                manager.group_commit(x, "a")
    assert_clean(manager)


def test_group_names_must_match(manager):
    x = torch.randn(4, requires_grad=True) * 1
    with pytest.raises(ChunkOffloadError, match=rf"group 'b' committed while group 'a' is open in chunk {CHUNK0}"):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                y = manager.group_start(x, "a")
                manager.group_commit(y.sin(), "b")
    assert_clean(manager)


def test_group_start_cannot_nest(manager):
    x = torch.randn(4, requires_grad=True) * 1
    with pytest.raises(ChunkOffloadError, match=rf"group 'inner' started while group 'outer' of chunk {CHUNK0} is still open"):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                y = manager.group_start(x, "outer")
                manager.group_start(y, "inner")
    assert_clean(manager)


def test_group_left_open_at_chunk_end(manager):
    x = torch.randn(4, requires_grad=True) * 1
    with pytest.raises(ChunkOffloadError, match=rf"chunk {CHUNK0} ended with group 'open' still open"):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                manager.group_start(x, "open").sin()
    assert_clean(manager)


class Sin(nn.Module):
    def forward(self, y):
        return y.sin()


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Sin()

    def forward(self, y):
        return self.inner(y * 2)


def test_nested_offloaded_modules_raise_naming_both(manager):
    outer = Outer()
    manager.offload_module(outer, "outer")
    manager.offload_module(outer.inner, "inner")
    with pytest.raises(ChunkOffloadError, match=rf"group 'inner' started while group 'outer' of chunk {CHUNK0} is still open"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with manager.iteration():
                with manager.chunk(microbatch=0):
                    outer(torch.randn(4, 4, requires_grad=True))
    assert_clean(manager)


def test_nested_offloaded_modules_error_has_no_side_effect_warnings(manager):
    # The module hooks must not fail themselves while the real error propagates (torch turns an
    # exception in an always_call forward hook into a warning).
    outer = Outer()
    manager.offload_module(outer, "outer")
    manager.offload_module(outer.inner, "inner")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ChunkOffloadError, match="cannot nest"):
            with manager.iteration():
                with manager.chunk(microbatch=0):
                    outer(torch.randn(4, 4, requires_grad=True))
    assert [str(w.message) for w in record] == []
    assert_clean(manager)


def test_tensor_pop_of_an_unknown_tag(manager):
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            with pytest.raises(ChunkOffloadError, match=r"tensor_pop got an unknown tag 42 of type int"):
                handler.tensor_pop(42)
            with pytest.raises(ChunkOffloadError, match=r"tensor_pop got an unknown tag 'x' of type str"):
                handler.tensor_pop("x")
    assert_clean(manager)


def test_tensor_pop_of_a_tag_from_another_handler(manager):
    x = torch.randn(8, 8, requires_grad=True) * 1
    with manager.iteration():
        with manager.chunk(microbatch=0) as first:
            tag = first.tensor_push(x)
            first.on_group_commit_forward()
        with manager.chunk(microbatch=3, vp_stage=1) as second:
            with pytest.raises(
                ChunkOffloadError,
                match=re.escape(
                    "tensor_pop of a tag of chunk (microbatch=0, vp_stage=0) on the handler of chunk (microbatch=3, vp_stage=1)"
                ),
            ):
                second.tensor_pop(tag)
        assert torch.equal(first.tensor_pop(tag), x)  # its own handler still serves it
        del tag
    assert_clean(manager)


def test_te_protocol_errors_name_the_chunk_and_ids(manager):
    with manager.iteration():
        with manager.chunk(microbatch=2, vp_stage=1) as handler:
            with pytest.raises(ChunkOffloadError, match=r"group id 5 is out of range for chunk \(microbatch=2, vp_stage=1\) with 0 groups"):
                handler.bulk_reload_group(5)
            with pytest.raises(ChunkOffloadError, match=r"on_group_commit_backward on chunk \(microbatch=2, vp_stage=1\) with no committed group left"):
                handler.on_group_commit_backward()
    assert_clean(manager)


def _one_offloaded_forward(mgr: OffloadManager, nbytes_floats: int = 512):
    module = Sin()
    mgr.offload_module(module, "sin")
    x = torch.randn(nbytes_floats, requires_grad=True)
    with mgr.iteration():
        with mgr.chunk(microbatch=0):
            out = module(x * 1)
        out.sum().backward()


def test_exhausted_pool_error_names_the_cap(make_manager):
    mgr = make_manager(host_pool_bytes=1024, on_exhausted="error", min_offload_bytes=1)
    with pytest.raises(ChunkOffloadError) as info:
        _one_offloaded_forward(mgr, nbytes_floats=512)  # 2048 bytes to offload
    message = str(info.value)
    assert "host pool exhausted" in message
    assert "2048 bytes requested (2048 rounded)" in message
    assert "0 of host_pool_bytes=1024 already allocated" in message  # the field the user set
    assert "capacity_bytes" not in message and "Raise host_pool_bytes" in message
    assert mgr.stats().pool.allocated_bytes == 0


def test_exhausted_pool_error_leaves_nothing_behind(make_manager):
    mgr = make_manager(host_pool_bytes=1024, on_exhausted="error", min_offload_bytes=1)
    with pytest.raises(ChunkOffloadError, match="host pool exhausted"):
        _one_offloaded_forward(mgr, nbytes_floats=512)
    assert_clean(mgr)
    _one_offloaded_forward(mgr, nbytes_floats=256)  # 1024 bytes fit
    assert_clean(mgr)
    assert mgr.stats().groups["sin"].bytes_offloaded == 1024


def test_exhausted_pool_fallback_warns_and_trains(make_manager):
    mgr = make_manager(host_pool_bytes=1024, on_exhausted="fallback", min_offload_bytes=1)
    with pytest.warns(UserWarning, match=r"host pool at its cap .*of host_pool_bytes=1024"):
        _one_offloaded_forward(mgr, nbytes_floats=512)
    assert mgr.stats().pool.fallback_allocations == 1
    assert_clean(mgr)


def _worker_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in ("chunk_offload-d2h", "chunk_offload-h2d")}


def test_bogus_on_exhausted_lists_choices():
    before = _worker_threads()
    with pytest.raises(ChunkOffloadError, match=r"on_exhausted='bogus' is not valid; choose one of \('fallback', 'error'\)"):
        OffloadManager(OffloadConfig(on_exhausted="bogus"))
    gc.collect()
    for thread in _worker_threads() - before:  # a failed constructor must not leave workers behind
        thread.join(10)
        assert not thread.is_alive()


def test_unknown_option_lists_valid_options():
    with pytest.raises(TypeError, match="min_ofload_bytes"):
        OffloadConfig(min_ofload_bytes=1)
    with pytest.raises(ChunkOffloadError) as info:
        OffloadManager({"min_ofload_bytes": 1, "pool_size": 3})
    message = str(info.value)
    assert "config must be an OffloadConfig" in message and "got dict {'min_ofload_bytes': 1, 'pool_size': 3}" in message
    for name in ("host_pool_bytes", "measure_time", "min_offload_bytes", "offload", "on_exhausted"):
        assert repr(name) in message


def test_invalid_option_values():
    with pytest.raises(ChunkOffloadError, match=r"min_offload_bytes must be an int number of bytes >= 0, got -1"):
        OffloadManager(OffloadConfig(min_offload_bytes=-1))
    with pytest.raises(ChunkOffloadError, match=r"host_pool_bytes must be an int number of bytes >= 0 or None, got -5"):
        OffloadManager(OffloadConfig(host_pool_bytes=-5))
    with pytest.raises(ChunkOffloadError, match=r"unknown wait names \['nope'\]; valid: \['offload_after_compute'"):
        manager_skipping_waits(("nope",))


def test_offload_module_arguments(manager):
    with pytest.raises(ChunkOffloadError, match=r"offload_module expects an nn.Module, got Tensor"):
        manager.offload_module(torch.randn(2), "x")
    with pytest.raises(ChunkOffloadError, match=r"offload_module needs a non-empty group name, got ''"):
        manager.offload_module(Sin(), "")


def test_chunk_outside_iteration(manager):
    with pytest.raises(ChunkOffloadError, match=r"chunk\(\) must be used inside `with manager.iteration\(\):`"):
        with manager.chunk(microbatch=0):
            pass
    assert_clean(manager)


def test_nested_iteration(manager):
    with pytest.raises(ChunkOffloadError, match=r"iteration\(\) entered while an iteration is already open; they cannot nest"):
        with manager.iteration():
            with manager.iteration():
                pass
    with manager.iteration():  # usable again
        pass
    assert_clean(manager)


def test_nested_chunk(manager):
    with pytest.raises(ChunkOffloadError, match=rf"chunk\(microbatch=1, vp_stage=2\) entered inside chunk {CHUNK0}; chunks cannot nest"):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                with manager.chunk(microbatch=1, vp_stage=2):
                    pass
    assert_clean(manager)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(microbatch=-1), "chunk() needs microbatch as an int >= 0, got -1"),
        (dict(microbatch=0, vp_stage=-2), "chunk() needs vp_stage as an int >= 0, got -2"),
        (dict(microbatch=1.0), "chunk() needs microbatch as an int >= 0, got 1.0"),
    ],
)
def test_chunk_arguments(manager, kwargs, fragment):
    with pytest.raises(ChunkOffloadError, match=re.escape(fragment)):
        with manager.iteration():
            with manager.chunk(**kwargs):
                pass
    assert_clean(manager)


def test_messages_carry_the_prefix():
    with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: "):
        OffloadManager({"bad": 1})
