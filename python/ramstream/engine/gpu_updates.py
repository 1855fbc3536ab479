"""CUDA-side updates of "mapped" buckets: the GPU runs AdamW on state in pinned host memory."""
from __future__ import annotations

import torch

from .._native import lib
from .host_jobs import dtype_code


def launch_mapped(engine, b, slots, hyper_of, grad_scale: float) -> None:
    """Queues the CUDA AdamW of mapped slots on the update stream (after the compute that
    produced their gradients); their gradients are released once it has run."""
    C = lib()
    engine._throttle(sum(s.param.grad.nbytes for s in slots))
    stream = engine.dev.begin_update()
    mcode = dtype_code(b.exp_avg.dtype)
    for s in slots:
        g = s.param.grad
        h = hyper_of(s.group)
        off = s.offset
        if b.master is None:       # fp32 weights are their own master
            param, out, ocode = s.param.data_ptr(), 0, 0
        else:
            param = b.master.data_ptr() + 4 * off
            out, ocode = s.param.data_ptr(), dtype_code(b.dtype)
        esz = b.exp_avg.element_size()
        C.cuda_adamw_ptr(param, g.data_ptr(), dtype_code(g.dtype),
                         b.exp_avg.data_ptr() + esz * off, b.exp_avg_sq.data_ptr() + esz * off,
                         mcode, out, ocode, s.numel, b.state_offset + off, h.lr, h.beta1,
                         h.beta2, h.eps, h.weight_decay, s.step, grad_scale, engine.seed,
                         stream, engine.device.index)
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
    lib().cuda_sq_norm(g.detach(), engine._dev_norm, accumulate=True, stream=stream,
                       device=engine.device.index)
    engine.dev.end_update()
