"""The link-time cost `_budget_search` minimises when a `CopyTiming` is given (NOTE [Link queue]).

NOTE [Link queue]
The chunks of a choice share one link, so their copies queue (NOTE [Budget choice] says how the
search uses the cost). Each direction is one FIFO queue at its own rate (``bytes_per_s`` out,
``reload_bytes_per_s`` or the same back), the two in parallel. The plan's actions are walked in
order. A chunk's offload, all the bytes it copies, enters the out queue when its forward ends:
at the start of the next action (as `CopyTiming.window_s` counts), after any wait there. It
starts when the queue is free and ends its bytes' seconds later. Its reload enters the back
queue in backward order (the engine's reload order) as soon as its offload has ended (as early
as the window allows) and ends its bytes' seconds after it starts. The chunk exposes ``max(0,
reload end - start of its backward)``, and compute waits that long: the backward and every
action after it start that much later, while the link keeps running. So a choice's exposure
is the delay it adds to the run: the least a run with these starts, rates and copy order can
wait, each wait no longer than the reload needs. (Without this shift a wait would be counted
again by every chunk queued behind the one that caused it.)
Each chunk's exposure is written as ``round trip - window`` (`CopyTiming.exposed_s`) plus its
waits in the two queues, less the shift that happened inside its window, and a choice's is the
sum over its chunks in their order: where no two chunks' copies share a queue (their windows do
not overlap), every term is bitwise the per-chunk model's and so is the sum. Where they share
it, a copy waits for the one ahead and exposes more; a wait may also give copies behind it time
to catch up, which the per-chunk model did not see either.
The walk's state is the shift (the delay so far), the queues' free times and the offload ends of
the chunks in flight; all are maxima and sums of the inputs, so more bytes never expose less.
`added_each` walks candidate changes as arrays, from the first one's offload to the end; the
steps before it are the choice's own, recorded once per choice (`_Base`).
Still a chunk alone in its window: `CopyTiming.slack_s` (`hides`, `exposed_s`), which the search
reads only to order groups that tie on this cost (`budget._slack`), and `PlanPolicy`'s kept tail
and timed reload ahead (NOTE [Kept tail], NOTE [Timed reload ahead]), which plan one chunk's
copies and reloads.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from ._budget_layout import Chunk

if TYPE_CHECKING:
    from .choice import CopyTiming

__all__ = ["Link"]

_IDLE = -math.inf
"""Free time of a queue nothing used yet."""


class _State:
    """Where a walk stands: shift (seconds compute was delayed), the queues' free times, and per
    chunk (by index) its offload end; floats, or arrays over candidates. With ``exposures``, also
    per chunk its wait in the out queue, the shift when it entered, and its exposure."""

    __slots__ = ("shift", "out_free", "back_free", "out_end", "out_wait", "entered", "exposed")

    def __init__(self, shift, out_free, back_free, out_end: list, exposures: bool = False) -> None:
        self.shift, self.out_free, self.back_free, self.out_end = shift, out_free, back_free, out_end
        n = len(out_end) if exposures else 0
        self.out_wait, self.entered, self.exposed = [0.0] * n, [0.0] * n, [0.0] * n


class _Base:
    """One choice: the state before each step of its walk, its copies' seconds, and the changes
    already evaluated on it. Made from the previous choice, it walks again only from the first
    changed chunk's offload on."""

    def __init__(self, link: "Link", values: list[int], previous: "_Base | None") -> None:
        self.values, self.moved = values, np.array(values, dtype=np.int64)
        """Each chunk's copied bytes, a list and an array."""
        self.seconds = link.seconds(values)
        """Per chunk: (seconds its offload takes, seconds its reload takes)."""
        self.memo: dict[int, float] = {}
        """Seconds added, by change * chunks + chunk index (`Link.added`)."""
        self.exposed: list[float] | None = None
        """Per chunk its exposure, walked when asked for (`Link.total`)."""
        if previous is None:
            at, self.states = 0, []
            state = _State(0.0, _IDLE, _IDLE, [_IDLE] * len(values))
        else:
            at = min(link.first[k] for k, (a, b) in enumerate(zip(previous.values, values)) if a != b)
            self.states = previous.states[:at]
            state = _State(*previous.states[at], list(previous.out_end))
        link.walk(state, at, self.seconds, max, self.states)
        self.states.append((state.shift, state.out_free, state.back_free))
        self.shift, self.out_end = state.shift, state.out_end
        """The walk's end: its shift, and per chunk its offload end."""

    def start(self, at: int, fill: Callable = float) -> _State:
        """The state before step ``at``, its three values made by ``fill`` (a float or an array)."""
        return _State(*map(fill, self.states[at]), list(self.out_end))


