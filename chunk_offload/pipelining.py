"""`chunk_offload.pipelining`: the torch.distributed.pipelining integration under a short name.

A re-export of `chunk_offload.integrations.pipelining`; see there.
"""

from .integrations.pipelining import ModuleSelector, PipelineOffloadManager, attach, listed_plan

__all__ = ["ModuleSelector", "PipelineOffloadManager", "attach", "listed_plan"]
