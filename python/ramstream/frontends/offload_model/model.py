"""OffloadModel: explicit weight streaming over user-cut chunks (RamTorch's API names), built on
the one weight streamer (weights/: Slab, frozen_slabs, WeightStreamer, make_copier).

Every chunk not pinned is one streamed block: all its parameters (trained and frozen) are slabs
at home in pinned host memory (ordinary memory on device="cpu") and visit the device only while
the chunk runs; pinned chunks stay resident on the device. Gradients of streamed parameters go
home as the autograd engine produces them (grads.py: on a D2H stream into pinned buffers
on a GPU), and after every step() each trained parameter's `.grad` is at home: `.grad` lives
where the parameter's data lives at rest, so `torch.optim.AdamW(model.parameters(), fused=True)`
steps on the home copies directly (the next load copies the updated weights to the device).
With ramstream's host optimizer (optimizer(), optim.py) the offload engine takes the
gradients of its parameters instead and updates each chunk during the backward.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.nn.functional as F

from ...activations.hooks import ActivationOffloader
from ...activations.recompute import Recompute, checkpointed
from ...trace import Tracer
from ...trace import current as _trace_current
from ...trace import register as _trace_register
from ...weights.slab import make_copier
from ...weights.streamer import Block, WeightStreamer, frozen_slabs
from .casts import CastSaver
from .checks import (
    ModelClosedError,
    StepResult,
    check_chunks,
    check_default_targets,
    check_device,
    check_grad_outputs,
    check_options,
    check_step_args,
    detach,
    pinned_set,
)
from .disk import check_disk, disk_slabs, open_disk, release_disk
from .grads import GradWriteback
from .hooks import Hooks, weak_grad_hook
from .optim import step_failed as _host_step_failed
from .optim import streamed_blocks
from .ramtorch import (
    RamTorchSurface,
    call_grad_outputs,
    check_ramtorch_options,
    resolve_activation_offload,
    sum_loss,
    to_device,
)

__all__ = ["OffloadModel", "StepResult", "offload_checkpoint"]


def offload_checkpoint(module, *args, **kwargs):
    """module(*args, **kwargs) as a recomputed region: only its inputs are kept and its forward
    runs again in backward (non-reentrant torch.utils.checkpoint, RNG restored: dropout-safe).
    Inside an OffloadModel chunk the chunk's weights are loaded when the recompute runs (it is
    part of the chunk's backward); with keep_activations=True it is how one part of a chunk
    trades compute for memory. Without grad mode it is module(*args, **kwargs)."""
    if not callable(module):
        raise TypeError(
            f"offload_checkpoint: module must be an nn.Module or callable, got {type(module).__name__}"
        )
    if not torch.is_grad_enabled():
        return module(*args, **kwargs)
    return checkpointed(module, *args, preserve_rng_state=True, **kwargs)


def _trace_modules(model):
    return list(model.chunks), model.device


class OffloadModel(RamTorchSurface, torch.nn.Module):
    """Runs `chunks` (nn.Modules) in sequence, streaming each unpinned chunk's weights through a
    window of `window` chunks on `device`.

    Args:
        chunks: the model cut into modules; a tuple output becomes the next chunk's positional
            arguments.
        device: "cuda", "cuda:i" or "cpu" (the same logic with host copies: CI); None (default,
            RamTorch's): "cuda" when torch sees a GPU, else "cpu".
        window: device slots for streamed chunks, the running one included (RamTorch's meaning;
            >= 1): at most `window` streamed chunks are loaded at once, `window` - 1 of them
            ahead of the one running. window=1 loads each chunk on demand, after the compute
            before it (a load never overlaps compute); window >= 2 prefetches. Weights on the
            device: at most `window` + (the pinned chunks) chunks.
        pin: this many chunks stay resident on the device, evenly spaced (RamTorch's meaning):
            chunk i * n // pin for i = 0 .. pin-1 of the n chunks (pin=2 of 5 chunks: 0 and 2).
        pin_layers: explicit indices of resident chunks (overrides `pin`).
        keep_activations: True keeps every chunk's graph (weights freed after use and reloaded
            before backward); "checkpoint" runs each chunk under non-reentrant
            torch.utils.checkpoint (inputs kept, forward recomputed in backward after the weights
            are reloaded; RNG restored: dropout-safe); False (recompute) is implemented exactly
            as "checkpoint" in this version.
        activation_offload: True pages the kept graph's large saved tensors (1 MiB and more) of
            every chunk to host memory in forward and brings them back in backward, a chunk
            ahead (ramstream's ActivationOffloader, the one wrap(activation_offload=...) uses);
            needs keep_activations=True. Under autocast the weights' low-precision casts are then
            paged with the other saved tensors instead of being cast again in backward.
            None (default): False, or offload_activations (RamTorch's name; both given: equal).

    RamTorch's options (docs/compat.md, docs/guide/disk.md): nvme, nvme_layers, nvme_path (frozen
    chunks' weights at home on disk, read per use: disk.py); grad_accum ("stream" or
    "cpu": ramstream has one way, every step's gradients home and summed there, as RamTorch's
    "cpu"); acc_slots (no device accumulators: unused); act_slots (ramstream pages every
    chunk's large saved tensors, whatever the count).

    Optimizers (the host optimizer's fp32 weights equal torch's fused AdamW's on the host copies
    bit for bit):
        `opt = model.optimizer(lr=...)` (or `ramstream.wrap(model, torch.optim.AdamW(...))`):
            ramstream's host AdamW, each streamed chunk's update running on native threads as
            soon as its gradients are home, while the backward of the chunks before it goes on;
            the next forward waits only for the chunk it loads. Step time about forward +
            max(backward, host AdamW of every parameter), instead of forward + backward + host
            AdamW: faster whenever there is a backward to hide the update behind, and more so
            with moment_dtype="bfloat16" (20 instead of 28 bytes of host traffic per parameter).
            Its overlap is lost in the micro-batches of an accumulation before the last, and with
            max_grad_norm or eager_updates=False (the updates then overlap only the next forward).
        `torch.optim.AdamW(model.parameters(), fused=True)` after each step(): serial (the whole
            update after the backward), torch's CPU AdamW for streamed chunks but its GPU AdamW
            for pinned ones: faster when most parameters are pinned (the host optimizer updates
            pinned chunks on the host too, their gradients and weights crossing PCIe), and when
            the host's cores are too few to run the update beside the thread driving the GPU.
    """

    def __init__(
        self,
        chunks,
        device=None,
        window: int = 2,
        pin: int = 0,
        pin_layers=None,
        keep_activations=False,
        activation_offload=None,
        *,
        nvme: int = 0,
        nvme_layers=None,
        nvme_path=None,
        grad_accum: str = "stream",
        acc_slots=None,
        offload_activations=None,
        act_slots: int = 2,
    ) -> None:
        super().__init__()
        chunks = check_chunks(chunks)
        activation_offload = resolve_activation_offload(
            activation_offload, offload_activations, keep_activations
        )
        check_options(window, keep_activations, activation_offload)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = check_device(device)
        pinned = pinned_set(pin, pin_layers, len(chunks))
        self._nvme = check_ramtorch_options(
            len(chunks),
            pinned,
            nvme=nvme,
            nvme_layers=nvme_layers,
            nvme_path=nvme_path,
            grad_accum=grad_accum,
            acc_slots=acc_slots,
            act_slots=act_slots,
        )
        self._nvme_path = check_disk(chunks, self._nvme - pinned, nvme, nvme_layers, nvme_path)
        self._nvme_args = (nvme, nvme_layers)
        self.grad_accum, self.acc_slots, self.act_slots = grad_accum, acc_slots or window, act_slots
        self.offload_activations = activation_offload
        self.chunks = torch.nn.ModuleList(chunks)
        self.window = window
        self.keep_activations = keep_activations
        self.copier = make_copier(self.device)
        self.grads = GradWriteback(self.device)
        self._hooks = Hooks()
        if keep_activations is not True:
            self._hooks.recompute = Recompute(chunks, range(len(chunks)))
        if activation_offload:
            self._hooks.activations = ActivationOffloader(chunks, self.device).attach()
            self._hooks.activations.set_paged(range(len(chunks)))
        self._finalizer = weakref.finalize(self, self._hooks.release)
        self._in_step = False
        self._casts = None
        self._build(pinned)
        _trace_register(self, _trace_modules)

    @property
    def streamer(self):
        """The WeightStreamer (None once closed)."""
        return self._hooks.streamer

    # ---- building ------------------------------------------------------------------------------
    def _build(self, pinned: set[int], engine=None) -> None:
        """The streamer over the unpinned chunks. With `engine` (the host optimizer's), a chunk's
        trained parameters in it are the engine's streamed buckets (their slabs, and a load waits
        for their update: Block.ready) and their gradients go to the engine; the others' go
        home through GradWriteback."""
        self.pinned = sorted(pinned)
        grads = {id(p): p.grad for p in self.parameters()}
        owned = streamed_blocks(engine)
        if engine is not None and engine.copier is not None:
            self.copier = engine.copier  # one copy stream for every slab of the streamer
        elif engine is not None:
            engine.copier = self.copier
        wait = engine._weak_wait if engine is not None else None
        blocks, disk = [], open_disk(self, pinned)  # (the store first: a full disk moves nothing)
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
                    trained = owned.get(i, [])
                    skip = {id(s.param) for b in trained for s in b.slots}
                    slabs = [b.slab for b in trained] + (disk.get(i) or frozen_slabs(c, skip, self.copier))
                    ready = [lambda b=b: wait(b) for b in trained]
                    blocks.append(Block(i, c, slabs, ready))
            for p in self.parameters():
                g = grads[id(p)]
                p.grad = None if g is None else g.to(p.device)
        self._hooks.streamer = WeightStreamer(blocks, copier=self.copier, ahead=self.window - 1)
        self._streamed = [p for b in blocks for s in b.slabs for p in s.params if p.requires_grad]
        self._casts = CastSaver(self._streamed)
        taken = {id(s.param) for s in engine.slots} if engine is not None else set()
        self._written_back = [p for p in self._streamed if id(p) not in taken]  # GradWriteback's
        self.grads.forget(taken)  # their pinned buffers of earlier steps go back to the arena
        self.grads.chunk_of = {id(p): b.index for b in blocks for s in b.slabs for p in s.params}
        hook = weak_grad_hook(self)
        self._hooks.grad_hooks = [p.register_post_accumulate_grad_hook(hook) for p in self._written_back]

    def _teardown(self) -> None:
        streamer, on_disk = self._hooks.streamer, disk_slabs(self)
        self._hooks.release_streamer()
        release_disk(self._hooks, on_disk)  # disk chunks' weights back in RAM (the next _build)
        if streamer is not None:
            with torch.no_grad():
                for b in streamer.blocks:
                    for s in b.slabs:
                        for p in s.params:
                            p.data = p.data.clone()  # off the slab's home buffer

    def optimizer(
        self,
        params=None,
        *,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **options,
    ):
        """ramstream's host optimizer for this model: AdamW on the host whose update of each
        streamed chunk runs (on the engine's native threads) as soon as the chunk's gradients
        have landed in pinned memory, while the backward of the chunks before it continues; the
        next forward's load of a chunk waits for its update. Returns an OffloadAdamW subclass
        (param groups, LR schedulers, torch-format state_dict()/load_state_dict(), zero_grad()).

        Args:
            params: None (every parameter of the model; frozen ones get no state) or parameters /
                param-group dicts of this model, as torch.optim.AdamW takes them.
            lr, betas, eps, weight_decay: as torch.optim.AdamW (a group may set its own).
            moment_dtype: "float32" (default: fp32 results bit-identical to
                torch.optim.AdamW(fused=True) on the host copies) or "bfloat16" (stochastic
                rounding; 20 instead of 28 bytes of host traffic per parameter: faster).
            accumulation_steps: model.step() calls summed (on the host, in fp32) per opt.step();
                a further model.step() before opt.step() raises RuntimeError.
            max_grad_norm: clip by the global norm as torch.nn.utils.clip_grad_norm_ (None: off);
                the updates then wait for opt.step() (the norm needs every gradient) and overlap
                only the next forward. torch.nn.utils.clip_grad_norm_(model.parameters(), n)
                between model.step() and opt.step() needs max_grad_norm or eager_updates=False.
            skip_nonfinite: a step whose global norm (max_grad_norm, clip_grad_norm_) is NaN or
                Inf applies no update either way; False (default) raises
                ramstream.NonFiniteGradientError, True skips with a RuntimeWarning.
            eager_updates: True (default): the updates of the last micro-batch's model.step()
                (with accumulation_steps=1: every model.step()) run during its backward, and
                opt.step() only closes the step; False: they run at opt.step() (queued in forward
                order; the next forward waits for each chunk's), so a backward that raises
                leaves weights and optimizer state exactly as before it.
            delayed_update: False (default), True (40 undelayed warm-up steps) or an integer >= 0
                of warm-up steps: ZeRO-Offload's one-step delayed parameter update (opt.step()
                returns before the host AdamW ran; the next model.step() reads the weights before
                it; the next opt.step() installs it). Changes the numbers: see
                docs/guide/delayed_update.md.
            threads: host threads of the update (None: RAMSTREAM_NUM_THREADS or all cores).
            bucket_bytes: gradients land and are updated in buckets of about this size (a bucket
                never spans two chunks).

        Semantics: after `model.step(x, y); opt.step()` the weights equal torch.optim.AdamW's
        over the same gradients (fp32: bit for bit). The gradients of the optimizer's parameters
        go to its buffers, never to `.grad`. Hyper-parameters are read when the updates are
        queued: with eager updates, in the backward of the step's last model.step(), so change
        them (or step an LR scheduler) after opt.step(), as a torch loop does. A model.step()
        that raises before its backward changes nothing; one that raises inside it drops the
        gradients gathered since the last opt.step() (RuntimeWarning when there were earlier
        micro-batches), and with eager updates the chunks whose update already ran keep it
        (RuntimeWarning with their count). Pinned chunks' parameters are updated on the host
        too (fp32 master there, new weights copied back to the device before their forward).
        Call set_pinned() before this; opt.close() (or model.close()) detaches it."""
        self._check_open()
        if self._hooks.host_opt is not None:
            raise ValueError(
                "OffloadModel.optimizer: this model already has a host optimizer; close it first (opt.close())"
            )
        from .optim import build

        return build(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options)

    def _release_host_optimizer(self) -> None:
        """opt.close(): the engine waits and unhooks; the model streams with its own slabs again."""
        self._hooks.release_host_opt()
        self._teardown()
        self._build(set(self.pinned))

    @property
    def stats(self) -> dict:
        """The streamer's counters (loads, bytes_h2d, evictions, peak_loaded_bytes, ...), the
        gradient write-back's (bytes_d2h, the host optimizer's included), casts_dropped
        (autocast's weight casts the kept graph did not hold: cast again in backward) and, with
        activation_offload=True, activation_bytes_paged (the last forward's saved tensors sent
        to host memory) and activation_host_bytes (the host buffers held); RamTorch's keys too
        (docs/compat.md): nvme_loads, acquire_wait_s, acc_loads, acc_evictions, act_offloads,
        act_reloads, act_bytes_offloaded, retiers."""
        opt = self._hooks.host_opt
        act = self._hooks.activations.stats() if self._hooks.activations is not None else {}
        return {
            **self.streamer.stats,
            **self._ramtorch_stats(self.streamer.stats, act),
            "bytes_d2h": self.grads.stats["bytes_d2h"] + (opt._engine.stats["bytes_d2h"] if opt else 0),
            "casts_dropped": self._casts.stats["casts_dropped"],
            "activation_bytes_paged": act.get("bytes_paged_last_pass", 0),
            "activation_host_bytes": act.get("host_bytes_held", 0),
        }

    def _apply(self, fn, recurse=True):
        raise TypeError(
            "OffloadModel: .to()/.cuda()/.half() are not supported: convert the chunks before OffloadModel()"
        )

    # ---- gradients -----------------------------------------------------------------------------
    def _grad_landed(self, p) -> None:
        """A streamed parameter's gradient of this backward: on its way home."""
        if not self._in_step:
            return  # a backward the user runs: torch accumulates into .grad itself
        g = p.grad
        p.grad = None
        self.grads.land(p, g)

    # ---- running -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._hooks.streamer is None:
            raise ModelClosedError("OffloadModel: the model is closed")

    def _run(self, x):
        for c in self.chunks:
            x = c(*x) if isinstance(x, tuple) else c(x)
        return x

    def forward(self, x):
        self._check_open()
        x = to_device(x, self.device)
        try:
            return self._run(x)
        finally:
            if not self._in_step:
                # weights back home between calls (an optimizer step writes there); a backward
                # through this output reloads them
                self.streamer.evict_all()

    def step(self, x, targets=None, loss_fn=None, grad_outputs=None, profile_path=None) -> StepResult:
        """Forward and backward. x: a tensor or a tuple/list of the first chunk's arguments
        (tensors moved to the device, as targets). The loss is loss_fn(output, targets); without
        loss_fn, mean squared error against targets, or output.sum() (RamTorch's) without
        targets. With grad_outputs (a tensor, a tuple for a tuple output, or a callable given the
        output, or RamTorch's (output, targets)) the output's gradient is supplied instead and no
        loss is computed. Gradients add into each trained parameter's `.grad` (the first step
        after flush_grads() starts a new sum); a step that raises leaves them as they were.
        profile_path: write a Chrome/Perfetto trace of this step there (ramstream.trace; with the
        host optimizer, the step returns after the updates it started, so they are in the trace)."""
        self._check_open()
        if grad_outputs is not None and loss_fn is not None:
            raise ValueError("OffloadModel.step: give loss_fn or grad_outputs, not both")
        check_step_args(loss_fn, grad_outputs)
        x, targets = to_device(x, self.device), to_device(targets, self.device)
        if profile_path is None:
            return self._traced_step(x, targets, loss_fn, grad_outputs)
        if _trace_current() is not None:
            raise ValueError("OffloadModel.step: profile_path given inside an active ramstream.trace()")
        with Tracer(profile_path, device=self.device):
            res = self._traced_step(x, targets, loss_fn, grad_outputs)
            if self._hooks.host_opt is not None:  # the host updates it started belong to its trace
                self._hooks.host_opt._engine.updater.drain()
            return res

    def _traced_step(self, x, targets, loss_fn, grad_outputs) -> StepResult:
        tr = _trace_current()
        t0 = time.perf_counter()
        try:
            return self._step(x, targets, loss_fn, grad_outputs)
        finally:
            if tr is not None:
                tr.span("steps", "step", t0, time.perf_counter())

    def _step(self, x, targets, loss_fn, grad_outputs) -> StepResult:
        before, fresh = {}, self._flushed  # after flush_grads(): a new sum (RamTorch's reset)
        for p in self._written_back:
            before[id(p)] = p.grad
            p.grad = None
        mine = {id(p) for p in self._written_back}
        kept = {id(p): (p, p.grad) for p in self._grad_params() if id(p) not in mine} if fresh else {}
        for p, _ in kept.values():
            p.grad = None
        self._in_step = True
        ok = False
        casts = contextlib.nullcontext()
        if (
            self.keep_activations is True
            and self._hooks.activations is None  # (paging takes the casts with the rest)
            and torch.is_autocast_enabled(self.device.type)
        ):
            casts = self._casts.hooks()  # the kept graph holds no weight casts
        try:
            with torch.enable_grad():
                with casts:
                    out = self._run(x)
                if grad_outputs is not None:
                    g = (
                        call_grad_outputs(grad_outputs, out, targets)
                        if callable(grad_outputs)
                        else grad_outputs
                    )
                    outs = out if isinstance(out, tuple) else (out,)
                    gs = to_device(g if isinstance(g, tuple) else (g,), self.device)
                    if len(outs) != len(gs):
                        raise ValueError(
                            f"OffloadModel.step: grad_outputs has {len(gs)} tensors for {len(outs)} outputs"
                        )
                    pairs = [
                        (o, gr)
                        for o, gr in zip(outs, gs)
                        if gr is not None and torch.is_tensor(o) and o.requires_grad
                    ]
                    check_grad_outputs(pairs)
                    torch.autograd.backward([o for o, _ in pairs], [gr for _, gr in pairs])
                    res = StepResult(detach(out))
                else:
                    if loss_fn is not None:
                        loss = loss_fn(out, targets)
                    elif targets is None:
                        loss = sum_loss(out)
                    else:
                        check_default_targets(out, targets)
                        loss = F.mse_loss(out, targets)
                    loss.backward()
                    res = StepResult(detach(out), loss.detach())
            ok = True
            return res
        finally:
            self._in_step = False
            self.streamer.evict_all()
            self.copier.synchronize()
            if ok:
                self.grads.commit({} if fresh else before)
                self._flushed = False
            else:
                self.grads.discard()
                for p in self._written_back:
                    p.grad = before[id(p)]
                for p, g in kept.values():
                    p.grad = g
                act = self._hooks.activations
                if act is not None:  # the failed pass's paged tensors leave the pool now
                    act.release_abandoned()
                    act.after_failed_step(failed=True)
                if self._hooks.host_opt is not None:
                    _host_step_failed(self._hooks.host_opt)

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Removes the hooks; streamed parameters stay views of their home copies (CPU)."""
        if self._hooks.streamer is not None:
            self.grads.wait()
        self._hooks.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
