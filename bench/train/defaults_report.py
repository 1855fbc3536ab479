"""bench_defaults.py's reporting: a wrapped run's plan made JSON-safe and compact (compact_plan),
and the markdown table of the runs (table: measured against predicted step and peak, the applied
plan, each defaults run's ratio to the hand32, hand or stock run of the same row and cap)."""

from __future__ import annotations

import json


def jsonable(x, depth=0):
    if isinstance(x, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        x = list(x)
        return [jsonable(v, depth + 1) for v in (x[:32] + ["..."] if len(x) > 48 else x)]
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, (int, str, bool)) or x is None:
        return x if not isinstance(x, str) else x[:300]
    return str(x)[:300]


def _predicted(x, path="") -> dict:
    """Every number under a key naming a prediction ("predicted_*", "planner", ...), by path."""
    out = {}
    if isinstance(x, dict):
        for k, v in x.items():
            p = f"{path}.{k}" if path else str(k)
            if any(w in str(k) for w in ("predict", "planner")) and not isinstance(v, (dict, list)):
                out[p] = v
            else:
                out.update(_predicted(v, p))
    elif isinstance(x, list):
        for i, v in enumerate(x[-6:]):
            out.update(_predicted(v, f"{path}[{i}]"))
    return out


PLAN_KEYS = ("planner", "predicted", "weights", "recompute", "optimizer", "recompute_keep", "activations",
             "profile", "history", "watchdog", "quantize")  # fmt: skip


def compact_plan(plan: dict | None, limit: int = 4000) -> dict:
    """memory_report(model)["plan"], JSON-safe and under ~limit bytes: the keys in PLAN_KEYS order
    (then any other), a key that would not fit replaced by the head of its text; "predicted_all"
    gathers every prediction found anywhere in it."""
    if not isinstance(plan, dict):
        return {"plan": jsonable(plan)}
    out: dict = {}
    pred = _predicted(plan)
    if pred:
        out["predicted_all"] = jsonable(dict(list(pred.items())[:24]))
    keys = [k for k in PLAN_KEYS if k in plan] + [k for k in plan if k not in PLAN_KEYS]
    for k in keys:
        v = jsonable(plan[k])
        if k == "history" and isinstance(v, list):
            v = v[-4:]
        used = len(json.dumps(out))
        text = json.dumps(v)
        if used + len(text) > limit:
            v = text[: max(0, min(200, limit - used - 40))] + "..." if limit - used > 60 else "<dropped>"
        out[k] = v
    return out


def _f(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def plan_columns(r: dict) -> tuple[str, str, str]:
    """(predicted s/step, predicted peak GiB, the plan in a few words) of a run's applied plan
    (memory_report's plan.planner, revised at step 0 when the step was larger); "-" without one."""
    plan = r.get("plan") if isinstance(r.get("plan"), dict) else {}
    pred = plan.get("predicted_all") if isinstance(plan.get("predicted_all"), dict) else {}
    step, vram = pred.get("planner.predicted_step_s"), pred.get("planner.predicted_vram_bytes")
    p = plan.get("planner")
    text = "-"
    if isinstance(p, dict):
        text = (
            f"{p.get('mode')} {p.get('batch')}x{p.get('seq')}: {len(p.get('streamed') or [])} streamed, "
            f"{len(p.get('recompute') or [])} recompute"
        )
    return _f(step, ".3f"), _f(vram / 2**30 if isinstance(vram, (int, float)) else None, ".2f"), text


def table(results: list[dict]) -> list[str]:
    by = {(r["row"], r["cap_gib"], r["variant"]): r for r in results}
    lines = ["| row | cap GiB | variant | status | s/step | predicted s/step | peak GiB | predicted peak GiB | "
             "setup s | to settled s | model TFLOP/s | moments | plan | defaults/ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        ratio = ""
        if r["variant"] in ("defaults", "sized") and r.get("s_per_step"):
            for ref in ("hand32", "hand", "stock"):
                o = by.get((r["row"], r["cap_gib"], ref))
                if o and o.get("s_per_step"):
                    ratio = f"{r['s_per_step'] / o['s_per_step']:.2f} ({ref})"
                    break
        status = r.get("status", "?")
        if status in ("oom", "error", "timeout", "crash") and r.get("phase"):
            status += f" @{r['phase']}" + (f" {r['step']}" if r.get("phase") == "step" else "")
        cap = _f(r["cap_gib"], "g") if r["cap_gib"] else "none"
        p_step, p_peak, plan = plan_columns(r)
        lines.append(
            f"| {r['row']} | {cap} | {r['variant']} | {status} | {_f(r.get('s_per_step'), '.3f')} | {p_step} | "
            f"{_f(r.get('peak_gib'), '.2f')} | {p_peak} | {_f(r.get('setup_s'), '.1f')} | "
            f"{_f(r.get('to_settled_s'), '.1f')} | {_f(r.get('model_tflops'), '.1f')} | {r.get('moment_dtype') or '-'} | "
            f"{plan} | {ratio} |"
        )
    return lines
