"""The weight-streaming benchmark's report: the table printed per configuration and the JSON
written after each (bench_stream.py), and the planner's prediction recorded next to each
ramstream configuration's measurement (planner_prediction, run in the configuration's process)."""

from __future__ import annotations

import json
import os

# wrap() options plan_training() takes too (weight_window, threads... do not change the plan)
PLAN_OPTIONS = ("param_offload", "activation_offload", "activation_checkpointing", "optimizer_mode",
                "moment_dtype", "quantize", "vram_headroom")  # fmt: skip


def _shape(cfg: dict, model_key: str, cuda: bool, qwen_layers):
    """The planner's ModelShape of a configuration's model (stream_models.py's GPT and Qwen)."""
    from stream_models import GPT_MODELS, QWEN

    from ramstream.planner import ModelShape

    if model_key.startswith("gpt"):
        from gpt import CONFIGS as GPT_CONFIGS

        c = GPT_CONFIGS[GPT_MODELS[model_key]]
        size = dict(d=c["d"], layers=c["layers"], heads=c["heads"], ctx=max(1024, cfg["seq"]))
        # a bf16 model (G rows: cast after building) runs in bf16; an fp32 one under bf16 autocast
        bf16 = cfg.get("dtype") == "bf16"
        return ModelShape.gpt(size, batch=cfg["batch"], seq=cfg["seq"], dtype="bf16" if bf16 else "fp32",
                              vocab=c["vocab"], loss=cfg["loss"],
                              autocast="bf16" if cuda and not bf16 else None)  # fmt: skip
    hf = dict(QWEN[model_key], model_type="qwen2", tie_word_embeddings=False)
    if qwen_layers:
        hf["num_hidden_layers"] = qwen_layers
    return ModelShape.from_hf_config(hf, batch=cfg["batch"], seq=cfg["seq"], dtype="bf16", lora=16)


def planner_prediction(cfg: dict, model_key: str, dev, qwen_layers=None) -> dict:
    """plan_training() for the configuration on this machine's profile (ramstream.profile_hardware;
    free VRAM taken as the process's cap, what wrap() saw before the model was built):
    {"predicted_s", "bound", "mode", "streamed", "activations", "optimizer_split", "bounds"}, or
    {"predicted_error"} when planning raises (the measurement is kept either way)."""
    try:
        import dataclasses

        import ramstream
        from ramstream.planner import plan_training

        cuda = dev.type == "cuda"
        prof = ramstream.profile_hardware(dev if cuda else "cpu")
        if cuda:
            from ramstream.hardware import gpu_memory

            prof = dataclasses.replace(prof, vram_free=int(gpu_memory(dev)["cap"]))
        opts = {k: v for k, v in cfg["options"].items() if k in PLAN_OPTIONS}
        if cfg.get("ckpt"):  # Hugging Face's own checkpointing: every layer recomputes
            opts["activation_checkpointing"] = True
        plan = plan_training(_shape(cfg, model_key, cuda, qwen_layers), prof, **opts)
        acts = {k: plan.activations.count(k) for k in ("keep", "page", "recompute")}
        return {
            "predicted_s": plan.predicted["step_s"],
            "bound": plan.predicted["bound"],
            "mode": plan.mode,
            "streamed": len(plan.weights["streamed"]),
            "activations": acts,
            "optimizer_split": plan.optimizer.get("split"),
            "bounds": plan.bounds,
            "profile": {k: getattr(prof, k) for k in ("h2d_gbps", "d2h_gbps", "duplex_gbps", "adamw_gbps",
                                                      "matmul_tflops", "vram_free", "source")},
        }  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a planning failure must not lose the measurement
        return {"predicted_error": f"{type(e).__name__}: {str(e)[:300]}"}


def summarize(results: list[dict], by_name: dict) -> list[str]:
    by = {r["name"]: r for r in results}
    lines = [
        f"{'config':16s} {'s/step':>8s} {'planned':>8s} {'m/p':>5s} {'peak GiB':>8s} {'ratio':>7s} {'vs':14s} "
        f"{'target':>7s} {'result':8s} notes"
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
        pred = (r.get("planner") or {}).get("predicted_s")
        pr = f"{pred:8.3f}" if pred else f"{'-':>8s}"
        mp = f"{r['s_per_step'] / pred:5.2f}" if ok and pred else f"{'-':>5s}"
        if ok and pred:
            r["measured_over_predicted"] = r["s_per_step"] / pred
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
            wl = r.get("weight_loads") or {}
            if wl.get("gbps"):
                util = f" = {wl['util']:.0%}" if wl.get("util") is not None else ""
                notes.append(f"loads {wl['gbps']:.1f} GB/s while loading{util} (traced step)")
                for part, what in (("alone", "alone"), ("beside_d2h", "beside D2H, of duplex")):
                    pw = wl.get(part) or {}
                    if pw.get("util") is not None:
                        notes.append(f"{pw['loads']} loads {what} {pw['gbps']:.1f} GB/s = {pw['util']:.0%}")
            elif r.get("h2d_total_util") is not None:
                notes.append(f"all H2D {r['h2d_total_util']:.0%} of {r['h2d_gbps']:.1f} GB/s")
            if r.get("mode"):
                notes.append(f"mode {r['mode']}")
            pl = r.get("planner") or {}
            if pl.get("bound"):
                notes.append(f"plan {pl['mode']} bound {pl['bound']} streamed {pl['streamed']}")
            elif pl.get("predicted_error"):
                notes.append(f"plan: {pl['predicted_error'][:60]}")
        else:
            notes.append((r.get("error") or "")[:110].replace("\n", " "))
        lines.append(
            f"{r['name']:16s} {s} {pr} {mp} {pk} {'' if ratio is None else f'{ratio:.3f}':>7s} "
            f"{(cfg.get('baseline') or '-'):14s} {'' if target is None else f'<={target:g}':>7s} "
            f"{result:8s} {'; '.join(notes)}"
        )
    return lines


def write_results(path: str, results: list[dict]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)
