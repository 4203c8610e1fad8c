"""Bounded layer groups (NOTE [Bounded layer groups] in core/marks.py).

With ``OffloadConfig(group_by="layer", layer_group_bytes=B)`` a layer's next call joins its pending
group only while that group holds fewer than B bytes to copy. Training stays bit-identical to
training without offload and moves exactly the bytes module groups move; the groups are the ones
the rule (`joins_layer_group`) gives; past the bound a registered joiner still joins, so a storage
two calls save is copied once; a bound needs layer groups.
"""

from __future__ import annotations

import pytest

from chunk_offload import ChunkOffloadError, OffloadConfig, OffloadManager
from chunk_offload.core import joins_layer_group
from tests._driver import assert_identical
from tests.core._models import MODULE_KINDS, ONE_F_ONE_B, run_schedule
from tests.core.test_joined_calls import LAYERS, _assert_same, _train

ITERATIONS = 2


def _run(**fields):
    """The shared stack under 1F1B with ``fields`` (None: without offload); the last iteration's stats."""
    recorded = []

    def factory() -> OffloadManager | None:
        return None if fields.get("off") else OffloadManager(OffloadConfig(min_offload_bytes=1, **fields))

    def record(manager: OffloadManager | None, iteration: int) -> None:
        if manager is not None and iteration == ITERATIONS - 1:
            recorded.append(manager.stats())

    result = run_schedule(factory, order=ONE_F_ONE_B, iterations=ITERATIONS, after_iteration=record)
    return result, (recorded[0] if recorded else None)


def test_the_rule() -> None:
    assert joins_layer_group(10**12, None)  # no bound: the whole layer
    assert joins_layer_group(99, 100) and not joins_layer_group(100, 100) and not joins_layer_group(1, 0)


def test_small_calls_share_a_group_and_large_ones_keep_their_own() -> None:
    baseline, _ = _run(off=True)
    by_module, module_stats = _run(group_by="call")
    per_call = {name: g.bytes_offloaded // g.groups for name, g in module_stats.groups.items()}
    # A norm's call saves whole storages only (its input, mean and rstd): its bytes per call are what
    # its group holds to copy (attn_norm's count the first layer's input, which it keeps, at commit only).
    bound = per_call["mlp_norm"] + 1
    assert per_call["qkv_linear"] == per_call["attn_proj"] == per_call["mlp_fc1"] < bound < per_call["core_attn"]
    bounded, stats = _run(group_by="layer", layer_group_bytes=bound)
    assert_identical(baseline, by_module)
    assert_identical(baseline, bounded)
    # attn_norm stays under the bound, and qkv_linear joins it; core_attn's group starts past it (the
    # projection's input alone is over), so attn_proj opens the next, under it, which mlp_norm joins.
    expected = ["attn_norm+qkv_linear", "core_attn", "attn_proj+mlp_norm", "mlp_fc1"]
    assert list(stats.groups) == expected
    calls = module_stats.groups["mlp_norm"].groups
    assert {name: g.groups for name, g in stats.groups.items()} == {name: calls for name in expected}
    for field in ("bytes_offloaded", "bytes_reloaded", "tensors_offloaded", "tensors_kept"):
        assert sum(getattr(g, field) for g in stats.groups.values()) == sum(getattr(g, field) for g in module_stats.groups.values()), field
    assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0


@pytest.mark.parametrize(("bound", "names"), [(1, list(MODULE_KINDS)), (1 << 40, ["+".join(MODULE_KINDS)])], ids=["one-byte", "huge"])
def test_the_bound_spans_module_groups_to_layer_groups(bound: int, names: list[str]) -> None:
    baseline, _ = _run(off=True)
    bounded, stats = _run(group_by="layer", layer_group_bytes=bound)
    assert_identical(baseline, bounded)
    assert list(stats.groups) == names


def test_past_the_bound_a_joiner_still_joins(make_manager) -> None:
    reference, _ = _train(None)
    manager = make_manager(group_by="layer", layer_group_bytes=1)
    grads, names = _train(manager)
    _assert_same(reference, grads)
    assert names == ["core+proj", "post"] * LAYERS  # the storage core and proj save is copied once
    shared = manager.stats().groups["core+proj"]
    assert shared.bytes_reloaded == shared.bytes_offloaded > 0


@pytest.mark.parametrize("group_by", ["call", "module"])
def test_a_bound_needs_layer_groups(group_by: str) -> None:
    with pytest.raises(ChunkOffloadError, match=rf"layer_group_bytes=4096 bounds layer groups; it needs group_by='layer', got group_by='{group_by}'"):
        OffloadManager(OffloadConfig(group_by=group_by, layer_group_bytes=4096))
