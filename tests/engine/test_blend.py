"""CacheBlend-style selective recompute (``lazy:blend=R``): exact at R=1, plain lazy when nothing
is selected, never writes the shared chunk KV, and recomputes the most-deviating tokens."""

from contextlib import contextmanager

import pytest
import torch

from lazyrag.engine.blend import select, selective_recompute
from lazyrag.strategy_names import lazy_options
from tests.helpers import CHUNKS, QUESTION, rel_err


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


def test_the_recompute_kernel_blends_as_the_reference(default_hf, monkeypatch):
    """The Triton attention a GPU recovery runs (here in Triton's interpreter) gives the fp32 reference's logits,
    for partial blends (scattered queries in layers 2-3) and a full one (every chunk token: full prefill)."""
    from transformers import LlamaForCausalLM

    from lazyrag.engine import LazyEngine, blend
    from tests.conftest import tiny_llama_config

    torch.manual_seed(7)
    hf = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)).eval()
    engine = LazyEngine.from_hf(hf, default_hf[1], device="cpu", kv_budget=16 << 20)
    layout = engine.build_prompt(QUESTION, CHUNKS[:3])
    strategies = ("lazy:blend=0.3", "lazy:blend=0.3:select=attn_dev", "lazy:blend=1")
    reference = {s: engine.layout_logits(layout, s) for s in strategies}
    monkeypatch.setattr(blend, "KERNEL_ON_CPU", True)
    for strategy, ref in reference.items():
        assert rel_err(engine.layout_logits(layout, strategy), ref) < 1e-4
    full = engine.layout_logits(layout, "full")
    assert rel_err(reference["lazy:blend=1"], full) < 1e-4 < rel_err(reference["lazy:blend=0.3"], full)


def test_a_recompute_kernel_that_fails_its_check_leaves_the_reference(monkeypatch, caplog):
    """On first use per layout the kernel is checked against the reference on a small problem: a build that raises or
    computes wrong is not used (a warning, the reference's answers)."""
    from lazyrag.engine import blend

    check = blend._kernel_checked.__wrapped__
    monkeypatch.setattr(blend, "prefix_attention", lambda q, *a: torch.zeros_like(q))
    assert not check(torch.device("cpu"), torch.float32, 4, 2, 16, 0.25) and "off by" in caplog.text

    def broken(*a):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(blend, "prefix_attention", broken)
    assert not check(torch.device("cpu"), torch.float32, 4, 2, 16, 0.25) and "no such instruction" in caplog.text
    monkeypatch.undo()
    caplog.clear()  # the context's gather is checked too
    monkeypatch.setattr(blend, "gather_rotated", lambda k, v, slots, *a: (k[slots], v[slots]))  # forgets to rotate
    assert not check(torch.device("cpu"), torch.float32, 4, 2, 16, 0.25) and "off by" in caplog.text
    monkeypatch.undo()
    assert check(torch.device("cpu"), torch.float32, 4, 2, 16, 0.25)  # the real one (Triton's interpreter here)


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
    with blended(engine, layout, 0.3) as (plan, b, owned):
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
    # the answer starts with the token the same plan's logits pick (an answer's quality is the eval's business)
    assert r.token_ids[0] == int(default_engine.layout_logits(layout, "lazy:blend=0.15").argmax())


def test_strategy_names():
    assert lazy_options("lazy:blend=0.15") == {"blend": 0.15}
    assert lazy_options("lazy:first=16:blend=0.1:select=chunk") == {
        "recompute_first": 16,
        "blend": 0.1,
        "blend_select": "chunk",
    }
    assert lazy_options("lazy:first=4:blend=0.12:select=attn_dev") == {
        "recompute_first": 4,
        "blend": 0.12,
        "blend_select": "attn_dev",
    }
    assert lazy_options("lazy:blend=0.15:select=gradual") == {"blend": 0.15, "blend_select": "gradual"}
    assert lazy_options("lazy:blend=0.15:select=attn:budget=chunk:attn_from=0.5") == {
        "blend": 0.15,
        "blend_select": "attn",
        "blend_budget": "chunk",
        "attn_from": 0.5,
    }
    for bad in (
        "lazy:blend=0.1:select=attention",
        "lazy:blend=1.5",
        "lazy:blend=x",
        "lazy:select=chunk",
        "lazy:first=0",
        "lazy:blend=0.1:blend=0.2",
        "lazy:foo=1",
        "lazy:budget=chunk",
        "lazy:blend=0.1:budget=each",
        "lazy:blend=0.1:attn_from=0.5",
        "lazy:blend=0.1:select=attn:attn_from=1",
        "lazy:blend=0.1:select=attn:attn_from=-0.1",
    ):
        with pytest.raises(ValueError, match="lazy:blend=R"):
            lazy_options(bad)


