#!/usr/bin/env bash
# Issue 46's device check, one call: the families' backend tests on CUDA (Qwen2 biases, Qwen3 q/k norms through the
# Triton kernels, fp32 and bf16, CUDA graphs), then e2e_gpu.py at Llama-3.1-8B, Qwen2.5-7B and Qwen3-8B shapes
# (random bf16 weights): lazy TTFT and decode ms/token, to compare per parameter.
#   bash benchmarks/families_gpu.sh      Writes e2e_<card>_<shape>.json and logs to $OUT (or benchmarks/results).
set -u
OUT=$(cd "${OUT:-benchmarks/results}" && pwd)
export PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'triton', triton.__version__, 'torch', torch.__version__)"
card=$(python3 -c "import torch; print('h200' if 'H200' in torch.cuda.get_device_name() else 'h100')")  # names the result files
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 3; }
timeout 200 python3 -m pytest -q -x tests/engine/test_backends.py -k families -p no:cacheprovider 2>&1 | tail -3
for shape in llama3.1-8b qwen2.5-7b qwen3-8b; do
  timeout ${E2E_S:-130} python3 benchmarks/e2e_gpu.py --shape $shape --reps ${REPS:-10} --out "$OUT/e2e_${card}_$shape.json" \
      > "$OUT/e2e_${card}_${shape}_log.txt" 2>&1 || echo "$shape exited $?"
  grep "shapes\|lazyrag TTFT lazy \|lazyrag decode\|transformers full" "$OUT/e2e_${card}_${shape}_log.txt" | sed "s/^/$shape: /"
done
