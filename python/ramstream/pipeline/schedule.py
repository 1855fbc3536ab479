"""Pipeline schedules: for every physical stage, the order in which it runs the forwards and
backwards of every (microbatch, chunk); check() proves a schedule complete and deadlock-free.

A model is cut into `stages * chunks_per_stage` consecutive pieces, the chunks (global virtual
stages) 0 .. stages*chunks_per_stage-1. Chunk c lives on stage c % stages (the interleaved,
Megatron-LM placement: stage s holds chunks s, s+stages, s+2*stages, ...). The dependencies:

  F(mb, c)  needs F(mb, c-1) (the activation from the chunk before; chunk 0 needs nothing)
  B(mb, c)  needs B(mb, c+1) (the gradient from the chunk after) and F(mb, c) (its saved
            activations; for the last chunk this is the loss)

and a stage runs its list in order, one op at a time. Every schedule built here runs the
backwards of each chunk in microbatch order 0 .. microbatches-1: gradients then accumulate
in the same order whatever the schedule, so all schedules give bit-identical gradients.

Pure Python, no torch: the Pipeline runtime and the simulators (ramstream.simulate.pipeline)
share it.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class Op(NamedTuple):
    """One unit of pipeline work: kind "F" (forward) or "B" (backward) of microbatch `mb` through
    chunk `chunk` (the global virtual stage, 0 .. stages*chunks_per_stage-1)."""

    kind: str
    mb: int
    chunk: int


NAMES = ("gpipe", "1f1b", "interleaved", "staggered_1b1f", "1b1f")
"""The accepted schedule names; "staggered_1b1f" and "1b1f" (RamTorch's) are aliases of "1f1b"."""

_ALIASES = {"staggered_1b1f": "1f1b", "1b1f": "1f1b"}


def _count(where: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}")
    return value


def canonical(name: str) -> str:
    """The schedule `name` resolves to ("staggered_1b1f" -> "1f1b"); ValueError naming the accepted
    names for any other string."""
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, NAMES))}, got {name!r}")
    return _ALIASES.get(name, name)


