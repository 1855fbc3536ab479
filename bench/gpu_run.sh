#!/usr/bin/env bash
# One call on the GPU machine (device tool): build, then the stages named in $STAGES
# (tests, cpu, cputorch, micro, train, act, diag, soak, sanitize, dp, loadprobe, stream, quant, offload, pipeline, delayed, nvme, io, trainer, loss, doctor, probe, pin, defaults), each under a time limit, logs under $OUT. Prints a short
# summary last.
#   STAGES="tests micro" bash bench/gpu_run.sh
#   STAGES="stream" STREAM_ROWS="F,E,D8" STREAM_DEADLINE=450 bash bench/gpu_run.sh
#   STAGES="defaults" DEFAULTS_ROWS="R1,R3" DEFAULTS_CAPS="8,12" DEFAULTS_DEADLINE=500 bash bench/gpu_run.sh
#   STAGES="tests train act" TRAIN_ARGS="--variants ramstream_auto,ramstream_auto_chunked,ramstream_auto_act2" bash bench/gpu_run.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 RAMSTREAM_CUDA=ON RAMSTREAM_CUDA_ARCHS="${RAMSTREAM_CUDA_ARCHS:-90-real}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}" NCCL_NVLS_ENABLE=0
OUT="${OUT:-/tmp/ramstream-out}"; mkdir -p "$OUT"
STAGES="${STAGES:-tests micro train}"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; free -g | head -2
  python3 -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"
} > "$OUT/machine.txt" 2>&1
summary "machine: $(head -1 "$OUT/machine.txt") | $(grep torch "$OUT/machine.txt")"

src_hash=$(git ls-files -s cpp cuda CMakeLists.txt cmake pyproject.toml python 2>/dev/null | sha1sum | cut -c1-12)
if [ "$(cat /tmp/ramstream-built 2>/dev/null)" != "$src_hash" ]; then
  t0=$(date +%s)
  if python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1; then
    echo "$src_hash" > /tmp/ramstream-built; summary "build: ok in $(( $(date +%s) - t0 )) s"
  else
    summary "build: FAILED"; tail -30 "$OUT/build.log"; exit 1
  fi
fi

