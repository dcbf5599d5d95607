"""Token sampling and incremental detokenization with stop strings."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past end-of-turn tokens (benchmarks with fixed output lengths)

    def __post_init__(self):
        # Checked here, before admission: a bad value would otherwise fail inside a batch of other requests.
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings; got {self.stop!r}")
        self.stop = [s for s in self.stop if s]
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, numbers.Integral) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer of at least 1; got {self.max_new_tokens!r}")
        self.max_new_tokens = int(self.max_new_tokens)
        if not _finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy); got {self.temperature!r}")
        if not _finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1]; got {self.top_p!r}")
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an integer or None; got {self.seed!r}")


def _finite_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] -> one token id (greedy at temperature 0, else temperature + nucleus sampling)."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits.float()
    # shifted so a tiny temperature gives -inf, never inf - inf = nan
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # always keeps the top token
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class Detokenizer:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Text that could still become a stop string, or an incomplete UTF-8 sequence, is held
    back until it is resolved.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                text, self.stopped = text[:i], True
        self.text = text
        if self.stopped:
            return self._flush(len(text))
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that is a prefix of a stop string
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._flush(safe)

    def finish(self) -> str:
        return self._flush(len(self.text.rstrip("\ufffd")))

    def _flush(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta
