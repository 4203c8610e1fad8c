"""`close()` and aborts while the user's own error propagates: the user's error surfaces, and a failing
close or abort is chained or noted on it, never raised in its place."""

from __future__ import annotations

import sys

import pytest
import torch

from chunk_offload import ChunkOffloadError, OffloadManager
from tests.core._bad_input import UserError, _forward_in_open_chunk, _offloaded_manager
from tests.core._models import assert_clean


# ----------------------------------------------------------------------------- close while the user's error propagates


def _close_in_iteration(manager, module):
    with manager.iteration():
        _forward_in_open_chunk(manager, module)
        manager.close()
        raise UserError("mine")


def _close_in_finally(manager, module):
    with manager.iteration():
        with manager.chunk(microbatch=0):
            module(torch.randn(3, 4, requires_grad=True))
            try:
                raise UserError("mine")
            finally:
                manager.close()


def _close_then_raise(manager, module):
    with manager.iteration():
        with manager.chunk(microbatch=0):
            module(torch.randn(3, 4, requires_grad=True))
            manager.close()
            raise UserError("mine")


def _close_in_except(manager, module):
    with manager.iteration():
        with manager.chunk(microbatch=0):
            try:
                module(torch.randn(3, 4, requires_grad=True))
                raise UserError("mine")
            except UserError:
                manager.close()
                raise


def _close_in_explicit_pairs(manager, module):
    manager.begin_iteration()
    manager.begin_chunk(microbatch=0)
    try:
        module(torch.randn(3, 4, requires_grad=True))
        raise UserError("mine")
    except UserError:
        manager.close()
        manager.end_chunk(abort=True)  # what a hook-driven integration does next: no error now
        manager.end_iteration(discard=True)
        raise


@pytest.mark.parametrize("where", [_close_in_iteration, _close_in_finally, _close_then_raise, _close_in_except, _close_in_explicit_pairs])
def test_close_inside_a_chunk_lets_the_users_error_surface(where):
    manager, module = _offloaded_manager()
    with pytest.raises(UserError, match="mine") as info:
        where(manager, module)
    assert info.value.__context__ is None or not isinstance(info.value.__context__, ChunkOffloadError)
    assert manager.closed and not manager.in_iteration
    assert_clean(manager)


def _break_close(manager: OffloadManager) -> None:
    """Make the manager's close fail after stopping its streams (a copy stream that broke)."""
    streams_close = manager.streams.close

    def failing_close() -> None:
        streams_close()
        raise RuntimeError("copy stream broke")

    manager.streams.close = failing_close


def test_a_failing_close_while_the_users_error_propagates_is_chained_to_it_not_raised(caplog):
    manager, module = _offloaded_manager()
    _break_close(manager)
    with pytest.raises(UserError, match="mine") as info:
        _close_in_finally(manager, module)
    notes = getattr(info.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert notes == ["chunk_offload: close() during this exception also failed: RuntimeError('copy stream broke')"]
    assert "close() failed while UserError('mine') propagated" in caplog.text
    assert manager.closed


def test_a_failing_close_without_an_error_in_flight_raises():
    manager, _ = _offloaded_manager()
    _break_close(manager)
    with pytest.raises(RuntimeError, match="copy stream broke"):
        manager.close()


@pytest.mark.parametrize("scope", ["chunk", "iteration"])
def test_a_failing_abort_while_the_users_error_propagates_is_a_note_on_it(monkeypatch, scope):
    from chunk_offload.core import ChunkOffloadHandler

    manager, module = _offloaded_manager()

    def broken_abort(self) -> None:
        raise RuntimeError("abort broke")

    with pytest.raises(UserError, match="mine") as info:
        with manager.iteration():
            with manager.chunk(microbatch=0):
                module(torch.randn(3, 4, requires_grad=True))
                if scope == "chunk":
                    monkeypatch.setattr(ChunkOffloadHandler, "abort", broken_abort)
                    raise UserError("mine")
            monkeypatch.setattr(ChunkOffloadHandler, "abort", broken_abort)
            raise UserError("mine")
    what = "aborting the chunk" if scope == "chunk" else "discarding the iteration"
    if sys.version_info >= (3, 11):
        assert f"chunk_offload: {what} during this exception also failed: RuntimeError('abort broke')" in info.value.__notes__
    monkeypatch.undo()
    manager.close()
