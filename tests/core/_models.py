"""A tiny transformer stack and pipeline-like drivers shared by the core tests.

`run_schedule` trains a model for a few iterations with microbatch forwards and backwards
interleaved in a given order (1F1B, interleaved VPP), with or without an `OffloadManager`,
and returns every loss and every parameter gradient, so tests compare them with
`torch.equal`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import chunk_offload

HIDDEN = 32
HEADS = 4
SEQ = 8
BATCH = 2

# Module kinds of a Megatron-like layer that the tests offload, by group name.
MODULE_KINDS = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")

ONE_F_ONE_B = ("F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3")
# Interleaved VPP with 2 model chunks and 4 microbatches, as stage 0 of PP=2 runs it:
# (kind, microbatch, vp_stage).
INTERLEAVED = (
    ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1), ("F", 3, 0),
    ("B", 1, 1), ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0), ("B", 2, 1), ("B", 3, 1),
    ("B", 2, 0), ("B", 3, 0),
)


class CoreAttention(nn.Module):
    """Softmax attention on q, k, v that are views of one qkv tensor (as in Megatron)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, h = q.shape
        d = h // self.heads

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(b, t, self.heads, d).transpose(1, 2)

        scores = split(q) @ split(k).transpose(-1, -2) / d**0.5
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return (probs @ split(v)).transpose(1, 2).reshape(b, t, h)


class Block(nn.Module):
    """Pre-norm attention + GELU MLP block with Megatron's submodule names as attributes."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.qkv_linear = nn.Linear(hidden, 3 * hidden)
        self.core_attn = CoreAttention(heads)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp_fc1 = nn.Linear(hidden, 4 * hidden)
        self.mlp_fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_linear(self.attn_norm(x)).chunk(3, dim=-1)
        x = x + self.attn_proj(self.core_attn(q, k, v))
        return x + self.mlp_fc2(F.gelu(self.mlp_fc1(self.mlp_norm(x))))


def no_saved_tensor_hooks() -> bool:
    """Whether no saved-tensor hooks are installed (a leak check after an iteration or an error)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def make_stack(layers: int = 2, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(layers)])


def register(manager: chunk_offload.OffloadManager, model: nn.Module, kinds: Sequence[str] = MODULE_KINDS) -> None:
    """Offload the submodules named in ``kinds`` of every block of ``model``."""
    for block in model.modules():
        if isinstance(block, Block):
            for kind in kinds:
                manager.offload_module(getattr(block, kind), kind)


def microbatches(count: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, SEQ, HIDDEN, generator=g) for _ in range(count)]


@dataclass
class RunResult:
    losses: list[torch.Tensor]
    grads: list[list[torch.Tensor]]  # per iteration, every parameter's gradient
    params: list[torch.Tensor]  # after the last optimizer step


def _actions(order: Sequence) -> list[tuple[str, int, int]]:
    return [(a[0], int(a[1:]), 0) if isinstance(a, str) else tuple(a) for a in order]


def run_schedule(
    manager_factory: Callable[[], chunk_offload.OffloadManager | None],
    *,
    order: Sequence = ONE_F_ONE_B,
    model_chunks: int = 1,
    iterations: int = 3,
    layers: int = 2,
    kinds: Sequence[str] = MODULE_KINDS,
    seed: int = 0,
    after_iteration: Callable[[chunk_offload.OffloadManager | None, int], None] | None = None,
) -> RunResult:
    """Train ``model_chunks`` stacks (virtual stages chained in order) with ``order`` per iteration.

    Microbatch m's loss is the mean square of the output of the last model chunk; for a
    chunk v < last, its backward is driven from the gradient of its output, recorded when the
    next chunk's backward ran (as a pipeline stage would receive it).
    """
    chunks = [make_stack(layers, seed + v) for v in range(model_chunks)]
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)
    manager = manager_factory()
    if manager is not None:
        for chunk in chunks:
            register(manager, chunk, kinds)
    actions = _actions(order)
    n_micro = 1 + max(m for _, m, _ in actions)
    xs = microbatches(n_micro)
    result = RunResult(losses=[], grads=[], params=[])
    for it in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        out_grads: dict[tuple[int, int], torch.Tensor] = {}
        scope = manager.iteration() if manager is not None else contextlib.nullcontext()
        with scope:
            for kind, m, v in actions:
                if kind == "F":
                    x = xs[m] if v == 0 else outputs[(m, v - 1)].detach().requires_grad_(True)
                    inputs[(m, v)] = x
                    chunk_scope = manager.chunk(microbatch=m, vp_stage=v) if manager is not None else contextlib.nullcontext()
                    with chunk_scope:
                        y = chunks[v](x)
                        if v == model_chunks - 1:
                            y = y.pow(2).mean()
                    outputs[(m, v)] = y
                else:
                    y = outputs.pop((m, v))
                    if v == model_chunks - 1:
                        result.losses.append(y.detach().clone())
                        y.backward()
                    else:
                        y.backward(out_grads.pop((m, v)))
                    x = inputs.pop((m, v))
                    if v > 0:
                        out_grads[(m, v - 1)] = x.grad
        result.grads.append([p.grad.detach().clone() for p in params])
        optimizer.step()
        if after_iteration is not None:
            after_iteration(manager, it)
    result.params = [p.detach().clone() for p in params]
    if manager is not None:
        manager.close()
    return result


def assert_identical(a: RunResult, b: RunResult) -> None:
    """Every loss, every gradient of every iteration and every final parameter bit-identical."""
    assert len(a.losses) == len(b.losses) and len(a.grads) == len(b.grads)
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(x, y), f"loss {i} differs: {x.item()!r} vs {y.item()!r}"
    for it, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        for j, (x, y) in enumerate(zip(ga, gb)):
            assert torch.equal(x, y), f"iteration {it}: gradient of parameter {j} differs"
    for j, (x, y) in enumerate(zip(a.params, b.params)):
        assert torch.equal(x, y), f"parameter {j} differs after training"
