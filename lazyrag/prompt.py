"""Prompt layout: a RAG prompt as separately tokenized segments.

``[shared prefix][chunk 1]...[chunk n][question tail]``: the prefix is the chat template's
header, the system prompt and the opening of the user turn; the tail is the question,
the end of the user turn and the generation prompt. Each segment is tokenized on its own,
so a chunk's token ids never depend on its neighbours and its KV can be reused anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents in the user's message. "
    "Answer briefly, in a few words."
)
CONTEXT_HEADER = "Documents:\n\n"
_SPLIT = "\u2063LAZYRAG_USER_CONTENT\u2063"


@dataclass
class PromptLayout:
    prefix_ids: list[int]
    chunk_ids: list[list[int]]
    question_ids: list[int]
    chunk_texts: list[str] = field(default_factory=list)

    def full_ids(self) -> list[int]:
        ids = list(self.prefix_ids)
        for c in self.chunk_ids:
            ids += c
        return ids + list(self.question_ids)

    def chunk_starts(self) -> list[int]:
        """Position of each chunk's first token in the stitched prompt (padding takes no position)."""
        starts, pos = [], len(self.prefix_ids)
        for c in self.chunk_ids:
            starts.append(pos)
            pos += len(c)
        return starts

    @property
    def num_tokens(self) -> int:
        return len(self.prefix_ids) + sum(map(len, self.chunk_ids)) + len(self.question_ids)


class PromptBuilder:
    """Splits the model's chat template around the user's content to find the segments."""

    def __init__(self, tokenizer, system_prompt: str = DEFAULT_SYSTEM_PROMPT):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self._bos = self._needs_bos()

    def _needs_bos(self) -> list[int]:
        tok = self.tokenizer
        if tok.bos_token_id is None:
            return []
        with_special = tok("a", add_special_tokens=True).input_ids
        return [tok.bos_token_id] if with_special and with_special[0] == tok.bos_token_id else []

    def template_parts(self, system: str) -> tuple[str, str]:
        """Text of the prompt before and after the user's content."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": _SPLIT}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            head, tail = text.split(_SPLIT)
            return head, tail
        return f"{system}\n\n", "\nAnswer:"

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def chunk_text(self, chunk: str) -> str:
        return chunk.strip() + "\n\n"

    def encode_chunk(self, chunk: str) -> list[int]:
        return self.encode(self.chunk_text(chunk))

    def prefix_ids(self, system: str | None = None) -> list[int]:
        head, _ = self.template_parts(system or self.system_prompt)
        ids = self.encode(head + CONTEXT_HEADER)
        if self._bos and (not ids or ids[0] != self._bos[0]):
            ids = self._bos + ids
        return ids

    def question_ids(self, question: str, system: str | None = None) -> list[int]:
        _, tail = self.template_parts(system or self.system_prompt)
        return self.encode(f"Question: {question.strip()}{tail}")

    def build(self, question: str, chunks: list[str], system: str | None = None) -> PromptLayout:
        return PromptLayout(
            prefix_ids=self.prefix_ids(system),
            chunk_ids=[self.encode_chunk(c) for c in chunks],
            question_ids=self.question_ids(question, system),
            chunk_texts=list(chunks),
        )