for stage in $STAGES; do
  case "$stage" in
    tests)
      (cd tests && RAMSTREAM_REQUIRE_CUDA=1 timeout ${TESTS_TIMEOUT:-300} python3 -m pytest ${TESTS:-.} -q -m cuda -p no:cacheprovider \
        --tb=short > "$OUT/tests_cuda.log" 2>&1)
      summary "tests -m cuda: $(tail -1 "$OUT/tests_cuda.log")"
      grep -E "^(FAILED|ERROR)" "$OUT/tests_cuda.log" | head -20 ;;
    cpu)  # CPU tests on this machine's CPU (AVX-512 where this VM has only AVX2): CPU_TESTS
      (cd tests && timeout 300 python3 -m pytest ${CPU_TESTS:-test_quant_isa.py} -q -m "not cuda" -p no:cacheprovider \
        --tb=short > "$OUT/tests_cpu_only.log" 2>&1)
      summary "cpu tests: $(tail -1 "$OUT/tests_cpu_only.log")"
      grep -E "^(FAILED|ERROR)" "$OUT/tests_cpu_only.log" | head -20 ;;
    cputorch)  # the host AdamW's bit-exactness against this machine's torch
      (cd tests && timeout 120 python3 -m pytest test_adamw.py test_adamw_rounding.py \
        test_adamw_input.py -q -m "not cuda" -p no:cacheprovider > "$OUT/tests_cpu.log" 2>&1)
      summary "test_adamw cpu (torch $(python3 -c 'import torch;print(torch.__version__)')): $(tail -1 "$OUT/tests_cpu.log")" ;;
    micro)
      for b in ${BENCHES:-adamw copy cuda_kernels quant}; do
        RAMSTREAM_BENCH_PARAMS=256e6 RAMSTREAM_BENCH_ELEMS=256e6 timeout 200 python3 -m pytest \
          "bench/bench_$b.py" -q -s -o addopts="" --benchmark-only -p no:cacheprovider \
          >> "$OUT/bench.log" 2>&1
        summary "bench_$b: rc=$? $(tail -1 "$OUT/bench.log")"
      done ;;
    train)
      timeout 400 python3 bench/train/bench_offload.py --model "${MODEL:-1.8b}" --batch 8 --seq 512 \
        --cap-gib 24 --out "$OUT/train.json" ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
      summary "train rc=$?"; tail -6 "$OUT/train.log" ;;
    act)   # issue 4: largest batch and slowdown of activation paging, 1.8B at seq 1024, 24 GiB
           # (one process per configuration: up to 12 of ~40-60 s each)
      timeout 1500 python3 bench/train/bench_activations.py --model "${MODEL:-1.8b}" --seq 1024 \
        --batches "${ACT_BATCHES:-4,8,16}" --cap-gib 24 --timeout 240 --out "$OUT/act.json" \
        ${ACT_ARGS:-} > "$OUT/act.log" 2>&1
      summary "act rc=$?"; tail -12 "$OUT/act.log" ;;
    diag)  # issue 8: what an OOM step leaves in VRAM; the resident switch's rounding per step
      timeout 200 python3 bench/train/diag_act_oom.py --model "${MODEL:-1.8b}" --seq 1024 --batch 8 \
        --cap-gib 24 > "$OUT/diag_oom.log" 2>&1
      summary "diag_oom rc=$?"; tail -20 "$OUT/diag_oom.log"
      (cd tests && RAMSTREAM_REQUIRE_CUDA=1 timeout 200 python3 -m pytest -q -s -p no:cacheprovider \
        test_resident_f64.py "test_wrap_resident.py::test_resident_goes_on_as_the_offloaded_run_on_the_gpu" \
        > "$OUT/diag_resident.log" 2>&1)
      summary "diag_resident: $(tail -1 "$OUT/diag_resident.log")"
      grep -E "ulps per step|^(FAILED|ERROR)|Assert" "$OUT/diag_resident.log" | head -12 ;;
    soak)  # issue 8: 200 steps of the 1.8B GPT, 24 GiB cap, optimizer_mode="auto", paging: flat memory
      timeout 400 python3 bench/train/soak.py --steps "${SOAK_STEPS:-200}" --model "${MODEL:-1.8b}" \
        --cap-gib 24 --out "$OUT/soak.json" > "$OUT/soak.log" 2>&1
      summary "soak rc=$?"; tail -12 "$OUT/soak.log" ;;
    sanitize)  # compute-sanitizer memcheck and racecheck over the CUDA kernel tests, once
      cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
      for tool in ${SAN_TOOLS:-memcheck racecheck}; do
        (cd tests && RAMSTREAM_REQUIRE_CUDA=1 timeout 240 "$cs" --tool "$tool" --error-exitcode 99 \
          --target-processes all python3 -m pytest -q -m cuda -p no:cacheprovider \
          ${SAN_TESTS:-test_cuda_kernels.py test_cuda_adamw.py} > "$OUT/sanitize_$tool.log" 2>&1)
        summary "compute-sanitizer $tool rc=$?: $(grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_$tool.log" | tail -2 | tr '\n' ' ')"
      done ;;
    stream)  # issue 10: weight streaming + planner, rows F,E,D8,A,C,B,D24 (STREAM_ROWS), one process
             # per configuration, the whole stage bounded by STREAM_DEADLINE seconds
      if ls .whl/*.whl > /dev/null 2>&1; then  # torchao for row A's baseline (no network there)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/*.whl > "$OUT/stream_pip.log" 2>&1 \
          && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
      fi
      timeout $(( ${STREAM_DEADLINE:-450} + 30 )) python3 bench/train/bench_stream.py \
        --rows "${STREAM_ROWS:-F,E,D8,A,C,B,D24}" --deadline "${STREAM_DEADLINE:-450}" \
        --out "$OUT/stream.json" ${STREAM_ARGS:-} > "$OUT/stream.log" 2>&1
      summary "stream rc=$?"; sed -n '/^config /,$p' "$OUT/stream.log" | tee -a "$OUT/summary.txt" ;;
    quant)   # issue 11: NF4 14B LoRA, the 70B shape streamed, load_model vs from_pretrained
      timeout $(( ${QUANT_DEADLINE:-380} + 30 )) python3 bench/train/bench_quant.py \
        --deadline "${QUANT_DEADLINE:-380}" --out "$OUT/quant.json" ${QUANT_ARGS:-} > "$OUT/quant.log" 2>&1
      summary "quant rc=$?"; tail -14 "$OUT/quant.log" | tee -a "$OUT/summary.txt" ;;
    offload)  # issue 13: OffloadModel (torch's AdamW; and its host optimizer: ramstream_hostopt)
              # vs RamTorch 1.11 (.whl/ramtorch-*.whl), one process each, the 1.8B GPT one chunk
              # per block, window 2, pin 0, keep_activations=True (three rows: allow ~3 builds in
              # OFFLOAD_DEADLINE; OFFLOAD_ARGS="--impls ..." picks rows, e.g. ramstream_hostopt_bf16)
      if ls .whl/ramtorch-*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/ramtorch-*.whl > "$OUT/offload_pip.log" 2>&1 \
          && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
      fi
      timeout $(( ${OFFLOAD_DEADLINE:-480} + 30 )) python3 bench/train/bench_offload_model.py \
        --model "${MODEL:-1.8b}" --batch 8 --seq 512 --cap-gib 24 --window 2 --pin 0 --keep true \
        --deadline "${OFFLOAD_DEADLINE:-480}" --out "$OUT/offload_model.json" ${OFFLOAD_ARGS:-} \
        > "$OUT/offload_model.log" 2>&1
      summary "offload rc=$?"; sed -n '/^config /,$p' "$OUT/offload_model.log" | tee -a "$OUT/summary.txt" ;;
    pipeline)  # issue 28: Pipeline, 1.8B GPT one chunk per block, 8x512, 8 microbatches, 24 GiB:
               # P2 (2 streamed stages on cuda:0 vs OffloadModel and RamTorch 1.11's Pipeline from
               # .whl/ramtorch-*.whl), P4 (4 stages, gpipe/1f1b/interleaved vs the simulator),
               # P2GPU (cuda:0 + cuda:1 vs 1 GPU; skipped on one GPU); ~6 builds in PIPELINE_DEADLINE (480 s);
               # PIPELINE_ARGS="--rows P2" picks rows
      if ls .whl/ramtorch-*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/ramtorch-*.whl > "$OUT/pipeline_pip.log" 2>&1 \
          && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
      fi
      timeout $(( ${PIPELINE_DEADLINE:-480} + 30 )) python3 bench/train/bench_pipeline.py \
        --model "${MODEL:-1.8b}" --batch 8 --seq 512 --microbatches 8 --cap-gib 24 --window 2 --pin 0 \
        --deadline "${PIPELINE_DEADLINE:-480}" --out "$OUT/pipeline.json" ${PIPELINE_ARGS:-} \
        > "$OUT/pipeline.log" 2>&1
      summary "pipeline rc=$?"; sed -n '/^config /,$p' "$OUT/pipeline.log" | tee -a "$OUT/summary.txt" ;;
    delayed)  # issue 29: delayed_update vs plain, GPT 6.85B bf16 8x512 chunked, 24 GiB, 200 steps each
      timeout ${DELAYED_TIMEOUT:-540} python3 bench/train/bench_delayed.py --model 6.85b --batch 8 --seq 512 \
        --cap-gib 24 --steps "${DELAYED_STEPS:-200}" --out "$OUT/delayed.json" ${DELAYED_ARGS:-} > "$OUT/delayed.log" 2>&1
      summary "delayed rc=$?"; tail -4 "$OUT/delayed.log" | tee -a "$OUT/summary.txt" ;;
    nvme)  # issue 29: the optimizer state on disk vs in RAM, GPT 6.85B bf16 8x512 chunked, 24 GiB;
           # NVME_DIR: a folder on the fastest local disk (default /tmp); NVME_ARGS, NVME_WEIGHTS_ARGS and
           # NVME_OFFLOAD_ARGS (e.g. "--share 0.1 --steps 6 --skip 2", "--model 1.8b", "--no-control",
           # "--deterministic") fit the runs to a small or slow disk; each runs the RAM variant twice
           # (the run-to-run spread of the losses) unless --no-control
      timeout ${NVME_TIMEOUT:-400} python3 bench/train/bench_nvme.py --model 6.85b --batch 8 --seq 512 \
        --cap-gib 24 --dir "${NVME_DIR:-/tmp}" --out "$OUT/nvme.json" ${NVME_ARGS:-} > "$OUT/nvme.log" 2>&1
      summary "nvme rc=$?"; tail -7 "$OUT/nvme.log" | tee -a "$OUT/summary.txt"
      # and a frozen base's streamed weights on disk (nvme_weights) vs in pinned RAM, same model
      timeout ${NVME_TIMEOUT:-400} python3 bench/train/bench_nvme.py --what weights --model 6.85b --batch 8 \
        --seq 512 --cap-gib 24 --dir "${NVME_DIR:-/tmp}" --out "$OUT/nvme_weights.json" ${NVME_WEIGHTS_ARGS:-} \
        > "$OUT/nvme_weights.log" 2>&1
      summary "nvme weights rc=$?"; tail -6 "$OUT/nvme_weights.log" | tee -a "$OUT/summary.txt"
      # and OffloadModel's frozen chunks (the blocks) all on disk (nvme, nvme_path) vs in pinned RAM:
      # s/step, disk read GB/s against the measured read rate (target >= 80 %)
      timeout ${NVME_TIMEOUT:-400} python3 bench/train/bench_nvme.py --what offload --model 6.85b --batch 8 \
        --seq 512 --cap-gib 24 --dir "${NVME_DIR:-/tmp}" --out "$OUT/nvme_offload.json" ${NVME_OFFLOAD_ARGS:-} \
        > "$OUT/nvme_offload.log" 2>&1
      summary "nvme offload rc=$?"; tail -7 "$OUT/nvme_offload.log" | tee -a "$OUT/summary.txt" ;;
    trainer)  # issue 12: Qwen2-1.5B shape, stock Trainer vs OffloadTrainer, uncapped and at 12 GiB
      timeout $(( ${TRAINER_DEADLINE:-300} + 30 )) python3 bench/train/bench_trainer.py \
        --deadline "${TRAINER_DEADLINE:-300}" --out "$OUT/trainer.json" ${TRAINER_ARGS:-} > "$OUT/trainer.log" 2>&1
      summary "trainer rc=$?"; tail -12 "$OUT/trainer.log" | tee -a "$OUT/summary.txt" ;;
    loss)  # issue 12: the chunked causal-LM loss against HF's dense one, Qwen2-1.5B's head
      timeout 120 python3 bench/train/bench_loss.py --profile --out "$OUT/loss.json" ${LOSS_ARGS:-} \
        > "$OUT/loss.log" 2>&1
      summary "loss rc=$?"; sed -n '1,8p' "$OUT/loss.log" | tee -a "$OUT/summary.txt" ;;
    defaults)  # issue 24: wrap()'s defaults vs hand-picked options (and stock) at 8-24 GiB caps, rows
               # R1-R6 of bench_defaults.py, one process per run, the whole stage bounded by DEFAULTS_DEADLINE
      timeout $(( ${DEFAULTS_DEADLINE:-500} + 20 )) python3 bench/train/bench_defaults.py \
        --rows "${DEFAULTS_ROWS:-R1,R3,R5,R4,R6}" --caps "${DEFAULTS_CAPS:-8,12,16,24}" \
        --deadline "${DEFAULTS_DEADLINE:-500}" --out "$OUT/defaults.jsonl" ${DEFAULTS_ARGS:-} > "$OUT/defaults.log" 2>&1
      summary "defaults rc=$?"; sed -n '/^| row /,$p' "$OUT/defaults.log" | tee -a "$OUT/summary.txt" ;;
    io)      # issue 29: direct I/O by pread/pwrite threads (the disk store's way) vs io_uring, same file
             # (bench/probe_io.cpp): IO_DIR (default /tmp), IO_GIB (default 4)
      g++ -O2 -std=c++17 -pthread bench/probe_io.cpp -o /tmp/probe_io \
        && timeout 150 /tmp/probe_io "${IO_DIR:-/tmp}" "${IO_GIB:-4}" 1,8 1,4,16 > "$OUT/io.jsonl" 2> "$OUT/io.log"
      summary "io rc=$?"
      python3 -c 'import json,sys; [print("  %-13s %-5s %2d MiB x%-2d %6.2f GB/s" % (r["method"], r["op"], r["chunk_mib"], r["concurrency"], r["gbps"])) for r in map(json.loads, open(sys.argv[1]))]' \
        "$OUT/io.jsonl" | tee -a "$OUT/summary.txt" ;;
    pin)     # where the offloaded setup goes: page-locking rate by method (probe_pin.py), PIN_GIB
      timeout 120 python3 bench/train/probe_pin.py --gib "${PIN_GIB:-8}" --out "$OUT/pin.json" > "$OUT/pin.log" 2>&1
      summary "pin rc=$?"; tee -a "$OUT/summary.txt" < "$OUT/pin.log" ;;
    doctor)  # issue 9: what this machine offers, one screen
      timeout 120 ramstream doctor > "$OUT/doctor.log" 2>&1
      summary "doctor rc=$?"; cat "$OUT/doctor.log" ;;
    probe)   # issue 10: the weight stream of the 1.8B GPT through a 4 GiB cap (probe_stream.py)
      timeout "${PROBE_TIMEOUT:-400}" python3 bench/train/probe_stream.py --out "$OUT/probe.json" \
        ${PROBE_ARGS:-} > "$OUT/probe.log" 2>&1
      summary "probe rc=$?"; cut -c1-600 "$OUT/probe.log" | tee -a "$OUT/summary.txt" ;;
    loadprobe)  # issue 11: where load_model's time goes (probe_load.py), on a 7B-shaped checkpoint
      ck=/tmp/ramstream-loadprobe
      [ -d "$ck" ] || timeout 200 python3 bench/train/load_ckpt.py "$ck" --layers "${LOADPROBE_LAYERS:-28}" \
        --shard 4GB > "$OUT/loadprobe.log" 2>&1
      timeout "${LOADPROBE_TIMEOUT:-200}" python3 bench/train/probe_load.py "$ck" ${LOADPROBE_ARGS:-} >> "$OUT/loadprobe.log" 2>&1
      summary "loadprobe rc=$?"
      RAMSTREAM_FORCE_ISA=avx2 timeout 100 python3 bench/train/probe_load.py "$ck" --only floor,load \
        >> "$OUT/loadprobe.log" 2>&1
      summary "loadprobe avx2 rc=$?"; grep -E "^(RESULT|INFO)" "$OUT/loadprobe.log" | cut -c1-400 ;;
    dp)    # issue 5 (a machine with 2+ GPUs): scaling, 1/N host state, parity, identical replicas
      timeout 580 python3 bench/train/bench_dp.py --nproc "${NPROC:-2}" --model "${MODEL:-1.8b}" \
        --batch 8 --seq 512 --steps 10 --check --out "$OUT/dp.json" > "$OUT/dp.log" 2>&1
      summary "dp rc=$?"; tail -8 "$OUT/dp.log" ;;
  esac
done
echo "==== summary"; cat "$OUT/summary.txt"
# The device tool brings back at most 8 files from $OUT: past that, every file goes into one
# archive (all.tgz; `tar xzf all.tgz` here) and only it, summary.txt and tests_cuda.log stay.
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/ramstream-all.tgz --exclude=./all.tgz . && mv /tmp/ramstream-all.tgz all.tgz) \
    && find "$OUT" -maxdepth 1 -type f ! -name all.tgz ! -name summary.txt ! -name tests_cuda.log -delete
fi
