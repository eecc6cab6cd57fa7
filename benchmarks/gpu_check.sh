#!/usr/bin/env bash
# One lent GPU machine, one call (the device tool allows 15 minutes of device time a session, 10 a command): build the
# extension against that machine's torch, run the GPU-marked tests, then the GPU benchmarks the open issues ask for,
# most important first, each bounded so the whole fits BUDGET seconds. Every log and JSON lands in $OUT (at most 8
# files come back: run.log, build.log, pytest_gpu.log and one JSON per benchmark).
#
#   OUT=/some/dir BUDGET=570 bash benchmarks/gpu_check.sh
#
#   1. GPU-marked tests (DeviceAdam on CUDA, the engine's device step, offload)                 <= 100 s
#   2. bench_device_adam.py --devices cuda: the CUDA Adam kernel, DeviceAdam eager, torch fused   <= 70 s   (issue 19)
#   3. max_model_size.py --optimizer_state_dtype int8 at MAX_LAYERS (default 14: 11.7B, 1.52x
#      the 7.67B found with fp32 moments on 126 GiB of host; MAX_LAYERS=0 skips it)             <= 200 s  (issue 19)
#   4. bench_offload.py: the 1.3B GPT at stage 3 without offload vs FSDP2, and with bf16/int8
#      moments on the GPU (DeviceAdam)                                                           what is left (22, 19)
#   5. the rest of tests/python (pytest-xdist), if any time is left.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
BUDGET=${BUDGET:-570}
PY=${PY:-python3}
MAX_LAYERS=${MAX_LAYERS:-14}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((BUDGET - $(elapsed))); }
log() { echo "[$(elapsed) s] $*"; }
cap() { local l; l=$(left); echo $((l < $1 ? l : $1)); }  # min(wanted, left)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "cores $(nproc), $(grep -m1 'model name' /proc/cpuinfo), $(free -g | awk '/Mem:/ {print $2}') GiB host"
git log --oneline -1 2>/dev/null || true

# Only this GPU's architecture: the default list (8.0;9.0+PTX) compiles the CUDA kernels twice.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
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

log "1. GPU-marked tests"
timeout -s INT "$(cap 100)" "${PYTEST[@]}" -m "gpu or multi_gpu" tests/python >"$OUT/pytest_gpu.log" 2>&1
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/pytest_gpu.log" | tail -25

log "2. bench_device_adam: the CUDA Adam kernel and DeviceAdam eager against torch's fused AdamW (fp32 state)"
timeout "$(cap 70)" "$PY" benchmarks/bench_device_adam.py --devices cuda --sizes 64M --rounds 3 --impls eager,cuda_kernel,torch_fused_adamw \
  --json "$OUT/device_adam_cuda.json"

T=$(cap 200)
if [ "$MAX_LAYERS" = 0 ]; then
  log "3. max_model_size: skipped (MAX_LAYERS=0)"
elif [ "$T" -gt 120 ]; then
  log "3. max_model_size: int8 moments, n_layer $MAX_LAYERS, stopped after $T s"
  timeout "$T" "$PY" benchmarks/max_model_size.py --optimizer_state_dtype int8 --n_layers "$MAX_LAYERS" \
    --out "$OUT" --budget "$((T - 5))" --timeout "$((T - 10))"
else
  log "3. max_model_size: skipped, $T s left"
fi

T=$(($(left) - 10))
if [ "$T" -gt 40 ]; then
  log "4. bench_offload: 1.3B GPT, stage 3 without offload vs FSDP2; bf16/int8 moments on the GPU, $T s"
  timeout "$T" "$PY" benchmarks/bench_offload.py --out "$OUT" --budget "$((T - 10))" --timeout 60 \
    --configs zeroshard_no_offload,fsdp2_no_offload,zeroshard_no_offload_fused,fsdp2_no_offload_fused,zeroshard_no_offload_int8_state,zeroshard_no_offload_bf16_state
else
  log "4. bench_offload: skipped, $T s left"
fi

T=$(($(left) - 10))
if [ "$T" -gt 30 ]; then
  log "5. all other tests in tests/python, pytest-xdist, stopped after $T s"
  timeout -s INT "$T" "${PYTEST[@]}" -n 8 -m "not gpu and not multi_gpu" tests/python >"$OUT/pytest_all.log" 2>&1
  tail -25 "$OUT/pytest_all.log"
else
  log "5. no time left for the rest of tests/python"
fi
log "done"
