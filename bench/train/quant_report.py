"""bench_quant.py's summary: the table of its rows (streamed vs quantized bases, RSS, notes) and
the 70B extrapolation from the layer-count runs."""

from __future__ import annotations

GIB = 2**30


def _extrapolate(results: list[dict], layers: int = 80) -> dict | None:
    """s/step, peak VRAM and RAM of the 70B shape at `layers`, linear in the layer count through
    the two largest G70 counts that ran."""
    ok = sorted(
        (r for r in results if r["row"] == "G70" and r.get("status") == "OK"), key=lambda r: r["layers"]
    )
    if len(ok) < 2:
        return None
    a, b = ok[-2], ok[-1]
    out = {"from_layers": [a["layers"], b["layers"]], "layers": layers}
    for k in ("s_per_step", "peak_gib", "host_rss_gib"):
        if a.get(k) is not None and b.get(k) is not None:
            slope = (b[k] - a[k]) / (b["layers"] - a["layers"])
            out[k] = b[k] + slope * (layers - b["layers"])
    return out


def summarize(results: list[dict], configs: list[dict]) -> list[str]:
    lines = [f"{'config':18s} {'status':7s} {'s/step':>8s} {'peak GiB':>8s} {'RSS GiB':>8s} result  notes"]
    by = {r["name"]: r for r in results}
    for r in results:
        cfg = next((c for c in configs if c["row"] == r["row"] and c["kind"] == r["kind"]), {})
        ok = r.get("status") == "OK"
        s = f"{r['s_per_step']:8.3f}" if ok and r.get("s_per_step") is not None else f"{'-':>8s}"
        pk = f"{r['peak_gib']:8.2f}" if ok and r.get("peak_gib") is not None else f"{'-':>8s}"
        rss = f"{r.get('peak_rss_gib') or r.get('host_rss_gib') or 0:8.2f}"
        result, notes = "", []
        if ok and cfg.get("target_s") is not None and r.get("peak_gib") is not None:
            good = r["s_per_step"] <= cfg["target_s"] and r["peak_gib"] <= cfg["target_peak"]
            result = "PASS" if good else "FAIL"
            notes.append(f"targets <= {cfg['target_s']} s/step, <= {cfg['target_peak']} GiB")
        if ok and r["kind"].startswith("train"):
            q = r.get("quantize") or {}
            if r["kind"] == "train70":
                notes.append("base NF4 from load_model(random_weights=True)")
            else:
                notes.append(f"quantize {q.get('format')} ({(q.get('reason') or '')[:70]})")
            notes.append(f"{r.get('streamed_blocks')} blocks streamed")
            pw = r.get("plan_weights") or {}
            if pw.get("packed_bytes"):
                notes.append(f"packed codes in pinned RAM {pw['packed_bytes'] / GIB:.3f} GiB")
            if r.get("weights_h2d_per_step"):
                gb = r["weights_h2d_per_step"] / 1e9
                notes.append(f"weights H2D {gb:.2f} GB/step ({gb / r['s_per_step']:.1f} GB/s)")
            if r.get("load_s") is not None:
                notes.append(
                    f"imports {r.get('import_s', 0):.1f}s, load_model {r['load_s']:.1f}s, "
                    f"LoRA {r['lora_s']:.1f}s, wrap {r.get('setup_s', 0):.1f}s"
                )
            if r["kind"] == "train70":
                notes.append(f"70B-shaped, {r['layers']} of 80 layers")
        if ok and r["kind"] == "write":
            notes.append(f"{r['shards']} shards, {r['checkpoint_gib']:.2f} GiB in {r['write_s']:.1f}s")
        if ok and r["kind"] in ("load", "hf_load"):
            each = "/".join(f"{t:.2f}" for t in r.get("load_s_each", []))
            notes.append(f"median {r['load_s']:.2f}s ({each}), {r['quantized_modules']} weights packed")
            other = by.get("LOAD_hf" if r["kind"] == "load" else "")
            if other and other.get("status") == "OK":
                faster = r["load_s"] / other["load_s"]
                lower = r["peak_rss_gib"] / other["peak_rss_gib"]
                result = "PASS" if faster < 1 and lower < 1 else "FAIL"
                same = "same codes" if r["digest"] == other["digest"] else "CODES DIFFER"
                notes.append(
                    f"vs from_pretrained+quantize_model: time x{faster:.2f}, peak RSS x{lower:.2f}, {same}"
                )
        if not ok:
            notes.append((r.get("error") or "")[:110].replace("\n", " "))
        lines.append(
            f"{r['name']:18s} {r.get('status', '?'):7s} {s} {pk} {rss} {result:7s} {'; '.join(notes)}"
        )
    q, b = by.get("Q14_nf4"), by.get("Q14B_bf16_stream")
    if q and b and q.get("status") == b.get("status") == "OK":
        lines.append(
            f"Q14: NF4 resident / bf16 streamed = {q['s_per_step'] / b['s_per_step']:.3f} (s/step ratio)"
        )
    ex = _extrapolate(results)
    if ex:
        vals = ", ".join(f"{k} {ex[k]:.2f}" for k in ("s_per_step", "peak_gib", "host_rss_gib") if k in ex)
        lines.append(
            f"G70 at 80 layers, extrapolated linearly from {ex['from_layers']} layers: {vals} (every "
            "block streamed; param_offload='auto' would keep the blocks that fit resident)"
        )
    return lines
