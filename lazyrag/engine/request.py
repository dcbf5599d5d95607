"""What a request is: its sampling parameters (strategy included), its state in flight, its result,
and the plan that says where each part of its prompt's KV comes from (the scheduler-to-planner interface)."""

from __future__ import annotations

import enum
import functools
import itertools
import math
import numbers
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from lazyrag.defaults import MAX_LOGPROBS, MIN_REPETITION_PENALTY, MIN_TEMPERATURE, MIN_TOP_P, SEED_LIMIT
from lazyrag.engine.runner import Placement, SeqState
from lazyrag.engine.sampling import Detokenizer
from lazyrag.kv.cache import Segment
from lazyrag.prompt import PromptLayout
from lazyrag.strategy_names import check_strategy


@dataclass(frozen=True)
class SamplingParams:
    """Immutable once checked (a request in flight keeps what was validated): derive others with
    ``dataclasses.replace(params, temperature=...)``, which checks them again."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy, else at least MIN_TEMPERATURE
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # a string or a list of strings is accepted and kept as a tuple
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past end-of-turn tokens (benchmarks with fixed output lengths)
    strategy: str = "lazy"  # how the prompt's KV is obtained: engine/reuse.py, names in lazyrag/strategy_names.py
    # vLLM's knobs (OpenAI's semantics); at their defaults a request takes the plain greedy / nucleus path
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 = all
    repetition_penalty: float = 1.0  # HF / vLLM: tokens of the prompt and the answer so far, logit / p if > 0 else * p
    presence_penalty: float = 0.0  # OpenAI: minus this from every token generated at least once, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the answer so far, in [-2, 2]
    logprobs: int | None = None  # None = none; n = the chosen token's logprob and the n most likely (0..20) per token

    def __post_init__(self) -> None:
        # Checked here, before admission: a bad value would otherwise fail inside a batch of other requests.
        put = functools.partial(object.__setattr__, self)  # frozen: the checked values are set once, here
        put("stop", _stop_strings(self.stop))
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, numbers.Integral)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an integer of at least 1; got {self.max_new_tokens!r}")
        put("max_new_tokens", int(self.max_new_tokens))
        if not _finite_number(self.temperature) or not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number of at least {MIN_TEMPERATURE:g} (smaller "
                f"ones sample greedily anyway, and fail in float32); got {self.temperature!r}"
            )
        if not _finite_number(self.top_p) or not MIN_TOP_P <= self.top_p <= 1:
            raise ValueError(f"top_p must be a number in [{MIN_TOP_P:g}, 1]; got {self.top_p!r}")
        put("temperature", float(self.temperature))
        put("top_p", float(self.top_p))
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, numbers.Integral)
            or not 0 <= self.seed < SEED_LIMIT
        ):
            raise ValueError(f"seed must be None or an integer in [0, 2**63); got {self.seed!r}")
        check_strategy(self.strategy)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer of at least 1; got {self.top_k!r}")
        put("top_k", int(self.top_k))
        self._check_penalties(put)
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, numbers.Integral)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer from 0 to {MAX_LOGPROBS} (top logprobs per token); "
                f"got {self.logprobs!r}"
            )
        put("logprobs", None if self.logprobs is None else int(self.logprobs))

    def _check_penalties(self, put: Callable[[str, object], None]) -> None:
        """The repetition, presence and frequency penalties checked, and ``put`` as floats."""
        if not _finite_number(self.repetition_penalty) or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100:
            raise ValueError(
                f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, 100] (1 = off); got "
                f"{self.repetition_penalty!r}"
            )
        put("repetition_penalty", float(self.repetition_penalty))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off); got {value!r}")
            put(name, float(value))

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no knob that needs the logits row on the host: the device's argmax is the token."""
        return self.temperature == 0 and not self.has_penalties and self.logprobs is None


def _stop_strings(stop: object) -> tuple[str, ...]:
    """``stop`` (None, a string, or a list or tuple of strings) as a tuple of its non-empty strings."""
    strings = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"stop must be a string or a list of strings; got {stop!r}")
    return tuple(s for s in strings if s)


def _finite_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Plan:
    """Where a request's prompt KV comes from, as the planner (engine/reuse.py) made it: the placed
    cached segments its new tokens attend to, the new tokens, and what it pinned or allocated,
    which the scheduler hands back to the planner (``Strategy.release``) when the request ends."""

    context: list[Placement]
    new_ids: list[int]
    new_start: int  # position of the first new token
    pinned: list[Segment] = field(default_factory=list)
    chunks_hit: int = 0
    chunks_missed: int = 0
    tokens_context: int = 0  # prompt tokens read as placed context rather than computed in context
    block_keys: list[str] = field(default_factory=list)  # prefix caching: hash chain of the prompt's blocks
    owned_blocks: list[int] = field(default_factory=list)  # the request's recomputed tokens: freed with it
    tokens_recomputed: int = 0  # chunk tokens computed again in context (quality recovery)
    recompute_cost: float = 0.0  # its compute, in tokens through the whole model (blend: selection included)
    prefix_tokens_reused: int = 0  # the request's prefix tokens whose KV was found cached (not encoded now)
    # its misses' tokens left to the step's encode batch (computed with other requests' misses, counted as its own)
    tokens_encoded_ahead: int = 0


