"""Seeded fuzzing of the engine under random requests (bounded to well under a minute on 2 cores).

Random chunk lists and orders (unicode, empty, repeated chunks), strategies, sampling params
(some invalid, some going bad in flight), aborts at random steps and cancelled asyncio tasks,
against a small engine whose pool is too small for everything at once. Invariants after every
step: no exception escapes ``step``, the cache stays within its byte budget; after each round:
every request ended the way its fault says (only the poisoned ones fail, aborted ones abort,
the rest finish or fail alone for lack of blocks), nothing stays pinned and every block not in
a cached segment is free; and ``lazy`` gives ``position_aware``'s next-token logits.
"""

import asyncio
import dataclasses
import math
import random

import pytest
import torch

from lazyrag.engine import SamplingParams
from lazyrag.kv.block_pool import OutOfBlocks
from lazyrag.kv.cache import CacheConfig

WORDS = [
    "canal",
    "Curie",
    "trench",
    "basalt",
    "violin",
    "1903",
    "Beijing",
    "depth",
    "lava",
    "prize",
    "naïve",
    "café",
    "東京",
    "Ελλάδα",
    "😀",
    "e\u0301",
    "שלום",
    "\t",
    "—",
    "...",
]
STRATEGIES = ["lazy", "position_aware", "position_aware:rerotate", "full", "prefix", "lazy:first=4", "lazy:blend=0.3"]
ROUNDS = 12


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _params(rng: random.Random, strategy: str) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=rng.randint(1, 12),
        temperature=rng.choice([0.0, 0.0, 0.5, 1.3]),
        top_p=rng.choice([1.0, 0.9, 0.3]),
        seed=rng.randint(0, 9),
        ignore_eos=rng.random() < 0.5,
        stop=rng.choice([[], ["."], ["prize", "😀"]]),
        strategy=strategy,
    )


def _invalid_params(rng: random.Random) -> dict:
    return rng.choice(
        [
            dict(temperature=math.nan),
            dict(temperature=-1.0),
            dict(temperature=math.inf),
            dict(top_p=0.0),
            dict(top_p=2.0),
            dict(max_new_tokens=0),
            dict(max_new_tokens=-3),
        ]
    )


def _check_quiet(engine) -> None:
    cache, pool = engine.cache, engine.cache.pool
    assert not engine.scheduler.has_work()
    assert all(seg.pins == 0 for seg in cache._segments.values())
    cached = sum(len(seg.blocks) for seg in cache._segments.values())
    assert pool.num_free + cached == pool.num_blocks, "a block is held by nobody"


@pytest.fixture
def small_engine(tiny_hf, default_hf):
    from lazyrag.engine import LazyEngine

    # 96 blocks of 16 tokens; cached chunks may keep at most 40 of them
    return LazyEngine.from_hf(
        tiny_hf, default_hf[1], device="cpu", kv_budget=96 * 8192, cache=CacheConfig(budget_bytes=40 * 8192)
    )


def test_fuzz_requests_faults_and_aborts(small_engine):
    engine = small_engine
    rng = random.Random(20261201)
    corpus = [_text(rng, 0, 40) for _ in range(14)] + [""]
    budget = engine.cache.budget_bytes
    for round_ in range(ROUNDS):
        reqs, fates = [], []
        for _ in range(rng.randint(2, 6)):
            chunks = [rng.choice(corpus) for _ in range(rng.randint(0, 5))]  # repeats allowed
            layout = engine.build_prompt(_text(rng, 1, 8), chunks)
            fate = rng.choices(["ok", "poison", "abort"], [6, 1, 2])[0]
            params = _params(rng, rng.choice(STRATEGIES))
            if fate == "poison":  # valid at admission, bad in flight (a bypass of the frozen dataclass)
                object.__setattr__(params, "temperature", math.nan)
            with pytest.raises(ValueError):
                SamplingParams(**_invalid_params(rng))
            reqs.append(engine.add_request(layout, params))
            fates.append(fate)
        abort_at = {i: rng.randint(0, 4) for i, f in enumerate(fates) if f == "abort"}
        steps = 0
        while engine.has_unfinished_requests():
            for i, at in abort_at.items():
                if at == steps:
                    engine.scheduler.abort(reqs[i])
            engine.step()  # a fault must never escape
            assert engine.cache.cached_bytes <= budget
            steps += 1
            assert steps < 500, "the scheduler stopped making progress"
        for req, fate in zip(reqs, fates):
            assert req.done
            if fate == "poison" and req.error is not None:
                assert isinstance(req.error, RuntimeError), req.error
            elif fate == "abort":
                assert req.finish_reason in ("abort", "stop", "length"), (round_, req.finish_reason, req.error)
            else:
                if req.error is not None:
                    assert isinstance(req.error, OutOfBlocks) and "kv_budget" in str(req.error), (round_, req.error)
                else:
                    assert req.finish_reason in ("stop", "length")
                    assert len(req.result().token_ids) <= req.params.max_new_tokens
        _check_quiet(engine)

        chunks = rng.sample(corpus[:-1], k=3)
        layout = engine.build_prompt(_text(rng, 2, 6), chunks)
        lazy = engine.layout_logits(layout, "lazy")
        aware = engine.layout_logits(layout, "position_aware")
        assert torch.allclose(lazy, aware, rtol=1e-4, atol=1e-4), (lazy - aware).abs().max()
        _check_quiet(engine)


