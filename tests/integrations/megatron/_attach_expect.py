"""What each rank of a tiny GPT run holds, derived from its config alone: layers, offloaded
submodules per name, bytes saved per call, megatron's schedule (expectations of test_attach.py)."""

from __future__ import annotations

from chunk_offload.integrations.megatron import ALIASES
from chunk_offload.schedule import megatron_plan
from tests._megatron import TinyGPTConfig


def rank_layers(cfg: TinyGPTConfig, pp_rank: int) -> list[int]:
    """Global indices of the transformer layers on ``pp_rank`` (all its model chunks).

    Megatron's layer offset: chunk v of stage r holds layers from
    ``v * num_layers / vp + r * num_layers / (pp * vp)`` on.
    """
    vp = cfg.virtual_pipeline or 1
    per_chunk = cfg.num_layers // (cfg.pipeline_parallel * vp)
    return [
        v * (cfg.num_layers // vp) + pp_rank * per_chunk + i for v in range(vp) for i in range(per_chunk)
    ]


def is_moe(cfg: TinyGPTConfig, layer: int) -> bool:
    if cfg.num_experts is None:
        return False
    if isinstance(cfg.moe_layer_freq, tuple):
        return cfg.moe_layer_freq[layer] == 1
    return layer % cfg.moe_layer_freq == 0


def module_counts(cfg: TinyGPTConfig, pp_rank: int, modules: tuple[str, ...]) -> dict[str, int]:
    """Offloaded submodules per canonical name on ``pp_rank`` (names that match nothing are left out)."""
    layers = rank_layers(cfg, pp_rank)
    moe = sum(is_moe(cfg, i) for i in layers)
    local_experts = (cfg.num_experts or 0) // cfg.expert_parallel
    per_name = {
        "attn_norm": len(layers),
        "qkv_linear": len(layers),
        "core_attn": len(layers),
        "attn_proj": len(layers),
        "mlp_norm": len(layers),  # MoE layers of the local spec have a pre-MLP norm as well
        "mlp_fc1": len(layers) - moe,
        "expert_fc1": moe * local_experts,
    }
    names = {ALIASES.get(m, m) for m in modules}
    return {n: per_name[n] for n in names if per_name[n] > 0}


F32 = 4  # bytes per element: every activation here is fp32, the causal mask is bool (1 byte)


def bytes_per_call(cfg: TinyGPTConfig, name: str) -> int:
    """Bytes one call of submodule ``name`` saves for backward (non-parameter tensors only).

    With tensor parallel 1 and no sequence parallel, s = seq_length, b = micro_batch_size,
    h = hidden_size, np = heads; every saved storage starts at offset 0 (no alignment padding).

    - qkv_linear, attn_proj, mlp_fc1: megatron's linear autograd Function saves (input, weight);
      the weight is a parameter and stays, the input is [s, b, in_features] with
      in_features = h for all three (attn_proj's input is the [s, b, np * hn] context).
    - attn_norm, mlp_norm (torch.nn.LayerNorm, the local spec without Apex): native_layer_norm
      saves input [s, b, h], weight and bias (parameters), mean and rstd [s, b, 1].
    - core_attn (megatron's local DotProductAttention, no GQA, fp32, masked_softmax_fusion off):
      q, k, v are views of one storage, linear_qkv's output [s, b, 3h] (split along the last
      dim); baddbmm saves q and k, bmm saves v: the span from q's first element to v's last is
      the whole storage, s*b*3h. ``forward_torch_softmax`` builds the causal mask
      ``triu(ones(s, s)).bool()`` (the harness passes no mask) and ``masked_fill_`` saves it:
      s*s bytes. Softmax saves its output [b, np, s, s]; dropout with p=0 returns its input and
      saves nothing; bmm saves a view of the softmax output (same storage, counted once).
    """
    s, b, h, heads = cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    if name in ("qkv_linear", "attn_proj", "mlp_fc1"):
        return s * b * h * F32
    if name in ("attn_norm", "mlp_norm"):
        return s * b * h * F32 + 2 * s * b * 1 * F32
    if name == "core_attn":
        return s * b * 3 * h * F32 + s * s * 1 + b * heads * s * s * F32
    raise AssertionError(f"no shape formula for {name!r}")


def expected_order(cfg: TinyGPTConfig, pp_rank: int) -> list[tuple[str, int, int]]:
    """The (F|B, microbatch, vp_stage) actions megatron's schedule runs on ``pp_rank`` per iteration."""
    plan = megatron_plan(
        pp_size=cfg.pipeline_parallel, pp_rank=pp_rank, num_microbatches=cfg.num_microbatches, vp_size=cfg.virtual_pipeline
    )
    return [(a.kind.value, a.microbatch, a.vp_stage) for a in plan.actions]


def received_chunks(cfg: TinyGPTConfig, pp_rank: int) -> int:
    """Model chunks (virtual stages) of ``pp_rank`` whose input comes from another stage: all but
    the first stage's first chunk, which embeds its tokens."""
    vp = cfg.virtual_pipeline or 1
    return vp - 1 if pp_rank == 0 else vp


def held_elsewhere_per_chunk(cfg: TinyGPTConfig, pp_rank: int, name: str) -> int:
    """Bytes per model chunk of what ``name`` saves and another reference holds on the device
    (NOTE [Storages held elsewhere]): the first layer's attn_norm saves the chunk's received input,
    which the schedule holds until the chunk's backward ([s, b, h]). Nothing else here: core
    attention's output is not saved by the local DotProductAttention itself."""
    if name != "attn_norm":
        return 0
    return cfg.seq_length * cfg.micro_batch_size * cfg.hidden_size * F32
