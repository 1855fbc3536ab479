"""PipeDream-2BW training on a Pipeline (Pipeline.train_session, RamTorch's PipeDream2BWTrainer):
the stages run one continuous 1F1B over a stream of microbatches, each stage updating its own
weights after every group of n_microbatches backwards, with two weight versions per stage
(twobw_stage.py). The stage threads, hand-overs (CUDA events) and failure exchange are the
Pipeline's (stage.py)."""

from __future__ import annotations

import functools
import os
import queue
import threading

import torch

from .checks import check_int, check_paths, split_batch, split_tensors
from .stage import Exchange, Stopped, device_context, receive, send
from .streamed import StreamedStage
from .twobw_stage import StageWeights, check_stage_module, version_of

__all__ = ["PipeDream2BWTrainer", "TrainRunResult", "TrainSession"]

SCHEDULES = ("2bw", "pipedream_2bw")
W = "Pipeline.train_session"


def stage_ops(s: int, stages: int, m: int, start: int, count: int):
    """Stage s's ops for microbatches start .. start+count-1 (count a multiple of m, start too):
    min(stages-1-s, count) warm-up forwards, then one forward one backward, with ("U", group)
    after the backward that completes a group of m. Yields ("F", mb), ("B", mb), ("U", group)."""
    warm = min(stages - 1 - s, count)
    for k in range(warm):
        yield "F", start + k
    for k in range(count):
        if warm + k < count:
            yield "F", start + warm + k
        yield "B", start + k
        if (start + k + 1) % m == 0:
            yield "U", (start + k) // m


class TrainRunResult:
    """What TrainSession.run() returns: `updates` (this run's), `total_updates` (the session's),
    `peak_inflight` (most microbatches admitted and not yet retired by stage 0), `losses` (per
    update, the mean of its microbatch losses, detached 0-dim tensors on the last stage's device),
    `loss` (the last update's) and `versions` (per stage, the weight version each of this run's
    microbatches used, in microbatch order)."""

    def __init__(self, updates, total_updates, peak_inflight, losses, versions) -> None:
        self.updates, self.total_updates, self.peak_inflight = updates, total_updates, peak_inflight
        self.losses, self.versions = losses, versions

    @property
    def loss(self) -> torch.Tensor:
        return self.losses[-1]

    def __repr__(self) -> str:
        return f"TrainRunResult(updates={self.updates}, total_updates={self.total_updates})"


class _Gate:
    """At most `limit` microbatches admitted and not yet retired (stage 0's backward queued). Waits
    on the exchange's condition, so a failed run wakes it; while the feeder waits here it counts as
    blocked in the exchange's deadlock detection (a retirement unblocks it)."""

    WHO, KEY = "feeder", ("a retired microbatch (max_inflight)", "-", "-")

    def __init__(self, ex: Exchange, limit: int) -> None:
        self.ex, self.limit, self.inflight, self.peak = ex, limit, 0, 0

    def admit(self) -> None:
        ex = self.ex
        with ex.cond:
            try:
                while self.inflight >= self.limit:
                    if ex.error is not None:
                        raise Stopped
                    ex.waits[self.WHO] = self.KEY
                    if ex._blocked() >= ex.running:
                        ex._deadlock()
                        raise Stopped
                    ex.cond.wait()
            finally:
                ex.waits.pop(self.WHO, None)
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)

    def retire(self) -> None:
        with self.ex.cond:
            self.inflight -= 1
            self.ex.waits.pop(self.WHO, None)  # the feeder can go on: not blocked any more
            self.ex.cond.notify_all()


