"""Continuous batching: many requests in flight over one model, one KV pool and one chunk cache.

Each ``step`` is one forward pass, with vLLM's prefill-first policy: requests that arrived
are planned (their missing chunks looked up, loaded or encoded) and their new tokens
prefilled together in one batch; when none is waiting, every running request decodes one
token, all in one batch. Requests join and leave between steps, so a long answer never
holds up a new question, and requests over the same chunks share one copy of their KV.

The scheduler is not thread-safe: one thread at a time calls ``step`` (the engine's lock).
``add`` and ``abort`` may be called from any thread at any time.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from lazyrag.kv.block_pool import OutOfBlocks
from lazyrag.kv.strategies import Plan, Strategy
from lazyrag.model.runner import ModelRunner, SeqState
from lazyrag.prompt import PromptLayout
from lazyrag.sampling import Detokenizer, SamplingParams, sample


@dataclass
class RequestStats:
    strategy: str
    prompt_tokens: int = 0
    chunks_hit: int = 0
    chunks_missed: int = 0
    tokens_prefilled: int = 0  # tokens run through the model for this request, chunk encoding included
    tokens_reused: int = 0  # prompt tokens whose KV was not computed in context (cached, or encoded position-free now)
    tokens_cached: int = 0  # of those, the tokens whose KV was already in the cache (0 on a cold cache): usage's cache_read
    new_tokens: int = 0
    tokens_recomputed: int = 0  # chunk tokens computed again in context (quality recovery), part of tokens_prefilled
    recompute_cost: float = 0.0  # that recovery's compute in tokens through the whole model (blend's selection included)
    plan_s: float = 0.0  # host time to look up, encode or copy the prompt's segments (TTFT minus prefill and sampling)
    queue_s: float = 0.0  # time from arrival until the scheduler took the request in

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    ttft_s: float
    total_s: float
    finish_reason: str  # "stop" (end of turn or stop string), "length", or "abort"
    stats: RequestStats = field(default_factory=lambda: RequestStats("lazy"))


@dataclass
class SchedulerConfig:
    max_running: int = 64  # sequences in flight (decoding) at once
    max_prefill_tokens: int = 8192  # new tokens in one prefill batch (a longer single prompt still runs alone)


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation in flight. The stepping thread appends to ``outputs`` and sets ``done``;
    the caller's thread drains ``outputs`` ((text delta, token id); id -1 for a final text tail)."""

    layout: PromptLayout
    params: SamplingParams
    strategy: Strategy
    arrival: float
    prompt_logits_only: bool = False  # stop after the prefill and keep the logits (no sampling)
    notify: Callable[[], None] | None = None  # called after outputs or done change (from the stepping thread)
    id: int = field(default_factory=lambda: next(_ids))

    outputs: deque = field(default_factory=deque)
    done: bool = False
    aborted: bool = False
    error: BaseException | None = None
    finish_reason: str = "length"
    prompt_logits: torch.Tensor | None = None  # [V] fp32 CPU, for prompt_logits_only
    stats: RequestStats | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    plan: Plan | None = None
    seq: SeqState | None = None
    last_token: int = -1
    detok: Detokenizer | None = None
    generator: torch.Generator | None = None

    def __post_init__(self):
        self.stats = RequestStats(self.strategy.name, prompt_tokens=self.layout.num_tokens)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def result(self) -> GenerationResult:
        if self.error is not None:
            raise self.error
        assert self.done, "the request is still running"
        text = self.detok.text if self.detok else ""
        ttft = (self.first_token_at if self.first_token_at is not None else self.finished_at) - self.arrival
        return GenerationResult(text, list(self.seq.generated) if self.seq else [], ttft, self.finished_at - self.arrival,
                                self.finish_reason, self.stats)


