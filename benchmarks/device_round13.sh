#!/usr/bin/env bash
# Round 13 (issue 12): the Gluon prefill kernel's warp-specialized build (two consumer warpgroups; a producer
# warpgroup that copies K/V and rotates mixed tiles' keys) on the H200: its GPU tests (the warp-specialized ones
# first, under a short timeout: a synchronisation bug hangs), then prefill_ceiling.py's side by side (configs,
# rotation on and off, SDPA) at the B=8 / 512-new shapes.
#   bash benchmarks/device_round13.sh [tests|bench|all|record]
#   (ONLY=REGEX: prefill_ceiling.py's --only; SHAPES="2048,10 8192,1": its contexts and document counts)
# record: the whole GPU test suite, then benchmarks/kernels.py's prefill sweep and grid (the result of record)
set -u
export PYTHONUNBUFFERED=1
what=${1:-all}
OUT=${OUT:-benchmarks/results}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'triton', triton.__version__, 'torch', torch.__version__)"
if [ "$what" = tests ] || [ "$what" = all ]; then
    LAZYRAG_KERNEL_AUTOTUNE=0 timeout 120 python3 -m pytest -q -x -m gpu tests/kernels/test_prefill.py \
        -k "test_prefill_gpu and w12 and hq32-hkv8-d128" 2>&1 | tail -15
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "warp-specialized smoke test failed"; exit 3; }
    LAZYRAG_KERNEL_AUTOTUNE=0 timeout 240 python3 -m pytest -q -x -n 8 -m gpu tests/kernels \
        -k "wgmma or prefill_gpu or tile_table" 2>&1 | tail -25
fi
if [ "$what" = record ]; then
    LAZYRAG_KERNEL_AUTOTUNE=0 timeout 200 python3 -m pytest -q -n 8 -m gpu tests/kernels \
        tests/engine/test_backends.py 2>&1 | grep -v "Warning\|warner\|config/__init__\|self._warn\|^\s*$" \
        | tee "$OUT/gpu_tests_round13_log.txt" | tail -8
    timeout 330 python3 benchmarks/kernels.py --sweep --sweep-only prefill --out "$OUT/kernels_h200_round13.json" \
        > "$OUT/kernels_h200_round13_log.txt" 2>&1
    echo "kernels.py exit $?"
    grep -v "^\s*$" "$OUT/kernels_h200_round13_log.txt" | tail -60
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    for shape in ${SHAPES:-2048,10 8192,10 8192,1}; do
        IFS=, read -r ctx docs <<< "$shape"
        timeout 200 python3 benchmarks/prefill_ceiling.py --ctx "$ctx" --docs "$docs" --only "${ONLY:-wgmma}" \
            --out "$OUT/prefill_ceiling_h200_round13_ctx${ctx}_docs${docs}.json" 2>&1 | grep -v "^\s*$" | tail -40
    done
fi
