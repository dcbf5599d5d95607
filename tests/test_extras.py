"""A missing optional dependency says which extra installs it (a fresh interpreter where the module cannot be found)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import HANG_S

HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {top!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
"""


@pytest.mark.parametrize(
    "top,code,extra",
    [
        ("llama_index", "import lazyrag.integrations.llama_index", "llama-index"),
        ("langchain_core", "import lazyrag.integrations.langchain", "langchain"),
        (
            "faiss",
            "from lazyrag.store.corpus import build_index; import numpy as np; "
            "build_index(np.zeros((1, 4), 'f4'), np.zeros(1, 'i8'))",
            "retrieval",
        ),
        ("sentence_transformers", "from lazyrag.store.retriever import load_embedder; load_embedder()", "retrieval"),
    ],
)
def test_a_missing_extra_names_what_to_install(top, code, extra):
    run = subprocess.run(
        [sys.executable, "-c", HIDE.format(top=top) + code], capture_output=True, text=True, timeout=HANG_S
    )
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("lazyrag.extras.MissingExtra") and f"pip install 'lazyrag[{extra}]'" in last, run.stderr[
        -2000:
    ]


def test_require_passes_when_installed():
    from lazyrag.extras import MissingExtra, require

    require("numbers", "numpy", "json")
    with pytest.raises(MissingExtra, match=r"pip install 'lazyrag\[tune\]'") as e:
        require("x", "peft.no_such_module_here")
    assert isinstance(e.value, ModuleNotFoundError)


def test_the_cpu_engine_runs_every_strategy_without_triton():
    """`scripts/demo.sh` installs no Triton (an extra): nothing on the CPU path may import it, the recovery included."""
    code = (
        HIDE.format(top="triton")
        + """
from lazyrag.engine import LazyEngine
engine = LazyEngine.from_pretrained(device="cpu")
for strategy in ("full", "lazy", "position_aware", "lazy+recover"):
    r = engine.generate("Who discovered penicillin?", ["Alexander Fleming discovered penicillin in 1928 in London."],
                        max_new_tokens=2, strategy=strategy)
    assert r.token_ids, strategy
import sys
assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
print("ok")
"""
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.parametrize("top,command,extra", [("uvicorn", "serve", "serve"), ("peft", "tune --out x", "tune")])
def test_a_command_without_its_extra_says_what_to_install(top, command, extra):
    code = HIDE.format(top=top) + f"from lazyrag.cli import main; raise SystemExit(main({command.split()!r}))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert (
        run.returncode != 0 and f"needs {top}, which is not installed: pip install 'lazyrag[{extra}]'" in run.stderr
    ), run.stderr[-2000:]
