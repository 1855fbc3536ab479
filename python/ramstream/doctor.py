"""`ramstream doctor`: one screen of OK/WARN/FAIL checks of what this machine offers ramstream, each
problem with what to do; the exit code is 1 only when something is broken (FAIL)."""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from .planner.measure import cgroup_limit, copy_rates, host_adamw_seconds

OK, WARN, FAIL = "OK", "WARN", "FAIL"
_GIB = 2**30


@dataclass
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str
    fix: str = ""


def _gpu_usable() -> bool:
    from .hardware import torch_cuda_problem

    return torch_cuda_problem() is None


def check_torch() -> Check:
    from .hardware import nvidia_driver

    v = torch.__version__
    if torch.version.cuda:
        return Check("torch", OK, f"torch {v}, CUDA {torch.version.cuda}")
    if nvidia_driver()["found"]:
        return Check(
            "torch",
            WARN,
            f"torch {v} is a CPU-only build on a machine with an NVIDIA driver",
            "install a CUDA build of torch: https://pytorch.org/get-started/locally",
        )
    return Check("torch", OK, f"torch {v} (CPU-only build, as this machine has no NVIDIA driver)")


def check_driver() -> Check:
    from .hardware import nvidia_driver

    d = nvidia_driver()
    if d["found"]:
        return Check("driver", OK, f"NVIDIA driver found, supports CUDA {d['cuda'] or '?'}")
    return Check(
        "driver",
        WARN,
        "no NVIDIA driver or GPU was found (libcuda.so.1 does not load)",
        "the CPU engine works (device='cpu'); for a GPU install the NVIDIA driver",
    )


def check_gpu() -> Check:
    from .hardware import gpu_memory, torch_cuda_problem

    problem = torch_cuda_problem()
    if problem:
        return Check("gpu", WARN, "torch can use no GPU", problem)
    parts = []
    for i in range(torch.cuda.device_count()):
        m = gpu_memory(torch.device("cuda", i))
        parts.append(
            f"cuda:{i} {torch.cuda.get_device_name(i)} {m['total'] / _GIB:.0f} GiB "
            f"({m['free'] / _GIB:.0f} free)"
        )
    return Check("gpu", OK, "; ".join(parts))


def check_build() -> Check:
    from ._native import lib
    from .hardware import kernels_problem, nvidia_driver

    C = lib()
    if not C.built_with_cuda():
        if _gpu_usable():
            return Check(
                "build",
                WARN,
                "this ramstream build has no CUDA kernels",
                "optimizer_mode='gpu' and the CUDA functional ops need them: reinstall "
                "with nvcc on PATH (RAMSTREAM_CUDA=ON pip install .) or use a CUDA wheel",
            )
        return Check("build", OK, "CPU-only build (no CUDA kernels; none needed without a GPU)")
    rt = C.cuda_runtime_version()
    text = f"CUDA kernels, static CUDA runtime {rt // 1000}.{rt % 1000 // 10}"
    problem = kernels_problem()
    if problem is None:
        return Check("build", OK, f"{text}; sees {C.cuda_device_count()} GPU(s)")
    if not nvidia_driver()["found"]:
        return Check("build", OK, f"{text} (unused: no NVIDIA driver)")
    return Check("build", FAIL, f"{text}, but it cannot use the GPU", problem)


def check_pinned() -> Check:
    from . import functional as F

    with warnings.catch_warnings():  # the check reports what the warning would say
        warnings.simplefilter("ignore", RuntimeWarning)
        budget, st = F.pin_budget(), F.memory_stats()
    text = f"budget {budget / _GIB:.1f} GiB ({st['budget_source']})"
    if st.get("budget_error"):
        return Check(
            "pinned",
            WARN,
            f"{text}; {st['budget_error']}",
            "RAMSTREAM_PIN_BUDGET takes bytes ('64G', '512M') or a share of RAM ('60%')",
        )
    t = F.pinned_empty((16 << 20,), dtype=torch.uint8)
    pinned = t.is_pinned()
    del t
    if pinned:
        return Check("pinned", OK, f"{text}; a 16 MiB buffer was page-locked")
    from .hardware import nvidia_driver

    why = F.memory_stats()["fallback_reason"] or "unknown"
    if not nvidia_driver()["found"]:
        why = "no NVIDIA driver"
    if _gpu_usable():
        return Check(
            "pinned",
            FAIL,
            f"{text}; pinning failed: {why}",
            "raise the budget (RAMSTREAM_PIN_BUDGET) or free host memory; copies to the "
            "GPU are synchronous and slow without page-locked buffers",
        )
    return Check("pinned", OK, f"{text}; no GPU, so buffers are ordinary memory ({why})")


def check_copy(nbytes: int = 64 << 20) -> Check:
    if not _gpu_usable():
        r = copy_rates(nbytes, "cpu")
        return Check("copy", OK, f"no GPU; host memcpy {r['h2d_gbps']:.1f} GB/s ({nbytes >> 20} MiB)")
    r = copy_rates(nbytes, "cuda:0")
    up, down = r["h2d_gbps"], r["d2h_gbps"]
    text = (
        f"cuda:0 H2D {up:.1f} GB/s, D2H {down:.1f} GB/s, both at once {r['duplex_gbps']:.1f} each "
        f"({nbytes >> 20} MiB, {'pinned' if r['pinned'] else 'NOT pinned'})"
    )
    if min(up, down) < 5:
        return Check(
            "copy",
            WARN,
            text,
            "below a PCIe 3.0 x16 link: check the link width and "
            "speed (nvidia-smi -q | grep -A3 'Link Width'); host buffers may not be "
            "pinned",
        )
    return Check("copy", OK, text)


