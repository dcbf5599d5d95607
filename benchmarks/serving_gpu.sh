#!/usr/bin/env bash
# Issue 41's device check, old tree against this one in the same call (one part a call, each under 10 minutes):
#   PART=a bash benchmarks/serving_gpu.sh OLD_TREE   # e2e_gpu.py new then old (SIDES="old new" swaps); the old tree's 1 GB closed loop (lazy) unless E2E_ONLY=1
#   PART=s bash benchmarks/serving_gpu.sh OLD_TREE   # the 1 GB closed loop (lazy), old tree then this one
#   PART=e bash benchmarks/serving_gpu.sh OLD_TREE   # a then s in one call: e2e new and old, then the 1 GB loop old and new
#   PART=b bash benchmarks/serving_gpu.sh            # this tree's 1 GB closed loop: every peer, lazy with and without the batched encode
#   PART=c bash benchmarks/serving_gpu.sh            # this tree, 1 GB plus a host-RAM tier holding the corpus: closed loop, 2 req/s
#   PART=p bash benchmarks/serving_gpu.sh            # this tree's 1 GB closed loop under LRU and TinyLFU admission: lazy and its exact peers
#   PART=h bash benchmarks/serving_gpu.sh OLD_TREE   # 1 GB plus the host tier, closed loop and 2 req/s (HOST_STRATEGIES, default
#                                                      lazy): the old tree then this one (the host-tier prefetch's A/B)
# OLD_TREE: `git archive <commit> | tar -x -C .snap`, carried. Writes to $OUT (or benchmarks/results): e2e_<card>_serving_{new,old}.json,
# serving_<card>_old.json, serving_<card>_1gb.json, ..._host.json, ..._policies.json (card: h100 or h200) and their logs.
set -u
part=${PART:-a}
OUT=$(cd "${OUT:-benchmarks/results}" && pwd)
new=$(pwd)
export PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) || { echo "install of $1 failed"; exit 3; }; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'triton', triton.__version__, 'torch', torch.__version__)"
card=$(python3 -c "import torch; print('h200' if 'H200' in torch.cuda.get_device_name() else 'h100')")  # names the result files
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
loop="--budget 1 --throughput-requests 160 --concurrency 16"
serve_lazy() {  # side tree: that tree's 1 GB closed loop with lazy alone
  install "$2"
  (cd "$2" && timeout 230 python3 benchmarks/serving.py --experiments throughput $loop --strategies lazy \
      --out "$OUT/serving_${card}_$1.json") > "$OUT/serving_${card}_$1_log.txt" 2>&1 || echo "$1 serving exited $?"
  grep "^throughput\|^model" "$OUT/serving_${card}_$1_log.txt" | sed "s/^/$1: /"
}
case $part in
a|e)
  old=${1:?old tree}
  for side in ${SIDES:-new old}; do
    tree=$new; [ "$side" = old ] && tree=$old
    install "$tree"
    (cd "$tree" && timeout 170 python3 benchmarks/e2e_gpu.py --reps 10 --out "$OUT/e2e_${card}_serving_$side.json") \
        > "$OUT/e2e_${card}_serving_${side}_log.txt" 2>&1 || echo "e2e $side exited $?"
    grep "lazyrag TTFT\|lazyrag decode\|transformers full" "$OUT/e2e_${card}_serving_${side}_log.txt" | sed "s/^/$side: /"
  done
  [ -n "${E2E_ONLY:-}" ] || serve_lazy old "$old"
  if [ "$part" = e ]; then serve_lazy new "$new"; else install "$new"; fi ;;
s)  # the 1 GB closed loop, lazy alone, old tree then this one
  old=${1:?old tree}
  serve_lazy old "$old"
  serve_lazy new "$new" ;;
b)
  install "$new"
  timeout 560 python3 benchmarks/serving.py --experiments throughput $loop --unbatched \
      --strategies position_aware,position_aware:rerotate,reorder+prefix,lazy --out "$OUT/serving_${card}_1gb.json" 2>&1 \
      | grep -v "Warning\|warn" | tee "$OUT/serving_${card}_1gb_log.txt" | grep "^throughput\|^model\|^wrote" ;;
c)
  install "$new"
  timeout 560 python3 benchmarks/serving.py --experiments host $loop --host-gb ${HOST_GB:-40} --rate 2 --requests 60 \
      --strategies position_aware,position_aware:rerotate,reorder+prefix,lazy --out "$OUT/serving_${card}_host.json" 2>&1 \
      | grep -v "Warning\|warn" | tee "$OUT/serving_${card}_host_log.txt" | grep "^host\|^model\|^wrote" ;;
h)
  old=${1:?old tree}
  for side in old new; do
    tree=$new; [ "$side" = old ] && tree=$old
    install "$tree"
    (cd "$tree" && timeout ${HOST_S:-270} python3 benchmarks/serving.py --experiments throughput,host $loop --host-gb ${HOST_GB:-40} \
        --rate 2 --requests 60 --strategies ${HOST_STRATEGIES:-lazy} --out "$OUT/serving_${card}_host_$side.json") 2>&1 \
        | grep -v "Warning\|warn" > "$OUT/serving_${card}_host_${side}_log.txt" || echo "$side exited $?"
    grep "^throughput\|^host\|^model" "$OUT/serving_${card}_host_${side}_log.txt" | sed "s/^/$side: /"
  done
  install "$new" ;;
p)
  install "$new"
  timeout 560 python3 benchmarks/serving.py --experiments throughput $loop --policies lru,lru+admit \
      --strategies position_aware:rerotate,reorder+prefix,lazy --out "$OUT/serving_${card}_policies.json" 2>&1 \
      | grep -v "Warning\|warn" | tee "$OUT/serving_${card}_policies_log.txt" | grep "^throughput\|^model\|^wrote" ;;
esac
