#!/usr/bin/env bash
# Issue 41 item 6 on the GPU: the closed loop offline, then through `lazyrag serve`'s HTTP app (streamed and plain)
# on one engine, Llama-3.1-8B shapes with random bf16 weights (benchmarks/serving_http.py).
#   bash benchmarks/serving_http_gpu.sh          # carry .whl (the server's and the openai client's wheels) and .snap/smol
# The device lacks fastapi, uvicorn, pydantic, openai and their dependencies: .whl holds CPython 3.12 x86-64 wheels of
# the versions in the dev venv, installed into /tmp/site. Writes $OUT (or benchmarks/results)/serving_http_h100.json
# and its log.
set -u
OUT=$(cd "${OUT:-benchmarks/results}" && pwd)
export PYTHONUNBUFFERED=1 LAZYRAG_KERNEL_AUTOTUNE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl failed"; exit 3; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "installing lazyrag failed"; exit 3; }
python3 -c "import torch, fastapi, uvicorn, openai, pydantic; print(torch.cuda.get_device_name(), 'torch', torch.__version__,
'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'openai', openai.__version__, 'pydantic', pydantic.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout ${LIMIT_S:-540} python3 benchmarks/serving_http.py --random-8b .snap/smol --budget 1 --concurrency 16 --requests 160 \
    --out "$OUT/serving_http_h100.json" 2>&1 | grep -v "Warning\|warn" | tee "$OUT/serving_http_h100_log.txt"
