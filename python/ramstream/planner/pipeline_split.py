"""The pipeline's split, decided (pure arithmetic: no torch, no nn.Module): contiguous pieces per
stage minimising the slowest stage's load (parameters, children or seconds) / device weight under
per-device memory budgets (partition, split_pipeline -> PipelineSplit), and a streamed stage's
window and pinned chunks within its device's budget (choose_streaming -> StageStreaming).

Bytes a piece needs on its device (stage_bytes): resident, its parameters, a gradient per trained
parameter (the parameter's dtype) and AdamW's two fp32 moments per trained element
(rules.PIPELINE_OPTIMIZER_BYTES); streamed (Pipeline(offload=True)), a chunk occupies a window
slot with its parameters and gradients while it runs (the optimizer's state stays with the home
copy in host memory), and a pinned chunk is resident. A streamed stage needs
    pinned chunks' resident bytes + min(window, streamed chunks) x the largest streamed chunk's slot.
Activations are not counted (the budgets are for weights, gradients and optimizer state).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..blocks import spaced
from .rules import PIPELINE_OPTIMIZER_BYTES, PIPELINE_STREAM_WINDOW

__all__ = [
    "OPTIMIZER_BYTES_PER_ELEMENT",
    "PipelineSplit",
    "PipelineStage",
    "StageStreaming",
    "check_budgets",
    "choose_streaming",
    "partition",
    "pinned_streaming",
    "split_pipeline",
    "stage_bytes",
]

OPTIMIZER_BYTES_PER_ELEMENT = PIPELINE_OPTIMIZER_BYTES  # pipeline/partition.py's name
BALANCES = ("params", "children", "time")
OFFLOADS = (False, True, "auto")
_INF = float("inf")


def stage_bytes(param_bytes: int, trainable_elements: int, trainable_bytes: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) in bytes of a piece resident on its device: its
    parameters, a gradient per trainable parameter (the parameter's dtype) and AdamW's two fp32
    moments per trainable element."""
    return param_bytes, trainable_bytes, trainable_elements * OPTIMIZER_BYTES_PER_ELEMENT


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB"


def _device_weights(device_weights, n: int) -> list[float]:
    if device_weights is None:
        return [1.0] * n
    try:
        dw = [float(w) for w in device_weights]
    except (TypeError, ValueError):
        raise TypeError(
            f"PipelineModel: device_weights must be a list of numbers, got {device_weights!r}"
        ) from None
    if len(dw) != n:
        raise ValueError(f"PipelineModel: device_weights has {len(dw)} entries for {n} stages")
    if not all(w > 0 and w != _INF for w in dw):
        raise ValueError(f"PipelineModel: device_weights must be positive and finite, got {device_weights!r}")
    return dw


def _budgets(device_memory, n: int, where: str = "PipelineModel") -> list[float] | None:
    """device_memory (bytes per stage, None entries unlimited) as floats (inf: unlimited);
    TypeError / ValueError naming it."""
    if device_memory is None:
        return None
    if isinstance(device_memory, (str, bytes)) or not hasattr(device_memory, "__len__"):
        raise TypeError(
            f"{where}: device_memory must be a list of bytes (or None) per stage, got "
            f"{type(device_memory).__name__}"
        )
    if len(device_memory) != n:
        raise ValueError(f"{where}: device_memory has {len(device_memory)} entries for {n} stages")
    out = []
    for b in device_memory:
        if b is None:
            out.append(_INF)
        elif isinstance(b, bool) or not isinstance(b, (int, float)) or not b >= 0:
            raise ValueError(
                f"{where}: device_memory entries must be bytes >= 0 or None, got {device_memory!r}"
            )
        else:
            out.append(float(b))
    return out


def check_budgets(device_memory, n: int, where: str = "Pipeline") -> list[int | None] | None:
    """device_memory checked (a list of bytes >= 0 or None per stage, or None): the list with
    None for unlimited entries; TypeError / ValueError naming it."""
    caps = _budgets(device_memory, n, where)
    return None if caps is None else [None if c == _INF else int(c) for c in caps]


