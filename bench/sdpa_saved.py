"""What torch's scaled_dot_product_attention saves for backward, per backend, with megatron's layout.

For each backend (torch's default choice, flash, memory-efficient, cuDNN) and each case (multi-head
and grouped-query attention, bf16, and fp32 for the memory-efficient kernel), query, key and value
are made as megatron-core's SelfAttention makes them: split views of linear_qkv's output
``[s, b, ng, (np/ng + 2) * hn]`` (the query a reshaped copy under grouped-query attention),
permuted to ``[b, n, s, hn]`` as `chunk_offload.devkit.attention.SDPAttention` passes them. A
``saved_tensors_hooks`` pair records every saved tensor: shape, dtype, device, bytes, and whether
it views linear_qkv's output. The planner's model of core_attn under SDPA
(``chunk_offload/planner/attention.py``) is compared with these records.

    python bench/sdpa_saved.py --json out/sdpa_saved.json     # on a CUDA machine (CPU: the CPU kernel)
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["main", "saved_by_sdpa"]


def saved_by_sdpa(*, s: int, b: int, heads: int, groups: int, hn: int, dtype: torch.dtype, backend: str | None) -> dict:
    """Run one SDPA forward (causal) and list what autograd saved."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    per = heads // groups
    mixed = torch.randn(s, b, groups, (per + 2) * hn, device=device, dtype=dtype, requires_grad=True)
    query, key, value = torch.split(mixed, [per * hn, hn, hn], dim=3)
    query = query.reshape(s, b, heads, hn)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    saved: list[dict] = []
    base = mixed.untyped_storage().data_ptr()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(
            {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "device": t.device.type,
                "nbytes": t.numel() * t.element_size(),
                "views_linear_qkv_output": t.untyped_storage().data_ptr() == base,
                "storage_offset_bytes": t.storage_offset() * t.element_size(),
                # One past the view's last element: what the engine copies ends here.
                "view_end_bytes": (t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size(),
                "storage_bytes": t.untyped_storage().nbytes(),
            }
        )
        return t

    kernel = contextlib.nullcontext()
    if backend is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = sdpa_kernel(getattr(SDPBackend, backend))
    try:
        with kernel, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != heads)
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0]}
    out.float().sum().backward()
    return {"grad_fn": type(out.grad_fn).__name__, "saved": saved}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    cases = [("mha_bf16", args.heads, torch.bfloat16), ("gqa_bf16", max(1, args.heads // 4), torch.bfloat16), ("mha_fp32", args.heads, torch.float32)]
    backends = [None] + (["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"] if torch.cuda.is_available() else [])
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    results["shape"] = {"s": args.seq, "b": args.batch, "np": args.heads, "hn": args.head_dim}
    for name, groups, dtype in cases:
        for backend in backends:
            key = f"{name}/{backend or 'default'}"
            results[key] = saved_by_sdpa(s=args.seq, b=args.batch, heads=args.heads, groups=groups, hn=args.head_dim, dtype=dtype, backend=backend)
            print(key, json.dumps(results[key]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
