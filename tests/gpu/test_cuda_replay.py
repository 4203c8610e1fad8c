"""R measured with `torch.cuda.max_memory_allocated` on single-stage megatron-core runs.

The stage replay (`chunk_offload.replay`) runs a megatron-core GPT stage on the GPU with and
without offload, alternating iterations in one process, and compares the drop of the device
peak with the drop `chunk_offload.schedule.simulate` predicts from the bytes of the groups:
R = measured / theoretical must be within 1% of 1. Two single-stage runs: the whole model at
PP=1 (megatron's no-pipelining order F0 B0 F1 B1 ...; every chunk offloaded, since a plan
would keep every chunk of it on device), and stage 0 of PP=4 under the plan's policy. The
vocabulary is small so that the logits do not dwarf the saved activations, and the core
attention is torch's SDPA where `GPTShape` offers it; losses and gradients must also be
bit-identical between the two modes. The model is bf16, cast whole as Megatron-LM's
``Float16Module`` casts it (`build_gpt_chunks`); SDPA then runs flash attention, whose backward
is deterministic only under ``torch.use_deterministic_algorithms(True)`` without ``warn_only``
(the ``strictly_deterministic`` fixture), which the bit-identity of the gradients needs.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine: bash bench/gpu_evidence.sh)"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
        reason="megatron-core is not installed (on the GPU machine: carry it as a wheel in .whl/, see bench/gpu_evidence.sh)",
    ),
]

MODULES = "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,mlp_fc1"
TOLERANCE = 0.01


@pytest.mark.parametrize(
    ("pp", "policy", "layers"),
    [(1, None, 8), (4, "plan", 16)],
    ids=["pp1_every_chunk", "pp4_stage0_plan"],
)
def test_measured_drop_matches_theory(pp: int, policy, layers: int, strictly_deterministic) -> None:
    from chunk_offload.devkit.gpt import GPTShape
    from chunk_offload.replay import megatron_stage, replay

    # Flash-style attention where the builder offers it: its backward needs no s x s temporaries,
    # which would sit on the device at a different moment of the two modes' peaks.
    flash = {"attention": "sdpa"} if "attention" in getattr(GPTShape, "__dataclass_fields__", {}) else {}
    shape = GPTShape(
        num_layers=layers, hidden_size=1024, num_attention_heads=8, vocab_size=1024, seq_length=2048,
        micro_batch_size=1, dtype=torch.bfloat16, **flash,
    )  # fmt: skip
    with megatron_stage(shape, pp_size=pp, pp_rank=0) as stage:
        result = replay(
            stage, modules=MODULES, num_microbatches=2 * pp, schedule_policy=policy, iterations=2, warmup=1, keep_tensors=True
        )
    print(result.format())
    base, off = result.baseline, result.offload
    assert base.last.device_peak_bytes is not None, "peaks are not device memory: did the replay run on CUDA?"
    assert off.bytes_offloaded > 0 and result.theoretical_drop > 0, result.summary()
    assert {p.dtype for c in stage.chunks for p in c.parameters()} == {torch.bfloat16}
    assert abs(result.ratio - 1.0) <= TOLERANCE, f"R = {result.ratio:.4f} is not within {TOLERANCE:.0%} of 1: {result.summary()}"
    assert all(torch.equal(x, y) for x, y in zip(base.losses, off.losses, strict=True))
    differing = [name for name in base.grads if not torch.equal(base.grads[name], off.grads[name])]
    assert base.grads and not differing, differing[:5]
