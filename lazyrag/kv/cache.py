"""Content-addressed segments of KV in the block pool, with pinning and eviction.

A segment is a run of tokens whose KV lives in blocks it owns alone: a chunk, the shared
prefix, a position-aware copy of a chunk, or one block of a prefix-cache hash chain. The
cache holds one reference to each segment's blocks; a request pins the segments it reads,
and pinned segments are never evicted.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from lazyrag.kv.block_pool import BlockPool, OutOfBlocks


def content_key(*parts) -> str:
    """sha256 over the parts (strings and token-id lists), for content addressing."""
    h = hashlib.sha256()
    for p in parts:
        data = p.encode() if isinstance(p, str) else b",".join(str(int(t)).encode() for t in p)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@dataclass
class Segment:
    key: str
    blocks: list[int]
    num_tokens: int
    start: int  # position of its first token when its KV was computed
    kind: str = "chunk"
    pins: int = 0
    hits: int = 0
    meta: dict = field(default_factory=dict)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserted: int = 0


class SegmentCache:
    """Segments by content key; least-recently-used unpinned segments are evicted for space."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._segments: OrderedDict[str, Segment] = OrderedDict()
        self._lock = threading.RLock()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, key: str) -> bool:
        return key in self._segments

    def get(self, key: str, pin: bool = True) -> Segment | None:
        """The segment under ``key`` (pinned for the caller), or None; counts a hit or a miss."""
        with self._lock:
            seg = self._segments.get(key)
            if seg is None:
                self.stats.misses += 1
                return None
            self._segments.move_to_end(key)
            self.stats.hits += 1
            seg.hits += 1
            if pin:
                seg.pins += 1
            return seg

    def peek(self, key: str) -> Segment | None:
        return self._segments.get(key)

    def put(self, seg: Segment, pin: bool = True) -> Segment:
        """Adopt a segment whose blocks the caller allocated (their one reference passes to the cache)."""
        with self._lock:
            assert seg.key not in self._segments, f"segment {seg.key[:12]} cached twice"
            seg.pins += int(pin)
            self._segments[seg.key] = seg
            self.stats.inserted += 1
            return seg

    def unpin(self, seg: Segment) -> None:
        with self._lock:
            assert seg.pins > 0, "unpinned a segment that was not pinned"
            seg.pins -= 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Blocks from the pool, evicting unpinned segments (oldest use first) until they fit."""
        with self._lock:
            while self.pool.num_free < num_blocks:
                victim = next((s for s in self._segments.values() if s.pins == 0), None)
                if victim is None:
                    raise OutOfBlocks(
                        f"need {num_blocks} KV blocks but only {self.pool.num_free} are free and every cached "
                        "segment is in use; raise kv_budget or send fewer/shorter chunks per request."
                    )
                self.evict(victim.key)
            return self.pool.allocate(num_blocks)

    def evict(self, key: str) -> None:
        with self._lock:
            seg = self._segments.pop(key)
            assert seg.pins == 0, "evicting a pinned segment"
            self.pool.decref(seg.blocks)
            self.stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            for key in [k for k, s in self._segments.items() if s.pins == 0]:
                self.evict(key)
