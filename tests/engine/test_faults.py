"""A bad request fails alone: its neighbours finish with the tokens they get alone, every block
and pin comes back, and the engine keeps serving (sync, threads, asyncio, across event loops)."""

import asyncio
import math
import threading

import pytest
import torch

from lazyrag.engine import SamplingParams
from tests.helpers import (
    CHUNKS,
    QUESTION,
    QUESTIONS,
    assert_nothing_held,
    kwargs_id,
    random_layouts,
    run_in_threads,
    stepped_by_hand,
)


@pytest.fixture
def fresh_engine(tiny_hf, default_hf):
    """An engine of its own: a fault test must not leave a shared engine broken for the tests after it."""
    from lazyrag.engine import LazyEngine

    return LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(stop=[None]), "stop"),
        (dict(seed="7"), "seed"),
        # issue 29: values that passed and then failed inside torch
        (dict(temperature=1e-320), "temperature"),
        (dict(temperature=1e-6), "temperature"),
        (dict(top_p=1e-300), "top_p"),
        (dict(top_p=1e-7), "top_p"),
        (dict(seed=2**70), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(seed=-1), "seed"),
    ],
    ids=kwargs_id,
)
def test_bad_sampling_params_are_refused_before_admission(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        SamplingParams(**kwargs)


def test_tiny_temperature_samples_the_top_token(fresh_engine):
    import torch

    logits = torch.tensor([1.0, 3.0, 2.0])
    from lazyrag.engine.sampling import sample

    # the smallest accepted
    assert sample(logits, SamplingParams(temperature=1e-5), torch.Generator().manual_seed(0)) == 1


def _poisoned_params():
    """Params that pass validation and then go bad in flight (SamplingParams is frozen, so only a bug
    or a deliberate bypass does this; sampling then fails, and must fail that request alone)."""
    params = SamplingParams(max_new_tokens=6, temperature=0.7, seed=1, ignore_eos=True)
    object.__setattr__(params, "temperature", math.nan)
    return params


def test_a_request_that_fails_while_sampling_fails_alone(fresh_engine):
    engine = fresh_engine
    layouts = random_layouts(engine, 4, seed=11)
    good = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = [engine.submit(lay, good).result().token_ids for lay in layouts][:3]  # and every chunk cached
    free_before = engine.cache.pool.num_free

    with stepped_by_hand(engine):
        reqs = [engine.add_request(lay, good) for lay in layouts[:3]]
        bad = engine.add_request(layouts[3], _poisoned_params())

    assert [r.result().token_ids for r in reqs] == alone
    with pytest.raises(RuntimeError):
        bad.result()
    assert bad.finish_reason == "error"
    assert_nothing_held(engine, free_before)
    assert engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=3).finish_reason in ("length", "stop")


def test_a_failing_forward_pass_fails_only_the_request_at_fault(fresh_engine, monkeypatch):
    """The batched forward fails whenever the poisoned sequence is in it; the others are run alone."""
    engine = fresh_engine
    layouts = random_layouts(engine, 3, seed=12)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    alone = [engine.submit(lay, params).result().token_ids for lay in layouts][:2]
    free_before = engine.cache.pool.num_free
    runner = engine.runner
    real_prefill, real_decode = runner.prefill, runner.decode

    def guard(seqs):
        if poisoned.seq is not None and any(s is poisoned.seq for s in seqs):
            raise RuntimeError("poisoned sequence")

    monkeypatch.setattr(
        runner, "prefill", lambda seqs, ids, logits=True: (guard(seqs), real_prefill(seqs, ids, logits))[1]
    )
    monkeypatch.setattr(runner, "decode", lambda seqs, toks: (guard(seqs), real_decode(seqs, toks))[1])
    with stepped_by_hand(engine):
        reqs = [engine.add_request(lay, params) for lay in layouts]
        poisoned = reqs[2]

    assert [r.result().token_ids for r in reqs[:2]] == alone
    with pytest.raises(RuntimeError, match="poisoned"):
        poisoned.result()
    assert_nothing_held(engine, free_before)


def test_a_notify_callback_that_raises_aborts_only_its_request(fresh_engine):
    engine = fresh_engine
    layouts = random_layouts(engine, 2, seed=13)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    expected = [engine.submit(lay, params).result().token_ids for lay in layouts][0]
    free_before = engine.cache.pool.num_free

    def closed_loop():
        raise RuntimeError("Event loop is closed")

    with stepped_by_hand(engine):
        ok = engine.add_request(layouts[0], params)
        gone = engine.add_request(layouts[1], params, notify=closed_loop)

    assert ok.result().token_ids == expected
    assert gone.finish_reason == "abort"
    assert_nothing_held(engine, free_before)


