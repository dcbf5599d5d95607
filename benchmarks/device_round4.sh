#!/usr/bin/env bash
# End to end, round 4: one device call (run from a copy of the worktree; $OUT is the call's output folder).
#   e2e benchmark with A/B variants and a profile, the attention/GEMM sweep at the e2e shape,
#   then the GPU tests (kernels -m gpu, and the engine backends) side by side.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
t0=$(date +%s)
timeout 200 python3 benchmarks/e2e_gpu.py --reps 8 --ab --profile --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e_log.txt"
echo "e2e: $(( $(date +%s) - t0 )) s"
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  timeout 90 python3 benchmarks/e2e_sweep.py --out "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep_log.txt"
  echo "sweep: $(( $(date +%s) - t0 )) s"
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  LAZYRAG_KERNEL_AUTOTUNE=0 timeout 200 python3 -m pytest -q -n 4 tests/test_kernels.py -m gpu > "$OUT/gpu_kernel_tests_log.txt" 2>&1 &
  LAZYRAG_KERNEL_AUTOTUNE=0 timeout 220 python3 -m pytest -q -n 8 tests/test_engine_backends.py > "$OUT/gpu_engine_tests_log.txt" 2>&1
  wait
  tail -5 "$OUT/gpu_kernel_tests_log.txt" "$OUT/gpu_engine_tests_log.txt"
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
