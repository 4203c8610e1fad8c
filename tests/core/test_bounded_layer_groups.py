"""Bounded layer groups (NOTE [Bounded layer groups] in core/marks.py).

With ``OffloadConfig(group_by="layer", layer_group_bytes=B)`` a layer's next call joins its pending
group only while that group holds fewer than B bytes to copy. Training stays bit-identical to
training without offload and moves exactly the bytes module groups move; the groups are the ones
the rule (`joins_layer_group`) gives; past the bound a registered joiner still joins, so a storage
two calls save is copied once. The bound is read under layer groups only: with ``group_by="call"``
or ``"module"`` it changes nothing. The default is bounded layer groups, 16 MiB.
"""

from __future__ import annotations

import pytest

from chunk_offload import OffloadConfig, OffloadManager
from chunk_offload.core import joins_layer_group
from chunk_offload.core.option_table import option
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


GROUP_FIELDS = ("groups", "bytes_offloaded", "bytes_reloaded", "tensors_offloaded", "tensors_kept", "bytes_kept_held_elsewhere")


def _groups(stats) -> list[tuple]:
    """The groups of ``stats`` in their order: each name with its counts (no timings)."""
    return [(name, *(getattr(g, field) for field in GROUP_FIELDS)) for name, g in stats.groups.items()]


@pytest.mark.parametrize("group_by", ["call", "module"])
def test_a_bound_is_read_under_layer_groups_only(group_by: str) -> None:
    # Under layer groups this bound splits the layer (attn_norm+qkv_linear holds it already); under
    # call or module groups it is accepted and changes nothing: the groups are those without a bound.
    bound = 4096
    _, unbounded_layers = _run(group_by="layer", layer_group_bytes=None)
    _, bounded_layers = _run(group_by="layer", layer_group_bytes=bound)
    assert list(unbounded_layers.groups) == ["+".join(MODULE_KINDS)]
    assert list(bounded_layers.groups) == ["attn_norm+qkv_linear", "core_attn", "attn_proj+mlp_norm", "mlp_fc1"]
    baseline, _ = _run(off=True)
    without, stats_without = _run(group_by=group_by, layer_group_bytes=None)
    bounded, stats = _run(group_by=group_by, layer_group_bytes=bound)
    assert OffloadConfig(group_by=group_by, layer_group_bytes=bound).layer_group_bytes == bound
    assert_identical(baseline, without)
    assert_identical(baseline, bounded)
    assert list(stats.groups) == list(MODULE_KINDS)
    assert _groups(stats) == _groups(stats_without)
    assert stats.bytes_offloaded == stats_without.bytes_offloaded > 0
    assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0


def test_the_default_is_bounded_layer_groups() -> None:
    assert option("group-by").default == "layer"
    assert option("layer-group-bytes").default == 16 << 20
    config = OffloadConfig()
    assert (config.group_by, config.layer_group_bytes) == ("layer", 16 << 20)
    # Every module of the tiny layer is far under 16 MiB: the default joins the whole layer, exactly
    # as the same bound given explicitly does.
    baseline, _ = _run(off=True)
    default, stats = _run()
    _, explicit_stats = _run(group_by="layer", layer_group_bytes=16 << 20)
    assert_identical(baseline, default)
    assert list(stats.groups) == ["+".join(MODULE_KINDS)]
    assert _groups(stats) == _groups(explicit_stats)
    assert stats.bytes_offloaded == explicit_stats.bytes_offloaded > 0
    assert stats.resident_bytes == 0 and stats.host_bytes == 0 and stats.pool.in_use_bytes == 0
