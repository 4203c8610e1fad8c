"""The ordering rules of reloads, as pure functions of the groups' states and bytes.

The engine (`ChunkOffloadHandler`) and the predictor (`chunk_offload.schedule.simulate`) both
call these, so a rule lives once. Each takes a chunk's groups in forward order as
``(GroupState, saved_bytes)`` pairs and returns the indices to reload, in issue order.

NOTE [Reload order]
Backward runs a chunk's groups from the last to the first. When group ``index``'s backward
starts, `reload_ahead_selection` picks the groups before it to reload now (their copies
overlap this group's backward). Before a chunk's backward starts, a `SchedulePolicy` may ask
for a prefetch of the chunk (`SchedulePolicy.prefetch_on`: which chunk, during which action,
with which byte budget); `prefetch_selection` picks that chunk's groups. To change which
groups are reloaded early, edit one of these two functions; to change which chunk is
prefetched when, edit the policy (`chunk_offload.schedule.PlanPolicy.prefetch_on`).

NOTE [Kept tail]
In a chunk whose backward follows its forward at once (PP=1, the last stage under 1F1B), the
first groups' saved tensors still wait for the forward of every later group and the backward
of every later group, so they are worth copying; the last ones are not: a copy out and back
cannot end before their backward needs them. `kept_tail` says how many last groups stay on
device: every group from the end whose copy out and back (twice its bytes over the link rate)
takes longer than the compute between its commit and its backward (the forward and backward
of the groups after it); at least the last group, whose backward starts right after its
commit. Without timing (no link rate measured yet), the last group alone. The others are
copied at their commits and reloaded in backward by `reload_ahead_selection`.

NOTE [Timed reload ahead]
`reload_ahead_budget` derives a chunk's ``reload_ahead_bytes`` from the reload link's rate and
each group's backward seconds, on a model of the link queue. Backward runs the groups from the
last; when group g's backward starts, its own reload is issued if it is still on host, then the
reloads `reload_ahead_selection` picks under the budget; reloads run one at a time on one h2d
stream, in issue order, each taking bytes / rate and starting no earlier than its group's copy
to host ended (``on_host_at_s``: where a chunk's backward follows its forward at once, the last
copies to host may still run when it starts; the reload stream waits for them, and the reloads
queued behind them wait too); compute waits at g's start until g's reload ends, then computes
``backward_s[g]``. Groups not on host when backward starts (kept, empty, or reloading from a
prefetch during the action before) are on device at once. A larger budget only issues the same
reloads, in the same order, earlier, so the predicted wait never grows with it.
The answer is the smallest budget whose wait is the least any budget reaches (none, where the
link keeps up): each group's reload starts early enough to end before its backward needs it,
and no earlier. The rule's choice changes only at sums of consecutive groups' bytes, so those
are bisected. None where one group ahead already reaches that least wait.
"""

from __future__ import annotations

from typing import Sequence

from .errors import ChunkOffloadError
from .group_state import GroupState

__all__ = ["kept_tail", "predicted_reload_wait", "prefetch_selection", "reload_ahead_budget", "reload_ahead_selection"]

_LOADED = (GroupState.RELOADING, GroupState.RESIDENT)


def reload_ahead_selection(
    groups: Sequence[tuple[GroupState, int]], index: int, budget_bytes: int | None, *, ahead_bytes: int | None = None
) -> list[int]:
    """Backward reached group ``index``: the groups before it whose reload starts now.

    The group just before is always reloaded (if on host). With ``budget_bytes`` (a chunk's
    ``reload_ahead_bytes``), earlier groups follow while the bytes of the groups before
    ``index`` that are reloading or resident still fit: a large group behind a small one (a
    layer's core attention behind its projection) then starts its copy early enough.
    ``ahead_bytes``: those bytes, where the caller keeps their sum (`_predicted_wait`, which
    calls this once per group of a chunk for each budget it tries); None: summed here.
    """
    if index == 0:
        return []
    if budget_bytes is None:
        return [index - 1] if groups[index - 1][0] is GroupState.ON_HOST else []
    ahead = loaded_bytes_before(groups, index) if ahead_bytes is None else ahead_bytes
    chosen = []
    for position, i in enumerate(reversed(range(index))):
        state, nbytes = groups[i]
        if state is not GroupState.ON_HOST:
            continue
        if position > 0 and ahead + nbytes > budget_bytes:
            break
        chosen.append(i)
        ahead += nbytes
    return chosen


def loaded_bytes_before(groups: Sequence[tuple[GroupState, int]], index: int) -> int:
    """The bytes of the groups before ``index`` that are reloading or resident: what a reload-ahead budget counts."""
    return sum(nbytes for state, nbytes in groups[:index] if state in _LOADED)


def prefetch_selection(groups: Sequence[tuple[GroupState, int]], budget_bytes: int | None) -> list[int]:
    """The groups a prefetch of a chunk reloads ahead of its backward.

    Groups are taken from the last one down while their bytes fit in ``budget_bytes``
    (stopping at the first that does not); None takes one group, the one backward needs first
    (the engine reloads the group before it when that backward starts). Groups not on host
    (kept, already reloading, empty) are skipped without counting.
    """
    chosen, issued = [], 0
    for i in reversed(range(len(groups))):
        state, nbytes = groups[i]
        if state is not GroupState.ON_HOST:
            continue
        if budget_bytes is not None and issued + nbytes > budget_bytes:
            break
        chosen.append(i)
        issued += nbytes
        if budget_bytes is None:
            break
    return chosen


