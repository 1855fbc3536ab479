"""OffloadModel (RamTorch's API): the model (model.py), its host optimizer (optim.py), gradient
write-back (grads.py), argument checks and StepResult (checks.py), saved-tensor casts (casts.py)."""

from .model import OffloadModel, StepResult, offload_checkpoint

OffloadStepResult = StepResult  # RamTorch's name

__all__ = ["OffloadModel", "OffloadStepResult", "StepResult", "offload_checkpoint"]
