"""The cold chunks of every lazy request admitted in one step are encoded in one batched forward
(Planner.encode_ahead), and each request's stats still read as if it had encoded its own."""
import pytest
import torch

from lazyrag.engine import LazyEngine, SamplingParams
from lazyrag.engine.reuse import ENCODE_BATCH_TOKENS, Strategy

CHUNKS = [
    ["The Orinoco flows through Venezuela and Colombia.", "Lake Titicaca lies between Peru and Bolivia."],
    ["The Danube passes through ten countries.", "Lake Titicaca lies between Peru and Bolivia."],
    ["Mount Kilimanjaro is in Tanzania.", "The Atacama desert is in Chile."],
]
QUESTIONS = ["Where does the Orinoco flow?", "How many countries does the Danube pass?", "Where is Kilimanjaro?"]
STRATEGIES = ["lazy", "lazy+recover", "lazy:first=2"]


def fresh_engine(tiny_hf, tokenizer) -> LazyEngine:
    engine = LazyEngine.from_hf(tiny_hf, tokenizer, device="cpu", kv_budget=16 << 20)
    engine.generate("warm-up: the prompt prefix gets cached", ["A chunk no test asks about."], SamplingParams(2))
    return engine


def run_in_one_step(engine: LazyEngine, encodes: list):
    """Queue every request, then step; ``encodes`` gets the number of chunks of each chunk-encoding call."""
    encode = Strategy.encode

    def counting(self, jobs, plan=None, keep=True):
        if jobs:
            encodes.append(len(jobs))
        return encode(self, jobs, plan, keep)

    Strategy.encode = counting
    try:
        with engine._lock:
            reqs = [engine.add_request(engine.build_prompt(q, c), SamplingParams(4, strategy=s))
                    for q, c, s in zip(QUESTIONS, CHUNKS, STRATEGIES)]
            while engine.scheduler.has_work():
                engine.scheduler.step()
    finally:
        Strategy.encode = encode
    return [r.result() for r in reqs]


def one_at_a_time(engine: LazyEngine):
    return [engine.generate(q, c, SamplingParams(4, strategy=s)) for q, c, s in zip(QUESTIONS, CHUNKS, STRATEGIES)]


def read_unpinned(engine: LazyEngine, key: str):
    seg = engine.cache.get(key)
    try:
        return engine.cache.read_kv(seg)
    finally:
        engine.cache.unpin(seg)


STAT_FIELDS = ("chunks_hit", "chunks_missed", "tokens_prefilled", "tokens_context", "tokens_reused",
               "chunk_tokens_reused", "prefix_tokens_reused", "tokens_recomputed")


def test_cold_chunks_of_one_step_are_encoded_in_one_forward_with_the_same_stats(tiny_hf, default_hf):
    tokenizer = default_hf[1]
    batched, alone = fresh_engine(tiny_hf, tokenizer), fresh_engine(tiny_hf, tokenizer)
    free_before = batched.cache.pool.num_free
    forwards = []
    together = run_in_one_step(batched, forwards)
    separately = one_at_a_time(alone)

    assert forwards == [5], "the five distinct cold chunks of three requests: one encode"
    assert sum(len(ids) for layout in map(lambda c: batched.build_prompt("", c), CHUNKS) for ids in layout.chunk_ids) \
        < ENCODE_BATCH_TOKENS, "so one encode is one forward"
    for a, b in zip(together, separately):
        for f in STAT_FIELDS:
            assert getattr(a.stats, f) == getattr(b.stats, f), f
    assert [r.stats.chunks_missed for r in together] == [2, 1, 2]  # the shared chunk: the first request's miss
    for f in ("hits", "misses"):
        assert getattr(batched.cache.stats, f) == getattr(alone.cache.stats, f), f
    # the same KV, whichever way it was encoded (fp32; a tolerance, not bit equality)
    for layout_chunks in CHUNKS:
        layout = batched.build_prompt("", layout_chunks)
        for ids in layout.chunk_ids:
            key = batched.chunk_key(ids, layout.encoding_prefix)
            (k1, v1), (k2, v2) = (read_unpinned(e, key) for e in (batched, alone))
            torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)
    assert batched.scheduler.planner.ahead == {}
    assert all(seg.pins == 0 for seg in batched.cache._segments.values())
    assert batched.cache.pool.num_free <= free_before


def test_a_failed_batched_encode_leaves_each_request_to_encode_its_own(tiny_hf, default_hf, monkeypatch):
    engine = fresh_engine(tiny_hf, default_hf[1])
    free_before = engine.cache.pool.num_free
    calls = []

    def broken(layouts):
        calls.append(len(layouts))
        raise RuntimeError("no room for the batch")

    monkeypatch.setattr(engine.scheduler.planner, "encode_ahead", broken)
    forwards = []
    results = run_in_one_step(engine, forwards)
    assert calls == [3]
    assert forwards == [2, 1, 2], "each request encoded its own misses"
    assert [r.stats.chunks_missed for r in results] == [2, 1, 2]
    assert all(seg.pins == 0 for seg in engine.cache._segments.values())
    assert engine.cache.pool.num_free <= free_before
    assert all(r.text is not None for r in results)


@pytest.mark.parametrize("strategies", [["full", "full", "full"], ["lazy", "position_aware", "full"]],
                         ids=["no-lazy-request", "one-lazy-request"])
def test_nothing_is_encoded_ahead_without_two_lazy_requests(tiny_hf, default_hf, monkeypatch, strategies):
    engine = fresh_engine(tiny_hf, default_hf[1])
    calls = []
    monkeypatch.setattr(engine.scheduler.planner, "encode_ahead", lambda layouts: calls.append(layouts))
    monkeypatch.setattr("tests.engine.test_encode_ahead.STRATEGIES", strategies)
    run_in_one_step(engine, [])
    assert calls == []
