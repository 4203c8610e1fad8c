"""megatron_training_cpu: each rule applied while enabled, and everything restored by disable()."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from chunk_offload import ChunkOffloadError  # noqa: E402
from chunk_offload.devkit import megatron_training_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the rules are inert with CUDA")


def test_device_count_and_set_device_while_enabled_only() -> None:
    count, set_device = torch.cuda.device_count, torch.cuda.set_device
    with megatron_training_cpu.training_on_cpu() as rules:
        assert "device_count" in rules.applied
        assert torch.cuda.device_count() == 1
        torch.cuda.set_device(1)  # no error: nothing to select on CPU
    assert torch.cuda.device_count is count and torch.cuda.set_device is set_device
    assert torch.cuda.device_count() == 0
    assert rules.patched == () and rules.applied == []


def test_compile_helpers_imports_the_wheels_helpers_instead_of_make(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core.datasets.utils as utils

    original = utils.compile_helpers
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("make ran"))
    with megatron_training_cpu.training_on_cpu():
        utils.compile_helpers()  # the wheel ships helpers_cpp (and no Makefile: make would fail)
        monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)  # import fails
        with pytest.raises(ChunkOffloadError, match=r"^chunk_offload: .*helpers_cpp.* is there but megatron.core.datasets.helpers_cpp does not import"):
            utils.compile_helpers()
    assert utils.compile_helpers is original


def test_fused_kernels_load_does_nothing_where_the_module_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    fused = types.ModuleType("megatron.legacy.fused_kernels")

    def load(args):
        raise RuntimeError("nvcc")

    fused.load = load
    monkeypatch.setitem(sys.modules, "megatron.legacy", types.ModuleType("megatron.legacy"))
    monkeypatch.setitem(sys.modules, "megatron.legacy.fused_kernels", fused)
    with megatron_training_cpu.training_on_cpu() as rules:
        assert "fused_kernels" in rules.applied
        assert fused.load(None) is None
    assert fused.load is load


def test_fused_kernels_skipped_without_the_module() -> None:
    if importlib.util.find_spec("megatron.legacy") is not None:
        pytest.skip("a Megatron-LM checkout with megatron.legacy is on the path")
    with megatron_training_cpu.training_on_cpu() as rules:
        assert "fused_kernels" not in rules.applied


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None, reason="needs megatron.training (megatron-core >= 0.19)")
def test_initialize_megatron_gets_allow_no_cuda_at_every_binding() -> None:
    import megatron.training as mt
    import megatron.training.initialize as init
    import megatron.training.training as training

    original = init.initialize_megatron
    with megatron_training_cpu.training_on_cpu() as rules:
        assert "allow_no_cuda" in rules.applied
        assert mt.initialize_megatron is init.initialize_megatron is training.initialize_megatron is not original
        assert mt.initialize_megatron.__wrapped__ is original
    assert mt.initialize_megatron is init.initialize_megatron is training.initialize_megatron is original
