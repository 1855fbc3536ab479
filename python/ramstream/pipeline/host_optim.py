"""Pipeline.optimizer(): ramstream's host optimizer (the offload engine's AdamW, the one
OffloadModel.optimizer() builds) over a pipeline's streamed chunks, updating each chunk on the host
as soon as its gradient of the step has landed, while the backward of the chunks before it goes on.

How: the engine's buckets of a streamed chunk's trained parameters are that chunk's slabs (its
weights at home in pinned host memory): the host AdamW writes the new weights there and the
chunk's next load waits for its update (Block.ready). A step drives one pass of the engine's
gradient intake (begin_driven, take, end_driven): a chunk-major backward run sums each streamed
gradient over every microbatch on the device, then land_part hands the chunk's gradients to the
engine (under one lock shared by the stage threads) instead of the write-back, and the engine
copies them to its landing buffers and queues the chunk's update.

Scope, checked (ValueError otherwise): every trained parameter is in a streamed stage's streamed
chunk (offload=True, no trained parameter in a pinned chunk or a resident stage), all stages on
one device; a step with more than one microbatch runs schedule="gpipe" with chunk-major streamed
stages (offload_chunk_major "auto" or True), where each chunk's gradient is final once per step.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

from ..frontends.offload_model.optim import _OPTIONS, param_groups, streamed_optimizer
from ..optim import OffloadAdamW
from . import schedule as schedules
from .streamed import StreamedStage

__all__ = ["PipelineAdamW", "begin_step", "build", "check_step", "end_step"]


class PipelineAdamW(OffloadAdamW):
    """The host optimizer of one Pipeline (built by `Pipeline.optimizer()`): an OffloadAdamW
    (param groups, LR schedulers, torch-format state dicts) whose engine takes the streamed
    gradients during `pipe.step()` (they never become `.grad`) and whose updates the chunks'
    loads wait for. close() gives the stages back their own slabs and gradient write-back (a
    torch optimizer over pipe.parameters() works again)."""

    _pipe_ref = None

    def close(self) -> None:
        if self._closed:
            return
        pipe = self._pipe_ref() if self._pipe_ref is not None else None
        if pipe is not None and pipe._host_opt is self:
            release(pipe)
            return
        super().close()


def _scope(pipe, groups) -> tuple[list, dict]:
    """(the streamed stages, {id(parameter): streamed block number}) of the trained parameters in
    `groups`; ValueError for a pipeline or parameter outside the scope (module docstring)."""
    if pipe._fake is not None:
        raise ValueError("Pipeline.optimizer: not with fake_compute (no stage computes gradients)")
    if len(set(pipe.devices)) != 1:
        raise ValueError(
            f"Pipeline.optimizer: the host optimizer serves stages on one device, these are on "
            f"{', '.join(str(d) for d in pipe.devices)}; use a torch optimizer over pipe.parameters()"
        )
    trained = {id(p) for g in groups for p in g["params"] if p.requires_grad}
    streamed, k = {}, 0  # k: the streamed chunks (not pinned) numbered over the stages in order
    for st in pipe._streamed:
        for i, part in enumerate(st.parts):
            if i in st.pinned:
                continue
            for p in part.parameters():
                if id(p) in trained:
                    streamed[id(p)] = k
            k += 1
    outside = trained - set(streamed)
    if outside:
        raise ValueError(
            f"Pipeline.optimizer: {len(outside)} trained parameter(s) are not in a streamed chunk (a "
            "resident stage, or a chunk pinned by offload_pin): the host optimizer updates streamed "
            "chunks only; pass offload=True with list stages and offload_pin=0, or use a torch "
            "optimizer over pipe.parameters()"
        )
    return list(pipe._streamed), streamed


def build(pipe, params, *, lr, betas, eps, weight_decay, **options) -> PipelineAdamW:
    """pipe.optimizer(...): the engine over the streamed chunks, wired into each stage's streamer."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"Pipeline.optimizer: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(_OPTIONS)}"
        )
    if pipe._host_opt is not None:
        raise ValueError("Pipeline.optimizer: this pipeline already has a host optimizer; close it first")
    groups = param_groups(pipe, params, "Pipeline.optimizer")
    stages, streamed = _scope(pipe, groups)
    with _between_steps(pipe, "Pipeline.optimizer"):
        return _attach(
            pipe,
            groups,
            stages,
            streamed,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
            options,
        )


