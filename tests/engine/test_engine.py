"""The engine's math: lazy stitching equals position-aware re-rotation, full prefill equals transformers.

Every test runs on the embedded default model and on a tiny random Llama with GQA and
Llama-3 RoPE scaling (the ``engine`` fixture).
"""

import random

import pytest
import torch

from lazyrag.engine.reuse import LazyStitching
from tests.helpers import CHUNKS, QUESTION, rel_err


def test_full_prefill_matches_transformers(engine_and_hf):
    engine, hf = engine_and_hf
    layout = engine.build_prompt(QUESTION, CHUNKS[:3])
    ids = torch.tensor([layout.full_ids()])
    with torch.no_grad():
        expected = hf(ids).logits[0, -1].float()
    got = engine.layout_logits(layout, "full")
    assert rel_err(got, expected) < 1e-4
    assert int(got.argmax()) == int(expected.argmax())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lazy_equals_position_aware_in_any_order(engine, seed):
    rng = random.Random(seed)
    chunks = rng.sample(CHUNKS, k=4)
    chunks.insert(rng.randrange(5), chunks[0])  # the same chunk at two positions of one prompt
    layout = engine.build_prompt(QUESTION, chunks)
    lazy = engine.layout_logits(layout, "lazy")
    aware = engine.layout_logits(layout, "position_aware")
    assert rel_err(lazy, aware) < 1e-5
    a = engine.generate(QUESTION, chunks, max_new_tokens=8, strategy="lazy")
    b = engine.generate(QUESTION, chunks, max_new_tokens=8, strategy="position_aware")
    assert a.token_ids == b.token_ids


def test_wrong_rotation_is_detected(engine, monkeypatch):
    """Sanity of the test above: reading chunks without their position offset changes the logits."""
    chunks = CHUNKS[:4]
    layout = engine.build_prompt(QUESTION, chunks)
    right = engine.layout_logits(layout, "lazy")
    plan = LazyStitching.plan

    def unrotated(self, layout):
        p = plan(self, layout)
        for placement in p.context:
            placement.delta = 0
        return p

    monkeypatch.setattr(LazyStitching, "plan", unrotated)
    wrong = engine.layout_logits(layout, "lazy")
    assert rel_err(wrong, right) > 1e-3


def test_cached_chunk_is_reused_at_a_new_position_without_recompute(engine):
    engine.cache.clear()
    first = engine.generate(QUESTION, CHUNKS[:3], max_new_tokens=2)
    assert first.stats.chunks_missed == 3
    layout = engine.build_prompt(QUESTION, [CHUNKS[2], CHUNKS[0], CHUNKS[1]])
    before = engine.runner.tokens_forwarded
    again = engine.generate(QUESTION, [CHUNKS[2], CHUNKS[0], CHUNKS[1]], max_new_tokens=1)
    assert again.stats.chunks_hit == 3 and again.stats.chunks_missed == 0
    # only the question tail went through the model (the one generated token needs no decode step)
    assert engine.runner.tokens_forwarded - before == len(layout.question_ids) == again.stats.tokens_prefilled
    assert again.stats.tokens_reused == layout.num_tokens - len(layout.question_ids)


def test_one_chunk_lazy_equals_full(plain_engine):
    """Without the encoding passage a lone chunk's cached KV is full prefill's (with it, test_encoding_passage.py)."""
    engine = plain_engine
    layout = engine.build_prompt(QUESTION, [CHUNKS[1]])
    lazy = engine.layout_logits(layout, "lazy")
    full = engine.layout_logits(layout, "full")
    assert rel_err(lazy, full) < 1e-4
    assert int(lazy.argmax()) == int(full.argmax())


