"""Issue 11's benchmark rows: LoRA on quantized (NF4) bases and load_model, each configuration in a
process of its own, under a per-process VRAM cap.

Rows (--rows, in the order given):
  Q14   LoRA r16 on a Qwen2.5-14B shape, 4x512, 24 GiB cap, wrap(quantize="auto", prefer="speed"):
        NF4 with every block in VRAM; targets <= 0.5 s/step and peak <= 20 GiB
  G70   LoRA r16 on a Llama-3-70B shape (hidden 8192, intermediate 28672, 64 heads, 8 KV heads,
        vocab 128256), NF4 base from load_model(random_weights=True), 1x512, 24 GiB cap, every
        block streamed (param_offload=True). Built with fewer than 80 layers (--g70-layers, default
        4,8: loading 80 layers of random weights takes minutes); s/step, peak VRAM and RAM at 80
        layers are extrapolated linearly from the two counts, and the table says so
  LOAD  load_model(quantize="nf4") of a sharded safetensors checkpoint written here (random
        weights, Qwen2.5-7B shape, bf16) against AutoModelForCausalLM.from_pretrained +
        quantize_model: seconds and peak RSS of each, in fresh processes (page cache warm for both)
  Q14B  the baseline of Q14: the bf16 base streamed (param_offload=True, quantize="none"), as in
        the weight-streaming benchmark's E_stream row

Each training configuration reports s/step (median of --steps after --warmup), peak GiB
(torch.cuda.max_memory_allocated over the process), host RSS peak, the quantize decision and the
streamed blocks. An out-of-memory or a refusal reports OOM, a missing package SKIP; the next one
runs in any case. --deadline bounds the whole run (a configuration that would start with under
30 s left is skipped). No network is needed: configs are built here, weights are random.

    python bench/train/bench_quant.py --deadline 360 --out quant.json      # the GPU machine
    python bench/train/bench_quant.py --tiny --device cpu --out q.json     # every path, seconds
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from profile_step import profiled_step, train_step  # noqa: E402
from quant_report import summarize  # noqa: E402
from stream_models import LORA_TARGETS, QWEN, build_qwen, fast_init_  # noqa: E402
from stream_report import write_results  # noqa: E402

GIB = 2**30
LLAMA70 = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
)
LLAMA_TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
)


def _c(name, row, kind, **kw) -> dict:
    c = dict(name=name, row=row, kind=kind, model="qwen14b", cap_gib=24, batch=4, seq=512)
    c.update(options={}, layers=None, timeout=200, target_s=None, target_peak=None)
    c.update(kw)
    return c


# fmt: off
CONFIGS = [
    _c("Q14_nf4", "Q14", "train", options={"quantize": "auto", "prefer": "speed"}, target_s=0.5,
       target_peak=20.0, timeout=240),
    _c("G70_L{}", "G70", "train70", batch=1, options={"param_offload": True}, timeout=200),
    _c("LOAD_write", "LOAD", "write", model="qwen7b", cap_gib=0, timeout=200),
    _c("LOAD_ramstream", "LOAD", "load", model="qwen7b", cap_gib=0, timeout=150),
    _c("LOAD_hf", "LOAD", "hf_load", model="qwen7b", cap_gib=0, timeout=200),
    _c("Q14B_bf16_stream", "Q14B", "train", options={"param_offload": True, "quantize": "none"},
       timeout=300),
]
# fmt: on
ROWS = list(dict.fromkeys(c["row"] for c in CONFIGS))


# ---- one configuration, in its own process ----------------------------------------------------
def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _device(args, cap_gib):
    import torch

    dev = torch.device(args.device)
    if dev.type == "cuda":
        from vram_cap import cap_vram

        dev = cap_vram("cuda", cap_gib)
    return dev


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _llama_folder(args, layers: int) -> str:
    """A folder holding only config.json of the 70B shape (or its tiny stand-in) with `layers`."""
    from transformers import LlamaConfig

    shape = LLAMA_TINY if args.tiny else LLAMA70
    cfg = LlamaConfig(**shape, num_hidden_layers=layers, tie_word_embeddings=False, use_cache=False)
    folder = tempfile.mkdtemp(prefix="rs_bench_g70_")
    cfg.save_pretrained(folder)
    return folder


def _lora(model):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, cfg)


def _train(args, cfg: dict, res: dict) -> None:
    import torch

    import ramstream

    dev = _device(args, cfg["cap_gib"])
    cuda = dev.type == "cuda"
    options = dict(cfg["options"])
    if not cuda and options.get("quantize") == "auto":
        options["quantize"] = "nf4"  # the CPU engine never quantizes on its own: the tiny run's stand-in
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if cfg["kind"] == "train70":
        # imported before the clock, as in the LOAD row (transformers' Trainer, peft: seconds
        # that are no part of loading); reported as import_s
        import peft  # noqa: F401

        from ramstream.integrations.huggingface import load_model

        folder = _llama_folder(args, cfg["layers"])
        res["import_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            model = load_model(folder, quantize="nf4", random_weights=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        res["load_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        model.train()
        model = _lora(model)
        res["lora_s"] = time.perf_counter() - t1
        vocab = model.config.vocab_size
    else:
        model, vocab = build_qwen(
            "qwen_tiny" if args.tiny else cfg["model"], torch.device("cpu"), None, False
        )
    res["build_s"] = time.perf_counter() - t0
    trained = [p for p in model.parameters() if p.requires_grad]
    res["trained_params"] = sum(p.numel() for p in trained)
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.1)
    model, opt = ramstream.wrap(model, opt, device=str(dev), **options)
    _sync(dev)
    res["setup_s"] = time.perf_counter() - t0
    rep = ramstream.memory_report(model)
    res["quantize"] = rep["params"]["quantization"]
    res["streamed_blocks"] = len(rep["params"]["streamed_blocks"])
    res["plan_weights"] = rep["plan"].get("weights")
    res["rss_after_setup_gib"] = _rss_gib()
    x = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), device=dev)
    if cuda:
        res["peak_setup_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
    times, h2d0 = [], 0

    def weight_h2d() -> int:
        return ramstream.memory_report(model)["params"]["stream"].get("bytes_h2d", 0)

    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            h2d0 = weight_h2d()
        _sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        res["loss_last"] = loss.item()
        del loss
        _sync(dev)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    st = opt.stats()
    res.update(status="OK", s_per_step=times[len(times) // 2], min_s=times[0], max_s=times[-1])
    res["stream"] = ramstream.memory_report(model)["params"]["stream"]
    res["bytes_h2d_total"] = st.get("bytes_h2d")
    res["weights_h2d_per_step"] = (weight_h2d() - h2d0) / args.steps  # streamed slabs, codes included
    res["events_tail"] = list(rep["events"])[-6:]
    if args.profile:  # one more step under torch.profiler, after the timed ones (their time is kept)
        res.update(profiled_step(dev, lambda: train_step(model, opt, x, dev)))


def _write(args, cfg: dict, res: dict) -> None:
    """A sharded bf16 safetensors checkpoint of the 7B shape (random weights) in args.ckpt."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    shape = QWEN["qwen_tiny" if args.tiny else cfg["model"]]
    conf = Qwen2Config(**shape, tie_word_embeddings=False, use_cache=False)
    t0 = time.perf_counter()
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    fast_init_(model)
    res["build_s"] = time.perf_counter() - t0
    tmp = args.ckpt + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    model.save_pretrained(tmp, max_shard_size="100KB" if args.tiny else "4GB")
    shutil.rmtree(args.ckpt, ignore_errors=True)
    os.replace(tmp, args.ckpt)  # a complete checkpoint or none
    res["write_s"] = time.perf_counter() - t0
    files = [f for f in os.listdir(args.ckpt) if f.endswith(".safetensors")]
    res["shards"] = len(files)
    res["checkpoint_gib"] = sum(os.path.getsize(os.path.join(args.ckpt, f)) for f in files) / GIB
    res["status"] = "OK"


