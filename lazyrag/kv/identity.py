"""What cached KV depends on besides its tokens: the model, the KV layout, and the shared prefix chunks are
encoded after. KV made under one identity is useless under another (a corpus store checks it).

The content-key rule is here too: a chunk's cache key is ``content_key(model fingerprint, "chunk", prefix ids,
chunk ids)``, with ``"after", passage ids`` appended when it was encoded after an encoding passage too, and the
shared prefix's ``content_key(model fingerprint, "prefix", prefix ids)`` (``chunk_key`` and ``prefix_key``); the
keys of stores on disk were made by it, so it must not change."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class KVIdentity:
    model_fingerprint: str
    model_name: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    system_prompt: str
    prefix_ids: list[int]  # the shared encoding prefix every chunk is encoded after
    prefix_key: str
    passage_ids: list[int]  # the encoding passage chunks are encoded after, past the prefix ([] for none)
    encoding_passage: str  # its text ("" for none): what an engine is given to read a store (passage_ids decide)


def content_key(*parts: str | Sequence[int]) -> str:
    """sha256 over the parts (strings and token-id lists), for content addressing.

    Token ids are hashed as packed int64 in native byte order (the bytes of ``array("q", ids)``,
    which the keys of stores on disk were made with): a 2k-token prompt hashes in microseconds,
    where formatting each id as text took about a millisecond. ``struct.pack`` packs a list
    about twice as fast as ``array`` (a lazy request's six keys on the dev machine: 87 -> 59 µs).
    """
    h = hashlib.sha256()
    for p in parts:
        data = p.encode() if isinstance(p, str) else struct.pack(f"={len(p)}q", *p)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


_Frozen = tuple[str | tuple[int, ...], ...]  # a key's parts, token-id lists made tuples


class ContentKeyMemo:
    """``content_key`` remembered by the parts' values: a chunk recurs across requests, and packing and
    hashing its ids is on the way to the first token. A 512-token chunk's key (dev machine): ~10 µs to
    hash, ~5 µs to look up when the ids are the int objects seen before (token lists kept by the caller),
    ~9 µs when they are equal ones made anew (a tokenizer's output): comparing them is most of it.

    Entries are keyed by the parts frozen into tuples, so a list changed since is another entry, never
    a stale key (and the key is made from those same tuples). At most ``max_tokens`` token ids are held,
    ~36 bytes each; the oldest entries leave first (a hot chunk that leaves costs one hash to come back).
    """

    def __init__(self, max_tokens: int = 1 << 20):
        self.max_tokens = max_tokens
        self._keys: dict[_Frozen, str] = {}
        self._tokens = 0
        self._lock = threading.Lock()  # for changes; a look-up is one dict read

    def __len__(self) -> int:
        return len(self._keys)

    def __call__(self, *parts: str | Sequence[int]) -> str:
        frozen: _Frozen = tuple(p if isinstance(p, str) else tuple(p) for p in parts)
        key = self._keys.get(frozen)
        if key is None:
            key = content_key(*frozen)
            self._remember(frozen, key)
        return key

    def _remember(self, frozen: _Frozen, key: str) -> None:
        tokens = _num_ids(frozen)
        with self._lock:
            if frozen in self._keys or tokens > self.max_tokens:
                return
            while self._tokens + tokens > self.max_tokens:
                oldest = next(iter(self._keys))  # dicts keep insertion order
                del self._keys[oldest]
                self._tokens -= _num_ids(oldest)
            self._keys[frozen] = key
            self._tokens += tokens


def _num_ids(frozen: _Frozen) -> int:
    return sum(len(p) for p in frozen if not isinstance(p, str))


_content_keys = ContentKeyMemo()  # one for every strategy and engine: a key depends on the content alone


def prefix_key(fingerprint: str, prefix_ids: list[int]) -> str:
    """The cache key of the shared encoding prefix under the model with this fingerprint."""
    return _content_keys(fingerprint, "prefix", prefix_ids)


def chunk_key(fingerprint: str, prefix_ids: list[int], chunk_ids: list[int], passage_ids: Sequence[int] = ()) -> str:
    """The cache key of a chunk's KV: its token ids, encoded after ``prefix_ids`` (and ``passage_ids``), under the
    model with this fingerprint (its position in a prompt is no part of it: the KV is position-free)."""
    if passage_ids:
        return _content_keys(fingerprint, "chunk", prefix_ids, chunk_ids, "after", passage_ids)
    return _content_keys(fingerprint, "chunk", prefix_ids, chunk_ids)
