"""The cache manager: content-addressed segments of KV in the block pool, under a byte budget.

A segment is a run of tokens whose KV lives in blocks it owns alone: a chunk, the shared
prefix, a position-aware copy of a chunk, or one block of a prefix-cache hash chain. The
cache holds one reference to each cached segment's blocks; a request pins the segments it
reads, and pinned segments are never evicted.

Budget: the bytes of *cached* segments on the device never exceed ``budget_bytes``
(default: the whole pool). A request's own blocks, and segments the cache declined to keep
(``transient``: used by the request that made them, freed when it unpins them), take the
rest of the pool. Which unpinned segment goes first is the eviction policy's call
(``policies.py``); whether a new segment is kept at all is the admission filter's.

Below the device pool sit optional tiers (``tiers.py``): evicted segments are demoted to
host RAM or disk when those have room, and a lookup that misses the pool but hits a tier
promotes the KV back (bit-exact copy into fresh blocks). ``prefetch`` does that promotion
in a background thread, ahead of the request that will need it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from lazyrag.kv.block_pool import BlockPool, OutOfBlocks, blocks_for
from lazyrag.kv.formats import resolve_stored_dtype
from lazyrag.kv.policies import FrequencySketch, make_policy
from lazyrag.kv.tiers import DiskTier, HostTier, Tier, TierEntry

log = logging.getLogger(__name__)


class SegmentKind(str, Enum):
    CHUNK = "chunk"  # a chunk's KV, encoded after the shared prefix
    PREFIX = "prefix"  # a prompt prefix at position 0
    COPY = "copy"  # a chunk re-rotated to another position (position-aware caching)
    PREFIX_BLOCK = "prefix_block"  # one block of an exact token prefix (prefix caching)
    RECOMPUTED = "recomputed"  # a chunk's head computed again in context for one request
    BLENDED = "blended"  # a chunk with some tokens recomputed in context, for one request

    def __str__(self) -> str:  # the value, on disk and in messages
        return self.value


@dataclass
class Segment:
    key: str
    blocks: list[int]
    num_tokens: int
    start: int  # position of its first token when its KV was computed
    kind: SegmentKind = SegmentKind.CHUNK
    pins: int = 0
    hits: int = 0
    cost: float = 0.0  # what recomputing it would cost (relative FLOPs); 0 = let the manager estimate
    transient: bool = False  # not kept by the cache: its blocks are freed when the last pin goes
    spill: bool = False  # transient for want of room on the device: it goes to a tier when the last pin goes


@dataclass(frozen=True)
class CostModel:
    """Relative recompute cost of a segment, for cost-aware eviction.

    Prefill cost per token is the linear layers (constant) plus attention over everything
    before it, which equals the linear part at ``attn_crossover_tokens`` of context (about
    16k for 8B-class models). A position-aware copy is only a re-rotation of existing KV:
    ``copy_fraction`` of recomputing it.
    """

    attn_crossover_tokens: int = 16384
    copy_fraction: float = 0.01

    def cost(self, seg: Segment) -> float:
        # A prefix-cache block is reachable only through the blocks before it, so a deep block
        # is worth no more than a shallow one: cost it without its context.
        mean_context = seg.num_tokens / 2 if seg.kind == SegmentKind.PREFIX_BLOCK else seg.start + seg.num_tokens / 2
        c = seg.num_tokens * (1.0 + mean_context / self.attn_crossover_tokens)
        return c * self.copy_fraction if seg.kind == SegmentKind.COPY else c


@dataclass
class CacheConfig:
    policy: str = "lru"  # lru | lfu | gdsf
    admission: bool = False  # TinyLFU-style frequency filter on insertion
    budget_bytes: int | None = None  # cached segments on the device; None = the whole pool
    host_bytes: int = 0  # host-RAM tier (0 = none)
    disk_dir: str | None = None  # disk tier folder (None = none)
    disk_bytes: int = 0
    # how host and disk tiers keep KV (kv/codec.py): auto (16 bits) | float32 (exact) | bfloat16 | float16 | int8
    stored_kv_dtype: str = "auto"
    demote_kinds: tuple[SegmentKind, ...] = (
        SegmentKind.CHUNK,
        SegmentKind.PREFIX,
    )  # copies and prefix blocks are cheap to redo
    sketch_window: int = 10_000
    cost_model: CostModel = field(default_factory=CostModel)


@dataclass
class CacheStats:
    hits: int = 0  # lookups served from the device pool
    misses: int = 0  # lookups found nowhere
    tier_hits: int = 0  # lookups served by promoting from host or disk
    evictions: int = 0
    inserted: int = 0
    rejected: int = 0  # new segments not kept (admission said no, or no unpinned room)
    demotions: int = 0
    promotions: int = 0  # tier hits plus prefetches
    prefetched: int = 0  # segments promoted ahead of the request that asked for them (``prefetch``)
    hit_tokens: int = 0
    tier_hits_by: dict[int, int] = field(default_factory=dict)  # tier index -> lookups it served
    tier_misses_by: dict[int, int] = field(
        default_factory=dict
    )  # tier index -> lookups that reached it and it could not serve
    reuse: dict[str, list[int]] = field(default_factory=dict)  # "prefix" | "chunk" -> [hits, tokens] served (any tier)

    def reused(self, seg: "Segment") -> None:
        group = "prefix" if seg.kind in (SegmentKind.PREFIX, SegmentKind.PREFIX_BLOCK) else "chunk"
        counts = self.reuse.setdefault(group, [0, 0])
        counts[0] += 1
        counts[1] += seg.num_tokens

    @property
    def lookups(self) -> int:
        return self.hits + self.misses + self.tier_hits


def _rate(hits: int, lookups: int) -> float | None:
    return hits / lookups if lookups else None


def _tier_row(
    tier: str, label: str, entries: int | None, nbytes: int | None, hits: int, misses: int, evictions: int
) -> dict[str, Any]:
    return {
        "tier": tier,
        "label": label,
        "entries": entries,
        "bytes": nbytes,
        "hits": hits,
        "misses": misses,
        "hit_rate": _rate(hits, hits + misses),
        "evictions": evictions,
    }


class CacheManager:
    """Segments by content key on the device pool, evicted by a pluggable policy, backed by tiers."""

    def __init__(self, pool: BlockPool, config: CacheConfig | None = None, tiers: list[Tier] | None = None):
        self.pool = pool
        self._apply(config or CacheConfig())
        self.stored_format = resolve_stored_dtype(self.config.stored_kv_dtype, pool.shape.dtype)
        self._segments: dict[str, Segment] = {}
        self._cached_blocks = 0
        self._lock = threading.RLock()
        self._prefetcher: ThreadPoolExecutor | None = None
        self._copy_stream: torch.cuda.Stream | None = None  # the prefetches' copies (CUDA)
        self._prefetching: Future[int] | None = None  # the last prefetch submitted
        self.stats = CacheStats()
        self._subscribers: list[Callable[[str, str], None]] = []  # KV events (subscribe)
        # tensor parallelism: this rank's KV heads [lo, hi) of the model's; KV of every head (a corpus store's)
        # is sliced to them where it enters the pool. None: the pool holds every head.
        self.kv_heads: tuple[int, int] | None = None
        self._configured_tiers = self._tiers_of(self.config)  # the host and disk tiers the config asks for
        self.tiers: list[Tier] = list(tiers or []) + self._configured_tiers
        if self.tiers and pool.device.type == "meta":
            raise ValueError("A pool on the meta device holds no values, so it cannot have host or disk tiers.")

    @staticmethod
    def _tiers_of(config: CacheConfig) -> list[Tier]:
        tiers: list[Tier] = []
        if config.host_bytes:
            tiers.append(HostTier(config.host_bytes))
        if config.disk_dir:
            tiers.append(DiskTier(config.disk_dir, config.disk_bytes or 1 << 62))
        return tiers

    def subscribe(self, callback: Callable[[str, str], None]) -> None:
        """Call ``callback(event, key)`` whenever a segment enters the pool (``"stored"``) or leaves it
        (``"removed"``), as vLLM publishes KV events: what a router needs to send a request where its chunks
        are (lazyrag/server/routing.py). It runs under the cache's lock: keep it to a queue append."""
        with self._lock:
            self._subscribers.append(callback)

    def _publish(self, event: str, key: str) -> None:
        for callback in self._subscribers:
            callback(event, key)

    def add_tier(self, tier: Tier) -> None:
        """Serve misses from ``tier`` too (below the existing tiers), e.g. a corpus store; once only."""
        if self.pool.device.type == "meta":
            raise ValueError("A pool on the meta device holds no values, so it cannot have host or disk tiers.")
        with self._lock:
            if tier not in self.tiers:
                self.tiers.append(tier)

    def _apply(self, config: CacheConfig) -> None:
        """Eviction policy, admission filter and budget from ``config`` (tiers are set up once, in __init__)."""
        self.config = config
        self.policy = make_policy(config.policy)
        self.sketch = FrequencySketch(config.sketch_window) if config.admission else None
        pool_bytes = self.pool.num_blocks * self.pool.shape.bytes_per_block
        self.budget_bytes = pool_bytes if config.budget_bytes is None else min(config.budget_bytes, pool_bytes)

    def reconfigure(self, config: CacheConfig) -> None:
        """Start over under another policy, admission filter, budget or host / disk tier: every unpinned segment
        leaves the pool, and the tiers the old config made are replaced by new, empty ones (a disk tier's folder
        is read again); tiers added otherwise (a corpus store) stay."""
        if (config.host_bytes or config.disk_dir) and self.pool.device.type == "meta":
            raise ValueError("A pool on the meta device holds no values, so it cannot have host or disk tiers.")
        self.settle_prefetch()
        with self._lock:
            self.clear()
            assert not self._segments, "reconfigured while requests hold segments"
            self._apply(config)
            others = [t for t in self.tiers if all(t is not c for c in self._configured_tiers)]  # e.g. corpus stores
            self._configured_tiers = self._tiers_of(config)
            self.tiers = self._configured_tiers + others  # host RAM and disk before a store: the faster first
            self.stored_format = resolve_stored_dtype(config.stored_kv_dtype, self.pool.shape.dtype)

    # -- queries ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, key: str) -> bool:
        return key in self._segments

    def resident_keys(self) -> list[str]:
        """The keys of the segments held in the pool now, oldest first."""
        return list(self._segments)

    @property
    def num_pinned(self) -> int:
        """Cached segments some request in flight still holds."""
        return sum(seg.pins > 0 for seg in self._segments.values())

    @property
    def cached_blocks(self) -> int:
        """Blocks held by cached segments (not by requests in flight)."""
        return self._cached_blocks

    @property
    def cached_bytes(self) -> int:
        return self._cached_blocks * self.pool.shape.bytes_per_block

    def get(self, key: str, pin: bool = True) -> Segment | None:
        """The segment under ``key`` (pinned for the caller), promoted from a tier if need be, or None."""
        with self._lock:
            if self.sketch is not None:
                self.sketch.record(key)
            seg = self._segments.get(key)
            if seg is not None:
                self.policy.touch(key)
                self.stats.hits += 1
                self.stats.hit_tokens += seg.num_tokens
                self.stats.reused(seg)
                seg.hits += 1
                seg.pins += int(pin)
                return seg
            if not self.tiers:
                self.stats.misses += 1
                return None
        entry = self._load(key)  # disk reads happen outside the lock
        with self._lock:
            if entry is None:
                self.stats.misses += 1
                return None
            seg = self._segments.get(key)
            if seg is not None:  # a prefetch got there first
                seg.pins += int(pin)
            else:
                seg = self._install(entry, pin=pin)
            self.stats.tier_hits += 1
            self.stats.hit_tokens += seg.num_tokens
            self.stats.reused(seg)
            return seg

    # -- insertion and pinning ----------------------------------------------------------------

    def put(self, seg: Segment, pin: bool = True) -> Segment:
        """Adopt a segment whose blocks the caller allocated (their one reference passes to the cache).

        If keeping it would exceed the budget, unpinned segments are evicted by the policy;
        when that is impossible or the admission filter prefers the residents, the segment
        is ``transient``: usable by the caller, freed when unpinned.
        """
        with self._lock:
            if not seg.cost:
                seg.cost = self.config.cost_model.cost(seg)
            seg.pins += int(pin)
            if seg.key in self._segments or not self._make_room(seg):
                seg.transient = True
                # the device had no room, but a tier may: it goes there once its last user is done with it
                seg.spill = seg.key not in self._segments and self._demotable(seg)
                self.stats.rejected += 1
                if seg.pins == 0:
                    self._free_transient(seg)
                return seg
            self._segments[seg.key] = seg
            self._cached_blocks += len(seg.blocks)
            self.policy.insert(seg.key, len(seg.blocks), seg.cost)
            self.stats.inserted += 1
            self._publish("stored", seg.key)
            return seg

    def _make_room(self, seg: Segment) -> bool:
        bpb = self.pool.shape.bytes_per_block
        need = (self._cached_blocks + len(seg.blocks)) * bpb - self.budget_bytes
        if need <= 0:
            return True
        victims, freed = [], 0
        for key in self.policy.victims():
            s = self._segments[key]
            if s.pins:
                continue
            victims.append(key)
            freed += len(s.blocks) * bpb
            if freed >= need:
                break
        if freed < need:
            return False
        if self.sketch is not None and not self.sketch.admit(seg.key, victims):
            return False
        for key in victims:
            self.evict(key)
        return True

    def record(self, keys: Iterable[str]) -> None:
        """Count requests for keys that were not looked up one by one (admission frequency only)."""
        if self.sketch is not None:
            with self._lock:
                for key in keys:
                    self.sketch.record(key)

    def touch(self, keys: Iterable[str]) -> None:
        """Mark cached keys as just used, in this order, without counting lookups."""
        with self._lock:
            for key in keys:
                if key in self._segments:
                    self.policy.refresh(key)

    def pin(self, seg: Segment) -> Segment:
        """One more pin on a segment the caller holds already (no lookup counted)."""
        with self._lock:
            assert seg.pins > 0, "pin() adds to a pinned segment; look a key up with get()"
            seg.pins += 1
            return seg

    def discard(self, seg: Segment) -> None:
        """Take a segment whose KV is wrong out of the cache at once, pinned or not: no lookup finds it again,
        and its blocks go when its last pin does (nothing is demoted)."""
        with self._lock:
            if self._segments.get(seg.key) is seg:
                self._unindex(seg)
            seg.spill = False
            if not seg.transient:
                seg.transient = True
                if seg.pins == 0:
                    self.pool.decref(seg.blocks)

    def unpin(self, seg: Segment) -> None:
        with self._lock:
            assert seg.pins > 0, "unpinned a segment that was not pinned"
            seg.pins -= 1
            if seg.transient and seg.pins == 0:
                self._free_transient(seg)

    def _free_transient(self, seg: Segment) -> None:
        if seg.spill:
            seg.spill = False
            try:
                self._demote(seg)
            except (
                Exception
            ):  # a tier that cannot take it (say, out of host memory): the KV is recomputed when asked for
                log.warning("lazyrag: spilling segment %s to a tier failed", seg.key[:12], exc_info=True)
        self.pool.decref(seg.blocks)

    def available_blocks(self) -> int:
        """Blocks an allocation could get now: free ones and those of unpinned cached segments."""
        with self._lock:
            return self.pool.num_free + sum(len(s.blocks) for s in self._segments.values() if s.pins == 0)

    def allocate(self, num_blocks: int) -> list[int]:
        """Blocks from the pool, evicting unpinned segments (policy order) until they fit."""
        with self._lock:
            while self.pool.num_free < num_blocks:
                victim = next((k for k in self.policy.victims() if self._segments[k].pins == 0), None)
                if victim is None:
                    raise OutOfBlocks(
                        f"need {num_blocks} KV blocks but only {self.pool.num_free} are free and every cached "
                        "segment is in use; raise kv_budget or send fewer/shorter chunks per request."
                    )
                self.evict(victim)
            return self.pool.allocate(num_blocks)

    def evict(self, key: str) -> None:
        with self._lock:
            seg = self._segments[key]
            assert seg.pins == 0, "evicting a pinned segment"
            self._demote(seg)
            self.policy.evicted(key)
            self._unindex(seg)
            self.pool.decref(seg.blocks)
            self.stats.evictions += 1

    def _unindex(self, seg: Segment) -> None:
        """No lookup finds ``seg`` any more, and its blocks no longer count against the budget (caller holds the
        lock)."""
        self.policy.remove(seg.key)
        del self._segments[seg.key]
        self._cached_blocks -= len(seg.blocks)
        self._publish("removed", seg.key)

    def clear(self) -> None:
        """Drop every unpinned segment from the device pool (tiers keep what they hold)."""
        self.settle_prefetch()
        with self._lock:
            for key in [k for k, s in self._segments.items() if s.pins == 0]:
                self.evict(key)

    def reset(self) -> None:
        """Back to a new cache's state: every segment forgotten (not demoted to the tiers, not counted as evicted),
        the statistics, eviction policy and admission sketch new. None may be pinned (no request in flight)."""
        self.settle_prefetch()
        with self._lock:
            assert all(s.pins == 0 for s in self._segments.values()), "reset while requests hold segments"
            for seg in list(self._segments.values()):
                self._unindex(seg)
                self.pool.decref(seg.blocks)
            self._apply(self.config)
            self.stats = CacheStats()

    # -- tiers ------------------------------------------------------------------------------

    def read_kv(self, seg: Segment, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """A segment's K and V ``[layers, tokens, H_kv, D]`` copied to ``device`` (the CPU), unpadded."""
        idx = torch.tensor(seg.blocks, device=self.pool.device)
        L, bs = self.pool.shape.num_layers, self.pool.shape.block_size
        out = []
        for t in (self.pool.k, self.pool.v):
            x = t[:, idx].reshape(L, len(seg.blocks) * bs, *t.shape[3:])[:, : seg.num_tokens]
            out.append(x.to(device, copy=True).contiguous())
        return out[0], out[1]

    def write_kv(self, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy ``k, v [layers, tokens, H_kv, D]`` (on any device) into ``blocks`` (the padding tail stays unused)."""
        if k.dtype != self.pool.shape.dtype:
            raise TypeError(
                f"KV is {k.dtype} but the pool holds {self.pool.shape.dtype}; it was made for another engine dtype."
            )
        L, bs = self.pool.shape.num_layers, self.pool.shape.block_size
        if self.kv_heads is not None and k.shape[2] != self.pool.shape.num_kv_heads:
            lo, hi = self.kv_heads  # stored with every head (built at tensor-parallel size 1): this rank's share
            k, v = k[:, :, lo:hi], v[:, :, lo:hi]
        n = k.shape[1]
        idx = torch.tensor(blocks, device=self.pool.device)
        for src, dst in ((k, self.pool.k), (v, self.pool.v)):
            padded = torch.zeros(L, len(blocks) * bs, *src.shape[2:], dtype=src.dtype, device=src.device)
            padded[:, :n] = src
            dst[:, idx] = padded.view(L, len(blocks), bs, *src.shape[2:]).to(self.pool.device, non_blocking=True)

    def _demotable(self, seg: Segment) -> bool:
        return seg.kind in self.config.demote_kinds and any(t.writable for t in self.tiers)

    def _demote(self, seg: Segment) -> None:
        if not self._demotable(seg):
            return
        if any(seg.key in t for t in self.tiers):
            return  # a lower tier (e.g. a corpus store) already has it
        k, v = self.read_kv(seg, self.pool.device)  # encoded where it is: fewer bytes cross to the host
        pinned = any(getattr(t, "pins_memory", False) for t in self.tiers if t.writable)
        pending = [TierEntry.encoded(seg.key, k, v, self.stored_format, seg.start, seg.kind, seg.cost, pinned)]
        for tier in self.tiers:
            if not tier.writable or not pending:
                continue
            nxt = []
            for e in pending:
                nxt.extend(tier.put(e))
            pending = nxt
        self.stats.demotions += 1

    def _load(self, key: str) -> TierEntry | None:
        for i, tier in enumerate(self.tiers):
            if key in tier:
                entry = tier.get(key)  # None if it was corrupt: then it is recomputed upstream
                if entry is not None:
                    self.stats.tier_hits_by[i] = self.stats.tier_hits_by.get(i, 0) + 1
                    return entry
            self.stats.tier_misses_by[i] = self.stats.tier_misses_by.get(i, 0) + 1
        return None

    def report(self) -> dict[str, Any]:
        """What the cache holds and how it served lookups, per tier (the device pool first, then host, disk and
        attached corpus stores, in lookup order): entries, bytes, hits, misses, hit rate, evictions; and the
        reuse split, prefix segments (a prompt's shared prefix, prefix-caching blocks) vs chunks, in hits and tokens.
        A tier's misses are the lookups that reached it and it could not serve (a device miss goes on to the tiers)."""
        st = self.stats
        with self._lock:
            device_misses = st.misses + st.tier_hits
            rows = [
                _tier_row(
                    "device",
                    "device pool",
                    len(self._segments),
                    self.cached_bytes,
                    st.hits,
                    device_misses,
                    st.evictions,
                )
            ]
            rows[0]["budget_bytes"] = self.budget_bytes
            for i, tier in enumerate(self.tiers):
                nbytes = getattr(tier, "nbytes", None)
                if not isinstance(nbytes, int) and hasattr(tier, "size_bytes"):
                    nbytes = tier.size_bytes()  # a corpus store: its folder on disk
                name = getattr(tier, "name", "tier")
                label = f"store {tier.path}" if name == "store" and hasattr(tier, "path") else name
                rows.append(
                    _tier_row(
                        f"{i}:{type(tier).__name__}",
                        label,
                        len(tier) if hasattr(tier, "__len__") else None,
                        nbytes,
                        st.tier_hits_by.get(i, 0),
                        st.tier_misses_by.get(i, 0),
                        tier.evictions,
                    )
                )
        reuse = {
            g: {"hits": st.reuse.get(g, [0, 0])[0], "tokens": st.reuse.get(g, [0, 0])[1]} for g in ("prefix", "chunk")
        }
        return {
            "tiers": rows,
            "lookups": st.lookups,
            "misses": st.misses,
            "hit_rate": _rate(st.lookups - st.misses, st.lookups),
            "reuse": reuse,
        }

    def _install(self, entry: TierEntry, pin: bool) -> Segment:
        bs = self.pool.shape.block_size
        blocks = self.allocate(blocks_for(entry.num_tokens, bs))
        self.write_kv(blocks, *entry.decode(self.pool.shape.dtype, self.pool.device))
        self.stats.promotions += 1
        return self.put(_segment_of(entry, blocks), pin=pin)

    def prefetch(self, keys: list[str]) -> Future[int]:
        """Promote these keys from the tiers into the pool in a background thread; returns how many arrived.

        On CUDA the copies run on a stream of their own, so they overlap the forward passes; a segment enters the
        cache only once its KV has landed, so whoever finds it reads it whole."""
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazyrag-prefetch")
        self._prefetching = self._prefetcher.submit(self._prefetch, list(keys))
        return self._prefetching

    def settle_prefetch(self) -> None:
        """Wait for the prefetch under way, if any (a failed one changed nothing): before the cache starts over."""
        if self._prefetching is not None:
            wait([self._prefetching])

    def _prefetch(self, keys: list[str]) -> int:
        done = 0
        for key in keys:
            if key in self._segments:
                continue
            entry = self._load(key)
            if entry is None:
                continue
            try:
                done += self._install_aside(entry)
            except OutOfBlocks:
                break  # the pool is full of pinned work: the request will load it itself
        return done

    def _install_aside(self, entry: TierEntry) -> bool:
        """``_install`` for a prefetch: the blocks are taken under the lock, the copy runs outside it (on CUDA, on
        the prefetch stream), and the segment is published after the copy has finished. Whether it was kept."""
        with self._lock:
            if entry.key in self._segments:
                return False
            blocks = self.allocate(blocks_for(entry.num_tokens, self.pool.shape.block_size))
            self.stats.promotions += 1
            self.stats.prefetched += 1
        try:
            if self.pool.device.type == "cuda":
                stream = self._prefetch_stream()
                # the blocks may have been freed by a request whose passes are still queued on the compute stream
                stream.wait_stream(torch.cuda.default_stream(self.pool.device))
                with torch.cuda.stream(stream):
                    self.write_kv(blocks, *entry.decode(self.pool.shape.dtype, self.pool.device))
                stream.synchronize()
            else:
                self.write_kv(blocks, *entry.decode(self.pool.shape.dtype, self.pool.device))
        except BaseException:
            self.pool.decref(blocks)
            raise
        with self._lock:
            if entry.key in self._segments:  # the request got there first and promoted it itself
                self.pool.decref(blocks)
                return False
            seg = self.put(_segment_of(entry, blocks), pin=False)
            return not seg.transient

    def _prefetch_stream(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.pool.device)
        return self._copy_stream


def _segment_of(entry: TierEntry, blocks: list[int]) -> Segment:
    """The pool segment of a tier entry whose KV was written into ``blocks``."""
    return Segment(entry.key, blocks, entry.num_tokens, entry.start, SegmentKind(entry.kind), cost=entry.cost)
