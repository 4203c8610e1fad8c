"""A manager kept after its model is dropped keeps no model alive: the model's hooks hold the
manager, never the other way (`MegatronOffloadManager.model_chunks` is held weakly)."""

from __future__ import annotations

import gc
import importlib.util
import weakref

import pytest

from chunk_offload import ChunkOffloadError
from tests.integrations.megatron.conftest import managed, pipeline_of_one  # noqa: F401 (fixtures)

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron-core is not installed")
@pytest.mark.parametrize("close", [True, False])
def test_a_detached_manager_kept_after_its_model_keeps_no_model_alive(managed, close: bool) -> None:
    from tests.integrations.megatron._auto_iterations import train_step

    chunk, manager = managed(iterations="auto", num_microbatches=2, schedule_policy="plan")
    for first in (0, 2, 4):
        train_step(chunk, 2, first=first)
    manager.end_iteration()
    assert manager.model_chunks == [chunk]
    manager.detach()
    if close:
        manager.close()
    model, weight = weakref.ref(chunk), weakref.ref(chunk.decoder.layers[0].self_attention.linear_qkv.weight)
    del chunk
    gc.collect()
    assert model() is None and weight() is None
    assert manager.model_chunks == [] and manager.training_calls == 3  # its records stay
    with pytest.raises(ChunkOffloadError, match="the model chunks this manager was attached to were freed; attach the new model instead"):
        manager.prepare_plan(2)
