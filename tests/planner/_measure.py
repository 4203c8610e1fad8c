"""Measure, in real megatron-core runs on CPU, the bytes each offload group saves.

One call of `measure` spawns one set of gloo processes per tensor-parallel size among the cases
(world size = that size, ``cpu_compat``) and, for every `ByteCase`, builds the model through
`chunk_offload.devkit.gpt.build_gpt_chunks` (the builder the harness and the
example use), attaches an offload manager to every module name the model has, and runs one
training step of one microbatch through megatron's own schedule
(``forward_backward_no_pipelining``). A forward pre-hook on each offloaded module records which
module opened each group, and the manager's record of the iteration
(``last_iteration.group_bytes``) gives each group's bytes, so the result is every group of the
step in forward order: (layer, module name, bytes), plus the per-name totals of ``stats()``.

A second run of the same case offloads each whole ``TransformerLayer`` as one group, which gives
the bytes of everything a layer saves for backward (storages deduplicated within the layer); a
Multi-Token Prediction layer (``mtp_num_layers``) is one group as a whole (its transformer layer
and what the MTP block saves), after the decoder's layers.
A third run counts each such layer's forward FLOPs with ``torch.utils.flop_counter.FlopCounterMode``.
Every tensor-parallel rank measures; the result is rank 0's, and `CaseBytes.same_on_every_rank`
says whether the other ranks measured the same.

megatron-core compiles its fused bias-SwiGLU with ``torch.compile``; the children disable
dynamo, so the function runs eagerly (compiling took about 15 s per process here). What it
saves does not change: ``SwiGLUFunction.forward`` saves its input in Python, outside the
compiled function.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from tests._megatron_train import megatron_step, reset_mtp_loss_tracker
from tests._spawn import run_ranks

__all__ = ["ByteCase", "CaseBytes", "measure", "measure_or_skip"]


@dataclass(kw_only=True, frozen=True)
class ByteCase:
    """A model shape (fields of ``GPTShape``) and the offload threshold of one measurement."""

    num_layers: int = 2
    hidden_size: int = 32
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    seq_length: int = 16
    micro_batch_size: int = 2
    num_experts: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_router_topk: int = 2
    add_bias_linear: bool = True
    dtype: torch.dtype = torch.float32
    normalization: str = "LayerNorm"
    swiglu: bool = False
    bias_activation_fusion: bool = False
    position_embedding_type: str = "learned_absolute"
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    attention: str = "local"
    recompute_modules: tuple[str, ...] = ()
    """megatron's selective recompute modules (empty: no recompute)."""
    mtp_num_layers: int | None = None
    """megatron's Multi-Token Prediction layers (None: none)."""
    min_offload_bytes: int = 1


@dataclass
class CaseBytes:
    """What one case saved, from the manager's statistics."""

    calls: list[tuple[int, str, int]] = field(default_factory=list)
    """Every group of the step in forward order: (global 0-based layer, module name, bytes), the
    bytes from the engine's record of the iteration (``last_iteration.group_bytes``)."""
    totals: dict[str, int] = field(default_factory=dict)
    """``stats().groups[name].bytes_offloaded`` after the step."""
    group_bytes: list[int] = field(default_factory=list)
    """The engine's own record of the chunk's group bytes (``manager.last_iteration.group_bytes``)."""
    layer_bytes: list[int] = field(default_factory=list)
    """Bytes offloaded by each whole layer taken as one group (second run), per layer."""
    layer_flops: list[int] = field(default_factory=list)
    """Forward FLOPs of each layer as torch's ``FlopCounterMode`` counts them (third run)."""
    same_on_every_rank: bool = True
    """Whether every tensor-parallel rank measured the same calls, totals, layer bytes and FLOPs."""

    def _key(self) -> tuple:
        return (self.calls, self.totals, self.group_bytes, self.layer_bytes, self.layer_flops)


