"""bench_pipeline.py's measurements inside a child process: one step under torch.profiler
(_profile), P4's prediction (_predict): simulate_schedule fed with the per-op times of a traced
step, each op's time alone on its device (simulate/shared.py) and, for comparison, the spans as
they are with a device per stage, and the host time of the pipeline's pieces (host_timers).

    python bench/train/pipeline_measure.py RESULTS.txt   # a table of tagged child RESULT lines
"""

from __future__ import annotations

import json
import os
import tempfile
import time


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _profile(one, path: str) -> dict:
    """One step under torch.profiler: the device's busy time (kernels, and copies apart) against
    the step's wall time; the kernels by total device time written to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = one()
    ev = prof.key_averages()
    kern = sum(e.self_device_time_total for e in ev if not e.key.startswith("Memcpy")) / 1e6
    copies = sum(e.self_device_time_total for e in ev if e.key.startswith("Memcpy")) / 1e6
    with open(path, "w") as f:
        f.write(ev.table(sort_by="self_device_time_total", row_limit=30))
    prof.export_chrome_trace(path + ".json")  # every thread and stream: profile_timeline.py
    return {"wall_s": wall, "kernels_s": kern, "copies_s": copies}


def _predict(one, args, stages: int, v: int) -> dict:
    """simulate_schedule fed with the median F / B time per chunk of a traced step."""
    from ramstream.simulate import simulate_schedule
    from ramstream.simulate.shared import exclusive_times

    fd, path = tempfile.mkstemp(suffix=".json", prefix="pipeline-step-")
    os.close(fd)
    # each span without its wait for the previous stage's activation or gradient (Exchange.take:
    # the simulator adds the dependencies itself) and, with --trace-sync on CUDA, ending when the
    # op's work on its stage's stream has (a span is otherwise when the host queued it)
    import threading

    import torch

    from ramstream.pipeline import run as run_mod
    from ramstream.pipeline import stage as stage_mod

    run_op, take, waits = run_mod.Run.run_op, stage_mod.Exchange.take, threading.local()

    def timed_take(self, *a, **k):
        t = time.perf_counter()
        try:
            return take(self, *a, **k)
        finally:
            waits.s = getattr(waits, "s", 0.0) + time.perf_counter() - t

    def timed(self, s, op):
        waits.s = 0.0
        t0 = time.perf_counter()
        if op.kind == "F":
            self.forward(s, op.chunk, op.mb)
        else:
            self.backward(s, op.chunk, op.mb)
        if args.trace_sync and torch.cuda.is_available() and self.chunks[op.chunk].device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the stage's stream (device_context)
        if self.spans is not None:
            self.spans.append((s, f"{op.kind} mb{op.mb} c{op.chunk}", t0 + waits.s, time.perf_counter()))

    run_mod.Run.run_op, stage_mod.Exchange.take = timed, timed_take
    try:
        traced_s, _ = one(trace_path=path)
        with open(path) as f:
            ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    finally:
        run_mod.Run.run_op, stage_mod.Exchange.take = run_op, take
        os.unlink(path)
    n = stages * v
    devices = args.devices.split(",")
    # each op's time alone on its device: its span less the share of the device the stages running
    # beside it took (simulate/shared.py's processor sharing, inverted; the span as is when the op
    # ran alone or every stage has a device of its own)
    alone = exclusive_times([(e["tid"] - 1, e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in ev], devices)
    per = {(k, c): [] for k in "FB" for c in range(n)}
    per_alone = {key: [] for key in per}
    for e, a in zip(ev, alone):  # name "F mb3 c1": kind, microbatch, chunk; dur in microseconds
        kind, _, c = e["name"].split()
        per[(kind, int(c[1:]))].append(e["dur"] / 1e6)
        per_alone[(kind, int(c[1:]))].append(a)
    sim = dict(stages=stages, microbatches=args.microbatches, chunks_per_stage=v)
    tf = [_median(per[("F", c)]) for c in range(n)]
    tb = [_median(per[("B", c)]) for c in range(n)]
    own = simulate_schedule(args.schedule, tf=tf, tb=tb, **sim)  # a device per stage, as before
    tf_alone = [_median(per_alone[("F", c)]) for c in range(n)]
    tb_alone = [_median(per_alone[("B", c)]) for c in range(n)]
    pred = simulate_schedule(args.schedule, tf=tf_alone, tb=tb_alone, devices=devices, **sim)
    return {
        "traced_step_s": traced_s,
        "trace_sync": args.trace_sync,
        "tf": tf,
        "tb": tb,
        "tf_alone": tf_alone,
        "tb_alone": tb_alone,
        "predicted_s": pred.makespan,
        "predicted_bubble": pred.bubble,
        "predicted_own_devices_s": own.makespan,
    }


def host_timers() -> tuple[dict, callable]:
    """Wall time of the pipeline's host-side pieces (patched in this process): the chunk-major
    forward and backward runs, each chunk's backward over the microbatches (its autograd.backward
    calls), the window / use calls of the weight streamers, the gradient landings, cast_grads'
    graph walk, the waits for another stage's activation or gradient. Returns (totals: name ->
    [seconds, calls], undo). Summed over every thread (the stage threads seldom overlap in P2's
    GPipe, whose stages on one device run one after the other)."""
    from ramstream.frontends.offload_model.grads import GradWriteback
    from ramstream.pipeline import chunk_major, stage
    from ramstream.pipeline import run as run_mod
    from ramstream.pipeline.streamed import StreamedStage
    from ramstream.weights.streamer import WeightStreamer

    totals: dict = {}
    undo = []

    def wrap(owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                v = totals.setdefault(key, [0.0, 0])
                v[0] += time.perf_counter() - t
                v[1] += 1

        setattr(owner, name, timed)
        undo.append(lambda: setattr(owner, name, fn))

    wrap(run_mod, "forward_parts", "forward run (all of it)")
    wrap(run_mod, "backward_parts", "backward run (all of it)")
    wrap(chunk_major, "_backward_chunk", "backward: autograd.backward calls")
    wrap(chunk_major, "fuse_cast_grads", "backward: cast_grads graph walk")
    wrap(WeightStreamer, "window", "streamer.window")
    wrap(WeightStreamer, "use", "streamer.use")
    wrap(StreamedStage, "land_part", "backward: land_part")
    wrap(GradWriteback, "land", "GradWriteback.land")
    wrap(StreamedStage, "end", "stage end (commit)")
    wrap(stage.Exchange, "take", "Exchange.take (waits)")

    def restore() -> None:
        for u in reversed(undo):
            u()

    return totals, restore


def print_children(path: str) -> None:
    """Prints the "[tag] RESULT {json}" lines of child runs (bench/p2_window.sh, p2_host.sh): each
    run's step, its forward + backward and optimizer parts, and its host timers when it has them."""
    import sys

    for line in open(path):
        tag, js = line.split(" RESULT ", 1)
        d = json.loads(js)
        print(
            f"{tag:<14} step {d['step_s']:.3f} forward+backward {d['pipeline_s']:.3f} "
            f"optimizer {d['optimizer_s']:.3f} steps {[round(x, 3) for x in d['steps_s']]} "
            f"peak GiB {d['peak_vram_gib']}"
        )
        for k, v in (d.get("host_timers") or {}).items():
            print(f"    {k:<40} {v[0] * 1e3:8.1f} ms/step  {v[1]:6.0f} calls/step")
    sys.stdout.flush()


if __name__ == "__main__":
    import sys

    print_children(sys.argv[1])
