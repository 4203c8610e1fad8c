"""`build_gpt_chunks` in bf16 and fp16: chunks cast whole, as Megatron-LM's ``Float16Module`` casts them.

In a half dtype every parameter and floating-point buffer of every chunk has that dtype (also
the norms, the learned position embedding and the MoE router's weight, which megatron builds in
fp32), the config says ``bf16`` / ``fp16`` as Megatron-LM's arguments set it, and wrapping a
built chunk in megatron's own ``Float16Module`` changes nothing: no parameter, not the loss
(fp32) and no gradient, bit for bit. See NOTE [ Half-precision chunks ] in
``chunk_offload/devkit/gpt.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.devkit.gpt import GPTShape

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed",
)

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_MODELS = {
    "dense": dict(attention="sdpa"),
    "moe_local_rmsnorm": dict(attention="local", num_experts=2, add_bias_linear=False, normalization="RMSNorm"),
}


def _loss_and_grads(model: torch.nn.Module, chunk: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    """One forward and backward of ``model`` (the chunk or a wrapper of it); the chunk's gradients."""
    chunk.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in chunk.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model", sorted(_MODELS))
@pytest.mark.parametrize("name", sorted(_HALF))
def test_half_chunks_are_cast_like_float16_module(name: str, model: str) -> None:
    from megatron.core.transformer.module import Float16Module

    from chunk_offload.replay import megatron_stage

    dtype = _HALF[name]
    shape = GPTShape(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, micro_batch_size=2, dtype=dtype,
        **_MODELS[model],
    )  # fmt: skip
    with megatron_stage(shape, pp_size=1, pp_rank=0) as stage:
        (chunk,) = stage.chunks
        assert (chunk.config.bf16, chunk.config.fp16) == (name == "bf16", name == "fp16")
        params = dict(chunk.named_parameters())
        assert {n for n, p in params.items() if p.dtype != dtype} == set()
        assert {n for n, b in chunk.named_buffers() if b.is_floating_point() and b.dtype != dtype} == set()
        # What megatron builds in fp32 whatever params_dtype says, cast too.
        born_fp32 = {"embedding.position_embeddings.weight", "decoder.final_layernorm.weight"}
        if "num_experts" in _MODELS[model]:
            born_fp32.add("decoder.layers.0.mlp.router.weight")
        assert born_fp32 <= params.keys()

        batch = stage.token_batches(1, iteration=0)[0]
        loss, grads = _loss_and_grads(chunk, chunk, batch)
        wrapped = Float16Module(chunk.config, chunk)
        assert {n: (p is params[n]) for n, p in wrapped.module.named_parameters()} == {n: True for n in params}
        assert {p.dtype for p in wrapped.parameters()} == {dtype}
        wrapped_loss, wrapped_grads = _loss_and_grads(wrapped, chunk, batch)

    assert loss.dtype == wrapped_loss.dtype == torch.float32  # megatron's cross entropy upcasts the logits
    assert torch.equal(loss, wrapped_loss) and torch.isfinite(loss)
    assert grads.keys() == wrapped_grads.keys() == params.keys()
    assert {g.dtype for g in grads.values()} == {dtype}
    assert [n for n in grads if not torch.equal(grads[n], wrapped_grads[n])] == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, "bf16"])
def test_shape_refuses_other_dtypes(dtype) -> None:
    accepted = r"\[torch\.float32, torch\.bfloat16, torch\.float16\]"
    with pytest.raises(ChunkOffloadError, match=rf"^chunk_offload: dtype must be one of {accepted}, got {dtype!r}$"):
        GPTShape(dtype=dtype)
