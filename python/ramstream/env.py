"""Every RAMSTREAM_* environment variable, declared once (who reads it, accepted values, default,
what it does): parsed where it is read, a bad value reported with a RuntimeWarning naming the
variable, the value, what is accepted and what is used instead (a ValueError where going on would be
wrong); `ramstream doctor` and the docs' table (markdown_table(), checked by tests/test_env.py)
come from the same declarations.

The C++ core reads its variables itself (thread pool, spin, ISA, pin budget) and falls back to its
default on a bad value; the parsers below accept exactly what it accepts, and `import ramstream`
checks them once (check_core) so that the fallback is never silent. An empty value counts as unset,
as it does in the core.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .options import MAX_THREADS

CORE = "core"  # the C++ core (ramstream._C); checked in Python at `import ramstream`
PYTHON = "python"  # the Python package, where the value is used
TESTS = "tests"  # the test suite (tests/conftest.py)
BUILD = "build"  # the build (CMake via scikit-build-core, cibuildwheel); no effect at run time

WARN_DEFAULT = "warn"  # a bad value: RuntimeWarning, the default is used (as the reader does)
RAISE = "raise"  # a bad value: ValueError
BUILD_STOPS = "build stops"  # a bad value: the build fails with the build tool's error

_READ_BY = {CORE: "C++ core", PYTHON: "Python", TESTS: "tests", BUILD: "build"}
_ON_BAD = {
    WARN_DEFAULT: "RuntimeWarning; default used",
    RAISE: "ValueError",
    BUILD_STOPS: "the build stops",
}


@dataclass(frozen=True)
class EnvVar:
    """One variable: `parse(raw)` returns the value or raises ValueError saying why not (None: any
    value is taken as given); `on_bad` says what a bad value does."""

    name: str
    read_by: str  # CORE, PYTHON, TESTS or BUILD
    accepted: str
    default: str
    doc: str
    parse: Callable[[str], Any] | None = None
    on_bad: str = WARN_DEFAULT
    here: Callable[[], str] | None = None  # the default on this machine, for the warning


@dataclass(frozen=True)
class Reading:
    """A variable as the environment holds it now: raw None when unset or empty; value None when
    unset or bad (the default applies); error is why raw is not accepted, or ""."""

    var: EnvVar
    raw: str | None
    value: Any
    error: str

    @property
    def message(self) -> str:
        """The warning or error text of a bad value ("" when it is good)."""
        if not self.error:
            return ""
        v = self.var
        text = f"{v.name}={self.raw!r} is not accepted ({self.error}); accepted: {v.accepted}"
        if v.on_bad == WARN_DEFAULT:
            here = f" ({v.here()} here)" if v.here else ""
            return f"{text}; ignored, using the default: {v.default}{here}"
        if v.on_bad == BUILD_STOPS:
            return f"{text}; the next build from source stops with an error"
        return text


# ---- parsers: each raises ValueError(why) ---------------------------------------------------------
_C_INT = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")  # what strtol(s, &end, 10) consumes whole


def _c_int(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi], spelled as the core's strtol accepts it (leading blanks, a sign)."""

    def parse(raw: str) -> int:
        if not _C_INT.fullmatch(raw):
            raise ValueError("not an integer")
        v = int(raw)
        if not lo <= v <= hi:
            raise ValueError(f"out of range [{lo}, {hi}]")
        return v

    return parse


