"""Continuous batching: many requests in flight over one model, one KV pool and one chunk cache.

The scheduler owns the cache: it admits a request when the pool can hold it, asks the
planner (engine/reuse.py) for the request's ``Plan``, runs the model, and hands the plan
back to the planner when the request ends.

Each ``step`` is one forward pass, with vLLM's prefill-first policy: requests that arrived
are planned (their missing chunks looked up, loaded or encoded) and their new tokens
prefilled together in one batch; when none is waiting, every running request decodes one
token, all in one batch. Requests join and leave between steps, so a long answer never
holds up a new question, and requests over the same chunks share one copy of their KV.

The scheduler is not thread-safe: one thread at a time calls ``step`` (the engine's lock).
``add`` and ``abort`` may be called from any thread at any time.

Faults stay with their request: an exception while planning, running the model, sampling
or notifying a consumer fails (or, for a consumer gone away, aborts) only the request(s) it
belongs to, which give back their blocks and pins; a batch whose forward pass fails is run
again one request at a time to find them. ``step`` itself never raises for a request's fault.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import torch

from lazyrag.engine.config import SchedulerConfig
from lazyrag.engine.request import Request
from lazyrag.engine.reuse import Planner
from lazyrag.engine.runner import ModelRunner, SeqState
from lazyrag.engine.sampling import Detokenizer, sample
from lazyrag.kv.block_pool import OutOfBlocks
from lazyrag.kv.cache import CacheManager

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: CacheManager, planner: Planner, tokenizer, end_tokens: set[int],
                 config: SchedulerConfig | None = None, clock: Callable[[], float] = time.perf_counter):
        self.runner, self.cache, self.planner = runner, cache, planner
        self.tokenizer, self.end_tokens = tokenizer, end_tokens
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.pool = cache.pool
        self.inbox: deque[Request] = deque()  # added by any thread, taken in by ``step``
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._prefilling: list[Request] = []
        self.steps = {"prefill": 0, "decode": 0}

    # -- any thread ---------------------------------------------------------------------------

    def add(self, req: Request) -> Request:
        self.inbox.append(req)
        return req

    def abort(self, req: Request) -> None:
        """Stop a request (its consumer went away); its blocks and pins are given back at the next step."""
        req.aborted = True

    def has_work(self) -> bool:
        return bool(self.inbox or self.waiting or self.running)

    # -- the stepping thread --------------------------------------------------------------------

    def step(self) -> bool:
        """One forward pass: prefill the requests that can start, else decode all running ones.
        Returns False when there was nothing to do."""
        try:
            while self.inbox:
                self.waiting.append(self.inbox.popleft())
            self._drop_aborted()
            self._prefilling = self._admit()  # out of waiting, not yet running
            if self._prefilling:
                self._prefill(self._prefilling)
                self._prefilling = []
                return True
            if self.running:
                self._decode()
                return True
            return False
        except Exception as e:  # a fault no single request owns (a bug): fail those in flight rather than hang them
            log.exception("lazyrag scheduler step failed; failing the requests in flight")
            for req in list(self.waiting) + self.running + self._prefilling:
                self._fail(req, e)
            self.waiting.clear()
            self._prefilling = []
            return True

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
        for req in [r for r in self.running if r.aborted]:
            self._finish(req, "abort")

    def _admit(self) -> list[Request]:
        """Plan waiting requests in arrival order while the batch, the token budget and the pool allow."""
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.config.max_running:
            req = self.waiting[0]
            new_tokens = len(req.layout.question_ids)  # a lower bound before planning (full and prefix add more)
            if batch and tokens + new_tokens > self.config.max_prefill_tokens:
                break
            try:
                if (self.running or batch) and self.pool_cannot_fit(req):
                    break  # planning now would encode its chunks only to fail for blocks and throw them away
                self._plan(req)
            except OutOfBlocks as e:
                if self.running or batch:
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
            tokens += len(req.plan.new_ids)
        return batch

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
        shape = self.pool.shape
        strategy, stats = self.planner[req.params.strategy], req.stats
        forwarded0 = self.runner.tokens_forwarded
        t0 = self.clock()
        stats.queue_s = t0 - req.arrival
        plan = strategy.plan(req.layout)
        try:
            # prefix caching publishes the request's own blocks: they must lie on the prompt's block grid
            assert strategy.name != "prefix" or plan.new_start % shape.block_size == 0
            own = len(plan.new_ids) + (0 if req.prompt_logits_only else req.params.max_new_tokens)
            req.seq = SeqState(context=plan.context, blocks=self.cache.allocate(shape.blocks_for(own)), next_pos=plan.new_start)
        except BaseException:
            strategy.release(plan)
            raise
        req.plan = plan
        stats.plan_s = self.clock() - t0
        stats.tokens_prefilled = self.runner.tokens_forwarded - forwarded0 + len(plan.new_ids)
        stats.chunks_hit, stats.chunks_missed, stats.tokens_context = plan.chunks_hit, plan.chunks_missed, plan.tokens_context
        stats.tokens_recomputed, stats.recompute_cost = plan.tokens_recomputed, plan.recompute_cost
        encoded = stats.tokens_prefilled - len(plan.new_ids) - plan.tokens_recomputed  # chunks (and prefix) missed and encoded now
        stats.tokens_reused = max(0, plan.tokens_context - encoded)
        if self.tokenizer is not None:
            req.detok = Detokenizer(self.tokenizer, req.params.stop)

    def _prefill(self, batch: list[Request]) -> None:
        done, logits = self._forward_isolated(batch, lambda rs: self.runner.prefill([r.seq for r in rs], [r.plan.new_ids for r in rs]))
        self.steps["prefill"] += 1
        if not done:
            return
        sampled = []  # indices into ``done`` of the requests that go on to decode
        for i, (r, row) in enumerate(zip(done, logits)):
            try:
                self.planner[r.params.strategy].finish(r.plan, r.seq)
                if r.prompt_logits_only:
                    r.prompt_logits = row.float().cpu()
            except Exception as e:
                self._fail(r, e)
                continue
            if r.prompt_logits_only:
                self._finish(r, "length")
            else:
                self.running.append(r)
                sampled.append(i)
        if len(sampled) < len(done):
            logits = logits[torch.tensor(sampled, dtype=torch.long, device=logits.device)]
        self._accept([done[i] for i in sampled], logits)

    def _decode(self) -> None:
        batch = list(self.running)
        self._accept(*self._forward_isolated(batch, lambda rs: self.runner.decode([r.seq for r in rs], [r.last_token for r in rs])))
        self.steps["decode"] += 1

    def _forward_isolated(self, batch: list[Request], forward: Callable[[list[Request]], torch.Tensor]) -> tuple[list[Request], torch.Tensor]:
        """The requests whose forward pass ran and their logits ``[B', V]``. A failing batch runs again one
        request at a time, so only the request(s) at fault fail (sequence state moves only on success)."""
        try:
            return batch, forward(batch)  # [B, V]
        except Exception as e:
            if len(batch) == 1:
                self._fail(batch[0], e)
                return [], None
            log.warning("lazyrag: a batched forward of %d requests failed (%r); running them one at a time", len(batch), e)
        done, rows = [], []
        for r in batch:
            try:
                rows.append(forward([r])[0])
                done.append(r)
            except Exception as e:
                self._fail(r, e)
        return done, torch.stack(rows) if rows else None

    def _accept(self, batch: list[Request], logits: torch.Tensor | None) -> None:
        """Sample each request's next token (``logits`` [B, V]) and apply end of turn, stop strings and the length limit."""
        if not batch:
            return
        greedy = self.runner.ops.argmax_rows(logits)  # one device sync for the whole batch
        now = self.clock()
        for r, row, best in zip(batch, logits, greedy):
            try:
                self._accept_one(r, row, best, now)
            except Exception as e:  # e.g. a tokenizer that cannot decode the token: this request only
                self._fail(r, e)

    def _accept_one(self, r: Request, row: torch.Tensor, best: int, now: float) -> None:
        token = best if r.params.temperature == 0 else sample(row, r.params, r.generator)
        if r.first_token_at is None:
            r.first_token_at = now
        if token in self.end_tokens and not r.params.ignore_eos:
            self._finish(r, "stop")
            return
        r.seq.generated.append(token)
        r.last_token = token
        r.outputs.append((r.detok.push(token) if r.detok else "", token))
        if r.detok and r.detok.stopped:
            self._finish(r, "stop")
        elif len(r.seq.generated) >= r.params.max_new_tokens:
            self._finish(r, "length")
        else:
            self._notify(r)

    def _finish(self, req: Request, reason: str) -> None:
        if req.done:
            return
        if req in self.running:
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
        req.stats.new_tokens = len(req.seq.generated) if req.seq else 0
        req.finish_reason, req.finished_at, req.done = reason, self.clock(), True
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
