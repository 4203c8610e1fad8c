"""`TinyGPTConfig`: shape, parallelism, training length and Megatron training options of one tiny GPT
run of the harness (``tests._megatron``), checked for consistency when built.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True, slots=True)
class TinyGPTConfig:
    """Shape, parallelism and training length of one tiny GPT run."""

    tensor_parallel: int = 1
    """``tensor_model_parallel_size`` (not covered by the tests in this directory)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs ``tensor_parallel > 1``; not covered by the tests in
    this directory: their gradient averaging does not sum sequence-parallel norm gradients over
    the tensor-parallel ranks)."""
    pipeline_parallel: int = 1
    """Pipeline stages (``pipeline_model_parallel_size``)."""
    virtual_pipeline: int | None = None
    """Model chunks per rank for the interleaved schedule; None for plain 1F1B."""
    expert_parallel: int = 1
    """``expert_model_parallel_size``; needs ``num_experts``."""
    num_experts: int | None = None
    """MoE experts per MoE layer (which layers are MoE: ``moe_layer_freq``); None for a dense MLP."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Megatron's ``moe_layer_freq`` when ``num_experts`` is set: ``N`` makes every N-th layer MoE
    (from the first), a tuple of 0/1 per layer (1: MoE) sets the pattern; 1: every layer is MoE."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_token_dispatcher: str = "allgather"
    """Megatron's ``moe_token_dispatcher_type``: ``"allgather"`` or ``"alltoall"``."""
    add_bias_linear: bool = True
    """Megatron's ``add_bias_linear``. MoE with ``expert_parallel=1`` and ``tensor_parallel=1`` needs
    False: with a bias, megatron-core 0.16.1's local expert MLP adds the fc2 bias in place to the
    output of ``reduce_from_tensor_model_parallel_region``, which at TP=1 returns its input as-is
    (a view made by a custom Function), and autograd refuses that in-place update."""
    num_layers: int = 4
    """Transformer layers in the whole model (split across stages and chunks)."""
    hidden_size: int = 32
    """Hidden size; FFN is 4x."""
    num_attention_heads: int = 4
    """Attention heads."""
    vocab_size: int = 64
    """Vocabulary size (tokens are drawn uniformly from it)."""
    seq_length: int = 16
    """Tokens per sequence."""
    micro_batch_size: int = 2
    """Sequences per microbatch."""
    num_microbatches: int = 4
    """Microbatches per iteration (a multiple of ``pipeline_parallel`` for VPP)."""
    iterations: int = 2
    """Optimizer steps."""
    seed: int = 1234
    """Seeds the model init (megatron RNG tracker) and the data."""
    optimizer: str = "adam"
    """``"adam"`` or ``"sgd"``."""
    lr: float = 1e-2
    """Learning rate."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Megatron's interleaved-schedule option: microbatches per virtual stage before switching (None: PP size)."""
    deallocate_pipeline_outputs: bool = True
    """Megatron's option (Megatron-LM turns it on for training): a stage frees the data of each
    output it sent downstream and runs backward through ``custom_backward``."""
    recompute_granularity: str | None = None
    """Megatron's activation recomputation: ``"selective"`` (core attention by default) or
    ``"full"`` (whole layers, see ``recompute_method``); None for none."""
    recompute_modules: tuple[str, ...] | None = None
    """With ``recompute_granularity="selective"``: megatron's ``recompute_modules`` (None: core_attn)."""
    recompute_method: str | None = None
    """With ``recompute_granularity="full"``: ``"uniform"`` (every layer, in groups of
    ``recompute_num_layers``) or ``"block"`` (the first ``recompute_num_layers`` layers of each chunk)."""
    recompute_num_layers: int | None = None
    """With ``recompute_granularity="full"``: see ``recompute_method``."""
    mtp_num_layers: int | None = None
    """Megatron's Multi-Token Prediction layers (``GPTShape.mtp_num_layers``), on the last stage; None for none."""
    megatron_ddp: bool = False
    """Train as Megatron-LM's ``train_step`` does: each chunk wrapped in megatron-core's
    ``DistributedDataParallel`` (contiguous gradient buffers, ``param.main_grad``, gradient
    accumulation hooks; inside ``Float16Module`` with ``bf16``), stepped by
    ``get_megatron_optimizer``, with ``finalize_model_grads_func`` and ``grad_scale_func`` (and
    under ``overlap_grad_reduce`` ``no_sync_func`` / ``grad_sync_func``) set on the model config
    as Megatron-LM's ``train`` sets them; ``RankResult.grads`` are then the ``main_grad`` buffers
    after ``finalize_model_grads``. False: a plain torch optimizer and `average_data_parallel_grads`."""
    overlap_grad_reduce: bool = False
    """With ``megatron_ddp``: ``DistributedDataParallelConfig.overlap_grad_reduce`` (bucketed
    asynchronous reduction started by the gradient hooks and the schedule's ``grad_sync_func``)."""
    use_distributed_optimizer: bool = False
    """With ``megatron_ddp``: megatron's distributed optimizer (gradients reduce-scattered, each
    data-parallel rank steps its shard of the fp32 main parameters, parameters all-gathered)."""
    grad_reduce_in_fp32: bool = False
    """With ``megatron_ddp``: ``DistributedDataParallelConfig.grad_reduce_in_fp32`` (fp32 ``main_grad``
    buffers for bf16 parameters)."""
    bucket_size: int | None = None
    """With ``megatron_ddp``: ``DistributedDataParallelConfig.bucket_size`` in elements (None:
    megatron's default; only used with ``overlap_grad_reduce``, on the first pipeline stage's first chunk)."""
    bf16: bool = False
    """With ``megatron_ddp``: bf16 parameters and activations (``Float16Module``, megatron's mixed
    precision optimizer with fp32 main parameters)."""

    def __post_init__(self) -> None:
        pp, vp = self.pipeline_parallel, self.virtual_pipeline
        if self.sequence_parallel and self.tensor_parallel < 2:
            raise ValueError(f"sequence_parallel needs tensor_parallel >= 2, got {self.tensor_parallel}")
        if vp is not None:
            if pp < 2:
                raise ValueError(f"virtual_pipeline={vp} needs pipeline_parallel >= 2, got {pp}")
            if self.num_microbatches % pp:
                raise ValueError(
                    f"num_microbatches={self.num_microbatches} must be a multiple of pipeline_parallel={pp} "
                    "for the interleaved schedule"
                )
        if self.num_layers % (pp * (vp or 1)):
            raise ValueError(
                f"num_layers={self.num_layers} must split evenly over {pp} stages x {vp or 1} chunks"
            )
        if self.expert_parallel > 1 and (self.num_experts is None or self.num_experts % self.expert_parallel):
            raise ValueError(
                f"expert_parallel={self.expert_parallel} needs num_experts divisible by it, got {self.num_experts}"
            )
        if isinstance(self.moe_layer_freq, tuple) and (
            len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}
        ):
            raise ValueError(
                f"moe_layer_freq={self.moe_layer_freq} must hold one 0 or 1 per layer ({self.num_layers})"
            )
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ValueError(f"recompute_granularity must be None, 'selective' or 'full', got {self.recompute_granularity!r}")
        if (self.recompute_granularity == "full") != (self.recompute_method is not None and self.recompute_num_layers is not None):
            raise ValueError("recompute_granularity='full' needs recompute_method and recompute_num_layers, and only it takes them")
        ddp_options = {
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "grad_reduce_in_fp32": self.grad_reduce_in_fp32,
            "bucket_size": self.bucket_size is not None,
            "bf16": self.bf16,
        }
        if not self.megatron_ddp and any(ddp_options.values()):
            raise ValueError(f"{[k for k, v in ddp_options.items() if v]} need megatron_ddp=True")
