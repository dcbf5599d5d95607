"""Continuous batching: concurrent requests are batched, give the same answers as one at a time,
and give back every block and pin when they end, fail or are abandoned."""

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from lazyrag.engine import SamplingParams, SchedulerConfig
from lazyrag.engine.request import RequestStage
from lazyrag.kv.block_pool import OutOfBlocks
from tests.helpers import (
    CHUNKS,
    QUESTION,
    assert_nothing_held,
    random_layouts,
    rel_err,
    run_in_threads,
    stepped_by_hand,
)


def test_batched_requests_match_one_at_a_time(tiny_engine):
    engine = tiny_engine
    strategies = ["lazy", "position_aware", "full", "prefix", "lazy:first=16"]
    lengths = [3, 9, 5, 12, 7]
    layouts = random_layouts(engine, len(strategies), seed=1)
    params = [SamplingParams(max_new_tokens=k, ignore_eos=True, strategy=s) for k, s in zip(lengths, strategies)]
    alone = [engine.submit(lay, p).result() for lay, p in zip(layouts, params)]
    free_before = engine.cache.pool.num_free
    steps = dict(engine.scheduler.steps)

    with stepped_by_hand(engine):
        reqs = [engine.add_request(lay, p) for lay, p in zip(layouts, params)]

    for req, ref in zip(reqs, alone):
        assert req.result().token_ids == ref.token_ids
        assert req.result().finish_reason == "length"
    # one prefill for all five, then one decode step per token of the longest answer
    assert engine.scheduler.steps["prefill"] - steps["prefill"] == 1
    assert engine.scheduler.steps["decode"] - steps["decode"] == max(lengths) - 1
    assert_nothing_held(engine, free_before)


def test_requests_from_threads_are_batched_and_correct(tiny_engine):
    engine = tiny_engine
    layouts = random_layouts(engine, 6, seed=2)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    alone = [engine.submit(lay, params).result().token_ids for lay in layouts]
    free_before = engine.cache.pool.num_free
    steps = dict(engine.scheduler.steps)
    got = run_in_threads(len(layouts), lambda i: engine.submit(layouts[i], params).result().token_ids)
    assert got == alone
    # sequentially this takes 6 x 9 decode steps; batched, far fewer
    assert engine.scheduler.steps["decode"] - steps["decode"] < 6 * 9
    assert_nothing_held(engine, free_before)


async def test_async_api_batches_concurrent_requests(default_engine):
    engine = default_engine
    layouts = random_layouts(engine, 4, seed=3)
    params = SamplingParams(max_new_tokens=8)
    alone = [engine.submit(lay, params).result() for lay in layouts]
    steps = dict(engine.scheduler.steps)

    results = await asyncio.gather(*(engine.submit(lay, params).aresult() for lay in layouts))

    assert [r.text for r in results] == [r.text for r in alone]
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    assert engine.scheduler.steps["decode"] - steps["decode"] < sum(len(r.token_ids) for r in alone)
    streamed = "".join([d async for d in engine.astream(QUESTION, CHUNKS[:3], max_new_tokens=8)])
    assert streamed == engine.generate(QUESTION, CHUNKS[:3], max_new_tokens=8).text


def test_stopping_a_stream_early_gives_everything_back(tiny_engine):
    engine = tiny_engine
    layout = random_layouts(engine, 1, seed=4)[0]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    engine.submit(layout, params).result()  # chunks cached
    free_before = engine.cache.pool.num_free
    stream = iter(engine.submit(layout, params))
    next(stream), next(stream)
    assert engine.cache.pool.num_free < free_before  # the request holds its own blocks
    stream.close()
    assert_nothing_held(engine, free_before)


async def test_cancelled_async_stream_gives_everything_back(tiny_engine):
    engine = tiny_engine
    layout = random_layouts(engine, 1, seed=5)[0]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    await engine.submit(layout, params).aresult()
    free_before = engine.cache.pool.num_free
    stream = engine.submit(layout, params).__aiter__()
    async for _ in stream:
        break
    await stream.aclose()
    deadline = time.monotonic() + 10
    while engine.scheduler.has_work() and time.monotonic() < deadline:  # the driver thread reaps it at its next step
        await asyncio.sleep(0.01)
    assert_nothing_held(engine, free_before)