def test_fuzz_asyncio_cancellations(small_engine):
    engine = small_engine
    rng = random.Random(7)
    corpus = [_text(rng, 5, 30) for _ in range(8)]

    async def one(layout, params, timeout):
        try:
            return await asyncio.wait_for(engine.submit(layout, params).aresult(), timeout)
        except (asyncio.TimeoutError, OutOfBlocks):
            return None

    for _ in range(4):  # each round in a new event loop, closed right after
        jobs = []
        for _ in range(rng.randint(3, 6)):
            layout = engine.build_prompt(_text(rng, 1, 6), rng.sample(corpus, k=rng.randint(1, 3)))
            params = SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=True)
            jobs.append((layout, params, rng.choice([0.01, 0.05, 30.0])))

        async def main(jobs=jobs):
            return await asyncio.gather(*(one(*job) for job in jobs))

        results = asyncio.run(main())
        for (_layout, params, timeout), res in zip(jobs, results):
            if timeout == 30.0:
                assert res is not None and len(res.token_ids) == params.max_new_tokens
    for _ in range(500):  # the driver thread reaps the last cancelled ones at its next step
        if not engine.scheduler.has_work():
            break
        asyncio.run(asyncio.sleep(0.01))
    _check_quiet(engine)
    assert engine._driver.is_alive()


# -- issue 29: the retriever's k, the adapters' prompts and constructor arguments ------------------------


def _odd_value(rng: random.Random):
    """Anything a caller might pass where a number or a string is expected."""
    return rng.choice(
        [
            rng.randint(-3, 12),
            rng.randint(13, 10**4),
            2**31,
            2**63,
            2**70,
            10**8,
            -(2**63),
            rng.uniform(-2, 2),
            1e-320,
            1e-300,
            1e-5,
            1e-6,
            1e-7,
            math.inf,
            -math.inf,
            math.nan,
            0.0,
            1.0,
            True,
            False,
            None,
            "3",
            b"3",
            [3],
            {"k": 3},
        ]
    )


def test_fuzz_retriever_k(tiny_engine, tiny_corpus, embedder, tmp_path):
    from lazyrag.store.build import PrecacheConfig, precache
    from lazyrag.store.retriever import Retriever

    out = tmp_path / "store"
    precache(tiny_engine, PrecacheConfig([str(tiny_corpus)], str(out), chunks_per_shard=2, progress=False), embedder)
    retriever = Retriever(out, embedder)
    rng = random.Random(29)
    for _ in range(60):
        k = _odd_value(rng)
        query = rng.choice([_text(rng, 1, 6), "", _odd_value(rng)])
        try:
            hits = retriever.retrieve(query, k)
        except ValueError:  # a bad k or query is refused by name; the process never aborts
            assert not isinstance(query, str) or isinstance(k, bool) or not isinstance(k, int) or k < 1, (query, k)
            continue
        assert isinstance(query, str) and isinstance(k, int) and k >= 1
        assert len(hits) == min(k, 5) and len({h.id for h in hits}) == len(hits)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_fuzz_adapter_arguments_and_prompts(small_engine):
    """Whatever an adapter's constructor accepts, the engine runs; whatever it would not run is refused
    at construction (ValueError) and any non-str prompt at the call (TypeError)."""
    from lazyrag.integrations.langchain import ChatLazyLlama
    from lazyrag.integrations.llama_index import LazyLlamaLLM

    rng = random.Random(2929)
    fields = {
        LazyLlamaLLM: ("temperature", "top_p", "seed", "max_new_tokens", "context_window", "kv_budget"),
        ChatLazyLlama: ("temperature", "top_p", "seed", "max_tokens", "kv_budget", "max_retries"),
    }
    ran = 0
    for _ in range(80):
        cls = rng.choice([LazyLlamaLLM, ChatLazyLlama])
        kwargs = {name: _odd_value(rng) for name in rng.sample(fields[cls], k=rng.randint(1, 3))}
        kwargs.pop("kv_budget", None) if rng.random() < 0.7 else None
        try:
            adapter = cls(engine=small_engine, **kwargs)
        except ValueError:
            continue
        params = adapter._params({}) if cls is LazyLlamaLLM else adapter.sampling_params()  # never raises once built
        if ran < 6 and params.max_new_tokens <= 64:
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 3))
            assert small_engine.generate("Why?", ["café au lait"], params).finish_reason in ("stop", "length")
            ran += 1
    llm = LazyLlamaLLM(engine=small_engine, max_new_tokens=2)
    for _ in range(20):
        prompt = rng.choice([_odd_value(rng), _text(rng, 1, 5)])
        if isinstance(prompt, str):
            assert isinstance(llm.complete(prompt).text, str)
        else:
            with pytest.raises(TypeError, match="takes the prompt as a str"):
                llm.complete(prompt)
    _check_quiet(small_engine)
