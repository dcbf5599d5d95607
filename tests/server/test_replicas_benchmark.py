"""``benchmarks/replicas.py`` in small (CPU, embedded model, 2 real replicas on Ray Serve, loopback): its JSON has a
row per router with sane numbers, every request's chunks are counted, and on a seeded workload built for it chunk
affinity finds at least as many chunks cached as round robin. Every document fits every replica's pool and requests
come one at a time on average (0.6 requests/s, each well under a second), so the router sees what each replica holds:
affinity sends a request where its documents are, round robin alternates and encodes each document on both."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("replicas_benchmark", ROOT / "benchmarks" / "replicas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_replicas_benchmark_runs_small_and_affinity_hits_at_least_as_much_as_round_robin(tmp_path):
    import ray

    if ray.is_initialized():  # another module's cluster: this one starts its own
        ray.shutdown()
    bench = load_benchmark()
    out = tmp_path / "replicas.json"
    argv = [
        "--replicas",
        "2",
        "--routers",
        "chunk_affinity",
        "round_robin",
        "--docs",
        "6",
        "--doc-tokens",
        "48",
        "--docs-per-prompt",
        "2",
        "--requests-per-replica",
        "6",
        "--rate",
        "0.3",
        "--kv-budget",
        "64MiB",
        "--max-tokens",
        "2",
        "--num-cpus",
        "2",
        "--out",
        str(out),
        "--no-plot",
    ]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["workload"]["docs"] == 6 and "benchmarks/replicas.py" in data["meta"]["command"]
    rows = {r["router"]: r for r in data["rows"]}
    assert set(rows) == {"chunk_affinity", "round_robin"}
    for name, row in rows.items():
        assert row["replicas"] == 2 and row["requests"] == 12 and row["errors"] == 0, row
        assert 0.0 <= row["chunk_hit_rate"] <= 1.0 and 0.0 <= row["cached_token_share"] <= 1.0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["ttft_p50_ms"] <= row["total_p50_ms"] + 1e-6
        assert row["throughput_rps"] > 0 and row["completion_tokens_per_s"] > 0
        assert 0.5 <= row["busiest_replica_share"] <= 1.0 and sum(row["per_replica"].values()) == 12
        results = data["per_request"][f"2/{name}"]
        assert len(results) == 12
        for r in results:  # the replica counted each of the request's documents as a chunk, hit or missed
            assert r["stats"]["chunks_hit"] + r["stats"]["chunks_missed"] == len(r["docs"]) == 2, r
            assert r["replica"] in ("replica-0", "replica-1")
    # round robin sends the same document to both replicas: on 6 documents it misses more than affinity does
    assert rows["chunk_affinity"]["chunk_hit_rate"] >= rows["round_robin"]["chunk_hit_rate"], rows
    assert rows["chunk_affinity"]["chunk_hit_rate"] > 0.3
