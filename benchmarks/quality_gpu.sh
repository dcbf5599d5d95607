#!/usr/bin/env bash
# Answer quality of the embedded model on the GPU machine (the device tool: no internet, no gguf package).
# The 98 MB GGUF cannot travel in one call (64 MiB), so it goes in parts (benchmarks/device_model.sh), one call
# each in a row while the machine is warm:
#   calls 1..N-1 (carry .model/K):              bash benchmarks/device_model.sh stage
#   call N (carry .model/N .whl .data):         bash benchmarks/device_model.sh stage && bash benchmarks/quality_gpu.sh SECONDS "STRATEGIES" [SETS]
#   more calls, same command, while still warm:   the evals resume (--resume) where the last call stopped
# SETS, space-separated: "nq" and "hotpotqa" are the whole sets as issue 14 ran them (NQ_WORKERS, HP_WORKERS);
# NAME:SPLIT:N[:WORKERS[:PASSAGES]] is N questions of one split (tune or report) of any set lazyrag eval knows, e.g.
# "nq:tune:240:4 squad:report:120:2:20" (nq and hotpotqa read .data, the others benchmarks/data; HotpotQA shuffled;
# PASSAGES: eval --passages). ADAPTER=FOLDER: every eval of the call with that adapter (tags end in _tuned);
# MODEL_DIR=FOLDER: with that model instead of the embedded GGUF, e.g. a `lazyrag tune --method full` output (same tags).
# Here, beforehand: `bash benchmarks/device_model.sh cut 32500K` (.model/0..2: the working tree is ~30 MB of the 64 MiB a call, the last part travels with .data and .whl); .whl/ the gguf wheel
# (device README); .data/ a copy of ../shared/data (hotpotqa_dev_500.jsonl may travel gzip'd), and in
# .data/partial/ the *.partial.jsonl of an earlier machine, if the runs are to go on from there; or SKIP_FROM=DIR
# (e.g. benchmarks/results/quality30): a split set scores only the questions DIR's quality_NAME_SPLIT_gpu_*.json
# reports did not answer with every strategy (eval --skip-answered), for quality_sets.py to merge.
# Each set runs in its own workers, spread over every visible GPU; every finished batch is saved, so a call
# that runs out of time loses only the batches in flight. Reports, partial files and logs are kept in /tmp/q
# (it survives between calls on a warm machine) and come back as $OUT/quality_gpu.tgz (the device returns at
# most 8 files). KV_GIB: each worker's KV pool in GiB (default 8; 12 workers of 8 GiB ran out of memory). A worker
# takes several GiB besides its pool: an 80 GB H100 held 7 workers of KV_GIB=4 and ran out with 9 and 13 (failed
# requests are recorded, not scored; benchmarks/NOTES.md), the 141 GB H200 held 11.
# DTYPE: the evals' dtype (default float32, as every committed report); bfloat16, what GPU users run, scored one
# worker's questions 2.6x faster on an H100, float32's run also re-encoding evicted chunks (NOTES, twelfth session).
set -euo pipefail
budget=${1:?seconds}; strategies=${2:?strategies}; sets=${3:-"nq hotpotqa"}
dtype=${DTYPE:-float32}
start=$(date +%s)
M=${MODEL_DIR:-$(bash benchmarks/device_model.sh join)}
tuned=${ADAPTER:+_tuned}; tuned=${tuned:-${MODEL_DIR:+_tuned}}  # the tag's suffix
[ -f .data/hotpotqa_dev_500.jsonl ] || gunzip -k .data/hotpotqa_dev_500.jsonl.gz
if [ -z "${INSTALLED:-}" ]; then  # INSTALLED=1: a caller that runs several of these at once installed already
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1  # the worker processes share the cores
export LAZYRAG_KERNEL_AUTOTUNE=0  # each worker would autotune the kernels again: the default configs
nvidia-smi --query-gpu=index,name,memory.used --format=csv
# Refuse a call that would run the GPUs out of memory before it loads anything: a worker takes its KV pool plus
# about 6 GiB (7 of KV_GIB=4 fit an 80 GB H100; 12 of KV_GIB=2, six a side of tune_gpu.sh's eval, did not; at
# KV_GIB=2 and 20 passages one held 9.0-10.0 GiB, eleventh session).
# EVALS_AT_ONCE: how many of these scripts share the GPUs (tune_gpu.sh's eval runs two).
total=0
for d in $sets; do
  case $d in
    nq) total=$(( total + ${NQ_WORKERS:-4} )) ;;
    hotpotqa) total=$(( total + ${HP_WORKERS:-2} )) ;;
    *:*:*) IFS=: read -r _ _ _ w _ <<< "$d"; total=$(( total + ${w:-2} )) ;;
  esac
