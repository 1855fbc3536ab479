"""The planner: what the machine offers (profile.py), what the model needs (shape.py), and where
everything lives and how long a step takes (plan.py); activation-paging arithmetic
(activations.py), the pipeline's split and a streamed stage's window/pin (pipeline_split.py) and
the shared measurements (measure.py)."""

from __future__ import annotations

from .activations import choose_paged_blocks, copy_seconds, estimate_overlap, fraction_to_blocks
from .pipeline_split import PipelineSplit, PipelineStage, StageStreaming, choose_streaming, split_pipeline
from .plan import Plan, PlanError, plan_training
from .profile import HardwareProfile, profile_hardware
from .shape import BlockShape, ModelShape

__all__ = [
    "choose_paged_blocks",
    "fraction_to_blocks",
    "copy_seconds",
    "estimate_overlap",
    "HardwareProfile",
    "profile_hardware",
    "ModelShape",
    "BlockShape",
    "Plan",
    "PlanError",
    "plan_training",
    "PipelineSplit",
    "PipelineStage",
    "StageStreaming",
    "choose_streaming",
    "split_pipeline",
]
