"""One call in a fresh process of its own: `in_own_process` (bench/megatron_compare.py's runs).

A run in a fresh process starts with nothing another run left: no device memory still allocated,
no allocator cache shaped by another model, no library singleton (megatron's offload manager) and
no profiler residue. The process is started with ``spawn`` (a new interpreter: a forked child of
a process that touched CUDA could not use it), so the call and its arguments are pickled: the
function must be importable by its module's name, or be in the ``__main__`` script. The answer
travels as plain pickle bytes: tensors by value (multiprocessing's own pickler, as torch extends
it, would pass them as shared-memory handles that die with the process that sent them).
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from multiprocessing.connection import Connection
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
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_answer, args=(send, function, args), daemon=True)
    process.start()
    send.close()  # the child holds the only write end: reading gets EOF when it ends
    try:
        status, value = pickle.loads(receive.recv_bytes())  # before join: a large answer fills the pipe until read
    except EOFError:
        status, value = None, None
    finally:
        receive.close()
        process.join()
    if status == "ok":
        return value
    if status == "raised":
        raise RunFailed(value)
    raise RunFailed(f"its process ended without an answer (exit code {process.exitcode})")


def _answer(send: Connection, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """The child's side: run the call and send ("ok", result) or ("raised", "Type: message")."""
    try:
        result = function(*args)
    except BaseException as error:  # noqa: BLE001 - every failure is the run's answer, KeyboardInterrupt included
        traceback.print_exc()
        send.send_bytes(pickle.dumps(("raised", f"{type(error).__name__}: {error}")))
    else:
        send.send_bytes(pickle.dumps(("ok", result)))
    finally:
        send.close()
