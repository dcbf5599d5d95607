#!/usr/bin/env bash
# Answer quality of the embedded model on the GPU machine (the device tool: no internet, no gguf package).
# The 98 MB GGUF cannot travel in one call (64 MiB), so it goes in two parts, two calls in a row while
# the machine is warm (benchmarks/NOTES.md, "Answer quality, third pass", has the exact calls):
#   call 1 (carry .model/a):               mkdir -p /tmp/m && cp .model/a/part1 /tmp/m/
#   call 2 (carry .model/b .whl .data):    bash benchmarks/quality_gpu.sh SECONDS "NQ_STRATEGIES" "HOTPOT_STRATEGIES" [N_NQ] [N_HOTPOT]
# Here, beforehand: .model/a/part1 = the GGUF's first 58,000,000 bytes, .model/b/part2 the rest and
# .model/b/sha its sha256; .whl/ the gguf wheel (device README); .data/ a copy of ../shared/data.
set -euo pipefail
budget=${1:?seconds}; nq=${2:?nq strategies}; hp=${3:-}; n_nq=${4:-2655}; n_hp=${5:-500}
start=$(date +%s)
M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$M" ]; then
  cat /tmp/m/part1 .model/b/part2 > "$M"
fi
echo "$(cat .model/b/sha)  $M" | sha256sum -c
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2  # 8 worker processes share 16 cores
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
run() {  # dataset n strategies out [extra]
  local left=$(( budget - ($(date +%s) - start) ))
  [ "$left" -gt 60 ] || { echo "skip $1: ${left}s left"; return 0; }
  timeout "$left" python3 -m lazyrag.cli eval --dataset "$1" --n "$2" --strategies "$3" --out "$OUT/$4" \
    --device cuda --dtype float32 --batch 32 --workers "${WORKERS:-8}" --max-new-tokens 32 --model "$M" "${@:5}" || echo "eval $1 exited $?"
}
run nq "$n_nq" "$nq" quality_nq_gpu.json --data .data/nq_open_oracle_2655.jsonl.gz
if [ -n "$hp" ]; then
  run hotpotqa "$n_hp" "$hp" quality_hotpotqa_gpu.json --shuffle --data .data/hotpotqa_dev_500.jsonl
fi