def test_a_full_pool_queues_requests_and_an_impossible_one_fails_alone(tiny_hf, default_hf):
    from lazyrag.engine import LazyEngine

    # 48 blocks of 16 tokens: the chunks and one long answer fit, two long answers do not (without the encoding
    # passage, whose context segment would take a third of so small a pool while chunks are encoded)
    engine = LazyEngine.from_hf(
        tiny_hf,
        default_hf[1],
        device="cpu",
        kv_budget=48 * 8192,
        encoding_passage=None,
        scheduler=SchedulerConfig(max_running=8),
    )
    assert engine.cache.pool.num_blocks == 48
    layouts = random_layouts(engine, 2, seed=6)
    long = SamplingParams(max_new_tokens=400, ignore_eos=True)
    before = engine.runner.tokens_forwarded
    with stepped_by_hand(engine):
        first = engine.add_request(layouts[0], long)
        second = engine.add_request(layouts[1], replace(long, strategy="position_aware"))
        impossible = engine.add_request(layouts[0], SamplingParams(max_new_tokens=1000, ignore_eos=True))
    assert len(first.result().token_ids) == len(second.result().token_ids) == 400
    assert second.first_token_at >= first.finished_at  # it waited for the first one's blocks
    # and while it waited, none of its chunks was encoded only to be thrown away
    useful = sum(r.result().stats.tokens_prefilled + len(r.result().token_ids) - 1 for r in (first, second))
    assert engine.runner.tokens_forwarded - before == useful
    with pytest.raises(OutOfBlocks, match="raise kv_budget"):
        impossible.result()
    assert all(seg.pins == 0 for seg in engine.cache._segments.values())
    assert (
        engine.cache.pool.num_free + sum(len(s.blocks) for s in engine.cache._segments.values())
        == engine.cache.pool.num_blocks
    )


def test_max_running_caps_the_batch(tiny_hf, default_hf):
    from lazyrag.engine import LazyEngine

    engine = LazyEngine.from_hf(
        tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20, scheduler=SchedulerConfig(max_running=2)
    )
    widest = 0
    with engine._lock:
        reqs = [
            engine.add_request(lay, SamplingParams(max_new_tokens=5, ignore_eos=True))
            for lay in random_layouts(engine, 5, seed=7)
        ]
        while engine.scheduler.has_work():
            engine.scheduler.step()
            widest = max(widest, len(engine.scheduler.running))
    assert widest == 2
    assert all(len(r.result().token_ids) == 5 for r in reqs)


def test_async_scheduling_gives_the_same_answers_and_everything_back(tiny_engine, monkeypatch):
    """Async scheduling (on with CUDA, forced here on the CPU) launches each greedy decode step on the previous
    step's tokens while they are still on the device. The answers are those of synchronous stepping; a request
    that ends on an end token ends one launched step late without a different answer; a sampled request makes
    the batch step synchronously while it runs; an abort and the length limit give every block back."""
    engine, sched = tiny_engine, tiny_engine.scheduler
    layouts = random_layouts(engine, 6, seed=21)
    lengths = [4, 11, 6, 9, 7]
    greedy = [SamplingParams(max_new_tokens=k, ignore_eos=True) for k in lengths]
    monkeypatch.setattr(sched, "async_scheduling", False)
    first_answer = engine.submit(layouts[1], greedy[1]).result().token_ids
    monkeypatch.setattr(sched, "end_tokens", {first_answer[4]})  # request 1 stops on its 5th token
    greedy[1] = replace(greedy[1], ignore_eos=False)
    alone = [engine.submit(lay, p).result() for lay, p in zip(layouts, greedy)]
    assert alone[1].finish_reason == "stop" and len(alone[1].token_ids) == 4
    sampled = SamplingParams(max_new_tokens=3, temperature=0.8, seed=5, ignore_eos=True)
    endless = SamplingParams(max_new_tokens=50, ignore_eos=True)
    free_before = engine.cache.pool.num_free

    monkeypatch.setattr(sched, "async_scheduling", True)
    decode, on_device = engine.runner.decode, []

    def spy(seqs, tokens):
        on_device.append(isinstance(tokens, torch.Tensor))
        return decode(seqs, tokens)

    monkeypatch.setattr(engine.runner, "decode", spy)
    with engine._lock:  # held from the first request queued: see stepped_by_hand
        reqs = [engine.add_request(lay, p) for lay, p in zip(layouts, greedy)]
        reqs.append(engine.add_request(layouts[0], sampled))
        aborted = engine.add_request(layouts[5], endless)
        while sched.has_work():
            sched.step()
            if len(aborted.outputs) >= 3:
                sched.abort(aborted)

    for req, ref in zip(reqs, alone):
        assert req.result().token_ids == ref.token_ids
        assert req.result().finish_reason == ref.finish_reason
    assert len(reqs[-1].result().token_ids) == 3
    assert aborted.finish_reason == "abort" and 3 <= len(aborted.seq.generated) < 50
    assert any(on_device) and not all(on_device)  # chained while all were greedy; not while the sampled one ran
    assert_nothing_held(engine, free_before)

    # one request, streamed: the same text as stepping synchronously
    stream = "".join(engine.submit(layouts[2], greedy[2]))
    monkeypatch.setattr(sched, "async_scheduling", False)
    assert stream == engine.submit(layouts[2], greedy[2]).result().text
    assert_nothing_held(engine, free_before)


