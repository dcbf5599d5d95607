#!/usr/bin/env bash
# Issue 30: choose the recovery on the tune splits of every set, then measure it on the report splits, on the
# GPU machine. The same command goes into every call while the machine stays warm (after the call that brings
# the model's first parts, see quality_gpu.sh; carry the last .model/N .whl .data); each call goes on where the last
# one stopped: the tune evals, then the choice (benchmarks/quality_sets.py --select, its rule in its
# docstring, fixed before any report split ran), then the report evals of full, lazy, the shipped
# lazy+recover, CacheBlend's lazy:blend=0.15 and the choice.
#   bash benchmarks/recovery_choice_gpu.sh SECONDS
# Everything is in /tmp/q and comes back as $OUT/quality_gpu.tgz.
set -euo pipefail
budget=${1:?seconds}; start=$(date +%s)
Q=/tmp/q
TUNE=${TUNE:-"full,lazy,lazy:blend=0.15,lazy+recover,lazy:blend=0.15:select=attn,lazy:first=4:blend=0.12:select=attn,lazy:blend=0.15:select=attn:attn_from=0.5,lazy:blend=0.15:select=attn_dev:budget=chunk"}
TUNE_SETS=${TUNE_SETS:-"nq:tune:100:3 hotpotqa:tune:60:2 squad:tune:120:2 2wiki:tune:90:2 musique:tune:36:2"}
REPORT_SETS=${REPORT_SETS:-"nq:report:800:3 hotpotqa:report:350:2 squad:report:600:2 2wiki:report:350:2 musique:report:140:2"}
export KV_GIB=${KV_GIB:-4} SPLIT_BATCH=${SPLIT_BATCH:-8}  # 15 workers of 5 GiB, 12 questions x 8 strategies a batch: out of GPU memory
finished() {  # split: every set's report of that split is written and none is partial
  for d in $1; do
    IFS=: read -r name split _ <<< "$d"
    [ -f "$Q/quality_${name}_${split}_gpu.json" ] && [ ! -f "$Q/quality_${name}_${split}_gpu.partial.jsonl" ] || return 1
  done
}
reports() { for d in $1; do IFS=: read -r name split _ <<< "$d"; echo "$Q/quality_${name}_${split}_gpu.json"; done; }
left() { echo $(( budget - ($(date +%s) - start) )); }
mkdir -p "$Q"
trap 'tar czf "$OUT/quality_gpu.tgz" -C "$Q" . 2>/dev/null || true' EXIT
if ! finished "$TUNE_SETS"; then
  bash benchmarks/quality_gpu.sh "$(left)" "$TUNE" "$TUNE_SETS" || true
fi
if finished "$TUNE_SETS" && [ ! -s "$Q/chosen" ]; then
  python3 benchmarks/quality_sets.py $(reports "$TUNE_SETS") --out "$Q/recovery_tune.json" --select "$Q/chosen" | tail -n 16
fi
if [ -s "$Q/chosen" ] && [ "$(left)" -gt 150 ] && ! finished "$REPORT_SETS"; then
  chosen=$(cat "$Q/chosen")
  report="full,lazy,lazy+recover,lazy:blend=0.15"
  case ",$report," in *",$chosen,"*) ;; *) report="$report,$chosen" ;; esac
  bash benchmarks/quality_gpu.sh "$(left)" "$report" "$REPORT_SETS" || true
fi
if finished "$REPORT_SETS"; then
  python3 benchmarks/quality_sets.py $(reports "$REPORT_SETS") --out "$Q/recovery_report.json"
fi
# the recoveries' TTFT on this GPU (HotpotQA prompts, chunks cached, eager), once, if time is left
if [ -s "$Q/chosen" ] && [ ! -f "$Q/ttft_h200.json" ] && [ "$(left)" -gt 150 ]; then
  PYTHONPATH=/tmp/site LAZYRAG_KERNEL_AUTOTUNE=0 timeout $(( $(left) - 30 )) python3 benchmarks/ttft.py \
    --model /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --items 5 --repeats 3 \
    --strategies "full,lazy,lazy+recover,lazy:blend=0.15,$(cat "$Q/chosen")" --data .data/hotpotqa_dev_500.jsonl \
    --out "$Q/ttft_h200.json" > "$Q/log_ttft.txt" 2>&1 || echo "ttft exited $?" >> "$Q/log_ttft.txt"
  tail -n 12 "$Q/log_ttft.txt"
fi
