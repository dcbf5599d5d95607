"""``benchmarks/serving_http.py`` in small (CPU, the session's default-model engine, a real uvicorn server on
loopback, openai clients in threads): every request is answered with all its tokens, and the offline run and both
HTTP runs (streamed, plain) count the same chunk hits and prefill the same tokens, as do the server's /metrics.
The cache holds every document, so these counts do not depend on the order concurrent requests are admitted in
(each document misses once, at its first request, whoever sends it). No timing is checked."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("serving_http_benchmark", ROOT / "benchmarks" / "serving_http.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_offline_and_http_runs_answer_everything_and_count_the_same_reuse(default_engine):
    bench = load_benchmark()
    args = bench.parse_args(
        ["--smoke", "--requests", "4", "--docs", "10", "--doc-tokens", "32", "--output-tokens", "4", "--budget", "10"]
    )
    config = default_engine.cache.config
    result = bench.benchmark(default_engine, args, "test")
    assert default_engine.cache.config == config  # the shared engine's cache is as it was
    rows = {r["run"]: r for r in result["rows"]}
    assert list(rows) == ["offline", "http-stream", "http"]
    for name, row in rows.items():
        assert row["requests"] == 4 and row["chunk_lookups"] == 4 * 5, name  # every request answered (4 tokens each)
        assert row["throughput_rps"] > 0 and row["engine_ttft_p50_ms"] > 0
        for key in ("chunk_hits", "tokens_prefilled", "tokens_reused", "prompt_tokens", "engine_cache"):
            assert row[key] == rows["offline"][key], (name, key)  # the same prompts, laid out the same way
        if name != "offline":
            assert row["rps_vs_offline"] > 0
            assert (row["metrics_chunk_hits"], row["metrics_chunk_misses"]) == (
                row["chunk_hits"],
                row["chunk_lookups"] - row["chunk_hits"],
            )
    assert rows["offline"]["engine_cache"]["evictions"] == 0
    assert 0 < rows["offline"]["chunk_hits"] < 20  # some documents came back, and each missed once
    assert rows["http-stream"]["ttft_p50_ms"] is not None and rows["http"]["ttft_p50_ms"] is None
