"""The chunks that the requests of one step miss are encoded together, in one batched forward before the
step's prefill (engine/reuse.py ``EncodeBatch``), and the cache, the stats and the KV are those of the path
where each request encodes its own misses as it is planned (``SchedulerConfig(batch_encodes=False)``)."""

import pytest
import torch

from lazyrag.engine import LazyEngine, SamplingParams, SchedulerConfig, reuse
from lazyrag.engine.runner import ModelRunner

CHUNKS = [
    ["The Orinoco flows through Venezuela and Colombia.", "Lake Titicaca lies between Peru and Bolivia."],
    ["The Danube passes through ten countries.", "Lake Titicaca lies between Peru and Bolivia."],
    ["Mount Kilimanjaro is in Tanzania.", "The Atacama desert is in Chile."],
]
QUESTIONS = ["Where does the Orinoco flow?", "How many countries does the Danube pass?", "Where is Kilimanjaro?"]
STAT_FIELDS = (
    "chunks_hit",
    "chunks_missed",
    "tokens_prefilled",
    "tokens_context",
    "tokens_reused",
    "chunk_tokens_reused",
    "prefix_tokens_reused",
    "tokens_recomputed",
)


def fresh_engine(tiny_hf, tokenizer, batch_encodes: bool = True) -> LazyEngine:
    engine = LazyEngine.from_hf(
        tiny_hf, tokenizer, device="cpu", kv_budget=16 << 20, scheduler=SchedulerConfig(batch_encodes=batch_encodes)
    )
    engine.generate("warm-up: the prompt prefix gets cached", ["A chunk no test asks about."], SamplingParams(2))
    return engine


def run_in_one_step(engine: LazyEngine, strategies: list[str], encodes: list | None = None, chunks=CHUNKS):
    """Queue every request, then step; ``encodes`` gets the number of segments of each encoding forward."""
    compute = reuse._compute

    def counting(runner, work):
        if encodes is not None:
            encodes.append(len(work))
        return compute(runner, work)

    reuse._compute = counting
    try:
        with engine._lock:
            reqs = [
                engine.add_request(engine.build_prompt(q, c), SamplingParams(4, strategy=s))
                for q, c, s in zip(QUESTIONS, chunks, strategies)
            ]
            while engine.scheduler.has_work():
                engine.scheduler.step()
    finally:
        reuse._compute = compute
    return [r.result() for r in reqs]


def read_unpinned(engine: LazyEngine, key: str):
    seg = engine.cache.get(key)
    try:
        return engine.cache.read_kv(seg)
    finally:
        engine.cache.unpin(seg)


@pytest.mark.parametrize(
    "strategies",
    [["lazy"] * 3, ["lazy", "lazy+recover", "lazy:first=2"], ["lazy", "position_aware", "lazy"]],
    ids=["lazy", "recovering", "position-aware-between"],
)
def test_a_steps_misses_are_encoded_together_with_the_stats_and_kv_of_one_at_a_time(tiny_hf, default_hf, strategies):
    tokenizer = default_hf[1]
    batched, alone = fresh_engine(tiny_hf, tokenizer), fresh_engine(tiny_hf, tokenizer, batch_encodes=False)
    forwards, forwards_alone = [], []
    together = run_in_one_step(batched, strategies, forwards)
    separately = run_in_one_step(alone, strategies, forwards_alone)

    if strategies == ["lazy"] * 3:
        assert forwards == [5], "the five distinct cold chunks of three requests: one forward"
        assert forwards_alone == [2, 1, 2]
    assert sum(forwards) == sum(forwards_alone), "no chunk encoded twice, none skipped"
    for a, b in zip(together, separately):
        for f in STAT_FIELDS:
            assert getattr(a.stats, f) == getattr(b.stats, f), f
    if "position_aware" not in strategies:  # a position-aware copy at a new place is a miss
        assert [r.stats.chunks_missed for r in together] == [2, 1, 2]  # the shared chunk: the first request's miss
    for f in ("hits", "misses", "evictions", "inserted"):
        assert getattr(batched.cache.stats, f) == getattr(alone.cache.stats, f), f
    assert sorted(batched.cache._segments) == sorted(alone.cache._segments)
    # the same KV, whichever way it was encoded (fp32; a tolerance, not bit equality)
    for layout_chunks in CHUNKS:
        layout = batched.build_prompt("", layout_chunks)
        for ids in layout.chunk_ids:
            key = batched.chunk_key(ids, layout.encoding_prefix)
            (k1, v1), (k2, v2) = (read_unpinned(e, key) for e in (batched, alone))
            torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)
    for a, b in zip(together, separately):
        assert a.token_ids == b.token_ids
    for engine in (batched, alone):
        assert not engine.core.planner.batch.pending and not engine.core.planner.batch.open
        assert engine.cache.num_pinned == 0
        assert engine.cache.pool.num_free + engine.cache.cached_blocks == engine.cache.pool.num_blocks


