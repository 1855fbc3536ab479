"""One pipeline step (or inference pass) in flight: Run executes a stage's op list (forward and
backward of (microbatch, chunk)), hands activations and gradients over through an Exchange, and
collects the outputs and losses; PipelineResult is what step() returns.

A Run is built per step by the Pipeline and dropped after it; stage threads hold it only while
they run its ops. Every op of a chunk runs on the chunk's stage thread (or, with overlap=False,
on the caller's thread), on the stage's CUDA stream when its device is a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import time

import torch

from .chunk_major import backward_parts, batches, forward_parts
from .stage import Exchange, Stopped, device_context, receive, send

__all__ = ["Chunk", "PipelineResult", "Run", "cat_outputs", "sum_loss"]


class Chunk:
    """One piece of the pipeline (a virtual stage): `module` on `device`, run by stage `stage`
    on `stream` (a torch.cuda.Stream, None off CUDA) under autocast `dtype` (None: off)."""

    __slots__ = ("device", "dtype", "module", "stage", "stream")

    def __init__(self, module, device, stage, stream, dtype) -> None:
        self.module, self.device, self.stage, self.stream, self.dtype = module, device, stage, stream, dtype

    def autocast(self):
        if self.dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.dtype)


class PipelineResult:
    """The result of Pipeline.step(): `outputs` (the last chunk's output per microbatch, detached,
    on the last stage's device), `losses` (the loss per microbatch, detached scalars; empty with
    grad_outputs), `loss` (their mean) and `output` (the outputs concatenated along dim 0)."""

    def __init__(self, outputs, losses, pipeline=None) -> None:
        self.outputs = list(outputs)
        self.losses = list(losses)
        self._pipeline = pipeline

    @property
    def loss(self) -> torch.Tensor:
        """The mean of the microbatch losses (the full-batch mean when the microbatches are equal)."""
        if not self.losses:
            raise RuntimeError(
                "PipelineResult.loss: this step ran with grad_outputs (the loss was bypassed), so no "
                "loss was computed"
            )
        return torch.stack(self.losses).mean()

    @property
    def output(self):
        """The microbatch outputs concatenated along dim 0 (a tuple output: element-wise)."""
        return cat_outputs(self.outputs)

    def flush_grads(self, scale: float = 1.0) -> None:
        """Pipeline.flush_grads(scale) of the pipeline that made this result (one meaning: see
        there; RamTorch's result averages by default, here the step's gradients already are the
        microbatch mean)."""
        if self._pipeline is None:
            raise RuntimeError("PipelineResult.flush_grads: no pipeline attached")
        self._pipeline.flush_grads(scale)


def sum_loss(out, _target):
    """Pipeline.step's loss without loss_fn (RamTorch's default): output.sum()."""
    if not torch.is_tensor(out):
        raise TypeError(
            "Pipeline.step: without loss_fn the loss is output.sum(), which needs a tensor output; "
            f"got {type(out).__name__}: pass loss_fn or grad_outputs"
        )
    return out.sum()


def cat_outputs(outs):
    first = outs[0]
    if torch.is_tensor(first):
        return torch.cat(outs, dim=0) if len(outs) > 1 else first
    if isinstance(first, tuple):
        return tuple(cat_outputs([o[i] for o in outs]) for i in range(len(first)))
    return list(outs)


def _move(v, device):
    if torch.is_tensor(v):
        return v.to(device, non_blocking=device.type == "cuda")
    if isinstance(v, tuple):
        return tuple(_move(x, device) for x in v)
    return v


class Run:
    """One step's state. `chunks` (Chunk per virtual stage), `ops` (per stage, Op lists), `inputs`
    (per microbatch, the first chunk's positional arguments), `targets` (per microbatch or None),
    `loss_fn` or `grads` (per microbatch: the last output's gradient, or a callable), `train`
    (False: forwards only, under no_grad), `pagers` (per stage: a StagePager paging saved
    activations, or None), `fake` (Pipeline's fake_compute, fake.py's FakeCompute: seconds slept
    before each op; with `replace` the ops skip the kernels: zeros of the right shapes flow, no
    loss_fn, no autograd). run_stage(s) never raises: the first failure is in `exchange.error`."""

    def __init__(
        self, chunks, ops, inputs, targets, *, loss_fn, grads, train, trace=False, pagers=None, fake=None,
        grouped=frozenset(),
    ) -> None:  # fmt: skip
        self.chunks, self.ops = chunks, ops
        self.fake = fake  # FakeCompute: (fwd, bwd) seconds per stage, split over its chunks; or None
        self.replace = fake is not None and fake.replace
        self.inputs, self.targets = inputs, targets
        self.loss_fn, self.grads, self.train = loss_fn, grads, train
        self.n = len(inputs)
        self.last = len(chunks) - 1
        self.exchange = Exchange(len(ops))
        self.saved: dict = {}  # (chunk, mb) -> forward state, each key touched by one stage only
        self.outputs: list = [None] * self.n
        self.losses: list = [None] * self.n
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.start_events: dict = {}  # device -> event on the caller's stream at the start
        self.end_events: dict = {}  # stage -> event on its stream at its end
        self.spans: list | None = [] if trace else None
        self.pagers = pagers if train and pagers and not self.replace else None
        self.failed_at = None  # (stage, op) of the first op that raised (oom.py says where)
        # chunks run chunk-major over runs of consecutive ops (chunk_major.py): streamed stages
        self.grouped = frozenset() if self.pagers is not None or fake is not None else frozenset(grouped)
        self.tapes: dict = {}  # (chunk, mb) -> a chunk-major forward's tape, until its backward

    # ---- the caller's side -----------------------------------------------------------------------
    def mark_start(self) -> None:
        """Events on the caller's current stream of every GPU: the stages start after what the
        caller queued there (an optimizer step, the inputs)."""
        for ch in self.chunks:
            if ch.stream is not None and ch.device not in self.start_events:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(ch.device))
                self.start_events[ch.device] = ev

    def join_streams(self) -> None:
        """The caller's current streams wait (on the GPU) for every stage's last op, and the
        outputs and losses (made on the last stage's stream) are recorded on the caller's."""
        for s, ev in self.end_events.items():
            dev = next(ch.device for ch in self.chunks if ch.stage == s)
            torch.cuda.current_stream(dev).wait_event(ev)
        for v in list(self.outputs) + list(self.losses):
            for t in v if isinstance(v, tuple) else (v,):
                if torch.is_tensor(t) and t.is_cuda:
                    t.record_stream(torch.cuda.current_stream(t.device))

    def run_serial(self, order) -> None:
        """overlap=False: every (stage, op) of `order` (an execution order) on this thread, each
        under its stage's device and stream; raises the first failure."""
        self.exchange.running = 1  # a missing hand-over is a deadlock at once
        grad = torch.enable_grad() if self.train else torch.no_grad()
        seen = set()
        try:
            with grad:
                for run in batches(order, self._groupable, pairs=True):
                    s, op = run[0]
                    ch = self.chunks[op.chunk]
                    with device_context(ch.device, ch.stream):
                        if s not in seen and ch.stream is not None and ch.device in self.start_events:
                            ch.stream.wait_event(self.start_events[ch.device])
                        seen.add(s)
                        self.run_ops(s, [op for _, op in run])
        except Stopped:
            raise self.exchange.error from None
        finally:
            for ch in self.chunks:
                if ch.stream is not None and ch.stage in seen and ch.stage not in self.end_events:
                    ev = torch.cuda.Event()
                    ev.record(ch.stream)
                    self.end_events[ch.stage] = ev

    # ---- a stage's side --------------------------------------------------------------------------
    def run_stage(self, s: int, serial: bool = False) -> None:
        """Runs stage s's ops in order (never raises; failures go to the exchange)."""
        ch0 = next(ch for ch in self.chunks if ch.stage == s)
        try:
            with device_context(ch0.device, ch0.stream):
                try:
                    if ch0.stream is not None and ch0.device in self.start_events:
                        ch0.stream.wait_event(self.start_events[ch0.device])
                    grad = torch.enable_grad() if self.train else torch.no_grad()
                    with grad:
                        for run in batches(self.ops[s], self._groupable):
                            self.exchange.check()
                            self.run_ops(s, run)
                finally:
                    if ch0.stream is not None:
                        ev = torch.cuda.Event()
                        ev.record(ch0.stream)
                        self.end_events[s] = ev
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - reported to the caller, who raises it
            self.exchange.fail(e)
        finally:
            if not serial:
                self.exchange.finished()
                self.done.put(s)

    def _groupable(self, op) -> bool:
        return op.chunk in self.grouped

    def run_ops(self, s: int, ops) -> None:
        """A run of stage s's ops: one op, or consecutive ops of one grouped chunk and kind, run
        chunk-major (a backward run whose forwards were not all chunk-major runs op by op)."""
        if len(ops) == 1:
            return self.run_op(s, ops[0])
        c, ms = ops[0].chunk, [op.mb for op in ops]
        if ops[0].kind == "B" and any((c, m) not in self.tapes for m in ms):
            for op in ops:
                self.run_op(s, op)
            return None
        t0 = time.perf_counter()
        try:
            (self.forward_group if ops[0].kind == "F" else self.backward_group)(s, c, ms)
        except Stopped:
            raise
        except BaseException:
            if self.failed_at is None:
                self.failed_at = (s, ops[0])
            raise
        if self.spans is not None:
            self.spans.append((s, f"{ops[0].kind} mb{ms[0]}-{ms[-1]} c{c}", t0, time.perf_counter()))
        return None

    def run_op(self, s: int, op) -> None:
        t0 = time.perf_counter()
        try:
            if op.kind == "F":
                self.forward(s, op.chunk, op.mb)
            elif (op.chunk, op.mb) in self.tapes:
                self.backward_group(s, op.chunk, [op.mb])
            else:
                self.backward(s, op.chunk, op.mb)
        except Stopped:
            raise
        except BaseException:
            if self.failed_at is None:
                self.failed_at = (s, op)
            raise
        if self.spans is not None:
            self.spans.append((s, f"{op.kind} mb{op.mb} c{op.chunk}", t0, time.perf_counter()))

    def _fake_time(self, s: int, kind: str) -> None:
        """fake_compute's seconds for an op of stage s (a stage's, shared by its chunks), slept once
        the op's input (activation or gradient) has arrived, where its kernels would start."""
        if self.fake is not None:
            v = len(self.chunks) // len(self.ops)
            time.sleep((self.fake.fwd if kind == "F" else self.fake.bwd)[s] / v)

    def _args(self, s: int, c: int, m: int) -> tuple:
        ch = self.chunks[c]
        if c == 0:
            return _move(self.inputs[m], ch.device)
        return receive(self.exchange.take(("F", c - 1, m), s), ch.device, ch.stream)

    def forward_group(self, s: int, c: int, ms) -> None:
        """The forwards of microbatches `ms` through chunk c, chunk-major (chunk_major.py)."""
        ch = self.chunks[c]
        args = [self._args(s, c, m) for m in ms]
        try:
            with ch.autocast():
                outs, tapes = forward_parts(ch.module, args, self.train)
        except RuntimeError as e:
            hint = _in_place(e, c)
            if hint is None:
                raise
            raise hint from e
        for j, m in enumerate(ms):
            if tapes is not None:
                self.tapes[(c, m)] = tapes[j]
            self._forwarded(s, c, m, args[j], outs[j])

    def backward_group(self, s: int, c: int, ms) -> None:
        """The backwards of microbatches `ms` through chunk c, whose forwards ran chunk-major."""
        ch = self.chunks[c]
        roots, held = [], []
        for m in ms:
            state = self.saved.pop((c, m))
            held.append(state[0])
            if c == self.last:
                roots.append(self._last_pairs(m, ch, state[1], state[2]))
            else:
                gs = receive(self.exchange.take(("B", c, m), s), ch.device, ch.stream)
                roots.append([(o, g) for o, g in zip(state[1], gs) if g is not None and _needs_grad(o)])
        tapes = [self.tapes.pop((c, m)) for m in ms]
        backward_parts(ch.module, tapes, roots, accumulate=len(ms) == self.n)
        del tapes, roots
        for m, args in zip(ms, held):
            if c > 0:
                back = tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)
                self.exchange.put(("B", c - 1, m), send(back, ch.stream, grads=True))

    def forward(self, s: int, c: int, m: int) -> None:
        ch = self.chunks[c]
        args = self._args(s, c, m)
        self._fake_time(s, "F")
        pager = self.pagers[s] if self.pagers is not None else None
        saving = pager.saving((c, m), [ch.module], args) if pager is not None else contextlib.nullcontext()
        try:
            with saving, ch.autocast():
                out = self.fake.output(c, ch.module, args, ch.device) if self.replace else ch.module(*args)
        except RuntimeError as e:
            hint = _in_place(e, c)
            if hint is None:
                raise
            raise hint from e
        self._forwarded(s, c, m, args, out)

    def _forwarded(self, s: int, c: int, m: int, args, out) -> None:
        """After chunk c's forward of microbatch m: the output handed on, or (last chunk) kept
        with its loss; what the backward needs saved."""
        ch = self.chunks[c]
        pager = self.pagers[s] if self.pagers is not None else None
        outs = out if isinstance(out, tuple) else (out,)
        if c < self.last:
            if self.train:
                self.saved[(c, m)] = (args, outs)
            self.exchange.put(("F", c, m), send(outs, ch.stream))
            return
        self.outputs[m] = _detach(out)
        loss = None
        if self.train and self.loss_fn is not None and self.replace:
            self.losses[m] = self.fake.loss(ch.device)
        elif self.train and self.loss_fn is not None:
            keep = outs  # held in self.saved until the backward anyway
            saving = (
                pager.saving((c, m), [ch.module], keep) if pager is not None else contextlib.nullcontext()
            )
            with saving, ch.autocast():
                loss = self.loss_fn(out, _move(self.targets[m], ch.device))
            if not torch.is_tensor(loss) or loss.numel() != 1:
                raise ValueError(
                    "Pipeline.step: loss_fn must return a scalar tensor, got "
                    + (
                        f"a tensor of shape {tuple(loss.shape)}"
                        if torch.is_tensor(loss)
                        else type(loss).__name__
                    )
                )
            self.losses[m] = loss.detach().reshape(())
        if self.train:
            self.saved[(c, m)] = (args, outs, loss)

    def backward(self, s: int, c: int, m: int) -> None:
        ch = self.chunks[c]
        state = self.saved.pop((c, m), None)
        if state is None:
            raise RuntimeError(f"Pipeline: the schedule runs B(mb={m}, chunk={c}) before its forward")
        args, outs = state[0], state[1]
        if c == self.last:
            pairs = [] if self.replace else self._last_pairs(m, ch, outs, state[2])
        else:
            gs = receive(self.exchange.take(("B", c, m), s), ch.device, ch.stream)
            pairs = [(o, g) for o, g in zip(outs, gs) if g is not None and _needs_grad(o)]
        self._fake_time(s, "B")
        if self.replace:  # no autograd (grad_outputs unused): zeros of the inputs' shapes go back
            if c > 0:
                self.exchange.put(("B", c - 1, m), send(self.fake.input_grads(args), ch.stream, grads=True))
            return
        pager = self.pagers[s] if self.pagers is not None else None
        if pager is not None:
            pager.fetch((c, m), ch.stream)
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        del state, outs, pairs
        if pager is not None:
            pager.release((c, m), ch.stream, self._backwards_next(s, c, m))
        if c > 0:
            back = tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)
            self.exchange.put(("B", c - 1, m), send(back, ch.stream, grads=True))

    def _backwards_next(self, s: int, c: int, m: int):
        """The (chunk, mb) of stage s's backwards after B(c, m), up to its next forward."""
        ops = self.ops[s]
        i = next(k for k, op in enumerate(ops) if op.kind == "B" and op.chunk == c and op.mb == m)
        for op in ops[i + 1 :]:
            if op.kind == "F":
                return
            yield (op.chunk, op.mb)

    def _last_pairs(self, m, ch, outs, loss):
        if self.grads is None:
            if loss is None or not loss.requires_grad:
                return []  # nothing before the loss needs a gradient
            return [(loss.reshape(()) / self.n, None)]
        g = self.grads[m]
        if callable(g):
            g = g(self.outputs[m], self.targets[m])
        gs = g if isinstance(g, tuple) else (g,)
        if len(gs) != len(outs):
            raise ValueError(
                f"Pipeline.step: grad_outputs has {len(gs)} entries for the last stage's {len(outs)} outputs"
            )
        pairs = []
        for i, (o, g) in enumerate(zip(outs, gs)):
            if g is None or not _needs_grad(o):
                continue
            if not torch.is_tensor(g) or g.shape != o.shape:
                got = tuple(g.shape) if torch.is_tensor(g) else type(g).__name__
                raise ValueError(
                    f"Pipeline.step: grad_outputs entry {i} must be a tensor of the output's shape "
                    f"{tuple(o.shape)}, got {got}"
                )
            pairs.append((o, g.to(ch.device, non_blocking=ch.device.type == "cuda")))
        return pairs

    # ---- trace -----------------------------------------------------------------------------------
    def write_trace(self, path, t_start: float) -> None:
        """The op spans (host time: on CUDA, when each op was queued) as a Chrome/Perfetto trace,
        one track per stage; written to a temporary name and renamed."""
        pid = os.getpid()
        ev = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "ramstream pipeline"}}
        ]
        for s in range(len(self.ops)):
            ev.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": s + 1, "args": {"name": f"stage {s}"}}
            )
        for s, name, t0, t1 in self.spans or []:
            ts = (t0 - t_start) * 1e6
            ev.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": pid,
                    "tid": s + 1,
                    "ts": round(ts, 3),
                    "dur": round((t1 - t0) * 1e6, 3),
                }
            )
        tmp = f"{os.fspath(path)}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": ev, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)


