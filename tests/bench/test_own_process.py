"""`bench/_own_process.py`: a call in a fresh process answers, or fails with its cause named, and leaves nothing running."""

from __future__ import annotations

import os
import sys

import pytest

from ._scripts import BENCH

sys.path.insert(0, str(BENCH))
from _own_process import RunFailed, in_own_process  # noqa: E402


def test_the_answer_comes_back_pickled() -> None:
    assert in_own_process(divmod, 7, 2) == (3, 1)


def test_a_call_that_raises_fails_with_its_exception() -> None:
    with pytest.raises(RunFailed, match=r"^ValueError: invalid literal for int\(\) with base 10: 'seven'$"):
        in_own_process(int, "seven")


def test_a_process_that_ends_without_an_answer_names_its_exit_code() -> None:
    with pytest.raises(RunFailed, match=r"^its process ended without an answer \(exit code 3\)$"):
        in_own_process(os._exit, 3)


def _children() -> list[int]:
    """The processes whose parent is this one (Linux /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if entry.isdigit() and int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    children.append(int(entry))
        except (OSError, ValueError, IndexError):  # not a process, or it ended meanwhile
            continue
    return children


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_nothing_is_left_running_after_the_call() -> None:
    before = _children()
    assert in_own_process(divmod, 9, 4) == (2, 1)
    assert _children() == before
