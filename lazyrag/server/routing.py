"""Which replica serves a request: chunk affinity, with least-loaded and round-robin as baselines.

Lazy caching makes routing matter more than a prefix cache does: a request is cheapest where most of
its chunks already sit in the pool, in any order. Each replica publishes the chunk keys that enter and
leave its pool (``CacheManager.subscribe``, like vLLM's KV events); the router keeps one key set per
replica from them and sends a request where it would start and finish soonest: the work queued there
(each request counted by the chunks it had to encode there, plus a little) plus the chunks of this
request that replica lacks. So a popular chunk does not pile every request onto one replica, and a
replica holding all of a request's chunks wins unless it is busier by more than what it saves.

The routers are plain objects (no I/O, thread-safe): the same code routes in the simulated cluster
(``benchmarks/routing.py``) and in front of several replicas.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field


class NoReplica(RuntimeError):
    """Every replica is marked down."""


@dataclass
class Replica:
    name: str
    held: set[str] = field(default_factory=set)  # chunk keys in its pool, as its KV events say
    in_flight: int = 0
    queued_work: float = 0.0  # the routed requests' estimated work, in chunk encodes
    alive: bool = True

    def on_kv_event(self, event: str, key: str) -> None:
        """``CacheManager.subscribe``'s callback."""
        if event == "stored":
            self.held.add(key)
        elif event == "removed":
            self.held.discard(key)


@dataclass(frozen=True)
class Route:
    """Where a request went and the work it was counted for there (give it back to ``Router.finish``)."""

    replica: str
    work: float


class Router:
    """The replicas by name, what they hold and their load; ``choose`` is the policy."""

    name = "base"

    def __init__(self, names: list[str], request_work: float = 0.1):
        assert names and len(set(names)) == len(names), "replica names must be distinct"
        self.replicas = {n: Replica(n) for n in names}
        # a request's work besides its chunk encodes, in chunk encodes: on an 8B model a request whose
        # 5 chunks are all cached takes ~5.5 ms, one 2k-token chunk encode ~52 ms (e2e_h200_round9.json)
        self.request_work = request_work
        self._lock = threading.Lock()

    def _alive(self) -> list[Replica]:
        alive = [r for r in self.replicas.values() if r.alive]
        if not alive:
            raise NoReplica("no replica is up: every one failed; restart one and mark it up")
        return alive

    def choose(self, chunk_keys: set[str]) -> Replica:
        raise NotImplementedError

    def start(self, chunk_keys: list[str]) -> Route:
        """Choose a replica for a request whose chunks have these keys and count it in flight there."""
        keys = set(chunk_keys)
        with self._lock:
            r = self.choose(keys)
            work = self.request_work + len(keys - r.held)
            r.in_flight += 1
            r.queued_work += work
            return Route(r.name, work)

    def finish(self, route: Route) -> None:
        with self._lock:
            r = self.replicas[route.replica]
            assert r.in_flight > 0, f"{route.replica} finished a request it was not serving"
            r.in_flight -= 1
            r.queued_work = max(0.0, r.queued_work - route.work)

    def mark_down(self, name: str) -> None:
        """Send nothing more there (its process died or stopped answering); what it held is forgotten."""
        with self._lock:
            r = self.replicas[name]
            r.alive, r.held = False, set()

    def mark_up(self, name: str) -> None:
        with self._lock:
            self.replicas[name].alive = True

    def least_loaded(self) -> Replica:
        return min(self._alive(), key=lambda r: r.in_flight)  # ties: the first by name (deterministic)


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self, names: list[str], **kw):
        super().__init__(names, **kw)
        self._next = itertools.cycle(names)

    def choose(self, chunk_keys: set[str]) -> Replica:
        self._alive()
        while not (r := self.replicas[next(self._next)]).alive:
            pass
        return r


class LeastLoadedRouter(Router):
    name = "least_loaded"

    def choose(self, chunk_keys: set[str]) -> Replica:
        return self.least_loaded()


class ChunkAffinityRouter(Router):
    """Least queued work plus the request's chunks a replica lacks; ties: more of them held, then by name.
    No replica holds any of them: the least queued work (the least loaded)."""

    name = "chunk_affinity"

    def choose(self, chunk_keys: set[str]) -> Replica:
        def cost(r: Replica) -> tuple[float, int]:
            held = len(chunk_keys & r.held)
            return r.queued_work + len(chunk_keys) - held, -held

        return min(self._alive(), key=cost)


ROUTERS = {cls.name: cls for cls in (ChunkAffinityRouter, LeastLoadedRouter, RoundRobinRouter)}


def make_router(name: str, replicas: list[str], **options) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"Unknown router {name!r}: choose one of {', '.join(ROUTERS)}.")
    return ROUTERS[name](replicas, **options)
