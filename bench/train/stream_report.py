"""The weight-streaming benchmark's report: the table printed per configuration and the JSON
written after each (bench_stream.py)."""

from __future__ import annotations

import json
import os


def summarize(results: list[dict], by_name: dict) -> list[str]:
    by = {r["name"]: r for r in results}
    lines = [
        f"{'config':16s} {'s/step':>8s} {'peak GiB':>8s} {'ratio':>7s} {'vs':14s} {'target':>7s} "
        f"{'result':8s} notes"
    ]
    for r in results:
        cfg = by_name.get(r["name"], {})
        ok = r.get("status") == "OK"
        s = f"{r['s_per_step']:8.3f}" if ok else f"{'-':>8s}"
        pk = r.get("peak_gib")
        pk = f"{pk:8.2f}" if ok and pk is not None else f"{'-':>8s}"
        b = by.get(cfg.get("baseline") or "")
        ratio = None
        if ok and b is not None and b.get("status") == "OK":
            ratio = r["s_per_step"] / b["s_per_step"]
            r["ratio"] = ratio
            r["baseline"] = b["name"]
        target = cfg.get("target")
        result = r.get("status", "?")
        if ok and target is not None:
            result = "-" if ratio is None else ("PASS" if ratio <= target else "FAIL")
        elif result == "OOM" and cfg.get("expect") == "oom":
            result = "OOM(exp)"
        notes = []
        if ok:
            ps = r.get("per_step") or {}
            if ps:
                h2d, d2h = ps.get("bytes_h2d", 0) / 1e9, ps.get("bytes_d2h", 0) / 1e9
                notes.append(
                    f"host {ps.get('host_update_s', 0):.3f}s wait {ps.get('wait_s', 0):.3f}s "
                    f"thr {ps.get('throttle_s', 0):.3f}s h2d {h2d:.2f}GB d2h {d2h:.2f}GB"
                )
            if ps.get("bytes_h2d_weights") is not None:
                notes.append(f"weights h2d {ps['bytes_h2d_weights'] / 1e9:.2f}GB")
            if ps.get("stream_wait_s") is not None:
                notes.append(f"stream wait {ps['stream_wait_s']:.3f}s")
            if r.get("loads_per_step") is not None:
                notes.append(f"loads/step {r['loads_per_step']:.1f}")
            if r.get("h2d_weights_util") is not None:
                notes.append(f"weight H2D {r['h2d_weights_util']:.0%} of {r['h2d_gbps']:.1f} GB/s")
            elif r.get("h2d_total_util") is not None:
                notes.append(f"all H2D {r['h2d_total_util']:.0%} of {r['h2d_gbps']:.1f} GB/s")
            if r.get("mode"):
                notes.append(f"mode {r['mode']}")
        else:
            notes.append((r.get("error") or "")[:110].replace("\n", " "))
        lines.append(
            f"{r['name']:16s} {s} {pk} {'' if ratio is None else f'{ratio:.3f}':>7s} "
            f"{(cfg.get('baseline') or '-'):14s} {'' if target is None else f'<={target:g}':>7s} "
            f"{result:8s} {'; '.join(notes)}"
        )
    return lines


def write_results(path: str, results: list[dict]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)
