#!/usr/bin/env bash
# Issue 41 item 5 and issue 42's step time, one device call: the GPU kernel tests of the recovery's attention, then
# benchmarks/recover_gpu.py (lazy / lazy+recover / full TTFT at 2.6k and 20.6k tokens, Llama-3.1-8B shapes, profiled)
# for this tree and OLD_TREE, then benchmarks/tune_step_gpu.py on a random-weight SmolLM2 (carry .snap/smol and .data).
#   bash benchmarks/recover_gpu.sh OLD_TREE        (OLD_TREE: `git archive <commit> lazyrag setup.py pyproject.toml
#                                                   benchmarks | tar -x -C .snap/old`, plus `kernels` for a commit
#                                                   from before lazyrag/kernels/, carried; SKIP_TUNE=1: no tune step;
#                                                   SIDES="new old old new": the trees' runs in that order, more
#                                                   pairs against drift; RECOVER_ARGS: e.g. "--docs 5 --reps 30")
# Writes recover_<card>_{new,old}.json, tune_step_gpu.json and logs to $OUT (or benchmarks/results).
set -u
old=${1:?old tree}
OUT=$(cd "${OUT:-benchmarks/results}" && pwd)
new=$(pwd)
export PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) || { echo "install of $1 failed"; exit 3; }; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'triton', triton.__version__, 'torch', torch.__version__)"
card=$(python3 -c "import torch; print('h200' if 'H200' in torch.cuda.get_device_name() else 'h100')")  # names the result files
install "$new"
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_recompute.py 2>&1 | tail -3
cp benchmarks/recover_gpu.py "$old/benchmarks/"
declare -A runs=()
for side in ${SIDES:-new old}; do
  tree=$new; [ "$side" = old ] && tree=$old
  runs[$side]=$(( ${runs[$side]:-0} + 1 )); tag=$side; [ "${runs[$side]}" = 1 ] || tag=${side}_r${runs[$side]}
  install "$tree"
  sweep=; [ "$tag" = new ] && [ -z "${NO_SWEEP:-}" ] && sweep=--sweep  # the kernels alone under each launch
  (cd "$tree" && timeout ${RECOVER_S:-200} python3 benchmarks/recover_gpu.py --label $side ${PROFILE:---profile} $sweep \
      ${RECOVER_ARGS:-} --out "$OUT/recover_${card}_$tag.json") > "$OUT/recover_${card}_${tag}_log.txt" 2>&1 \
    || echo "recover $tag exited $?"
  grep -v "Warning\|warn" "$OUT/recover_${card}_${tag}_log.txt" | grep "tokens:\|profile\|gpu \|host \|  attention\|  gather" | head -80
done
install "$new"
[ -n "${SKIP_TUNE:-}" ] || { [ -f .data/hotpotqa_dev_500.jsonl ] || gunzip -k .data/hotpotqa_dev_500.jsonl.gz
  timeout ${TUNE_S:-240} python3 benchmarks/tune_step_gpu.py --random-from .snap/smol --steps 6 --profile-steps 2 \
    --data nq=.data/nq_open_oracle_2655.jsonl.gz --data hotpotqa=.data/hotpotqa_dev_500.jsonl \
    --out "$OUT/tune_step_gpu.json" 2>&1 | grep -v "Warning\|warn\|Loading\|Writing" | tail -40; }
