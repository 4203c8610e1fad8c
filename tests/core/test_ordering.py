"""The reload ordering rules (`chunk_offload.core.ordering`), as the pure functions the engine and
`simulate` share."""

from __future__ import annotations

import random

import pytest

from chunk_offload.core import ChunkOffloadError, GroupState
from chunk_offload.core.ordering import kept_tail, predicted_reload_wait, prefetch_selection, reload_ahead_budget, reload_ahead_selection

H, K, L, R, X = GroupState.ON_HOST, GroupState.KEPT, GroupState.RELOADING, GroupState.RESIDENT, GroupState.RELEASED


def test_reload_ahead_without_budget_takes_the_group_just_before():
    groups = [(H, 10), (H, 20), (R, 30)]
    assert reload_ahead_selection(groups, 2, None) == [1]
    assert reload_ahead_selection(groups, 0, None) == []
    assert reload_ahead_selection([(R, 10), (R, 20)], 1, None) == []  # not on host: nothing to do


def test_reload_ahead_with_budget_counts_bytes_already_loading():
    groups = [(H, 40), (H, 30), (H, 5), (R, 100)]
    # The group just before always goes; then earlier ones while the loaded-ahead bytes fit.
    assert reload_ahead_selection(groups, 3, 35) == [2, 1]
    assert reload_ahead_selection(groups, 3, 34) == [2]
    # 30 bytes already reloading count against the budget.
    assert reload_ahead_selection([(H, 40), (L, 30), (H, 5), (R, 100)], 3, 35) == [2]
    # A group not on host is skipped but counts as a position: the first on-host one is not forced.
    assert reload_ahead_selection([(H, 40), (X, 0), (R, 100)], 2, 10) == []


def test_prefetch_takes_the_last_groups_within_the_budget():
    groups = [(H, 10), (H, 20), (H, 30)]
    assert prefetch_selection(groups, None) == [2]
    assert prefetch_selection(groups, 50) == [2, 1]
    assert prefetch_selection(groups, 29) == []  # the first does not fit: stop there
    assert prefetch_selection([(H, 10), (K, 20), (X, 0)], None) == [0]  # kept and empty groups are skipped


def test_kept_tail_keeps_the_groups_whose_copy_cannot_hide():
    assert kept_tail([]) == 0
    assert kept_tail([10, 20, 30]) == 1  # no timing: the last group only
    # 10 bytes/s: a group of b bytes needs 2 b / 10 s out and back; each group computes 1 s.
    assert kept_tail([10, 20, 30], bytes_per_s=10.0, compute_s=[1.0, 1.0, 1.0]) == 2  # 20 B: 4 s > 1 s; 10 B: 2 s <= 2 s
    assert kept_tail([10, 20, 30], bytes_per_s=10.0, compute_s=[1.0, 1.0, 5.0]) == 1  # 20 B: 4 s <= 5 s
    assert kept_tail([50, 20, 30], bytes_per_s=10.0, compute_s=[1.0, 1.0, 1.0]) == 3  # nothing hides
    # Links that differ by direction: 10 B out at 10 B/s (1 s) and back at 40 B/s (0.25 s) fit 2 s;
    # back at 5 B/s (2 s) they do not.
    assert kept_tail([10, 20, 30], bytes_per_s=10.0, reload_bytes_per_s=40.0, compute_s=[1.0, 1.0, 1.0]) == 2
    assert kept_tail([10, 20, 30], bytes_per_s=10.0, reload_bytes_per_s=5.0, compute_s=[1.0, 1.0, 1.0]) == 3
    assert kept_tail([10, 20, 30], bytes_per_s=10.0, reload_bytes_per_s=10.0, compute_s=[1.0, 1.0, 5.0]) == 1


def test_reload_ahead_budget_is_none_where_one_group_ahead_waits_least():
    # Uniform groups, the last kept: each reload (1 s) hides behind the backward of the group after it (1 s).
    uniform = [(H, 10)] * 4 + [(K, 10)]
    assert reload_ahead_budget(uniform, reload_bytes_per_s=10.0, backward_s=[1.0] * 5) is None
    assert reload_ahead_budget([(K, 10), (K, 10)], reload_bytes_per_s=1.0, backward_s=[0.0, 0.0]) is None  # nothing on host
    # A link that is busy from the start under one group ahead: no budget waits less (10 s per reload, 1 s per backward).
    assert reload_ahead_budget(uniform, reload_bytes_per_s=1.0, backward_s=[1.0] * 5) is None


def test_reload_ahead_budget_starts_a_large_group_behind_a_small_one_in_time():
    # Forward order: a large group (100 B, 10 s on the link), a small one (10 B, 1 s), a kept one.
    # One ahead: the large reload starts when the small group's 1 s backward does, 9 s of wait.
    # Issued with the small one while the kept group computes (10 s), it ends at 11 s: exactly in time.
    groups = [(H, 100), (H, 10), (K, 10)]
    assert reload_ahead_budget(groups, reload_bytes_per_s=10.0, backward_s=[10.0, 1.0, 10.0]) == 110
    # The kept group computes 9 s only: the large reload ends 1 s late whatever the budget, and 110 still waits least.
    assert reload_ahead_budget(groups, reload_bytes_per_s=10.0, backward_s=[10.0, 1.0, 9.0]) == 110
    # Small and large groups alternating, backward time proportional to bytes, a link twice as fast as compute:
    # each large reload must start with the small group before it, as the large group after them computes.
    layers = [(H, 1), (H, 10)] * 3 + [(H, 1), (K, 10)]
    assert reload_ahead_budget(layers, reload_bytes_per_s=1.0, backward_s=[2.0 * b for _, b in layers]) == 11
    # A group already reloading (a prefetch) needs no reload, and its 10 B count against the budget as the rule counts them.
    prefetched = [(H, 100), (R, 10), (K, 10)]
    assert reload_ahead_budget(prefetched, reload_bytes_per_s=10.0, backward_s=[10.0, 1.0, 10.0]) == 110