def test_a_long_prompt_is_prefilled_in_pieces_and_an_abort_lands_between_them(tiny_engine, monkeypatch):
    """A prompt with more new tokens than ``long_prefill_tokens`` is prefilled a piece a step: its logits are those
    of one whole prefill (within float tolerance), a short request admitted meanwhile is not held back, and an abort
    between pieces ends the request there, having forwarded only the pieces already run, with everything given back."""
    engine, sched = tiny_engine, tiny_engine.scheduler
    layout = random_layouts(engine, 1, seed=31)[0]
    short = random_layouts(engine, 2, seed=32)[1]
    piece = -(-len(short.question_ids) // 16) * 16  # the short request's question fits one piece
    assert layout.num_tokens > 3 * piece
    whole = engine.layout_logits(layout, strategy="full")
    engine.submit(short, SamplingParams(max_new_tokens=1)).result()  # its chunks cached
    free_before = engine.cache.pool.num_free
    monkeypatch.setattr(sched, "config", replace(sched.config, long_prefill_tokens=piece))

    steps = sched.steps["prefill"]
    pieces = engine.layout_logits(layout, strategy="full")
    assert sched.steps["prefill"] - steps == -(-layout.num_tokens // piece)
    assert rel_err(pieces, whole) < 1e-4
    assert_nothing_held(engine, free_before)

    with engine._lock:
        long = engine.add_request(layout, SamplingParams(max_new_tokens=4, ignore_eos=True, strategy="full"))
        sched.step()  # the long prompt's first piece
        assert long.seq.num_written == piece and not long.done and sched.has_work()
        quick = engine.add_request(short, SamplingParams(max_new_tokens=2, ignore_eos=True))
        sched.step()  # the long prompt's second piece and the short request's whole prompt, in one forward
        assert long.seq.num_written == 2 * piece and quick.first_token_at is not None and long.first_token_at is None
        forwarded = engine.runner.tokens_forwarded
        sched.abort(long)
        while sched.has_work():
            sched.step()
    assert long.finish_reason == "abort" and long.seq.num_written == 2 * piece
    assert engine.runner.tokens_forwarded - forwarded == 1  # the short request's second token, nothing of the long one
    assert len(quick.result().token_ids) == 2
    assert_nothing_held(engine, free_before)


def _stages(sched, req, step_while=lambda: True) -> list[RequestStage]:
    """The stages ``req`` is seen in after each step (each one once), stepping while it runs and ``step_while()``."""
    seen = [req.stage]
    while not req.done and step_while():
        sched.step()
        if req.stage is not seen[-1]:
            seen.append(req.stage)
    return seen


def test_a_request_moves_through_its_stages_and_ends_finished_aborted_or_failed(tiny_engine, monkeypatch):
    """WAITING until a step plans it; PREFILLING while its prompt is prefilled (a piece a step here); DECODING in
    the running batch; FINISHED at the length limit. An abort asked for moves nothing until the next step, which
    ends the request ABORTED wherever it was; a request whose forward pass fails ends FAILED. Each gives back all
    it held."""
    S = RequestStage
    engine, sched = tiny_engine, tiny_engine.scheduler
    layout = random_layouts(engine, 1, seed=41)[0]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, strategy="full")
    engine.submit(layout, params).result()
    free_before = engine.cache.pool.num_free
    monkeypatch.setattr(sched, "async_scheduling", False)
    monkeypatch.setattr(sched, "config", replace(sched.config, long_prefill_tokens=16))
    assert layout.num_tokens > 2 * 16

    with engine._lock:
        req = engine.add_request(layout, params)
        assert _stages(sched, req, lambda: req.stage is S.WAITING) == [S.WAITING, S.PREFILLING]
        assert req in sched._partial and not req.done  # its first piece only
        assert _stages(sched, req) == [S.PREFILLING, S.DECODING, S.FINISHED]
        assert req.done and req.finish_reason == "length" and req not in sched.running

        logits_only = engine.add_request(layout, params, prompt_logits_only=True)
        assert _stages(sched, logits_only) == [S.WAITING, S.PREFILLING, S.FINISHED]  # never in the running batch

        waiting = engine.add_request(layout, params)
        sched.abort(waiting)
        assert waiting.stage is S.WAITING  # the abort lands at the next step
        assert _stages(sched, waiting) == [S.WAITING, S.ABORTED]

        endless = replace(params, max_new_tokens=50)
        running = engine.add_request(layout, endless)
        assert _stages(sched, running, lambda: running.stage is not S.DECODING)[-1] is S.DECODING
        sched.abort(running)
        assert running.stage is S.DECODING and running in sched.running
        assert _stages(sched, running) == [S.DECODING, S.ABORTED]
        assert running.finish_reason == "abort" and running not in sched.running
    assert_nothing_held(engine, free_before)

    decode = engine.runner.decode

    def failing(seqs, tokens):
        if any(s is poisoned.seq for s in seqs):
            raise RuntimeError("poisoned sequence")
        return decode(seqs, tokens)

    monkeypatch.setattr(engine.runner, "decode", failing)
    with engine._lock:
        poisoned = engine.add_request(layout, params)
        assert _stages(sched, poisoned)[-2:] == [S.DECODING, S.FAILED]
    assert poisoned.finish_reason == "error" and isinstance(poisoned.error, RuntimeError)
    assert_nothing_held(engine, free_before)


def test_long_prefill_tokens_defaults_by_device():
    from lazyrag.engine import EngineConfig

    assert EngineConfig(device="cpu").scheduler.long_prefill_tokens == 2048
    config = EngineConfig(device="cpu", scheduler=SchedulerConfig(long_prefill_tokens=64))
    assert config.scheduler.long_prefill_tokens == 64
    assert EngineConfig(device="cpu").with_changes(device="cuda").scheduler.long_prefill_tokens == 8192
    with pytest.raises(ValueError, match="long_prefill_tokens"):
        EngineConfig(device="cpu", scheduler=SchedulerConfig(long_prefill_tokens=0))


def test_the_chunks_of_waiting_requests_are_prefetched_from_the_host_tier(tiny_engine, monkeypatch):
    """While a step runs, the chunks of the requests still waiting for a slot are promoted from the host tier in
    the background: planning them finds them in the pool (device hits, nothing promoted on the stepping thread),
    and the answers are those of a request that promoted its own."""
    engine = tiny_engine
    layouts = [engine.build_prompt(QUESTION, chunks) for chunks in (CHUNKS[:2], CHUNKS[2:4], CHUNKS[4:])]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    config = engine.cache.config
    engine.cache.reconfigure(replace(config, host_bytes=64 << 20, stored_kv_dtype="float32"))  # bit-exact
    try:
        alone = [engine.submit(lay, params).result().token_ids for lay in layouts]
        engine.cache.clear()  # every segment demoted: the KV is in host RAM only
        monkeypatch.setattr(
            engine.scheduler, "config", replace(engine.scheduler.config, max_running=1, prefetch_waiting=2)
        )
        sched, stats = engine.scheduler, engine.cache.stats
        keys = [k for lay in layouts[1:] for k in engine.core.planner["lazy"].lookup_keys(lay)]
        with engine._lock:
            reqs = [engine.add_request(lay, params) for lay in layouts]
            sched.step()  # the first request promotes its own chunks; the other two wait for its slot
            assert sched.prefetching is not None and sched.prefetching.result(timeout=120) == 3  # their chunks
            assert all(key in engine.cache for key in keys)
            tier_hits, prefetched = stats.tier_hits, stats.prefetched
            while sched.has_work():
                sched.step()
        assert stats.tier_hits == tier_hits and stats.prefetched == prefetched == 3
        assert [r.result().token_ids for r in reqs] == alone
        assert [r.stats.chunks_hit for r in reqs] == [len(lay.chunk_ids) for lay in layouts]
        assert engine.cache.num_pinned == 0  # and every block not cached is back in the pool:
        assert engine.cache.pool.num_free == engine.cache.pool.num_blocks - engine.cache.cached_blocks
    finally:
        engine.cache.reconfigure(config)


def test_prefetching_waiting_requests_defaults_to_cuda_without_tensor_parallelism():
    from lazyrag.engine import EngineConfig

    assert EngineConfig(device="cpu").scheduler.prefetch_waiting == 0
    assert EngineConfig(device="cpu").with_changes(device="cuda").scheduler.prefetch_waiting == 4
    assert EngineConfig(device="cuda", tensor_parallel_size=2).scheduler.prefetch_waiting == 0
    assert EngineConfig(device="cpu", scheduler=SchedulerConfig(prefetch_waiting=3)).scheduler.prefetch_waiting == 3
