#!/usr/bin/env bash
# Kernels round 6: one device call (the `run` tool; $OUT is the call's output folder), from the repository root:
#   SWEEP_ONLY=attention,elementwise,gemm AB=... TESTS="tests/test_kernels.py" TESTS_K="gemv or skinny" bash benchmarks/device_round6.sh
# 1. e2e_sweep.py alone on the GPU (sections from SWEEP_ONLY);
# 2. e2e_gpu.py with the sweep's GEMV / skinny-GEMM tables, a kernel profile and the A/B variants; "sweep_best"
#    in AB stands for the attention configs the sweep timed fastest (splits, config and rotation schedule forced);
# 3. the GPU tests in TESTS (default: the whole GPU suite; TESTS_K: a -k filter) in whatever time is left.
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET=${BUDGET:-540}
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
if [ -n "${SWEEP_ONLY}" ]; then
  stamp "sweep start"
  timeout ${SWEEP_LIMIT:-240} python3 benchmarks/e2e_sweep.py --only "${SWEEP_ONLY}" --out "$OUT/e2e_sweep.json" 2>&1 | tee "$OUT/e2e_sweep_log.txt" | grep -v "^gemv [a-z_]* (\|^prefill {\|^decode {\|^skinny [a-z_]* ("
  stamp "sweep done"
fi
TABLES=""
# --gemv-configs reads both tables (gemv_adopt, skinny_adopt)
[ -s "$OUT/e2e_sweep.json" ] && grep -q "gemv_adopt\|skinny_adopt" "$OUT/e2e_sweep.json" && TABLES="--gemv-configs $OUT/e2e_sweep.json"
BEST=$(python3 - "$OUT/e2e_sweep.json" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    sys.exit(0)
parts = []
for kind in ("prefill", "decode"):
    b = d.get(f"{kind}_best")
    if b:
        cfg = ":".join("none" if c is None else str(c) for c in b["config"])
        parts += [f"{kind}_config={cfg}", f"{kind}_splits={b['splits']}", f"{kind}_rot={b['rotation_mode']}"]
print("&".join(parts))
EOF
)
# python, not ${AB//...}: bash 5.2 expands '&' in a substitution's replacement to the matched text
AB=$(python3 -c 'import sys; ab, best = sys.argv[1:]; print(",".join(v.replace("sweep_best", best) for v in ab.split(",") if best or "sweep_best" not in v))' "${AB:-base}" "$BEST")
echo "A/B variants: $AB"
if [ "${E2E:-1}" = 1 ]; then
  timeout ${E2E_LIMIT:-200} python3 benchmarks/e2e_gpu.py --reps ${REPS:-10} ${PROFILE---profile} $TABLES --ab "$AB" --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e_log.txt"
  stamp "e2e done"
fi
L=$(( BUDGET - ($(date +%s) - T0) ))
echo "GPU tests get ${L} s"
LAZYRAG_KERNEL_AUTOTUNE=0 timeout $L python3 -m pytest -q -n 8 -m gpu ${TESTS:-tests/test_kernels.py tests/test_engine_backends.py} \
  ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu_tests_log.txt" 2>&1
echo "GPU tests exit $?"
tail -n 15 "$OUT/gpu_tests_log.txt"
stamp "all finished"
