"""Prompt layout: a RAG prompt as separately tokenized segments.

``[shared prefix][chunk 1]...[chunk n][question tail]``: the prefix is the chat template's
header, the system prompt and the opening of the user turn; the tail is the question,
the end of the user turn and the generation prompt. Each segment is tokenized on its own,
so a chunk's token ids never depend on its neighbours and its KV can be reused anywhere.
"""

from __future__ import annotations

import hashlib
import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents in the user's message. "
    "Answer briefly, in a few words."
)
CONTEXT_HEADER = "Documents:\n\n"
# Every chunk is encoded after the prefix and this passage, so that its KV is computed as if other documents came
# first, as they do for four of five chunks in a full prefill; requests never read the passage (its KV is rotated
# away, engine/reuse.py). Made-up prose about nothing a question asks, in the register of retrieved passages: three
# short documents, about a full prefill's mean distance from a chunk back to the prefix. Measured (issue 30,
# benchmarks/NOTES.md "The encoding passage"): lazy's KL to full prefill about halved at no recompute; three
# documents beat one on every set.
DEFAULT_ENCODING_PASSAGE = "\n\n".join(
    [
        "Harlow Fen is a wetland on the lower course of the River Aske. It was drained in part during the eighteenth "
        "century, when a pumping station and several miles of embankment were built, and the land was farmed until the "
        "1950s. Today it is a nature reserve known for its reed beds and wading birds.",
        "The Corran Line was a narrow-gauge railway that carried slate from the quarries above Tallow Bridge to the "
        "harbour at Penmere. It opened in 1871 with two steam locomotives, added a passenger service in the 1890s, and "
        "closed when the last quarry shut. Parts of the trackbed are now a footpath.",
        "Maren Osk was a painter of coastal scenes who worked mostly in watercolour. She trained in a provincial art "
        "school, exhibited in small galleries for thirty years, and kept notebooks of tides and weather beside her "
        "sketches. A collection of her work is held by a regional museum.",
    ]
)
_SPLIT = "\u2063LAZYRAG_USER_CONTENT\u2063"


def passage_label(passage: str | None) -> str:
    """How reports name an engine's encoding passage: none, default, or custom-<first 8 hex of its sha256>."""
    if not passage:
        return "none"
    return "default" if passage == DEFAULT_ENCODING_PASSAGE else "custom-" + passage_sha256(passage)[:8]


def passage_sha256(passage: str | None) -> str:
    """The passage's text as a hash (empty for none): what a label cannot tell apart, e.g. two releases' defaults."""
    return hashlib.sha256(passage.encode()).hexdigest() if passage else ""


