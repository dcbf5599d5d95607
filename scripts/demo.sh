#!/usr/bin/env bash
# Install (first run only takes a minute or two) and run the offline demo on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh gguf
exec .venv/bin/lazyrag demo "$@"
