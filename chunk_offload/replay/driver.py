"""Run a stage's chunk forwards and backwards as megatron-core's schedules do, one action at a time.

Shared by every mode of the replay (without offload, with chunk-offload, with megatron-core's
built-in offload), so that all of them feed the very same inputs to the very same calls:

- forward: the first chunk of the first stage reads tokens; any other chunk gets a synthetic
  received activation (`MegatronStage.received_activation`) through ``set_input_tensor``. The
  last chunk of the last stage computes the mean token loss divided by the number of
  microbatches. Other outputs are "sent" and then freed as megatron frees them
  (``deallocate_output_tensor``), which keeps only their autograd graph.
- backward: from a synthetic received gradient (the loss on the last chunk), through megatron's
  ``custom_backward``; the gradient of the received activation is then "sent" (dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .stage import MegatronStage

__all__ = ["ChunkDriver", "Kept"]


@dataclass(kw_only=True)
class Kept:
    """What one iteration leaves for comparisons: losses always, the rest with ``keep_tensors``."""

    losses: list[torch.Tensor] = field(default_factory=list, repr=False)
    """Loss of each microbatch (last stage only; else empty)."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    """Parameter gradients after the iteration, ``"chunk{vp}.{name}"``."""
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    """Gradient of each received activation, by (microbatch, vp_stage)."""
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    """Each chunk's output before it was freed, by (microbatch, vp_stage)."""


class ChunkDriver:
    """Calls one stage's chunks for the actions of a plan with ``num_microbatches`` microbatches."""

    def __init__(self, stage: MegatronStage, num_microbatches: int, *, keep_tensors: bool) -> None:
        from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor

        self.stage = stage
        self.num_microbatches = num_microbatches
        self.keep = keep_tensors
        self._custom_backward = custom_backward
        self._deallocate = deallocate_output_tensor
        needs_tokens = any(stage.is_first(vp) or stage.is_last(vp) for vp in range(stage.vp_size))
        self._batches = stage.token_batches(num_microbatches, iteration=0) if needs_tokens else None

    def zero_grads(self) -> None:
        """Zero ``param.grad`` in place, as megatron's persistent gradient buffers are before an iteration."""
        for chunk in self.stage.chunks:
            chunk.zero_grad(set_to_none=False)

    def keep_grads(self, kept: Kept) -> None:
        """With ``keep_tensors``: copy the parameter gradients into ``kept``."""
        if self.keep:
            kept.grads = {
                f"chunk{vp}.{name}": p.grad.detach().cpu().clone()
                for vp, chunk in enumerate(self.stage.chunks)
                for name, p in chunk.named_parameters()
                if p.grad is not None
            }

    def forward(self, microbatch: int, vp_stage: int, kept: Kept) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's forward; returns what its backward needs (output or loss, received activation)."""
        stage = self.stage
        chunk = stage.chunks[vp_stage]
        first, last = stage.is_first(vp_stage), stage.is_last(vp_stage)
        batch = self._batches[microbatch] if self._batches is not None else None
        received = None
        if not first:
            received = stage.received_activation(iteration=0, microbatch=microbatch, vp_stage=vp_stage)
        chunk.set_input_tensor(received)
        output = chunk(
            batch["tokens"] if first else None,
            batch["position_ids"] if first else None,
            None,  # megatron's default causal mask
            labels=batch["labels"] if last else None,
        )
        if last:
            output = output.float().mean() / self.num_microbatches  # megatron divides the loss by the microbatches
            kept.losses.append(output.detach().clone())
        else:
            if self.keep:
                kept.outputs[(microbatch, vp_stage)] = output.detach().cpu().clone()
            # Sent to the next stage: only the graph is kept (megatron's deallocate_pipeline_outputs).
            self._deallocate(output, chunk.config.deallocate_pipeline_outputs)
        return output, received

    def backward(
        self, microbatch: int, vp_stage: int, output: torch.Tensor, received: torch.Tensor | None, kept: Kept
    ) -> None:
        """The chunk's backward from the synthetic received gradient (or from the loss)."""
        last = self.stage.is_last(vp_stage)
        grad = None if last else self.stage.received_grad(iteration=0, microbatch=microbatch, vp_stage=vp_stage)
        if self.stage.chunks[vp_stage].config.deallocate_pipeline_outputs:
            self._custom_backward(output, grad)
        else:
            torch.autograd.backward(output, grad_tensors=grad)
        if received is not None and self.keep:
            kept.input_grads[(microbatch, vp_stage)] = received.grad.detach().cpu().clone()
