#!/usr/bin/env bash
# Issue 28 P2 on the GPU machine (after a build): one profiled step each of OffloadModel and the
# chunk-major pipeline (8 and 4 microbatches), as busy-per-window timelines (profile_timeline.py);
# the traces gzipped under $OUT.
OUT="${OUT:-/tmp/ramstream-out}"; mkdir -p "$OUT"; cd "$(dirname "$0")/train" || exit 1
A="--model 1.8b --batch 8 --seq 512 --window 2 --pin 0 --steps 3 --warmup 1 --cap-gib 24"
R="ramstream --devices cuda:0,cuda:0 --schedule gpipe"
one() { tag=$1; shift
  timeout 120 python3 bench_pipeline.py --child "$@" --profile "/tmp/$tag.txt" 2>>"$OUT/err.txt" | grep RESULT | sed "s/^/[$tag] /" >> "$OUT/ab.txt"
  echo "== $tag"; python3 profile_timeline.py "/tmp/$tag.txt.json" --windows 25 --lanes 6 | tee "$OUT/timeline_$tag.txt"
  gzip -c "/tmp/$tag.txt.json" > "$OUT/trace_$tag.json.gz"; }
one off offload --devices cuda:0 $A
one mb8 $R --microbatches 8 $A