def test_prefix_caching_reuses_exact_prefix_only(engine):
    engine.cache.clear()
    chunks = CHUNKS[:3]
    layout = engine.build_prompt(QUESTION, chunks)
    cold = engine.generate(QUESTION, chunks, max_new_tokens=1, strategy="prefix")
    warm = engine.generate(QUESTION, chunks, max_new_tokens=1, strategy="prefix")
    bs = engine.cache.pool.shape.block_size
    assert cold.stats.tokens_reused == 0
    assert warm.stats.tokens_reused == (layout.num_tokens - 1) // bs * bs
    assert rel_err(engine.layout_logits(layout, "prefix"), engine.layout_logits(layout, "full")) < 1e-4
    # a different first chunk shares only the system prefix's whole blocks
    swapped = engine.generate(QUESTION, [chunks[1], chunks[0], chunks[2]], max_new_tokens=1, strategy="prefix")
    assert swapped.stats.tokens_reused == len(layout.prefix_ids) // bs * bs
    assert swapped.stats.chunks_hit == 0


def test_lazy_shares_one_physical_copy_across_positions(engine):
    engine.cache.clear()
    engine.generate(QUESTION, CHUNKS[:3], max_new_tokens=1)
    blocks_lazy = len(engine.cache)
    engine.generate(QUESTION, CHUNKS[:3][::-1], max_new_tokens=1)
    assert len(engine.cache) == blocks_lazy  # no new segment for the new order
    engine.generate(QUESTION, CHUNKS[:3][::-1], max_new_tokens=1, strategy="position_aware")
    assert len(engine.cache) > blocks_lazy  # position-aware materialised copies


def test_stream_yields_the_generated_text(engine):
    result = engine.generate(QUESTION, CHUNKS[:3], max_new_tokens=12)
    streamed = "".join(engine.stream(QUESTION, CHUNKS[:3], max_new_tokens=12))
    assert streamed == result.text
    assert result.ttft_s > 0 and result.total_s >= result.ttft_s


def test_pool_blocks_are_returned_after_requests(engine):
    engine.cache.clear()
    free = engine.cache.pool.num_free
    engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=3, strategy="full")
    assert engine.cache.pool.num_free == free
    engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=3)
    cached_blocks = sum(len(s.blocks) for s in engine.cache._segments.values())
    assert engine.cache.pool.num_free == free - cached_blocks
    assert all(s.pins == 0 for s in engine.cache._segments.values())


def test_recomputing_chunk_heads_in_context(plain_engine):
    """lazy:first=K recomputes each chunk's first K tokens attending to the chunks before it.

    With two chunks and K covering them, that is exactly a full prefill: without the encoding passage
    the first chunk's cached KV already saw everything before it, and the second is recomputed in context.
    """
    engine = plain_engine
    chunks = CHUNKS[:2]
    layout = engine.build_prompt(QUESTION, chunks)
    full = engine.layout_logits(layout, "full")
    lazy = engine.layout_logits(layout, "lazy")
    free = engine.cache.pool.num_free
    r = engine.generate(QUESTION, chunks, max_new_tokens=1, strategy="lazy:first=512")
    assert r.stats.tokens_recomputed == sum(map(len, layout.chunk_ids))
    assert engine.cache.pool.num_free == free  # the recomputed blocks went back with the request
    covered = engine.layout_logits(layout, "lazy:first=512")
    assert rel_err(covered, full) < 1e-4 < rel_err(lazy, full)
    part = engine.generate(QUESTION, CHUNKS[:4], max_new_tokens=1, strategy="lazy:first=16")
    bs = engine.cache.pool.shape.block_size
    assert part.stats.tokens_recomputed == 4 * bs and part.stats.chunks_hit + part.stats.chunks_missed == 4
    with pytest.raises(ValueError, match="lazy:first=K"):
        engine.generate(QUESTION, chunks, strategy="lazy:first=x")


def test_a_failed_request_gives_back_what_it_pinned(tiny_engine, monkeypatch):
    from lazyrag.kv.block_pool import OutOfBlocks

    engine = tiny_engine
    engine.cache.clear()
    engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=1)  # prefix and two chunks cached
    free = engine.cache.pool.num_free
    real = engine.cache.allocate

    def exhausted(n):
        raise OutOfBlocks("simulated: no room for the new chunk")

    monkeypatch.setattr(engine.cache, "allocate", exhausted)
    with pytest.raises(OutOfBlocks):
        engine.generate(QUESTION, CHUNKS[:3], max_new_tokens=1)  # hits two, fails encoding the third
    monkeypatch.setattr(engine.cache, "allocate", real)
    assert all(s.pins == 0 for s in engine.cache._segments.values())
    assert engine.cache.pool.num_free == free