@dataclass
class PromptLayout:
    prefix_ids: list[int]
    chunk_ids: list[list[int]]
    question_ids: list[int]
    chunk_texts: list[str] = field(default_factory=list)
    # Chunks' KV is computed after this prefix; None = the request's own prefix (the usual case).
    encoding_prefix_ids: list[int] | None = None

    @property
    def encoding_prefix(self) -> list[int]:
        return self.prefix_ids if self.encoding_prefix_ids is None else self.encoding_prefix_ids

    def full_ids(self) -> list[int]:
        ids = list(self.prefix_ids)
        for c in self.chunk_ids:
            ids += c
        return ids + list(self.question_ids)

    def chunk_starts(self) -> list[int]:
        """Position of each chunk's first token in the stitched prompt (padding takes no position).

        Contiguous after the prefix; only a request prefix shorter than the encoding prefix
        leaves a gap, so that no chunk is read at a position before where it was encoded.
        """
        starts, pos = [], max(len(self.prefix_ids), len(self.encoding_prefix))
        for c in self.chunk_ids:
            starts.append(pos)
            pos += len(c)
        return starts

    @property
    def question_start(self) -> int:
        return max(len(self.prefix_ids), len(self.encoding_prefix)) + sum(map(len, self.chunk_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.prefix_ids) + sum(map(len, self.chunk_ids)) + len(self.question_ids)


def check_text(value, what: str) -> str:
    """``value`` as prompt text, or a ValueError that names what is wrong with it."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string; got {type(value).__name__}.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a badly decoded file or JSON "\\ud800"
        raise ValueError(
            f"{what} is not valid Unicode: character {e.start} is a lone surrogate "
            f"({value[e.start]!r}); decode the source text with errors='replace'."
        ) from None
    return value


def check_chunks(chunks) -> list[str]:
    """The chunks as a list of strings, or a ValueError that says what was passed instead."""
    if isinstance(chunks, (str, bytes)):
        raise ValueError(
            "chunks must be a list of strings, not a single string (it would be read one "
            "character per chunk); wrap it: [text]."
        )
    if chunks is None:
        raise ValueError("chunks must be a list of strings; got None (pass [] for no context).")
    if isinstance(chunks, (set, frozenset)):
        raise ValueError(
            f"chunks must be a list of strings, not a {type(chunks).__name__}: a set's order can change "
            "between runs, and the chunks' order is the prompt's; pass a list (sorted(...) if any order will do)."
        )
    if isinstance(chunks, Mapping):
        raise TypeError(
            f"chunks must be a list of strings, not a {type(chunks).__name__} (iterating it would read its "
            "keys as the chunks); pass the texts as a list: list(d.values()) or [text, ...]."
        )
    try:
        chunks = list(chunks)
    except TypeError:
        raise ValueError(f"chunks must be a list of strings; got {type(chunks).__name__}.") from None
    return [check_text(c, f"chunk {i}") for i, c in enumerate(chunks)]


def check_layout(layout: "PromptLayout", vocab_size: int) -> None:
    """A layout the model can run: token ids inside the vocabulary, a prefix and a question to prefill.
    Checked before admission, since a bad id would fail inside a batch of other requests."""
    for name in ("prefix_ids", "question_ids"):
        setattr(layout, name, _token_ids(getattr(layout, name), name.replace("_ids", ""), vocab_size))
    if not layout.prefix_ids:
        raise ValueError(
            "The prompt layout has no prefix tokens; build it with engine.build_prompt or layout_from_text."
        )
    if not layout.question_ids:
        raise ValueError(
            "The prompt layout has no tokens after its last chunk (the question); nothing would be prefilled."
        )
    layout.chunk_ids = [_token_ids(c, f"chunk {i}", vocab_size) for i, c in enumerate(layout.chunk_ids)]
    if layout.encoding_prefix_ids is not None:
        layout.encoding_prefix_ids = _token_ids(layout.encoding_prefix_ids, "encoding prefix", vocab_size)


def _token_ids(ids, what: str, vocab_size: int) -> list[int]:
    """``ids`` as a list of token ids in [0, vocab_size): as given when they are Python ints (the usual case, checked
    in C), else converted from any integer type (numpy's, torch's); a ValueError naming the bad value otherwise."""
    try:
        lo, hi = min(ids, default=0), max(ids, default=0)
        plain = type(lo) is int and type(hi) is int
    except (TypeError, ValueError):  # not numbers, or numpy / torch elements that min() cannot compare as one
        plain = False
    if not plain:
        try:
            ids = [operator.index(t) for t in ids]
        except TypeError:
            bad = next(t for t in ids if not hasattr(t, "__index__"))
            raise ValueError(
                f"The prompt layout's {what} holds {bad!r} ({type(bad).__name__}): token ids are integers."
            ) from None
        lo, hi = min(ids, default=0), max(ids, default=0)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"The prompt layout's {what} holds token id {lo if lo < 0 else hi}, outside the model's "
            f"vocabulary [0, {vocab_size})."
        )
    return ids if isinstance(ids, list) else list(ids)


class PromptBuilder:
    """Splits the model's chat template around the user's content to find the segments."""

    def __init__(
        self,
        tokenizer,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        encoding_passage: str | None = DEFAULT_ENCODING_PASSAGE,
    ):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.encoding_passage = encoding_passage or None
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
        return self._with_bos(self.encode(head + CONTEXT_HEADER))

    def passage_ids(self) -> list[int]:
        """Token ids of the encoding passage chunks are encoded after (besides the prefix); [] for none."""
        return self.encode_chunk(self.encoding_passage) if self.encoding_passage else []

    def question_text(self, question: str) -> str:
        return f"Question: {question.strip()}"

    def question_ids(self, question: str, system: str | None = None) -> list[int]:
        _, tail = self.template_parts(system or self.system_prompt)
        return self.encode(self.question_text(question) + tail)

    def user_content(self, question: str, chunks: list[str]) -> str:
        """The user turn's text of ``build(question, chunks)`` (prefix tail, chunks, question), for a caller
        that renders whole chat messages (the server): ``layout_from_text`` then finds the same segments."""
        return CONTEXT_HEADER + "".join(self.chunk_text(c) for c in chunks) + self.question_text(question)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Chat messages as prompt text (with the generation prompt unless told); a default system turn is added."""
        if not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}] + list(messages)
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        body = "\n\n".join(m["content"] for m in messages)
        return body + "\nAnswer:" if add_generation_prompt else body

    def _with_bos(self, ids: list[int]) -> list[int]:
        return self._bos + ids if self._bos and (not ids or ids[0] != self._bos[0]) else ids

    def split_text(self, text: str, found: list[tuple[int, int, str]]) -> PromptLayout:
        """A prompt with known chunks at ``found`` (start, end, chunk text) as a layout."""
        if found and not self._with_bos(self.encode(text[: found[0][0]])):
            found = found[1:]  # the strategies need a non-empty request prefix: a leading chunk becomes it
        if found and not self.encode(text[found[-1][1] :].lstrip()):
            found = found[:-1]  # and tokens after the last chunk to prefill: a trailing chunk becomes them
        if not found:  # nothing to reuse: the whole prompt is prefilled; its first token is the (non-empty) prefix
            ids = self._with_bos(self.encode(text))
            if not ids:
                raise ValueError("The prompt is empty.")
            if len(ids) == 1:
                raise ValueError(
                    f"The prompt {text!r} is a single token; lazyrag reads a prompt as a prefix and the "
                    "tokens after it, so it needs at least two (add a word, or send it as a chat message)."
                )
            return PromptLayout(prefix_ids=ids[:1], chunk_ids=[], question_ids=ids[1:])
        chunk_ids, texts, pos = [], [], found[0][0]
        for start, end, chunk in found:
            glue = text[pos:start].strip()
            if glue:  # e.g. a metadata line between retrieved chunks
                chunk_ids.append(self.encode_chunk(glue))
                texts.append(glue)
            chunk_ids.append(self.encode_chunk(chunk))
            texts.append(chunk)
            pos = end
        return PromptLayout(
            prefix_ids=self._with_bos(self.encode(text[: found[0][0]])),
            chunk_ids=chunk_ids,
            question_ids=self.encode(text[pos:].lstrip()),
            chunk_texts=texts,
            encoding_prefix_ids=self.prefix_ids(),
        )

    def build(self, question: str, chunks: list[str], system: str | None = None) -> PromptLayout:
        return PromptLayout(
            prefix_ids=self.prefix_ids(system),
            chunk_ids=[self.encode_chunk(c) for c in chunks],
            question_ids=self.question_ids(question, system),
            chunk_texts=list(chunks),
        )


