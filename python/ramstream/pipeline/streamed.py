"""A streamed pipeline stage (RamTorch's offloaded stage, `offload=True`): a list of chunks run in
sequence whose weights live in host RAM (pinned on a GPU) and visit the stage's device only while
a chunk runs, through ramstream's one weight streamer (weights/: Slab, WeightStreamer), the one
OffloadModel uses; gradients of streamed parameters go home as autograd produces them
(OffloadModel's GradWriteback) and become `.grad` when the step succeeds.

Threads: a stage's forwards run on its stage thread, its backwards' hooks on the autograd thread
of its device; the streamer and the write-back are only ever used by one of them at a time.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..activations.recompute import Recompute
from ..frontends.offload_model.checks import spaced
from ..frontends.offload_model.grads import GradWriteback
from ..planner.pipeline_split import check_budgets, choose_streaming
from ..weights.slab import make_copier
from ..weights.streamer import Block, WeightStreamer, frozen_slabs
from .split import piece_bytes

__all__ = ["StreamedStage", "stream_choices"]


def stream_choices(pieces, n: int, offload: bool, device_memory, window, pin) -> list:
    """Per piece (chunk order, piece c on stage c % n) the planner's StageStreaming when it is a
    streamed stage (a list of chunks, offload=True), else None: the chunks' bytes read here, the
    window and pinned chunks chosen by planner/pipeline_split.py choose_streaming within the
    stage's device_memory (checked: bytes or None per stage), less its resident pieces, shared equally by its streamed pieces. window / pin:
    ints (kept; a pin above the chunk count pins them all) or "auto"."""
    budgets = check_budgets(device_memory, n)
    out = [None] * len(pieces)
    if not offload:
        return out
    for s in range(n):
        mine = [c for c in range(len(pieces)) if c % n == s]
        streamed = [c for c in mine if isinstance(pieces[c], list)]
        if not streamed:
            continue
        cap = None if budgets is None else budgets[s]
        if cap is not None:
            resident = sum(sum(piece_bytes(pieces[c])) for c in mine if c not in streamed)
            cap = max(0, cap - resident) // len(streamed)
        for c in streamed:
            chunks = [piece_bytes(m) for m in pieces[c]]
            p = None if pin == "auto" else min(pin, len(chunks))
            out[c] = choose_streaming(
                chunks, cap, window=None if window == "auto" else window, pin=p, stage=s
            )
    return out


def _land(ref, p) -> None:
    stage = ref()
    if stage is not None and stage.in_step and not stage.holding:
        if id(p) in stage.taken:
            if stage.one_microbatch:  # the gradient is the step's: the host optimizer takes it
                stage.hand_over([p])
                return
            raise RuntimeError(  # (host_optim.begin_step refuses such a step before it runs)
                "Pipeline: the host optimizer takes each streamed gradient once per step, summed "
                "over every microbatch: a backward ran microbatch by microbatch"
            )
        g = p.grad
        p.grad = None
        stage.grads.land(p, g)


class StreamedStage(nn.Module):
    """`chunks` (nn.Modules run in sequence; a tuple output is the next one's arguments) on
    `device`, every chunk but the `pin` evenly spaced pinned ones streamed: at most `window`
    streamed chunks on the device at once (OffloadModel's `window`, RamTorch's meaning).
    keep_activations: True keeps each chunk's graph (weights reloaded for its backward);
    "checkpoint" or False recompute each chunk's forward in its backward (after the reload).

    Between steps the streamed parameters are views of their home copies in host memory and their
    `.grad` lives there too, so a torch optimizer over them updates the home copies; the next load
    copies the new weights to the device. .to() raises (the stage places itself)."""

    def __init__(self, chunks, device: torch.device, *, window: int, pin: int, keep_activations) -> None:
        super().__init__()
        self.parts = nn.ModuleList(chunks)
        n = len(chunks)
        pinned = spaced(min(pin, n), n) if pin else set()
        self.device = device
        self.copier = make_copier(device)
        self.grads = GradWriteback(device, sum_as_landed=True)  # a landing per microbatch
        self.in_step = False
        self.holding = False  # chunk_major.backward_parts sums the gradients on the device first
        self.fused_casts = 0  # parameters whose cast gradients cast_grads.py summed (a count)
        self.taken: set = set()  # ids of the parameters whose gradients the host optimizer takes
        self.hand_over = None  # host_optim.py: hands a chunk's final gradients to the engine
        self.one_microbatch = False  # this step has one microbatch: every landing is final
        with torch.no_grad():
            for i, c in enumerate(chunks):
                for m in c.modules():  # buffers always live on the device
                    for name, buf in list(m._buffers.items()):
                        if buf is not None and buf.device != device:
                            m._buffers[name] = buf.to(device)
                if i in pinned:
                    for p in c.parameters():
                        p.data = p.data.to(device)
                        if p.grad is not None:
                            p.grad = p.grad.to(device)
        self.pinned = sorted(pinned)
        self.streamer = None
        self.recompute = Recompute(list(chunks), list(range(n))) if keep_activations is not True else None
        self.build(window - 1)

    def build(self, ahead: int, engine_buckets=None, wait=None) -> None:
        """The streamer over the unpinned chunks, each chunk's parameters in slabs of its own, or
        (engine_buckets: {chunk index: the host optimizer's buckets of it}) its trained ones in
        the engine's slabs, whose loads wait (wait(bucket)) for their update, and their gradients
        handed to the engine (hand_over) instead of the write-back."""
        engine_buckets = engine_buckets or {}
        blocks = []
        for i, c in enumerate(self.parts):
            if i in self.pinned:
                continue
            trained = engine_buckets.get(i, [])
            skip = {id(sl.param) for b in trained for sl in b.slots}
            slabs = [b.slab for b in trained] + frozen_slabs(c, skip, self.copier)
            blocks.append(Block(i, c, slabs, [lambda b=b: wait(b) for b in trained]))
        self.streamer = WeightStreamer(blocks, copier=self.copier, ahead=ahead)
        self.block_of = {b.index: k for k, b in enumerate(blocks)}  # chunk -> streamer block
        self.taken = {id(sl.param) for bs in engine_buckets.values() for b in bs for sl in b.slots}
        self.grads.forget(self.taken)  # their pooled pinned buffers go back
        self._handles = self._hook_grads()

    def unbuild(self) -> None:
        """Before the streamer is built again: weights home, the hooks off, and every streamed
        parameter off its slab (a copy of its current weights in ordinary host memory)."""
        self.streamer.evict_all()
        self.copier.synchronize()
        params = list(self._streamed_params(trained_only=False))
        self.streamer.close()
        for h in self._handles:
            h.remove()
        self._handles = []
        with torch.no_grad():
            for p in params:
                p.data = p.data.clone()

    def _hook_grads(self) -> list:
        ref = weakref.ref(self)
        return [
            p.register_post_accumulate_grad_hook(lambda p, r=ref: _land(r, p))
            for p in self._streamed_params()
        ]

    def forward(self, *args):
        x = args
        for m in self.parts:
            x = m(*x) if isinstance(x, tuple) else m(x)
        return x

    def _streamed_params(self, chunks=None, trained_only: bool = True):
        blocks = self.streamer.blocks
        for b in (
            blocks if chunks is None else [blocks[self.block_of[i]] for i in chunks if i in self.block_of]
        ):
            for s in b.slabs:
                yield from (p for p in s.params if p.requires_grad or not trained_only)

    def land_part(self, i: int) -> None:
        """Chunk i's streamed gradients, summed on the device over a run of microbatches, go home
        (one batch of landings: GradWriteback.land_many), or to the host optimizer's engine."""
        pairs, taken = [], []
        for p in self._streamed_params([i]):
            if id(p) in self.taken:
                taken.append(p)  # .grad handed over as it is (the engine sets it to None)
                continue
            g = p.grad
            if g is not None:
                p.grad = None
                pairs.append((p, g))
        self.grads.land_many(pairs)
        if taken:
            self.hand_over(taken)

    def drop_device_grads(self) -> None:
        """A failed chunk-major backward: gradients not yet sent home are dropped."""
        for p in self._streamed_params():
            p.grad = None

    def begin(self) -> None:
        """A pipeline step starts: streamed gradients go home through the write-back."""
        self.in_step = True

    def end(self, ok: bool) -> None:
        """The step ended (every op of every stage done): weights home, and the landed gradients
        become `.grad` (ok) or are dropped. Waits for this stage's copy and D2H streams."""
        self.in_step = False
        self.streamer.evict_all()
        self.copier.synchronize()
        if ok:
            self.grads.commit({})
        else:
            self.grads.discard()

    def set_pinned(self, want) -> tuple[list, list, list]:
        """Makes exactly the chunks `want` (indices) resident, between steps (pinning.py): a newly
        pinned chunk's weights and `.grad` are copied to the device, a newly streamed one's into
        new home slabs (its `.grad` home); the other chunks keep their slabs. Values are copied,
        never changed. Every copy is made before anything switches: one that fails (out of
        memory) leaves the stage as it was. Returns (newly pinned, newly streamed, their
        parameters). Not during a step (the caller holds the pipeline's lock)."""
        want = set(want)
        to_pin, to_unpin = sorted(want - set(self.pinned)), sorted(set(self.pinned) - want)
        moved = [p for i in to_pin + to_unpin for p in self.parts[i].parameters()]
        if not to_pin and not to_unpin:
            return to_pin, to_unpin, moved
        self.streamer.evict_all()
        self.copier.synchronize()
        out = [p for i in to_unpin for p in self.parts[i].parameters()]
        saved = [(p, p.data, p.grad) for p in out]
        data, grads, fresh = {}, {}, {}
        try:
            with torch.no_grad():
                for i in to_pin:
                    for p in self.parts[i].parameters():
                        data[p] = p.data.to(self.device, copy=True)
                        grads[p] = None if p.grad is None else p.grad.to(self.device)
                for p in out:
                    p.grad = None  # (its data moves home next: a .grad elsewhere would not match)
                for i in to_unpin:  # the slabs copy the weights home and point the parameters there
                    fresh[i] = Block(i, self.parts[i], frozen_slabs(self.parts[i], set(), self.copier), [])
                for p, _, g in saved:
                    grads[p] = None if g is None else g.to(p.device)
        except BaseException:
            for p, d, g in saved:
                p.data, p.grad = d, g
            raise
        old = {b.index: b for b in self.streamer.blocks}
        stats = self.streamer.stats
        self.streamer.close()
        for h in self._handles:
            h.remove()
        with torch.no_grad():
            for p in data:
                p.grad = None
                p.data = data[p]
            for p, g in grads.items():
                p.grad = g
        self.grads.forget([id(p) for p in data])  # their pooled pinned buffers go back
        blocks = [old.get(i) or fresh[i] for i in range(len(self.parts)) if i not in want]
        self.streamer = WeightStreamer(blocks, copier=self.copier, ahead=self.streamer.ahead)
        self.streamer.stats = stats  # its counters go on
        self.block_of = {b.index: k for k, b in enumerate(blocks)}
        self._handles = self._hook_grads()
        self.pinned = sorted(want)
        return to_pin, to_unpin, moved

    def _apply(self, fn, recurse=True):
        raise TypeError(
            "Pipeline: a streamed stage cannot be moved or converted (.to()/.half()): it places itself"
        )

    def close(self) -> None:
        """Removes the hooks; the streamed parameters stay views of their home copies."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.grads.close()
        self.streamer.close()
        if self.recompute is not None:
            self.recompute.close()
            self.recompute = None
