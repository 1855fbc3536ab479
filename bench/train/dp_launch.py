"""bench_dp.py's process launcher and report: runs a worker command (alone, or as N ranks that
meet through a FileStore) with a timeout, reads its JSON, and summarizes the runs as a table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time


def _launch(name: str, cmd: list[str], out_file: str, timeout: float) -> dict:
    """Runs one worker (or torchrun) in its own session, its output in a log file. On timeout
    it gets SIGTERM first (torchrun then stops its workers, which run in sessions of their
    own), its whole group SIGKILL 30 s later."""
    t0 = time.perf_counter()
    log = out_file + ".log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = f"timeout after {timeout:.0f} s"
    if rc == 0 and os.path.exists(out_file):
        with open(out_file) as f:
            r = json.load(f)
    else:
        with open(log, errors="replace") as f:
            r = {"ok": False, "error": f"rc={rc}: {f.read()[-3000:]}"}
    r.update(name=name, wall_s=time.perf_counter() - t0, cmd=" ".join(cmd), log=log)
    print(json.dumps(r), flush=True)
    return r


def _launch_ranks(name: str, cmd: list[str], n: int, init_file: str, out_file: str, timeout: float) -> dict:
    """--rendezvous file: starts the n ranks itself (RANK, WORLD_SIZE, LOCAL_RANK set as torchrun
    would), meeting through a FileStore in `init_file`; each rank logs to its own file. A rank
    that fails or a timeout stops the others."""
    t0 = time.perf_counter()
    procs, logs = [], []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            RAMSTREAM_DP_INIT_FILE=init_file,
        )
        logs.append(f"{out_file}.rank{r}.log")
        with open(logs[-1], "w") as f:
            procs.append(
                subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            )
    deadline, rc = time.monotonic() + timeout, 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            rc = failed[0] if failed else f"timeout after {timeout:.0f} s"
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    rc = rc or next((p.returncode for p in procs if p.returncode), 0)
    if rc == 0 and os.path.exists(out_file):
        with open(out_file) as f:
            r = json.load(f)
    else:
        tails = []
        for log in logs:
            with open(log, errors="replace") as f:
                tails.append(f"{log}: {f.read()[-1500:]}")
        r = {"ok": False, "error": f"rc={rc}: " + "\n".join(tails)}
    r.update(name=name, wall_s=time.perf_counter() - t0, cmd=" ".join(cmd), log=logs[0])
    print(json.dumps(r), flush=True)
    return r


def summarize(runs: dict, n: int) -> dict:
    one, dp = runs.get("single", {}), runs.get("dp", {})
    s = {"nproc": n}
    if one.get("ok") and dp.get("ok"):
        single_bytes = one["host_state_bytes_by_rank"][0]
        per_rank = dp["host_state_bytes_by_rank"]
        s.update(
            tokens_per_s_single=one["tokens_per_s"],
            tokens_per_s_dp=dp["tokens_per_s"],
            scaling=dp["tokens_per_s"] / one["tokens_per_s"],
            scaling_target=0.85 * n,
            host_state_bytes_single=single_bytes,
            host_state_bytes_by_rank=per_rank,
            host_state_sum_equals_single=sum(per_rank) == single_bytes,
            host_state_max_rank_fraction=max(per_rank) / single_bytes,
            host_state_fraction_target=1.0 / n,
            peak_vram_gib_single=one.get("peak_vram_gib"),
            peak_vram_gib_dp=dp.get("peak_vram_gib"),
        )
        s["scaling_ok"] = s["scaling"] >= s["scaling_target"]
    if dp.get("ok") and "parity_max_abs_diff" in dp:
        s.update(
            parity_max_abs_diff=dp["parity_max_abs_diff"],
            parity_tol=dp["parity_tol"],
            parity_ok=dp["parity_ok"],
            replicas_identical=dp.get("replicas_identical"),
        )
    return s


def _table(res: dict) -> None:
    print(
        f"\n{'run':10s} {'world':>5s} {'global batch':>12s} {'s/step':>8s} {'tokens/s':>10s} "
        f"{'peak VRAM GiB':>14s} {'host state GiB/rank':>20s}"
    )
    for r in res["runs"]:
        if not r.get("ok"):
            print(f"{r['name']:10s} failed: {r.get('error', '')[-300:]}")
            continue
        vram = f"{r['peak_vram_gib']:.2f}" if r.get("peak_vram_gib") is not None else "-"
        host = "/".join(f"{b / 2**30:.3f}" for b in r["host_state_bytes_by_rank"])
        print(
            f"{r['name']:10s} {r['world']:5d} {r['global_batch']:12d} {r['s_per_step']:8.4f} "
            f"{r['tokens_per_s']:10.0f} {vram:>14s} {host:>20s}"
        )
    print("summary " + json.dumps(res["summary"]), flush=True)
