"""PipelineModel (RamTorch's name): an nn.Sequential split into contiguous stages over devices,
balanced by parameter count, child count or measured time, per-device weights and memory budgets;
forward() for pipelined inference, step() for training, with the model's own parameters and state
dict."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn

from ..planner.pipeline_split import split_pipeline
from .checks import check_devices
from .run import PipelineResult
from .runtime import Pipeline
from .split import Sequence, children_of, piece_bytes, split_model
from .timing import measure_piece_times

__all__ = ["PipelineModel", "PipelinePaddingWarning"]


class PipelinePaddingWarning(UserWarning):
    """PipelineModel.forward padded its last microbatch (the batch is not a multiple of
    example_input's rows). Silence with
    ``warnings.filterwarnings("ignore", category=ramstream.PipelinePaddingWarning)`` or
    ``PipelineModel(..., warn_on_padding=False)``."""


class PipelineModel(nn.Module):
    """`model` (an nn.Sequential) cut into contiguous stages, one per device, run as a Pipeline.

    Args:
        model: an nn.Sequential (or an nn.ModuleList of blocks run in order); its children are
            cut into stages (the modules are shared: the
            model's parameters are the pipeline's, and an optimizer over model.parameters() or
            this module's parameters() sees the gradients).
        example_input: one microbatch (a tensor): forward() runs microbatches of its rows. None:
            forward() cuts a batch into num_stages microbatches.
        devices: one per stage; None: num_stages stages on cuda:i round-robin (or the CPU),
            num_stages defaulting to min(GPUs, 2) (1 without a GPU).
        num_stages: the stage count when devices is None (else it must equal len(devices)).
        split_spec: {child name: SplitPoint.BEGINNING/END or "beginning"/"end"} (see Pipeline);
            None: balanced.
        balance: "params" (default): stages balanced by parameter count; "children": by the
            number of children; "time": by each child's measured forward + backward seconds
            (measure_piece_times on the first device with example_input, chained through the
            children; or `piece_times` when given).
        device_weights: relative speed per stage (e.g. [2, 1]: stage 0 takes twice the load);
            the split minimises the largest load / weight. Used when split_spec is None.
        piece_times: seconds per child for balance="time" (skips the measurement: a split
            printed from `piece_times` can be pinned, and tests are deterministic).
        device_memory: bytes per stage (None entries: unlimited) that the stage's parameters,
            gradients and AdamW state (8 bytes per trainable element) must fit; activations are
            not counted. No contiguous split fits: MemoryError with the arithmetic.
        overlap, autocast, fake_compute: as Pipeline's.
        warn_on_padding: forward() warns (PipelinePaddingWarning) when it pads the last
            microbatch.

    `counts` holds the children per stage, `split_spec` the cut points chosen (BEGINNING
    points as strings), `piece_times` the seconds per child (balance="time"; else None) and `plan`
    the planner's PipelineSplit it applied (planner/pipeline_split.py: per stage the children,
    bytes, load and the arithmetic; None with split_spec).
    parameters(), named_parameters(), buffers(), state_dict() and load_state_dict() are the
    model's; .to()/.cuda() raise (the stages are placed already).
    """

    def __init__(
        self,
        model,
        example_input=None,
        *,
        devices=None,
        num_stages=None,
        split_spec=None,
        balance: str = "params",
        device_weights=None,
        overlap: bool = True,
        warn_on_padding: bool = True,
        autocast=None,
        piece_times=None,
        device_memory=None,
        fake_compute=None,
    ) -> None:
        super().__init__()
        kids = children_of(model, "PipelineModel")
        if num_stages is not None and (
            isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1
        ):
            raise ValueError(f"PipelineModel: num_stages must be an int >= 1, got {num_stages!r}")
        if devices is None:
            k = torch.cuda.device_count() if torch.cuda.is_available() else 0
            devs = check_devices(None, num_stages or (min(k, 2) if k else 1))
        else:
            devs = check_devices(devices, None)
            if num_stages is not None and num_stages != len(devs):
                raise ValueError(
                    f"PipelineModel: num_stages={num_stages} but devices has {len(devs)} entries"
                )
        if balance not in BALANCES:
            raise ValueError(
                f"PipelineModel: balance must be one of {', '.join(map(repr, BALANCES))}, got {balance!r}"
            )
        if split_spec is not None and device_memory is not None:
            raise ValueError(
                "PipelineModel: device_memory goes with split_spec=None (ramstream picks the split)"
            )
        if piece_times is not None and balance != "time":
            raise ValueError(f"PipelineModel: piece_times goes with balance='time', got balance={balance!r}")
        if example_input is not None and not (torch.is_tensor(example_input) and example_input.dim() >= 1):
            raise TypeError("PipelineModel: example_input must be None or a tensor with a batch dimension")
        if not isinstance(warn_on_padding, bool):
            raise TypeError(
                f"PipelineModel: warn_on_padding must be a bool, got {type(warn_on_padding).__name__}"
            )
        n = len(devs)
        self.piece_times = None
        self.plan = None
        if split_spec is None:
            mods = [m for _, m in kids]
            if balance == "time":
                self.piece_times = _times(mods, example_input, devs[0], piece_times)
            self.plan = split_pipeline(
                n,
                params=[sum(p.numel() for p in m.parameters()) for m in mods],
                detail=[piece_bytes(m) for m in mods],
                times=self.piece_times,
                balance=balance,
                budgets=device_memory,
                device_weights=device_weights,
            )
            counts = self.plan.counts
            pieces, i = [], 0
            for c in counts:
                part = [m for _, m in kids[i : i + c]]
                pieces.append(part[0] if c == 1 else Sequence(part))
                i += c
        else:
            pieces = split_model(model, split_spec, n, where="PipelineModel")
            counts = [len(p.parts) if isinstance(p, Sequence) else 1 for p in pieces]
        starts = [sum(counts[:s]) for s in range(1, n)]
        self.counts = counts
        self.split_spec = {kids[i][0]: "beginning" for i in starts}
        self._warn_on_padding = warn_on_padding
        self._example_batch = None if example_input is None else int(example_input.shape[0])
        object.__setattr__(self, "_model", model)  # not a submodule: its names and keys stay its own
        self._pipe = Pipeline(
            stage_modules=pieces, devices=devs, overlap=overlap, autocast=autocast, offload=False,
            fake_compute=fake_compute,
        )  # fmt: skip
        self.devices = self._pipe.devices
        self.num_stages = n

    @property
    def pipeline(self) -> Pipeline:
        """The Pipeline running the stages."""
        return self._pipe

    # ---- the model's parameters and state ------------------------------------------------------
    def parameters(self, recurse: bool = True):
        return self._model.parameters(recurse=recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._model.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def buffers(self, recurse: bool = True):
        return self._model.buffers(recurse=recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._model.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._model.load_state_dict(*args, **kwargs)

    def train(self, mode: bool = True):
        self.training = mode
        self._model.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        raise TypeError(
            "PipelineModel: .to()/.cuda()/.half() are not supported: the stages are placed on their devices"
        )

    # ---- running --------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, data):
        """Pipelined inference (no graph kept): `data` cut into microbatches of example_input's
        rows, the last one padded with copies of its first row (PipelinePaddingWarning) and the
        padding's outputs dropped; returns the last stage's output for every row."""
        if not torch.is_tensor(data) or data.dim() == 0:
            raise TypeError("PipelineModel.forward: data must be a tensor with a batch dimension")
        rows = data.shape[0]
        eb = self._example_batch
        if eb is None:
            return self._pipe.infer(data, n_microbatches=max(1, min(self.num_stages, rows)))
        k = max(1, math.ceil(rows / eb))
        pad = k * eb - rows
        if pad:
            if self._warn_on_padding:
                warnings.warn(
                    f"PipelineModel.forward: {rows} rows are not a multiple of the microbatch's {eb} "
                    f"(example_input); the last microbatch is padded with {pad} row(s), whose outputs are "
                    "dropped. Silence with warnings.filterwarnings('ignore', "
                    "category=ramstream.PipelinePaddingWarning) or warn_on_padding=False.",
                    PipelinePaddingWarning,
                    stacklevel=2,
                )
            data = torch.cat([data, data[:1].expand(pad, *data.shape[1:])])
        out = self._pipe.infer(data, n_microbatches=k)
        return _rows(out, rows) if pad else out

    def step(
        self,
        data,
        *,
        targets=None,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        loss_fn=None,
        trace_path=None,
        profile_path=None,
        grad_outputs=None,
    ) -> PipelineResult:
        """Pipeline.step() on the stages (same arguments and meaning)."""
        return self._pipe.step(
            data,
            targets=targets,
            schedule=schedule,
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            trace_path=trace_path,
            profile_path=profile_path,
            grad_outputs=grad_outputs,
        )

    def infer(self, data, *, n_microbatches: int | None = None, trace_path=None, profile_path=None):
        """Pipeline.infer() on the stages (no padding)."""
        return self._pipe.infer(
            data, n_microbatches=n_microbatches, trace_path=trace_path, profile_path=profile_path
        )

    def infer_open(self):
        """Pipeline.infer_open(): the streaming-inference session (items are not padded)."""
        return self._pipe.infer_open()

    def infer_submit(self, x):
        """Pipeline.infer_submit(x) -> InferHandle (one item, not padded)."""
        return self._pipe.infer_submit(x)

    def infer_loop(self, items, *, max_in_flight=None, timeout=None):
        """Pipeline.infer_loop(items): their results in order."""
        return self._pipe.infer_loop(items, max_in_flight=max_in_flight, timeout=timeout)

    def flush_grads(self, scale: float = 1.0) -> None:
        """Pipeline.flush_grads(scale): one meaning, see there."""
        self._pipe.flush_grads(scale)

    def close(self) -> None:
        """Stops the stage threads (Pipeline.close())."""
        self._pipe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


BALANCES = ("params", "children", "time")


def _times(mods, example_input, device, given) -> list[float]:
    if given is None:
        if example_input is None:
            raise ValueError(
                "PipelineModel: balance='time' measures each child with example_input (one microbatch); "
                "pass example_input or piece_times"
            )
        return measure_piece_times(mods, example_input, device)
    try:
        times = [float(t) for t in given]
    except (TypeError, ValueError):
        raise TypeError(f"PipelineModel: piece_times must be a list of seconds, got {given!r}") from None
    if len(times) != len(mods):
        raise ValueError(f"PipelineModel: piece_times has {len(times)} entries for {len(mods)} children")
    return times


def _rows(out, rows):
    if torch.is_tensor(out):
        return out[:rows]
    if isinstance(out, tuple):
        return tuple(_rows(o, rows) for o in out)
    return out