def _solve(weights, n, dw, fits):
    """best[n][k] and the cuts of the DP; fits(stage, j, i) says whether pieces j..i-1 fit the
    stage's budget (None: always), and must stay False when j moves earlier."""
    k = len(weights)
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)
    # best[s][i]: the smallest heaviest load placing the first i pieces on the first s stages
    best = [[_INF] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for s in range(1, n + 1):
        for i in range(s, k - (n - s) + 1):
            for j in range(i - 1, s - 2, -1):  # latest cut first: ties leave later stages smaller
                if fits is not None and not fits(s - 1, j, i):
                    break  # earlier cuts only add bytes
                cost = max(best[s - 1][j], (pre[i] - pre[j]) / dw[s - 1])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    return best, cut


def _counts(cut, n: int, k: int) -> list[int]:
    counts, i = [], k
    for s in range(n, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]


def _check_loads(weights, n, k) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"balance: the number of stages must be an int >= 1, got {n!r}")
    if k < n:
        raise ValueError(
            f"PipelineModel: cannot split {k} children into {n} stages (one child at least each)"
        )
    if any(not w >= 0 or w == _INF for w in weights):
        raise ValueError(f"PipelineModel: piece loads must be finite and >= 0, got {list(weights)!r}")


def partition(weights, n: int, device_weights=None, *, sizes=None, budgets=None, detail=None) -> list[int]:
    """Contiguous counts (one per stage, each >= 1) of `weights` (a load per piece: parameters,
    1 per child, or seconds) minimising the heaviest stage's load / device_weights[stage] (None:
    equal; a faster device has a larger weight and takes more); among ties the later stages are
    the smaller (a parameter-free child stays with the layer before it).

    sizes (bytes per piece) and budgets (bytes per stage, None entries unlimited) constrain the
    split: every stage's bytes fit its budget. No split fitting: MemoryError with the arithmetic
    (`detail`, per piece (parameters, gradients, optimizer) bytes, spells out the sums). ValueError
    when there are fewer pieces than stages or a bad device weight or budget."""
    k = len(weights)
    _check_loads(weights, n, k)
    dw = _device_weights(device_weights, n)
    caps = _budgets(budgets, n)
    if caps is not None and sizes is None:
        raise ValueError("partition: budgets need sizes (bytes per piece)")
    fits = None
    if caps is not None:
        pre_b = [0]
        for b in sizes:
            pre_b.append(pre_b[-1] + b)

        def fits(s, j, i):
            return pre_b[i] - pre_b[j] <= caps[s]

    best, cut = _solve(weights, n, dw, fits)
    if best[n][k] == _INF:
        raise MemoryError(_no_fit(weights, n, dw, sizes, caps, detail))
    return _counts(cut, n, k)


def _no_fit(weights, n, dw, sizes, caps, detail) -> str:
    """Why no split fits: the balanced split's stages against the budgets, each stage's bytes
    as parameters + gradients + optimizer state."""
    _, cut = _solve(weights, n, dw, None)
    counts = _counts(cut, n, len(weights))
    lines, a = [], 0
    for s, c in enumerate(counts):
        b = sum(sizes[a : a + c])
        parts = ""
        if detail is not None:
            p, g, o = (sum(d[x] for d in detail[a : a + c]) for x in range(3))
            parts = f"parameters {_gib(p)} + gradients {_gib(g)} + optimizer {_gib(o)} = "
        cap = "unlimited" if caps[s] == _INF else _gib(caps[s])
        mark = " (too big)" if b > caps[s] else ""
        lines.append(f"stage {s} (pieces {a}-{a + c - 1}): {parts}{_gib(b)} of {cap}{mark}")
        a += c
    big = max(range(len(sizes)), key=lambda x: sizes[x])
    total = sum(caps)
    return (
        f"PipelineModel: no contiguous split of the {len(sizes)} pieces fits device_memory: they need "
        f"{_gib(sum(sizes))} in all (parameters + gradients + {OPTIMIZER_BYTES_PER_ELEMENT} bytes of "
        f"AdamW state per trainable element), the budgets sum to "
        f"{'unlimited' if total == _INF else _gib(total)}, the largest piece ({big}) needs "
        f"{_gib(sizes[big])}; the balanced split would be: " + "; ".join(lines)
    )


