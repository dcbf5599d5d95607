"""CacheBlend-style selective recompute (``lazy:blend=R``): exact at R=1, plain lazy when nothing
is selected, never writes the shared chunk KV, and recomputes the most-deviating tokens."""
import pytest
import torch

from lazyrag.engine.blend import select, selective_recompute
from lazyrag.strategy_names import lazy_options
from tests.test_engine import CHUNKS, QUESTION, rel_err


def test_blending_every_token_is_full_prefill(engine):
    """With every chunk token recomputed in context, the prompt's KV is exactly full prefill's."""
    layout = engine.build_prompt(QUESTION, CHUNKS[:4])
    full = engine.layout_logits(layout, "full")
    lazy = engine.layout_logits(layout, "lazy")
    blended = engine.layout_logits(layout, "lazy:blend=1")
    assert rel_err(blended, full) < 1e-4 < rel_err(lazy, full)
    # first=K forces each chunk's first K tokens in: K over every chunk is the same thing
    heads = engine.layout_logits(layout, "lazy:first=4096:blend=1e-9")
    assert rel_err(heads, full) < 1e-4


def test_blending_nothing_is_lazy(tiny_engine):
    layout = tiny_engine.build_prompt(QUESTION, CHUNKS[:3])
    lazy = tiny_engine.layout_logits(layout, "lazy")
    assert torch.equal(tiny_engine.layout_logits(layout, "lazy:blend=1e-9"), lazy)  # rounds to no token


def test_shared_chunk_kv_is_never_written(tiny_engine):
    engine = tiny_engine
    engine.cache.clear()
    engine.precache(CHUNKS[:3])
    pool, free = engine.cache.pool, engine.cache.pool.num_free
    blocks = torch.tensor([b for s in engine.cache._segments.values() for b in s.blocks])
    k, v = pool.k[:, blocks].clone(), pool.v[:, blocks].clone()
    r = engine.generate(QUESTION, CHUNKS[:3], max_new_tokens=2, strategy="lazy:blend=0.5")
    assert r.stats.chunks_hit == 3 and r.stats.tokens_recomputed > 0
    assert torch.equal(pool.k[:, blocks], k) and torch.equal(pool.v[:, blocks], v)
    assert pool.num_free == free  # the private copies went back with the request


def test_the_most_deviating_tokens_are_selected(tiny_engine):
    engine = tiny_engine
    layout = engine.build_prompt(QUESTION, CHUNKS[:3])
    lazy = engine.scheduler.planner["lazy"]
    plan = lazy.plan(layout)
    owned = []

    def allocate(n):
        owned.extend(engine.cache.allocate(n))
        return owned[-n:]

    try:
        b = selective_recompute(engine.runner, plan.context, [None, *layout.chunk_ids], 0.3, allocate)
        chunk_tokens = sum(map(len, layout.chunk_ids))
        assert len(b.selected) == round(0.3 * chunk_tokens) and b.deviation.shape == (chunk_tokens,)
        chosen = torch.zeros(chunk_tokens, dtype=torch.bool)
        chosen[b.selected] = True
        assert b.deviation[chosen].min() >= b.deviation[~chosen].max() > 0
        L = len(engine.model.layers)
        assert b.cost == pytest.approx((chunk_tokens + len(b.selected) * (L - 1)) / L)
        # the private copies replace the chunks in the context, read at the same delta
        assert [p.delta for p in b.context] == [p.delta for p in plan.context]
        copies = {blk for p in b.context if p.segment.kind == "blended" for blk in p.segment.blocks}
        assert owned and set(owned) <= copies
    finally:
        engine.cache.pool.decref(owned)
        lazy.release(plan)


def test_select_globally_per_chunk_and_forced():
    dev = torch.tensor([5.0, 4.0, 3.0, 0.1, 0.2, 0.3, 0.4, 2.0])
    chunk = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    none = torch.zeros(8, dtype=torch.bool)
    assert select(dev, chunk, 0.25, none).tolist() == [0, 1]  # global: chunk 1 gets nothing
    assert select(dev, chunk, 0.4, none, per_chunk=True).tolist() == [0, 6, 7]  # 1 of 3, 2 of 5
    forced = torch.tensor([False, False, False, True, False, False, False, False])
    assert select(dev, chunk, 0.25, forced).tolist() == [0, 1, 3]


def test_blend_through_generate_on_the_default_model(default_engine):
    layout = default_engine.build_prompt(QUESTION, CHUNKS)
    default_engine.precache(CHUNKS)  # so that tokens_prefilled counts no chunk encoding
    r = default_engine.generate(QUESTION, CHUNKS, max_new_tokens=16, strategy="lazy:blend=0.15")
    chunk_tokens = sum(map(len, layout.chunk_ids))
    assert r.stats.tokens_recomputed == round(0.15 * chunk_tokens)
    L = len(default_engine.model.layers)
    cost = round((chunk_tokens + r.stats.tokens_recomputed * (L - 1)) / L)
    assert r.stats.tokens_prefilled == len(layout.question_ids) + cost
    assert "19" in r.text  # 1903 / 1911, as full prefill answers


def test_strategy_names():
    assert lazy_options("lazy:blend=0.15") == {"blend": 0.15}
    assert lazy_options("lazy:first=16:blend=0.1:select=chunk") == {"recompute_first": 16, "blend": 0.1, "blend_per_chunk": True}
    for bad in ("lazy:blend=0", "lazy:blend=1.5", "lazy:blend=x", "lazy:select=chunk", "lazy:first=0", "lazy:blend=0.1:blend=0.2", "lazy:foo=1"):
        with pytest.raises(ValueError, match="lazy:blend=R"):
            lazy_options(bad)
