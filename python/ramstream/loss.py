"""Cross-entropy of a linear head computed in row chunks: the [tokens, vocab] logits never exist.

Gradients are recomputed per chunk in backward rather than accumulated in forward. Both ways hold
the same memory while backward runs (dW in fp32, dh, one chunk of logits), but computing them in
forward would keep dW ([vocab, hidden] fp32) and dh alive from the loss's forward until its
backward, adding up when several losses are computed before one backward (or when backward never
comes); recomputing keeps nothing per row but the targets between the two. The price is one more
chunk matmul (and the softmax computed again from it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .ops import cross_entropy as _ce_kernels
from .runtime import heads as _heads

__all__ = ["chunked_cross_entropy", "causal_lm_loss"]

_REDUCTIONS = ("mean", "sum")


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except TypeError:  # pragma: no cover - torch < 2.4
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        if device_type == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
    return None


def _acc_dtype(cdtype: torch.dtype) -> torch.dtype:
    """The softmax, the log-sum-exp and the gradient accumulators: float64 for a float64 matmul,
    float32 otherwise."""
    return torch.float64 if cdtype == torch.float64 else torch.float32


_TWICE = (
    "chunked_cross_entropy: double backward is not supported: backward recomputes the "
    "logits chunk by chunk without a graph, so its gradients cannot be differentiated "
    "again (create_graph=True); use F.cross_entropy(F.linear(hidden, weight, bias), "
    "targets) for higher-order gradients"
)


def _no_double_backward(grads: tuple, inputs: tuple) -> tuple:
    """Backward's results under create_graph=True: differentiating any of them raises _TWICE.
    Without this they would be constants and a later backward would silently miss their
    contribution. The error node also takes the loss's inputs that require grad, so that
    autograd.grad(..., inputs) of them reaches it rather than finding no path."""
    idx = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    anchors = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return grads
    try:
        err = torch._C._functions.DelayedError(_TWICE.encode(), len(idx) + len(anchors))
    except (AttributeError, TypeError):  # pragma: no cover - the private API went away
        raise RuntimeError(_TWICE) from None
    outs = err(*[grads[i].detach().requires_grad_() for i in idx], *anchors)
    if isinstance(outs, torch.Tensor):
        outs = (outs,)
    grads = list(grads)
    for i, o in zip(idx, outs):
        grads[i] = o
    return tuple(grads)


def _chunks(n: int, chunk: int, cdtype: torch.dtype, fused: bool):
    """Row ranges. Without the fused kernels a 16-bit matmul dtype takes half the rows at once:
    its logits (2 bytes) and their float32 copy (4 bytes) coexist, so both ways peak near
    chunk * V * 4 bytes; the kernels work on the logits in place (chunk * V * 2 bytes)."""
    if not fused and torch.empty((), dtype=cdtype).element_size() < 4:
        chunk = max(1, chunk // 2)
    for s in range(0, n, chunk):
        yield s, min(n, s + chunk)


_MM_F32 = {"how": None}  # how this torch adds a 16-bit product into a float32 matrix (found once)


def _add_product(dw: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dw (float32) + a @ b for 16-bit a, b: on CUDA one GEMM accumulating in float32 into dw
    (torch's addmm with out_dtype, where this torch has it), else the product in a's dtype
    added in float32 (one more pass over dw and a rounding of each chunk's product)."""
    how = _MM_F32["how"]
    if a.device.type == "cuda" and how != "plain":
        try:
            if how in (None, "out"):
                torch.addmm(dw, a, b, out_dtype=torch.float32, out=dw)
                _MM_F32["how"] = "out"
                return dw
            return torch.addmm(dw, a, b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):
            if how == "out":
                raise  # it worked before: this failure is not about support
            _MM_F32["how"] = "new" if how is None else "plain"
            return _add_product(dw, a, b)
    dw += a @ b
    return dw


def _fused(hidden: torch.Tensor, cdtype: torch.dtype) -> bool:
    return _ce_kernels.usable(hidden.device, cdtype)


