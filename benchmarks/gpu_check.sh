#!/usr/bin/env bash
# One lent GPU machine, one call (the device tool's 10-minute command limit): build the extension against that
# machine's torch, run the GPU-marked tests, the GPU benchmark the open issues ask for, then the rest of tests/python
# (pytest-xdist) in whatever time is left. Every log and JSON lands in $OUT (default gpu_out/).
#
#   OUT=/some/dir BUDGET=560 bash benchmarks/gpu_check.sh
#
# BUDGET (seconds) bounds the whole script; the full test run gets what the earlier steps leave and is stopped with
# SIGINT at the deadline, so pytest still prints its summary of what ran.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
BUDGET=${BUDGET:-560}
PY=${PY:-python3}
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((BUDGET - $(elapsed))); }
log() { echo "[$(elapsed) s] $*"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "cores $(nproc), $(grep -m1 'model name' /proc/cpuinfo)"
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$OUT/machine.txt"

log "build: the _C extension (Release, CUDA parts on) with $(nproc) jobs"
if ! { cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")" \
  -DZEROSHARD_MODULE_OUTPUT_DIR="$PWD/python/zeroshard" && cmake --build build/gpu -j "$(nproc)" --target _C; } \
  >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  log "build FAILED"
  exit 1
fi
grep -E "CUDA parts|torch is built|C\+\+ runtime" "$OUT/build.log"
# One C++ runtime in the process: _C must load the shared libstdc++, not carry a static copy (CMakeLists.txt).
readelf -d python/zeroshard/_C*.so | grep -E "NEEDED.*libstdc" || echo "WARNING: _C does not load the shared libstdc++"
log "build done"

export PYTHONPATH="$PWD/python:$PWD/examples" PYTHONUNBUFFERED=1
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs)

log "GPU-marked tests"
timeout -s INT 100 "${PYTEST[@]}" -m "gpu or multi_gpu" tests/python 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15

log "bench_offload: 1.3B GPT, stage 3 without offload against FSDP2 without offload (issue 22), one GPU"
timeout 200 "$PY" benchmarks/bench_offload.py --configs zeroshard_no_offload,zeroshard_no_offload_fused,fsdp2_no_offload,fsdp2_no_offload_fused \
  --out "$OUT" --budget 190 --timeout 80 2>&1 | tee "$OUT/bench_offload.log" | tail -12

T=$(($(left) - 10))
if [ "$T" -gt 30 ]; then
  log "all other tests in tests/python, pytest-xdist, stopped after $T s"
  timeout -s INT "$T" "${PYTEST[@]}" -n 8 -m "not gpu and not multi_gpu" tests/python >"$OUT/pytest_all.log" 2>&1
  tail -25 "$OUT/pytest_all.log"
else
  log "no time left for the rest of tests/python"
fi
log "done"