def _choice(*names: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in names:
            raise ValueError(f"not one of {', '.join(names)}")
        return raw

    return parse


ISAS = ("scalar", "avx2", "avx512")


def _isa(raw: str) -> str:
    _choice(*ISAS)(raw)
    from ._native import lib

    best = lib().best_isa()
    if ISAS.index(raw) > ISAS.index(best):
        raise ValueError(f"this CPU supports at most {best}")
    return raw


def _pin_budget(raw: str) -> int:
    from ._native import lib

    try:
        return int(lib().parse_pin_budget(raw))  # the core's own parser
    except ValueError as e:  # its reason, without its list of what is accepted (the message has it)
        raise ValueError(str(e).split("; expected")[0]) from None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _physical_ram() -> int:
    from ._native import lib

    return int(lib().physical_memory_bytes())


def _switch(raw: str) -> bool:
    return _choice("0", "1")(raw) == "1"


def _folder(raw: str) -> str:
    if os.path.exists(raw) and not os.path.isdir(raw):
        raise ValueError("it exists and is not a folder")
    return raw


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "RAMSTREAM_NUM_THREADS",
            CORE,
            f"an integer in [1, {MAX_THREADS}]",
            "all logical CPUs",
            "threads of the host pool (host AdamW, quantization, copies)",
            _c_int(1, MAX_THREADS),
            here=lambda: f"{os.cpu_count() or 1}",
        ),
        EnvVar(
            "RAMSTREAM_POOL_SPIN_US",
            CORE,
            "an integer in [0, 1000000]",
            "150 us",
            "microseconds an idle pool thread spins before it sleeps",
            _c_int(0, 1_000_000),
        ),
        EnvVar(
            "RAMSTREAM_FORCE_ISA",
            CORE,
            "scalar, avx2 or avx512, at most what the CPU supports",
            "the best ISA the CPU supports",
            "the host kernels' instruction set, instead of the best (tests, benchmarks)",
            _isa,
        ),
        EnvVar(
            "RAMSTREAM_PIN_BUDGET",
            CORE,
            "bytes with an optional K/M/G/T suffix (64G, 512M) or a share of RAM (60%)",
            "50% of physical RAM",
            "how much host memory the pinned arena may page-lock",
            _pin_budget,
            here=lambda: _gib(_physical_ram() // 2),
        ),
        EnvVar(
            "RAMSTREAM_PIN_METHOD",
            CORE,
            "alloc or register",
            "register",
            "how the arena page-locks blocks of 64 MiB and more: register (an anonymous mapping "
            "faulted in by up to 16 threads, then cudaHostRegister; 10x cudaHostAlloc's rate on the "
            "H100 machine) or alloc (cudaHostAlloc, one thread)",
            _choice("alloc", "register"),
        ),
        EnvVar(
            "RAMSTREAM_AVX512BF16",
            CORE,
            "0 or 1",
            "1 (used where the CPU has AVX512-BF16)",
            "0: the AVX-512 AdamW writes bf16 without the AVX512-BF16 instruction (tests)",
            _switch,
        ),
        EnvVar(
            "RAMSTREAM_EXPANDABLE_SEGMENTS",
            PYTHON,
            "0 or 1",
            "1 (unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set)",
            "1: wrap() on CUDA turns on the caching allocator's expandable segments (no stranded "
            "fragments under a tight plan); 0: the allocator is left as it is",
            _switch,
        ),
        EnvVar(
            "RAMSTREAM_CACHE_DIR",
            PYTHON,
            "a folder (created when missing)",
            "~/.cache/ramstream",
            "where profile_hardware caches measured rates",
            _folder,
        ),
        EnvVar(
            "RAMSTREAM_NVME_DIR",
            PYTHON,
            "an existing, writable folder",
            "unset (no disk tier)",
            "the default nvme_dir of wrap() and OffloadAdamW: the folder of the optimizer state's scratch "
            "file (nvme_offload)",
            _folder,
            RAISE,
        ),
        EnvVar(
            "RAMSTREAM_REQUIRE_CUDA",
            TESTS,
            "0 or 1",
            "0",
            "1: a test marked cuda fails instead of skipping when no GPU is usable",
            _switch,
            RAISE,
        ),
        EnvVar(
            "RAMSTREAM_CUDA",
            BUILD,
            "AUTO, ON or OFF",
            "AUTO",
            "CUDA kernels: AUTO builds them when a toolkit is found, ON requires one",
            _choice("AUTO", "ON", "OFF"),
            BUILD_STOPS,
        ),
        EnvVar(
            "RAMSTREAM_CUDA_ARCHS",
            BUILD,
            "all, or CMake CUDA architectures (90-real;100-real)",
            "the GPUs nvidia-smi sees (none: sm_75 PTX)",
            "the GPU architectures compiled",
            None,
            BUILD_STOPS,
        ),
        EnvVar(
            "RAMSTREAM_CUDA_MAJOR",
            BUILD,
            "12 or 13",
            "none (required by the wheel build)",
            "the CUDA major a cibuildwheel wheel is built for (.github/scripts/install_cuda.sh)",
            _choice("12", "13"),
            BUILD_STOPS,
        ),
    )
}

# Read by the benchmark scripts under bench/ only (they say what they take); not the package's.
BENCH_PREFIXES = ("RAMSTREAM_BENCH_", "RAMSTREAM_DP_")


def read(name: str) -> Reading:
    """The variable `name` parsed from the environment now, without warning. KeyError for a name
    that is not declared."""
    var = VARIABLES[name]
    raw = os.environ.get(name)
    if not raw:
        return Reading(var, None, None, "")
    if var.parse is None:
        return Reading(var, raw, raw, "")
    try:
        return Reading(var, raw, var.parse(raw), "")
    except ValueError as e:
        return Reading(var, raw, None, str(e) or "not accepted")


_warned: set = set()
_lock = threading.Lock()


def get(name: str, stacklevel: int = 2) -> Any:
    """The parsed value of `name`, or None when it is unset (the reader's default applies). A bad
    value: a RuntimeWarning (once per process and value) and None, or ValueError for a variable
    whose `on_bad` is RAISE."""
    r = read(name)
    if r.error:
        if r.var.on_bad == RAISE:
            raise ValueError(f"ramstream: {r.message}")
        with _lock:
            first = (name, r.raw) not in _warned
            _warned.add((name, r.raw))
        if first:
            warnings.warn(f"ramstream: {r.message}", RuntimeWarning, stacklevel=stacklevel + 1)
    return r.value


def check_core() -> None:
    """Warns once about each bad variable the C++ core reads (at `import ramstream`). A variable
    whose check needs the compiled core is skipped when the core does not load (the import error
    comes at its first use)."""
    for name, var in VARIABLES.items():
        if var.read_by != CORE or not os.environ.get(name):
            continue
        try:
            get(name, stacklevel=3)
        except ImportError:
            pass


def describe(r: Reading) -> str:
    """`NAME=raw` and what it means now, for `ramstream doctor`."""
    text = f"{r.var.name}={r.raw}"
    if r.error:
        return f"{text} (not accepted)"
    if r.var.read_by == BUILD:
        return f"{text} (build time)"
    if r.var.name == "RAMSTREAM_PIN_BUDGET":
        return f"{text} (= {_gib(r.value)})"
    if isinstance(r.value, bool):
        return f"{text} ({'on' if r.value else 'off'})"
    if str(r.value) != r.raw:
        return f"{text} (= {r.value})"
    return text


def markdown_table() -> str:
    """The table of every variable in docs/troubleshooting.md, from the declarations."""
    rows = [
        "| variable | read by | accepted | default | a bad value | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for v in VARIABLES.values():
        rows.append(
            f"| `{v.name}` | {_READ_BY[v.read_by]} | {v.accepted} | {v.default} | {_ON_BAD[v.on_bad]} | {v.doc} |"
        )
    return "\n".join(rows)
