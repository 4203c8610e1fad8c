"""`SDPAttention` against megatron-core's own core attention, in a real GPTModel on a gloo rank.

The two compute the same function with different kernels, so losses and gradients agree to
rounding (not bit for bit); what SDPA saves for backward holds no s x s tensor. With SDPA,
`attach` under megatron's interleaved schedule (PP=2, VPP=2) trains bit-identically to the run
without offload (as the example does, tests/examples, whose default SDPA is).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests._spawn import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed",
)

_SHAPES = {
    "mha": {},
    "gqa_rope": {"num_query_groups": 2, "position_embedding_type": "rope"},
    "mqa": {"num_query_groups": 1},
}


def _train_step(rank: int, world: int, kwargs: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from chunk_offload.devkit import cpu_compat
    from chunk_offload.devkit.gpt import GPTShape, build_gpt_chunks, random_token_batches

    out = {}
    with cpu_compat.megatron_on_cpu():
        for attention in ("local", "sdpa"):
            parallel_state.initialize_model_parallel()
            torch.manual_seed(7)
            model_parallel_cuda_manual_seed(7)
            shape = GPTShape(attention=attention, **kwargs)
            model = build_gpt_chunks(shape)[0]
            batch = random_token_batches(shape, num_microbatches=1, seed=7, iteration=0)[0]
            sizes: list[tuple[int, ...]] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                sizes.append(tuple(t.shape))
                return t

            attention_module = model.decoder.layers[0].self_attention.core_attention
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            attention_module.register_forward_pre_hook(lambda m, a: hooks.__enter__())
            attention_module.register_forward_hook(lambda m, a, o: hooks.__exit__(None, None, None))
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().mean()
            loss.backward()
            out[attention] = {
                "kind": type(attention_module).__name__,
                "loss": loss.detach(),
                "grads": {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None},
                "saved": sizes,
            }
            parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("name", list(_SHAPES))
def test_sdpa_matches_megatron_attention_and_saves_no_square(name):
    result = run_ranks(_train_step, (_SHAPES[name],), world_size=1, timeout_s=240, what="sdpa vs local")[0]
    local, sdpa = result["local"], result["sdpa"]
    assert (local["kind"], sdpa["kind"]) == ("DotProductAttention", "SDPAttention")
    tol = 1e-5
    torch.testing.assert_close(sdpa["loss"], local["loss"], rtol=tol, atol=tol)
    assert sdpa["grads"].keys() == local["grads"].keys()
    for key in local["grads"]:
        torch.testing.assert_close(sdpa["grads"][key], local["grads"][key], rtol=tol * 10, atol=tol)
    s = 32  # GPTShape's default seq_length
    assert any(size[-2:] == (s, s) for size in local["saved"])  # the local softmax
    assert not any(size[-2:] == (s, s) for size in sdpa["saved"])
    assert len(sdpa["saved"]) == 5  # query, key, value, output, log-sum-exp


def test_unknown_attention_is_refused():
    from chunk_offload.core.errors import ChunkOffloadError
    from chunk_offload.devkit.gpt import GPTShape

    with pytest.raises(ChunkOffloadError, match=r"attention must be one of \['sdpa', 'local'\], got 'flash'"):
        GPTShape(attention="flash")


def _sdpa(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from chunk_offload.devkit.attention import use_sdpa

    assert use_sdpa(chunks) == 2 * len(chunks)  # two layers per chunk
    return chunks


def test_attach_with_sdpa_is_bit_identical():
    from tests._megatron import Hooks, Run, TinyGPTConfig, spawn_runs
    from tests.planner._stage_hooks import RecordHooks

    cfg = TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2, num_layers=8, num_microbatches=4, iterations=2)
    offload = RecordHooks(("qkv_linear", "core_attn", "attn_proj"), options={"min_offload_bytes": 1}, attention="sdpa")
    hooks = Hooks(wrap_model=offload.wrap_model, wrap_forward_backward=offload.wrap_forward_backward, after_step=offload.after_step)
    baseline, offloaded = spawn_runs([Run(config=cfg, hooks=Hooks(wrap_model=_sdpa)), Run(config=cfg, hooks=hooks)], world_size=2, timeout_s=240)
    for a, b in zip(baseline, offloaded, strict=True):
        assert all(torch.equal(x, y) for la, lb in zip(a.losses, b.losses, strict=True) for x, y in zip(la, lb, strict=True))
        assert a.params.keys() == b.params.keys() and a.grads.keys() == b.grads.keys()
        assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
        assert all(torch.equal(a.grads[k], b.grads[k]) for k in a.grads)
    # Something was offloaded: stage 0 keeps no chunk under the interleaved plan.
    assert any(step["bytes_offloaded"] > 0 for r in offloaded if r.rank == 0 for step in r.steps)
