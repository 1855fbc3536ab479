"""TrainStream 0.4.1's OffloadAdamW arguments that ramstream spells otherwise, translated where the
optimizer takes its arguments (docs/compat.md): eager= is eager_updates=, compute_grad_norm=True is
max_grad_norm=float("inf") (the norm taken and checked every step, nothing clipped); chunk_elems=
and pin_moments= are checked and have no effect (ramstream's buckets are bucket_bytes, and it pins
what the page-lock budget allows)."""

from __future__ import annotations


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
