"""The Megatron example, launched as users launch it (torchrun, gloo on CPU), with and without offload.

Both runs must print the same losses with full precision and save bit-identical parameters on
every rank; the offload run must print its per-stage summary with bytes for every module.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason='megatron-core is not installed (pip install "chunk-offload[megatron]")',
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
MODULES = "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,mlp_fc1"


def _launch(tmp_path: Path, name: str, world: int, extra: list[str]) -> tuple[str, Path]:
    state = tmp_path / name
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        str(EXAMPLE), "--iterations", "3", "--save-state", str(state), "--hang-timeout-s", "240", *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout, state


def _losses(stdout: str) -> list[str]:
    return re.findall(r"^iteration \d+ loss (\S+) \(rank \d+\)$", stdout, flags=re.M)


@pytest.mark.parametrize(
    "world, parallel",
    [
        (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]),
        (2, ["--expert-model-parallel-size", "2", "--num-experts", "4", "--num-layers", "2"]),
    ],
    ids=["pp2_vpp2", "ep2_moe"],
)
def test_example_with_and_without_offload_is_bit_identical(tmp_path, world, parallel):
    modules = MODULES if "--num-experts" not in parallel else "core_attn,qkv_linear,expert_fc1"
    base_out, base_state = _launch(tmp_path, "base", world, parallel)
    off_out, off_state = _launch(tmp_path, "offload", world, [*parallel, "--offload-modules", modules])

    base_losses, off_losses = _losses(base_out), _losses(off_out)
    assert len(base_losses) >= 3 and off_losses == base_losses
    for name in modules.split(","):
        bytes_moved = [int(b) for b in re.findall(rf"{name}:(\d+)", off_out)]
        assert len(bytes_moved) == world and all(b > 0 for b in bytes_moved), off_out
    for rank in range(world):
        base = torch.load(base_state / f"rank{rank}.pt")
        off = torch.load(off_state / f"rank{rank}.pt")
        assert base["losses"] == off["losses"]
        assert base["params"].keys() == off["params"].keys()
        differing = [k for k in base["params"] if not torch.equal(base["params"][k], off["params"][k])]
        assert not differing, f"rank {rank}: parameters differ: {differing[:5]}"
