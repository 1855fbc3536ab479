"""Single-process pipeline parallelism over the GPUs of one machine (RamTorch's Pipeline API):
Pipeline (runtime.py: persistent stage threads running schedule.py's op orders; paging.py: its
activation paging; streaming.py: its streaming inference; pinning.py: set_offload_pinned; twobw.py:
PipeDream-2BW training sessions, train_session(); oom.py: PipelineOutOfMemoryError, what a stage
out of device memory raises), PipelineModel (model.py: an nn.Sequential split over devices,
balanced by parameters or measured time: partition.py, timing.py)."""

from .model import PipelineModel, PipelinePaddingWarning
from .oom import PipelineOutOfMemoryError
from .runtime import Pipeline, PipelineResult
from .streaming import InferHandle, InferStream
from .twobw import PipeDream2BWTrainer, TrainRunResult, TrainSession

__all__ = [
    "InferHandle",
    "InferStream",
    "Pipeline",
    "PipelineModel",
    "PipelineOutOfMemoryError",
    "PipelinePaddingWarning",
    "PipelineResult",
    "PipeDream2BWTrainer",
    "TrainRunResult",
    "TrainSession",
]
