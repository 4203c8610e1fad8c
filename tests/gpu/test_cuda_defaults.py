"""What the integrations' defaults become on CUDA streams (NOTE [Timed reload ahead by default]).

On CPU streams ``timed_reload_ahead="auto"`` is off (tests/integrations/test_session.py); on the
copy engines of a device it is on, unless turned off.
"""

from __future__ import annotations

import pytest
import torch

from chunk_offload import CudaStreams, OffloadConfig
from chunk_offload.integrations.options import ScheduleOptions
from chunk_offload.integrations.session import TrainingSession

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine: bash bench/gpu_evidence.sh)")


@pytest.mark.parametrize(("options", "timed"), [(ScheduleOptions(), True), (ScheduleOptions(timed_reload_ahead=False), False)])
def test_timed_reload_ahead_is_on_by_default_on_cuda_streams(options: ScheduleOptions, timed: bool) -> None:
    session = TrainingSession(config=OffloadConfig(), streams=CudaStreams(), options=options, check_order=lambda order: None)
    try:
        assert CudaStreams.measures_link and session.tracking.timed_reload_ahead is timed
        assert session.tracking.budgets.timed_reload_ahead is timed
    finally:
        session.engine.close()
