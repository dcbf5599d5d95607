#!/usr/bin/env bash
# Install everything the tests need and run them (CPU; Triton kernels run in its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
