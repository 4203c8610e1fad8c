"""The reload ordering rules (`chunk_offload.core.ordering`), as the pure functions the engine and
`simulate` share."""

from __future__ import annotations

from chunk_offload.core import GroupState
from chunk_offload.core.ordering import kept_tail, prefetch_selection, reload_ahead_selection

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