def _digest(model) -> str:
    """SHA-1 of the first block's packed codes and absmax (equal loads pack equal bytes)."""
    import torch

    from ramstream.activations import find_blocks

    h = hashlib.sha1()
    for n, b in sorted(find_blocks(model)[0].named_buffers()):
        if n.endswith(("weight_codes", "weight_absmax")):
            h.update(n.encode())
            h.update(memoryview(b.contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _load(args, cfg: dict, res: dict) -> None:
    import torch

    import ramstream
    from ramstream.quant import is_quantized

    # the modules are imported before the clock starts (ramstream.integrations.huggingface imports
    # transformers' Trainer, seconds that are no part of loading); reported as import_s
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM

    from ramstream.integrations.huggingface import load_model

    res["import_s"] = time.perf_counter() - t0
    res["rss_before_gib"] = _rss_gib()
    times, model = [], None
    for i in range(max(1, args.load_repeat)):  # the median of a few loads in this process
        if i:
            model = None  # the last load's memory goes back first
            gc.collect()
        t0 = time.perf_counter()
        if cfg["kind"] == "load":
            model = load_model(args.ckpt, quantize="nf4", dtype=torch.bfloat16)
            rep = None
        else:
            model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16)
            model.requires_grad_(False)  # a LoRA base: quantize_model packs frozen weights only
            rep = ramstream.quantize_model(model, "nf4")
        times.append(time.perf_counter() - t0)
        if i == 0:
            res["peak_rss_gib"] = _rss_gib()  # the first load's, before anything else allocates
    res["load_s"] = statistics.median(times)
    res["load_s_each"] = times
    res["quantized_modules"] = sum(is_quantized(m) for m in model.modules())
    res["bytes_after"] = rep["bytes_after"] if rep else None
    res["digest"] = _digest(model)
    res["status"] = "OK"


def run_config(args, cfg: dict) -> dict:
    import torch

    out = {k: cfg[k] for k in ("name", "row", "kind", "cap_gib", "batch", "seq", "options", "layers")}
    out.update(device=args.device, pid=os.getpid(), tiny=args.tiny)
    t_start = time.perf_counter()
    try:
        if cfg["kind"] in ("train", "train70"):
            _train(args, cfg, out)
        elif cfg["kind"] == "write":
            _write(args, cfg, out)
        else:
            _load(args, cfg, out)
    except torch.OutOfMemoryError as e:
        out.update(status="OOM", error="torch.OutOfMemoryError: " + str(e).split("\n")[0][:200])
    except MemoryError as e:  # wrap() refusing, host RAM, page-lock budget
        out.update(status="OOM", error="MemoryError: " + str(e)[:400])
    except ImportError as e:
        out.update(status="SKIP", error=f"not importable: {e}")
    except Exception as e:  # reported, not raised: the driver goes on with the next one
        import traceback

        out.update(status="ERROR", error=f"{type(e).__name__}: {str(e)[:300]}")
        out["traceback"] = traceback.format_exc()[-1500:]
    out["process_s"] = time.perf_counter() - t_start
    out["host_rss_gib"] = _rss_gib()
    if args.device == "cuda":
        out["peak_gib"] = max(torch.cuda.max_memory_allocated() / GIB, out.get("peak_setup_gib") or 0.0)
    return out


# ---- the driver (never touches the device) -----------------------------------------------------
def _spawn(args, cfg: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--config", json.dumps(cfg), "--ckpt", args.ckpt]
    cmd += ["--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--load-repeat", str(args.load_repeat)]
    if args.tiny:
        cmd.append("--tiny")
    if args.profile:
        cmd.append("--profile")
    base = {k: cfg[k] for k in ("name", "row", "kind", "layers")}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return dict(base, status="TIMEOUT", error=f"over {timeout:.0f} s: {err[-300:]}", wall_s=timeout)
    got = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if got:
        r = got[-1]
    else:
        err = (p.stderr or p.stdout)[-600:]
        oom = "OutOfMemoryError" in err or "out of memory" in err
        r = dict(base, status="OOM" if oom else "CRASH", error=f"rc {p.returncode}: {err}")
    r["wall_s"] = time.perf_counter() - t0
    return r


def plan_configs(rows: list[str], g70_layers: list[int]) -> list[dict]:
    out = []
    for r in rows:
        for c in CONFIGS:
            if c["row"] != r:
                continue
            if c["kind"] == "train70":
                out += [dict(c, name=c["name"].format(n), layers=n) for n in g70_layers]
            else:
                out.append(dict(c))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="Q14,G70,LOAD,Q14B")
    ap.add_argument(
        "--g70-layers", default=None, help="layer counts (>= 2) of the 70B shape (default 4,8; tiny 2,3)"
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes of every model (smoke run)")
    ap.add_argument("--deadline", type=float, default=0, help="seconds for the whole run (0: none)")
    ap.add_argument("--ckpt", default=None, help="where LOAD writes its checkpoint (removed after)")
    ap.add_argument("--keep-ckpt", action="store_true")
    ap.add_argument("--load-repeat", type=int, default=3, help="LOAD: loads per process (median)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="each training configuration runs one more step under torch.profiler after the timed "
        "ones: top ops by device and CPU time, device busy time against wall time",
    )
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.config:
        print("RESULT " + json.dumps(run_config(args, json.loads(args.config)), default=str), flush=True)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"--rows: unknown {bad}; known: {', '.join(ROWS)}")
    layers = [int(x) for x in (args.g70_layers or ("2,3" if args.tiny else "4,8")).split(",")]
    own_ckpt = args.ckpt is None
    if own_ckpt:
        args.ckpt = os.path.join(tempfile.mkdtemp(prefix="rs_bench_quant_"), "ckpt")
    t_run = time.perf_counter()
    results: list[dict] = []
    try:
        for cfg in plan_configs(rows, layers):
            timeout = cfg["timeout"] + 4 * (cfg.get("layers") or 0)  # G70: loading takes ~1-2 s a layer
            if cfg["kind"] in ("load", "hf_load") and not os.path.isdir(args.ckpt):
                r = dict(name=cfg["name"], row=cfg["row"], kind=cfg["kind"], status="SKIP")
                r["error"] = "no checkpoint (LOAD_write did not run)"
            elif args.deadline and args.deadline - (time.perf_counter() - t_run) < 30:
                left = args.deadline - (time.perf_counter() - t_run)
                r = dict(name=cfg["name"], row=cfg["row"], kind=cfg["kind"], status="SKIP")
                r["error"] = f"out of time ({left:.0f} s of --deadline left)"
            else:
                if args.deadline:
                    timeout = min(timeout, args.deadline - (time.perf_counter() - t_run) - 5)
                r = _spawn(args, cfg, timeout)
            results.append(r)
            brief = {k: r.get(k) for k in ("name", "status", "s_per_step", "peak_gib", "wall_s", "error")}
            print(json.dumps(brief, default=str), flush=True)
            if args.out:
                write_results(args.out, results)
    finally:
        if not args.keep_ckpt:
            shutil.rmtree(os.path.dirname(args.ckpt) if own_ckpt else args.ckpt, ignore_errors=True)
    print()
    print("\n".join(summarize(results, CONFIGS)))
    print(f"total {time.perf_counter() - t_run:.0f} s")
    if args.out:
        write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