def test_reload_ahead_budget_on_a_link_slower_than_compute_waits_least():
    # 10 s per reload, 18 s of backward for 30 s of reloads: some wait is unavoidable. One ahead leaves
    # the link idle from 10 s to 15 s (18 s of wait); reloading the two groups before the kept one
    # during its 15 s backward keeps the link busy (13 s, the least); all three waits no less.
    groups = [(H, 10)] * 3 + [(K, 10)]
    assert reload_ahead_budget(groups, reload_bytes_per_s=1.0, backward_s=[1.0, 1.0, 1.0, 15.0]) == 20


def test_reload_ahead_budget_checks_its_arguments():
    with pytest.raises(ChunkOffloadError, match="backward_s has 1 entries for 2 groups"):
        reload_ahead_budget([(H, 1), (H, 1)], reload_bytes_per_s=1.0, backward_s=[1.0])
    with pytest.raises(ChunkOffloadError, match="reload_bytes_per_s must be > 0, got 0"):
        reload_ahead_budget([(H, 1)], reload_bytes_per_s=0, backward_s=[1.0])


def test_predicted_reload_wait_is_the_models_wait_under_a_budget():
    # A large group (10 s on the link), a small one (1 s), a kept one (10 s of backward): one
    # group ahead the large reload starts with the small group's backward and waits 10 - 1 s;
    # 110 bytes ahead it starts with the kept group's and ends as the small group's ends.
    groups = [(H, 100), (H, 10), (K, 10)]
    assert predicted_reload_wait(groups, None, reload_bytes_per_s=10.0, backward_s=[10.0, 1.0, 10.0]) == 9.0
    assert predicted_reload_wait(groups, 110, reload_bytes_per_s=10.0, backward_s=[10.0, 1.0, 10.0]) == 0.0
    with pytest.raises(ChunkOffloadError, match=r"backward_s has 2 entries for 3 groups; give one per group"):
        predicted_reload_wait(groups, None, reload_bytes_per_s=10.0, backward_s=[1.0, 1.0])
    with pytest.raises(ChunkOffloadError, match=r"reload_bytes_per_s must be > 0, got 0.0"):
        predicted_reload_wait(groups, None, reload_bytes_per_s=0.0, backward_s=[1.0] * 3)


def test_a_reload_waits_for_its_copy_to_host():
    """The same groups, the large one's copy to host ending 12 s into the backward: its reload
    starts then, whatever the budget, and ends at 22 s, 11 s after the small group's backward
    ended; so one group ahead waits least already. Copies that ended before change nothing."""
    groups, backward = [(H, 100), (H, 10), (K, 10)], [10.0, 1.0, 10.0]
    for budget in (None, 110):
        assert predicted_reload_wait(groups, budget, reload_bytes_per_s=10.0, backward_s=backward, on_host_at_s=[12.0, 0.0, 0.0]) == 11.0
    assert reload_ahead_budget(groups, reload_bytes_per_s=10.0, backward_s=backward, on_host_at_s=[12.0, 0.0, 0.0]) is None
    assert reload_ahead_budget(groups, reload_bytes_per_s=10.0, backward_s=backward, on_host_at_s=[-5.0, -1.0, 0.0]) == 110
    with pytest.raises(ChunkOffloadError, match=r"on_host_at_s has 1 entries for 3 groups; give one per group"):
        predicted_reload_wait(groups, None, reload_bytes_per_s=10.0, backward_s=backward, on_host_at_s=[1.0])


def _wait_calling_the_rule_as_the_engine_does(groups, budget, rate, backward_s):
    """The model's wait with each selection summing its bytes ahead itself (``ahead_bytes`` None)."""
    pairs, arrival, now, link, waited = list(groups), [0.0] * len(groups), 0.0, 0.0, 0.0
    for g in reversed(range(len(pairs))):
        for i in ([g] if pairs[g][0] is H else []) + reload_ahead_selection(pairs, g, budget):
            link = max(link, now) + pairs[i][1] / rate
            arrival[i], pairs[i] = link, (GroupState.RELOADING, pairs[i][1])
        waited, now = waited + max(0.0, arrival[g] - now), max(now, arrival[g]) + backward_s[g]
        pairs[g] = (GroupState.RELEASED, pairs[g][1])
    return waited


@pytest.mark.parametrize("seed", range(20))
def test_the_models_running_sum_of_bytes_ahead_is_the_rules_own(seed):
    """`predicted_reload_wait` keeps the bytes ahead as it goes (linear per budget, not quadratic):
    on random chunks (prefetched and kept groups among them) and budgets, the same waits as calling
    the rule the way the engine calls it."""
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    groups = [(rng.choice([H, H, H, K, GroupState.RELOADING]), rng.choice([1, 2, 5, 8, 20])) for _ in range(n)]
    backward = [rng.uniform(0.1, 3.0) for _ in range(n)]
    for budget in (None, 0, 5, 13, 40, sum(b for _, b in groups)):
        expected = _wait_calling_the_rule_as_the_engine_does(groups, budget, 4.0, backward)
        assert predicted_reload_wait(groups, budget, reload_bytes_per_s=4.0, backward_s=backward) == expected
