"""Each example runs offline on CPU in a subprocess and prints what it promises (KV reuse stats)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HANG_S

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(name: str, *args: str) -> str:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=HANG_S, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def stats(line_pattern: str, out: str) -> list[dict]:
    return [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m)} for m in re.findall(line_pattern, out)]


def test_llama_index_query_engine():
    out = run("llama_index_query_engine.py", "--max-new-tokens", "8")
    first, second = stats(r"llm calls=(.*)", out)
    assert first["chunks_missed"] == 3 and second["chunks_hit"] == 3 and second["chunks_missed"] == 0
    assert second["tokens_prefilled"] < first["tokens_prefilled"] // 5  # the question only
    assert "Penicillin" in out


def test_langchain_rag_chain():
    out = run("langchain_rag_chain.py", "--max-tokens", "8")
    assert "8 chunks from 8 documents" in out
    hits = re.findall(r'"chunks_hit": (\d+), "chunks_missed": (\d+)', out)
    assert hits == [("3", "0"), ("3", "0")]  # KV loaded from the store, never recomputed
    from lazyrag.demo import load_demo_corpus

    assert f"batch: {len(load_demo_corpus()['questions'])} answers" in out  # one per demo question


def test_precache_corpus():
    out = run("precache_corpus.py")
    assert "encoded 8 chunks" in out and "rerun: 0 chunks encoded" in out
    (s,) = stats(r"stats: (.*)", out)
    assert s["chunks_hit"] == 3 and s["chunks_missed"] == 0 and s["store_hits"] >= 4  # prefix + 3 chunks from disk


def test_streaming():
    out = run("streaming.py")
    assert out.count("time to first token") == 3
    assert "same answer everywhere: True" in out
