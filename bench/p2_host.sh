#!/usr/bin/env bash
# Issue 28 P2: where the pipeline's host time goes (after a build). The P2 pipeline child (1.82B,
# 2 streamed stages on cuda:0, gpipe chunk-major, 8 microbatches, 24 GiB cap) with --host-timers
# (pipeline_measure.host_timers: each piece's wall time per step), streamed (pin 0) and with every
# chunk pinned (pin $PIN_ALL: the same pipeline without weight streaming; out of memory at the cap),
# without cast_grads.py's fused cast gradients (pipe_unfused), with the host optimizer
# (pipe_host, offload_host: .optimizer(), each chunk updated during the backward; pipe_host8: its
# AdamW on 8 threads; pipe_host_at_step: eager_updates=False), beside OffloadModel and
# the eager floor (stock PyTorch, the same 8 microbatches, resident) in the same call.
OUT="${OUT:-/tmp/ramstream-out}"; mkdir -p "$OUT"; cd "$(dirname "$0")/train" || exit 1
A="--model 1.8b --batch 8 --seq 512 --window 2 --steps ${STEPS:-5} --warmup 1 --cap-gib 24"
one() { tag=$1; shift; echo "== $tag" >> "$OUT/err.txt"
  timeout 100 python3 bench_pipeline.py --child "$@" $A 2>>"$OUT/err.txt" | grep RESULT | sed "s/^/[$tag] /" >> "$OUT/host.txt"; }
for v in ${VARIANTS:-pipe pipe_unfused offload eager}; do
  case $v in
    pipe) one pipe ramstream --devices cuda:0,cuda:0 --schedule gpipe --microbatches 8 --pin 0 --host-timers ;;
    pipe_unfused) one pipe_unfused ramstream --devices cuda:0,cuda:0 --schedule gpipe --microbatches 8 --pin 0 --host-timers --unfused ;;
    pipe_pinned) one pipe_pinned ramstream --devices cuda:0,cuda:0 --schedule gpipe --microbatches 8 --pin "${PIN_ALL:-17}" --host-timers ;;
    pipe_host) one pipe_host ramstream --devices cuda:0,cuda:0 --schedule gpipe --microbatches 8 --pin 0 --host-opt --host-timers ;;
    pipe_host8) one pipe_host8 ramstream --devices cuda:0,cuda:0 --schedule gpipe --microbatches 8 --pin 0 --host-opt --host-opt-threads 8 ;;
    pipe_host_at_step) one pipe_host_at_step ramstream --devices cuda:0,cuda:0 --schedule gpipe --microbatches 8 --pin 0 --host-opt --host-opt-at-step --host-timers ;;
    offload) one offload offload --devices cuda:0 --pin 0 ;;
    offload_host) one offload_host offload --devices cuda:0 --pin 0 --host-opt ;;
    eager) one eager eager --devices cuda:0 --microbatches 8 --pin 0 ;;
  esac
done
python3 pipeline_measure.py "$OUT/host.txt"
