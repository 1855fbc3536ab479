"""OffloadModel: explicit weight streaming over user-cut chunks (RamTorch's API names), built on
the one weight streamer (weights/: Slab, frozen_slabs, WeightStreamer, make_copier).

Every chunk not pinned is one streamed block: all its parameters (trained and frozen) are slabs
at home in pinned host memory (ordinary memory on device="cpu") and visit the device only while
the chunk runs; pinned chunks stay resident on the device. Gradients of streamed parameters are
moved, as the autograd engine produces them, into accumulators on the parameter's home device,
and after every step() each trained parameter's `.grad` is that accumulator: `.grad` lives where
the parameter's data lives at rest, so `torch.optim.AdamW(model.parameters(), fused=True)` steps
on the home copies directly (the next load copies the updated weights to the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .activations.recompute import Recompute
from .weights.slab import make_copier
from .weights.streamer import Block, WeightStreamer, frozen_slabs

_KEEP = (False, True, "checkpoint")
_NO_LOSS = object()


@dataclass
class StepResult:
    """What step() returns: the output (detached) and the loss (detached; raises ValueError when
    step() was given grad_outputs, which computes no loss)."""

    output: Any
    _loss: Any = _NO_LOSS

    @property
    def loss(self):
        if self._loss is _NO_LOSS:
            raise ValueError("StepResult.loss: step() was given grad_outputs, so no loss was computed")
        return self._loss


def _device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"OffloadModel: device must be 'cpu' or 'cuda[:index]', got {device!r}") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"OffloadModel: device must be 'cpu' or 'cuda[:index]', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"OffloadModel: device={device!r} does not exist (torch sees no GPU); use 'cpu'")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"OffloadModel: device={device!r} does not exist ({torch.cuda.device_count()} GPUs: "
            f"cuda:0-cuda:{torch.cuda.device_count() - 1})"
        )
    return torch.device("cuda", index)


def _pinned_set(pin, pin_layers, n: int) -> set[int]:
    if pin_layers is not None:
        if isinstance(pin_layers, (str, bytes)) or not hasattr(pin_layers, "__iter__"):
            raise ValueError(f"OffloadModel: pin_layers must be a list of chunk indices, got {pin_layers!r}")
        idx = list(pin_layers)
        bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"OffloadModel: pin_layers must be chunk indices in [0, {n}), got {bad!r}")
        if len(set(idx)) != len(idx):
            raise ValueError(f"OffloadModel: pin_layers has duplicate indices: {idx!r}")
        return set(idx)
    if isinstance(pin, bool) or not isinstance(pin, int) or not 0 <= pin <= n:
        raise ValueError(f"OffloadModel: pin must be an int in [0, {n}] (the number of chunks), got {pin!r}")
    return set(range(pin))


def _detach(x):
    if torch.is_tensor(x):
        return x.detach()
    if isinstance(x, tuple):
        return tuple(_detach(v) for v in x)
    return x


class OffloadModel(torch.nn.Module):
    """Runs `chunks` (nn.Modules) in sequence, streaming each unpinned chunk's weights through a
    window of `window` chunks on `device`.

    Args:
        chunks: the model cut into modules; a tuple output becomes the next chunk's positional
            arguments.
        device: "cuda", "cuda:i" or "cpu" (the same logic with host copies: CI).
        window: how many chunks are loaded ahead of the one running (>= 1).
        pin: the first `pin` chunks stay resident on the device.
        pin_layers: explicit indices of resident chunks (overrides `pin`).
        keep_activations: True keeps every chunk's graph (weights freed after use and reloaded
            before backward); "checkpoint" runs each chunk under non-reentrant
            torch.utils.checkpoint (inputs kept, forward recomputed in backward after the weights
            are reloaded; RNG restored: dropout-safe); False (recompute) is implemented exactly
            as "checkpoint" in this version.
        activation_offload: only False in this version.
    """

    def __init__(
        self,
        chunks,
        device="cuda",
        window: int = 2,
        pin: int = 0,
        pin_layers=None,
        keep_activations=False,
        activation_offload=False,
    ) -> None:
        super().__init__()
        if isinstance(chunks, torch.nn.Module) and not isinstance(
            chunks, (torch.nn.Sequential, torch.nn.ModuleList)
        ):
            raise ValueError("OffloadModel: chunks must be a list of nn.Modules, got a single module")
        chunks = list(chunks)
        if not chunks:
            raise ValueError("OffloadModel: chunks must be a non-empty list of nn.Modules")
        bad = [i for i, c in enumerate(chunks) if not isinstance(c, torch.nn.Module)]
        if bad:
            raise ValueError(f"OffloadModel: chunks must be nn.Modules; chunks {bad} are not")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"OffloadModel: window must be an int >= 1, got {window!r}")
        if not any(keep_activations is k or (isinstance(k, str) and keep_activations == k) for k in _KEEP):
            raise ValueError(
                f"OffloadModel: keep_activations must be False, True or 'checkpoint', got {keep_activations!r}"
            )
        if activation_offload is not False:
            raise ValueError(
                f"OffloadModel: activation_offload must be False (paging is not built yet), got {activation_offload!r}"
            )
        owner: dict[int, int] = {}
        for i, c in enumerate(chunks):
            for p in c.parameters():
                if owner.setdefault(id(p), i) != i:
                    raise ValueError(
                        f"OffloadModel: chunks {owner[id(p)]} and {i} share a parameter; chunks must not share parameters"
                    )
        self.device = _device(device)
        pinned = _pinned_set(pin, pin_layers, len(chunks))
        self.chunks = torch.nn.ModuleList(chunks)
        self.window = window
        self.keep_activations = keep_activations
        self.copier = make_copier(self.device)
        self._recompute = Recompute(chunks, range(len(chunks))) if keep_activations is not True else None
        self._in_step = False
        self._acc: dict[int, Any] = {}  # id(param) -> this step's gradient accumulator
        self._grad_hooks: list = []
        self.streamer = None
        self._build(pinned)

    # ---- building ------------------------------------------------------------------------------
    def _build(self, pinned: set[int]) -> None:
        self.pinned = sorted(pinned)
        grads = {id(p): p.grad for p in self.parameters()}
        blocks = []
        with torch.no_grad():
            for i, c in enumerate(self.chunks):
                for p in c.parameters():
                    p.grad = None
                for m in c.modules():  # buffers always live on the device
                    for name, buf in list(m._buffers.items()):
                        if buf is not None and buf.device != self.device:
                            m._buffers[name] = buf.to(self.device)
                if i in pinned:
                    for p in c.parameters():
                        p.data = p.data.to(self.device)
                else:
                    blocks.append(Block(i, c, frozen_slabs(c, set(), self.copier), []))
            for p in self.parameters():
                g = grads[id(p)]
                p.grad = None if g is None else g.to(p.device)
        self.streamer = WeightStreamer(blocks, copier=self.copier, window=self.window)
        self._streamed = [p for b in blocks for s in b.slabs for p in s.params if p.requires_grad]
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._grad_landed) for p in self._streamed]

    def _teardown(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
            with torch.no_grad():
                for b in self.streamer.blocks:
                    for s in b.slabs:
                        for p in s.params:
                            p.data = p.data.clone()  # off the slab's home buffer
            self.streamer = None
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []

    def set_pinned(self, indices) -> None:
        """Makes exactly the chunks at `indices` resident (the others stream). Gradients move
        with their parameters; build the optimizer after this call (its state would stay where
        the parameters were)."""
        pinned = _pinned_set(0, indices, len(self.chunks))
        self._teardown()
        self._build(pinned)

    @property
    def stats(self) -> dict:
        """The streamer's counters: loads, bytes_h2d, evictions, peak_loaded_bytes, ..."""
        return self.streamer.stats

    def _apply(self, fn, recurse=True):
        raise TypeError(
            "OffloadModel: .to()/.cuda()/.half() are not supported: convert the chunks before OffloadModel()"
        )

    # ---- gradients -----------------------------------------------------------------------------
    def _grad_landed(self, p) -> None:
        """A streamed parameter's gradient of this backward: into its accumulator at home."""
        if not self._in_step:
            return  # a backward the user runs: torch accumulates into .grad itself
        g = p.grad
        p.grad = None
        acc = self._acc.get(id(p))
        home = p.device if not p.is_cuda else torch.device("cpu")
        if acc is None:
            self._acc[id(p)] = g if g.device == home else g.to(home)
        else:
            acc.add_(g.to(home))

    def flush_grads(self) -> None:
        """RamTorch's "accumulators -> .grad". step() already leaves every gradient in `.grad`
        (streamed parameters: on their home device); this waits for pending copies."""
        self.copier.synchronize()

    # ---- running -------------------------------------------------------------------------------
    def _run(self, x):
        for c in self.chunks:
            x = c(*x) if isinstance(x, tuple) else c(x)
        return x

    def forward(self, x):
        if self.streamer is None:
            raise ValueError("OffloadModel: the model is closed")
        try:
            return self._run(x)
        finally:
            if not self._in_step:
                # weights back home between calls (an optimizer step writes there); a backward
                # through this output reloads them
                self.streamer.evict_all()

    def step(self, x, targets=None, loss_fn=None, grad_outputs=None) -> StepResult:
        """Forward and backward. The loss is loss_fn(output, targets) (default: mean squared
        error); with grad_outputs (a tensor, a tuple for a tuple output, or a callable given the
        output) the output's gradient is supplied instead and no loss is computed. Gradients add
        into each trained parameter's `.grad`."""
        if self.streamer is None:
            raise ValueError("OffloadModel: the model is closed")
        if grad_outputs is not None and loss_fn is not None:
            raise ValueError("OffloadModel.step: give loss_fn or grad_outputs, not both")
        if grad_outputs is None and targets is None:
            raise ValueError("OffloadModel.step: give targets (for loss_fn) or grad_outputs")
        for p in self._streamed:
            self._acc[id(p)] = p.grad
            p.grad = None
        self._in_step = True
        try:
            with torch.enable_grad():
                out = self._run(x)
                if grad_outputs is not None:
                    g = grad_outputs(out) if callable(grad_outputs) else grad_outputs
                    outs = out if isinstance(out, tuple) else (out,)
                    gs = g if isinstance(g, tuple) else (g,)
                    if len(outs) != len(gs):
                        raise ValueError(
                            f"OffloadModel.step: grad_outputs has {len(gs)} tensors for {len(outs)} outputs"
                        )
                    pairs = [
                        (o, gr)
                        for o, gr in zip(outs, gs)
                        if gr is not None and torch.is_tensor(o) and o.requires_grad
                    ]
                    torch.autograd.backward([o for o, _ in pairs], [gr for _, gr in pairs])
                    return StepResult(_detach(out))
                loss = (loss_fn or F.mse_loss)(out, targets)
                loss.backward()
                return StepResult(_detach(out), loss.detach())
        finally:
            self._in_step = False
            self.streamer.evict_all()
            self.copier.synchronize()
            for p in self._streamed:
                p.grad = self._acc.pop(id(p), None)

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Removes the hooks; streamed parameters stay views of their home copies (CPU)."""
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        if self._recompute is not None:
            self._recompute.close()
            self._recompute = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