def measure(cases: list[ByteCase], *, timeout_s: float = 300.0) -> list[CaseBytes]:
    """Run the cases, one spawn per tensor-parallel size; results in the order of ``cases``."""
    results: dict[int, CaseBytes] = {}
    for tp in sorted({c.tensor_parallel for c in cases}):
        picked = [i for i, c in enumerate(cases) if c.tensor_parallel == tp]
        per_rank = run_ranks(
            _measure_cases, ([cases[i] for i in picked],), world_size=tp, timeout_s=timeout_s, what="byte measurement"
        )
        for j, i in enumerate(picked):
            first = per_rank[0][j]
            first.same_on_every_rank = all(r[j]._key() == first._key() for r in per_rank)
            results[i] = first
    return [results[i] for i in range(len(cases))]


def measure_or_skip(cases: dict[str, ByteCase]) -> dict[str, CaseBytes]:
    """`measure` of ``{name: case}`` by name, for a module-scoped fixture: skips the test without
    megatron-core or on a CUDA host (``cpu_compat`` is inert there)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host")
    return dict(zip(cases, measure(list(cases.values())), strict=True))


def _measure_cases(rank: int, world_size: int, cases: list[ByteCase]) -> list[CaseBytes]:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    import torch._dynamo.config

    torch._dynamo.config.disable = True  # see the module docstring
    from chunk_offload.devkit import cpu_compat

    with cpu_compat.megatron_on_cpu():
        return [_measure_case(case) for case in cases]


def _shape(case: ByteCase):
    from chunk_offload.devkit.gpt import GPTShape

    return GPTShape(
        num_layers=case.num_layers,
        hidden_size=case.hidden_size,
        ffn_hidden_size=case.ffn_hidden_size,
        num_attention_heads=case.num_attention_heads,
        num_query_groups=case.num_query_groups,
        vocab_size=64,
        seq_length=case.seq_length,
        micro_batch_size=case.micro_batch_size,
        num_experts=case.num_experts,
        moe_layer_freq=case.moe_layer_freq,
        moe_router_topk=case.moe_router_topk,
        add_bias_linear=case.add_bias_linear,
        dtype=case.dtype,
        normalization=case.normalization,
        swiglu=case.swiglu,
        bias_activation_fusion=case.bias_activation_fusion,
        position_embedding_type=case.position_embedding_type,
        attention=case.attention,
        mtp_num_layers=case.mtp_num_layers,
        **({"recompute_granularity": "selective", "recompute_modules": case.recompute_modules} if case.recompute_modules else {}),
    )


def _build(case: ByteCase):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from chunk_offload.devkit.gpt import build_gpt_chunks

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=case.tensor_parallel)
    reset_mtp_loss_tracker()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    chunks = build_gpt_chunks(_shape(case), tensor_parallel=case.tensor_parallel, sequence_parallel=case.sequence_parallel)
    if case.dtype in (torch.bfloat16, torch.float16):
        # What Megatron-LM's training does for bf16/fp16: Float16Module casts the parameters
        # (norms included) and the float inputs of the first stage.
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    return chunks


def _step(case: ByteCase, chunks, forward_backward) -> None:
    """One training step of one microbatch through Megatron's schedule (no pipelining: one chunk)."""
    megatron_step(forward_backward, chunks, _shape(case), num_microbatches=1, seed=1234, iteration=0)