# ---- a streamed stage's window and pinned chunks ----------------------------------------------------


@dataclass(frozen=True)
class StageStreaming:
    """A streamed stage's choice: `window` device slots for streamed chunks (the running one
    included), `pin` evenly spaced resident chunks (`pinned`: their indices in the stage, as
    blocks.spaced picks them). slot_bytes: the largest streamed chunk's parameters + gradients;
    pinned_bytes: the pinned chunks' parameters + gradients + optimizer state; device_bytes:
    pinned_bytes + min(window, streamed chunks) x slot_bytes; budget: the device's bytes (None:
    unlimited); chosen: which of window / pin the planner chose (the others were given)."""

    window: int
    pin: int
    pinned: tuple[int, ...]
    slot_bytes: int
    pinned_bytes: int
    device_bytes: int
    budget: int | None
    chosen: tuple[str, ...]

    def line(self) -> str:
        streamed = "all chunks pinned (nothing streams)" if self.slot_bytes == 0 else (
            f"window {self.window} x {_gib(self.slot_bytes)} (largest streamed chunk: parameters + gradients)"
        )  # fmt: skip
        cap = "no budget" if self.budget is None else f"budget {_gib(self.budget)}"
        how = f" ({' and '.join(self.chosen)} chosen)" if self.chosen else " (given)"
        return (
            f"pin {self.pin} {list(self.pinned)} = {_gib(self.pinned_bytes)} resident + {streamed} = "
            f"{_gib(self.device_bytes)} of {cap}{how}"
        )


def _streaming_need(chunks, pinned, window) -> tuple[int, int, int]:
    """(slot bytes, pinned bytes, device bytes) of a stage's chunks with `pinned` resident."""
    rest = [c for i, c in enumerate(chunks) if i not in pinned]
    slot = max((c[0] + c[1] for c in rest), default=0)
    res = sum(sum(c) for i, c in enumerate(chunks) if i in pinned)
    return slot, res, res + min(window, len(rest)) * slot


def _check_choice(name: str, v, lo: int, hi: int | None):
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"Pipeline: {name} must be {rng} or 'auto', got {v!r}")
    return v


def choose_streaming(chunks, budget=None, *, window=None, pin=None, stage: int = 0) -> StageStreaming:
    """The window and the pinned chunks of a streamed stage whose chunks need `chunks` bytes, each
    (parameters, gradients, optimizer state), on a device of `budget` bytes (None: unlimited).
    window / pin: an int (given: kept) or None / "auto" (chosen). The window is
    rules.PIPELINE_STREAM_WINDOW, or 1 when that does not fit; then as many pinned chunks as the
    budget leaves (none without a budget). Not even the given (or a 1-chunk) window fits:
    MemoryError with the arithmetic."""
    n = len(chunks)
    w = _check_choice("offload_window", window, 1, None)
    p = _check_choice("offload_pin", pin, 0, n)
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0
    ):
        raise ValueError(f"Pipeline: device_memory entries must be bytes >= 0 or None, got {budget!r}")
    chosen = tuple(k for k, v in (("window", w), ("pin", p)) if v is None)
    windows = [w] if w is not None else list(range(PIPELINE_STREAM_WINDOW, 0, -1))
    if budget is None or budget == _INF:
        pins = [p if p is not None else 0]
    else:
        pins = [p] if p is not None else list(range(n, -1, -1))
    for win in windows:
        for k in pins:
            pinned = spaced(k, n) if k else set()
            slot, res, need = _streaming_need(chunks, pinned, win)
            if budget is None or budget == _INF or need <= budget:
                cap = None if budget is None or budget == _INF else int(budget)
                return StageStreaming(win, k, tuple(sorted(pinned)), slot, res, need, cap, chosen)
    k = pins[-1]
    pinned = spaced(k, n) if k else set()
    slot, res, need = _streaming_need(chunks, pinned, windows[-1])
    big = max(range(n), key=lambda i: chunks[i][0] + chunks[i][1]) if n else 0
    raise MemoryError(
        f"Pipeline: streamed stage {stage} does not fit its device_memory: pin {k} ({_gib(res)} resident: "
        f"parameters + gradients + {OPTIMIZER_BYTES_PER_ELEMENT} B of AdamW state per trained element) + "
        f"window {windows[-1]} x {_gib(slot)} (the largest streamed chunk, {big}: parameters + gradients) = "
        f"{_gib(need)} > {_gib(budget)}; give the stage fewer or smaller chunks, or more memory"
    )


