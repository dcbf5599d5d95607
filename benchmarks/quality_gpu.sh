#!/usr/bin/env bash
# Answer quality of the embedded model at full n on the GPU machine (the device tool: no internet, no gguf
# package). The 98 MB GGUF cannot travel in one call (64 MiB), so it goes in two parts, two calls in a row
# while the machine is warm:
#   call 1 (carry .model/a):                      mkdir -p /tmp/m && cp .model/a/part1 /tmp/m/
#   call 2 (carry .model/b .whl .data):           bash benchmarks/quality_gpu.sh SECONDS "STRATEGIES" [DATASETS]
#   more calls, same command, while still warm:   the evals resume (--resume) where the last call stopped
# Here, beforehand: .model/a/part1 = the GGUF's first 58,000,000 bytes, .model/b/part2 the rest and
# .model/b/sha its sha256; .whl/ the gguf wheel (device README); .data/ a copy of ../shared/data, and in
# .data/partial/ the *.partial.jsonl of an earlier machine, if the runs are to go on from there.
# Each dataset runs in its own workers, spread over every visible GPU; every finished batch is saved, so a
# call that runs out of time loses only the batches in flight. Results and partial files land in $OUT.
set -euo pipefail
budget=${1:?seconds}; strategies=${2:?strategies}; datasets=${3:-"nq hotpotqa"}
start=$(date +%s)
M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$M" ]; then
  cat /tmp/m/part1 .model/b/part2 > "$M"
fi
echo "$(cat .model/b/sha)  $M" | sha256sum -c
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1  # the worker processes share the cores
export LAZYRAG_KERNEL_AUTOTUNE=0  # each worker would autotune the kernels again: the default configs
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
nvidia-smi --query-gpu=index,name,memory.used --format=csv
Q=/tmp/q  # survives between calls on a warm machine
mkdir -p "$Q"
cp -n .data/partial/*.partial.jsonl "$Q"/ 2>/dev/null || true
trap 'cp "$Q"/* "$OUT"/ 2>/dev/null || true' EXIT
left=$(( budget - ($(date +%s) - start) ))
run() {  # dataset n workers batch [extra]: one dataset's eval, resumed, stopped in time to write its report
  timeout "$left" python3 -m lazyrag.cli eval --resume --time-limit $(( left - 40 )) --dataset "$1" --n "$2" \
    --strategies "$strategies" --out "$Q/quality_$1_gpu.json" --device cuda --dtype float32 --workers "$3" \
    --batch "$4" --eager --max-new-tokens "${NEW_TOKENS:-16}" --model "$M" "${@:5}" > "$Q/log_$1.txt" 2>&1 \
    || echo "eval $1 exited $?" >> "$Q/log_$1.txt"
}
for d in $datasets; do
  case $d in
    nq) run nq 2655 "${NQ_WORKERS:-4}" 32 --data .data/nq_open_oracle_2655.jsonl.gz & ;;
    hotpotqa) run hotpotqa 500 "${HP_WORKERS:-2}" 16 --shuffle --data .data/hotpotqa_dev_500.jsonl & ;;
  esac
done
wait
for d in $datasets; do tail -n 12 "$Q/log_$d.txt"; done
