"""NOTE [CUDA graph capture]: no offload group opens while compute is capturing a CUDA graph.

A graph's replays run none of the hooks that copy saved tensors to host and back, so a group
inside a captured region would corrupt the host buffers other groups reuse. The engine asks its
`StreamBackend` (`capturing`) at each group's open; here a `CpuStreams` whose compute stream
"captures" on demand stands for a CUDA one (tests/gpu captures for real). Each way a group opens
(a module's hooks, `group_start`, Transformer Engine's pack hook) must raise before it pushes a
hook or issues a copy, leave nothing behind, and let the next iteration train bit-identically.
"""

from __future__ import annotations

import pytest
import torch

from chunk_offload import ChunkOffloadError, CpuStreams, OffloadConfig, OffloadManager
from tests._driver import assert_identical, drive
from tests.core._errors import CHUNK0
from tests.core._models import Block, assert_clean, make_stack, microbatches, register

_REFUSED = r"started while a CUDA graph is being captured on the compute stream .*Keep offloaded modules out of captured regions"


class CapturingStreams(CpuStreams):
    """CPU streams whose compute stream captures a CUDA graph while ``capture`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.capture = False
        self.asked = 0  # `capturing` calls: one per group opened

    def capturing(self) -> bool:
        self.asked += 1
        return self.capture


@pytest.fixture
def capturing():
    """A manager (``min_offload_bytes=1``) on `CapturingStreams`, and the streams."""
    streams = CapturingStreams()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=streams)
    yield manager, streams
    manager.close()


def _trains_like_no_offload(manager: OffloadManager, model: torch.nn.Module) -> None:
    """With the capture over, one iteration equals that of a fresh model without offload."""
    xs = microbatches(2)
    assert_identical(drive(make_stack(2, seed=0), inputs=xs, lr=None), drive(model, inputs=xs, manager=manager, lr=None))
    assert manager.stats().bytes_offloaded > 0
    assert_clean(manager)


@pytest.mark.parametrize("from_block", [0, 1], ids=["first-group", "mid-chunk"])
def test_a_module_group_opened_during_a_capture_raises_and_leaves_nothing(capturing, from_block):
    """Captured from the chunk's first group, or from the second block on (the first block's
    groups already copied to host: their buffers go back to the pool)."""
    manager, streams = capturing
    model = make_stack(2, seed=0)
    register(manager, model)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    handle = blocks[from_block].register_forward_pre_hook(lambda *_: setattr(streams, "capture", True))
    x = microbatches(1)[0]
    with pytest.raises(ChunkOffloadError, match=rf"group '\w+' of chunk {CHUNK0} {_REFUSED}"):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                model(x)
    assert_clean(manager)
    handle.remove()
    streams.capture = False
    _trains_like_no_offload(manager, model)
    assert streams.asked > 0


def test_group_start_during_a_capture_raises(capturing):
    manager, streams = capturing
    x = torch.randn(4, 8, requires_grad=True)
    streams.capture = True
    with pytest.raises(ChunkOffloadError, match=rf"group 'manual' of chunk {CHUNK0} {_REFUSED}"):
        with manager.iteration():
            with manager.chunk(microbatch=0):
                manager.group_start(x, "manual")
    assert_clean(manager)


def test_transformer_engine_pack_hook_during_a_capture_raises(capturing):
    """TE's saved-tensor hook opens the handler's group at its first tensor (`tensor_push`)."""
    manager, streams = capturing
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ChunkOffloadError, match=rf"group 'te_group' of chunk {CHUNK0} {_REFUSED}"):
        with manager.iteration():
            with manager.chunk(microbatch=0) as handler:
                streams.capture = True
                handler.tensor_push(x.sin())
    assert_clean(manager)
