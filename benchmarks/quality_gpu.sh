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
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1  # the worker processes share 16 cores
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
run() {  # dataset n strategies out seconds batch [extra]: a time-limited eval (partial n if the time runs out)
  local left=$(( budget - ($(date +%s) - start) )) limit=$5
  [ "$limit" -lt "$left" ] || limit=$left
  [ "$limit" -gt 60 ] || { echo "skip $1: ${limit}s left"; return 0; }
  timeout "$limit" python3 -m lazyrag.cli eval --time-limit $(( limit - 25 )) --dataset "$1" --n "$2" --strategies "$3" \
    --out "$OUT/$4" --device cuda --dtype float32 --batch "$6" --workers "${WORKERS:-6}" --eager \
    --max-new-tokens "${NEW_TOKENS:-16}" --model "$M" "${@:7}" || echo "eval $1 exited $?"
}
if [ -n "$hp" ]; then nq_share=$(( budget * 62 / 100 )); else nq_share=$budget; fi
run nq "$n_nq" "$nq" quality_nq_gpu.json "$nq_share" 32 --data .data/nq_open_oracle_2655.jsonl.gz
if [ -n "$hp" ]; then
  run hotpotqa "$n_hp" "$hp" quality_hotpotqa_gpu.json "$budget" 16 --shuffle --data .data/hotpotqa_dev_500.jsonl
fi