class Link:
    """Exposed link seconds of one plan's choices for a measured `CopyTiming` (NOTE [Link queue])."""

    def __init__(self, timing: "CopyTiming", steps: Mapping[Chunk, tuple[int, int]], order: Sequence[Chunk]) -> None:
        """``steps``: per chunk, the plan indices of its forward and backward; ``order``: the
        chunks as the search numbers them (`_Search.order`) and its ``moved`` lists them."""
        self.timing, self.order = timing, list(order)
        self.out_rate = timing.bytes_per_s
        self.back_rate = timing.bytes_per_s if timing.reload_bytes_per_s is None else timing.reload_bytes_per_s
        self.window = [timing.window_s(*steps[chunk]) for chunk in self.order]
        """Each chunk's window in seconds (`CopyTiming.window_s`), by its index in ``order``."""
        walk = []  # (action, rank within it, is offload, chunk index)
        for k, chunk in enumerate(self.order):
            forward, backward = steps[chunk]
            enters = min(forward + 1, backward)
            # At one action a backward's wait comes first, then the offload entering at its start;
            # a chunk whose backward follows its forward enters before its own backward.
            walk.append((enters, -1 if enters == backward else 1, True, k))
            walk.append((backward, 0, False, k))
        walk.sort()
        self.steps = [(k, float(timing.action_starts_s[action]), offload) for action, _, offload, k in walk]
        """The walk's steps in order: (chunk index, start of the action, offload or reload)."""
        self.first = [0] * len(self.order)
        """Per chunk: the step its offload enters at."""
        for j, (k, _, offload) in enumerate(self.steps):
            if offload:
                self.first[k] = j
        self._base: _Base | None = None

    def seconds(self, nbytes: Sequence) -> list[tuple]:
        """Per chunk (``nbytes`` a list of ints or arrays): seconds its offload and its reload take."""
        return [(m / self.out_rate, m / self.back_rate) for m in nbytes]

    def walk(self, state: _State, first: int, seconds: list, maximum: Callable, record: list | None = None) -> None:
        """Walk the steps from ``first`` on ``state`` (changed in place): ``seconds[k]`` is chunk
        ``k``'s (`seconds`), floats or arrays over candidates (``maximum``: `max`, or `np.maximum`
        for arrays); ``record`` gets (shift, out free, back free) before each step. Exposures are
        kept where ``state`` has room for them."""
        shift, out_free, back_free, out_end = state.shift, state.out_free, state.back_free, state.out_end
        exposures = bool(state.exposed)
        for k, start, offload in self.steps[first:]:
            if record is not None:
                record.append((shift, out_free, back_free))
            out_s, back_s = seconds[k]
            each = type(out_s) is np.ndarray
            if not each and not out_s:
                continue
            if offload:
                ready = start + shift
                if exposures:
                    state.out_wait[k], state.entered[k] = max(out_free - ready, 0.0), shift
                # A candidate copying nothing only raises the free time to its own start: no later copy starts before that.
                out_end[k] = out_free = maximum(out_free, ready) + out_s
                continue
            begins = maximum(back_free, out_end[k])
            back_end = begins + back_s
            if each:  # a candidate copying nothing reloads nothing
                back_end = np.where(out_s > 0, back_end, back_free)
            if exposures:
                # NOTE [Link queue]: the per-chunk model's round trip - window, plus the waits, less the shift inside the window.
                waited = state.out_wait[k] + (begins - out_end[k])
                state.exposed[k] = max(0.0, out_s + back_s + waited - self.window[k] - (shift - state.entered[k]))
            back_free, shift = back_end, maximum(shift, back_end - start)
        state.shift, state.out_free, state.back_free = shift, out_free, back_free

    def exposures(self, moved: Mapping[Chunk, int]) -> dict[Chunk, float]:
        """Seconds each chunk exposes (NOTE [Link queue]), given each chunk's copied bytes."""
        base = self._base_for(moved)
        if base.exposed is None:
            state = _State(0.0, _IDLE, _IDLE, [_IDLE] * len(self.order), exposures=True)
            self.walk(state, 0, base.seconds, max)
            base.exposed = state.exposed
        return dict(zip(self.order, base.exposed))

    def total(self, moved: Mapping[Chunk, int]) -> float:
        """Exposed seconds of a whole choice: the chunks' exposures summed in ``order``."""
        return sum(self.exposures(moved).values(), 0.0)

    def added(self, moved: Mapping[Chunk, int], chunk: int, change: int) -> float:
        """Exposed seconds that ``change`` more bytes copied by chunk ``chunk`` (its index in
        ``order``) add to the choice ``moved`` (negative ``change``: the seconds keeping them on
        device gives back, as a negative)."""
        base = self._base_for(moved)
        key = change * len(self.order) + chunk
        if key not in base.memo:
            seconds = list(base.seconds)
            seconds[chunk] = self.seconds([base.values[chunk] + change])[0]
            state = base.start(self.first[chunk])
            self.walk(state, self.first[chunk], seconds, max)
            base.memo[key] = state.shift - base.shift
        return base.memo[key]

    def added_each(self, moved: Mapping[Chunk, int], chunks: np.ndarray, change: np.ndarray) -> np.ndarray:
        """`added` for many changes at once (``chunks``, ``change``: arrays): one walk from the
        first one's offload, arrays over the distinct changes not evaluated on this choice yet."""
        base, n = self._base_for(moved), len(self.order)
        keys = (change.astype(np.int64) * n + chunks).tolist()  # one per (chunk, change), as `added`'s
        todo = [key for key in dict.fromkeys(keys) if key not in base.memo]
        if todo:
            cand = np.array(todo, dtype=np.int64) % n
            new = np.array(self.seconds([np.array(todo, dtype=np.int64) // n + base.moved[cand]])[0])  # (2, candidates)
            seconds = list(base.seconds)
            for k in set(cand.tolist()):
                seconds[k] = np.where(cand == k, new, np.array(seconds[k])[:, None])
            first = min(self.first[k] for k in set(cand.tolist()))
            state = base.start(first, lambda value: np.full(len(todo), value))
            self.walk(state, first, seconds, np.maximum)
            base.memo.update(zip(todo, (state.shift - base.shift).tolist()))
        return np.fromiter(map(base.memo.__getitem__, keys), dtype=np.float64, count=len(keys))

    def _base_for(self, moved: Mapping[Chunk, int]) -> _Base:
        values = list(moved.values())
        if self._base is None or self._base.values != values:
            self._base = _Base(self, values, self._base)
        return self._base
