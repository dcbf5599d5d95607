#!/usr/bin/env bash
# The style gate (CI runs it before the tests): ruff lint and ruff format on the product code.
# Settings: [tool.ruff] in pyproject.toml. ruff comes with the test extra (bash scripts/setup.sh test).
# tests/ and benchmarks/ are not gated yet.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF="${RUFF:-.venv/bin/ruff}"
FOLDERS=(lazyrag integrations kernels)
"$RUFF" check "${FOLDERS[@]}"
"$RUFF" format --check "${FOLDERS[@]}"
# mypy ([tool.mypy]) on the folders and modules that reach zero errors (kv, store, model, tune, and the top-level
# prompt, strategy_names, eval and demo); imports into other folders are read, not reported
MYPY_PATHS=(lazyrag/kv lazyrag/store lazyrag/model lazyrag/tune
    lazyrag/prompt.py lazyrag/strategy_names.py lazyrag/eval.py lazyrag/demo.py)
"${MYPY:-.venv/bin/mypy}" --follow-imports=silent "${MYPY_PATHS[@]}"