class Scheduler:
    def __init__(self, runner: ModelRunner, tokenizer, end_tokens: set[int], config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.runner, self.tokenizer, self.end_tokens = runner, tokenizer, end_tokens
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.pool = runner.pool
        self.inbox: deque[Request] = deque()  # added by any thread, taken in by ``step``
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
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
        while self.inbox:
            self.waiting.append(self.inbox.popleft())
        self._drop_aborted()
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
            return True
        if self.running:
            self._decode()
            return True
        return False

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
            if (self.running or batch) and self.pool_cannot_fit(req):
                break  # planning now would encode its chunks only to fail for blocks and throw them away
            try:
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
        return req.strategy.cache.available_blocks() < 2 * chunks + own

    def _plan(self, req: Request) -> None:
        """Look up, load or encode the prompt's segments and allocate the request's own blocks."""
        bs = self.pool.shape.block_size
        strategy, stats = req.strategy, req.stats
        forwarded0 = self.runner.tokens_forwarded
        t0 = self.clock()
        stats.queue_s = t0 - req.arrival
        plan = strategy.plan(req.layout)
        try:
            # prefix caching publishes the request's own blocks: they must lie on the prompt's block grid
            assert strategy.name != "prefix" or plan.new_start % bs == 0
            own = len(plan.new_ids) + (0 if req.prompt_logits_only else req.params.max_new_tokens)
            req.seq = SeqState(context=plan.context, blocks=strategy.cache.allocate(-(-own // bs)), next_pos=plan.new_start)
        except BaseException:
            strategy.release(plan)
            raise
        req.plan = plan
        stats.plan_s = self.clock() - t0
        stats.tokens_prefilled = self.runner.tokens_forwarded - forwarded0 + len(plan.new_ids)
        stats.chunks_hit, stats.chunks_missed, stats.tokens_reused = plan.chunks_hit, plan.chunks_missed, plan.tokens_reused
        stats.tokens_recomputed, stats.recompute_cost = plan.tokens_recomputed, plan.recompute_cost
        encoded = stats.tokens_prefilled - len(plan.new_ids) - plan.tokens_recomputed  # chunks (and prefix) missed and encoded now
        stats.tokens_cached = max(0, plan.tokens_reused - encoded)
        if self.tokenizer is not None:
            req.detok = Detokenizer(self.tokenizer, req.params.stop)

    def _prefill(self, batch: list[Request]) -> None:
        try:
            logits = self.runner.prefill([r.seq for r in batch], [r.plan.new_ids for r in batch])  # [B, V]
        except Exception as e:
            for r in batch:
                self._fail(r, e)
            return
        self.steps["prefill"] += 1
        for r in batch:
            r.strategy.finish(r.plan, r.seq)
        self.running.extend(r for r in batch if not r.prompt_logits_only)
        for r, row in zip(batch, logits):
            if r.prompt_logits_only:
                r.prompt_logits = row.float().cpu()
                self._finish(r, "length")
        self._accept([r for r in batch if not r.prompt_logits_only], logits[[not r.prompt_logits_only for r in batch]])

    def _decode(self) -> None:
        batch = list(self.running)
        try:
            logits = self.runner.decode([r.seq for r in batch], [r.last_token for r in batch])  # [B, V]
        except Exception as e:
            for r in batch:
                self._fail(r, e)
            return
        self.steps["decode"] += 1
        self._accept(batch, logits)

    def _accept(self, batch: list[Request], logits: torch.Tensor) -> None:
        """Sample each request's next token and apply end of turn, stop strings and the length limit."""
        if not batch:
            return
        greedy = logits.argmax(-1).tolist()  # one device sync for the whole batch
        now = self.clock()
        for r, row, best in zip(batch, logits, greedy):
            token = best if r.params.temperature == 0 else sample(row, r.params, r.generator)
            if r.first_token_at is None:
                r.first_token_at = now
            if token in self.end_tokens and not r.params.ignore_eos:
                self._finish(r, "stop")
                continue
            r.seq.generated.append(token)
            r.last_token = token
            r.outputs.append((r.detok.push(token) if r.detok else "", token))
            if r.detok and r.detok.stopped:
                self._finish(r, "stop")
            elif len(r.seq.generated) >= r.params.max_new_tokens:
                self._finish(r, "length")
            elif r.notify:
                r.notify()

    def _finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        if req.detok:
            tail = req.detok.finish()
            if tail:
                req.outputs.append((tail, -1))
        req.stats.new_tokens = len(req.seq.generated) if req.seq else 0
        req.finish_reason, req.finished_at, req.done = reason, self.clock(), True
        if req.notify:
            req.notify()

    def _fail(self, req: Request, error: BaseException) -> None:
        req.error = error
        self._finish(req, "error")

    def _release(self, req: Request) -> None:
        if req.seq is not None and req.seq.blocks:
            self.pool.decref(req.seq.blocks)
            req.seq.blocks = []
        if req.plan is not None:
            req.strategy.release(req.plan)