def pinned_streaming(chunks, pinned, window: int, budget=None, *, stage: int = 0, force: bool = False):
    """choose_streaming's arithmetic for pinned chunks chosen by hand (Pipeline.set_offload_pinned):
    the StageStreaming of a streamed stage whose chunks need `chunks` bytes, each (parameters,
    gradients, optimizer state), with the chunk indices `pinned` resident and `window` slots.
    Needing more than `budget` (bytes; None: unlimited): MemoryError with the arithmetic, unless
    force (then the StageStreaming shows device_bytes > budget)."""
    pins = set(pinned)
    slot, res, need = _streaming_need(chunks, pins, window)
    cap = None if budget is None or budget == _INF else int(budget)
    if cap is not None and need > cap and not force:
        raise MemoryError(
            f"Pipeline.set_offload_pinned: stage {stage} with chunks {sorted(pins)} pinned needs {res} B resident "
            f"(parameters + gradients + {OPTIMIZER_BYTES_PER_ELEMENT} B of AdamW state per trained element) + "
            f"window {window} x {slot} B (the largest streamed chunk: parameters + gradients) = {need} B "
            f"({_gib(need)}) > its budget {cap} B ({_gib(cap)}: device_memory less the device's resident "
            "pieces, shared by its streamed pieces; offload_plan's budget); pin fewer chunks, or pass force=True"
        )
    return StageStreaming(window, len(pins), tuple(sorted(pins)), slot, res, need, cap, ())


# ---- the whole split ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a PipelineSplit: pieces start..stop-1; load (what the split balanced) and
    time (seconds, when piece times were given; else None); its device weight; bytes of its
    parameters, gradients and optimizer state (resident); device_bytes (the prediction: resident
    bytes, or streaming.device_bytes when the stage streams) and budget (None: unlimited)."""

    index: int
    start: int
    stop: int
    load: float
    time: float | None
    weight: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    device_bytes: int
    budget: int | None
    streaming: StageStreaming | None = None

    @property
    def count(self) -> int:
        return self.stop - self.start

    @property
    def resident_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class PipelineSplit:
    """The planner's pipeline split: `stages` in order, balanced by `balance`, `streamed` when the
    stages stream their chunks (Pipeline(offload=True)); `lines`: why, with the arithmetic."""

    balance: str
    stages: tuple[PipelineStage, ...]
    streamed: bool
    lines: tuple[str, ...]

    @property
    def counts(self) -> list[int]:
        """Pieces per stage (PipelineModel.counts)."""
        return [s.count for s in self.stages]

    @property
    def boundaries(self) -> list[int]:
        """The first piece of every stage after the first."""
        return [s.start for s in self.stages[1:]]

    def shares(self) -> list[float]:
        """Each stage's share of the total time (or of the load, without times)."""
        vals = [s.time if s.time is not None else s.load for s in self.stages]
        total = sum(vals)
        return [v / total if total > 0 else 1.0 / len(vals) for v in vals]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["counts"], d["boundaries"], d["shares"] = self.counts, self.boundaries, self.shares()
        return d

    def explain(self) -> str:
        return "\n".join(self.lines)


def _loads(balance, params, times, k) -> list[float]:
    if balance not in BALANCES:
        raise ValueError(
            f"PipelineModel: balance must be one of {', '.join(map(repr, BALANCES))}, got {balance!r}"
        )
    if balance == "time":
        if times is None:
            raise ValueError("split_pipeline: balance='time' needs times (seconds per piece)")
        return [float(t) for t in times]
    if balance == "params":
        return [float(p) for p in params]
    return [1.0] * k


