"""Stage replay: what one stage of a large pipeline job would see, measured on one device.

A lent machine has one GPU, so the ranks of a pipeline cannot run there together. The replay
builds stage ``s`` of ``p`` with its real megatron-core chunks (`megatron_stage`) and runs the
stage's exact action list from megatron's schedule (`replay`), with synthetic received
activations and gradients, with and without offload side by side in one process::

    with megatron_stage(GPTShape(num_layers=32, hidden_size=4096, ...), pp_size=4, pp_rank=0, vp_size=2) as stage:
        result = replay(stage, modules="core_attn,qkv_linear", num_microbatches=8)
    table = result.format()                 # step time, peak memory, measured/theoretical drop, R

`replay_under_budget` runs the stage as training does under a device budget.

Command line: ``python -m chunk_offload.replay --help``.
"""

from .result import BudgetReplay, ModeResult, ReplayResult
from .run import replay, replay_under_budget
from .stage import MegatronStage, megatron_stage

__all__ = ["BudgetReplay", "MegatronStage", "ModeResult", "ReplayResult", "megatron_stage", "replay", "replay_under_budget"]