def _in_place(e: RuntimeError, c: int) -> RuntimeError:
    """A stage that modified its input leaf in place: the error that says so (else None)."""
    if c > 0 and "leaf Variable that requires grad" in str(e):
        return RuntimeError(
            f"Pipeline: chunk {c} modifies its input in place (such as nn.ReLU(inplace=True) "
            "first); a stage's input is a leaf tensor that carries its gradient back: start the "
            "stage with an out-of-place op"
        )
    return None


def _needs_grad(o) -> bool:
    return torch.is_tensor(o) and o.requires_grad


def _detach(out):
    if torch.is_tensor(out):
        return out.detach()
    if isinstance(out, tuple):
        return tuple(_detach(o) for o in out)
    return out


def commit_grads(stash, *, fresh: bool) -> None:
    """A successful step's gradients into `.grad`: `stash` holds (parameter, its .grad before the
    step); the step's sum is in p.grad now. Added to the old .grad, or (fresh: flush_grads() ran
    since the last step) in its place; a parameter without a new gradient keeps the old one (or
    none after a flush). CUDA gradients are recorded on the caller's stream."""
    with torch.no_grad():
        for p, old in stash:
            new = p.grad
            if new is not None and new.is_cuda:
                new.record_stream(torch.cuda.current_stream(new.device))
            if new is None:
                p.grad = None if fresh else old
            elif old is not None and not fresh:
                p.grad = old.add_(new)