def build(name: str, stages: int, microbatches: int, chunks_per_stage: int = 1) -> list[list[Op]]:
    """The op list of every stage, `result[s]` being stage s's order.

    name:
      "gpipe"        all forwards (microbatch order, chunk by chunk), then all backwards
                     (microbatch order): every stage holds every microbatch's activations.
      "1f1b"         the textbook one-forward-one-backward (PipeDream-Flush): stage s runs
                     min(stages-1-s, microbatches) warm-up forwards, then alternates one
                     forward and one backward, then the remaining backwards. It holds at most
                     stages-s microbatches' activations; same makespan as GPipe.
                     RamTorch's own "1f1b" differs: there every stage runs the same
                     stages-1 warm-up forwards (a 65-71 % bubble at 4 stages); ours is the
                     textbook schedule, which RamTorch calls "staggered_1b1f" (an alias here).
      "interleaved"  Megatron-LM's interleaved 1F1B (virtual pipeline) for chunks_per_stage
                     v >= 2: the microbatches go in groups of `stages`; a stage runs a group's
                     forwards through its first chunk, then its second, ..., and the backwards
                     through its chunks in reverse; warm-up (stages-1-s)*2 + (v-1)*stages
                     forwards, then one forward one backward. Megatron-LM requires
                     microbatches % stages == 0; any count works here: the schedule is
                     built for the count rounded up to a multiple of `stages` and the
                     padding microbatches' ops are dropped (a smaller last group idles a
                     little more). Its bubble is about 1/v of
                     1F1B's; it holds more activations. With v == 1 it is "1f1b".

    chunks_per_stage > 1 is only for "interleaved" ("gpipe" and "1f1b" run one chunk a stage).
    ValueError naming the argument and the accepted values for a bad name or count.
    """
    kind = canonical(name)
    _count("build", "stages", stages)
    _count("build", "microbatches", microbatches)
    _count("build", "chunks_per_stage", chunks_per_stage)
    if chunks_per_stage > 1 and kind != "interleaved":
        raise ValueError(
            f"build: chunks_per_stage={chunks_per_stage} needs schedule 'interleaved' "
            f"('{name}' runs chunks_per_stage=1)"
        )
    p, m = stages, microbatches
    if kind == "gpipe":
        return [[Op("F", mb, s) for mb in range(m)] + [Op("B", mb, s) for mb in range(m)] for s in range(p)]
    if kind == "1f1b" or chunks_per_stage == 1:
        out = []
        for s in range(p):
            fwd, bwd = [Op("F", mb, s) for mb in range(m)], [Op("B", mb, s) for mb in range(m)]
            out.append(_one_f_one_b(fwd, bwd, min(p - 1 - s, m)))
        return out
    # Megatron-LM's table needs microbatches % stages == 0: build it for the count rounded up to a
    # multiple of `stages` and drop the padding microbatches. Dropping ops only shortens the
    # paths between the remaining ones, so the result is deadlock-free as the padded one is.
    v, padded = chunks_per_stage, -(-m // p) * p
    out = []
    for s in range(p):
        fwd: list[Op] = []
        bwd: list[Op] = []
        for g in range(0, padded, p):
            for j in range(v):
                fwd += [Op("F", mb, j * p + s) for mb in range(g, g + p)]
                bwd += [Op("B", mb, (v - 1 - j) * p + s) for mb in range(g, g + p)]
        ops = _one_f_one_b(fwd, bwd, min((p - 1 - s) * 2 + (v - 1) * p, len(fwd)))
        out.append([op for op in ops if op.mb < m])
    return out


def forwards(stages: int, chunks: int, microbatches: int) -> list[list[Op]]:
    """Forwards only (inference): every stage's chunks in the order (microbatch group of `stages`,
    chunk, microbatch)."""
    ops = []
    for s in range(stages):
        mine = [c for c in range(chunks) if c % stages == s]
        keys = sorted((m // stages, c, m) for c in mine for m in range(microbatches))
        ops.append([Op("F", m, c) for _, c, m in keys])
    return ops


def _one_f_one_b(fwd: list[Op], bwd: list[Op], warmup: int) -> list[Op]:
    """`warmup` forwards, then one forward one backward, then the remaining backwards."""
    ops = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    return ops + bwd[len(fwd) - warmup :]


def dependencies(op: Op, chunks: int) -> list[Op]:
    """The ops `op` waits for (besides the one before it on its stage), with `chunks` the number of
    chunks: F(mb, c) waits for F(mb, c-1); B(mb, c) for B(mb, c+1) and F(mb, c)."""
    kind, mb, c = op
    if kind == "F":
        return [Op("F", mb, c - 1)] if c > 0 else []
    return ([Op("B", mb, c + 1)] if c + 1 < chunks else []) + [Op("F", mb, c)]


def execution_order(ops_per_stage, chunks: int) -> list[tuple[int, Op]]:
    """Every (stage, op) in an order that runs each op after its dependencies and after the ops
    before it on its stage (each stage's ops keep their list order). ValueError if no such order
    exists (the schedule deadlocks), naming the op each blocked stage waits at. Expects each op
    once (check() tests that first)."""
    where = {op: (s, i) for s, ops in enumerate(ops_per_stage) for i, op in enumerate(ops)}
    waiting: dict[Op, list[Op]] = {}  # op -> the ops it unblocks
    missing: dict[Op, int] = {}
    for ops in ops_per_stage:
        for i, op in enumerate(ops):
            deps = [d for d in dependencies(op, chunks) if d in where]
            if i > 0:
                deps.append(ops[i - 1])
            missing[op] = len(deps)
            for d in deps:
                waiting.setdefault(d, []).append(op)
    ready = deque(op for op, n in missing.items() if n == 0)
    order = []
    while ready:
        op = ready.popleft()
        order.append((where[op][0], op))
        for nxt in waiting.get(op, ()):
            missing[nxt] -= 1
            if missing[nxt] == 0:
                ready.append(nxt)
    if len(order) < len(where):
        done = {op for _, op in order}
        stuck = []
        for s, ops in enumerate(ops_per_stage):
            head = next((op for op in ops if op not in done), None)
            if head is not None:
                stuck.append(f"stage {s} at {_fmt(head)}")
        raise ValueError(f"the schedule deadlocks: {'; '.join(stuck)}")
    return order


def _fmt(op: Op) -> str:
    return f"{op.kind}(mb={op.mb}, chunk={op.chunk})"


def check(
    ops_per_stage, stages: int, microbatches: int, chunks_per_stage: int = 1, *, ordered_backward: bool = True
) -> None:
    """Raises ValueError unless `ops_per_stage` (one op list per stage) runs every F and B of every
    (microbatch, chunk) exactly once, each on the stage holding its chunk (chunk % stages), and
    cannot deadlock (some order runs every op after its dependencies and the ops before it on
    its stage). With `ordered_backward` (the runtime's contract), also that each chunk's
    backwards run in microbatch order. Ops may be Op or (kind, mb, chunk) tuples."""
    _count("check", "stages", stages)
    _count("check", "microbatches", microbatches)
    _count("check", "chunks_per_stage", chunks_per_stage)
    if not isinstance(ops_per_stage, (list, tuple)) or len(ops_per_stage) != stages:
        got = len(ops_per_stage) if isinstance(ops_per_stage, (list, tuple)) else type(ops_per_stage).__name__
        raise ValueError(
            f"check: ops_per_stage must be a list of {stages} op lists (one per stage), got {got}"
        )
    chunks = stages * chunks_per_stage
    seen: set[Op] = set()
    norm: list[list[Op]] = []
    for s, ops in enumerate(ops_per_stage):
        row = []
        for i, raw in enumerate(ops):
            try:
                op = Op(*raw)
            except TypeError:
                raise ValueError(f"check: stage {s} op {i} is not (kind, mb, chunk): {raw!r}") from None
            ok = op.kind in ("F", "B") and all(isinstance(x, int) and not isinstance(x, bool) for x in op[1:])
            if not ok or not (0 <= op.mb < microbatches and 0 <= op.chunk < chunks):
                raise ValueError(
                    f"check: stage {s} op {i} {raw!r}: kind must be 'F' or 'B', mb in [0, {microbatches}), "
                    f"chunk in [0, {chunks})"
                )
            if op.chunk % stages != s:
                raise ValueError(
                    f"check: {_fmt(op)} is on stage {s}; chunk {op.chunk} lives on stage {op.chunk % stages}"
                )
            if op in seen:
                raise ValueError(f"check: {_fmt(op)} appears twice")
            seen.add(op)
            row.append(op)
        norm.append(row)
    if len(seen) != 2 * microbatches * chunks:
        absent = next(
            Op(k, mb, c)
            for k in "FB"
            for mb in range(microbatches)
            for c in range(chunks)
            if Op(k, mb, c) not in seen
        )
        raise ValueError(f"check: {2 * microbatches * chunks - len(seen)} ops missing, e.g. {_fmt(absent)}")
    if ordered_backward:
        nxt = [0] * chunks
        for row in norm:
            for op in row:
                if op.kind == "B":
                    if op.mb != nxt[op.chunk]:
                        raise ValueError(
                            f"check: chunk {op.chunk}'s backwards are not in microbatch order: "
                            f"{_fmt(op)} before B(mb={nxt[op.chunk]})"
                        )
                    nxt[op.chunk] += 1
    try:
        execution_order(norm, chunks)
    except ValueError as e:
        raise ValueError(f"check: {e}") from None