@pytest.mark.parametrize("selection", ["attn", "attn_dev", "gradual", "chunk", "attn_dev:budget=chunk:attn_from=0.5"])
def test_every_selection_blending_every_token_is_full_prefill(engine, selection):
    """R=1 under any selection recomputes every chunk token in context: full prefill's logits."""
    layout = engine.build_prompt(QUESTION, CHUNKS[:4])
    full = engine.layout_logits(layout, "full")
    assert rel_err(engine.layout_logits(layout, f"lazy:blend=1:select={selection}"), full) < 1e-4
    # and with nothing selected, plain lazy
    lazy = engine.layout_logits(layout, "lazy")
    assert torch.equal(engine.layout_logits(layout, f"lazy:blend=1e-9:select={selection}"), lazy)


@contextmanager
def blended(engine, layout, ratio, **kw):
    """(lazy plan, its Blend, the private blocks) for ``layout``; plan and blocks are given back on exit."""
    lazy = engine.core.planner["lazy"]
    plan = lazy.plan(layout)
    owned = []

    def allocate(n):
        owned.extend(engine.cache.allocate(n))
        return owned[-n:]

    try:
        yield (
            plan,
            selective_recompute(
                engine.runner,
                plan.context,
                [None, *layout.chunk_ids],
                ratio,
                allocate,
                question=list(layout.question_ids),
                question_start=layout.question_start,
                **kw,
            ),
            owned,
        )
    finally:
        engine.cache.pool.decref(owned)
        lazy.release(plan)


def _blend(engine, layout, ratio, **kw):
    with blended(engine, layout, ratio, **kw) as (plan, b, _):
        return plan, b


