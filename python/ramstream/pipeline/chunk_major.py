"""Chunk-major execution of a streamed stage: when a stage's schedule runs several forwards (or
backwards) of one streamed stage in a row, each of the stage's chunks runs over all of those
microbatches while it is loaded, so the chunk is loaded once per run of ops instead of once per
microbatch. GPipe on a streamed stage then loads each chunk twice per step (forward and backward)
as OffloadModel does on the whole batch, where microbatch-major execution loads it 2 x
microbatches times (issue 28's P2 row: 16 loads of 7.3 GB per step).

How: the stage's chunks are cut apart in autograd: a chunk's output goes to the next chunk as a
detached leaf (the tape keeps both), so the backward runs chunk by chunk, in reverse, over the
microbatches; the weight streamer is driven from here (WeightStreamer.driven: window(), use()).
Values are bit-identical to microbatch-major execution: every chunk computes the same thing on
the same inputs, a boundary's gradient reaches the chunk before it as it would inside one graph,
and a parameter's gradient sums the microbatches in the same order. A backward run that covers
every microbatch of the step sums the streamed gradients on the device and sends each home once
(the same left-to-right sum the host would make); a shorter run sends them home per microbatch.

Which chunks run chunk-major is Run's `grouped` (the Pipeline's offload_chunk_major): streamed
stages, one chunk per stage (gpipe, 1f1b; not interleaved, where a run of ops waiting for all its
inputs could wait on itself), without activation paging or fake compute. Not thread-safe: the
stage's thread only (its forwards; its backwards run on the same thread here).
"""

from __future__ import annotations

import torch

from .cast_grads import fuse_cast_grads

__all__ = ["backward_parts", "batches", "forward_parts", "grouped_chunks"]


def grouped_chunks(option, chunks, chunks_per_stage: int, streamed_type) -> frozenset:
    """The chunks (indices) that run chunk-major under Pipeline's offload_chunk_major `option`:
    True: every streamed chunk (instances of `streamed_type`); "auto": those whose device runs
    another stage too, or all of a one-stage pipeline (across devices a run delays the next
    stage's start: simulate_pipeline(chunk_major=True) shows when that costs more than the loads
    it saves); False: none. None with chunks_per_stage > 1. TypeError for another value."""
    if option not in (True, False, "auto") or not isinstance(option, (bool, str)):
        raise TypeError(f"Pipeline: offload_chunk_major must be True, False or 'auto', got {option!r}")
    if option is False or chunks_per_stage != 1:
        return frozenset()
    stages: dict = {}
    for ch in chunks:
        stages.setdefault(ch.device, set()).add(ch.stage)
    one_stage = len({ch.stage for ch in chunks}) == 1
    return frozenset(
        c
        for c, ch in enumerate(chunks)
        if isinstance(ch.module, streamed_type)
        and (option is True or one_stage or len(stages[ch.device]) > 1)
    )


def batches(items, groupable, pairs: bool = False):
    """`items` (one stage's ops, or with `pairs` (stage, op) pairs of an execution order) cut into
    runs: consecutive ops of one stage, chunk and kind for which `groupable(op)` holds form one
    run; every other op is a run of its own."""
    out: list[list] = []
    for it in items:
        op = it[1] if pairs else it
        if out and groupable(op):
            last = out[-1][-1]
            prev = last[1] if pairs else last
            same_stage = not pairs or it[0] == last[0]
            if same_stage and prev.kind == op.kind and prev.chunk == op.chunk and groupable(prev):
                out[-1].append(it)
                continue
        out.append([it])
    return out


def _leaf(v):
    """A chunk's output as the next chunk's input: a tensor that requires grad becomes a detached
    leaf (its .grad is the gradient the chunk before receives); anything else passes as is."""
    if torch.is_tensor(v) and v.requires_grad:
        return v.detach().requires_grad_(True)
    return v


