#!/usr/bin/env bash
# Issue 28 P2 diagnosis on the GPU machine (after a build): the P2 pipeline step (1.82B, 2 streamed
# stages on cuda:0, gpipe chunk-major, 8 microbatches) against OffloadModel in the same call, at
# the 24 GiB cap and above it, with expandable segments, and traced; RESULT lines in $OUT/ab.txt.
OUT="${OUT:-/tmp/ramstream-out}"; mkdir -p "$OUT"; cd "$(dirname "$0")/train" || exit 1
A="--model 1.8b --batch 8 --seq 512 --window 2 --pin 0 --steps 3 --warmup 1"
R="ramstream --devices cuda:0,cuda:0 --schedule gpipe --microbatches 8"
one() { tag=$1; shift; echo "== $tag" >> "$OUT/err.txt"
  timeout 100 python3 bench_pipeline.py --child "$@" 2>>"$OUT/err.txt" | grep RESULT | sed "s/^/[$tag] /" >> "$OUT/ab.txt"; }
one off offload --devices cuda:0 $A --cap-gib 24
one cap24 $R $A --cap-gib 24 --trace "$OUT/trace24.json"
one cap60 $R $A --cap-gib 60 --trace "$OUT/trace60.json"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True one exp24 $R $A --cap-gib 24
one off2 offload --devices cuda:0 $A --cap-gib 24
python3 - "$OUT/ab.txt" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    tag, js = line.split(" RESULT ", 1); d = json.loads(js)
    print(tag, "step %.3f pipeline %.3f optimizer %.3f" % (d["step_s"], d["pipeline_s"], d["optimizer_s"]),
          "steps", [round(x, 3) for x in d["steps_s"]], "peak", d["peak_vram_gib"], "reserved", d["peak_reserved_gib"],
          "retries", d["alloc_retries"], "traced", d.get("traced_s"))
PY
