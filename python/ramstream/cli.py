"""`ramstream` command line: info (what ramstream sees), doctor (checks with what to do), bench
(host AdamW vs torch), demo, plan (where a model's state would live, without training).

    ramstream info
    ramstream doctor [--json]
    ramstream bench [--params N] [--repeat R]
    ramstream demo  [--device cpu|cuda|cuda:N] [--steps N]
    ramstream plan  (--config PATH | --gpt SIZE) [--vram-gb G] [--ram-gb G] [--batch B] [--seq S]
                    [--lora R] [--dtype bf16|fp32] [--h2d-gbps X --d2h-gbps X --adamw-gbps X
                    --tflops X] [--json]
                    [--stages N [--stage-vram-gb G,G,...] [--balance params|children|time]
                     [--offload auto|true|false] [--microbatches M]]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _cmd_info(args) -> int:
    from .hardware import describe

    d = describe()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    ram = d["ram"]
    print(f"ramstream {__import__('ramstream').__version__}  torch {d['torch']}")
    if d.get("isa_env_error"):
        print(f"warning: {d['isa_env_error']} (ignored)")
    print(
        f"host: ISA {d['isa']} (best {d['best_isa']}), {d['threads']} threads, "
        f"RAM {ram['total'] / 2**30:.1f} GiB total / {ram['available'] / 2**30:.1f} GiB available"
    )
    rt = d["cuda_runtime"]
    cuda = (
        f"CUDA runtime {rt // 1000}.{rt % 1000 // 10}"
        if d["built_with_cuda"]
        else "no CUDA kernels in this build"
    )
    print(
        f"build: {cuda}; GPUs seen by ramstream: {d['cuda_devices']}"
        + (f" ({d['cuda_unavailable_reason']})" if d["cuda_devices"] == 0 else "")
    )
    for i, g in enumerate(d["gpus"]):
        print(f"  cuda:{i} {g['name']}: {g['total'] / 2**30:.1f} GiB, usable now {g['free'] / 2**30:.1f} GiB")
    return 0


def _cmd_bench(args) -> int:
    from . import functional as F

    n = args.params
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours():
        step[0] += 1
        F.adamw_(p, grad, m, v, step=step[0], lr=1e-3)

    tp = torch.nn.Parameter(p.clone())
    tp.grad = grad.clone()
    topt = torch.optim.AdamW([tp], lr=1e-3, fused=True)
    from .planner.measure import best_seconds

    t_ours = best_seconds(ours, args.repeat)
    t_torch = best_seconds(topt.step, args.repeat)
    print(f"host AdamW fp32, {n / 1e6:.0f}M params, {torch.get_num_threads()} torch threads")
    print(f"  ramstream        {n / t_ours / 1e9:6.2f} G params/s  {32 * n / t_ours / 1e9:6.1f} GB/s")
    print(f"  torch fused CPU  {n / t_torch / 1e9:6.2f} G params/s  {32 * n / t_torch / 1e9:6.1f} GB/s")
    print(f"  ratio ramstream / torch: {t_torch / t_ours:.2f}x")
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo
    from .hardware import torch_cuda_problem

    if args.device is not None and torch.device(args.device).type == "cuda":
        problem = torch_cuda_problem(args.device)
        if problem:
            print(f"ramstream demo --device {args.device}: {problem}", file=sys.stderr)
            return 2
    return run_demo(device=args.device, steps=args.steps)


def _cmd_doctor(args) -> int:
    from .doctor import run_doctor

    return run_doctor(as_json=args.json)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="ramstream", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="print the hardware ramstream sees")
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    p.set_defaults(fn=_cmd_info)
    p = sub.add_parser(
        "doctor",
        help="check GPU, driver, build, pinned memory, copy and AdamW "
        "rates, RAM, RAMSTREAM_* variables; OK/WARN/FAIL with what to do",
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(fn=_cmd_doctor)
    p = sub.add_parser("bench", help="host AdamW against torch's fused CPU AdamW")
    p.add_argument(
        "--params", type=int, default=16_000_000, help="fp32 parameters updated per step (default: 16000000)"
    )
    p.add_argument(
        "--repeat", type=int, default=5, help="timed steps of each; the fastest counts (default: 5)"
    )
    p.set_defaults(fn=_cmd_bench)
    p = sub.add_parser("demo", help="train a small GPT wrapped by ramstream next to plain torch")
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)"
    )
    p.add_argument("--steps", type=int, default=20, help="training steps of each run (default: 20)")
    p.set_defaults(fn=_cmd_demo)
    p = sub.add_parser("plan", help="what would live where and the predicted step time, without training")
    from .planner import cli_plan

    cli_plan.add_arguments(p)
    p.set_defaults(fn=cli_plan.run)
    args = ap.parse_args(argv)
    if getattr(args, "params", 1) < 1 or getattr(args, "repeat", 1) < 1 or getattr(args, "steps", 1) < 1:
        ap.error("--params, --repeat and --steps must be >= 1")
    if getattr(args, "device", None) is not None and not _is_device(args.device):
        ap.error(f"--device {args.device!r}: accepted: cpu, cuda, cuda:N")
    return args.fn(args)


def _is_device(name: str) -> bool:
    try:
        return torch.device(name).type in ("cpu", "cuda")
    except (RuntimeError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