def test_async_faults_fail_alone_across_event_loops(fresh_engine):
    """A poisoned request inside a gather, and a task cancelled by wait_for whose event loop then
    closes, leave the driver thread serving the next event loop with everything given back."""
    engine = fresh_engine
    layouts = random_layouts(engine, 3, seed=14)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = [engine.submit(lay, params).result().token_ids for lay in layouts]
    free_before = engine.cache.pool.num_free

    async def with_a_poisoned_neighbour():
        return await asyncio.gather(
            *(engine.submit(lay, params).aresult() for lay in layouts),
            engine.submit(layouts[0], _poisoned_params()).aresult(),
            return_exceptions=True,
        )

    *good, bad = asyncio.run(asyncio.wait_for(with_a_poisoned_neighbour(), 60))
    assert [r.token_ids for r in good] == expected
    assert isinstance(bad, RuntimeError)

    async def cancelled():
        long = SamplingParams(max_new_tokens=2000, ignore_eos=True)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.submit(layouts[1], long).aresult(), 0.3)
        # its loop closes right after; the scheduler still holds (or just dropped) the request

    for _ in range(2):
        asyncio.run(cancelled())

    async def next_loop():
        return await asyncio.gather(*(engine.submit(lay, params).aresult() for lay in layouts))

    again = asyncio.run(asyncio.wait_for(next_loop(), 60))  # hung forever when the driver thread died
    assert [r.token_ids for r in again] == expected
    assert engine._driver.is_alive()
    deadline = threading.Event()
    for _ in range(500):
        if not engine.scheduler.has_work():
            break
        deadline.wait(0.01)
    assert_nothing_held(engine, free_before)


def test_threads_with_a_bad_request_among_them(fresh_engine):
    engine = fresh_engine
    layouts = random_layouts(engine, 4, seed=15)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = [engine.submit(lay, params).result().token_ids for lay in layouts]
    free_before = engine.cache.pool.num_free
    got = run_in_threads(
        5, lambda i: engine.submit(layouts[i % 4], params if i < 4 else _poisoned_params()).result().token_ids
    )
    assert got[:4] == expected
    assert isinstance(got[4], RuntimeError)
    assert_nothing_held(engine, free_before)


@pytest.mark.parametrize(
    "question, chunks, problem",
    [
        (QUESTION, "one long string", "not a single string"),
        (QUESTION, None, "got None"),
        (QUESTION, [CHUNKS[0], None], "chunk 1 must be a string"),
        (None, CHUNKS[:1], "question must be a string"),
        (QUESTION, [CHUNKS[0], "bad \ud800 text"], "chunk 1 is not valid Unicode"),
        ("why \udfff?", CHUNKS[:1], "question is not valid Unicode"),
        (QUESTION, set(CHUNKS[:2]), "not a set"),
    ],
    ids=[
        "chunks-a-string",
        "chunks-none",
        "chunk-none",
        "question-none",
        "chunk-surrogate",
        "question-surrogate",
        "chunks-a-set",
    ],
)
def test_bad_prompt_input_is_a_value_error_that_names_it(fresh_engine, question, chunks, problem):
    with pytest.raises(ValueError, match=problem):
        fresh_engine.generate(question, chunks, max_new_tokens=2)


def test_a_layout_with_ids_outside_the_vocabulary_is_refused(fresh_engine):
    layout = fresh_engine.build_prompt(QUESTIONS[1], CHUNKS[:2])
    layout.chunk_ids[1] = layout.chunk_ids[1][:-1] + [10**9]
    with pytest.raises(ValueError, match="chunk 1"):
        fresh_engine.add_request(layout, SamplingParams(max_new_tokens=2))
    assert not fresh_engine.scheduler.has_work()


def test_whatever_the_pool_held_never_reaches_the_logits(tiny_hf, default_hf):
    """Every slot a request reads is written first or masked as padding: a pool full of NaN (recycled
    memory can hold anything) gives the logits of a clean one."""
    from lazyrag.engine import LazyEngine

    clean = LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20)
    dirty = LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20)
    dirty.cache.pool.k.fill_(float("nan"))
    dirty.cache.pool.v.fill_(float("nan"))
    for strategy in ("lazy", "position_aware", "full", "lazy:blend=0.3", "lazy:first=4"):
        layout = clean.build_prompt(QUESTIONS[2], CHUNKS[:3])
        want, got = clean.layout_logits(layout, strategy), dirty.layout_logits(layout, strategy)
        assert torch.isfinite(got).all(), strategy
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), strategy


# -- issue 29 ------------------------------------------------------------------------------------


def test_sampling_params_are_frozen_and_replace_checks_again():
    import dataclasses

    params = SamplingParams(max_new_tokens=4, temperature=0.5, stop=["."])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = math.nan
    assert params.stop == (".",) and hash(params) == hash(SamplingParams(max_new_tokens=4, temperature=0.5, stop="."))
    assert dataclasses.replace(params, temperature=0.0).temperature == 0.0
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(params, temperature=1e-320)


def test_the_edge_values_accepted_actually_run(fresh_engine):
    greedy = fresh_engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=4, ignore_eos=True)
    for kw in (
        dict(temperature=1e-5, top_p=1.0, seed=0),
        dict(temperature=1.0, top_p=1e-6, seed=2**63 - 1),
        dict(temperature=1e-5, top_p=1e-6, seed=2**63 - 1),
    ):
        got = fresh_engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=4, ignore_eos=True, **kw)
        assert got.token_ids == greedy.token_ids, kw  # the top token every time: the greedy answer
    got = fresh_engine.generate(QUESTION, CHUNKS[:2], max_new_tokens=4, ignore_eos=True, temperature=1e6, seed=3)
    assert len(got.token_ids) == 4


def test_a_dict_of_chunks_is_refused_not_read_as_its_keys(fresh_engine):
    with pytest.raises(TypeError, match=r"not a dict.*list\(d\.values\(\)\)"):
        fresh_engine.generate(QUESTION, {"curie": CHUNKS[1]}, max_new_tokens=2)
    assert not fresh_engine.scheduler.has_work()
