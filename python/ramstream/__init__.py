"""ramstream: train PyTorch models larger than GPU memory by streaming state from host RAM.

model, optimizer = ramstream.wrap(model, optimizer)
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import functional  # noqa: E402
from .blocks import find_blocks  # noqa: E402
from .checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from .engine.nonfinite import NonFiniteGradientError  # noqa: E402
from .env import check_core as _check_env  # noqa: E402
from .frontends.offload_model import (  # noqa: E402
    OffloadModel,
    OffloadStepResult,
    StepResult,
    offload_checkpoint,
)
from .loss import causal_lm_loss, chunked_cross_entropy  # noqa: E402
from .ops.memory import (  # noqa: E402
    empty_cache,
    memory_stats,
    pin_budget,
    pinned_empty,
    register_host_memory,
    reset_peak_memory_stats,
    set_pin_budget,
    unregister_host_memory,
)
from .optim import OffloadAdamW  # noqa: E402
from .pipeline import Pipeline, PipelineModel, PipelineOutOfMemoryError, PipelinePaddingWarning  # noqa: E402
from .planner import HardwareProfile, ModelShape, Plan, PlanError, plan_training, profile_hardware  # noqa: E402
from .quant import dequantize_model, quantize_model  # noqa: E402
from .report import pinned_stats  # noqa: E402
from .runtime.inspect import plan_for  # noqa: E402
from .runtime.tokens import PlanOutOfMemoryError  # noqa: E402
from .trace import trace  # noqa: E402
from .wrap import memory_report, unwrap, wrap  # noqa: E402

_check_env()  # a bad RAMSTREAM_* value the C++ core reads warns once, here (env.py)

__all__ = [
    "__version__",
    "OffloadAdamW",
    "NonFiniteGradientError",
    "wrap",
    "unwrap",
    "memory_report",
    # explicit weight streaming over user-cut chunks (RamTorch's API)
    "OffloadModel",
    "StepResult",
    "OffloadStepResult",  # RamTorch's name for StepResult
    "offload_checkpoint",
    # single-process pipeline parallelism over devices (RamTorch's Pipeline API)
    "Pipeline",
    "PipelineModel",
    "PipelinePaddingWarning",
    # Chrome/Perfetto step traces (every mode)
    "trace",
    # checkpoints (safetensors + JSON, atomic)
    "save_checkpoint",
    "load_checkpoint",
    # packed int8/NF4 frozen weights (quant/)
    "quantize_model",
    "dequantize_model",
    # the planner
    "profile_hardware",
    "HardwareProfile",
    "ModelShape",
    "plan_training",
    "plan_for",
    "Plan",
    "PlanError",
    "PlanOutOfMemoryError",
    "PipelineOutOfMemoryError",
    "functional",
    "find_blocks",  # the repeated block stack wrap() detects (TrainStream's name)
    # pinned host memory
    "pinned_empty",
    "memory_stats",
    "pinned_stats",  # TrainStream's names for memory_stats' counters
    "set_pin_budget",
    "pin_budget",
    "empty_cache",
    "reset_peak_memory_stats",
    "register_host_memory",
    "unregister_host_memory",
    # losses that never build the full logits
    "chunked_cross_entropy",
    "causal_lm_loss",
]
