"""Benchmark (issue 12): the Hugging Face Trainer, stock vs ramstream's OffloadTrainer, on a Qwen2-1.5B
shape (random weights), full fine-tune, 10 steps, bf16; uncapped and under a 12 GiB VRAM cap.

Configurations, each in its own subprocess (a fresh CUDA context, its own peak):
  stock            transformers.Trainer, no cap                      (the baseline)
  stock_again      the same once more                                its own run-to-run loss difference
  ramstream        OffloadTrainer (wrap() defaults), no cap          losses vs stock, step-time ratio
  stock_cap12      transformers.Trainer under the 12 GiB cap         expected: out of memory
  ramstream_cap12  OffloadTrainer under the 12 GiB cap               s/step, peak VRAM
  ramstream_hfloss OffloadTrainer with chunked_loss=False, no cap     the chunked loss's share
The cap is torch.cuda.set_per_process_memory_fraction(cap / total, 0), set before the model is
built. Both trainers get the same TrainingArguments: fp32 weights with bf16 autocast (bf16=True;
the stock AdamW then updates fp32 weights as ramstream's fp32 masters do, so the losses can agree
to 2e-4; --weights bf16 trains bf16 weights, where they are not expected to), warm-up, gradient
accumulation, max_grad_norm=1.0, logging every step. s/step is the median time between the
Trainer's step ends after --skip steps; peak VRAM is torch.cuda.max_memory_allocated over the
whole process. --deadline bounds the whole run (a configuration that would start with under 30 s
left is SKIPped); --tiny runs a tiny Qwen2 on the CPU in seconds (no cap there: every
configuration trains, and the losses are compared all the same).

    python bench/train/bench_trainer.py --deadline 540 --out trainer.json      # the GPU machine
    python bench/train/bench_trainer.py --tiny --out trainer_tiny.json         # any machine
    python bench/train/bench_trainer.py --summarize trainer.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {  # name: (trainer, cap in GiB or None, OffloadTrainer options added to --options)
    "stock": ("stock", None, {}),
    # the stock Trainer once more: its own run-to-run difference, the floor of any loss comparison
    "stock_again": ("stock", None, {}),
    "ramstream": ("ramstream", None, {}),
    "stock_cap12": ("stock", 12.0, {}),
    "ramstream_cap12": ("ramstream", 12.0, {}),
    # Hugging Face's own loss instead of the chunked one: what the chunked loss costs or saves
    "ramstream_hfloss": ("ramstream", None, {"chunked_loss": False}),
}
BASELINE = "stock"
TOL = 2e-4
# Qwen2-1.5B: hidden 1536, MLP 8960, 28 layers, 12 heads (2 KV), vocab 151936, tied embeddings
SHAPES = {
    "qwen2-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    ),
}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", help=f"comma-separated configurations (default all: {', '.join(CONFIGS)})")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    ap.add_argument("--skip", type=int, default=2, help="steps left out of s/step (default 2)")
    ap.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size (default 4)")
    ap.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps (default 2)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per row (default 1024)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default 1e-5; 3e-3 with --tiny)")
    ap.add_argument(
        "--options", default="{}", help="JSON: wrap() options for the ramstream rows (default {})"
    )
    ap.add_argument("--weights", choices=("fp32", "bf16"), default="fp32", help="weights' dtype (see above)")
    ap.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16: bf16 autocast (the timed benchmark); fp32: no autocast, no TF32, eager attention and "
        "torch.use_deterministic_algorithms, where the stock Trainer repeats itself exactly and a "
        "2e-4 loss comparison means something (see stock_again)",
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when present")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen2 on the CPU, seconds")
    ap.add_argument("--deadline", type=float, default=0, help="seconds for the whole run (0: none)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per configuration (default 300)")
    ap.add_argument("--summarize", metavar="JSON", help="print the table of an earlier --out file")
    ap.add_argument("--out", help="results as JSON (rewritten after each configuration)")
    ap.add_argument(
        "--profile",
        default="",
        help="comma-separated configurations whose steps 5-6 run under torch.profiler: the top ops by "
        "self CPU and by self device time go into their result (profile_cpu, profile_device)",
    )
    ap.add_argument("--config", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.device, a.seq, a.batch = a.device or "cpu", min(a.seq, 32), min(a.batch, 2)
    if a.lr is None:
        a.lr = 3e-3 if a.tiny else 1e-5
    try:
        a.wrap_options = json.loads(a.options)
    except ValueError as e:
        ap.error(f"--options: not JSON ({e})")
    if not isinstance(a.wrap_options, dict):
        ap.error(f"--options: a JSON object of wrap() options, got {a.options!r}")
    return a


# ---- one configuration (the subprocess) ------------------------------------------------------------
def _dataset(n: int, seq: int, vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return rows


def run_config(a, name: str) -> dict:
    import torch

    kind, cap, extra_opts = CONFIGS[name]
    a.wrap_options = {**a.wrap_options, **extra_opts}
    cuda = a.device == "cuda"
    res = {"name": name, "kind": kind, "cap_gib": cap if cuda else None, "device": a.device, "status": "OK"}
    res.update(batch=a.batch, accum=a.accum, seq=a.seq, lr=a.lr, weights=a.weights, precision=a.precision)
    if kind == "ramstream":
        res["options"] = a.wrap_options
    if cuda and cap:
        from vram_cap import cap_vram

        cap_vram("cuda:0", cap)
    t0 = time.perf_counter()
    try:
        _train(a, kind, cuda, res)
    except torch.OutOfMemoryError as e:
        res.update(status="OOM", error="torch.OutOfMemoryError: " + str(e).split("\n")[0][:200])
    except MemoryError as e:  # wrap() refusing with the plan's arithmetic
        res.update(status="OOM", error="MemoryError: " + str(e).split("\n")[0][:300])
    except Exception as e:  # reported, not raised: the driver goes on
        import traceback

        res.update(status="ERROR", error=f"{type(e).__name__}: {str(e)[:300]}")
        res["traceback"] = traceback.format_exc()[-1500:]
    res["process_s"] = time.perf_counter() - t0
    if cuda:
        res["peak_vram_gib"] = torch.cuda.max_memory_allocated(0) / 2**30
    return res


def _train(a, kind: str, cuda: bool, res: dict) -> None:
    import torch
    import transformers

    from ramstream.integrations.huggingface import OffloadTrainer

    shape = SHAPES["tiny" if a.tiny else "qwen2-1.5b"]
    exact = a.precision == "fp32"
    if exact:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True)
        shape = dict(shape, attn_implementation="eager")  # SDPA's backward kernels use atomics
    cfg = transformers.Qwen2Config(**shape, max_position_embeddings=max(a.seq, 4096))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    from ramstream.integrations.random_init import init_module_

    with no_init_weights():  # torch's one-core normal draws took ~15 s of each process
        model = transformers.Qwen2ForCausalLM(cfg)  # on the CPU: the same weights in every process
    for m in model.modules():  # HF's distributions, drawn on every core (seeded above)
        init_module_(m, cfg.initializer_range, model._init_weights)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if a.weights == "bf16":
        model = model.to(torch.bfloat16)
    res["build_s"] = time.perf_counter() - t0
    res["params"] = sum(p.numel() for p in model.parameters())
    times: list[float] = []

    profile = res["name"] in a.profile.split(",")
    prof = {}

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if profile and state.global_step == 4 and not prof:  # steps 5 and 6
                acts = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if cuda else []
                )
                prof["p"] = torch.profiler.profile(activities=acts)
                prof["p"].__enter__()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())
            if "p" in prof and state.global_step == 6:
                p = prof.pop("p")
                p.__exit__(None, None, None)
                ka = p.key_averages()
                res["profile_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=25)
                if cuda:
                    res["profile_device"] = ka.table(sort_by="self_device_time_total", row_limit=25)

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=a.batch,
            gradient_accumulation_steps=a.accum,
            max_steps=a.steps,
            learning_rate=a.lr,
            warmup_steps=2,
            lr_scheduler_type="linear",
            weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=not cuda,
            bf16=cuda and not exact,
            seed=0,
            disable_tqdm=True,
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            dataloader_num_workers=0,
        )
        data = _dataset(a.steps * a.batch * a.accum, a.seq, cfg.vocab_size)
        opts = dict(a.wrap_options) if cuda else dict(a.wrap_options, device="cpu")
        extra = {} if kind == "stock" else {"ramstream": opts}
        cls = transformers.Trainer if kind == "stock" else OffloadTrainer
        trainer = cls(model=model, args=args, train_dataset=data, callbacks=[Timer()], **extra)
        t0 = time.perf_counter()
        times.append(t0)
        trainer.train()
        res["train_s"] = time.perf_counter() - t0
    res["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    steps = [b - c for c, b in zip(times, times[1:])]
    res["step_s"] = steps
    # the profiled steps (5, 6) and the next one (the profiler's teardown) are not timed
    profiled = {4, 5, 6} if profile else set()
    res["untimed_steps"] = sorted(i + 1 for i in profiled)
    kept = [s for i, s in enumerate(steps) if i >= a.skip and i not in profiled] or steps
    res["s_per_step"] = statistics.median(kept) if kept else None
    if kind == "ramstream":
        import ramstream
        from ramstream.integrations.huggingface import _unpeft

        m = (
            trainer.model
            if getattr(trainer.model, "_ramstream", None) is not None
            else _unpeft(trainer.model)
        )
        rep = ramstream.memory_report(m)
        res["host_state_gib"] = rep["optimizer"]["host_state_bytes"] / 2**30
        res["streamed_blocks"] = len(rep["params"]["streamed_blocks"])
        res["optimizer_mode"] = rep["optimizer"]["mode"]
        res["resident"] = rep["optimizer"]["resident"]
        res["events"] = rep["events"][-6:]


# ---- the driver ------------------------------------------------------------------------------------
def _spawn(a, name: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--config", name, "--device", a.device]
    for flag in (
        "steps",
        "skip",
        "batch",
        "accum",
        "seq",
        "lr",
        "weights",
        "precision",
        "options",
        "profile",
    ):
        cmd += [f"--{flag}", str(getattr(a, flag))]
    if a.tiny:
        cmd.append("--tiny")
    env = dict(os.environ)
    if a.precision == "fp32":  # cuBLAS's deterministic workspaces (read when CUDA starts)
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "TIMEOUT", "error": f"over {timeout:.0f} s", "wall_s": timeout}
    got = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if got:
        r = got[-1]
    else:
        err = (p.stderr or p.stdout)[-600:]
        oom = "OutOfMemoryError" in err or "out of memory" in err
        r = {"name": name, "status": "OOM" if oom else "CRASH", "error": f"rc {p.returncode}: {err}"}
    r["wall_s"] = time.perf_counter() - t0
    return r


def compare(results: list[dict]) -> None:
    """Adds to each OK run beside an OK baseline: the largest loss difference and the step-time ratio
    (configuration / baseline; the uncapped stock Trainer is the baseline of both ramstream rows)."""
    by = {r["name"]: r for r in results}
    base = by.get(BASELINE)
    if base is None or base.get("status") != "OK":
        return
    for r in results:
        if r["name"] == BASELINE or r.get("status") != "OK":
            continue
        a, b = r.get("losses") or [], base.get("losses") or []
        if a and len(a) == len(b):
            r["max_loss_diff"] = max(abs(x - y) for x, y in zip(a, b))
            r["losses_within_tol"] = r["max_loss_diff"] <= TOL
        if r.get("s_per_step") and base.get("s_per_step"):
            r["step_time_ratio"] = r["s_per_step"] / base["s_per_step"]


def summarize(results: list[dict]) -> list[str]:
    lines = [
        f"{'configuration':<16} {'status':<8} {'s/step':>8} {'ratio':>7} {'peak VRAM':>10} {'loss diff':>10}"
    ]
    for r in results:
        sps, ratio, peak, diff = (
            r.get(k) for k in ("s_per_step", "step_time_ratio", "peak_vram_gib", "max_loss_diff")
        )
        lines.append(
            f"{r['name']:<16} {r.get('status', '?'):<8} "
            f"{f'{sps:.3f}' if sps else '-':>8} {f'{ratio:.3f}' if ratio else '-':>7} "
            f"{f'{peak:.2f} GiB' if peak is not None else '-':>10} {f'{diff:.2e}' if diff is not None else '-':>10}"
        )
        if r.get("error"):
            lines.append(f"    {r['error'][:160]}")
    return lines


def _write(path: str, results: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None) -> int:
    a = parse(argv)
    if a.summarize:
        with open(a.summarize) as f:
            print("\n".join(summarize(json.load(f))))
        return 0
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.config:
        print("RESULT " + json.dumps(run_config(a, a.config), default=str), flush=True)
        return 0
    names = a.only.split(",") if a.only else list(CONFIGS)
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"--only: unknown {bad}; accepted: {', '.join(CONFIGS)}")
    t_run, results = time.perf_counter(), []
    for name in names:
        timeout = a.timeout
        if a.deadline:
            left = a.deadline - (time.perf_counter() - t_run)
            if left < 30:
                results.append({"name": name, "status": "SKIP", "error": f"out of time ({left:.0f} s left)"})
                continue
            timeout = min(timeout, left - 5)
        r = _spawn(a, name, timeout)
        results.append(r)
        print(
            json.dumps({k: r.get(k) for k in ("name", "status", "s_per_step", "peak_vram_gib", "error")}),
            flush=True,
        )
        compare(results)
        if a.out:
            _write(a.out, results)
    compare(results)
    if a.out:
        _write(a.out, results)
    print("\n".join(summarize(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