def _in_place_hint(i: int) -> RuntimeError:
    return RuntimeError(
        f"Pipeline: chunk {i} of a streamed stage modifies its input in place (such as "
        "nn.ReLU(inplace=True) first); with offload_chunk_major=True (the default) each chunk's "
        "input is a leaf tensor that carries its gradient back: start the chunk with an "
        "out-of-place op, or pass offload_chunk_major=False"
    )


def forward_parts(stage, args_list, train: bool):
    """Runs `stage` (a StreamedStage) on every microbatch's arguments (tuples), chunk by chunk;
    returns (outputs, tapes): per microbatch the last chunk's output (attached to its graph) and,
    when training, the tape: per chunk (its input tuple, its output tuple). On failure every
    streamed chunk is evicted and the error raised (the caller's step fails as a whole)."""
    st = stage.streamer
    nb = len(st.blocks)
    xs = [tuple(a) for a in args_list]
    outs: list = [None] * len(xs)
    tapes = [[] for _ in xs] if train else None
    last = len(stage.parts) - 1
    st.driven = True
    try:
        for i, part in enumerate(stage.parts):
            k = stage.block_of.get(i)
            if k is not None:
                st.window(range(k, min(nb, k + 1 + st.ahead)))
                st.use(k)
            for m, x in enumerate(xs):
                try:
                    out = part(*x)
                except RuntimeError as e:
                    if i > 0 and "leaf Variable that requires grad" in str(e):
                        raise _in_place_hint(i) from e
                    raise
                o = out if isinstance(out, tuple) else (out,)
                if train:
                    tapes[m].append((x, o))
                if i == last:
                    outs[m] = out
                else:
                    xs[m] = tuple(_leaf(v) for v in o) if train else o
            if torch.is_autocast_enabled(stage.device.type):
                torch.clear_autocast_cache()  # the chunk's cast weights: not kept past it
        if not train:
            st.window(())
    except BaseException:
        st.window(())
        raise
    finally:
        st.driven = False
    return outs, tapes


def backward_parts(stage, tapes, roots, *, accumulate: bool) -> None:
    """The backward of the microbatches whose `tapes` forward_parts made, chunk by chunk in
    reverse; roots: per microbatch the (tensor, gradient) pairs of the last chunk's graph (its
    outputs with their gradients, or the loss). The stage's input leaves get their .grad.
    accumulate: the streamed gradients sum over the microbatches on the device and go home once
    per chunk (the run covers every microbatch of the step); else each goes home as autograd
    makes it. The tapes are consumed. On failure the streamed gradients still on the device are
    dropped, every chunk is evicted and the error raised."""
    st = stage.streamer
    last = len(stage.parts) - 1
    st.driven = True
    stage.holding = accumulate
    try:
        for i in range(last, -1, -1):
            k = stage.block_of.get(i)
            if k is not None:
                st.window(range(k, max(-1, k - 1 - st.ahead), -1))
                st.use(k)
            fused = (
                fuse_cast_grads(list(stage._streamed_params([i])), tapes[0][i][1])
                if accumulate and stage.recompute is None and k is not None and tapes
                else []
            )
            stage.fused_casts += len(fused)
            try:
                _backward_chunk(i, last, tapes, roots)
            finally:
                for h in fused:
                    h.remove()
            if accumulate:
                stage.land_part(i)
        st.window(())
    except BaseException:
        stage.drop_device_grads()
        st.window(())
        raise
    finally:
        st.driven = False
        stage.holding = False


def _backward_chunk(i: int, last: int, tapes, roots) -> None:
    """Chunk i's backward for every microbatch of the run, in order."""
    for m, tape in enumerate(tapes):
        if i == last:
            pairs = roots[m]
        else:
            nxt = tape[i + 1][0]
            pairs = [
                (o, a.grad)
                for o, a in zip(tape[i][1], nxt)
                if torch.is_tensor(a) and a.requires_grad and a.grad is not None and o.requires_grad
            ]
            tape[i + 1] = None  # its input's gradient is read: the chunk's tensors may go
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        del pairs