def check_adamw(n: int = 16_000_000) -> Check:
    """Host AdamW against torch's fused CPU AdamW on n fp32 parameters (memory-bound sizes, as in
    training: 2M fit in a large CPU's caches). torch runs first: its OpenMP threads keep spinning
    for a while after a parallel region and would take cores from ramstream's pool, so ramstream's
    timing starts after a pause."""
    from . import functional as F

    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    F.adamw_(p, grad, m, v, step=1, lr=1e-3, weight_decay=1e-2)
    tp = torch.nn.Parameter(p0.clone())
    tp.grad = grad.clone()
    topt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=1e-2, fused=True)
    topt.step()
    if not torch.equal(p, tp.detach()):
        bad = int((p != tp.detach()).sum())
        return Check(
            "adamw",
            FAIL,
            f"host AdamW differs from torch's fused AdamW in {bad} of {n} values after one step",
            "report this with `ramstream info --json`",
        )
    from .planner.measure import best_seconds

    t_torch = best_seconds(topt.step)
    time.sleep(0.3)  # OpenMP's spinning threads go idle
    t_ours = host_adamw_seconds(p, grad, m, v)
    ratio = t_torch / t_ours
    text = (
        f"host AdamW {n / t_ours / 1e9:.2f} G params/s, {ratio:.2f}x torch's fused CPU "
        f"AdamW ({n / 1e6:.0f}M fp32, {torch.get_num_threads()} torch threads; torch timed first); bit-identical"
    )
    if ratio < 0.9:
        return Check(
            "adamw",
            WARN,
            text,
            "other processes may be using the cores; set "
            "RAMSTREAM_NUM_THREADS to the physical cores free for training",
        )
    return Check("adamw", OK, text)


def check_isa() -> Check:
    from ._native import lib

    C = lib()
    text = f"{C.active_isa()} (best {C.best_isa()}), {C.num_threads()} threads"
    if C.isa_env_error():
        return Check(
            "isa",
            WARN,
            f"{text}; {C.isa_env_error()}",
            "RAMSTREAM_FORCE_ISA takes scalar, avx2 or avx512; unset it to use the best",
        )
    if C.active_isa() != C.best_isa():
        return Check(
            "isa",
            WARN,
            f"{text}: RAMSTREAM_FORCE_ISA picks a slower ISA",
            "unset RAMSTREAM_FORCE_ISA unless you are testing",
        )
    if C.best_isa() == "scalar" and os.uname().machine == "x86_64":
        return Check("isa", WARN, f"{text}: this CPU has no AVX2", "the host AdamW is slow here")
    return Check("isa", OK, text)


def check_ram() -> Check:
    from .hardware import host_memory

    ram, limit = host_memory(), cgroup_limit()
    text = f"{ram['total'] / _GIB:.1f} GiB total, {ram['available'] / _GIB:.1f} GiB available"
    if limit is None:
        return Check("ram", OK, f"{text}; no cgroup memory limit")
    text += f"; cgroup limit {limit / _GIB:.1f} GiB"
    from . import functional as F

    if F.pin_budget() > limit:
        return Check(
            "ram",
            WARN,
            f"{text} is below the pin budget {F.pin_budget() / _GIB:.1f} GiB",
            f"set RAMSTREAM_PIN_BUDGET below {limit / _GIB:.0f}G: past the limit the "
            "kernel kills the process",
        )
    return Check("ram", OK, text)


def check_env() -> Check:
    """Each RAMSTREAM_* variable set, with what it parses to (env.py); a bad value is a WARN (ignored,
    the default used) or a FAIL (an error where it is read), an unknown name a WARN."""
    from . import env

    found = sorted(k for k, v in os.environ.items() if k.startswith("RAMSTREAM_") and v)
    if not found:
        return Check("env", OK, "no RAMSTREAM_* variables set")
    parts, problems, unknown, status = [], [], [], OK
    for k in found:
        if k not in env.VARIABLES:
            parts.append(f"{k}={os.environ[k]}")
            if not k.startswith(env.BENCH_PREFIXES):  # bench/ scripts read those
                unknown.append(k)
            continue
        r = env.read(k)
        parts.append(env.describe(r))
        if r.error:
            problems.append(r.message)
            status = FAIL if r.var.on_bad == env.RAISE else (WARN if status == OK else status)
    if unknown:
        problems.append(f"unknown, ignored: {', '.join(unknown)} (known: {', '.join(env.VARIABLES)})")
        status = WARN if status == OK else status
    return Check("env", status, ", ".join(parts), "; ".join(problems))


CHECKS = (
    check_torch,
    check_driver,
    check_gpu,
    check_build,
    check_pinned,
    check_copy,
    check_adamw,
    check_isa,
    check_ram,
    check_env,
)


def run_checks() -> list[Check]:
    """Every check in order; one that raises becomes a FAIL that shows the exception."""
    out = []
    for fn in CHECKS:
        name = fn.__name__.removeprefix("check_")
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 - a broken check is itself the finding
            out.append(
                Check(name, FAIL, f"{type(e).__name__}: {e}", "report this with `ramstream info --json`")
            )
    return out


def run_doctor(as_json: bool = False) -> int:
    """Prints the checks (a table, or JSON) and returns 1 when one FAILs, else 0."""
    checks = run_checks()
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        import ramstream

        print(f"ramstream {ramstream.__version__} doctor")
        for c in checks:
            print(f"  {c.status:4s}  {c.name:7s} {c.detail}")
            if c.fix:
                print(f"  {'':4s}  {'':7s} -> {c.fix}")
        bad = [c.name for c in checks if c.status == FAIL]
        print("broken: " + ", ".join(bad) if bad else "nothing broken")
    return 1 if any(c.status == FAIL for c in checks) else 0