@contextlib.contextmanager
def _between_steps(pipe, where: str):
    """Holds the pipeline's lock: no step(), infer() or stream runs while the stages are rebuilt."""
    if not pipe._lock.acquire(blocking=False):
        raise RuntimeError(
            f"{where}: a step() or infer() is running, or an infer_open() stream or a train_session() is "
            "open; call it between steps"
        )
    try:
        yield
    finally:
        pipe._lock.release()


def _attach(pipe, groups, stages, streamed, hyper: dict, options: dict) -> PipelineAdamW:
    """The engine built over the stages' streamed chunks (their slabs become its buckets)."""
    ahead = {st: st.streamer.ahead for st in stages}
    for st in stages:
        st.unbuild()  # the trained parameters' slabs become the engine's buckets
    try:
        opt = streamed_optimizer(
            PipelineAdamW, groups, hyper, pipe.devices[0], list(pipe.parameters()), streamed, options
        )
    except BaseException:
        for st in stages:
            st.build(ahead[st])  # as it was: its own slabs and write-back
        raise
    engine = opt._engine
    where = {}
    for st in stages:
        for i in range(len(st.parts)):
            if i not in st.pinned:
                where[len(where)] = (st, i)
    mine: dict = {st: {} for st in stages}
    for b in engine.buckets:
        st, i = where[engine.streamed[id(b.slots[0].param)]]
        mine[st].setdefault(i, []).append(b)
    lock = threading.Lock()
    intake = weakref.proxy(engine.intake)

    def hand_over(params) -> None:
        with lock:
            intake.take(params)

    for st in stages:
        st.own_copier, st.copier = st.copier, engine.copier  # one copy stream for every slab
        st.build(ahead[st], mine[st], engine._weak_wait)
        st.hand_over = hand_over
    pipe._host_opt = opt
    opt._pipe_ref = weakref.ref(pipe)
    return opt


def release(pipe) -> None:
    """opt.close(): the engine waits for its updates and unhooks; the stages stream with slabs of
    their own again, holding the current weights."""
    with _between_steps(pipe, "PipelineAdamW.close"):
        opt, pipe._host_opt = pipe._host_opt, None
        OffloadAdamW.close(opt)
        for st in pipe._streamed:
            ahead = st.streamer.ahead
            st.unbuild()
            st.copier = getattr(st, "own_copier", st.copier)
            st.hand_over = None
            st.build(ahead)


def check_step(pipe, schedule: str, n: int) -> None:
    """Before a step: refuses one whose backward would not sum every streamed gradient over all its
    microbatches (ValueError naming the way out)."""
    if pipe._host_opt is None:
        return
    chunks = [c for c, ch in enumerate(pipe._chunks) if isinstance(ch.module, StreamedStage)]
    major = schedules.canonical(schedule) == "gpipe" and all(c in pipe._grouped for c in chunks)
    if n > 1 and not major:
        raise ValueError(
            f"Pipeline.step: with the host optimizer (pipe.optimizer()) a step of {n} microbatches "
            f"needs schedule='gpipe' and chunk-major streamed stages (offload_chunk_major='auto' or "
            f"True; got schedule={schedule!r}), where each chunk's gradient is complete once per "
            "step; or use a torch optimizer over pipe.parameters()"
        )


def begin_step(pipe, n: int) -> None:
    """The step's ops are about to run: the engine's driven pass starts."""
    opt = pipe._host_opt
    if opt is None:
        return
    opt._engine.intake.begin_driven()
    for st in pipe._streamed:
        st.one_microbatch = n == 1


def end_step(pipe, ok: bool) -> None:
    """After every stage stopped: the driven pass ends (ok) or is dropped (its gradients, and the
    updates not yet run; updates that ran keep, with a RuntimeWarning, as OffloadModel's)."""
    opt = pipe._host_opt
    if opt is None:
        return
    if ok:
        opt._engine.intake.end_driven()
    else:
        opt._engine.intake.abandon_driven()
