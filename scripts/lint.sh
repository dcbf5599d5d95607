#!/usr/bin/env bash
# The style gate (CI runs it before the tests): ruff lint and ruff format on the product code, the tests and the
# benchmarks; mypy on the product code only.
# Settings: [tool.ruff] in pyproject.toml. ruff comes with the test extra (bash scripts/setup.sh test).
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF="${RUFF:-.venv/bin/ruff}"
FOLDERS=(lazyrag integrations tests benchmarks)
"$RUFF" check "${FOLDERS[@]}"
"$RUFF" format --check "${FOLDERS[@]}"
# mypy ([tool.mypy]) at zero errors on the whole lazyrag package (engine, server, kv, store, model, tune, kernels
# and every top-level module) and integrations/
MYPY_PATHS=(lazyrag integrations)
"${MYPY:-.venv/bin/mypy}" --follow-imports=silent "${MYPY_PATHS[@]}"