@dataclass
class RequestStats:
    strategy: str
    prompt_tokens: int = 0
    chunks_hit: int = 0
    chunks_missed: int = 0
    tokens_prefilled: int = 0  # tokens run through the model for this request, chunk encoding included
    tokens_context: int = (
        0  # prompt tokens read as placed context, not computed in context (cached, or encoded alone now)
    )
    tokens_reused: int = (
        0  # of those, the tokens whose KV was already in the cache (0 on a cold cache): usage's cache_read;
    )
    # = prefix_tokens_reused + chunk_tokens_reused (a cold request over new chunks still reuses the cached prefix)
    new_tokens: int = 0
    prefix_tokens_reused: int = 0  # of tokens_reused, the shared prompt prefix's (system prompt, chat template head)
    chunk_tokens_reused: int = (
        0  # of tokens_reused, the chunks' (and, for prefix caching, other prompt blocks'): the sum is tokens_reused
    )
    tokens_recomputed: int = 0  # chunk tokens computed again in context (quality recovery), part of tokens_prefilled
    recompute_cost: float = (
        0.0  # that recovery's compute in tokens through the whole model (blend's selection included)
    )
    plan_s: float = 0.0  # host time to look up, encode or copy the prompt's segments (TTFT minus prefill and sampling)
    queue_s: float = 0.0  # time from arrival until the scheduler took the request in

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    ttft_s: float
    total_s: float
    finish_reason: str  # "stop" (end of turn or stop string), "length", or "abort"
    stats: RequestStats = field(default_factory=lambda: RequestStats("lazy"))
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: one per token of token_ids


@dataclass
class TokenLogprob:
    """A generated token's log-probability (log_softmax of the model's raw logits, before penalties,
    temperature or top-k/top-p, as vLLM reports them) and the ``logprobs`` most likely tokens', best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class RequestStage(enum.Enum):
    """Where a request is in its life. The scheduler (engine/scheduler.py) moves it forward only, from any stage
    before an end to any end: WAITING -> PREFILLING -> DECODING, then FINISHED, ABORTED or FAILED."""

    WAITING = "waiting"  # queued (the scheduler's inbox or waiting queue): nothing planned, nothing held
    PREFILLING = "prefilling"  # planned, holding its blocks and pins; its prompt prefilled whole or in pieces
    DECODING = "decoding"  # in the running batch: its prompt prefilled, a token generated each step
    FINISHED = "finished"  # ended by an end token, a stop string or the length limit (prompt_logits_only: prefilled)
    ABORTED = "aborted"  # ended by an abort before it finished
    FAILED = "failed"  # ended by its error (``Request.error``)

    def __init__(self, value: str) -> None:
        # a member's attribute, not a property: the scheduler reads it for every row of every step
        self.ended = value in ("finished", "aborted", "failed")


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation in flight. The stepping thread appends to ``outputs`` and moves ``stage`` (to an end last, so
    that ``done`` tells another thread that the outputs are complete); the caller's thread drains ``outputs``
    ((text delta, token id); id -1 for a final text tail)."""

    layout: PromptLayout
    params: SamplingParams
    arrival: float
    prompt_logits_only: bool = False  # stop after the prefill and keep the logits (no sampling)
    notify: Callable[[], object] | None = None  # called after outputs or done change (from the stepping thread)
    id: int = field(default_factory=lambda: next(_ids))

    outputs: deque[tuple[str, int]] = field(default_factory=deque)
    stage: RequestStage = RequestStage.WAITING  # moved by the scheduler alone
    aborted: bool = False  # an abort asked for (any thread): the next step ends the request ABORTED unless it ended
    error: BaseException | None = None
    finish_reason: str = "length"
    prompt_logits: torch.Tensor | None = None  # [V] fp32 CPU, for prompt_logits_only
    stats: RequestStats = field(init=False)  # set in __post_init__
    first_token_at: float | None = None
    finished_at: float | None = None
    plan: Plan | None = None
    seq: SeqState | None = None
    last_token: int = -1
    detok: Detokenizer | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs, one per generated token
    penalty_ids: torch.Tensor | None = None  # with a repetition penalty: the prompt's distinct token ids
    tp_id: int = -1  # tensor parallelism: the id every rank knows this request by (engine/tensor_parallel.py)

    def __post_init__(self) -> None:
        self.stats = RequestStats(self.params.strategy, prompt_tokens=self.layout.num_tokens)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def done(self) -> bool:
        """Whether the request has ended (finished, aborted or failed): its outputs are all there."""
        return self.stage.ended

    def result(self) -> GenerationResult:
        if self.error is not None:
            raise self.error
        assert self.done, f"the request is still {self.stage.value}"
        assert self.finished_at is not None  # set before it ended
        text = self.detok.text if self.detok else ""
        ttft = (self.first_token_at if self.first_token_at is not None else self.finished_at) - self.arrival
        return GenerationResult(
            text,
            list(self.seq.generated) if self.seq else [],
            ttft,
            self.finished_at - self.arrival,
            self.finish_reason,
            self.stats,
            None if self.logprobs is None else list(self.logprobs),
        )
