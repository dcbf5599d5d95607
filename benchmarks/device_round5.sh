#!/usr/bin/env bash
# Kernels round 5: ONE device call, within ~400 s wall (run from a copy of the worktree, e.g.
# `cd .kwt && bash benchmarks/device_round5.sh`; $OUT is the call's output folder).
# 1. e2e_sweep.py alone on the GPU: the fused one-token GEMVs (every candidate config, checked, then timed
#    against norm + cuBLAS), the attention kernels' splits/configs at the e2e shape, the GEMMs at M=1/64;
# 2. e2e_gpu.py with the sweep's GEMV table, a kernel profile and the A/B variants;
# 3. the GPU tests (kernels -m gpu, and the engine backends) side by side in whatever time is left.
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET=${BUDGET:-400}
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
stamp "sweep start"
timeout ${SWEEP_LIMIT:-120} python3 benchmarks/e2e_sweep.py --only "${SWEEP_ONLY:-gemv,attention,gemm}" --out "$OUT/e2e_sweep.json" 2>&1 | tee "$OUT/e2e_sweep_log.txt" | grep -v "^gemv [a-z_]* (\|^prefill {\|^decode {"
stamp "sweep done"
GEMV=""
[ -s "$OUT/e2e_sweep.json" ] && grep -q gemv_adopt "$OUT/e2e_sweep.json" && GEMV="--gemv-configs $OUT/e2e_sweep.json"
timeout ${E2E_LIMIT:-140} python3 benchmarks/e2e_gpu.py --reps 8 --profile $GEMV \
  --ab "${AB:-base,gemv=none,gemv=wqkv+wo,decode_merge&prefill_merge,decode_splits=8,prefill_splits=4,cublaslt}" --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e_log.txt"
if ! grep -q '"lazyrag_decode_ms_per_token"' "$OUT/e2e.json" 2>/dev/null; then  # the GEMV path broke: the round-4 engine
  stamp "e2e failed; again without the GEMVs"
  timeout 80 python3 benchmarks/e2e_gpu.py --reps 8 --no-gemv --out "$OUT/e2e.json" 2>&1 | tee -a "$OUT/e2e_log.txt"
fi
stamp "e2e done"
L=$(( BUDGET - ($(date +%s) - T0) ))
echo "GPU tests get ${L} s"
LAZYRAG_KERNEL_AUTOTUNE=0 timeout $L python3 -m pytest -q -n 4 tests/test_kernels.py -m gpu > "$OUT/gpu_tests_log.txt" 2>&1 &
LAZYRAG_KERNEL_AUTOTUNE=0 timeout $L python3 -m pytest -q -n 8 tests/test_engine_backends.py > "$OUT/gpu_engine_tests_log.txt" 2>&1
echo "engine tests exit $?"
wait
tail -n 6 "$OUT/gpu_tests_log.txt" "$OUT/gpu_engine_tests_log.txt"
stamp "all finished"
