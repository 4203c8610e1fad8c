"""On a real GPU, an offloaded module captured in a CUDA graph is refused (NOTE [CUDA graph capture]).

`torch.cuda.graph` captures one training step of an offloaded layer: the group's open raises
before any copy is issued, the capture ends with that error, and nothing is left behind; the
same layer then trains eagerly with offload. tests/core/test_cuda_graph_capture.py checks the
same on CPU streams that pretend to capture.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadConfig, OffloadManager
from tests.core._models import assert_clean

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine: bash bench/gpu_evidence.sh)")


def test_an_offloaded_module_inside_a_captured_graph_is_refused() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(256, 256), nn.GELU()).to(device)
    x = torch.randn(64, 256, device=device, requires_grad=True)
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    manager.offload_module(layer, "mlp")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph needs
            layer(x).sum().backward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ChunkOffloadError, match=r"group 'mlp' .* started while a CUDA graph is being captured"):
            with manager.iteration():
                with manager.chunk(microbatch=0):
                    with torch.cuda.graph(graph):
                        layer(x)
        assert_clean(manager)
        with manager.iteration():
            with manager.chunk(microbatch=0):
                loss = layer(x).sum()
            loss.backward()
        assert manager.stats().bytes_offloaded > 0
        assert_clean(manager)
    finally:
        manager.close()
