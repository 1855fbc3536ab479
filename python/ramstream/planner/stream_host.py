"""The host AdamW of streamed blocks beside the weight stream, as the engine runs it: a few steps of
its queue and of the forward that waits on it, in timing.py's per-block seconds. Pure arithmetic.

What it mirrors:
- engine/updater.py: a host bucket's update is queued on the engine thread as soon as its
  gradients land in the backward (eager updates), with priority = bucket index, and
  engine/worker.py runs the lowest pending priority first, one job at a time: during the backward
  the host updates the block that landed last among those waiting, after it block 0, 1, ...
- weights/streamer.py: block k's forward pre-hook loads block k and prefetches the next `ahead`
  streamed blocks, each load first waiting on the training thread (`ready`, the engine's bucket
  wait) for that block's update; a load starts no earlier than the compute queued before it; in
  the backward a block's reload is prefetched `ahead` blocks early; the last `ahead` + 1 blocks of
  the forward stay for the backward.
- engine/intake.py: a block's gradients go down after its backward (the host share's; a mapped
  share's update runs on the GPU stream after that part's backward, gpu_updates.py).
A resident part with a host share waits at its forward for its update and the new weights' copy
(the guard). The forward trails the host when the host is slower than the backward (row F of
tests/test_planner_h200.py: every block of the 1.8B GPT streamed, 0.43 s of host AdamW against
a 0.3 s stream-bound pass): the step is then the host's work plus what it cannot overlap, from its
last update to the next backward's first landing.
"""

from __future__ import annotations

AHEAD = 2  # options.py weight_window: blocks prefetched ahead of the running one
STEPS = 4  # simulated steps: the first starts with every update done; the last cycle is the step


def parts_split(shape, split: dict, streamed) -> list[dict]:
    """Numel per placement for each part in forward (bucket) order, embed, blocks, head: a
    streamed block's trained parameters are updated on the host (engine/core.py: streamed buckets
    are never mapped); the rest fill the "device" share first, then "mapped", then "host"
    (inflight.choose_placements, core.py's first buckets in forward order to the GPU kernel)."""
    ss = set(streamed)
    parts = shape.parts
    left = {"device": split["device"], "mapped": split["mapped"]}
    out = []
    for i, q in enumerate(parts):
        numel = q.trained_numel
        if 1 <= i <= len(shape.blocks) and (i - 1) in ss:
            out.append({"device": 0, "mapped": 0, "host": numel})
            continue
        row = {}
        for k in ("device", "mapped"):
            row[k] = min(numel, left[k])
            left[k] -= row[k]
            numel -= row[k]
        row["host"] = numel
        out.append(row)
    return out


def host_cycle(*, fwd, bwd, load_f, load_b, streamed, ahead: int, outside: float, host_s, d2h_s, mapped_s,
               ready_s) -> float:  # fmt: skip
    """Seconds per step in steady state. Per block k: fwd[k], bwd[k] (compute, the recompute in
    bwd), load_f[k], load_b[k] (a streamed block's copy in the forward, in the backward); outside:
    the head and the loss, forward and backward. Per part p (0 embed, 1..n blocks, n + 1 head):
    host_s[p] its host AdamW, d2h_s[p] its gradients' copy down, mapped_s[p] its mapped update on
    the GPU stream, ready_s[p] the copy up of a resident part's new weights."""
    n = len(fwd)
    ss = set(streamed)
    done = [float("-inf")] * (n + 2)  # host update of each part finished (the previous step's)
    host_free = 0.0
    t, starts = 0.0, []
    for _ in range(STEPS):
        starts.append(t)
        py = gpu = copy = t

        def guard(p, py):
            return max(py, done[p] + ready_s[p]) if host_s[p] else py

        py = guard(0, py)
        loaded: dict[int, float] = {}
        for k in range(n):
            if k in ss:
                for j in [k] + [j for j in range(k + 1, min(n, k + 1 + ahead)) if j in ss]:
                    if j not in loaded:
                        py = max(py, done[j + 1])
                        copy = max(py, copy, gpu) + load_f[j]
                        loaded[j] = copy
                start = max(gpu, py, loaded[k])
            else:
                py = guard(k + 1, py)
                start = max(gpu, py)
            gpu = start + fwd[k]
        gpu = max(gpu, guard(n + 1, py)) + outside
        land = [0.0] * (n + 2)
        down = gpu
        down = land[n + 1] = max(gpu, down) + d2h_s[n + 1]
        gpu += mapped_s[n + 1]
        kept = {k for k in range(max(0, n - 1 - ahead), n)}
        ends = {n: gpu}
        for k in range(n - 1, -1, -1):
            start = gpu
            if k in ss and k not in kept:
                issue = ends[min(n, k + ahead + 1)]  # prefetched `ahead` blocks early
                copy = max(copy, issue) + load_b[k]
                start = max(gpu, copy)
            gpu = start + bwd[k]
            ends[k] = gpu
            down = land[k + 1] = max(gpu, down) + d2h_s[k + 1]
            gpu += mapped_s[k + 1]
        down = land[0] = max(gpu, down) + d2h_s[0]
        gpu += mapped_s[0]
        todo = {p for p in range(n + 2) if host_s[p]}
        while todo:  # the engine thread: the lowest landed bucket first, one at a time
            now = max(host_free, min(land[p] for p in todo))
            p = min(q for q in todo if land[q] <= now)
            done[p] = host_free = now + host_s[p]
            todo.discard(p)
        t = gpu
    return starts[-1] - starts[-2]
