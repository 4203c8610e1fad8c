"""Development infrastructure: run megatron-core where there is no GPU, and build small GPT models.

Not part of the offload engine. Seven modules, each imported explicitly (importing megatron-core
is slow, so nothing here is imported by ``chunk_offload`` itself):

- `chunk_offload.devkit.cpu_compat`: named, reversible rules that redirect megatron-core's CUDA
  calls so that it builds and trains on a CPU-only host with gloo (inert when CUDA is present);
  see docs/megatron_cpu.md.
- `chunk_offload.devkit.megatron_training_cpu`: the same for Megatron-LM's ``megatron.training``
  (``initialize_megatron`` / ``pretrain``), used by the ``chunk_offload.megatron_lm`` launcher.
- `chunk_offload.devkit.gpt`: the small megatron-core GPT builder shared by the example, the
  stage replay, the planner's measurements and the tests;
- `chunk_offload.devkit.attention`: a flash-style core attention for megatron-core on torch's
  ``scaled_dot_product_attention`` (the builder's ``attention="sdpa"``);
- `chunk_offload.devkit.slow_link`: a chain of groups whose backward compute and reload link take
  real (slept) time, so that waits on reloads are measured on CPU streams;
- `chunk_offload.devkit.deterministic`: torch's deterministic kernels for a block, so that the
  replay and the benches compare runs bit for bit on CUDA too;
- `chunk_offload.devkit.host_profile`: an offload engine's host time by function (cProfile) and
  its CUDA API calls (torch.profiler), for the replay's comparison and the benches.
"""

__all__: list[str] = []