class _ChunkedCE(torch.autograd.Function):
    """hidden [N, d], weight [V, d], bias [V] or None, targets [N] int64 -> fp32 scalar.

    On CUDA (ramstream's kernels, ops/cross_entropy.py) a chunk's logits are read once in
    forward (each row's log-sum-exp and target logit, float32) and once in backward, where the
    gradient is written over them in their dtype (softmax times the scale, then the target's
    term, as torch's cross_entropy backward orders it); dW accumulates in float32 inside the
    GEMM. Elsewhere the [chunk, V] work is torch's log_softmax(dtype=) reading the logits in the
    matmul's dtype and writing float32 (fp64 for fp64), seven passes in backward. On the H200
    (Qwen2-1.5B head, 4096 tokens) the torch path took 31 ms per forward + backward against
    16.4 ms for Hugging Face's dense loss (bench/train/bench_loss.py)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, ignore_index, cdtype, denom):
        dev = hidden.device.type
        acc = _acc_dtype(cdtype)
        fused = _fused(hidden, cdtype)
        with torch.autocast(dev, enabled=False):
            w = weight.to(cdtype)
            b = bias.to(cdtype) if bias is not None else None
            valid = targets != ignore_index
            safe = torch.where(valid, targets, 0)
            total = torch.zeros((), dtype=acc, device=hidden.device)
            lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device) if fused else None
            for s, e in _chunks(hidden.shape[0], chunk, cdtype, fused):
                logits = F.linear(hidden[s:e].to(cdtype), w, b)
                if fused:
                    lse[s:e], tl = _ce_kernels.forward(logits, safe[s:e])
                    nll = lse[s:e] - tl
                else:
                    logp = F.log_softmax(logits, 1, dtype=acc)
                    nll = logp.gather(1, safe[s:e, None]).squeeze(1).neg_()
                    del logp
                del logits
                total += torch.where(valid[s:e], nll, 0.0).sum()
            if denom is None:  # reduction="mean": over the rows not ignored
                denom = valid.sum().to(acc)
            elif torch.is_tensor(denom):
                denom = denom.to(acc)
            loss = total / denom
        ctx.save_for_backward(
            hidden, weight, bias, safe, valid, denom if torch.is_tensor(denom) else None, lse
        )
        ctx.denom = None if torch.is_tensor(denom) else denom
        ctx.chunk, ctx.cdtype, ctx.fused = chunk, cdtype, fused
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if not torch.is_grad_enabled():
            return _ChunkedCE._grads(ctx, grad_out)
        with torch.no_grad():  # create_graph=True
            grads = _ChunkedCE._grads(ctx, grad_out)
        return _no_double_backward(grads, ctx.saved_tensors[:3])

    @staticmethod
    def _grads(ctx, grad_out):
        hidden, weight, bias, safe, valid, denom_t, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdtype, chunk = ctx.cdtype, ctx.chunk
        # a bias gradient summed from the kernel's 16-bit gradient would lose its float32 sums:
        # with a trained bias the chunk takes torch's path (HF causal LMs have no head bias)
        fused = ctx.fused and not need_b
        acc = _acc_dtype(cdtype)
        denom = denom_t if denom_t is not None else ctx.denom
        dh = dw = db = None
        with torch.autocast(hidden.device.type, enabled=False):
            scale = (grad_out.to(acc) / denom).reshape(())
            row_scale = torch.where(valid, scale, torch.zeros((), dtype=acc, device=hidden.device))
            w = weight.to(cdtype)
            b = bias.to(cdtype) if bias is not None else None
            if need_h:
                dh = torch.empty_like(hidden)
            if need_w:
                dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
            if need_b:
                db = torch.zeros(bias.shape, dtype=acc, device=bias.device)
            for s, e in _chunks(hidden.shape[0], chunk, cdtype, fused):
                h = hidden[s:e].to(cdtype)
                if fused:  # the gradient written over the recomputed logits, in cdtype
                    g = _ce_kernels.backward_(F.linear(h, w, b), safe[s:e], lse[s:e], row_scale[s:e].float())
                else:
                    # d loss / d logits in torch's cross_entropy order: exp(log_softmax) * scale,
                    # then - scale at the target (rows ignored: scale 0); float32, then one cast
                    p = F.log_softmax(F.linear(h, w, b), 1, dtype=acc).exp_()
                    rs = row_scale[s:e, None]
                    p.mul_(rs)
                    p.scatter_add_(1, safe[s:e, None], rs.neg())
                    if need_b:
                        db += p.sum(0)
                    g = p if cdtype == acc else p.to(cdtype)
                    del p
                if need_h:
                    if dh.dtype == cdtype:
                        torch.mm(g, w, out=dh[s:e])
                    else:
                        dh[s:e].copy_(g @ w)
                if need_w:
                    if cdtype == acc:
                        dw.addmm_(g.t(), h)
                    else:
                        dw = _add_product(dw, g.t(), h)  # fp32 sums of the 16-bit products
                del g
        if dw is not None:
            dw = dw.to(weight.dtype)
        if db is not None:
            db = db.to(bias.dtype)
        return dh, dw, db, None, None, None, None, None


def _check(
    where: str, hidden, weight, targets, bias, chunk_size, ignore_index, reduction, num_items, tname="targets"
):
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"{where}: hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if not hidden.is_floating_point():
        raise TypeError(f"{where}: hidden must be a floating-point tensor, got {hidden.dtype}")
    if hidden.dim() < 2:
        raise ValueError(
            f"{where}: hidden must have shape [..., hidden_size] with at least 2 "
            f"dims, got {tuple(hidden.shape)}"
        )
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{where}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point():
        raise TypeError(f"{where}: weight must be a floating-point tensor, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{where}: weight must have shape [vocab, {hidden.shape[-1]}] (hidden's "
            f"last dim), got {tuple(weight.shape)}"
        )
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"{where}: {tname} must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"{where}: {tname} must be an integer tensor, got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{where}: {tname} must have shape {tuple(hidden.shape[:-1])} (hidden's "
            f"leading dims), got {tuple(targets.shape)}"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{where}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"{where}: bias must have shape ({weight.shape[0]},) (weight's "
                f"vocab), got {tuple(bias.shape)}"
            )
    for name, t in (("weight", weight), (tname, targets), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{where}: {name} is on {t.device} but hidden is on {hidden.device}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{where}: chunk_size must be an int >= 1, got {chunk_size!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"{where}: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in _REDUCTIONS or not isinstance(reduction, str):
        raise ValueError(
            f"{where}: reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, got {reduction!r}"
        )
    if num_items is None:
        return
    if reduction != "mean":
        raise ValueError(
            f"{where}: num_items divides the summed loss (Hugging Face's "
            f"num_items_in_batch) and needs reduction='mean', got {reduction!r}"
        )
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.dtype == torch.bool or num_items.is_complex():
            raise ValueError(
                f"{where}: num_items must be a number > 0 or a one-element real "
                f"tensor, got a {num_items.dtype} tensor of shape "
                f"{tuple(num_items.shape)}"
            )
    elif (
        isinstance(num_items, bool)
        or not isinstance(num_items, (int, float))
        or not math.isfinite(num_items)
        or num_items <= 0
    ):
        raise ValueError(
            f"{where}: num_items must be a number > 0 or a one-element real tensor, got {num_items!r}"
        )


def _check_range(where: str, tname: str, targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """ValueError when a target other than ignore_index is outside [0, vocab) (checked after the
    loss failed: no pass over the targets on the way that works)."""
    bad = targets[(targets != ignore_index) & ((targets < 0) | (targets >= vocab))]
    if bad.numel():
        raise ValueError(
            f"{where}: {tname} must be class indices in [0, {vocab}) (weight's vocab) or ignore_index="
            f"{ignore_index}, got {bad.numel()} outside, e.g. {int(bad[0])}"
        )


def _run(hidden, weight, targets, bias, chunk_size, ignore_index, reduction, num_items, where, tname):
    _heads.seen(weight)  # the head of a wrapped model: its step check plans with this loss from now on
    d = hidden.shape[-1]
    h2 = hidden.reshape(-1, d)
    t1 = targets.reshape(-1).long()
    ac = _autocast_dtype(hidden.device.type)
    if ac is not None and hidden.dtype in (torch.float32, torch.float16, torch.bfloat16):
        cdtype = ac
    else:
        cdtype = torch.promote_types(hidden.dtype, weight.dtype)
    if num_items is not None:
        denom = (
            num_items.reshape(()).to(hidden.device)
            if isinstance(num_items, torch.Tensor)
            else float(num_items)
        )
    elif reduction == "sum":
        denom = 1.0
    else:
        denom = None
    try:
        return _ChunkedCE.apply(h2, weight, bias, t1, chunk_size, ignore_index, cdtype, denom)
    except (RuntimeError, IndexError):
        if t1.device.type == "cpu":  # a raw gather error: say which argument is wrong
            _check_range(where, tname, t1, weight.shape[0], ignore_index)
        raise


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items=None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), targets)`` without the full logits.

    Args:
        hidden: [..., d] floating-point activations (any device).
        weight: [V, d] the output projection (e.g. the LM head's weight, tied or not).
        targets: integer class indices of shape hidden.shape[:-1], in [0, V) or ``ignore_index``.
        bias: optional [V].
        chunk_size: rows of logits computed at once (half as many with a 16-bit matmul dtype);
            peak extra memory about chunk_size * V * 4 bytes, plus a float32 [V, d] gradient
            accumulator in backward (and a [V, d] product per chunk in a 16-bit dtype).
        ignore_index: targets equal to it contribute nothing and are not counted by "mean".
        reduction: "mean" (over the targets not ignored) or "sum".
        num_items: Hugging Face's ``num_items_in_batch``: the summed loss divided by this number
            (an int/float > 0 or a one-element tensor) instead of by the count; needs "mean".

    Returns a float32 scalar (float64 when the matmul dtype is float64). Logits are computed one
    chunk at a time with the matmul in the autocast dtype when torch.autocast is on (like
    F.linear), otherwise in the inputs' promoted dtype, then upcast to float32 (float64 inputs:
    float64 throughout) for the softmax. Backward recomputes each chunk's logits and accumulates
    the weight (and bias) gradient in float32 before casting it to the parameter's dtype. Backward
    cannot be differentiated again: differentiating the gradients of a ``create_graph=True``
    backward raises RuntimeError. Raises ValueError naming the argument for bad shapes, devices,
    chunk_size, reduction, ignore_index or num_items; TypeError for non-tensor or wrong-dtype
    inputs.
    """
    _check(
        "chunked_cross_entropy", hidden, weight, targets, bias, chunk_size, ignore_index, reduction, num_items
    )
    return _run(
        hidden,
        weight,
        targets,
        bias,
        chunk_size,
        ignore_index,
        reduction,
        num_items,
        "chunked_cross_entropy",
        "targets",
    )


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items=None,
) -> torch.Tensor:
    """Causal-LM loss as Hugging Face computes it, without the full logits: position t of
    ``hidden`` ([..., T, d]) predicts ``labels[..., t + 1]`` ([..., T]); the last position of each
    sequence predicts nothing (its label is ``ignore_index``). Arguments and result as
    chunked_cross_entropy; ``num_items`` is HF's ``num_items_in_batch``."""
    _check(
        "causal_lm_loss",
        hidden,
        weight,
        labels,
        bias,
        chunk_size,
        ignore_index,
        reduction,
        num_items,
        "labels",
    )
    shifted = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    return _run(
        hidden,
        weight,
        shifted,
        bias,
        chunk_size,
        ignore_index,
        reduction,
        num_items,
        "causal_lm_loss",
        "labels",
    )