done
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{s += $1} END {print int(s / 1024)}')
# TRAINING_GIB: memory a training beside the evals holds (a rank-64 tune of the embedded model peaks at 31 GiB)
fit=$(( (gib - ${TRAINING_GIB:-0}) / (${KV_GIB:-8} + 6) ))
if (( total * ${EVALS_AT_ONCE:-1} > fit )); then
  echo "quality_gpu.sh: $total workers x ${EVALS_AT_ONCE:-1} evals at once would not fit in the GPUs' ${gib} GiB" \
    "(about $fit workers of KV_GIB=${KV_GIB:-8} do): fewer workers per set, or a smaller KV_GIB" >&2
  exit 2
fi
Q=/tmp/q
mkdir -p "$Q"
cp -n .data/partial/*.partial.jsonl "$Q"/ 2>/dev/null || true
trap 'tar czf "$OUT/quality_gpu.tgz" -C "$Q" . 2>/dev/null || true' EXIT
# One question first, in one process: it converts the GGUF into the model cache and fills Triton's kernel cache,
# which the workers then read. Twelve workers starting cold each converted and compiled for themselves, and their
# first batch took 3-5 minutes of a 450 s call (benchmarks/NOTES.md, ninth session).
W=$Q/warm-up$tuned; mkdir -p "$W"
timeout 240 python3 -m lazyrag.cli eval --dataset squad --split report --n 1 --strategies "$strategies" --device cuda \
  --dtype "$dtype" --eager --max-new-tokens 2 --model "$M" --out "$W/quality.json" ${ADAPTER:+--adapter "$ADAPTER"} \
  > "$W/log.txt" 2>&1 || echo "warm-up exited $? (the workers start cold)"
left=$(( budget - ($(date +%s) - start) ))
run() {  # tag workers batch [eval options]: one eval, resumed, stopped in time to write its report
  local tag=$1 workers=$2 batch=$3; shift 3
  timeout "$left" python3 -m lazyrag.cli eval --resume --time-limit $(( left - 40 )) --strategies "$strategies" \
    --out "$Q/quality_${tag}_gpu.json" --device cuda --dtype "$dtype" --workers "$workers" --batch "$batch" --eager \
    --max-new-tokens "${NEW_TOKENS:-16}" --model "$M" ${KV_GIB:+--kv-budget "$KV_GIB"} "$@" > "$Q/log_$tag.txt" 2>&1 \
    || echo "eval $tag exited $?" >> "$Q/log_$tag.txt"
}
data_of() {  # the options that say where a set's file is
  case $1 in
    nq) echo "--data .data/nq_open_oracle_2655.jsonl.gz" ;;
    hotpotqa) echo "--data .data/hotpotqa_dev_500.jsonl --shuffle" ;;
  esac
}
skip_of() {  # SKIP_FROM=DIR: leave out the questions its earlier reports of this set and split answered (eval --skip-answered)
  [ -n "${SKIP_FROM:-}" ] || return 0
  local f=( "$SKIP_FROM"/quality_"$1"_"$2"_gpu_*.json )
  [ -f "${f[0]}" ] && echo "--skip-answered ${f[*]}"
}
tags=()
for d in $sets; do
  case $d in
    nq) run nq "${NQ_WORKERS:-4}" 32 --dataset nq --n 2655 $(data_of nq) & tags+=(nq) ;;
    hotpotqa) run hotpotqa "${HP_WORKERS:-2}" 16 --dataset hotpotqa --n 500 $(data_of hotpotqa) & tags+=(hotpotqa) ;;
    *:*:*)
      IFS=: read -r name split n workers passages <<< "$d"
      tag="${name}_${split}${passages:+_p$passages}$tuned"
      run "$tag" "${workers:-2}" "${SPLIT_BATCH:-12}" --dataset "$name" --split "$split" --n "$n" $(data_of "$name") \
        $(skip_of "$name" "$split") ${passages:+--passages "$passages"} ${ADAPTER:+--adapter "$ADAPTER"} &
      tags+=("$tag") ;;
    *) echo "unknown set $d" >&2; exit 2 ;;
  esac
done
wait
for t in "${tags[@]}"; do tail -n 14 "$Q/log_$t.txt"; done
