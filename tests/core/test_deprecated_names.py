"""Names renamed in this release still work for one release, with a `DeprecationWarning` naming the new one."""

from __future__ import annotations

import pytest

import chunk_offload.core as core


def test_offload_policy_is_the_tensor_filter() -> None:
    with pytest.warns(DeprecationWarning, match=r"chunk_offload.core.OffloadPolicy is deprecated .* use chunk_offload.core.TensorFilter"):
        assert core.OffloadPolicy is core.TensorFilter
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        core.NoSuchName  # noqa: B018


def test_manager_policy_is_its_tensor_filter() -> None:
    manager = core.OffloadManager(streams=core.CpuStreams())
    try:
        with pytest.warns(DeprecationWarning, match=r"OffloadManager.policy is deprecated .* use .tensor_filter"):
            assert manager.policy is manager.tensor_filter
        with pytest.raises(AttributeError, match="'OffloadManager' object has no attribute 'no_such_name'"):
            manager.no_such_name  # noqa: B018
    finally:
        manager.close()