def test_position_aware_variants_cache_what_they_say(tiny_engine):
    """``position_aware`` keeps only placed copies (a new position re-encodes); ``:rerotate`` also keeps
    the position-free chunk (a new position costs a copy); both equal ``lazy``."""
    engine = tiny_engine
    layout = engine.build_prompt(QUESTION, CHUNKS[:3])
    moved = engine.build_prompt(QUESTION, CHUNKS[2::-1])
    for name, encodes_again in (("position_aware", True), ("position_aware:rerotate", False)):
        engine.cache.clear()
        first = engine.layout_logits(layout, name)
        before = engine.runner.tokens_forwarded
        again = engine.layout_logits(moved, name)
        forwarded = engine.runner.tokens_forwarded - before - len(moved.question_ids)
        assert (forwarded > 0) == encodes_again, (name, forwarded)
        assert rel_err(first, engine.layout_logits(layout, "lazy")) < 1e-5
        assert rel_err(again, engine.layout_logits(moved, "lazy")) < 1e-5


def test_reuse_stats_count_only_kv_taken_from_the_cache(tiny_hf, default_hf):
    """On a cold cache nothing is reused (the chunks are encoded now, then read in place); warm, all of it is."""
    from lazyrag.engine import LazyEngine

    engine = LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20)
    cold = engine.generate(QUESTION, CHUNKS[:3], max_new_tokens=1).stats
    warm = engine.generate(QUESTION, CHUNKS[:3][::-1], max_new_tokens=1).stats
    assert cold.chunks_missed == 3 and cold.tokens_reused == 0 and cold.tokens_context > 0
    assert warm.chunks_hit == 3 and warm.tokens_reused == warm.tokens_context == cold.tokens_context


def test_the_chunk_finder_is_bounded_least_recently_used_first(tiny_engine):
    """Every retrieval registers its chunks: the finder keeps the recent ones, not every text ever seen."""
    from lazyrag.prompt import ChunkFinder

    assert 0 < tiny_engine.chunk_finder.max_chunks <= ChunkFinder.MAX_CHUNKS
    finder = ChunkFinder(max_chunks=3)
    texts = [f"Document number {i} talks about a topic of its own." for i in range(6)]
    for text in texts[:3]:
        finder.add(text)
    assert [t for *_, t in finder.find("see " + texts[0])] == [texts[0]]  # found: now the most recent
    for text in texts[3:5]:
        finder.add(text)
    assert len(finder) == 3 and [t in finder for t in texts[:5]] == [True, False, False, True, True]
    assert finder.find(texts[1] + " " + texts[4]) == [(len(texts[1]) + 1, len(texts[1]) + 1 + len(texts[4]), texts[4])]
    for i in range(1000):
        finder.add(f"Another passage, number {i}, longer than the anchor.")
    assert len(finder) == 3 and sum(len(b.texts()) for b in finder._by_anchor.values()) == 3


# -- sampling knobs (issue 34): top_k, penalties, logprobs --------------------------------------

KNOB_CHUNKS = ["Alexander Fleming discovered penicillin in 1928.", "Tea reached Britain in 1662."]
REPEATING = "List the numbers from one to ten, separated by commas."


