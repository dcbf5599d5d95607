#!/usr/bin/env bash
# Issue 31's device check: the GPU tests of this tree, then benchmarks/e2e_gpu.py (Llama-3.1-8B shapes, random
# bf16 weights: TTFT and decode ms/token) of an older tree and of this one, alternating, in one call.
#   bash benchmarks/code_health_gpu.sh OLD_TREE [ROUNDS]     (SKIP_TESTS=1: e2e only; FIRST_ROUND=K: rounds K..ROUNDS)
# OLD_TREE: a checkout of the code to compare with (e.g. `git archive <commit> | tar -x -C .snap`, carried).
# Each tree is installed editable before its run (a tree from before lazyrag/kernels/ mounts lazyrag.kernels from
# its top-level kernels/ through setup.py, so its e2e_gpu.py only sees its own kernels once it is the one installed). Writes to $OUT (or
# benchmarks/results): gpu_tests_NAME_log.txt, e2e_h200_NAME_{old,new}_rK.json and their logs (NAME: $NAME, default
# code_health; issue 33's TP=1 check ran with NAME=tp1).
set -u
old=${1:?old tree}; rounds=${2:-1}; name=${NAME:-code_health}
OUT=$(cd "${OUT:-benchmarks/results}" && pwd)
new=$(pwd)
export PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) || { echo "install of $1 failed"; exit 3; }; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'triton', triton.__version__, 'torch', torch.__version__)"
install "$new"
[ -n "${SKIP_TESTS:-}" ] || timeout 170 python3 -m pytest -q -n 8 -m gpu tests/kernels tests/engine/test_backends.py 2>&1 \
    | grep -v "Warning\|warner\|config/__init__\|self._warn\|^\s*$" | tee "$OUT/gpu_tests_${name}_log.txt" | tail -6
for r in $(seq "${FIRST_ROUND:-1}" "$rounds"); do
  for side in old new; do
    tree=$new; [ "$side" = old ] && tree=$old
    install "$tree"
    (cd "$tree" && timeout 190 python3 benchmarks/e2e_gpu.py --reps ${REPS:-10} --out "$OUT/e2e_h200_${name}_${side}_r$r.json") \
        > "$OUT/e2e_h200_${name}_${side}_r${r}_log.txt" 2>&1 || echo "e2e $side exited $?"
    grep "lazyrag TTFT lazy\|lazyrag decode" "$OUT/e2e_h200_${name}_${side}_r${r}_log.txt" | sed "s/^/$side r$r: /"
  done
done
install "$new"
