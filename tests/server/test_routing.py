"""Routing across replicas (lazyrag/server/routing.py): KV events from the real cache manager, the
routers' choices, and the simulated cluster's outcome (benchmarks/routing.py)."""

import pytest
import torch

from lazyrag.kv.block_pool import BlockPool, KVShape
from lazyrag.kv.cache import CacheConfig, CacheManager, Segment
from lazyrag.server.routing import ChunkAffinityRouter, LeastLoadedRouter, NoReplica, RoundRobinRouter, make_router

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)


def meta_cache(blocks: int, budget_blocks: int) -> CacheManager:
    pool = BlockPool(SHAPE, blocks, torch.device("meta"))
    return CacheManager(pool, CacheConfig(budget_bytes=budget_blocks * SHAPE.bytes_per_block))


def put(cache: CacheManager, key: str, blocks: int = 1) -> Segment:
    seg = cache.put(Segment(key, cache.allocate(blocks), blocks * SHAPE.block_size, 0))
    cache.unpin(seg)
    return seg


def test_the_cache_publishes_stored_and_removed_keys():
    cache = meta_cache(blocks=8, budget_blocks=2)
    events = []
    cache.subscribe(lambda event, key: events.append((event, key)))
    put(cache, "a")
    put(cache, "b")
    put(cache, "c")  # over the budget: the LRU victim "a" leaves
    assert events == [("stored", "a"), ("stored", "b"), ("removed", "a"), ("stored", "c")]
    cache.clear()
    assert sorted(events[4:]) == [("removed", "b"), ("removed", "c")]


def test_a_rejected_segment_publishes_nothing():
    cache = meta_cache(blocks=8, budget_blocks=1)
    events = []
    cache.subscribe(lambda event, key: events.append((event, key)))
    seg = cache.put(Segment("big", cache.allocate(2), 32, 0))  # larger than the whole budget: transient
    assert seg.transient and events == []
    cache.unpin(seg)


def routed_with_events(router, caches):
    for name, cache in caches.items():
        cache.subscribe(router.replicas[name].on_kv_event)


def test_affinity_goes_where_the_chunks_are_unless_that_replica_is_far_busier():
    router = ChunkAffinityRouter(["r0", "r1", "r2"])
    caches = {n: meta_cache(16, 16) for n in router.replicas}
    routed_with_events(router, caches)
    for key in ("doc1", "doc2", "doc3"):
        put(caches["r1"], key)
    put(caches["r2"], "doc1")
    first = router.start(["doc1", "doc2", "doc3"])
    assert first.replica == "r1" and first.work == pytest.approx(0.1)  # nothing to encode there
    # r1 is busy with one cheap request; the next still goes there (saving 3 encodes beats 0.1 of queued work)
    assert router.start(["doc1", "doc2", "doc3"]).replica == "r1"
    # enough queued at r1 that encoding elsewhere is sooner: the replica with part of them and no queue
    for _ in range(3):
        router.replicas["r1"].queued_work += 1.0
    r = router.start(["doc1", "doc2", "doc3"])
    assert r.replica == "r2" and r.work == pytest.approx(2.1)
    router.finish(r)
    assert router.replicas["r2"].in_flight == 0 and router.replicas["r2"].queued_work == pytest.approx(0.0)
    # no replica holds any of the chunks: the least queued work
    assert router.start(["doc9"]).replica == "r0"


def test_evicted_chunks_stop_attracting_requests():
    router = ChunkAffinityRouter(["r0", "r1"])
    caches = {n: meta_cache(8, 1) for n in router.replicas}
    routed_with_events(router, caches)
    put(caches["r1"], "doc1")
    assert router.replicas["r1"].held == {"doc1"}
    put(caches["r1"], "doc2")  # the budget holds one block: doc1 leaves
    assert router.replicas["r1"].held == {"doc2"}
    assert router.start(["doc1"]).replica == "r0"  # r1 no longer has it; r0 is first among equals


@pytest.mark.parametrize("router_cls", [ChunkAffinityRouter, LeastLoadedRouter, RoundRobinRouter], ids=lambda c: c.name)
def test_a_replica_marked_down_gets_nothing_and_none_up_is_an_error(router_cls):
    router = router_cls(["r0", "r1"])
    router.replicas["r0"].held = {"doc1"}
    router.mark_down("r0")
    assert {router.start(["doc1"]).replica for _ in range(4)} == {"r1"}
    assert router.replicas["r0"].held == set(), "a replica that went down is assumed to have lost its cache"
    router.mark_down("r1")
    with pytest.raises(NoReplica, match="no replica is up"):
        router.start(["doc1"])
    router.mark_up("r1")
    assert router.start([]).replica == "r1"


def test_round_robin_and_least_loaded_ignore_the_chunks():
    rr = RoundRobinRouter(["r0", "r1", "r2"])
    assert [rr.start(["x"]).replica for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    ll = LeastLoadedRouter(["r0", "r1"])
    ll.replicas["r0"].held = {"x"}
    a = ll.start(["x"])
    assert (a.replica, ll.start(["x"]).replica) == ("r0", "r1")
    ll.finish(a)
    assert ll.start(["x"]).replica == "r0"
    with pytest.raises(ValueError, match="Unknown router"):
        make_router("random", ["r0"])


def test_in_the_simulated_cluster_affinity_serves_more_chunks_from_cache_than_round_robin():
    """The real cache manager and lazy planner per replica (benchmarks/routing.py), 4 replicas, Zipf 2.1."""
    import argparse

    from benchmarks.hit_rate import Workload
    from benchmarks.routing import simulate

    args = argparse.Namespace(
        budget_gib=4.0, rate=8.0, requests_per_replica=60, alpha=2.1, hit_ms=5.48, miss_us_per_token=25.4
    )
    rows = {name: simulate(name, 4, Workload(), args) for name in ("chunk_affinity", "round_robin")}
    a, b = rows["chunk_affinity"], rows["round_robin"]
    assert a["requests"] == b["requests"] == 240
    assert a["chunk_hit_rate"] > b["chunk_hit_rate"] + 0.02
    assert a["encoded_tokens_per_request"] < b["encoded_tokens_per_request"]
    assert a["ttft_p50_ms"] < b["ttft_p50_ms"]