def test_sampling_knobs_are_checked_when_made():
    from lazyrag.engine import SamplingParams

    ok = SamplingParams(top_k=0, repetition_penalty=1.3, presence_penalty=-2, frequency_penalty=2, logprobs=20)
    assert (ok.top_k, ok.presence_penalty, ok.logprobs) == (0, -2.0, 20) and not ok.plain_greedy
    assert SamplingParams().plain_greedy and SamplingParams(top_k=5).plain_greedy  # top_k alone leaves argmax alone
    for bad in (
        dict(top_k=-2),
        dict(top_k=1.5),
        dict(repetition_penalty=0),
        dict(repetition_penalty=float("nan")),
        dict(repetition_penalty=1e-30),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(logprobs=21),
        dict(logprobs=-1),
        dict(logprobs=True),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_penalties_follow_vllm_semantics():
    from lazyrag.engine import SamplingParams
    from lazyrag.engine.sampling import apply_penalties, sample

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), torch.tensor([1]), [0])
    assert rep.tolist() == [1.0, -2.0, 0.5, 3.0]  # seen in prompt or answer: positive / p, negative * p
    freq = apply_penalties(
        logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), torch.tensor([2]), [3, 3, 0]
    )
    assert freq.tolist() == [2.0 - 0.5 - 1.0, -1.0, 0.5, 3.0 - 1.0 - 1.0]  # answer tokens only, counted
    assert sample(logits, SamplingParams(frequency_penalty=2.0), None, None, [3]) == 0  # greedy picks up the penalty
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingParams(temperature=5.0, top_k=2), g) for _ in range(50)} == {0, 3}


def test_a_strong_repetition_penalty_stops_repeats(default_engine):
    greedy = default_engine.generate(REPEATING, KNOB_CHUNKS, max_new_tokens=24)
    assert len(set(greedy.token_ids)) < len(greedy.token_ids), "the greedy answer repeats a token (commas)"
    penalized = default_engine.generate(REPEATING, KNOB_CHUNKS, max_new_tokens=24, repetition_penalty=50.0)
    assert penalized.token_ids and len(set(penalized.token_ids)) == len(penalized.token_ids)
    freq = default_engine.generate(
        REPEATING, KNOB_CHUNKS, max_new_tokens=24, frequency_penalty=2.0, presence_penalty=2.0
    )
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(freq.token_ids) < repeats(greedy.token_ids)


def test_top_k_1_is_greedy_at_any_temperature(default_engine):
    greedy = default_engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=12)
    for seed in (0, 1):
        assert (
            default_engine.generate(
                QUESTION, CHUNKS[:2], max_new_tokens=12, temperature=1.0, top_k=1, seed=seed
            ).token_ids
            == greedy.token_ids
        )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_of_each_generated_token(default_engine, temperature):
    r = default_engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=8, temperature=temperature, seed=4, logprobs=5)
    assert r.logprobs is not None and [lp.token_id for lp in r.logprobs] == r.token_ids
    for lp in r.logprobs:
        values = [v for _, v in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True) and values[0] <= 0
        assert torch.logsumexp(torch.tensor(values), 0) <= 1e-5  # part of one distribution
        assert lp.logprob <= values[0] + 1e-6 and (
            lp.token_id not in dict(lp.top) or dict(lp.top)[lp.token_id] == lp.logprob
        )
        if temperature == 0:
            assert lp.top[0][0] == lp.token_id
    first = torch.log_softmax(default_engine.next_token_logits(QUESTION, CHUNKS[:2]), -1)
    assert abs(r.logprobs[0].logprob - float(first[r.token_ids[0]])) < 1e-4
    assert default_engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=2).logprobs is None  # only when asked
    assert [lp.top for lp in default_engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=2, logprobs=0).logprobs] == [
        [],
        [],
    ]