def kept_tail(
    group_bytes: Sequence[int],
    *,
    bytes_per_s: float | None = None,
    compute_s: Sequence[float] | None = None,
    reload_bytes_per_s: float | None = None,
) -> int:
    """How many last groups of a chunk whose backward follows its forward at once stay on device.

    ``group_bytes``: the chunk's saved bytes per group, in forward order; ``bytes_per_s``: the
    link's copy rate to host; ``reload_bytes_per_s``: back to the device, where it differs (None:
    ``bytes_per_s``); ``compute_s``: each group's forward plus backward compute seconds. Without
    a rate and the compute: 1 (the last group). See NOTE [Kept tail].
    """
    n = len(group_bytes)
    if n == 0:
        return 0
    if bytes_per_s is None or compute_s is None:
        return 1
    back = bytes_per_s if reload_bytes_per_s is None else reload_bytes_per_s
    kept, after = 1, float(compute_s[-1])
    for g in reversed(range(n - 1)):
        if group_bytes[g] / bytes_per_s + group_bytes[g] / back <= after:
            break
        kept += 1
        after += float(compute_s[g])
    return kept


def reload_ahead_budget(
    groups: Sequence[tuple[GroupState, int]],
    *,
    reload_bytes_per_s: float,
    backward_s: Sequence[float],
    on_host_at_s: Sequence[float] | None = None,
) -> int | None:
    """The smallest ``reload_ahead_bytes`` under which a chunk's reloads wait least (NOTE [Timed reload ahead]).

    ``groups``: the chunk's groups in forward order as they are when its backward starts;
    ``reload_bytes_per_s``: the host-to-device link rate; ``backward_s``: each group's backward
    compute seconds; ``on_host_at_s``: per group, the seconds after the backward's start at which
    its copy to host ends (<= 0 or None: done before). None where one group ahead already waits least.
    """
    lag = _check_model(groups, reload_bytes_per_s, backward_s, on_host_at_s)
    prefix = [0]
    for state, nbytes in groups:  # the bytes the rule counts: on host, or already reloading
        prefix.append(prefix[-1] + (nbytes if state in (GroupState.ON_HOST, *_LOADED) else 0))
    least = _predicted_wait(groups, prefix[-1], reload_bytes_per_s, backward_s, lag)  # every reload as early as the rule allows
    slack = 1e-9 * (sum(backward_s) + prefix[-1] / reload_bytes_per_s + max(lag))  # rounding, not a tolerance of the model
    if _predicted_wait(groups, None, reload_bytes_per_s, backward_s, lag) <= least + slack:
        return None
    sums = sorted({prefix[k] - prefix[j] for k in range(len(prefix)) for j in range(k) if prefix[k] > prefix[j]})
    lo, hi = 0, len(sums) - 1  # sums[hi] == prefix[-1] reaches `least`
    while lo < hi:
        mid = (lo + hi) // 2
        if _predicted_wait(groups, sums[mid], reload_bytes_per_s, backward_s, lag) <= least + slack:
            hi = mid
        else:
            lo = mid + 1
    return sums[lo]


def predicted_reload_wait(
    groups: Sequence[tuple[GroupState, int]],
    budget_bytes: int | None,
    *,
    reload_bytes_per_s: float,
    backward_s: Sequence[float],
    on_host_at_s: Sequence[float] | None = None,
) -> float:
    """Seconds compute waits on reloads in a chunk's backward under ``budget_bytes`` of reload
    ahead (None: one group ahead), on the model of NOTE [Timed reload ahead]; arguments as
    `reload_ahead_budget` takes them."""
    lag = _check_model(groups, reload_bytes_per_s, backward_s, on_host_at_s)
    return _predicted_wait(groups, budget_bytes, reload_bytes_per_s, backward_s, lag)


def _check_model(
    groups: Sequence[tuple[GroupState, int]], rate: float, backward_s: Sequence[float], on_host_at_s: Sequence[float] | None
) -> list[float]:
    """Raise on inputs the model cannot take; each group's time on host after the backward's start (>= 0)."""
    if len(backward_s) != len(groups):
        raise ChunkOffloadError(f"chunk_offload: backward_s has {len(backward_s)} entries for {len(groups)} groups; give one per group")
    if not rate > 0:
        raise ChunkOffloadError(f"chunk_offload: reload_bytes_per_s must be > 0, got {rate!r}")
    if on_host_at_s is None:
        return [0.0] * len(groups)
    if len(on_host_at_s) != len(groups):
        raise ChunkOffloadError(f"chunk_offload: on_host_at_s has {len(on_host_at_s)} entries for {len(groups)} groups; give one per group")
    return [max(0.0, float(t)) for t in on_host_at_s]


def _predicted_wait(
    groups: Sequence[tuple[GroupState, int]], budget: int | None, rate: float, backward_s: Sequence[float], on_host_at: Sequence[float]
) -> float:
    pairs = list(groups)
    n = len(pairs)
    arrival = [0.0] * n
    now = link = waited = 0.0
    ahead = loaded_bytes_before(pairs, n - 1)  # kept as the loop runs: O(n) per budget
    for g in reversed(range(n)):
        issued = [g] if pairs[g][0] is GroupState.ON_HOST else []
        for i in issued + reload_ahead_selection(pairs, g, budget, ahead_bytes=ahead):  # the rule's issue order, as the engine's
            # The reload stream waits for the group's copy to host (R4), holding the reloads behind it.
            link = max(link, now, on_host_at[i]) + pairs[i][1] / rate
            arrival[i] = link
            pairs[i] = (GroupState.RELOADING, pairs[i][1])
            if i < g:  # on host until now: counted ahead from here on
                ahead += pairs[i][1]
        if arrival[g] > now:
            waited += arrival[g] - now
            now = arrival[g]
        now += backward_s[g]
        pairs[g] = (GroupState.RELEASED, pairs[g][1])
        if g and pairs[g - 1][0] in _LOADED:  # the next group's own bytes are not ahead of it
            ahead -= pairs[g - 1][1]
    return waited
