"""Schedule simulators: `python -m ramstream.simulate offload ...` predicts an OffloadModel step
(offload.py), from given per-chunk times or ones measured on a real step (measure.py); `schedule`
and `pipeline` a pipeline schedule's step, alone or with weight streaming (pipeline.py); Gantt
charts with matplotlib (gantt.py, pipeline_gantt.py, the optional extra ramstream[plot])."""

from .measure import measure_step, times_from_trace
from .offload import Prediction, Span, simulate_offload, table
from .pipeline import PipelinePrediction, simulate_pipeline, simulate_schedule

__all__ = [
    "Prediction",
    "Span",
    "simulate_offload",
    "table",
    "times_from_trace",
    "measure_step",
    "PipelinePrediction",
    "simulate_pipeline",
    "simulate_schedule",
]
