"""CUDA-side updates of "mapped" buckets: the GPU runs AdamW on state in pinned host memory."""
from __future__ import annotations

import torch

from ..ops import _raw


def launch_mapped(engine, b, slots, hyper_of, grad_scale: float) -> None:
    """Queues the CUDA AdamW of mapped slots on the update stream (after the compute that
    produced their gradients); their gradients are released once it has run."""
    engine._throttle(sum(s.param.grad.nbytes for s in slots))
    stream = engine.dev.begin_update()
    for s in slots:
        g = s.param.grad
        h = hyper_of(s.group)
        off = s.offset
        if b.master is None:       # fp32 weights are their own master
            param, out = s.param.data_ptr(), 0
        else:
            param, out = b.master.data_ptr() + 4 * off, s.param.data_ptr()
        esz = b.exp_avg.element_size()
        _raw.cuda_adamw_ptr(param=param, grad=g.data_ptr(), grad_dtype=g.dtype,
                            exp_avg=b.exp_avg.data_ptr() + esz * off,
                            exp_avg_sq=b.exp_avg_sq.data_ptr() + esz * off,
                            moment_dtype=b.exp_avg.dtype, out=out, out_dtype=b.dtype, n=s.numel,
                            offset=b.state_offset + off, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                            eps=h.eps, weight_decay=h.weight_decay, step=s.step,
                            grad_scale=grad_scale, seed=engine.seed, stream=stream,
                            device=engine.device.index)
        g.record_stream(engine.dev.upd)
        s.param.grad = None
    engine.stats["gpu_updates"] += len(slots)
    b.h2d_event = engine.dev.end_update()
    engine._track(b.h2d_event, sum(s.numel for s in slots) * b.dtype.itemsize)
    engine._mark_pending(b)


def dev_norm_add(engine, g: torch.Tensor) -> None:
    """Adds the squared norm of a mapped slot's gradient to a device scalar (clipping)."""
    if engine._dev_norm is None:
        engine._dev_norm = torch.zeros(1, dtype=torch.float64, device=engine.device)
    stream = engine.dev.begin_update()
    _raw.cuda_sq_norm(x=g, out=engine._dev_norm, accumulate=True, stream=stream,
                      device=engine.device.index)
    engine.dev.end_update()
