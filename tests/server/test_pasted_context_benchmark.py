"""``benchmarks/pasted_context.py`` in small (the session's default-model engine, a real uvicorn server on loopback,
the stock LangChain and LlamaIndex clients and the openai client): 2 questions over 3 real 2WikiMultihopQA passages.
From the 2nd question the pasted clients reuse >= 80% of the context tokens with no ``documents`` field, as the
``documents`` path does; with the server's pasted-context switch off nothing is reused. No timing is checked."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("langchain_openai")
pytest.importorskip("llama_index.llms.openai_like")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("pasted_context_benchmark", ROOT / "benchmarks" / "pasted_context.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_pasted_clients_reuse_the_context_from_the_second_question(default_engine, tmp_path):
    bench = load_benchmark()
    out = tmp_path / "pasted.json"
    config, finder = default_engine.cache.config, default_engine.chunk_finder
    assert (
        bench.main(
            ["--questions", "2", "--passages", "3", "--max-tokens", "4", "--out", str(out)], engine=default_engine
        )
        == 0
    )
    # the shared engine as it was
    assert default_engine.cache.config == config and default_engine.chunk_finder is finder
    assert default_engine.submit.__func__ is type(default_engine).submit  # the watch is off again

    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["command"].startswith(".venv/bin/python benchmarks/pasted_context.py --questions 2")
    assert meta["device"] and meta["load_note"] and len(meta["loadavg_start"]) == 3 and len(meta["loadavg_end"]) == 3
    assert meta["passages"] == 3 and len(meta["questions"]) == 2 and meta["orders"][0] != meta["orders"][1]
    assert meta["context_tokens"] == sum(meta["passage_tokens"]) > 0
    assert list(result["summary"]) == list(bench.CLIENTS)
    assert all("loadavg" in s and "busy_processes" in s for s in result["summary"].values())
    rows = {(r["client"], r["question"]): r for r in result["rows"]}
    assert len(rows) == len(result["rows"]) == 2 * len(bench.CLIENTS)
    for (client, q), r in rows.items():
        # text was streamed
        assert r["ttft_ms"] is not None and r["ttft_ms"] > 0 and r["engine_ttft_ms"] > 0, (client, q)
        assert r["answer"].strip() and r["context_tokens"] == meta["context_tokens"]
        # usage = /metrics = engine
        assert r["cached_tokens"] == r["metrics_cached_tokens"] == r["tokens_reused"], (client, q)
    assert rows["langchain", 1]["cached_source"] == rows["documents", 1]["cached_source"] == "usage"
    assert rows["llamaindex", 1]["cached_source"] == "metrics"

    for client in bench.PASTED_CLIENTS + ("documents",):
        first, second = rows[client, 1], rows[client, 2]
        assert first["cached_tokens"] < 0.2 * first["context_tokens"], client  # a fresh cache: question 1 is cold
        assert second["cached_tokens"] >= 0.8 * second["context_tokens"], (client, second)
        assert second["passages_as_chunks"] == 3 and second["chunks_missed"] == 0, (client, second)
        assert second["tokens_prefilled"] < first["tokens_prefilled"], client
        assert result["summary"][client]["cached_pct_rest_median"] >= 80.0
    for q in (1, 2):  # the switch off: the pasted passages are not looked for, nothing is reused
        r = rows["no-reuse", q]
        assert r["passages_as_chunks"] == 0 and r["cached_tokens"] < 0.2 * r["context_tokens"], r
