"""The pipeline's pure split arithmetic (no torch, no nn.Module): contiguous counts of pieces per
stage that minimise the slowest stage's load (parameters, child counts or measured seconds, one
routine for all), weighted per device, under an optional per-device memory budget."""

from __future__ import annotations

__all__ = ["OPTIMIZER_BYTES_PER_ELEMENT", "partition", "stage_bytes"]

OPTIMIZER_BYTES_PER_ELEMENT = 8  # AdamW's two fp32 moments per trainable element


def stage_bytes(param_bytes: int, trainable_elements: int, trainable_bytes: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) in bytes of a piece resident on its device: its
    parameters, a gradient per trainable parameter (the parameter's dtype) and AdamW's two fp32
    moments per trainable element."""
    return param_bytes, trainable_bytes, trainable_elements * OPTIMIZER_BYTES_PER_ELEMENT


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
    if not all(w > 0 and w != float("inf") for w in dw):
        raise ValueError(f"PipelineModel: device_weights must be positive and finite, got {device_weights!r}")
    return dw


def _budgets(device_memory, n: int) -> list[float] | None:
    if device_memory is None:
        return None
    if isinstance(device_memory, (str, bytes)) or not hasattr(device_memory, "__len__"):
        raise TypeError(
            "PipelineModel: device_memory must be a list of bytes (or None) per stage, got "
            f"{type(device_memory).__name__}"
        )
    if len(device_memory) != n:
        raise ValueError(f"PipelineModel: device_memory has {len(device_memory)} entries for {n} stages")
    out = []
    for b in device_memory:
        if b is None:
            out.append(float("inf"))
        elif isinstance(b, bool) or not isinstance(b, (int, float)) or not b >= 0:
            raise ValueError(
                f"PipelineModel: device_memory entries must be bytes >= 0 or None, got {device_memory!r}"
            )
        else:
            out.append(float(b))
    return out


def _solve(weights, n, dw, sizes, budgets):
    """best[n][k] and the cuts of the DP; a stage whose bytes exceed its budget is not a choice."""
    k = len(weights)
    pre, pre_b = [0], [0]
    for w in weights:
        pre.append(pre[-1] + w)
    for b in sizes or [0] * k:
        pre_b.append(pre_b[-1] + b)
    inf = float("inf")
    # best[s][i]: the smallest heaviest load placing the first i pieces on the first s stages
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for s in range(1, n + 1):
        cap = inf if budgets is None else budgets[s - 1]
        for i in range(s, k - (n - s) + 1):
            for j in range(i - 1, s - 2, -1):  # latest cut first: ties leave later stages smaller
                if pre_b[i] - pre_b[j] > cap:
                    break  # earlier cuts only add bytes
                cost = max(best[s - 1][j], (pre[i] - pre[j]) / dw[s - 1])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    return best, cut


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
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"balance: the number of stages must be an int >= 1, got {n!r}")
    if k < n:
        raise ValueError(
            f"PipelineModel: cannot split {k} children into {n} stages (one child at least each)"
        )
    if any(not w >= 0 or w == float("inf") for w in weights):
        raise ValueError(f"PipelineModel: piece loads must be finite and >= 0, got {list(weights)!r}")
    dw = _device_weights(device_weights, n)
    caps = _budgets(budgets, n)
    if caps is not None and sizes is None:
        raise ValueError("partition: budgets need sizes (bytes per piece)")
    best, cut = _solve(weights, n, dw, sizes, caps)
    if best[n][k] == float("inf"):
        raise MemoryError(_no_fit(weights, n, dw, sizes, caps, detail))
    counts, i = [], k
    for s in range(n, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB"


def _no_fit(weights, n, dw, sizes, caps, detail) -> str:
    """Why no split fits: the balanced split's stages against the budgets, each stage's bytes
    as parameters + gradients + optimizer state."""
    _, cut = _solve(weights, n, dw, None, None)
    counts, i = [], len(weights)
    for s in range(n, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    counts.reverse()
    lines, a = [], 0
    for s, c in enumerate(counts):
        b = sum(sizes[a : a + c])
        parts = ""
        if detail is not None:
            p, g, o = (sum(d[x] for d in detail[a : a + c]) for x in range(3))
            parts = f"parameters {_gib(p)} + gradients {_gib(g)} + optimizer {_gib(o)} = "
        cap = "unlimited" if caps[s] == float("inf") else _gib(caps[s])
        mark = " (too big)" if b > caps[s] else ""
        lines.append(f"stage {s} (pieces {a}-{a + c - 1}): {parts}{_gib(b)} of {cap}{mark}")
        a += c
    big = max(range(len(sizes)), key=lambda x: sizes[x])
    total = sum(caps)
    return (
        f"PipelineModel: no contiguous split of the {len(sizes)} pieces fits device_memory: they need "
        f"{_gib(sum(sizes))} in all (parameters + gradients + {OPTIMIZER_BYTES_PER_ELEMENT} bytes of "
        f"AdamW state per trainable element), the budgets sum to "
        f"{'unlimited' if total == float('inf') else _gib(total)}, the largest piece ({big}) needs "
        f"{_gib(sizes[big])}; the balanced split would be: " + "; ".join(lines)
    )
