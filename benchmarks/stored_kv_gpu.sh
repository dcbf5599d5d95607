#!/usr/bin/env bash
# benchmarks/stored_kv.py on the GPU machine (issue 34): the GPU's bfloat16 engine, auto (= bfloat16, the
# engine's KV exactly) against a rerun of itself (the control) and int8; FP32=1 adds a float32 engine (the
# CPU's arithmetic, torch attention: ~0.3 s a question a dtype here, slower than the bf16 engine's ~0.1 s).
# Host-tier path: the device has no FAISS or MiniLM.
# After staging the model's first parts (benchmarks/device_model.sh), carry the last .model/N, .whl and .data:
#   bash benchmarks/device_model.sh stage && bash benchmarks/stored_kv_gpu.sh [SECONDS]
# Logs and JSON come back in $OUT.
set -euo pipefail
budget=${1:-540}
M=$(bash benchmarks/device_model.sh join)
[ -f .data/hotpotqa_dev_500.jsonl ] || gunzip -k .data/hotpotqa_dev_500.jsonl.gz
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
SETS=${SETS:-"nq:300,hotpotqa:200,squad:300,2wiki:200,musique:100"}
common=(--via host --host-gib 4 --device cuda --model "$M" --data .data --sets "$SETS")
timeout "$budget" python3 benchmarks/stored_kv.py "${common[@]}" --stored auto,auto#2,int8 \
  --out "$OUT/stored_kv_h200_bf16.json" > "$OUT/stored_kv_h200_bf16_log.txt" 2>&1 &
if [ -n "${FP32:-}" ]; then
  timeout "$budget" python3 benchmarks/stored_kv.py "${common[@]}" --dtype float32 --attention torch \
    --out "$OUT/stored_kv_h200_fp32.json" > "$OUT/stored_kv_h200_fp32_log.txt" 2>&1 &
fi
wait || true
grep -hv "GGUF\|Loading weights" "$OUT"/stored_kv_h200_*_log.txt | tail -n 80
