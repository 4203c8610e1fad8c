"""The group state machine: every transition goes through one table, and each state an
operation does not expect is an error (formerly some operations returned silently)."""

from __future__ import annotations

import pytest
import torch

from chunk_offload import ChunkOffloadError, CpuStreams, OffloadConfig, OffloadManager
from chunk_offload.core.group_state import TRANSITIONS, GroupState

INTERNAL = r"chunk_offload internal error"


@pytest.fixture
def handler():
    """The handler of one open chunk of a manager on CPU streams (iteration discarded after the test)."""
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=CpuStreams())
    manager.begin_iteration()
    handler = manager.begin_chunk(microbatch=0)
    yield handler
    manager.end_chunk(abort=True)
    manager.end_iteration(discard=True)
    manager.close()


def _committed(handler, name: str = "g"):
    """A group that saved one tensor and was committed (offload issued: OFFLOADING)."""
    group = handler.open_group(name)
    saved = torch.randn(64)
    ref = group.save(saved)
    handler.commit_group(name)
    return group, ref, saved


def test_table_names_every_state_and_terminal_states_are_final():
    assert set(TRANSITIONS) == set(GroupState)
    assert TRANSITIONS[GroupState.RELEASED] == frozenset() and TRANSITIONS[GroupState.DISCARDED] == frozenset()
    for state, targets in TRANSITIONS.items():
        assert state not in targets, f"{state} lists itself"


def test_a_transition_outside_the_table_is_an_internal_error(handler):
    group = handler.open_group("g")
    with pytest.raises(AssertionError, match=INTERNAL + r".*transition to 'resident' is not allowed"):
        group._to(GroupState.RESIDENT)  # COLLECTING -> RESIDENT is not in the table
    assert group.state is GroupState.COLLECTING


def test_release_device_of_a_group_already_on_host_is_an_internal_error(handler):
    group, _ref, _saved = _committed(handler)
    assert group.state is GroupState.OFFLOADING
    group.release_device()
    assert group.state is GroupState.ON_HOST
    with pytest.raises(AssertionError, match=INTERNAL + r".*release_device of OffloadGroup\('g'.*state=on_host"):
        group.release_device()  # formerly a silent return


def test_release_device_of_a_kept_group_is_an_internal_error(handler):
    handler.offload = False
    group, _ref, _saved = _committed(handler)
    assert group.state is GroupState.KEPT
    with pytest.raises(AssertionError, match=INTERNAL + r".*release_device of .*state=kept"):
        group.release_device()  # formerly a silent return


def test_release_device_after_a_cancelled_offload_is_a_no_op(handler):
    group, _ref, _saved = _committed(handler)
    group.reload()  # backward reached the group before its release: the offload is cancelled
    assert group.state is GroupState.RESIDENT
    group.release_device()
    assert group.state is GroupState.RESIDENT


def test_ensure_resident_of_an_open_group_raises(handler):
    group = handler.open_group("g")
    with pytest.raises(ChunkOffloadError, match=r"cannot unpack a tensor of group 'g' .* in state 'collecting'"):
        group.ensure_resident()  # formerly a silent return


def test_ensure_resident_of_a_discarded_group_raises(handler):
    group, _ref, _saved = _committed(handler)
    handler.abort()
    assert group.state is GroupState.DISCARDED
    with pytest.raises(ChunkOffloadError, match=r"cannot unpack a tensor of group 'g' .*: the group was discarded"):
        group.ensure_resident()  # formerly a silent return


def test_reload_of_an_open_or_discarded_group_raises(handler):
    group = handler.open_group("g")
    with pytest.raises(ChunkOffloadError, match=r"cannot reload group 'g' .* in state 'collecting'"):
        group.reload()
    handler.abort()
    with pytest.raises(ChunkOffloadError, match=r"cannot reload group 'g' .*: the group was discarded"):
        group.reload()


def test_release_empty_of_a_group_holding_storages_is_an_internal_error(handler):
    handler.offload = False
    group, _ref, _saved = _committed(handler)
    with pytest.raises(AssertionError, match=INTERNAL + r".*release_empty of .*which holds storages"):
        group.release_empty()


def test_reload_then_ensure_resident_walks_the_table(handler):
    group, ref, saved = _committed(handler)
    group.release_device()
    group.reload()
    assert group.state is GroupState.RELOADING
    group.ensure_resident()
    assert group.state is GroupState.RESIDENT
    assert torch.equal(group.unpack(ref), saved)