def test_reuse_stats_split_prefix_and_chunk_tokens(tiny_hf, default_hf):
    """tokens_reused = prefix_tokens_reused + chunk_tokens_reused: over new chunks, only the cached prefix is reused."""
    from lazyrag.engine import LazyEngine

    engine = LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20)
    prefix = len(engine.build_prompt(QUESTION, CHUNKS[:2]).prefix_ids)
    first = engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=1).stats
    cold = engine.generate(
        QUESTION, CHUNKS[2:4], max_new_tokens=1
    ).stats  # the prefix is cached now, these chunks are not
    warm = engine.generate(QUESTION, CHUNKS[2:4][::-1], max_new_tokens=1).stats
    assert first.tokens_reused == first.prefix_tokens_reused == first.chunk_tokens_reused == 0
    assert (
        cold.chunks_hit == 0
        and cold.tokens_reused == cold.prefix_tokens_reused == prefix
        and cold.chunk_tokens_reused == 0
    )
    assert warm.chunks_hit == 2 and warm.prefix_tokens_reused == prefix
    assert warm.chunk_tokens_reused == warm.tokens_reused - prefix == warm.tokens_context - prefix > 0
    pre = engine.generate(
        QUESTION, CHUNKS[2:4][::-1], max_new_tokens=1, strategy="prefix"
    ).stats  # APC: blocks of the prompt
    again = engine.generate(QUESTION, CHUNKS[2:4][::-1], max_new_tokens=1, strategy="prefix").stats
    assert (
        pre.tokens_reused == 0
        and again.tokens_reused == again.prefix_tokens_reused + again.chunk_tokens_reused > prefix
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_engine_config_resolves_every_default_in_one_place(device):
    """No field is left None for the engine to interpret (a torch.device("cuda") needs no GPU to be made)."""
    from lazyrag.engine.config import EngineConfig

    cfg = EngineConfig(device=device)
    on_cuda = device == "cuda"
    assert cfg.attention == ("triton" if on_cuda else "torch") and cfg.dtype == (
        torch.bfloat16 if on_cuda else torch.float32
    )
    assert (cfg.cuda_graphs, cfg.gemv, cfg.triton_elementwise, cfg.compile_elementwise) == (on_cuda,) * 4
    assert cfg.fused_kv_store == on_cuda and cfg.skinny_gemm is False and cfg.scheduler.async_scheduling == on_cuda
    assert cfg.short_prefill_blas == ("cublaslt" if on_cuda else None)
    unresolved = [
        f for f in ("model", "adapter") if getattr(cfg, f) is None
    ]  # the embedded model until loaded; no adapter
    # torch's own BLAS choice on CPU
    assert [f for f in cfg.__dataclass_fields__ if getattr(cfg, f) is None and f not in unresolved] == (
        [] if on_cuda else ["short_prefill_blas"]
    )
    mine = EngineConfig(device=device, attention="torch", cuda_graphs=False, gemv=True, skinny_gemm=True)
    assert (mine.attention, mine.cuda_graphs, mine.gemv, mine.skinny_gemm, mine.triton_elementwise) == (
        "torch",
        False,
        True,
        True,
        False,
    )


def test_engine_config_with_changes_resolves_its_defaults_again():
    from lazyrag.engine.config import EngineConfig

    cpu = EngineConfig(device="cpu", gemv=False)
    cuda = cpu.with_changes(device="cuda")
    assert (cuda.attention, cuda.dtype, cuda.cuda_graphs, cuda.scheduler.async_scheduling) == (
        "triton",
        torch.bfloat16,
        True,
        True,
    )
    assert cuda.gemv is False  # what was given stays
    assert cpu.attention == "torch" and cpu.scheduler.async_scheduling is False  # the original is untouched
    assert cuda.with_changes(device="cpu") == cpu


def test_chunks_sharing_an_opening_are_found_longest_first():
    """Texts with one opening (metadata headers) sit in one anchor bucket, indexed again by their first 256
    characters: each is found, the longest of nested ones first, and an evicted one is gone from the index."""
    from lazyrag.prompt import ChunkFinder

    finder = ChunkFinder(max_chunks=500)
    head = "file_path: /data/corpus/documents/"
    long = [head + f"{i}.txt\n\n" + " ".join([f"body {i}"] * 60) for i in range(300)]
    short = [head + f"{i}" for i in range(150)]  # under 256 characters, also under the same anchor
    nested = long[7] + " and a longer version of the same passage."
    for text in long + short + [nested]:
        finder.add(text)
    assert len(finder._by_anchor) == 1
    prompt = "Context:\n" + long[3] + "\n\n" + nested + "\n\n" + short[42] + "!\n\nQuestion?"
    assert [t for *_, t in finder.find(prompt)] == [long[3], nested, short[42]]
    for i in range(60):  # evicts the 51 least recently used: long[0..50] but the found long[3]
        finder.add(f"Another passage number {i} with an opening of its own.")
    assert long[3] in finder and long[4] not in finder and [t for *_, t in finder.find(long[4])] == [short[4]]
    held = sum(len(b.texts()) for b in finder._by_anchor.values())
    assert held == len(finder) == 500
