"""Token sampling and incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch


# what this module reads of request.py's SamplingParams and TokenLogprob (typed structurally: request.py imports this
# module)
class SamplingKnobs(Protocol):
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def has_penalties(self) -> bool: ...


class TokenLogprobView(Protocol):
    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> list[tuple[int, float]]: ...


def sample(
    logits: torch.Tensor,
    params: SamplingKnobs,
    generator: torch.Generator | None,
    prompt_ids: torch.Tensor | None = None,
    output_ids: list[int] | None = None,
) -> int:
    """logits: [V] -> one token id (greedy at temperature 0, else temperature, top-k and nucleus sampling);
    ``params``: a SamplingParams. Penalties (vLLM's order: before temperature and the filters) need
    ``output_ids`` (the tokens generated so far) and, for the repetition penalty, ``prompt_ids`` (the
    prompt's distinct token ids)."""
    if params.has_penalties:
        logits = apply_penalties(logits, params, prompt_ids, output_ids or [])
    if params.temperature == 0:
        return int(logits.argmax())  # top-k and top-p never drop the most likely token
    logits = logits.float()
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # shifted so a tiny temperature gives -inf, never inf - inf = nan
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # always keeps the top token
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def apply_penalties(
    logits: torch.Tensor, params: SamplingKnobs, prompt_ids: torch.Tensor | None, output_ids: list[int]
) -> torch.Tensor:
    """A penalized copy of ``logits`` [V] (fp32), as vLLM: the repetition penalty (HF's: a seen token's logit
    divided by it when positive, multiplied when not) over the prompt's and the answer's tokens, then OpenAI's
    frequency (times the token's count in the answer) and presence (once per token in the answer) penalties."""
    logits = logits.float().clone()
    out = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
    if params.repetition_penalty != 1.0:
        seen = out if prompt_ids is None else torch.cat([prompt_ids.to(logits.device), out])
        if seen.numel():
            seen = seen.unique()
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and out.numel():
        counts = torch.bincount(out, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """(the token's logprob, the ``n`` most likely (id, logprob), best first) from the raw logits [V]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if n:
        values, ids = torch.topk(lp, min(n, lp.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), top


# -- logprobs as OpenAI reports them (the server's responses, and ChatOpenAI's format in the LangChain adapter) --


def logprob_entries(
    tokenizer: Any, logprobs: Sequence[TokenLogprobView]
) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token text, logprob, [(top token text, logprob)]) per generated token (a result's TokenLogprobs)."""

    def text(token_id: int) -> str:
        decoded: str = tokenizer.decode([token_id])
        return decoded

    return [(text(lp.token_id), lp.logprob, [(text(t), v) for t, v in lp.top]) for lp in logprobs]


def openai_chat_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]]) -> dict[str, Any]:
    """OpenAI's chat ``choices[i].logprobs["content"]`` from ``logprob_entries``."""

    def one(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(tt, tlp) for tt, tlp in top]} for t, lp, top in entries]}


def openai_completion_logprobs(
    entries: list[tuple[str, float, list[tuple[str, float]]]], offset: int = 0
) -> dict[str, Any]:
    """OpenAI's completions ``choices[i].logprobs``; ``offset``: the text offset of the first token."""
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


class Detokenizer:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Text that could still become a stop string, or an incomplete UTF-8 sequence, is held
    back until it is resolved.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]):  # a transformers tokenizer (its decode)
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text: str = self.tokenizer.decode(self.ids, skip_special_tokens=True)
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