PASTED_MIN_CHARS = 80  # a shorter paragraph (a heading, a "Question: ..." line) is not worth a cache entry
# a line that only separates: LlamaIndex's "---------------------" around the context, "=====", "***", "###"
_SEPARATOR_LINE = re.compile(r"^\s*([-=_*#~])\1{2,}\s*$")
_HEADING_LINE = re.compile(r"^\s*[\w ]{1,40}:\s*$")  # "Context:", "Documents:" right above the first passage


def pasted_passages(text: str, keep_last: bool = True, min_chars: int = PASTED_MIN_CHARS) -> list[str]:
    """The passages a user pasted into ``text``: its paragraphs, split where RAG prompts split retrieved texts
    (blank lines, as LangChain's stuffing chains and LlamaIndex's context join them; separator lines such
    as LlamaIndex's dashes; heading lines such as "Context:"), of at least ``min_chars`` characters.

    ``keep_last=False`` leaves the last paragraph out: in a message that ends with the question (every stock
    RAG template's last user turn, or a raw completion prompt) that paragraph holds it, and it must be
    computed in context, after the passages, not encoded on its own.
    """
    paragraphs, lines = [], []
    for line in text.split("\n"):
        if line.strip() and not _SEPARATOR_LINE.match(line) and not _HEADING_LINE.match(line):
            lines.append(line)
        elif lines:
            paragraphs.append("\n".join(lines).strip())
            lines = []
    if lines:
        paragraphs.append("\n".join(lines).strip())
    if not keep_last:
        paragraphs = paragraphs[:-1]
    return [p for p in dict.fromkeys(paragraphs) if len(p) >= min_chars]


