"""RamTorch 1.11's OffloadModel surface on ramstream's machinery: its extra constructor options
checked and mapped (nvme*, grad_accum, acc_slots, offload_activations, act_slots), the step's
input and loss conventions, and its methods and properties (tier changes returning a summary,
flush_grads(scale), zero_grad_acc, invalidate_residency, *_layers, stats keys) as a mixin."""

from __future__ import annotations

import inspect
import numbers
import operator
import os
import warnings

import torch

from .checks import detach, pinned_set
from .disk import disk_chunks, disk_stats, paged_disk

GRAD_ACCUM = ("stream", "cpu")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def chunk_indices(chunks, n: int, where: str) -> frozenset:
    """An int or an iterable of chunk indices (RamTorch's convention: duplicates are one index):
    TypeError for a bool or a non-integer, ValueError for one outside [0, n)."""
    if isinstance(chunks, bool):
        raise TypeError(f"{where} must be a chunk index or an iterable of them, got a bool")
    if isinstance(chunks, (str, bytes)) or not (_is_int(chunks) or hasattr(chunks, "__iter__")):
        raise TypeError(f"{where} must be a chunk index or an iterable of them, got {type(chunks).__name__}")
    items = [chunks] if _is_int(chunks) else list(chunks)
    idx = set()
    for i in items:
        if isinstance(i, bool):
            raise TypeError(f"{where}: chunk indices must be ints, not bool")
        try:
            idx.add(operator.index(i))
        except TypeError:
            raise TypeError(f"{where}: chunk indices must be ints, got {type(i).__name__}") from None
    bad = sorted(i for i in idx if not 0 <= i < n)
    if bad:
        raise ValueError(f"{where}: chunk indices must be in [0, {n}), got {bad}")
    return frozenset(idx)


def check_ramtorch_options(n, pinned, *, nvme, nvme_layers, nvme_path, grad_accum, acc_slots, act_slots):
    """RamTorch's options that ramstream takes with their meaning (grad_accum, acc_slots and
    act_slots change nothing here: see docs/compat.md). Returns the chunks asked for on disk
    (nvme > 0 or nvme_layers, RamTorch's placement: disk.py); the pinned ones stay on the device."""
    if not _is_int(nvme) or nvme < 0:
        raise ValueError(f"OffloadModel: nvme must be an int >= 0 (chunks on disk), got {nvme!r}")
    if nvme_path is not None and not isinstance(nvme_path, (str, os.PathLike)):
        raise TypeError(f"OffloadModel: nvme_path must be None or a path, got {type(nvme_path).__name__}")
    idx = chunk_indices(nvme_layers, n, "OffloadModel: nvme_layers") if nvme_layers is not None else ()
    disk = disk_chunks(n, (), nvme, nvme_layers, idx)
    if grad_accum not in GRAD_ACCUM:
        raise ValueError(f"OffloadModel: grad_accum must be 'stream' or 'cpu', got {grad_accum!r}")
    if acc_slots is not None and (not _is_int(acc_slots) or acc_slots < 1):
        raise ValueError(f"OffloadModel: acc_slots must be None or an int >= 1, got {acc_slots!r}")
    if not _is_int(act_slots) or act_slots < 1:
        raise ValueError(f"OffloadModel: act_slots must be an int >= 1, got {act_slots!r}")
    return disk


def resolve_activation_offload(activation_offload, offload_activations, keep_activations) -> bool:
    """activation_offload (ramstream's name) or offload_activations (RamTorch's): the same
    option; both given and different is a ValueError. RamTorch's name with
    keep_activations="checkpoint" (where each chunk keeps only its input) warns and pages nothing."""
    for name, v in (("activation_offload", activation_offload), ("offload_activations", offload_activations)):
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"OffloadModel: {name} must be True or False, got {v!r}")
    if activation_offload is not None and offload_activations is not None:
        if activation_offload != offload_activations:
            raise ValueError(
                "OffloadModel: activation_offload and offload_activations (RamTorch's name for it) "
                f"differ ({activation_offload!r} and {offload_activations!r}); give one of them"
            )
    if activation_offload is not None or not offload_activations:
        return bool(activation_offload)
    if keep_activations is False:
        raise ValueError(
            "OffloadModel: offload_activations=True (ramstream's activation_offload) needs "
            "keep_activations=True or 'checkpoint', got keep_activations=False"
        )
    if isinstance(keep_activations, str):
        warnings.warn(
            "OffloadModel: offload_activations=True with keep_activations='checkpoint': ramstream keeps "
            "each chunk's input on the device and pages nothing (use keep_activations=True to page "
            "the kept graph's activations)",
            UserWarning,
            stacklevel=3,
        )
        return False
    return True


def to_device(x, device):
    """RamTorch's input convention: a tensor, or a tuple or list of the first chunk's positional
    arguments (a tuple then), tensors moved to the model's device."""
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return tuple(v.to(device) if torch.is_tensor(v) else v for v in x)
    return x


def call_grad_outputs(fn, out, targets):
    """A callable grad_outputs: RamTorch's fn(output, targets) (given the detached output, under
    no_grad) when it takes two arguments, ramstream's fn(output) otherwise."""
    try:
        inspect.signature(fn).bind(out, targets)
    except (TypeError, ValueError):
        return fn(out)
    with torch.no_grad():
        return fn(detach(out), targets)


def sum_loss(out):
    """The default loss without targets: output.sum() (RamTorch's)."""
    if not torch.is_tensor(out):
        raise ValueError(
            "OffloadModel.step: the default loss without targets (output.sum(), RamTorch's) needs one "
            f"tensor output, the model returned {type(out).__name__}; pass loss_fn="
        )
    return out.sum()


def _optimizers(optimizers) -> list:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    try:
        opts = list(optimizers)
    except TypeError:
        raise TypeError(
            f"OffloadModel: optimizers must be an optimizer or an iterable of them, got {type(optimizers).__name__}"
        ) from None
    bad = [type(o).__name__ for o in opts if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise TypeError(f"OffloadModel: optimizers must be torch.optim.Optimizers, got {bad}")
    return opts


def follow_params(optimizers, params) -> None:
    """Each optimizer's per-parameter state tensors go where their parameter now lives (a 0-dim
    CPU `step` stays on the host unless the group is fused or capturable, as torch keeps it)."""
    for opt in optimizers:
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for p in params:
            st = opt.state.get(p)
            if not st:
                continue
            g = group_of.get(id(p), {})
            on_device = bool(g.get("fused") or g.get("capturable"))
            for key, val in list(st.items()):
                if not torch.is_tensor(val) or val.device == p.device:
                    continue
                if key == "step" and val.ndim == 0 and val.device.type == "cpu" and not on_device:
                    continue
                st[key] = val.to(p.device)


class RamTorchSurface:
    """OffloadModel's RamTorch-named methods and properties (mixed into OffloadModel)."""

    _retiers = 0  # tier changes that moved a chunk (stats["retiers"])
    _flushed = False  # flush_grads() ran and no step() since: the next step starts a new sum

    @property
    def n(self) -> int:
        """The number of chunks."""
        return len(self.chunks)

    @property
    def pinned_layers(self) -> frozenset:
        """The resident chunks' indices (ramstream's `pinned`, as a frozenset)."""
        return frozenset(self.pinned)

    @property
    def streamed_layers(self) -> frozenset:
        """The streamed (offloaded) chunks' indices: every chunk not pinned."""
        return frozenset(range(len(self.chunks))) - frozenset(self.pinned)

    @property
    def nvme_layers(self) -> frozenset:
        """The chunks whose weights live on disk (nvme / nvme_layers minus the pinned chunks)."""
        return frozenset(self._nvme) - frozenset(self.pinned)

    def state_dict(self, *args, **kwargs):
        """torch's state_dict; a disk chunk's weights are read from disk (host copies: its
        parameters are empty stand-ins at rest)."""
        with paged_disk(self) as copies:
            sd = super().state_dict(*args, **kwargs)
            if copies:  # (a parameter's detached alias follows it back to its stand-in)
                for k, v in sd.items():
                    if torch.is_tensor(v) and v.numel() and v.untyped_storage().data_ptr() in copies:
                        sd[k] = v.detach().clone()
            return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's load_state_dict; a disk chunk's weights are written to its record on disk
        (assign=True is refused with disk chunks)."""
        if assign and self.nvme_layers:
            raise ValueError("OffloadModel.load_state_dict: assign=True is not supported with chunks on disk")
        with paged_disk(self, write_back=True):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # ---- tiers ---------------------------------------------------------------------------------
    def set_pinned(self, pinned, *, optimizers=(), force: bool = False) -> dict:
        """Makes exactly the chunks `pinned` resident (an int: that many evenly spaced, as `pin`;
        an iterable: those indices, as `pin_layers`); the others stream. Weights, `.grad` and
        partial sums move with their parameters (nothing is discarded); the state of
        `optimizers` (torch optimizers) follows the moved parameters. Returns RamTorch's summary
        {"pinned": newly pinned, "unpinned": newly streamed, "bytes_moved": their parameters'
        bytes, "grads_discarded": False}. `force` is accepted (a failed step leaves nothing to
        recover from). With the host optimizer (model.optimizer()) attached: ValueError."""
        if isinstance(pinned, bool):
            raise TypeError("OffloadModel.set_pinned: pinned must be a count or an iterable of chunk indices")
        n = len(self.chunks)
        want = pinned_set(pinned, None, n) if _is_int(pinned) else pinned_set(0, pinned, n)
        return self._retier(set(want), optimizers, "set_pinned")

    def pin_chunks(self, chunks, *, optimizers=(), force: bool = False) -> dict:
        """Pins these chunks too (already pinned ones are ignored); as set_pinned."""
        idx = chunk_indices(chunks, len(self.chunks), "OffloadModel.pin_chunks: chunks")
        return self._retier(set(self.pinned) | idx, optimizers, "pin_chunks")

    def unpin_chunks(self, chunks, *, optimizers=(), force: bool = False) -> dict:
        """Streams these chunks (already streamed ones are ignored); as set_pinned."""
        idx = chunk_indices(chunks, len(self.chunks), "OffloadModel.unpin_chunks: chunks")
        return self._retier(set(self.pinned) - idx, optimizers, "unpin_chunks")

    def _retier(self, want: set, optimizers, name: str) -> dict:
        self._check_open()
        opts = _optimizers(optimizers)
        if self._in_step:
            raise RuntimeError(f"OffloadModel.{name}: called inside step(); call it between steps")
        if self._hooks.host_opt is not None:
            raise ValueError(
                f"OffloadModel.{name}: the host optimizer (model.optimizer()) keeps its buckets "
                f"where the chunks live; call {name} before model.optimizer(), or opt.close() first"
            )
        now = set(self.pinned)
        to_pin, to_unpin = sorted(want - now), sorted(now - want)
        moved = [p for i in to_pin + to_unpin for p in self.chunks[i].parameters()]
        summary = {
            "pinned": to_pin,
            "unpinned": to_unpin,
            "bytes_moved": sum(p.nbytes for p in moved),
            "grads_discarded": False,
        }
        if not to_pin and not to_unpin:
            return summary
        self._teardown()
        self._build(want)
        follow_params(opts, moved)
        self._retiers += 1
        return summary

    # ---- gradients -----------------------------------------------------------------------------
    def _grad_params(self) -> list:
        """The trained parameters whose gradients step() leaves in `.grad` (the host optimizer's
        take theirs into its buffers)."""
        opt = self._hooks.host_opt
        taken = {id(s.param) for s in opt._engine.slots} if opt is not None else set()
        return [p for p in self.parameters() if p.requires_grad and id(p) not in taken]

    def flush_grads(self, scale=1.0) -> None:
        """RamTorch's "accumulators -> .grad": every step() since the last flush has added its
        gradients into `.grad` (the sum); this waits for pending copies, multiplies that sum by
        `scale` (k accumulated steps: scale=1/k for the mean) and marks it flushed, so the next
        step() starts a new sum instead of adding to it (opt.zero_grad() is then optional, as in
        RamTorch). A second flush with no step() between changes nothing. With the host
        optimizer (model.optimizer(): its gradients are not in `.grad`) scale must be 1."""
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(
                f"OffloadModel.flush_grads: scale must be a real number, got {type(scale).__name__}"
            )
        self.copier.synchronize()
        self.grads.wait()
        if scale != 1 and self._hooks.host_opt is not None:
            raise ValueError(
                "OffloadModel.flush_grads: scale must be 1.0 with the host optimizer (model.optimizer() "
                "takes the gradients itself, summing accumulation_steps micro-batches); scale the loss instead"
            )
        if scale != 1 and not self._flushed:
            with torch.no_grad():
                for p in self._grad_params():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        self._flushed = True
        self.invalidate_residency()

    def zero_grad_acc(self) -> None:
        """Drops the gradients summed since the last flush_grads() (RamTorch's accumulators): the
        `.grad` of trained parameters when a step() ran since (a flushed `.grad` stays for the
        optimizer), and the host optimizer's gathered gradients (its zero_grad())."""
        opt = self._hooks.host_opt
        if opt is not None:
            opt.zero_grad()
        if not self._flushed:
            for p in self._grad_params():
                p.grad = None
        self._flushed = True

    def invalidate_residency(self) -> None:
        """Every streamed chunk's device copy dropped, so the next use loads the home weights.
        ramstream already does this after every forward and step (an optimizer writes the home
        copies), so this only waits for pending copies."""
        if self._hooks.streamer is not None:
            self.streamer.evict_all()
        self.copier.synchronize()

    def _ramtorch_stats(self, streamer: dict, act: dict) -> dict:
        """RamTorch's stats keys from ramstream's counters (0 for what ramstream does not do)."""
        return {
            **disk_stats(self._hooks.disk),
            "acquire_wait_s": streamer["stream_wait_s"],
            "acc_loads": 0,
            "acc_evictions": 0,
            "act_offloads": act.get("copies_d2h", 0),
            "act_reloads": act.get("copies_h2d", 0),
            "act_bytes_offloaded": act.get("bytes_d2h", 0),
            "retiers": self._retiers,
        }
