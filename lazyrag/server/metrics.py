"""Prometheus metrics of ``lazyrag serve`` (``GET /metrics``), named after vLLM's where one exists.

Counters and histograms are updated as requests finish; the cache's numbers (chunks and bytes per
tier, hits, evictions) are read from the engine at scrape time, so they are never stale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from lazyrag.engine import GenerationResult, LazyEngine

disable_created_metrics()  # no *_created series next to every counter (as vLLM)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)


class ServerMetrics:
    def __init__(self, engine: "LazyEngine"):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lazyrag_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "lazyrag_time_to_first_token_seconds",
            "time to first token of each generation",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "lazyrag_time_per_output_token_seconds",
            "mean inter-token latency of each generation (after its first token)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "lazyrag_e2e_request_latency_seconds",
            "time from arrival to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("lazyrag_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter(
            "lazyrag_cached_prompt_tokens", "prompt tokens whose KV was reused from the cache, not computed", registry=r
        )
        self.generation_tokens = Counter("lazyrag_generation_tokens", "tokens generated", registry=r)
        self.chunk_hits = Counter("lazyrag_chunk_hits", "prompt chunks whose KV was found cached", registry=r)
        self.chunk_misses = Counter("lazyrag_chunk_misses", "prompt chunks encoded for the request", registry=r)
        self.aborted = Counter(
            "lazyrag_requests_aborted", "generations stopped because the client went away", registry=r
        )
        self.in_flight = Gauge("lazyrag_requests_in_flight", "generations admitted and not finished", registry=r)
        r.register(_CacheCollector(engine))

    def finished(self, result: "GenerationResult") -> None:
        s = result.stats
        self.ttft.observe(result.ttft_s)
        self.e2e.observe(result.total_s)
        if s.new_tokens > 1:
            self.itl.observe((result.total_s - result.ttft_s) / (s.new_tokens - 1))
        self.prompt_tokens.inc(s.prompt_tokens)
        self.cached_tokens.inc(s.tokens_reused)
        self.generation_tokens.inc(s.new_tokens)
        self.chunk_hits.inc(s.chunks_hit)
        self.chunk_misses.inc(s.chunks_missed)


class _CacheCollector:
    """The engine's chunk cache, read at scrape time."""

    def __init__(self, engine: "LazyEngine"):
        self.engine = engine

    def collect(self):
        cache = self.engine.cache
        stats = cache.stats
        report = self.engine.cache_report()
        lookups = CounterMetricFamily(
            "lazyrag_cache_lookups", "cache lookups of prompt segments, by outcome", labels=["outcome"]
        )
        lookups.add_metric(["device_hit"], stats.hits)
        lookups.add_metric(["tier_hit"], stats.tier_hits)
        lookups.add_metric(["miss"], stats.misses)
        yield lookups
        yield CounterMetricFamily(
            "lazyrag_cache_evictions", "segments evicted from the device pool", value=stats.evictions
        )
        entries = GaugeMetricFamily("lazyrag_cache_entries", "cached segments per tier", labels=["tier"])
        nbytes = GaugeMetricFamily("lazyrag_cache_bytes", "bytes of cached KV per tier", labels=["tier"])
        tier_hits = CounterMetricFamily("lazyrag_cache_tier_hits", "lookups each tier served", labels=["tier"])
        tier_misses = CounterMetricFamily(
            "lazyrag_cache_tier_misses", "lookups that reached a tier and it could not serve", labels=["tier"]
        )
        tier_evictions = CounterMetricFamily(
            "lazyrag_cache_tier_evictions", "entries each tier pushed out", labels=["tier"]
        )
        for row in report["tiers"]:
            if row["entries"] is not None:
                entries.add_metric([row["tier"]], row["entries"])
            if isinstance(row["bytes"], int):
                nbytes.add_metric([row["tier"]], row["bytes"])
            tier_hits.add_metric([row["tier"]], row["hits"])
            tier_misses.add_metric([row["tier"]], row["misses"])
            tier_evictions.add_metric([row["tier"]], row["evictions"])
        yield from (entries, nbytes, tier_hits, tier_misses, tier_evictions)
        reused = CounterMetricFamily(
            "lazyrag_cache_reused_tokens", "prompt tokens served from the cache, by segment kind", labels=["kind"]
        )
        for kind, r in report["reuse"].items():
            reused.add_metric([kind], r["tokens"])
        yield reused
        pool = cache.pool
        yield GaugeMetricFamily("lazyrag_kv_pool_free_blocks", "free blocks of the paged KV pool", value=pool.num_free)
        yield GaugeMetricFamily("lazyrag_kv_pool_blocks", "blocks of the paged KV pool", value=pool.num_blocks)
