#!/usr/bin/env bash
# End to end, round 4: ONE device call, within ~240 s wall (run from a copy of the worktree, e.g.
# `cd .kwt && bash benchmarks/device_round4.sh`; $OUT is the call's output folder).
# The e2e benchmark (with a kernel profile) first, alone on the GPU, so its timings are clean; then the
# GPU tests (kernels -m gpu, and the engine backends) side by side in whatever time is left.
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET=${BUDGET:-236}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
timeout ${E2E_LIMIT:-130} python3 benchmarks/e2e_gpu.py --reps 8 --profile ${E2E_ARGS:---ab cublaslt,prefill_splits=4,decode_splits=8} --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e_log.txt"
echo "e2e finished at $(( $(date +%s) - T0 )) s"
L=$(( BUDGET - ($(date +%s) - T0) ))
echo "GPU tests get ${L} s"
LAZYRAG_KERNEL_AUTOTUNE=0 timeout $L python3 -m pytest -q -n 3 tests/test_kernels.py -m gpu > "$OUT/gpu_kernel_tests_log.txt" 2>&1 &
LAZYRAG_KERNEL_AUTOTUNE=0 timeout $L python3 -m pytest -q -n 8 tests/test_engine_backends.py > "$OUT/gpu_engine_tests_log.txt" 2>&1
echo "engine tests exit $?"
wait
tail -4 "$OUT/gpu_kernel_tests_log.txt" "$OUT/gpu_engine_tests_log.txt"
echo "all finished at $(( $(date +%s) - T0 )) s"
