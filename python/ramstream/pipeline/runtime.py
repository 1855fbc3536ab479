"""Pipeline: single-process pipeline parallelism (RamTorch's Pipeline API) over one stage per
device (several GPUs, one GPU several times, or the CPU), with persistent stage threads, per-stage
CUDA streams and events, and all-or-nothing steps."""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
import weakref

import torch

from . import host_optim
from . import schedule as schedules
from .checks import (
    check_autocast,
    check_devices,
    check_offload,
    check_params,
    check_paths,
    dice,
    schedule_hint,
)
from .chunk_major import grouped_chunks
from .fake import check_fake_compute, refuse_replace
from .microbatch import cut_inputs, loss_or_grads
from .oom import explain as out_of_memory
from .paging import StagePager
from .pinning import set_offload_pinned
from .run import Chunk, PipelineResult, Run, cat_outputs, commit_grads
from .split import Sequence, split_model
from .stage import StageThread, stop_all
from .streamed import StreamedStage, stream_choices
from .streaming import InferHandle, InferStream
from .twobw import TrainSession

__all__ = ["Pipeline", "PipelineResult"]


class Pipeline:
    """Runs a model cut into stages, one stage per device, microbatches flowing through them.

    Args:
        model, example_input, split_spec: an nn.Sequential (or an nn.ModuleList of blocks, run in
            order) and where to cut it: split_spec maps a
            child's name to SplitPoint.BEGINNING (a stage starts there) or .END (one ends after
            it), or is None (balanced by parameter count over `devices`). example_input is
            accepted for RamTorch's signature and not needed (nothing is traced).
        stage_modules: the stages, one nn.Module each (its forward takes the previous stage's
            output; a tuple output becomes the next stage's positional arguments); an entry that
            is a list of modules (or an nn.ModuleList) is a chunked stage run in sequence. With chunks_per_stage=v (an
            int), the list holds stages*v chunks, chunk c on stage c % stages (the "interleaved"
            schedule's placement).
        chunk_modules: a flat list of chunks cut into consecutive stages: chunks_per_stage as a
            list of counts, or an even split (earlier stages take the remainder); with
            chunks_per_stage=v (an int), placed as stage_modules are.
        devices: one per stage ("cpu", "cuda", "cuda:i"; the same GPU may appear several
            times); None: cuda:i round-robin over the visible GPUs, or the CPU.
        overlap: True: one persistent thread per stage, started here and reused by every step;
            False: every op on the caller's thread, in a valid order (debugging).
        autocast: None, torch.bfloat16 or "bf16" (each stage runs its forward and the loss under
            torch.autocast on its device; parameters and gradients stay in their dtype), or
            torch.float16 / "fp16" for infer() only (step() raises ValueError: fp16 gradients
            underflow without loss scaling, which the pipeline does not do).
        offload: True (RamTorch's default): a chunked stage (a list in stage_modules, or
            chunk_modules) streams its weights from host RAM (pinned on a GPU) through
            ramstream's weight streamer, chunk by chunk (StreamedStage: OffloadModel's
            machinery); its parameters and their `.grad` live in host memory between steps.
            False: chunked stages run resident. Plain module stages are always resident.
        offload_window, offload_pin, offload_keep_activations: a streamed stage's `window`
            (device slots, the running chunk included), `pin` (evenly spaced resident chunks) and
            keep_activations (True, or "checkpoint"/False: recompute), as OffloadModel's; "auto"
            (default): the planner's choice within device_memory (bytes or None per stage; the
            pipeline guide has the arithmetic), listed in `offload_plan`.
        offload_grad_accum, offload_acc_slots: checked and accepted; they change nothing
            (gradients always go home as they are produced, summed there).
        fake_compute: None, or {"fwd": s, "bwd": s} (seconds, or a list per stage) slept at each op
            of step() and infer() once its input arrived (a stage's seconds split over its chunks):
            schedule timing; "replace" (or "replace": True in the dict): the ops skip the kernels,
            zeros of the real shapes flow, weights and .grad are untouched (fake.py).
        offload_activations, offload_act_slots: True pages what each stage's forwards save for
            backward to host memory (pinned on a GPU) beyond offload_act_slots forwards per stage,
            back at their backward (paging.py; bit-identical; activation_stats() counts it).
        offload_chunk_major: True: when a stage's schedule runs several forwards (or backwards) of
            a streamed stage in a row, each chunk runs over all of them while loaded
            (chunk_major.py): GPipe loads each chunk twice per step instead of twice per
            microbatch; bit-identical. "auto" (default): True for the streamed stages whose device
            runs another stage too (or a one-stage pipeline), where no overlap between devices is
            lost. False: microbatch by microbatch (RamTorch's order). Not with chunks_per_stage
            > 1, offload_activations or fake_compute.

    Threads and streams: the stage threads are daemons named ramstream-pipeline-<stage>; close()
    (or the pipeline's collection) stops them. On CUDA every stage has its own stream; stages
    hand activations and gradients over with CUDA events, a step waits for its stages on the host
    but never synchronizes a device: it returns once the caller's current streams are ordered after
    the stages' work (outputs, losses and .grad are safe to use on them). Not thread-safe: one
    step() or infer() at a time (a second one raises RuntimeError).
    """

    def __init__(
        self,
        model=None,
        example_input=None,
        split_spec=None,
        *,
        stage_modules=None,
        chunk_modules=None,
        chunks_per_stage=None,
        devices=None,
        overlap: bool = True,
        autocast=None,
        offload: bool = True,
        offload_window="auto",
        offload_pin="auto",
        offload_keep_activations=True,
        offload_grad_accum: str = "stream",
        offload_acc_slots=None,
        offload_activations: bool = False,
        offload_act_slots: int = 2,
        offload_chunk_major="auto",
        device_memory=None,
        fake_compute=None,
    ) -> None:
        self._threads: list = []
        self._closed = False
        if not isinstance(overlap, bool):
            raise TypeError(f"Pipeline: overlap must be a bool, got {type(overlap).__name__}")
        if not isinstance(offload, bool):
            raise TypeError(f"Pipeline: offload must be a bool, got {type(offload).__name__}")
        check_offload(
            offload_window,
            offload_pin,
            offload_keep_activations,
            offload_grad_accum,
            offload_acc_slots,
            offload_activations,
            offload_act_slots,
        )
        self.autocast_dtype = check_autocast(autocast)
        self.overlap, self.offload = overlap, offload
        devs = check_devices(devices, None) if devices is not None else None
        if model is not None:
            if stage_modules is not None or chunk_modules is not None:
                raise ValueError("Pipeline: give model or stage_modules/chunk_modules, not both")
            if chunks_per_stage is not None:
                raise ValueError("Pipeline: chunks_per_stage needs stage_modules or chunk_modules, not model")
            if devs is None:
                devs = check_devices(None, None)
            stage_modules = split_model(model, split_spec, len(devs) if split_spec is None else None)
        elif split_spec is not None or example_input is not None:
            raise ValueError("Pipeline: split_spec and example_input go with model=")
        elif stage_modules is None and chunk_modules is None:
            raise ValueError("Pipeline: give stage_modules, chunk_modules, or model (an nn.Sequential)")
        default_k = len(devs) if devs is not None else len(check_devices(None, None))
        pieces, v = dice(stage_modules, chunk_modules, chunks_per_stage, default_k)
        if len(pieces) % v:
            raise ValueError(f"Pipeline: {len(pieces)} modules do not make chunks_per_stage={v} per stage")
        n = len(pieces) // v
        if devs is None:
            devs = check_devices(None, n)
        elif len(devs) != n:
            raise ValueError(f"Pipeline: devices has {len(devs)} entries for {n} stages")
        self.devices = devs
        self.num_stages = n
        self.chunks_per_stage = v
        self._fake = check_fake_compute(fake_compute, n)
        choices = stream_choices(pieces, n, offload, device_memory, offload_window, offload_pin)
        self.offload_plan = [ch for ch in choices if ch is not None]
        streams = [torch.cuda.Stream(device=d) if d.type == "cuda" else None for d in devs]
        self._chunks = []
        for c, piece in enumerate(pieces):
            s = c % n
            if isinstance(piece, list) and offload:
                mod = StreamedStage(
                    piece,
                    devs[s],
                    window=choices[c].window,
                    pin=choices[c].pin,
                    keep_activations=offload_keep_activations,
                )
            else:
                mod = Sequence(piece) if isinstance(piece, list) else piece
                mod.to(devs[s])
            self._chunks.append(Chunk(mod, devs[s], s, streams[s], self.autocast_dtype))
        self._streamed = [ch.module for ch in self._chunks if isinstance(ch.module, StreamedStage)]
        self._grouped = grouped_chunks(offload_chunk_major, self._chunks, v, StreamedStage)
        self._pagers = [StagePager(d, offload_act_slots) for d in devs] if offload_activations else None
        self._params = check_params(self._chunks)
        self._flushed = False  # flush_grads() ran and no step since: the next step starts a new sum
        self._host_opt = None  # optimizer(): the host optimizer while attached (host_optim.py)
        self._hinted = False  # checks.schedule_hint's advice given
        self._lock = threading.Lock()
        self._stream: InferStream | None = None
        self._session: TrainSession | None = None
        if overlap:
            self._threads = [StageThread(s) for s in range(n)]
        self._finalizer = weakref.finalize(self, stop_all, list(self._threads), list(self._streamed))

    # ---- what users read ---------------------------------------------------------------------------
    @property
    def modules(self) -> list:
        """The chunk modules in pipeline order (one per stage unless chunks_per_stage > 1)."""
        return [ch.module for ch in self._chunks]

    def parameters(self):
        """Every parameter of the stages, once each, in pipeline order (for an optimizer)."""
        return iter(self._params)

    def __repr__(self) -> str:
        devs = ", ".join(str(d) for d in self.devices)
        return (
            f"Pipeline(stages={self.num_stages}, chunks_per_stage={self.chunks_per_stage}, devices=[{devs}])"
        )

    # ---- running -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Pipeline: the pipeline is closed")

    def _execute(self, run: Run, ops) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                "Pipeline: a step() or infer() is already running (from another thread, or from inside a "
                "stage), or an infer_open() stream or a train_session() is open (close it first)"
            )
        try:
            run.mark_start()
            if self.overlap:
                for s, t in enumerate(self._threads):
                    t.submit(functools.partial(run.run_stage, s))
                left = len(self._threads)
                try:
                    while left:
                        run.done.get()
                        left -= 1
                except BaseException as e:  # an interrupt: stop the stages, wait for them, re-raise
                    run.exchange.fail(e)
                    while left:
                        run.done.get()
                        left -= 1
                    raise
            else:
                run.run_serial(schedules.execution_order(ops, len(self._chunks)))
            run.join_streams()
            if run.exchange.error is not None:
                raise run.exchange.error
        except torch.OutOfMemoryError as e:  # where, the schedule's arithmetic, what holds less
            raise out_of_memory(e, run, stages=self.num_stages, chunks_per_stage=self.chunks_per_stage,
                                devices=self.devices, paging=bool(self._pagers)) from e  # fmt: skip
        finally:
            self._lock.release()

    def _profiled(self, run, ops, trace_path, profile_path) -> None:
        check_paths(trace_path=trace_path, profile_path=profile_path)
        t0 = time.perf_counter()
        if profile_path is None:
            self._execute(run, ops)
        else:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                self._execute(run, ops)
            prof.export_chrome_trace(os.fspath(profile_path))
        if trace_path is not None:
            run.write_trace(trace_path, t0)

    def step(
        self,
        data,
        *,
        targets=None,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        loss_fn=None,
        trace_path=None,
        profile_path=None,
        grad_outputs=None,
    ) -> PipelineResult:
        """One training step: forward and backward of `n_microbatches` microbatches.

        data (a tensor, or a flat tuple: the first stage's positional arguments) and targets are
        cut along dim 0 into n_microbatches (default 4) pieces (torch.tensor_split); or data is
        pre-split: a tuple/list of microbatches, each a tuple of tensors (microbatch.py; targets
        and grad_outputs then one entry per microbatch, or a tensor cut at their rows; the
        guide has the rules). Per microbatch the loss is
        loss_fn(output, target) (without loss_fn and targets: output.sum(), RamTorch's default),
        and loss / n_microbatches is backpropagated, so the gradients are those of the mean of
        the microbatch losses: the full-batch mean when the microbatches are equal and loss_fn
        averages over rows. grad_outputs (instead of loss_fn) gives the gradient of the last
        stage's output: a tensor or tuple of the full batch (cut like data; None entries for
        outputs that get none), or a callable (output, target) -> gradient per microbatch; it
        is backpropagated as given (not divided), so `.grad` is the gradient of the objective it
        is the gradient of. schedule: "1f1b" (textbook one-forward-one-backward, RamTorch's
        "staggered_1b1f"), "gpipe", "interleaved" (chunks_per_stage > 1); every schedule gives
        the same gradients bit for bit. A stage's input arrives as a fresh leaf tensor: a stage
        must not begin with an in-place op on it (nn.ReLU(inplace=True)).

        Gradients: a step adds its gradients into each trained parameter's `.grad` when it
        succeeded as a whole (after flush_grads() the next step starts a new sum instead). A
        step that raises, in any stage, in forward, backward or the loss, stops every stage,
        leaves every `.grad` and weight as before it, and raises the first error; the next step
        runs normally. Buffers a forward updates (BatchNorm statistics) keep the microbatches that
        ran. Returns a PipelineResult (outputs, losses, loss). trace_path: a Chrome/Perfetto trace
        of the ops per stage (host times); profile_path: a torch.profiler trace of the step.
        """
        self._check_open()
        if self.autocast_dtype == torch.float16:
            raise ValueError(
                "Pipeline.step: autocast=float16 cannot train: fp16 gradients underflow without loss "
                "scaling (GradScaler), which the pipeline does not apply; use autocast=torch.bfloat16 "
                "(fp16 stays available for infer())"
            )
        inputs, cut, presplit = cut_inputs("Pipeline.step", data, n_microbatches)
        n = len(inputs)
        ops = schedules.build(schedule, self.num_stages, n, self.chunks_per_stage)
        host_optim.check_step(self, schedule, n)
        if not self._hinted:
            hint = schedule_hint(schedules.canonical(schedule), self.devices, self._grouped, n)
            if hint is not None:
                self._hinted = True
                warnings.warn(hint, UserWarning, stacklevel=2)
        tg = cut("targets", targets) if targets is not None else [None] * n
        loss_fn, grads = loss_or_grads(loss_fn, grad_outputs, targets, cut, presplit, n)
        run = Run(
            self._chunks, ops, inputs, tg, loss_fn=loss_fn if grads is None else None, grads=grads,
            train=True, trace=trace_path is not None, pagers=self._pagers, fake=self._fake,
            grouped=self._grouped,
        )  # fmt: skip
        replace = self._fake is not None and self._fake.replace  # .grad and every weight untouched
        stash = [(p, p.grad) for p in self._params if p.requires_grad and not replace]
        streamed = [] if replace else self._streamed
        host_optim.begin_step(self, n)
        for p, _ in stash:
            p.grad = None  # this step's gradients accumulate apart: committed only if it all succeeds
        ok = False
        for st in streamed:
            st.begin()
        try:
            self._profiled(run, ops, trace_path, profile_path)
            ok = True
        finally:
            host_optim.end_step(self, ok)
            try:
                for pg in self._pagers or []:
                    pg.reset()  # a failed step's paged activations go back to the pool
                for st in streamed:
                    st.end(ok)  # streamed gradients (landed at home) into .grad, or dropped
            finally:
                if ok and not replace:
                    commit_grads(stash, fresh=self._flushed)
                    self._flushed = False
                else:
                    for p, old in stash:
                        p.grad = old
        losses = [x for x in run.losses if x is not None] if grads is None else []
        return PipelineResult(run.outputs, losses, self)

    def infer(self, data, *, n_microbatches: int | None = None, trace_path=None, profile_path=None):
        """Forward only, under no_grad: data cut into n_microbatches (default 4) along dim 0, or
        pre-split as step() takes it, pipelined through the stages (stage s runs microbatch k while
        stage s+1 runs k-1); returns the last stage's outputs concatenated along dim 0 (a tuple
        output: element-wise), or for pre-split data a tuple of the outputs per microbatch."""
        self._check_open()
        inputs, _, presplit = cut_inputs("Pipeline.infer", data, n_microbatches)
        n = len(inputs)
        ops = schedules.forwards(self.num_stages, len(self._chunks), n)
        run = Run(
            self._chunks, ops, inputs, [None] * n, loss_fn=None, grads=None, train=False,
            trace=trace_path is not None, fake=self._fake, grouped=self._grouped,
        )  # fmt: skip
        try:
            self._profiled(run, ops, trace_path, profile_path)
        finally:
            for st in self._streamed:
                st.streamer.evict_all()
        return tuple(run.outputs) if presplit else cat_outputs(run.outputs)

    # ---- streaming inference (streaming.py) -------------------------------------------------------
    def infer_open(self) -> InferStream:
        """Opens (or returns the open) streaming-inference session (streaming.py), served by the
        stage threads until closed (its close(), a `with` block, or close()); step()/infer() raise
        RuntimeError meanwhile."""
        self._check_open()
        refuse_replace(self._fake, "infer_open()")
        if self._stream is not None:
            return self._stream
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("Pipeline.infer_open: a step(), infer() or train_session() is active")
        self._stream = InferStream(self._chunks, self._threads, self._end_stream)
        return self._stream

    def _end_stream(self) -> None:
        for st in self._streamed:
            st.streamer.evict_all()
        self._stream = None
        self._lock.release()

    def infer_submit(self, x) -> InferHandle:
        """Queues one item (a tensor or a tuple of the first stage's arguments; not cut) into the
        open stream (opened if none is) and returns its InferHandle at once: result(timeout=None)
        is the last stage's output (the stages run in order under no_grad) or raises the error a
        stage raised for this item (the other items go on). Stage s runs item i while stage s+1
        runs item i-1."""
        return self.infer_open().submit(x)

    def infer_loop(self, items, *, max_in_flight: int | None = None, timeout: float | None = None):
        """Yields the results of `items` (as infer_submit takes them) in order, at most
        max_in_flight (default 2 per stage) submitted ahead, on the open stream or on one it opens
        and closes. timeout: seconds per result (TimeoutError)."""
        opened = self._stream is None
        stream = self.infer_open()
        try:
            yield from stream.loop(items, max_in_flight=max_in_flight, timeout=timeout)
        finally:
            if opened:
                stream.close()

    def activation_stats(self) -> list:
        """Per stage, what offload_activations moved since construction (StagePager.stats():
        packs, kept, paged, paged_bytes, fetched, fetched_bytes, resident_peak, host pool bytes);
        [] without offload_activations."""
        return [pg.stats() for pg in self._pagers or []]

    def set_offload_pinned(self, pinned, *, optimizers=(), force: bool = False) -> dict:
        """Between steps, re-pins the streamed stages' chunks (RamTorch's; pinning.py, the guide)."""
        return set_offload_pinned(self, pinned, optimizers=optimizers, force=force)

    def train_session(
        self, *, optimizer_factory, n_microbatches=4, loss_fn, schedule="pipedream_2bw", max_inflight=None,
        optimizer_device=None,
    ) -> TrainSession:  # fmt: skip
        """A PipeDream-2BW training session (twobw.py TrainSession; the pipeline guide: one update
        stale, per-stage local updates; step()/infer() raise RuntimeError until it is closed)."""
        self._check_open()
        refuse_replace(self._fake, "train_session()")
        return TrainSession(
            self, optimizer_factory=optimizer_factory, n_microbatches=n_microbatches, loss_fn=loss_fn,
            schedule=schedule, max_inflight=max_inflight, optimizer_device=optimizer_device,
        )  # fmt: skip

    def optimizer(self, params=None, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **options):
        """ramstream's host AdamW over the streamed chunks, each updated during the backward once
        its gradient of the step has landed (OffloadModel.optimizer()'s options and meaning;
        host_optim.py has the scope, the pipeline guide the rest). Returns a PipelineAdamW."""
        self._check_open()
        return host_optim.build(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options
        )

    # ---- gradients and lifetime --------------------------------------------------------------------
    def flush_grads(self, scale: float = 1.0) -> None:
        """RamTorch's "accumulators -> .grad", with one meaning (OffloadModel's): every step()
        since the last flush has added its gradients (each already the mean over its
        microbatches) into `.grad`; this multiplies that sum by `scale` (k steps accumulated:
        scale=1/k for their mean) and marks it flushed, so the next step() starts a new sum
        instead of adding (opt.zero_grad() is then optional, as in RamTorch). A second flush
        with no step between changes nothing. PipelineResult.flush_grads() is this method."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"Pipeline.flush_grads: scale must be a real number, got {type(scale).__name__}")
        if scale != 1 and self._host_opt is not None:
            raise ValueError(
                "Pipeline.flush_grads: the host optimizer takes the gradients (none reach .grad)"
            )
        if scale != 1 and not self._flushed:
            with torch.no_grad():
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        self._flushed = True

    def close(self) -> None:
        """Stops the stage threads (after the step in progress); idempotent. The modules and
        their parameters stay where they are."""
        if self._closed:
            return
        if self._stream is not None:
            self._stream.close()
        if self._session is not None:
            self._session.close()
        self._closed = True
        self._finalizer.detach()
        for t in self._threads:
            t.stop(wait=True)
        self._threads = []
        if self._host_opt is not None:
            self._host_opt.close()  # its updates end; the stages get slabs of their own back
        for st in self._streamed:
            st.close()
        for pg in self._pagers or []:
            pg.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
