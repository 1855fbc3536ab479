"""Where wrap()'s offloaded setup goes: how fast this machine page-locks host memory, by method.

The offloaded 6.85B run spends 21-27 s of its 23-29 s setup pinning ~96 GB of host state (bench/
RESULTS.md, seventeenth session), about 4 GB/s: the arena asks cudaHostAlloc for each large block,
on one thread, and the driver zeroes and locks every 4 KiB page itself. This probe measures, for
the same number of bytes, in one process:

  hostalloc   cudaHostAlloc (Portable|Mapped), as the arena does today (one thread)
  register    an anonymous mmap, cudaHostRegister (Portable|Mapped) with the pages untouched
  touch+reg   an anonymous mmap with MADV_HUGEPAGE, first-touched by T threads in parallel, then
              cudaHostRegister: the kernel zeroes the pages on T cores and the driver only locks
              pages that already exist (2 MiB ones where transparent huge pages allow)

and a host-to-device copy from each buffer (so a faster pin that copies slower is seen). Prints
GB/s per phase and a ratio against hostalloc. No ramstream code is involved: it decides whether
the arena's large blocks should be allocated the third way.

    python3 bench/train/probe_pin.py --gib 8 --threads 1,4,16 --out pin.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import threading
import time

import torch

PROT = mmap.PROT_READ | mmap.PROT_WRITE
FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
MADV_HUGEPAGE = 14
PORTABLE_MAPPED = 1 | 2

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _mmap(n: int) -> int:
    p = libc.mmap(None, n, PROT, FLAGS, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise MemoryError(f"mmap({n}) failed: errno {ctypes.get_errno()}")
    return p


def _touch(p: int, n: int, threads: int) -> None:
    """Write one byte per 4 KiB page of [p, p+n) from `threads` threads, each its own slice."""
    buf = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
    per = -(-n // threads)
    per += (-per) % (2 << 20)

    def run(i):
        buf[i * per : min(n, (i + 1) * per)][::4096].fill_(0)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads) if i * per < n]
    torch.set_num_threads(1)
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _h2d_gbs(host: torch.Tensor) -> float:
    dev = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    dev.copy_(host[: dev.numel()], non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return host.numel() / (time.perf_counter() - t) / 1e9


def probe(n: int, threads: list[int]) -> list[dict]:
    cudart = torch.cuda.cudart()
    rows = []
    torch.cuda.init()
    # cudaHostAlloc through torch's pinned allocator (it calls cudaHostAlloc for a new block)
    t = time.perf_counter()
    x = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dt = time.perf_counter() - t
    rows.append({"method": "hostalloc", "pin_s": dt, "gbs": n / dt / 1e9, "h2d_gbs": _h2d_gbs(x)})
    del x
    torch._C._host_emptyCache()
    for how, tcounts in (("register", [0]), ("touch+reg", threads)):
        for T in tcounts:
            p = _mmap(n)
            try:
                t0 = time.perf_counter()
                if T:
                    libc.madvise(p, n, MADV_HUGEPAGE)
                    _touch(p, n, T)
                t1 = time.perf_counter()
                err = cudart.cudaHostRegister(p, n, PORTABLE_MAPPED)
                t2 = time.perf_counter()
                if int(err) != 0:
                    rows.append({"method": how, "threads": T, "error": str(err)})
                    continue
                host = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
                row = {
                    "method": how,
                    "threads": T,
                    "touch_s": t1 - t0,
                    "register_s": t2 - t1,
                    "pin_s": t2 - t0,
                    "gbs": n / (t2 - t0) / 1e9,
                    "h2d_gbs": _h2d_gbs(host),
                }
                rows.append(row)
                del host
                cudart.cudaHostUnregister(p)
            finally:
                libc.munmap(p, n)
    # the arena itself (ramstream.pinned_empty), each of RAMSTREAM_PIN_METHOD's ways
    from ramstream.ops import memory

    for method in ("alloc", "register"):
        os.environ["RAMSTREAM_PIN_METHOD"] = method
        t = time.perf_counter()
        x = memory.pinned_empty(n, torch.uint8)
        dt = time.perf_counter() - t
        pinned = bool(memory.lib().is_arena_pinned(x.data_ptr()))
        rows.append(
            {
                "method": f"arena {method}",
                "pin_s": dt,
                "gbs": n / dt / 1e9,
                "pinned": pinned,
                "h2d_gbs": _h2d_gbs(x),
            }
        )
        del x
        memory.lib().empty_cache()
    os.environ.pop("RAMSTREAM_PIN_METHOD", None)
    base = rows[0]["pin_s"]
    for r in rows:
        if "pin_s" in r:
            r["speedup_vs_hostalloc"] = base / r["pin_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="bytes to pin per method (GiB)")
    ap.add_argument("--threads", default="1,4,16", help="thread counts of the touch+reg method")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_pin: needs a CUDA GPU (it measures the CUDA driver's page locking)")
    n = int(a.gib * (1 << 30))
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    print(f"transparent huge pages: {thp}")
    rows = probe(n, [int(s) for s in a.threads.split(",")])
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<10} T={r['threads']}: {r['error']}")
            continue
        extra = f" (touch {r['touch_s']:.2f} s + register {r['register_s']:.2f} s)" if "touch_s" in r else ""
        print(
            f"{r['method']:<10} T={r.get('threads', 1):<3} {a.gib:.0f} GiB pinned in {r['pin_s']:.2f} s = "
            f"{r['gbs']:.1f} GB/s{extra}; H2D from it {r['h2d_gbs']:.1f} GB/s; "
            f"{r['speedup_vs_hostalloc']:.2f}x of hostalloc"
            + ("" if r.get("pinned", True) else " (NOT pinned: fell back)")
        )
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump({"gib": a.gib, "thp": thp, "rows": rows}, f, indent=1)
        os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