class TrainSession:
    """A PipeDream-2BW training session over a Pipeline's resident stages (see
    Pipeline.train_session). While it is open the pipeline's step(), infer() and infer_open() raise
    RuntimeError. Not thread-safe: one run() at a time. close() (or a `with` block) ends it; the
    stages' Parameters then hold the latest weights."""

    def __init__(
        self, pipe, *, optimizer_factory, n_microbatches=4, loss_fn, schedule="pipedream_2bw",
        max_inflight=None, optimizer_device=None,
    ) -> None:  # fmt: skip
        if schedule not in SCHEDULES:
            raise ValueError(f"{W}: schedule must be one of {SCHEDULES}, got {schedule!r}")
        S = pipe.num_stages
        self.m = check_int(W, f"n_microbatches (at least the {S} stages)", n_microbatches, S)
        self.max_inflight = 2 * self.m + S if max_inflight is None else max_inflight
        check_int(W, f"max_inflight (at least the {S} stages)", self.max_inflight, S)
        if not callable(loss_fn):
            raise TypeError(
                f"{W}: loss_fn must be callable (output, target) -> loss, got {type(loss_fn).__name__}"
            )
        if optimizer_device is not None and (
            not isinstance(optimizer_device, (str, torch.device))
            or torch.device(optimizer_device).type != "cpu"
        ):
            raise ValueError(
                f"{W}: optimizer_device must be None (the stage's device) or 'cpu', got {optimizer_device!r}"
            )
        factories = (
            list(optimizer_factory)
            if isinstance(optimizer_factory, (list, tuple))
            else [optimizer_factory] * S
        )
        if len(factories) != S or not all(callable(f) for f in factories):
            raise TypeError(
                f"{W}: optimizer_factory must be a callable params -> torch.optim.Optimizer, or a list of "
                f"{S} (one per stage)"
            )
        self._check_pipeline(pipe)
        self.pipe, self.loss_fn, self.num_stages = pipe, loss_fn, S
        self.chunks = pipe._chunks
        if not pipe._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{W}: a step(), infer(), infer_open() stream or another train_session is active on this pipeline"
            )
        try:
            self.stages = [
                StageWeights(ch.module, ch.device, f, optimizer_device is not None, s)
                for s, (ch, f) in enumerate(zip(self.chunks, factories))
            ]
        except BaseException:
            pipe._lock.release()
            raise
        pipe._session = self
        self.total_updates = 0
        self._closed = False
        self._failed: BaseException | None = None
        self._running = threading.Lock()

    @staticmethod
    def _check_pipeline(pipe) -> None:
        pipe._check_open()
        if pipe.chunks_per_stage != 1:
            raise NotImplementedError(
                f"{W}: chunks_per_stage={pipe.chunks_per_stage}: 2BW runs one chunk per stage"
            )
        if pipe._pagers is not None:
            raise NotImplementedError(
                f"{W}: offload_activations=True is not supported with 2BW (resident stages only)"
            )
        if not pipe.overlap:
            raise NotImplementedError(f"{W}: overlap=False is not supported: 2BW runs on the stage threads")
        if pipe.autocast_dtype == torch.float16:
            raise ValueError(
                f"{W}: autocast=float16 cannot train (fp16 gradients underflow without loss scaling); "
                "use autocast=torch.bfloat16 or None"
            )
        for s, ch in enumerate(pipe._chunks):
            if isinstance(ch.module, StreamedStage):
                raise NotImplementedError(
                    f"{W}: stage {s} is streamed (offload=True with a list of chunks); 2BW trains resident "
                    "stages only: build the Pipeline with offload=False"
                )
            check_stage_module(W, s, ch.module)
            for p in ch.module.parameters():
                if p.grad is not None:
                    raise ValueError(
                        f"{W}: stage {s} has a parameter with a .grad; start from clean gradients "
                        "(optimizer.zero_grad(set_to_none=True))"
                    )

    @property
    def optimizers(self) -> list:
        """Per stage, its optimizer (None for a stage without trainable parameters)."""
        return [st.optimizer for st in self.stages]

    # ---- running ------------------------------------------------------------------------------
    def run(self, loader, *, updates: int, observer=None, profile_path=None) -> TrainRunResult:
        """Trains `updates` updates from `loader` (an iterable of (inputs, targets) batches, one per
        update, cut into n_microbatches along dim 0 as Pipeline.step cuts them). Every stage
        updates itself after its backwards of each group, with the group's gradient (the mean of
        the microbatch losses, loss / n_microbatches backpropagated per microbatch) taken at the
        weight version version_of(group) (one update stale with several stages). The pipeline is
        drained at the end of a run (not between updates); the versions and optimizer states go on
        into the next run. observer(stage, update, snapshot) is called on the stage's thread after
        each of its updates with CPU copies ({"grads", "weights", "optimizer"}): for debugging.
        profile_path: a torch.profiler trace of the run.

        A failure (a stage's forward, backward, loss or update, the loader, an observer) stops
        every stage and is raised; the stages that had applied one update more than the others
        undo it, so every stage's weights and optimizer state are those after `total_updates`
        updates (the last one all stages completed); that group's gradients are dropped. The
        session then refuses run(): close it (and open a new one to go on)."""
        if self._closed:
            raise RuntimeError(f"{W}: the session is closed")
        if self._failed is not None:
            raise RuntimeError(f"{W}: a previous run failed ({self._failed!r}); close() this session")
        n = check_int("TrainSession.run", "updates", updates, 1)
        if observer is not None and not callable(observer):
            raise TypeError(f"TrainSession.run: observer must be callable, got {type(observer).__name__}")
        check_paths(profile_path=profile_path)
        if not self._running.acquire(blocking=False):
            raise RuntimeError("TrainSession.run: a run() is already in progress")
        try:
            if profile_path is None:
                return self._run(loader, n, observer)
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                out = self._run(loader, n, observer)
            prof.export_chrome_trace(os.fspath(profile_path))
            return out
        finally:
            self._running.release()

    def _run(self, loader, n: int, observer) -> TrainRunResult:
        S, m = self.num_stages, self.m
        ex = Exchange(S + 1)  # the stage workers and this thread, which feeds the microbatches
        gate = _Gate(ex, self.max_inflight)
        start = self.total_updates * m
        state = _RunState(S, n * m)
        starts = {}
        for ch in self.chunks:
            if ch.stream is not None and ch.device not in starts:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(ch.device))
                starts[ch.device] = ev
        done: queue.SimpleQueue = queue.SimpleQueue()
        for s, t in enumerate(self.pipe._threads):
            job = functools.partial(self._stage_job, s, ex, gate, state, start, n * m, observer, starts, done)
            t.submit(job)
        left = S
        try:
            self._feed(loader, n, ex, gate, start)
        except BaseException as e:  # noqa: BLE001 - the loader's error, an interrupt: raised below
            ex.fail(e)
        finally:
            ex.finished()
        interrupt = None
        try:
            while left:
                done.get()
                left -= 1
        except BaseException as e:  # an interrupt while waiting: stop the stages, wait, roll back
            interrupt = e
            ex.fail(e)
            while left:
                done.get()
                left -= 1
        self._join(state)
        if ex.error is not None:
            self._fail(ex.error, state.ends)
            raise interrupt or ex.error
        self.total_updates += n
        losses = [torch.stack(state.losses[g * m : (g + 1) * m]).mean() for g in range(n)]
        return TrainRunResult(n, self.total_updates, gate.peak, losses, state.versions)

    def _feed(self, loader, n: int, ex: Exchange, gate: _Gate, start: int) -> None:
        it = iter(loader)
        for g in range(n):
            try:
                item = next(it)
            except StopIteration:
                raise ValueError(
                    f"TrainSession.run: the loader ended after {g} batches; updates={n} needs {n}"
                ) from None
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(
                    f"TrainSession.run: the loader must yield (inputs, targets) pairs, got {type(item).__name__}"
                )
            inputs, rows = split_batch(item[0], self.m)
            targets = split_tensors("targets", item[1], self.m, rows)
            for k in range(self.m):
                gate.admit()
                mb = start + g * self.m + k
                ex.put(("X", "input", mb), send(inputs[k], _caller_stream(inputs[k]), grads=True))
                tk = targets[k]
                tv = tk if isinstance(tk, tuple) else (tk,)
                ex.put(("T", "target", mb), (isinstance(tk, tuple), send(tv, _caller_stream(tv), grads=True)))

    def _stage_job(self, s, ex, gate, state, start, count, observer, starts, done) -> None:
        """Stage s's ops of one run, on its thread (never raises: failures go to the exchange)."""
        ch, st = self.chunks[s], self.stages[s]
        last = s == self.num_stages - 1
        saved: dict = {}
        try:
            with device_context(ch.device, ch.stream):
                try:
                    if ch.stream is not None and ch.device in starts:
                        ch.stream.wait_event(starts[ch.device])
                    with torch.enable_grad():
                        for kind, i in stage_ops(s, self.num_stages, self.m, start, count):
                            ex.check()
                            if kind == "F":
                                self._forward(s, ch, st, i, ex, saved, state, start, last)
                            elif kind == "B":
                                self._backward(s, ch, st, i, ex, saved, last)
                                if s == 0:
                                    gate.retire()
                            else:
                                grads = st.update(version_of(i, self.num_stages))
                                if observer is not None:
                                    observer(s, i, _snapshot(st, grads))
                                del grads
                finally:
                    if ch.stream is not None:
                        ev = torch.cuda.Event()
                        ev.record(ch.stream)
                        state.ends[s] = ev
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - reported to the caller, who raises it
            ex.fail(e)
        finally:
            saved.clear()
            ex.finished()
            done.put(s)

    def _forward(self, s, ch, st, mb, ex, saved, state, start, last) -> None:
        if s == 0:
            args = receive(ex.take(("X", "input", mb), s), ch.device, ch.stream)
        else:
            args = receive(ex.take(("F", s - 1, mb), s), ch.device, ch.stream)
        v = version_of(mb // self.m, self.num_stages)
        out, bank = st.forward(v, args, ch.autocast())
        state.versions[s][mb - start] = v
        outs = out if isinstance(out, tuple) else (out,)
        if not last:
            saved[mb] = (args, outs, bank)
            ex.put(("F", s, mb), send(outs, ch.stream))
            return
        is_tuple, payload = ex.take(("T", "target", mb), s)
        target = receive(payload, ch.device, ch.stream)
        target = target if is_tuple else target[0]
        with ch.autocast():
            loss = self.loss_fn(out, target)
        if not torch.is_tensor(loss) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if torch.is_tensor(loss) else type(loss).__name__
            raise ValueError(f"TrainSession.run: loss_fn must return a scalar tensor, got {got}")
        state.losses[mb - start] = loss.detach().reshape(())
        saved[mb] = (args, (loss.reshape(()) / self.m,), bank)

    def _backward(self, s, ch, st, mb, ex, saved, last) -> None:
        args, outs, bank = saved.pop(mb)
        if last:
            pairs = [(outs[0], None)] if outs[0].requires_grad else []
        else:
            gs = receive(ex.take(("B", s, mb), s), ch.device, ch.stream)
            pairs = [
                (o, g) for o, g in zip(outs, gs) if g is not None and torch.is_tensor(o) and o.requires_grad
            ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        st.backward_done(bank)
        del outs, pairs
        if s > 0:
            back = tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)
            ex.put(("B", s - 1, mb), send(back, ch.stream, grads=True))

    def _join(self, state) -> None:
        """The caller's current streams wait (on the GPU) for every stage's last op."""
        for s, ev in state.ends.items():
            torch.cuda.current_stream(self.chunks[s].device).wait_event(ev)
        for t in state.losses:
            if torch.is_tensor(t) and t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))

    def _fail(self, error: BaseException, ends: dict) -> None:
        """Every stage back to the last update all of them completed; the session refuses run().
        CPU masters are restored on the host: their stage's queued work is waited for first (that
        stage's event only, never a device)."""
        done = min(st.latest for st in self.stages)
        for s, st in enumerate(self.stages):
            if st.masters is not None and s in ends:
                ends[s].synchronize()
            st.roll_back_to(done)
        self.total_updates = done
        self._failed = error

    # ---- the end ------------------------------------------------------------------------------
    def close(self) -> None:
        """Ends the session (idempotent): the Parameters keep the latest weights (their .grad
        None), the second bank and the optimizers' undo copies are freed, and the pipeline's
        step()/infer() work again. The optimizers stay usable (`optimizers`)."""
        if self._closed:
            return
        if not self._running.acquire(blocking=False):
            raise RuntimeError("TrainSession.close: a run() is in progress; let it finish first")
        try:
            for st in self.stages:
                st.release()
            self._closed = True
            self.pipe._session = None
            self.pipe._lock.release()
        finally:
            self._running.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


PipeDream2BWTrainer = TrainSession  # RamTorch's name


class _RunState:
    """What one run's workers record: per stage the versions used, the losses, the end events."""

    def __init__(self, stages: int, count: int) -> None:
        self.versions = [[None] * count for _ in range(stages)]
        self.losses: list = [None] * count
        self.ends: dict = {}


def _caller_stream(values):
    for v in values:
        if torch.is_tensor(v) and v.is_cuda:
            return torch.cuda.current_stream(v.device)
    return None


def _cpu(v):
    if torch.is_tensor(v):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, dict):
        return {k: _cpu(x) for k, x in v.items()}
    return v


def _snapshot(st: StageWeights, grads) -> dict:
    """CPU copies of the gradients a stage's update applied, its latest weights and its optimizer
    state (per parameter name): for observer()."""
    opt_params = st.masters if st.masters is not None else st.params
    state = st.optimizer.state if st.optimizer is not None else {}
    return {
        "grads": {n: _cpu(g) for n, g in zip(st.names, grads)},
        "weights": {n: _cpu(p) for n, p in zip(st.names, st.params)},
        "optimizer": {n: _cpu(dict(state.get(p, {}))) for n, p in zip(st.names, opt_params)},
    }
