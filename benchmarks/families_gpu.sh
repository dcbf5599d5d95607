#!/usr/bin/env bash
# Issue 46's device check, in parts of under 10 minutes each (random bf16 weights at each model's shapes):
#   PART=t bash benchmarks/families_gpu.sh     the families' CUDA tests (Qwen2 biases, Qwen3 q/k head norms through
#                                              the Triton kernels, fp32 and bf16, CUDA graphs), then the one-token
#                                              GEMV sweep of the shapes tuned_configs.json has no config for
#                                              (gemv_sweep.py -> $OUT/gemv_sweep_<card>.json)
#   PART=e bash benchmarks/families_gpu.sh [OLD_TREE]
#                                              e2e_gpu.py at Llama-3.1-8B, Qwen2.5-7B and Qwen3-8B shapes (lazy TTFT
#                                              and decode ms/token, to compare per parameter); GEMV_CONFIGS=<sweep
#                                              json> runs the Qwen shapes with the sweep's configs too; OLD_TREE (a
#                                              `git archive` of an earlier commit, carried) runs Qwen3 on it first
# Writes e2e_<card>_<shape>[_swept|_old].json and logs to $OUT (or benchmarks/results).
set -u
part=${PART:-e}
OUT=$(cd "${OUT:-benchmarks/results}" && pwd)
new=$(pwd)
export PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'triton', triton.__version__, 'torch', torch.__version__)"
card=$(python3 -c "import torch; print('h200' if 'H200' in torch.cuda.get_device_name() else 'h100')")  # names the result files
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) || { echo "install of $1 failed"; exit 3; }; }
e2e() {  # tree shape suffix [extra args]: one e2e_gpu.py run, its headline lines
  local tree=$1 shape=$2 tag=$3; shift 3
  (cd "$tree" && timeout ${E2E_S:-130} python3 benchmarks/e2e_gpu.py --shape $shape --reps ${REPS:-10} \
      --out "$OUT/e2e_${card}_$shape$tag.json" "$@") > "$OUT/e2e_${card}_$shape${tag}_log.txt" 2>&1 || echo "$shape$tag exited $?"
  grep "shapes\|lazyrag TTFT lazy \|lazyrag decode\|transformers full" "$OUT/e2e_${card}_$shape${tag}_log.txt" | sed "s/^/$shape$tag: /"
}
case $part in
t)
  install "$new"
  timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_elementwise.py -k head_rms -p no:cacheprovider 2>&1 | tail -2
  timeout 180 python3 -m pytest -q tests/engine/test_backends.py -k "families and cuda" -p no:cacheprovider 2>&1 | tail -3
  timeout ${SWEEP_S:-300} python3 benchmarks/gemv_sweep.py --shapes ${SWEEP_SHAPES:-qwen2.5-7b,qwen3-8b} \
      --out "$OUT/gemv_sweep_$card.json" 2>&1 | grep -v "Warning\|warn" > "$OUT/gemv_sweep_${card}_log.txt"
  grep -v "^  \|^$" "$OUT/gemv_sweep_${card}_log.txt" | tail -12 ;;
e)
  if [ -n "${1:-}" ]; then install "$1"; e2e "$1" qwen3-8b _old; fi
  install "$new"
  for shape in ${SHAPES_RUN:-llama3.1-8b qwen2.5-7b qwen3-8b}; do
    e2e "$new" $shape ""
    if [ -n "${GEMV_CONFIGS:-}" ] && [ "$shape" != llama3.1-8b ]; then
      e2e "$new" $shape _swept --gemv-configs "$(cd "$(dirname "$GEMV_CONFIGS")" && pwd)/$(basename "$GEMV_CONFIGS")"
    fi
  done ;;
esac
