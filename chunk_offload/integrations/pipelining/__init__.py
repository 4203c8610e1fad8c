"""torch.distributed.pipelining integration: offload submodules of pipeline stages under torch's schedules.

    manager = attach(schedule, {"attn": "layers.*.attention", "mlp_fc1": "layers.*.mlp.fc1"}, config=OffloadConfig(min_offload_bytes=1 << 20))
    schedule.step(x, target=y, losses=losses)   # each training step is one offload iteration
    manager.plan                                # this rank's order, checked against what ran

Covers `Schedule1F1B`, `ScheduleGPipe`, `ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`,
`ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`, `ScheduleDualPipeV` (and other
schedules built from `PipelineStage`s).
`order` is the only module that reads torch's private schedule names.
"""

from .attach import PipelineOffloadManager, attach
from .selection import ModuleSelector
from .order import listed_plan

__all__ = ["ModuleSelector", "PipelineOffloadManager", "attach", "listed_plan"]
