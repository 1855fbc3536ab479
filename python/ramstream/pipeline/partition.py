"""The pipeline's split arithmetic, re-exported: it is decided in the planner
(planner/pipeline_split.py: partition, stage_bytes, split_pipeline); this name stays importable."""

from __future__ import annotations

from ..planner.pipeline_split import OPTIMIZER_BYTES_PER_ELEMENT, partition, stage_bytes

__all__ = ["OPTIMIZER_BYTES_PER_ELEMENT", "partition", "stage_bytes"]
