"""Fails (exit 1) when ramstream's host AdamW is below 0.9x torch's fused CPU AdamW in a
bench/bench_adamw.py --benchmark-json file. Both come from the same run; each is its fastest
round (the least disturbed by other work on a small shared machine: the median moved by 30 %
between runs on the 2-core CI machine, the minimum far less)."""

from __future__ import annotations

import json
import sys

GATE = 0.9


def main(path: str) -> int:
    with open(path) as f:
        rows = {b["name"]: b["stats"]["min"] for b in json.load(f)["benchmarks"]}
    ours, torch_fused = rows.get("test_ramstream_fp32"), rows.get("test_torch_fused_fp32")
    if ours is None or torch_fused is None:
        print(f"bench gate: {path} lacks test_ramstream_fp32 or test_torch_fused_fp32: {sorted(rows)}")
        return 1
    ratio = torch_fused / ours
    verdict = "ok" if ratio >= GATE else "FAIL"
    print(
        f"bench gate: host AdamW fp32 {ours * 1e3:.2f} ms, torch fused CPU AdamW {torch_fused * 1e3:.2f} ms: "
        f"{ratio:.2f}x (gate {GATE}x) {verdict}"
    )
    return 0 if ratio >= GATE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
