"""Token sampling and incremental detokenization with stop strings."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, params, generator: torch.Generator | None) -> int:
    """logits: [V] -> one token id (greedy at temperature 0, else temperature + nucleus sampling);
    ``params``: a SamplingParams (its temperature and top_p)."""
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
