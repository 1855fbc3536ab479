"""TrainStream 0.4.1's OffloadAdamW surface where ramstream's differs (docs/compat.md).

Arguments, translated where the optimizer takes them: eager= is eager_updates=, compute_grad_norm=True
is max_grad_norm=float("inf") (the norm taken and checked every step, nothing clipped); chunk_elems=
and pin_moments= are checked and have no effect (ramstream's buckets are bucket_bytes, and it pins
what the page-lock budget allows). Methods and attributes (TrainStreamMethods, a base of
OffloadAdamW): detach(), moment_dtype, device; stats() keys under TrainStream's names (stats_names).
"""

from __future__ import annotations

import torch


def translate(
    *, eager, compute_grad_norm, chunk_elems, pin_moments, eager_updates: bool, max_grad_norm
) -> tuple[bool, object]:
    """(eager_updates, max_grad_norm) after TrainStream's arguments; ValueError naming the argument
    for a bad value or a contradiction with ramstream's own."""
    where = "OffloadAdamW:"
    if eager is not None:
        if not isinstance(eager, bool):
            raise ValueError(
                f"{where} eager={eager!r}; accepted: None, True, False (TrainStream's eager_updates)"
            )
        if eager_updates is not True and eager_updates != eager:
            raise ValueError(
                f"{where} eager={eager!r} and eager_updates={eager_updates!r} disagree; pass one of them"
            )
        eager_updates = eager
    if not isinstance(compute_grad_norm, bool):
        raise ValueError(f"{where} compute_grad_norm={compute_grad_norm!r}; accepted: True, False")
    if compute_grad_norm and max_grad_norm is None:
        max_grad_norm = float("inf")  # the norm every step, without clipping
    if chunk_elems is not None and (
        isinstance(chunk_elems, bool) or not isinstance(chunk_elems, int) or chunk_elems < 1
    ):
        raise ValueError(
            f"{where} chunk_elems={chunk_elems!r}; accepted: None or an integer >= 1 (no effect)"
        )
    if pin_moments is not None and not isinstance(pin_moments, bool):
        raise ValueError(f"{where} pin_moments={pin_moments!r}; accepted: None, True, False (no effect)")
    return eager_updates, max_grad_norm


def stats_names(opt, s: dict) -> dict:
    """TrainStream's stats() keys over ramstream's figures `s` (the engine's stats): its
    grad_bytes_offloaded (= bytes_d2h), param_bytes_uploaded (= bytes_h2d), guard_waits (= waits),
    mode ("resident" after the switch), numel and params (trained elements and tensors),
    host_state_bytes (fp32 masters, moments and accumulation sums off the device: 0 once
    resident), moment_dtype ("float32"/"bfloat16"), update_ms_total (= host_update_s in ms)."""
    from .report import host_state_bytes

    e = opt._engine
    return dict(
        grad_bytes_offloaded=s["bytes_d2h"],
        param_bytes_uploaded=s["bytes_h2d"],
        guard_waits=s["waits"],
        mode="resident" if opt._resident is not None else opt.mode,
        numel=sum(x.numel for x in e.slots),
        params=len(e.slots),
        host_state_bytes=host_state_bytes(e),
        moment_dtype=str(e.moment_dtype).replace("torch.", ""),
        update_ms_total=s["host_update_s"] * 1e3,
    )


class TrainStreamMethods:
    """TrainStream's OffloadAdamW methods and attributes that ramstream has no name for (a base of
    ramstream.OffloadAdamW)."""

    def detach(self):
        """TrainStream's detach(): waits for pending updates and undoes attach(model) / wrap() on
        the model this optimizer is attached to, as ramstream.unwrap(model) does, and gives the
        model back plain on the optimizer's device with its trained weights (streamed weights,
        which unwrap leaves in host memory, are moved there). Returns that model, or None when
        the optimizer is attached to none (then it only waits, and keeps training as before).
        Differs from TrainStream: the optimizer is closed afterwards (unwrap closes it), where
        TrainStream's keeps training the parameters standalone; build a torch optimizer for the
        detached model, or attach a new OffloadAdamW. Idempotent. Main thread, no GIL release."""
        from .runtime.attach import unwrap

        ref = getattr(self, "_attached_model", None)
        model = ref() if ref is not None else None
        w = getattr(model, "_ramstream", None) if model is not None else None
        if w is None or w.optimizer is not self:
            if not self._closed:
                self.synchronize()
            return None
        device = self._engine.device
        unwrap(model)
        self._attached_model = None
        tensors = list(model.parameters()) + list(model.buffers())
        if any(t.device != device for t in tensors):
            model.to(device)
        return model

    @property
    def moment_dtype(self) -> str:
        """The moments' dtype as TrainStream names it: "float32" or "bfloat16"."""
        return str(self._moment_dtype).replace("torch.", "")

    @property
    def device(self) -> torch.device:
        """The compute device (the parameters' device; the CPU on the CPU engine)."""
        return self._engine.device
