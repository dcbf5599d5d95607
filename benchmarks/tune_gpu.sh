#!/usr/bin/env bash
# `lazyrag tune` of the embedded model on the GPU machine, then base vs tuned answers on report questions.
# The GGUF travels in parts (benchmarks/device_model.sh): calls 1..N-1 (carry .model/K) `bash benchmarks/device_model.sh stage`;
# the last call (carry .model/N .whl .data):
#   bash benchmarks/device_model.sh stage && bash benchmarks/tune_gpu.sh TRAIN_SECONDS EVAL_SECONDS [MAX_STEPS]
# .whl: the gguf wheel; .data: ../shared/data's NQ file and HotpotQA (gzip'd). Writes $OUT/tune_gpu.tgz (the adapter,
# its log.jsonl and lazyrag_tune.json, the eval reports and logs) and prints the KL and accuracy lines.
# Eval: NQ report questions with 9 distractors (10 passages), the same seed for both models, so the questions and
# passages are paired: base model (full, lazy, lazy+recover), tuned model (full, lazy).
set -u
train=${1:?train seconds}; evals=${2:?eval seconds}; steps=${3:-3000}
M=$(bash benchmarks/device_model.sh join) || exit 1
[ -f .data/hotpotqa_dev_500.jsonl ] || gunzip -k .data/hotpotqa_dev_500.jsonl.gz
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 3; }
python3 -c "import torch, peft, transformers; print(torch.cuda.get_device_name(), 'peft', peft.__version__, 'transformers', transformers.__version__)"
T=/tmp/t; mkdir -p $T
trap 'tar czf "$OUT/tune_gpu.tgz" -C "$T" . 2>/dev/null || true' EXIT
data="--data nq=.data/nq_open_oracle_2655.jsonl.gz --data hotpotqa=.data/hotpotqa_dev_500.jsonl"
timeout $((train + 60)) python3 -m lazyrag.cli tune --model "$M" --out $T/adapter $data --max-steps "$steps" \
    --time-limit "$train" --eval-every 100 --save-every 100 --prompts-per-step ${PROMPTS:-8} ${TUNE_ARGS:-} > $T/tune_log.txt 2>&1 \
    || echo "tune exited $?"
grep -v "it/s\]\|step/s" $T/tune_log.txt | tail -5
python3 - <<'PY'
import json
for line in open("/tmp/t/adapter/log.jsonl"):
    r = json.loads(line)
    if "tuned_lazy" in r:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items() if k in ("step", "base_lazy", "tuned_lazy", "tuned_full", "kl_lazy")})
PY
ev() {  # tag seconds [options]
  local tag=$1 secs=$2; shift 2
  timeout $((secs + 60)) python3 -m lazyrag.cli eval --dataset nq --split report --n ${EVAL_N:-400} --distractors 9 \
      --data .data/nq_open_oracle_2655.jsonl.gz --device cuda --dtype float32 --eager --batch 32 --max-new-tokens 16 \
      --model "$M" --time-limit "$secs" --out $T/eval_$tag.json "$@" > $T/eval_${tag}_log.txt 2>&1 || echo "eval $tag exited $?"
  grep -i "accuracy\|^strategy\|^full\|^lazy" $T/eval_${tag}_log.txt | head -8 | sed "s/^/$tag: /"
}
half=$((evals / 2))
ev base $half --strategies full,lazy,lazy+recover
ev tuned $half --strategies full,lazy --adapter $T/adapter
