"""Eviction policies and frequency-aware admission for the segment cache.

A policy only orders keys; the cache manager owns the segments, knows which are pinned
and asks the policy for victims in order. Policies are not thread-safe on their own: the
manager calls them under its lock.

* ``lru``: least recently used first (vLLM's stock policy; what the paper ran).
* ``lfu``: fewest uses first, ties by age.
* ``gdsf``: GreedyDual-Size-Frequency (Cherkasova 1998): priority = L + uses * cost / size,
  where cost is the segment's recompute cost, size its blocks, and L the priority of the
  last victim (so long-idle entries age out). Cheap-to-redo segments (a position-aware
  copy, a short chunk) go before expensive ones of the same size.

Admission (``FrequencySketch``, TinyLFU-style): every lookup is counted, resident or not;
a new entry is kept unless the entries it would evict were asked for more often.
Under a budget smaller than a prompt's working set, LRU evicts the hot documents to make
room for one-off ones; admission stops that churn.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Iterator


class EvictionPolicy:
    name = "base"

    def insert(self, key: str, size: int, cost: float) -> None:
        raise NotImplementedError

    def touch(self, key: str) -> None:
        raise NotImplementedError

    def remove(self, key: str) -> None:
        raise NotImplementedError

    def refresh(self, key: str) -> None:
        """Make ``key`` the most recent without counting a use (order of a request's release)."""
        self.touch(key)

    def victims(self) -> Iterator[str]:
        """Keys from first-to-evict onwards. The caller skips pinned keys and may stop early;
        it calls ``evicted`` for the one it removes (and ``remove`` after it)."""
        raise NotImplementedError

    def evicted(self, key: str) -> None:
        """Hook for aging (GDSF inflates L to the victim's priority)."""


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key: str, size: int, cost: float) -> None:
        self._order[key] = None

    def touch(self, key: str) -> None:
        self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def refresh(self, key: str) -> None:
        self._order.move_to_end(key)

    def victims(self) -> Iterator[str]:
        return iter(self._order)  # callers stop iterating before they evict


class _HeapPolicy(EvictionPolicy):
    """Min-heap of (priority, tick, key) with lazy deletion: stale entries are skipped on pop."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._prio: dict[str, tuple[float, int]] = {}
        self._uses: dict[str, int] = {}
        self._meta: dict[str, tuple[int, float]] = {}  # key -> (size, cost)
        self._tick = itertools.count()

    def priority(self, key: str) -> float:
        raise NotImplementedError

    def _push(self, key: str) -> None:
        entry = (self.priority(key), next(self._tick))
        self._prio[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 4 * len(self._prio) + 64:  # drop stale entries now and then
            self._heap = [(p, t, k) for k, (p, t) in self._prio.items()]
            heapq.heapify(self._heap)

    def insert(self, key: str, size: int, cost: float) -> None:
        self._uses[key] = 1
        self._meta[key] = (max(1, size), max(cost, 1e-12))
        self._push(key)

    def touch(self, key: str) -> None:
        self._uses[key] += 1
        self._push(key)

    def refresh(self, key: str) -> None:
        self._push(key)  # same priority, newer tick: the later of two ties to go

    def remove(self, key: str) -> None:
        for d in (self._prio, self._uses, self._meta):
            d.pop(key, None)

    def victims(self) -> Iterator[str]:
        # Pop in priority order; keys the caller skips (pinned) are pushed back afterwards.
        skipped: list[tuple[float, int, str]] = []
        try:
            while self._heap:
                p, t, key = heapq.heappop(self._heap)
                if self._prio.get(key) != (p, t):
                    continue  # stale
                skipped.append((p, t, key))
                yield key
        finally:
            for item in skipped:
                if self._prio.get(item[2]) == item[:2]:
                    heapq.heappush(self._heap, item)


class LFU(_HeapPolicy):
    name = "lfu"

    def priority(self, key: str) -> float:
        return float(self._uses[key])


class GDSF(_HeapPolicy):
    name = "gdsf"

    def __init__(self) -> None:
        super().__init__()
        self.inflation = 0.0  # L: priority of the last victim

    def priority(self, key: str) -> float:
        size, cost = self._meta[key]
        return self.inflation + self._uses[key] * cost / size

    def evicted(self, key: str) -> None:
        if key in self._prio:
            self.inflation = max(self.inflation, self._prio[key][0])


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {p.name: p for p in (LRU, LFU, GDSF)}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"Unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}.")
    return POLICIES[name]()


class FrequencySketch:
    """Access counts of every key asked for (resident or not), halved every ``window`` accesses.

    TinyLFU uses a count-min sketch to bound memory; the key sets here (chunks of a corpus)
    are small enough for an exact dict, which also makes decisions reproducible in tests.
    Halving keeps the counts a recent-popularity estimate, so yesterday's hot chunk fades.
    """

    def __init__(self, window: int = 10_000):
        self.window = window
        self._counts: dict[str, int] = {}
        self._seen = 0

    def record(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1
        self._seen += 1
        if self._seen >= self.window:
            self._seen = 0
            self._counts = {k: c // 2 for k, c in self._counts.items() if c > 1}

    def frequency(self, key: str) -> int:
        return self._counts.get(key, 0)

    def admit(self, candidate: str, victims: list[str]) -> bool:
        """Keep ``candidate`` unless the most popular entry it displaces was asked for more often. Ties are kept
        (TinyLFU's rule is strict): a new working set replaces entries as cold as itself on its first request
        instead of being encoded again on the next; in the serving replay (benchmarks/NOTES.md, "The 1 GB goals")
        both rules prefill the same 185 tokens a request."""
        return not victims or self.frequency(candidate) >= max(self.frequency(v) for v in victims)
