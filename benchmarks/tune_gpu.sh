#!/usr/bin/env bash
# `lazyrag tune` of the embedded model on the GPU machine, then base vs tuned answers on the report parts.
# The GGUF travels in parts (benchmarks/device_model.sh): calls 1..N-1 (carry .model/K) `bash benchmarks/device_model.sh stage`;
# the last call (carry .model/N .whl .data):
#   bash benchmarks/device_model.sh stage && bash benchmarks/tune_gpu.sh train SECONDS
# then, next call on the still-warm machine (carry .whl .data):
#   bash benchmarks/tune_gpu.sh eval SECONDS "SETS"      # SETS as quality_gpu.sh's NAME:SPLIT:N:WORKERS:PASSAGES
#   (ADAPTER_DIR=FOLDER: evaluate that adapter instead of this machine's last training, e.g. the embedded one;
#    TUNED_MODEL=FOLDER: a fully tuned model instead of an adapter, e.g. /tmp/t/full_2e-5)
# weights over 14 MB stay on the machine (a call brings back 16 MiB a file); fetch them in a next call with
#   python3 benchmarks/device_weights.py pack /tmp/t/NAME $OUT [--call K]
# train: CONFIGS (default below: LoRA rank 8 and 64 and full fine-tuning) are settings trained side by side, one process each, on the one GPU
# (TUNE_OPTS: options every config gets, e.g. "--passages 10,20,20": no 5-passage prompts, twice as many of 20); each
# first runs 20 steps to time a step, then resumes with as many steps as fit in SECONDS (the cosine schedule ends
# there). The LoRA config with the lowest held-out KL (tuned lazy vs base full, on tune-part prompts) becomes
# /tmp/t/adapter. eval: quality_gpu.sh twice at once on the same questions: the base model (BASE_STRATEGIES) and
# the tuned one (TUNED_STRATEGIES). Everything comes back in $OUT/tune_gpu.tgz and $OUT/quality_gpu.tgz.
set -u
mode=${1:?train or eval}; budget=${2:?seconds}
start=$(date +%s)
M=${MODEL:-$(bash benchmarks/device_model.sh join)} || exit 1  # MODEL: another checkpoint
[ -f .data/hotpotqa_dev_500.jsonl ] || gunzip -k .data/hotpotqa_dev_500.jsonl.gz
if [ -z "${INSTALLED:-}" ]; then  # INSTALLED=1: the caller installed, e.g. to run quality_gpu.sh beside the training
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 3; }
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
T=/tmp/t; mkdir -p $T
if [ "$mode" = eval ]; then
  sets=${3:?sets}
  export INSTALLED=1 EVALS_AT_ONCE=2  # the base and the tuned model's evals share the GPU
  bash benchmarks/quality_gpu.sh "$budget" "${BASE_STRATEGIES:-full,lazy,lazy+recover}" "$sets" > $T/eval_base.txt 2>&1 &
  tuned=(ADAPTER="${ADAPTER_DIR:-$T/adapter}")
  [ -z "${TUNED_MODEL:-}" ] || tuned=(MODEL_DIR="$TUNED_MODEL")  # a fully tuned model's folder, e.g. $T/full_2e-5
  env "${tuned[@]}" bash benchmarks/quality_gpu.sh "$budget" "${TUNED_STRATEGIES:-full,lazy,lazy+recover}" "$sets" > $T/eval_tuned.txt 2>&1 &
  wait
  grep -h "accuracy\|^ *full\|^ *lazy\|exited" $T/eval_base.txt $T/eval_tuned.txt | head -80
  exit 0
fi
python3 -c "import torch, peft, transformers; print(torch.cuda.get_device_name(), 'peft', peft.__version__, 'transformers', transformers.__version__)"
pack() {  # logs and the adapters that fit what a call brings back (16 MiB a file); larger weights stay on the machine
  local big; big=$(cd "$T" && find . -name '*.safetensors' -size +14M -printf '%P ')
  [ -z "$big" ] || echo "left on the machine (over 14 MB; benchmarks/device_weights.py brings them): $big"
  tar czf "$OUT/tune_gpu.tgz" -C "$T" --exclude=checkpoint --exclude=.checkpoint.old --exclude=teacher_answers.jsonl \
    $(for f in $big; do printf -- '--exclude=./%s ' "$f"; done) . 2>/dev/null || true
}
trap pack EXIT
data="--data nq=.data/nq_open_oracle_2655.jsonl.gz --data hotpotqa=.data/hotpotqa_dev_500.jsonl"
CONFIGS=${CONFIGS:-"r8_lr1.5e-3:--lora-rank=8:--lr=1.5e-3 r64_lr1e-3:--lora-rank=64:--lr=1e-3 full_2e-5:--method=full:--lr=2e-5"}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # two trainings share the GPU; their peaks differ by step
one() {  # name options...: 20 steps to time a step, then as many as fit in the budget
  local name=$1; shift
  local out=$T/$name opts=("$@") steps
  tune() {  # steps seconds
    timeout $(( $2 + 90 )) python3 -m lazyrag.cli tune --model "$M" --out $out $data --max-steps "$1" --time-limit "$2" \
      --eval-every 100 --save-every 50 --prompts-per-step ${PROMPTS:-8} "${opts[@]}" ${TUNE_OPTS:-} >> $T/${name}_log.txt 2>&1 \
      || echo "$name: tune exited $?"
  }
  tune 20 $(( budget - ($(date +%s) - start) - 30 ))
  steps=$(python3 - "$out/log.jsonl" $(( budget - ($(date +%s) - start) )) <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"seconds"' in l]
per_step = ((rows[-1]["seconds"] - rows[0]["seconds"]) / (len(rows) - 1) if len(rows) > 1
            else rows[0]["seconds"] / rows[0]["step"])
left = float(sys.argv[2]) - 75  # the reload, the last held-out KL and the save
print(max(20, rows[-1]["step"] + int(left / per_step)), f"{per_step:.3f}")
PY
)
  [ -n "$steps" ] || { echo "$name: no steps timed"; return; }
  echo "$name: ${steps#* } s/step -> ${steps% *} steps"
  tune "${steps% *}" $(( budget - ($(date +%s) - start) - 15 ))
}
for c in $CONFIGS; do
  IFS=: read -r name o1 o2 <<< "$c"
  one "$name" "$o1" "$o2" &
done
wait
python3 - <<'PY'
import json, pathlib, shutil
best = None
for d in sorted(pathlib.Path("/tmp/t").iterdir()):
    log = d / "log.jsonl"
    if not log.is_file():
        continue
    rows = [json.loads(l) for l in open(log)]
    dev = [r for r in rows if "tuned_lazy" in r]
    base = next((r["base_lazy"] for r in rows if "base_lazy" in r), None)
    if not dev:
        continue
    last = dev[-1]
    print(f"{d.name}: step {last['step']}, KL lazy base {base:.4f} -> tuned {last['tuned_lazy']:.4f}, tuned full {last['tuned_full']:.4f}")
    for r in dev:
        print(f"   step {r['step']}: lazy {r['tuned_lazy']:.4f} full {r['tuned_full']:.4f}")
    if (d / "adapter_config.json").is_file() and (best is None or last["tuned_lazy"] < best[1]):
        best = (d, last["tuned_lazy"])
if best:
    shutil.rmtree("/tmp/t/adapter", ignore_errors=True)
    shutil.copytree(best[0], "/tmp/t/adapter", ignore=shutil.ignore_patterns("checkpoint", ".checkpoint*", "teacher_answers.jsonl"))
    print("adapter:", best[0].name)
PY