class _Bucket:
    """The chunks that share one anchor, indexed again by a longer start so that many chunks with a common opening
    (metadata headers: "file_path: ...", "Title: ...") cost one lookup, not one comparison each. Readers take no
    lock: every change is one dict store or delete, or a new tuple in place of the old."""

    __slots__ = ("long", "short", "short_lengths", "_per_length")

    def __init__(self):
        self.long: dict[str, tuple[str, ...]] = {}  # the first LONG characters -> the texts opening so, longest first
        self.short: dict[str, None] = {}  # texts shorter than LONG
        self.short_lengths: tuple[int, ...] = ()  # their lengths, longest first
        self._per_length: dict[int, int] = {}  # how many short texts have each length

    def match(self, prompt: str, i: int, long: int) -> str | None:
        """The longest text of the bucket that ``prompt`` holds at ``i``."""
        for text in self.long.get(prompt[i : i + long], ()):
            if prompt.startswith(text, i):
                return text
        for n in self.short_lengths:
            if prompt[i : i + n] in self.short:
                return prompt[i : i + n]
        return None

    def texts(self) -> list[str]:
        return [t for group in list(self.long.values()) for t in group] + list(self.short)


class ChunkFinder:
    """Finds known chunk texts inside an arbitrary prompt string.

    Each chunk is indexed by its first ``anchor`` characters, and inside that by its first ``LONG`` characters; a
    scan looks up the anchor at every offset of the prompt (a dict lookup of a fixed-size slice), then the longer
    start, then verifies the whole chunk. Time is linear in the prompt's length, independent of how many chunks are
    indexed and of how many share an opening. Chunks shorter than the anchor are not worth a cache entry and are not
    found.

    It holds at most ``max_chunks`` texts, least recently added or found first out, so a process
    that sees new chunks forever (every retrieval registers its results) stays bounded.
    """

    MAX_CHUNKS = 1 << 17  # texts kept: a store's chunks and more (a few hundred MB of text at most)
    LONG = 256  # the second-level key: chunks that open with the same 256 characters are compared one by one

    def __init__(self, anchor: int = 24, max_chunks: int | None = None):
        self.anchor = anchor
        self.max_chunks = self.MAX_CHUNKS if max_chunks is None else max_chunks
        if self.max_chunks < 1:
            raise ValueError(f"max_chunks must be at least 1; got {max_chunks!r}")
        self._by_anchor: dict[str, _Bucket] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # every text held, least recently used first
        self._lock = threading.Lock()  # adapters register retrieved texts from other threads while prompts are split

    def __len__(self) -> int:
        return len(self._recent)

    def __contains__(self, text: str) -> bool:
        return text.strip() in self._recent

    def add(self, text: str) -> None:
        text = text.strip()
        if len(text) < self.anchor:
            return
        with self._lock:
            if text in self._recent:
                self._recent.move_to_end(text)
                return
            self._recent[text] = None
            self._rebucket(text, add=True)
            while len(self._recent) > self.max_chunks:
                self._rebucket(self._recent.popitem(last=False)[0], add=False)

    def _rebucket(self, text: str, add: bool) -> None:
        """Add ``text`` to its bucket, or remove it (then an empty bucket goes)."""
        key = text[: self.anchor]
        bucket = self._by_anchor.get(key)
        if bucket is None:
            bucket = self._by_anchor[key] = _Bucket()
        if len(text) >= self.LONG:
            start = text[: self.LONG]
            group = [t for t in bucket.long.get(start, ()) if t != text] + ([text] if add else [])
            if group:
                bucket.long[start] = tuple(sorted(group, key=len, reverse=True))  # longest match first
            else:
                bucket.long.pop(start, None)
        else:
            n, count = len(text), bucket._per_length
            if add:
                bucket.short[text] = None
                count[n] = count.get(n, 0) + 1
            elif bucket.short.pop(text, 0) is None:
                count[n] -= 1
                if not count[n]:
                    del count[n]
            if len(count) != len(bucket.short_lengths):  # a length came or went
                bucket.short_lengths = tuple(sorted(count, reverse=True))
        if not bucket.long and not bucket.short:
            del self._by_anchor[key]

    def find(self, prompt: str) -> list[tuple[int, int, str]]:
        """Non-overlapping (start, end, chunk text) occurrences, left to right."""
        found, i, a, n = [], 0, self.anchor, self.LONG
        lookup = self._by_anchor.get  # safe unlocked: a bucket changes by single dict stores and tuple swaps
        while i <= len(prompt) - a:
            bucket = lookup(prompt[i : i + a])
            if bucket is not None:
                text = bucket.match(prompt, i, n)
                if text is not None:
                    found.append((i, i + len(text), text))
                    i += len(text)
                    continue
            i += 1
        if found:
            with self._lock:
                for _, _, text in found:
                    if text in self._recent:
                        self._recent.move_to_end(text)
        return found
