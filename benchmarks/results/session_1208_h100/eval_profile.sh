#!/usr/bin/env bash
# one-off: where an eval worker's time goes on the GPU (issue 42's slow evals)
set -u
M=$(bash benchmarks/device_model.sh join)
[ -f .data/hotpotqa_dev_500.jsonl ] || gunzip -k .data/hotpotqa_dev_500.jsonl.gz
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
(nvidia-smi dmon -s u -d 2 > $OUT/dmon.txt 2>&1 &)
common="--dataset nq --data .data/nq_open_oracle_2655.jsonl.gz --split report --passages 20 --strategies full,lazy --device cuda --max-new-tokens 16 --model $M --kv-budget 2 --batch 12 --workers 1"
# warm: converts the GGUF, compiles kernels
timeout 200 python3 -m lazyrag.cli eval $common --n 12 --dtype float32 --eager --out /tmp/pw/q.json > $OUT/warm.txt 2>&1; tail -5 $OUT/warm.txt
for v in "f32eager:--dtype float32 --eager" "bf16eager:--dtype bfloat16 --eager"; do
  tag=${v%%:*}; opts=${v#*:}
  s=$(date +%s.%N)
  timeout ${PROF_S:-150} python3 -m cProfile -o /tmp/prof_$tag -m lazyrag.cli eval $common --n 24 $opts --out /tmp/p_$tag/q.json > $OUT/log_$tag.txt 2>&1
  echo "$tag rc $? wall $(python3 -c "import time; print(round(time.time()-$s,1))") s"; tail -4 $OUT/log_$tag.txt
  python3 -c "
import pstats; p = pstats.Stats('/tmp/prof_$tag'); p.sort_stats('cumulative').print_stats(45); p.sort_stats('tottime').print_stats(30)" > $OUT/prof_$tag.txt 2>&1
  grep -A 32 "ncalls" $OUT/prof_$tag.txt | tail -31 | cut -c1-160 | head -25
done
