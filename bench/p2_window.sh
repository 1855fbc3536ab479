#!/usr/bin/env bash
# Issue 28 P2 by window (after a build): the P2 pipeline step (1.82B, 2 streamed stages on cuda:0,
# gpipe chunk-major, 8 microbatches, 24 GiB cap) against OffloadModel with the same window, for
# each window in $WINDOWS (default "2 4 3"); RESULT lines in $OUT/window.txt, a table printed.
OUT="${OUT:-/tmp/ramstream-out}"; mkdir -p "$OUT"; cd "$(dirname "$0")/train" || exit 1
A="--model 1.8b --batch 8 --seq 512 --pin 0 --steps ${STEPS:-5} --warmup 1 --cap-gib 24"
one() { tag=$1; shift; echo "== $tag" >> "$OUT/err.txt"
  timeout 90 python3 bench_pipeline.py --child "$@" 2>>"$OUT/err.txt" | grep RESULT | sed "s/^/[$tag] /" >> "$OUT/window.txt"; }
for w in ${WINDOWS:-2 4 3}; do
  one "pipe w$w" ramstream --devices cuda:0,cuda:0 --schedule gpipe --microbatches 8 --window "$w" $A
  one "off w$w" offload --devices cuda:0 --window "$w" $A
done
python3 pipeline_measure.py "$OUT/window.txt"
