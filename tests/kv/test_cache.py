"""The cache manager on its own: content keys, budget, policies, admission, pinning under threads, tiers."""

import random
import threading

import pytest
import torch

from lazyrag.kv.block_pool import BlockPool, KVShape, OutOfBlocks
from lazyrag.kv.cache import CacheConfig, CacheManager, Segment
from lazyrag.kv.tiers import DiskTier

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
BPB = SHAPE.bytes_per_block


def make(num_blocks=16, **cfg):
    pool = BlockPool(SHAPE, num_blocks, torch.device("cpu"))
    return CacheManager(pool, CacheConfig(**cfg))


def add(cache, key, tokens=8, pin=False, kind="chunk", fill=None):
    blocks = cache.allocate(SHAPE.blocks_for(tokens))
    if fill is not None:
        cache.write_kv(blocks, *fill)
    return cache.put(Segment(key, blocks, tokens, 0, kind=kind), pin=pin)


def rand_kv(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (SHAPE.num_layers, tokens, SHAPE.num_kv_heads, SHAPE.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_lru_evicts_least_recently_used_under_pressure():
    cache = make(num_blocks=6)  # three 2-block segments fit
    for k in "abc":
        add(cache, k)
    cache.get("a", pin=False)  # a is now the most recent
    add(cache, "d")
    assert "b" not in cache and {"a", "c", "d"} <= set(cache._segments)
    assert cache.stats.evictions == 1


def test_reconfigure_starts_over_under_the_new_policy_and_budget():
    cache = make(num_blocks=8)
    for k in "abc":
        add(cache, k)
    cache.reconfigure(CacheConfig(policy="lfu", admission=True, budget_bytes=2 * SHAPE.bytes_per_block))
    assert len(cache) == 0 and cache.pool.num_free == 8
    assert cache.config.policy == "lfu" and cache.sketch is not None and cache.budget_bytes == 2 * SHAPE.bytes_per_block
    cache.get("d"), cache.get("d")
    add(cache, "d")
    cache.get("e")
    add(cache, "e")  # does not fit beside d, and d (asked twice) outranks it under the new admission rule
    assert "d" in cache and "e" not in cache and cache.cached_bytes <= cache.budget_bytes


def test_lfu_evicts_least_frequently_used():
    cache = make(num_blocks=6, policy="lfu")
    for k in "abc":
        add(cache, k)
    for _ in range(3):
        cache.get("a", pin=False)
        cache.get("b", pin=False)
    add(cache, "d")
    assert "c" not in cache and {"a", "b", "d"} <= set(cache._segments)


def test_gdsf_evicts_cheap_copies_before_expensive_chunks():
    cache = make(num_blocks=6, policy="gdsf")
    add(cache, "chunk1")
    add(cache, "copy", kind="copy")  # a re-rotated copy: ~1% of a recompute
    add(cache, "chunk2")
    add(cache, "chunk3")
    assert "copy" not in cache and "chunk1" in cache  # LRU would have evicted chunk1


def test_admission_keeps_popular_residents_over_one_off_newcomers():
    cache = make(num_blocks=8, policy="lru", admission=True, budget_bytes=4 * BPB)
    add(cache, "hot1")
    add(cache, "hot2")
    for _ in range(3):
        cache.get("hot1", pin=False), cache.get("hot2", pin=False)
    cache.get("cold")  # a miss still counts once
    seg = add(cache, "cold", pin=True)
    assert seg.transient and "cold" not in cache and {"hot1", "hot2"} <= set(cache._segments)
    free = cache.pool.num_free
    cache.unpin(seg)  # a transient segment's blocks go back when its user is done
    assert cache.pool.num_free == free + 2
    for _ in range(5):
        cache.get("new")
    add(cache, "new")  # asked for more often than the residents: admitted
    assert "new" in cache


def test_admission_lets_newcomers_replace_residents_asked_for_no_more_often():
    """Ties are admitted: a new working set takes the place of entries as cold as itself (strict TinyLFU refuses it
    its first time, so the next request encodes it again)."""
    cache = make(num_blocks=8, policy="lru", admission=True, budget_bytes=4 * BPB)
    for key in ("old1", "old2", "new1", "new2"):
        cache.get(key)
        add(cache, key)
    assert set(cache._segments) == {"new1", "new2"}


def test_pinned_segments_are_never_evicted_and_full_pool_says_what_to_do():
    cache = make(num_blocks=4)
    a = add(cache, "a", pin=True)
    add(cache, "b", pin=True)
    with pytest.raises(OutOfBlocks, match="raise kv_budget"):
        cache.allocate(1)
    cache.unpin(a)
    cache.allocate(1)
    assert "a" not in cache and "b" in cache


@pytest.mark.parametrize("policy,admission", [("lru", False), ("lfu", False), ("gdsf", True)])
def test_many_threads_never_evict_pinned_or_exceed_the_budget(policy, admission):
    """Each thread pins segments, stamps checks their KV while pinned, and unpins; the data must never change."""
    budget = 12 * BPB
    cache = make(num_blocks=24, policy=policy, admission=admission, budget_bytes=budget)
    errors, lock = [], threading.Lock()

    def worker(tid):
        rng = random.Random(tid)
        for _ in range(150):
            key = f"k{int(rng.paretovariate(1.2)) % 20}"
            value = float(hash(key) % 1000)
            with cache._lock:  # lookup-or-compute must be atomic per key, as the engine's request lock makes it
                seg = cache.get(key)
                if seg is None:
                    try:
                        blocks = cache.allocate(2)
                    except OutOfBlocks:
                        continue
                    cache.pool.k[:, blocks] = value
                    seg = cache.put(Segment(key, blocks, 8, 0), pin=True)
            try:
                for _ in range(3):
                    got = cache.pool.k[:, seg.blocks]
                    if not bool((got == value).all()):
                        with lock:
                            errors.append(f"{key} changed while pinned")
                    if cache.cached_bytes > budget:
                        with lock:
                            errors.append("budget exceeded")
            finally:
                cache.unpin(seg)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert all(s.pins == 0 for s in cache._segments.values())
    assert cache.pool.num_free + cache._cached_blocks == cache.pool.num_blocks  # no leaked blocks
    assert cache.stats.evictions > 0


def test_budget_is_never_exceeded_by_random_traffic():
    budget = 7 * BPB
    cache = make(num_blocks=20, policy="gdsf", budget_bytes=budget)
    rng = random.Random(0)
    held = []
    for _step in range(400):
        key = f"s{rng.randrange(30)}"
        seg = cache.get(key)
        if seg is None:
            seg = add(cache, key, tokens=rng.choice([4, 8, 12]), pin=True)
        held.append(seg)
        if len(held) > 2 or rng.random() < 0.5:
            cache.unpin(held.pop(0))
        assert cache.cached_bytes <= budget
        assert cache.pool.num_free >= 0
    for seg in held:
        cache.unpin(seg)
    assert cache.pool.num_free + cache._cached_blocks == cache.pool.num_blocks


# stored dtype -> (bytes of the stored segment / float32's, worst error relative to the largest |value|)
STORED_BOUNDS = {
    "float32": (1.0, 0.0),
    "auto": (0.5, 2**-11),
    "float16": (0.5, 2**-11),
    "bfloat16": (0.5, 2**-8),
    "int8": (0.25 + 0.125 / 2, 1 / 127),
}  # int8: 1 byte a value, V's float32 scale per 8-dim head row


@pytest.mark.parametrize("stored", list(STORED_BOUNDS))
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tier_round_trip_keeps_kv_within_its_stored_dtypes_rounding(tier, stored, tmp_path):
    """float32 comes back bit-exact; 16 bits and int8 come back as the codec rounds them, at their share of the
    bytes."""
    from lazyrag.kv import codec
    from lazyrag.kv.formats import resolve_stored_dtype

    cfg = {"host_bytes": 1 << 20} if tier == "host" else {"disk_dir": str(tmp_path), "disk_bytes": 1 << 20}
    cache = make(num_blocks=4, stored_kv_dtype=stored, **cfg)
    k, v = rand_kv(7, seed=1)
    k[1, :, 0, 3] *= 30  # an outlier channel, as real K has: per-channel scales keep the other channels fine
    add(cache, "a", tokens=7, fill=(k, v))
    add(cache, "b", tokens=8)
    add(cache, "c", tokens=8)  # evicts a: demoted to the tier
    assert "a" not in cache and cache.stats.demotions == 1
    entry = cache.tiers[0].get("a")
    share, bound = STORED_BOUNDS[stored]
    assert (
        entry.nbytes <= share * (k.nbytes + v.nbytes) + 2 * SHAPE.num_layers * SHAPE.num_kv_heads * SHAPE.head_dim * 4
    )
    seg = cache.get("a")  # promoted back into fresh blocks
    assert seg is not None and cache.stats.tier_hits == 1 and seg.num_tokens == 7
    k2, v2 = cache.read_kv(seg)
    assert k2.dtype == v2.dtype == torch.float32
    want = codec.decode(codec.encode(k, v, resolve_stored_dtype(stored, torch.float32)), torch.float32)
    assert torch.equal(k2, want[0]) and torch.equal(v2, want[1])  # the tier adds nothing to the codec's rounding
    if stored == "float32":
        assert torch.equal(k2, k) and torch.equal(v2, v)
    else:
        for new, old, per in ((k2, k, 1), (v2, v, 3)):  # K's error bounded per channel (over tokens), V's per token
            scale = old.abs().amax(dim=per, keepdim=True)
            assert 0 < float(((new - old).abs() / scale).max()) <= bound
    cache.unpin(seg)


def test_int8_keeps_small_channels_beside_an_outlier_channel():
    """Per-channel K scales: a channel 100x larger than the rest does not swamp them (a per-tensor scale would)."""
    from lazyrag.kv import codec

    k, v = rand_kv(64, seed=4)
    k[:, :, :, 0] *= 100
    k2, _ = codec.decode(codec.encode(k, v, "int8"), torch.float32)
    small = (k2 - k)[..., 1:].abs().max() / k[..., 1:].abs().max()
    assert small <= 1 / 127 and float((k2 - k)[..., 0].abs().max()) > float((k2 - k)[..., 1:].abs().max())


def test_float16_out_of_range_segment_is_kept_in_bfloat16_not_as_infinity():
    from lazyrag.kv import codec

    k, v = rand_kv(4, seed=5)
    k[0, 0, 0, 0] = 1e6
    stored = codec.encode(k, v, "float16")
    assert stored["k"].dtype == torch.bfloat16
    assert torch.isfinite(codec.decode(stored, torch.float32)[0]).all()


def test_unknown_stored_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16, int8"):
        make(num_blocks=4, host_bytes=1 << 20, stored_kv_dtype="fp8")


def test_corrupt_disk_tier_file_is_a_miss_not_wrong_kv(tmp_path):
    cache = make(num_blocks=4, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    add(cache, "a", fill=rand_kv(8))
    cache.clear()
    path = tmp_path / "a.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip a bit of V
    path.write_bytes(bytes(data))
    assert cache.get("a") is None
    assert cache.stats.misses == 1 and not path.exists()  # dropped, to be recomputed
    assert "a" not in DiskTier(tmp_path, 1 << 20)


def test_disk_tier_file_moved_to_another_key_or_start_is_a_miss(tmp_path):
    """The checksum ties the KV to its key and start: a file renamed, or its start edited, is not served."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cache = make(num_blocks=4, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    add(cache, "a", fill=rand_kv(8, seed=2))
    add(cache, "b", fill=rand_kv(8, seed=3))
    cache.clear()
    (tmp_path / "a.safetensors").replace(tmp_path / "c.safetensors")  # a's KV filed under another key
    path = tmp_path / "b.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    save_file(load_file(str(path)), str(path), metadata={**meta, "start": str(int(meta["start"]) + 16)})
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.get("c") is None and tier.get("b") is None
    assert "c" not in tier and "b" not in tier


def test_prefetch_promotes_in_the_background(tmp_path):
    cache = make(num_blocks=8, disk_dir=str(tmp_path), disk_bytes=1 << 20, stored_kv_dtype="float32")
    kvs = {key: rand_kv(8, seed=i) for i, key in enumerate("abc")}
    for key, kv in kvs.items():
        add(cache, key, fill=kv)
    cache.clear()
    assert len(cache) == 0
    assert cache.prefetch(list("abc") + ["missing"]).result(timeout=30) == 3
    for key, (k, _v) in kvs.items():
        seg = cache.get(key)
        assert seg is not None and torch.equal(cache.read_kv(seg)[0], k)
        cache.unpin(seg)
    assert cache.stats.hits == 3 and cache.stats.promotions == cache.stats.prefetched == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetch_on_cuda_copies_on_its_own_stream_and_publishes_only_whole_kv():
    """The copy stream waits for passes still queued on the compute stream (they may read blocks that were just
    freed), and a prefetched segment appears in the cache only once its KV has landed."""
    shape = KVShape(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    pool = BlockPool(shape, 512, torch.device("cuda"))
    cache = CacheManager(pool, CacheConfig(host_bytes=1 << 30))
    g = torch.Generator().manual_seed(0)
    kvs = {}
    for i in range(6):
        k, v = (torch.randn(4, 512, 8, 128, generator=g).to(torch.bfloat16) for _ in range(2))
        kvs[f"doc{i}"] = (k, v)
        blocks = cache.allocate(shape.blocks_for(512))
        cache.write_kv(blocks, k.cuda(), v.cuda())
        cache.put(Segment(f"doc{i}", blocks, 512, 0), pin=False)
    cache.clear()
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # the compute stream busy while the copies are queued
        a = a @ a / 64
    assert cache.prefetch(list(kvs)).result(timeout=120) == 6
    for key, (k, v) in kvs.items():
        seg = cache.get(key)
        assert seg is not None and cache.stats.tier_hits == 0
        k2, v2 = cache.read_kv(seg)
        assert torch.equal(k2.cpu(), k) and torch.equal(v2.cpu(), v)
        cache.unpin(seg)


def test_meta_device_pool_takes_8b_sized_budgets_without_memory():
    shape = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert shape.bytes_per_block // 16 == 128 * 1024  # Llama-3.1-8B: 128 KiB per token
    pool = BlockPool.with_budget(shape, 8 << 30, torch.device("meta"))
    cache = CacheManager(pool, CacheConfig(policy="gdsf", budget_bytes=1 << 30))
    for i in range(10):  # 10 docs of 2048 tokens = 2.5 GiB of KV through a 1 GiB budget
        cache.put(Segment(f"doc{i}", cache.allocate(shape.blocks_for(2048)), 2048, 0), pin=False)
        assert cache.cached_bytes <= 1 << 30
    assert len(cache) == 4 and cache.stats.evictions == 6
    with pytest.raises(ValueError, match="meta"):
        CacheManager(pool, CacheConfig(host_bytes=1 << 20))


def test_cache_report_per_tier_and_prefix_vs_chunk_reuse(tmp_path):
    """entries, bytes, hits, misses, hit rate and evictions of the device pool, the host and the disk tier
    (lookup order), and the reuse split by segment kind."""
    budget = 2 * SHAPE.blocks_for(8) * BPB  # room for two 8-token segments on the device
    host = 2 * rand_kv(8)[0].nbytes * 2  # and two in host RAM
    cache = make(num_blocks=16, budget_bytes=budget, host_bytes=host, disk_dir=str(tmp_path / "disk"))
    for i, key in enumerate(["p", "a", "b", "c", "d"]):
        add(cache, key, fill=rand_kv(8, i), kind="prefix" if key == "p" else "chunk")
    for key in ("c", "d", "d"):  # on the device
        cache.unpin(cache.get(key))
    for key in ("p", "a", "nowhere"):  # p and a were pushed to host (then disk); nowhere is a miss everywhere
        seg = cache.get(key)
        if seg is not None:
            cache.unpin(seg)
    report = cache.report()
    device, host_row, disk_row = report["tiers"]
    assert [r["label"] for r in report["tiers"]] == ["device pool", "host", "disk"]
    assert device["entries"] == len(cache) and device["bytes"] == cache.cached_bytes <= budget
    assert device["hits"] == 3 and device["misses"] == 3 and device["hit_rate"] == 0.5 and device["evictions"] >= 3
    served = host_row["hits"] + disk_row["hits"]
    assert served == 2 and host_row["misses"] == 3 - host_row["hits"]  # p, a and nowhere reached the host tier
    assert disk_row["misses"] == 3 - host_row["hits"] - disk_row["hits"]  # those it did not serve went on to disk
    assert host_row["entries"] + disk_row["entries"] >= 3 and host_row["bytes"] <= host and disk_row["bytes"] > 0
    assert host_row["evictions"] >= 1  # the host tier held two: the third pushed one down to disk
    assert report["lookups"] == 6 and report["misses"] == 1 and report["hit_rate"] == 5 / 6
    assert report["reuse"] == {"prefix": {"hits": 1, "tokens": 8}, "chunk": {"hits": 4, "tokens": 32}}


def test_a_segment_the_budget_had_no_room_for_spills_to_the_host_tier_when_its_last_user_is_done():
    cache = make(num_blocks=8, budget_bytes=2 * BPB, host_bytes=1 << 20, stored_kv_dtype="float32")
    k, v = rand_kv(8, seed=3)
    resident = add(cache, "resident", pin=True)  # fills the budget and stays in use
    spilled = add(cache, "new", pin=True, fill=(k, v))
    assert spilled.transient and spilled.spill and "new" not in cache
    cache.unpin(spilled)  # its request ends: the KV goes to the host, its blocks back to the pool
    assert cache.pool.num_free == 8 - len(resident.blocks)
    cache.unpin(resident)
    seg = cache.get("new")  # promoted from the host, bit-exact (float32 kept)
    assert seg is not None and cache.stats.tier_hits == 1
    k2, v2 = cache.read_kv(seg)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_a_discarded_segment_is_never_found_again_nor_demoted():
    cache = make(num_blocks=8, host_bytes=1 << 20)
    seg = add(cache, "bad", pin=True)
    cache.discard(seg)
    assert "bad" not in cache and cache.get("bad") is None
    cache.unpin(seg)
    assert cache.pool.num_free == 8 and cache.stats.demotions == 0 and not any("bad" in t for t in cache.tiers)


def test_reconfigure_replaces_the_host_tier_it_made_and_keeps_one_added_later(tmp_path):
    cache = make(num_blocks=8)
    store = DiskTier(tmp_path / "store", 1 << 20)
    cache.add_tier(store)
    cache.reconfigure(CacheConfig(host_bytes=1 << 20))
    assert [t.name for t in cache.tiers] == ["host", "disk"] and cache.tiers[1] is store
    add(cache, "a")
    cache.reconfigure(CacheConfig())  # "a" went down to the host tier, which goes with the config that made it
    assert cache.tiers == [store] and cache.get("a") is None
    with pytest.raises(ValueError, match="meta"):
        CacheManager(BlockPool(SHAPE, 4, torch.device("meta"))).reconfigure(CacheConfig(host_bytes=1 << 20))