def _measure_case(case: ByteCase) -> CaseBytes:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from chunk_offload.core import OffloadConfig, OffloadManager
    from chunk_offload.integrations.megatron import OFFLOAD_MODULE_NAMES, attach
    from chunk_offload.integrations.megatron.modules import resolve, transformer_layers
    from chunk_offload.module_names import MOE_MODULES

    result = CaseBytes()
    # Run 1: every module name the model has, one group per call (no joined calls: each module measured alone).
    chunks = _build(case)
    try:
        names = [n for n in OFFLOAD_MODULE_NAMES if resolve(chunks[0], n)]
        if "moe" in case.recompute_modules:  # megatron's rule (module_names.combination_problem): not both
            names = [n for n in names if n not in MOE_MODULES]
        # schedule_policy=None: offload every chunk (the plan policy keeps a chunk whose backward
        # follows at once, as here with one microbatch).
        manager = attach(chunks, names, config=OffloadConfig(min_offload_bytes=case.min_offload_bytes, group_by="call"), schedule_policy=None)
        layer_now = [-1]
        called: list[tuple[int, str]] = []

        index = {id(layer): i for i, layer in enumerate(transformer_layers(chunks[0]))}  # one stage: the global index

        def enter_layer(module, args, kwargs):
            layer_now[0] = index[id(module)]

        def record(name):
            def hook(module, args):
                # In a chunk's forward only: a recomputed module runs again in backward, outside any chunk.
                if torch.is_grad_enabled() and manager.engine.current_handler is not None:
                    called.append((layer_now[0], name))

            return hook

        for layer in transformer_layers(chunks[0]):
            layer.register_forward_pre_hook(enter_layer, with_kwargs=True)
        for name in names:
            for module in resolve(chunks[0], name):
                module.register_forward_pre_hook(record(name))
        _step(case, chunks, manager.wrap(get_forward_backward_func()))
        result.totals = {n: g.bytes_offloaded for n, g in manager.stats().groups.items()}
        # The engine's own bytes per group, in the order the groups were opened (= `called`).
        result.group_bytes = list(manager.last_iteration.group_bytes[(0, 0)])
        result.calls = [(layer, name, nbytes) for (layer, name), nbytes in zip(called, result.group_bytes, strict=True)]
        manager.close()
    finally:
        parallel_state.destroy_model_parallel()

    # Run 2: each whole layer as one group.
    chunks = _build(case)
    try:
        manager = OffloadManager(OffloadConfig(min_offload_bytes=case.min_offload_bytes))
        manager.protect_module(chunks[0])
        layers = _whole_layers(chunks[0])
        for i, layer in enumerate(layers):
            manager.offload_module(layer, f"layer{i}")
        forward_backward = get_forward_backward_func()
        chunk_scope = _ChunkScope(manager)
        chunks[0].register_forward_pre_hook(chunk_scope.enter)
        chunks[0].register_forward_hook(chunk_scope.exit, always_call=True)

        def wrapped(**kwargs):
            with manager.iteration():
                return forward_backward(**kwargs)

        _step(case, chunks, wrapped)
        stats = manager.stats()
        result.layer_bytes = [stats.groups[f"layer{i}"].bytes_offloaded for i in range(len(layers))]
        manager.close()
    finally:
        parallel_state.destroy_model_parallel()

    # Run 3: matmul FLOPs of each layer's forward.
    chunks = _build(case)
    try:
        from torch.utils.flop_counter import FlopCounterMode

        counters = []

        def count_start(module, args, kwargs):
            counter = FlopCounterMode(display=False)
            counter.__enter__()
            counters.append(counter)

        def count_end(module, args, output):
            counters[-1].__exit__(None, None, None)

        for layer in _whole_layers(chunks[0]):
            layer.register_forward_pre_hook(count_start, with_kwargs=True)
            layer.register_forward_hook(count_end)
        _step(case, chunks, get_forward_backward_func())
        result.layer_flops = [c.get_total_flops() for c in counters]
    finally:
        parallel_state.destroy_model_parallel()
    return result


def _whole_layers(chunk) -> list:
    """The decoder's layers, then each MTP layer as a whole (its one transformer layer inside it)."""
    from chunk_offload.integrations.megatron.modules import mtp_layers, transformer_layers

    layers, mtp = transformer_layers(chunk), mtp_layers(chunk)
    return layers[: len(layers) - len(mtp)] + mtp


class _ChunkScope:
    """Opens the manager's chunk for the duration of the model chunk's forward."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.scopes = []
        self.forwards = 0

    def enter(self, module, args):
        if torch.is_grad_enabled():
            scope = self.manager.chunk(microbatch=self.forwards)
            self.forwards += 1
            scope.__enter__()
            self.scopes.append(scope)

    def exit(self, module, args, output):
        if self.scopes:
            self.scopes.pop().__exit__(None, None, None)