def split_pipeline(
    n: int,
    *,
    params,
    detail=None,
    times=None,
    balance: str = "params",
    budgets=None,
    device_weights=None,
    offload=False,
) -> PipelineSplit:
    """The split of k pieces (in order) over n stages. params: parameter elements per piece;
    detail: per piece (parameters, gradients, optimizer state) bytes (stage_bytes; needed with
    budgets); times: seconds per piece (balance="time" needs them; else they only fill the time
    column); balance: "params", "children" or "time"; budgets: bytes per stage (None entries:
    unlimited); device_weights: relative speed per stage. offload: False (every stage resident:
    partition's split), True (every stage streams its pieces as chunks: each stage's budget must
    hold one window slot of its largest piece; then choose_streaming per stage) or "auto"
    (resident when a resident split fits, else streamed). MemoryError with the arithmetic when
    nothing fits."""
    k = len(params)
    if offload not in OFFLOADS or isinstance(offload, int) and not isinstance(offload, bool):
        raise ValueError(f"split_pipeline: offload must be False, True or 'auto', got {offload!r}")
    if times is not None and len(times) != k:
        raise ValueError(f"PipelineModel: piece_times has {len(times)} entries for {k} children")
    loads = _loads(balance, params, times, k)
    _check_loads(loads, n, k)
    dw = _device_weights(device_weights, n)
    caps = _budgets(budgets, n)
    detail = [tuple(int(x) for x in d) for d in detail] if detail is not None else [(0, 0, 0)] * k
    if len(detail) != k:
        raise ValueError(f"split_pipeline: detail has {len(detail)} entries for {k} pieces")
    sizes = [sum(d) for d in detail]
    streamed = offload is True
    if not streamed:
        try:
            counts = partition(loads, n, dw, sizes=sizes if caps else None, budgets=caps, detail=detail)
        except MemoryError:
            if offload != "auto":
                raise
            streamed = True
    if streamed:
        slots = [d[0] + d[1] for d in detail]

        def fits(s, j, i):
            return caps is None or max(slots[j:i]) <= caps[s]

        best, cut = _solve(loads, n, dw, fits)
        if best[n][k] == _INF:
            big = max(range(k), key=lambda i: slots[i])
            raise MemoryError(
                f"split_pipeline: even streamed, no contiguous split fits device_memory: a stage needs at "
                f"least one window slot of its largest piece (parameters + gradients); piece {big} needs "
                f"{_gib(slots[big])}, the budgets are "
                + ", ".join("unlimited" if c == _INF else _gib(c) for c in caps)
            )
        counts = _counts(cut, n, k)
    return _assemble(balance, counts, loads, times, dw, detail, caps, streamed)


def _assemble(balance, counts, loads, times, dw, detail, caps, streamed) -> PipelineSplit:
    stages, a = [], 0
    lines = [
        f"pipeline split over {len(counts)} stages by {balance}"
        + (", each stage streaming its pieces" if streamed else ", stages resident")
        + ": the heaviest stage's load / device weight is the smallest of every contiguous split"
    ]
    for s, c in enumerate(counts):
        b = a + c
        p, g, o = (sum(d[x] for d in detail[a:b]) for x in range(3))
        cap = None if caps is None or caps[s] == _INF else int(caps[s])
        st = choose_streaming(detail[a:b], cap, stage=s) if streamed else None
        dev = st.device_bytes if st is not None else p + g + o
        t = None if times is None else float(sum(times[a:b]))
        stage = PipelineStage(s, a, b, float(sum(loads[a:b])), t, dw[s], p, g, o, dev, cap, st)
        stages.append(stage)
        of = "" if cap is None else f" of {_gib(cap)}"
        lines.append(
            f"stage {s}: pieces {a}-{b - 1}, load {stage.load:.6g} / weight {dw[s]:g}, parameters "
            f"{_gib(p)} + gradients {_gib(g)} + optimizer {_gib(o)} = {_gib(p + g + o)}"
            + (f"; streamed: {st.line()}" if st is not None else f"{of} on the device")
        )
        a = b
    return PipelineSplit(balance, tuple(stages), streamed, tuple(lines))
