"""Continuous batching: many requests in flight over one model, one KV pool and one chunk cache.

The scheduler owns the cache: it admits a request when the pool can hold it, asks the
planner (engine/reuse.py) for the request's ``Plan``, runs the model, and hands the plan
back to the planner when the request ends.

Each ``step`` is one forward pass, with vLLM's prefill-first policy: requests that arrived
are planned (their missing chunks looked up, loaded or encoded) and their new tokens
prefilled together in one batch; when none is waiting, every running request decodes one
token, all in one batch. Requests join and leave between steps, so a long answer never
holds up a new question, and requests over the same chunks share one copy of their KV.
A prompt with more new tokens than ``long_prefill_tokens`` is prefilled in pieces, one a step
and ahead of new admissions (vLLM's chunked prefill): an abort lands between pieces.

Async scheduling (vLLM's ``--async-scheduling``; on with CUDA): a step's greedy tokens stay on
the device, and while they are being computed the next decode step of the same batch is
already launched with them as its input, before the host reads them; the host's work of a
step (reading tokens, stop checks, streaming, building the next batch) then overlaps the
device's. A request that ends (end of turn, stop string, abort) has run one step too many,
whose output is dropped; the length limit is known ahead and costs nothing.

The scheduler is not thread-safe: one thread at a time calls ``step`` (the engine's lock).
``add`` and ``abort`` may be called from any thread at any time.

Faults stay with their request: an exception while planning, running the model, sampling
or notifying a consumer fails (or, for a consumer gone away, aborts) only the request(s) it
belongs to, which give back their blocks and pins; a batch whose forward pass fails is run
again one request at a time to find them. ``step`` itself never raises for a request's fault.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lazyrag.engine.config import SchedulerConfig
from lazyrag.engine.request import Plan, Request, RequestStage, TokenLogprob
from lazyrag.engine.reuse import Planner
from lazyrag.engine.runner import ModelRunner, SeqState
from lazyrag.engine.sampling import Detokenizer, sample, token_logprobs
from lazyrag.kv.block_pool import OutOfBlocks
from lazyrag.kv.cache import CacheManager

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Launched:
    """A forward pass queued on the device whose tokens the host has not read yet."""

    batch: list[Request]  # its rows, in order
    logits: torch.Tensor  # [B, V]; a captured graph's buffer is overwritten by that graph's next replay
    tokens: torch.Tensor  # [B] int64: each row's greedy token, on the device
    host_tokens: torch.Tensor  # [B] the same, in host memory once ``ready`` has completed
    ready: torch.cuda.Event | None  # None: computed synchronously (CPU)


def _planned(req: Request) -> tuple[Plan, SeqState]:
    """The plan and sequence state of a request that ``Scheduler._plan`` planned (it sets both)."""
    assert req.plan is not None and req.seq is not None, "the request is not planned"
    return req.plan, req.seq


def _seq(req: Request) -> SeqState:
    """The sequence state of a planned request."""
    assert req.seq is not None, "the request is not planned"
    return req.seq


# the stage a request ends in, by its finish reason ("stop" and "length": FINISHED)
_END_STAGES = {"abort": RequestStage.ABORTED, "error": RequestStage.FAILED}


def _length(piece: slice[int, int, int]) -> int:
    return piece.stop - piece.start


def launch_tokens(
    batch: list[Request], logits: torch.Tensor, greedy_tokens: Callable[[torch.Tensor], torch.Tensor]
) -> Launched:
    """Queue each row's greedy token and its copy to the host (pinned memory, one event), without waiting."""
    tokens = greedy_tokens(logits)  # [B] on the device
    if not tokens.is_cuda:
        return Launched(batch, logits, tokens, tokens, None)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return Launched(batch, logits, tokens, host, ready)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: CacheManager,
        planner: Planner,
        tokenizer: Any,  # a transformers tokenizer (its decode), or None: no text, token ids only
        end_tokens: set[int],
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner, self.cache, self.planner = runner, cache, planner
        self.tokenizer, self.end_tokens = tokenizer, end_tokens
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.pool = cache.pool
        self.inbox: deque[Request] = deque()  # added by any thread, taken in by ``step``
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._prefilling: list[Request] = []
        self._partial: list[Request] = []  # admitted, their prompt prefilled in part: continued first, next step
        self._launched: Launched | None = None  # async scheduling: the step in flight, not yet accepted
        self.async_scheduling = bool(self.config.async_scheduling)  # EngineConfig resolved None (on with cuda)
        self.prefetching: Future[int] | None = None  # the promotion of waiting requests' chunks under way, if any
        self._prefetched_for: set[int] = set()  # ids of the waiting requests whose chunks were sent to prefetch
        self.steps = {"prefill": 0, "decode": 0}

    # -- any thread ---------------------------------------------------------------------------

    def add(self, req: Request) -> Request:
        self.inbox.append(req)
        return req

    def abort(self, req: Request) -> None:
        """Stop a request (its consumer went away); its blocks and pins are given back at the next step."""
        req.aborted = True

    def drop(self, req: Request) -> None:
        """End ``req`` now, wherever it is, giving back what it holds (stepping thread only): tensor parallelism's
        ranks end here what rank 0 ended alone (engine/tensor_parallel.py)."""
        for queue in (self.inbox, self.waiting, self._partial):
            if req in queue:
                queue.remove(req)
        self._finish(req, "abort")

    def has_work(self) -> bool:
        return bool(self.inbox or self.waiting or self._partial or self.running or self._launched)

    def fail_all(self, error: BaseException, also: list[Request]) -> None:
        """Fail every request queued or running, and ``also``, with ``error``, and forget the step in flight (stepping
        thread only): tensor parallelism's group broke, so nothing can run any more (engine/tensor_parallel.py)."""
        for req in list(self.inbox) + list(self.waiting) + list(self.running) + also:
            self._fail(req, error)
        self.inbox.clear()
        self.waiting.clear()
        self._launched = None

    # -- the stepping thread --------------------------------------------------------------------

    def step(self) -> bool:
        """One forward pass: prefill the requests that can start, else decode all running ones. With async
        scheduling a pass is accepted at the next ``step``, after the pass that follows it has been launched
        where it can be. Returns False when there was nothing to do."""
        previous, self._launched = self._launched, None
        try:
            return self._step(previous)
        except Exception as e:  # a fault no single request owns (a bug): fail those in flight rather than hang them
            log.exception("lazyrag scheduler step failed; failing the requests in flight")
            self._fail_in_flight(previous, e)
            return True

    def _step(self, previous: Launched | None) -> bool:
        """``step``'s work, ``previous`` the pass launched by the step before (async scheduling)."""
        while self.inbox:
            self.waiting.append(self.inbox.popleft())
        self._drop_aborted()
        if previous is not None and self._chain_and_accept(previous):
            return True
        if not self._launch() and previous is None:
            return False
        self._prefetch_waiting()  # after the launch: the copies overlap the pass
        if not self.async_scheduling and self._launched is not None:
            launched, self._launched = self._launched, None
            self._accept(launched)
        return True

    def _chain_and_accept(self, previous: Launched) -> bool:
        """Accept ``previous``, having launched the decode that follows it first where it can be (so the device
        computes it while the host reads ``previous``'s tokens). Whether that decode was launched."""
        if self._can_chain(previous):
            self._launched = self._chain_decode(previous)
        self._accept(previous)
        return self._launched is not None

    def _launch(self) -> bool:
        """Launch the step's pass into ``_launched``: a prefill of the requests admitted, else a decode of the
        running ones. False when there is nothing to run (a pass whose every request failed still counts)."""
        self._prefilling = self._admit()  # out of waiting, not yet running
        if self._prefilling:
            self._launched = self._prefill(self._prefilling)
            self._prefilling = []
        elif self.running:
            self._launched = self._decode()
        else:
            return False
        return True

    def _fail_in_flight(self, previous: Launched | None, error: Exception) -> None:
        """Fail every request queued, admitted, running or in a pass not yet accepted, and forget the pass."""
        in_flight = [r for step in (previous, self._launched) if step is not None for r in step.batch]
        for req in list(self.waiting) + self.running + self._partial + self._prefilling + in_flight:
            self._fail(req, error)
        self.waiting.clear()
        self._partial = []
        self._prefilling = []
        self._launched = None

    def drop_aborted(self) -> None:
        """Give back the blocks and pins of aborted requests now, without a forward pass."""
        try:
            self._drop_aborted()
        except Exception:
            log.exception("lazyrag scheduler failed to drop aborted requests")

    def _drop_aborted(self) -> None:
        for req in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(req)
            self._finish(req, "abort")
        for req in [r for r in self._partial if r.aborted]:
            self._partial.remove(req)
            self._finish(req, "abort")
        for req in [r for r in self.running if r.aborted]:
            self._finish(req, "abort")

    def _admit(self) -> list[Request]:
        """The requests whose prompt was prefilled in part, then waiting requests planned in arrival order while
        the batch, the token budget and the pool allow; the chunks they miss are computed together, in the step's
        encode batch (engine/reuse.py ``EncodeBatch``), before their prefill. A request whose chunk could not be
        encoded fails alone."""
        continued, self._partial = self._partial, []
        tokens = sum(_length(self._next_piece(r)) for r in continued)
        batch = self.planner.batch
        if not self.config.batch_encodes:
            return continued + self._admit_planned(len(continued), tokens)
        batch.begin()
        try:
            admitted = self._admit_planned(len(continued), tokens)
        finally:
            batch.end()
        if not batch.failed:
            return continued + admitted
        ok = continued
        for req in admitted:
            try:
                batch.check(_planned(req)[0])
                ok.append(req)
            except RuntimeError as e:
                self._fail(req, e)
        return ok

    def _admit_planned(self, continued: int, tokens: int) -> list[Request]:
        """Waiting requests planned, after ``continued`` requests of ``tokens`` new tokens already in the step."""
        batch: list[Request] = []
        while self.waiting and len(self.running) + continued + len(batch) < self.config.max_running:
            req = self.waiting[0]
            new_tokens = len(req.layout.question_ids)  # a lower bound before planning (full and prefix add more)
            if (batch or continued) and tokens + new_tokens > self.config.max_prefill_tokens:
                break
            try:
                if (self.running or batch or continued) and self.pool_cannot_fit(req):
                    break  # planning now would encode its chunks only to fail for blocks and throw them away
                self._plan(req)
            except OutOfBlocks as e:
                if self.running or batch or continued:
                    break  # blocks come back as running requests finish: try again then
                self.waiting.popleft()
                self._fail(req, e)
                continue
            except Exception as e:  # a bad request fails alone
                self.waiting.popleft()
                self._fail(req, e)
                continue
            self.waiting.popleft()
            batch.append(req)
            tokens += _length(self._next_piece(req))
        return batch

    def _prefetch_waiting(self) -> None:
        """Bring the chunks of the next waiting requests up from the host or disk tier while this step runs, so
        that planning them finds them in the pool (one prefetch at a time; it only promotes, never encodes)."""
        lookahead = self.config.prefetch_waiting or 0
        if not (lookahead and self.waiting and self.cache.tiers):
            return
        if self.prefetching is not None:
            if not self.prefetching.done():
                return
            if self.prefetching.exception() is not None:  # the request loads it itself; nothing is lost
                log.warning("lazyrag: prefetching from a tier failed", exc_info=self.prefetching.exception())
            self.prefetching = None
        window = list(itertools.islice(self.waiting, lookahead))
        newcomers = [req for req in window if req.id not in self._prefetched_for]
        self._prefetched_for = {req.id for req in window}
        keys: list[str] = []
        for req in newcomers:
            try:
                keys += self.planner[req.params.strategy].lookup_keys(req.layout)
            except ValueError:
                continue  # an unknown strategy: its request fails when it is planned
        keys = [k for k in dict.fromkeys(keys) if k not in self.cache]
        if keys:
            self.prefetching = self.cache.prefetch(keys)

    def _next_piece(self, req: Request) -> slice[int, int, int]:
        """Which of ``req``'s new prompt tokens it prefills in this step: all that are left, or the next
        ``long_prefill_tokens``."""
        plan, seq = _planned(req)
        limit = self.config.long_prefill_tokens or self.config.max_prefill_tokens
        return slice(seq.num_written, min(len(plan.new_ids), seq.num_written + limit))

    def pool_cannot_fit(self, req: Request) -> bool:
        """Whether the pool surely lacks room for the request's worst case: every chunk encoded
        (twice: a position-aware copy and its source) and all its own tokens."""
        shape = self.pool.shape
        layout = req.layout
        chunks = sum(shape.blocks_for(len(c)) for c in layout.chunk_ids)
        own = shape.blocks_for(layout.num_tokens + (0 if req.prompt_logits_only else req.params.max_new_tokens))
        return self.cache.available_blocks() < 2 * chunks + own

    def _plan(self, req: Request) -> None:
        """Look up, load or encode the prompt's segments and allocate the request's own blocks."""
        assert req.stage is RequestStage.WAITING, req.stage
        shape = self.pool.shape
        strategy, stats = self.planner[req.params.strategy], req.stats
        forwarded0, flushed0 = self.runner.tokens_forwarded, self.planner.batch.tokens_flushed
        t0 = self.clock()
        stats.queue_s = t0 - req.arrival
        plan = strategy.plan(req.layout)
        try:
            # prefix caching publishes the request's own blocks: they must lie on the prompt's block grid
            assert strategy.name != "prefix" or plan.new_start % shape.block_size == 0
            own = len(plan.new_ids) + (0 if req.prompt_logits_only else req.params.max_new_tokens)
            req.seq = SeqState(
                context=plan.context, blocks=self.cache.allocate(shape.blocks_for(own)), next_pos=plan.new_start
            )
        except BaseException:
            strategy.release(plan)
            raise
        req.plan = plan
        req.stage = RequestStage.PREFILLING  # it holds blocks and pins from here: ``_release`` gives them back
        stats.plan_s = self.clock() - t0
        # its own forwards while planning (not the step's batched encodes it flushed) and its share of that batch
        own_forwarded = self.runner.tokens_forwarded - forwarded0 - (self.planner.batch.tokens_flushed - flushed0)
        stats.tokens_prefilled = own_forwarded + len(plan.new_ids) + plan.tokens_encoded_ahead
        stats.chunks_hit, stats.chunks_missed, stats.tokens_context = (
            plan.chunks_hit,
            plan.chunks_missed,
            plan.tokens_context,
        )
        stats.tokens_recomputed, stats.recompute_cost = plan.tokens_recomputed, plan.recompute_cost
        encoded = (
            stats.tokens_prefilled - len(plan.new_ids) - plan.tokens_recomputed
        )  # chunks (and prefix) missed and encoded now
        stats.tokens_reused = max(0, plan.tokens_context - encoded)
        stats.prefix_tokens_reused = min(plan.prefix_tokens_reused, stats.tokens_reused)
        stats.chunk_tokens_reused = stats.tokens_reused - stats.prefix_tokens_reused
        if self.tokenizer is not None:
            req.detok = Detokenizer(self.tokenizer, req.params.stop)

    def _prefill(self, batch: list[Request]) -> Launched | None:
        """One forward over each request's next piece of prompt; the requests whose prompt it completes get their
        first token launched, the others wait in ``_partial`` for their next piece."""
        pieces = {id(r): _planned(r)[0].new_ids[self._next_piece(r)] for r in batch}

        def forward(rs: list[Request]) -> torch.Tensor:
            logits = self.runner.prefill([_seq(r) for r in rs], [pieces[id(r)] for r in rs])
            assert logits is not None  # prefill's logits=True
            return logits

        done, logits = self._forward_isolated(batch, forward)
        self.steps["prefill"] += 1
        if not done:
            return None
        assert logits is not None  # a row for each request in ``done``
        kept = []  # indices into ``done`` of the requests whose plans finished
        for i, r in enumerate(done):
            plan, seq = _planned(r)
            if seq.num_written < len(plan.new_ids):
                self._partial.append(r)
                continue
            try:
                self.planner[r.params.strategy].finish(plan, seq)
            except Exception as e:
                self._fail(r, e)
                continue
            kept.append(i)
            if not r.prompt_logits_only:
                assert r.stage is RequestStage.PREFILLING, r.stage
                self.running.append(r)
                r.stage = RequestStage.DECODING
        if len(kept) < len(done):
            if not kept:
                return None
            logits = logits[torch.tensor(kept, dtype=torch.long, device=logits.device)]
        return launch_tokens([done[i] for i in kept], logits, self.runner.ops.greedy_tokens)

    def _decode(self) -> Launched | None:
        batch = list(self.running)
        done, logits = self._forward_isolated(
            batch, lambda rs: self.runner.decode([_seq(r) for r in rs], [r.last_token for r in rs])
        )
        self.steps["decode"] += 1
        if not done:
            return None
        assert logits is not None  # a row for each request in ``done``
        return launch_tokens(done, logits, self.runner.ops.greedy_tokens)

    def _can_chain(self, previous: Launched) -> bool:
        """Whether the next step is a decode of exactly ``previous``'s rows, each sure to want another token
        whatever ``previous`` gives it, so it can be launched on ``previous``'s device tokens before they are read."""
        return (
            self.async_scheduling
            and not self.waiting
            and not self._partial
            and len(previous.batch) == len(self.running)
            and all(r is q for r, q in zip(previous.batch, self.running))
            and all(
                r.params.plain_greedy and not r.aborted and len(_seq(r).generated) + 1 < r.params.max_new_tokens
                for r in previous.batch
            )
        )

    def _chain_decode(self, previous: Launched) -> Launched | None:
        """The decode step after ``previous``, launched on its device tokens; None if the launch failed (the
        caller then accepts ``previous`` and decodes as usual, which isolates a request at fault)."""
        batch = previous.batch
        try:
            logits = self.runner.decode([_seq(r) for r in batch], previous.tokens)
        except Exception as e:
            log.warning(
                "lazyrag: an async decode launch of %d requests failed (%r); decoding after the host has the tokens",
                len(batch),
                e,
            )
            return None
        self.steps["decode"] += 1
        return launch_tokens(batch, logits, self.runner.ops.greedy_tokens)

    def _forward_isolated(
        self, batch: list[Request], forward: Callable[[list[Request]], torch.Tensor]
    ) -> tuple[list[Request], torch.Tensor | None]:
        """The requests whose forward pass ran and their logits ``[B', V]`` (None when none ran). A failing batch runs
        again one request at a time, so only the request(s) at fault fail (sequence state moves only on success)."""
        try:
            return batch, forward(batch)  # [B, V]
        except Exception as e:
            if len(batch) == 1:
                self._fail(batch[0], e)
                return [], None
            log.warning(
                "lazyrag: a batched forward of %d requests failed (%r); running them one at a time", len(batch), e
            )
        done, rows = [], []
        for r in batch:
            try:
                rows.append(forward([r])[0].clone())  # a captured graph's logits buffer is refilled by the next run
                done.append(r)
            except Exception as e:
                self._fail(r, e)
        return done, torch.stack(rows) if rows else None

    def _accept(self, launched: Launched) -> None:
        """Read a launched step's tokens (sampling the rows that are not greedy) and apply end of turn, stop
        strings and the length limit; rows of requests that ended meanwhile are dropped."""
        live = [(i, r) for i, r in enumerate(launched.batch) if not r.stage.ended]
        if not live:
            return  # nothing to read: no need to wait for the device
        if launched.ready is not None:
            launched.ready.synchronize()
        greedy = launched.host_tokens.tolist()
        now = self.clock()
        for i, r in live:
            try:
                if r.prompt_logits_only:  # only ever in a prefill: it never joins the running batch
                    r.prompt_logits = launched.logits[i].float().cpu()
                    self._finish(r, "length")
                else:
                    self._accept_one(r, launched.logits[i], greedy[i], now)
            except Exception as e:  # e.g. a tokenizer that cannot decode the token: this request only
                self._fail(r, e)

    def _accept_one(self, r: Request, row: torch.Tensor, best: int, now: float) -> None:
        params, seq = r.params, _seq(r)
        if params.plain_greedy:  # the default path: the device's argmax, nothing else to do
            token = best
        else:  # penalties, top-k, top-p, temperature or logprobs: only these requests pay for them
            if params.repetition_penalty != 1.0 and r.penalty_ids is None:
                r.penalty_ids = torch.tensor(sorted(set(r.layout.full_ids())), dtype=torch.long)
            token = (
                best
                if params.temperature == 0 and not params.has_penalties
                else sample(row, params, r.generator, r.penalty_ids, seq.generated)
            )
        if r.first_token_at is None:
            r.first_token_at = now
        if token in self.end_tokens and not params.ignore_eos:
            self._finish(r, "stop")
            return
        if r.logprobs is not None:
            assert params.logprobs is not None  # r.logprobs is a list only with params.logprobs
            logprob, top = token_logprobs(row, token, params.logprobs)
            r.logprobs.append(TokenLogprob(token, logprob, top))
        seq.generated.append(token)
        r.last_token = token
        r.outputs.append((r.detok.push(token) if r.detok else "", token))
        if r.detok and r.detok.stopped:
            self._finish(r, "stop")
        elif len(seq.generated) >= r.params.max_new_tokens:
            self._finish(r, "length")
        else:
            self._notify(r)

    def _finish(self, req: Request, reason: str) -> None:
        if req.done:
            return
        if req.stage is RequestStage.DECODING:  # exactly the requests in the running batch
            self.running.remove(req)
        try:
            self._release(req)
            if req.detok:
                tail = req.detok.finish()
                if tail:
                    req.outputs.append((tail, -1))
        except Exception as e:
            log.exception("lazyrag: finishing request %d failed", req.id)
            if req.error is None:
                req.error, reason = e, "error"
        assert (req.error is not None) == (reason == "error"), (reason, req.error)
        req.stats.new_tokens = len(req.seq.generated) if req.seq else 0
        req.finish_reason, req.finished_at = reason, self.clock()
        req.stage = _END_STAGES.get(reason, RequestStage.FINISHED)  # last: another thread may read ``done`` now
        self._notify(req)

    def _notify(self, req: Request) -> None:
        if req.notify is None:
            return
        try:
            req.notify()
        except Exception:  # its consumer is gone (say its event loop closed): stop the request, nothing else
            log.debug("lazyrag: request %d's consumer cannot be notified; aborting it", req.id, exc_info=True)
            req.notify = None
            req.aborted = True

    def _fail(self, req: Request, error: BaseException) -> None:
        if req.done:
            return
        req.error = error
        self._finish(req, "error")

    def _release(self, req: Request) -> None:
        if req.seq is not None and req.seq.blocks:
            self.pool.decref(req.seq.blocks)
            req.seq.blocks = []
        if req.plan is not None:
            self.planner[req.params.strategy].release(req.plan)
