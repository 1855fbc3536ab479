"""Which loss a wrapped model trains with, learned where the loss runs: wrap() (runtime/apply.py
check_steps) registers the model's head weight(s) here with the model's step check, and the chunked
losses (loss.py chunked_cross_entropy, causal_lm_loss, and Hugging Face's compute_loss through them)
call seen() with the weight they were given. A head of a wrapped model then tells its step check
that the loss is chunked (runtime/tokens.py StepCheck.learn_loss), so that later steps are planned
without the dense logits. Weak: the registry holds no reference to the weight or the check (an id
with weak references, checked on use); nothing registered costs one dict lookup per loss call."""

from __future__ import annotations

import weakref

# id(head weight) -> (weakref to the weight, weakref to the StepCheck told of the loss)
_HEADS: dict[int, tuple] = {}


def register(weight, check) -> None:
    """`check.learn_loss("chunked")` is called when a chunked loss is given `weight`."""
    key = id(weight)

    def gone(_ref, key=key):
        entry = _HEADS.get(key)
        if entry is not None and entry[0]() is None:
            _HEADS.pop(key, None)

    _HEADS[key] = (weakref.ref(weight, gone), weakref.ref(check))


def seen(weight, loss: str = "chunked") -> None:
    """A loss of kind `loss` was computed with `weight` as its head."""
    if not _HEADS:
        return
    entry = _HEADS.get(id(weight))
    if entry is None or entry[0]() is not weight:
        return
    check = entry[1]()
    if check is None:
        _HEADS.pop(id(weight), None)
        return
    check.learn_loss(loss)