def test_attention_selection_takes_what_the_question_reads(default_engine):
    """select=attn recomputes the chunk tokens the question attends to most over the cached context:
    here the question quotes one chunk's rare phrase, and that chunk gets most of the picks."""
    engine = default_engine
    chunks = [
        CHUNKS[0],
        "The zorblax quartermaster of Vellinghaven keeps seventeen copper lanterns in the tower.",
        CHUNKS[2],
    ]
    question = "How many copper lanterns does the zorblax quartermaster of Vellinghaven keep?"
    layout = engine.build_prompt(question, chunks)
    plan, b = _blend(engine, layout, 0.1, selection="attn")
    sizes = [len(c) for c in layout.chunk_ids]
    C = sum(sizes)
    assert len(b.selected) == round(0.1 * C)
    # the same scores, computed on their own: the selection is their top R
    from lazyrag.engine.blend import PlacedContext, question_attention

    engine.precache(chunks)
    plan2 = engine.core.planner["lazy"].plan(layout)
    try:
        n_prefix = plan2.context[0].segment.num_tokens
        ctx = PlacedContext(engine.runner, plan2.context)
        assert len(ctx) == n_prefix + C
        score, ran = question_attention(engine.runner, ctx, list(layout.question_ids), layout.question_start)
        L = len(engine.model.layers)
        late, _ = question_attention(engine.runner, ctx, list(layout.question_ids), layout.question_start, (L // 2, L))
    finally:
        engine.core.planner["lazy"].release(plan2)
    assert ran == len(engine.model.layers)
    top = score[n_prefix:].topk(len(b.selected)).indices.sort().values
    assert torch.equal(b.selected, top)
    owner = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
    picks = torch.bincount(owner[b.selected], minlength=3).float() / torch.tensor(sizes)
    assert picks.argmax() == 1  # the quoted chunk, densest in picks
    # cost: the question through every layer, then only the selected tokens (no layer-0 pass over all chunks)
    assert b.cost == pytest.approx(len(layout.question_ids) + len(b.selected))

    # attn_from=0.5: the top R by the attention of the second half of the layers alone
    _, b_late = _blend(engine, layout, 0.1, selection="attn", attn_from=0.5)
    assert torch.equal(b_late.selected, late[n_prefix:].topk(len(b.selected)).indices.sort().values)
    assert not torch.equal(b_late.selected, b.selected)  # the early layers' attention did count before
    # budget=chunk: R of each chunk, each chunk's own top by the same scores
    _, b_each = _blend(engine, layout, 0.1, selection="attn", per_chunk=True)
    start = 0
    for _i, size in enumerate(sizes):
        mine = b_each.selected[(b_each.selected >= start) & (b_each.selected < start + size)]
        assert len(mine) == round(0.1 * size)
        assert torch.equal(
            mine, start + score[n_prefix + start : n_prefix + start + size].topk(len(mine)).indices.sort().values
        )
        start += size


def test_gradual_filtering_keeps_a_subset_of_the_first_pick(default_engine):
    engine = default_engine  # 30 layers (the tiny model has too few for two filtering stages)
    layout = engine.build_prompt(QUESTION, CHUNKS[:3])
    _, one = _blend(engine, layout, 0.3)
    _, grad = _blend(engine, layout, 0.15, selection="gradual")
    C = one.deviation.numel()
    assert len(grad.selected) == round(0.15 * C)
    assert set(grad.selected.tolist()) <= set(one.selected.tolist())  # 2R by layer-1 deviation, then R by layer 2's
    assert torch.allclose(grad.deviation, one.deviation)
    L = len(engine.model.layers)
    assert grad.cost == pytest.approx((C + len(one.selected) + len(grad.selected) * (L - 2)) / L)


def test_the_named_recovery_is_its_spelled_out_strategy_everywhere(default_engine):
    """``lazy+recover`` is the one name for the chosen recovery: the engine runs it as ``RECOVER_AS`` (and it
    moves lazy's next-token distribution towards full prefill's), and the CLI and both adapters accept it."""
    from lazyrag.cli import build_parser
    from lazyrag.integrations.langchain import ChatLazyLlama
    from lazyrag.integrations.llama_index import LazyLlamaLLM
    from lazyrag.strategy_names import RECOVER, RECOVER_AS

    layout = default_engine.build_prompt(QUESTION, CHUNKS[:4])
    full, lazy = (default_engine.layout_logits(layout, s).log_softmax(-1) for s in ("full", "lazy"))
    named, spelled = (default_engine.layout_logits(layout, s) for s in (RECOVER, RECOVER_AS))
    assert rel_err(named, spelled) < 1e-5
    kl = lambda lp: float((full.exp() * (full - lp)).sum())  # noqa: E731
    assert kl(named.log_softmax(-1)) < kl(lazy)
    r = default_engine.generate(QUESTION, CHUNKS[:4], max_new_tokens=2, strategy=RECOVER)
    assert r.stats.tokens_recomputed > 0
    assert build_parser().parse_args(["ask", "q", "--strategy", RECOVER]).strategy == RECOVER
    assert LazyLlamaLLM(strategy=RECOVER).strategy == RECOVER and ChatLazyLlama(strategy=RECOVER).strategy == RECOVER


@pytest.mark.parametrize("strategy", ["lazy", "lazy:first=4"])  # first=4: placements read from their second block on
def test_placed_context_reads_what_the_reference_gathers(tiny_engine, strategy):
    """blend's per-request context (slots and rotations worked out once) equals the kernels' reference
    gather of the same placements' block metas, layer by layer, kept or not."""
    from lazyrag.engine.blend import PlacedContext
    from lazyrag.engine.runner import SeqState
    from lazyrag.kernels.reference import gather_context

    engine = tiny_engine
    layout = engine.build_prompt(QUESTION, CHUNKS[:3])
    planner = engine.core.planner[strategy]
    plan = planner.plan(layout)
    try:
        assert strategy == "lazy" or any(p.first_block for p in plan.context)
        meta = torch.from_numpy(
            SeqState(context=plan.context, blocks=[], next_pos=0).block_meta(engine.cache.pool.shape.block_size, 0)
        )
        ctx = PlacedContext(engine.runner, plan.context)
        pool, r = engine.cache.pool, engine.runner
        for layer in range(pool.k.shape[0]):
            k_ref, v_ref = gather_context(pool.k[layer], pool.v[layer], meta, r.rope_cos, r.rope_sin)
            for keep in (True, False):  # the kept copy, then a fresh gather
                k, v = ctx.layer(layer, keep=keep)
                assert k.shape == k_ref.shape and torch.equal(k, k_ref) and torch.equal(v, v_ref)
        assert ctx.position.tolist() == [
            p.segment.start + p.delta + t
            for p in plan.context
            for t in range(p.first_block * pool.shape.block_size, p.segment.num_tokens)
        ]
    finally:
        planner.release(plan)


def test_writing_several_layers_at_once_equals_writing_each(tiny_engine):
    pool = tiny_engine.cache.pool
    blocks = pool.allocate(2)
    try:
        slots = pool.slots(blocks, 5, start=3)
        L, _, _, hkv, hd = pool.k.shape
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(L - 1, 5, hkv, hd, generator=g), torch.randn(L - 1, 5, hkv, hd, generator=g)
        pool.write_layers(list(range(1, L)), slots, k, v)
        got = pool.k.clone(), pool.v.clone()
        for i in range(1, L):
            pool.write(i, slots, -k[i - 1], -v[i - 1])  # poison, then the per-layer write must restore it
            pool.write(i, slots, k[i - 1], v[i - 1])
        assert torch.equal(pool.k, got[0]) and torch.equal(pool.v, got[1])
        assert torch.equal(pool.k[1].view(-1, hkv, hd)[slots], k[0].to(pool.k.dtype))
    finally:
        pool.decref(blocks)
