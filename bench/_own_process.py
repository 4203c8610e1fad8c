"""One call in a fresh process of its own: `in_own_process` (bench/megatron_compare.py's runs).

A run in a fresh process starts with nothing another run left: no device memory still allocated,
no allocator cache shaped by another model, no library singleton (megatron's offload manager) and
no profiler residue. The process is a new interpreter running this file (a forked child of a
process that touched CUDA could not use it): it reads the caller's ``sys.path``, then the call,
from its stdin, and writes the answer to a pipe of its own, so that its stdout and stderr stay
the caller's terminal. Both travel as plain pickle: the function is found by its module's name
(not the ``__main__`` script), and tensors go by value. Nothing is left running after the call
(multiprocessing's ``spawn`` would leave its resource tracker until the caller exits).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import traceback
from typing import Any, Callable

__all__ = ["RunFailed", "in_own_process"]


class RunFailed(RuntimeError):
    """The call raised in its process (the message is its exception's), or the process ended
    without an answer (killed, out of memory, a crash in native code: the message says its exit code)."""


def in_own_process(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a fresh process; what it returns (pickled back), or `RunFailed`.

    The process's traceback, where the call raised, is printed by that process to its stderr
    (the terminal the bench writes to), so that the cause is shown where the bench's log is.
    """
    request = pickle.dumps(sys.path) + pickle.dumps((function, args))
    answer_read, answer_write = os.pipe()
    sys.stdout.flush()  # what the caller printed comes before what the child prints
    sys.stderr.flush()
    try:
        child = subprocess.Popen([sys.executable, __file__, str(answer_write)], stdin=subprocess.PIPE, pass_fds=(answer_write,))
    finally:
        os.close(answer_write)  # the child holds the only write end: reading gets EOF when it ends
    with os.fdopen(answer_read, "rb") as answers:
        try:
            with child.stdin:
                child.stdin.write(request)
        except BrokenPipeError:  # it ended before reading the call; its exit code says how
            pass
        answer = answers.read()
    child.wait()
    if not answer:
        raise RunFailed(f"its process ended without an answer (exit code {child.returncode})")
    status, value = pickle.loads(answer)
    if status == "raised":
        raise RunFailed(value)
    return value


def _answer(answer_fd: int) -> None:
    """The child's side: read the caller's path and the call, run it, write ("ok", result) or
    ("raised", "Type: message")."""
    sys.path[:] = pickle.load(sys.stdin.buffer)
    function, args = pickle.load(sys.stdin.buffer)
    try:
        answer = ("ok", function(*args))
    except BaseException as error:  # noqa: BLE001 - every failure is the run's answer, KeyboardInterrupt included
        traceback.print_exc()
        answer = ("raised", f"{type(error).__name__}: {error}")
    with os.fdopen(answer_fd, "wb") as out:
        out.write(pickle.dumps(answer))


if __name__ == "__main__":
    _answer(int(sys.argv[1]))