POISON = "This chunk cannot be encoded."


def test_a_chunk_that_fails_to_encode_fails_its_request_alone_and_is_not_cached(tiny_hf, default_hf, monkeypatch):
    engine = fresh_engine(tiny_hf, default_hf[1])
    poison_ids = engine.build_prompt("", [POISON]).chunk_ids[0]
    prefill = ModelRunner.prefill
    encodes = []

    def failing(self, seqs, new_ids, logits=True):
        if not logits:
            encodes.append(len(seqs))
            if any(ids == poison_ids for ids in new_ids):
                raise RuntimeError("device fault")
        return prefill(self, seqs, new_ids, logits)

    monkeypatch.setattr(ModelRunner, "prefill", failing)
    chunks = [CHUNKS[0], [POISON, CHUNKS[1][0]], CHUNKS[2]]
    with engine._lock:
        reqs = [engine.add_request(engine.build_prompt(q, c), SamplingParams(4)) for q, c in zip(QUESTIONS, chunks)]
        while engine.scheduler.has_work():
            engine.scheduler.step()
    assert encodes[0] == 6, "one batched forward of the six cold chunks first"
    assert encodes[1:] == [1] * 6, "then each job alone"
    assert reqs[1].finish_reason == "error" and "encoding" in str(reqs[1].error)
    assert [reqs[0].finish_reason, reqs[2].finish_reason] == ["length", "length"]
    key = engine.chunk_key(poison_ids, engine.build_prompt("", [POISON]).encoding_prefix)
    assert key not in engine.cache, "a chunk whose KV was never computed is not cached"
    danube = engine.chunk_key(
        engine.build_prompt("", [CHUNKS[1][0]]).chunk_ids[0], engine.build_prompt("", []).encoding_prefix
    )
    assert danube in engine.cache, "the failed request's other chunk was encoded and stays"
    assert engine.cache.num_pinned == 0
    assert engine.cache.pool.num_free + engine.cache.cached_blocks == engine.cache.pool.num_blocks
    monkeypatch.setattr(ModelRunner, "prefill", prefill)
    again = engine.generate(QUESTIONS[1], [CHUNKS[1][0]], SamplingParams(4))
    assert again.stats.chunks_hit == 1


def test_planning_alone_computes_nothing_until_the_batch_is_flushed(tiny_hf, default_hf):
    engine = fresh_engine(tiny_hf, default_hf[1])
    planner = engine.core.planner
    layout = engine.build_prompt(QUESTIONS[0], CHUNKS[0])
    forwarded = engine.runner.tokens_forwarded
    planner.batch.begin()
    plan = planner["lazy"].plan(layout)
    assert engine.runner.tokens_forwarded == forwarded, "a plain lazy plan only looks up and allocates"
    assert plan.chunks_missed == 2 and plan.tokens_encoded_ahead == sum(map(len, layout.chunk_ids))
    assert len(planner.batch.pending) == 2
    pinned = [seg.pins for seg in plan.pinned if seg.kind == "chunk"]
    assert pinned == [2, 2], "the plan's pin and the batch's: no eviction before the KV exists"
    planner.batch.end()
    assert engine.runner.tokens_forwarded == forwarded + plan.tokens_encoded_ahead
    assert [seg.pins for seg in plan.pinned if seg.kind == "chunk"] == [1, 1]
    planner["lazy"].release(plan)
    assert engine.cache.num_pinned == 0
