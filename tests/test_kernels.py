"""LazyAttention Triton kernels against the PyTorch reference.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so those shapes are tiny and fp32; the ``gpu`` tests use bf16/fp16 and real-ish shapes.
Every case draws fresh random data, shuffles the physical block ids, pads the last block
of each document, and poisons the output with NaN so unwritten elements fail.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from lazyrag.kernels.decode import CONFIGS as DECODE_CONFIGS
from lazyrag.kernels.decode import choose_splits, lazy_decode
from lazyrag.kernels.gemm import CANDIDATES as SKINNY_CANDIDATES
from lazyrag.kernels.gemv import CANDIDATES as GEMV_CANDIDATES
from lazyrag.kernels.kvloop import merge_splits, split_counters, tile_table
from lazyrag.kernels.prefill import CONFIGS as PREFILL_CONFIGS
from lazyrag.kernels.prefill import lazy_prefill
from lazyrag.kernels.common import pack_block_meta, unpack_block_meta
from lazyrag.kernels.reference import apply_rotary, lazy_decode_reference, lazy_prefill_reference, rope_tables

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _hopper() -> bool:
    from lazyrag.kernels import prefill_wgmma
    return CUDA and prefill_wgmma.HAVE_GLUON and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Triton with Gluon")
MAX_POS = 1 << 15


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output (unwritten or bad masking)"
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: torch.Tensor  # [B, max_blocks] int64 packed
    nblocks: torch.Tensor  # [B]
    docs: list  # per sequence: list of (first block index in the row, n blocks, delta)


def make_paged(gen, docs_per_seq, hkv, d, bs, dtype, device, reuse_first_doc=False, max_delta=MAX_POS - 1):
    """Build a shuffled paged pool and per-sequence block tables.

    docs_per_seq: per sequence a list of document lengths in tokens. Each document owns
    whole blocks (last one padded) at random physical ids and gets a random delta. With
    reuse_first_doc, the first document of sequence 0 appears again at the end of that
    sequence: same physical blocks, another delta.
    """
    doc_blocks = [[(n + bs - 1) // bs for n in seq] for seq in docs_per_seq]
    total = sum(sum(x) for x in doc_blocks) + 3  # a few unused blocks in the pool
    perm = torch.randperm(total, generator=gen)
    k_cache = torch.randn(total, bs, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(total, bs, hkv, d, generator=gen).to(dtype).to(device)
    rows, docs, nxt = [], [], 0
    for s, seq in enumerate(docs_per_seq):
        ids, dl, vl, info = [], [], [], []
        for n, nb in zip(seq, doc_blocks[s]):
            phys = perm[nxt: nxt + nb]
            nxt += nb
            delta = int(torch.randint(0, max_delta + 1, (1,), generator=gen))
            info.append((len(ids), nb, delta))
            ids += phys.tolist()
            dl += [delta] * nb
            vl += [bs] * (nb - 1) + [n - (nb - 1) * bs]
        if reuse_first_doc and s == 0 and seq:
            _, nb0, _ = info[0]
            delta = int(torch.randint(0, max_delta + 1, (1,), generator=gen))
            info.append((len(ids), nb0, delta))
            ids += ids[:nb0]
            dl += [delta] * nb0
            vl += vl[:nb0]
        rows.append((ids, dl, vl))
        docs.append(info)
    width = max(1, max(len(r[0]) for r in rows)) + 2  # padded table, junk beyond nblocks
    meta = torch.zeros(len(rows), width, dtype=torch.int64)
    for s, (ids, dl, vl) in enumerate(rows):
        if ids:
            meta[s, : len(ids)] = pack_block_meta(torch.tensor(ids), torch.tensor(dl), torch.tensor(vl))
        meta[s, len(ids):] = pack_block_meta(torch.tensor([total - 1]), torch.tensor([7]), torch.tensor([bs]))
    nblocks = torch.tensor([len(r[0]) for r in rows], dtype=torch.int32)
    return Paged(k_cache, v_cache, meta.to(device), nblocks.to(device), docs)


def make_rope(d, device, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = rope_tables(inv_freq, MAX_POS)
    return cos.to(device), sin.to(device)


def rotated_in_place(p: Paged, cos, sin):
    """The same pool, metas and layout, with every used block's K re-rotated by its delta (each
    block belongs to one document here, except a reused one, which gets its own copy)."""
    ids, deltas, valid = unpack_block_meta(p.meta)
    k = p.k_cache.clone()
    extra, meta = [], p.meta.clone()
    seen = {}
    for b in range(p.meta.shape[0]):
        for j in range(int(p.nblocks[b])):
            phys, d = int(ids[b, j]), int(deltas[b, j])
            if phys in seen and seen[phys] != d:  # a document reused at another offset: a private block
                extra.append((b, j, phys, d))
                continue
            seen[phys] = d
            k[phys] = apply_rotary(p.k_cache[phys].float(), cos[d], sin[d]).to(k.dtype)
    v = p.v_cache
    if extra:
        k = torch.cat((k, torch.stack([apply_rotary(p.k_cache[ph].float(), cos[d], sin[d]).to(k.dtype)
                                       for _, _, ph, d in extra])))
        v = torch.cat((v, torch.stack([p.v_cache[ph] for _, _, ph, _ in extra])))
        for i, (b, j, _, d) in enumerate(extra):
            meta[b, j] = pack_block_meta(torch.tensor([p.k_cache.shape[0] + i]), torch.tensor([d]),
                                         valid[b, j].view(1))[0]
    return Paged(k, v, meta, p.nblocks, p.docs)


def prerotated(p: Paged, cos, sin):
    """Materialise every (sequence, block) re-rotated by its delta into its own block; deltas 0."""
    ids, deltas, valid = unpack_block_meta(p.meta)
    B, W = p.meta.shape
    k = apply_rotary(p.k_cache[ids.reshape(-1)].float(), cos[deltas.reshape(-1)][:, None, None, :],
                     sin[deltas.reshape(-1)][:, None, None, :]).to(p.k_cache.dtype)
    v = p.v_cache[ids.reshape(-1)]
    new_ids = torch.arange(B * W, device=p.meta.device).reshape(B, W)
    meta0 = pack_block_meta(new_ids, torch.zeros_like(deltas), valid)
    return Paged(k, v.clone(), meta0, p.nblocks, p.docs)


def make_prefill(seed, new_lens, docs_per_seq, hq, hkv, d, bs, dtype, device, reuse_first_doc=False):
    gen = torch.Generator().manual_seed(seed)
    p = make_paged(gen, docs_per_seq, hkv, d, bs, dtype, device, reuse_first_doc)
    tq = sum(new_lens)
    q = torch.randn(tq, hq, d, generator=gen).to(dtype).to(device)
    k_new = torch.randn(tq, hkv, d, generator=gen).to(dtype).to(device)
    v_new = torch.randn(tq, hkv, d, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + list(torch.tensor(new_lens).cumsum(0)), dtype=torch.int32, device=device)
    return p, q, k_new, v_new, cu


def run_prefill(p, q, k_new, v_new, cu, cos, sin, scale, **kw):
    out = torch.full_like(q, float("nan"))
    return lazy_prefill(q, k_new, v_new, cu, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, scale,
                        out=out, **kw)


def ref_prefill(p, q, k_new, v_new, cu, cos, sin, scale, meta=None):
    return lazy_prefill_reference(q, k_new, v_new, cu, p.k_cache, p.v_cache, p.meta if meta is None else meta,
                                  p.nblocks, cos, sin, scale)


def run_decode(p, q, cos, sin, scale, **kw):
    out = torch.full_like(q, float("nan"))
    return lazy_decode(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, scale, out=out, **kw)


# ---------------------------------------------------------------- CPU (interpreter), fp32
# (seed, new token counts, documents per sequence (tokens), Hq, Hkv, D, block_size)
PREFILL_CASES = [
    (1, [5], [[20, 9]], 2, 2, 64, 16),  # MHA, two docs, padded last blocks
    (2, [3, 6], [[17], [16, 40]], 6, 2, 64, 16),  # GQA 3, batch of unequal lengths
    (3, [4, 0, 2], [[33, 5], [8], []], 4, 1, 64, 16),  # MQA/GQA 4, empty query seq, 0 ctx blocks
    (4, [2], [[12, 20, 7]], 8, 1, 128, 32),  # GQA 8, head dim 128, block 32
    (5, [40, 3], [[20], [9, 30]], 4, 2, 64, 16),  # 40 new tokens: unmasked new-token tiles before the diagonal
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"seed{c[0]}")
def test_prefill_matches_reference(case):
    seed, new_lens, docs, hq, hkv, d, bs = case
    p, q, kn, vn, cu = make_prefill(seed, new_lens, docs, hq, hkv, d, bs, torch.float32, "cpu",
                                    reuse_first_doc=seed == 1)
    cos, sin = make_rope(d, "cpu")
    scale = d ** -0.5
    out = run_prefill(p, q, kn, vn, cu, cos, sin, scale)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, scale)
    assert rel_err(out, ref) < 1e-4


def test_prefill_tile_spans_several_documents():
    # one-block documents and a 4-page KV tile: every tile straddles segment boundaries,
    # and the same document sits at two offsets
    p, q, kn, vn, cu = make_prefill(11, [3], [[5, 16, 3, 30, 2]], 4, 2, 64, 16, torch.float32, "cpu",
                                    reuse_first_doc=True)
    cos, sin = make_rope(64, "cpu")
    out = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125, config=(16, 64, 1, 1))
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    assert rel_err(out, ref) < 1e-4


def test_prefill_wrong_rotation_is_detected():
    p, q, kn, vn, cu = make_prefill(12, [4], [[20, 24]], 2, 1, 64, 16, torch.float32, "cpu")
    cos, sin = make_rope(64, "cpu")
    out = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    ids, deltas, valid = unpack_block_meta(p.meta)
    wrong = pack_block_meta(ids, (deltas + 1) % MAX_POS, valid)  # off by one position
    assert rel_err(out, ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)) < 1e-4
    assert rel_err(out, ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125, meta=wrong)) > 1e-2


def test_prefill_no_rotation_on_prerotated_keys():
    p, q, kn, vn, cu = make_prefill(13, [3, 2], [[18, 7], [25]], 4, 2, 64, 16, torch.float32, "cpu")
    cos, sin = make_rope(64, "cpu")
    pre = prerotated(p, cos, sin)
    out = run_prefill(pre, q, kn, vn, cu, cos, sin, 0.125, apply_rotation=False)
    assert rel_err(out, ref_prefill(pre, q, kn, vn, cu, cos, sin, 0.125)) < 1e-4
    lazy = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    assert rel_err(lazy, out) < 1e-4


# (seed, new token counts, documents per sequence (tokens), Hq, Hkv, D, block_size, num_splits)
PREFILL_SPLIT_CASES = [
    (31, [5], [[20, 9, 40]], 2, 2, 64, 16, 3),  # MHA, repeated doc, more splits than some ranges hold
    (32, [3, 6, 0], [[17], [16, 40, 33], []], 6, 2, 64, 16, 2),  # GQA 3, unequal batch, empty seq/ctx
    (33, [4, 1], [[33, 5], [8, 70]], 4, 1, 64, 16, 4),  # GQA 4 (MQA)
    (34, [2], [[12, 20, 7, 45]], 8, 1, 128, 32, 7),  # GQA 8, head dim 128, block 32, a split with no blocks
]


@pytest.mark.parametrize("case", PREFILL_SPLIT_CASES, ids=lambda c: f"seed{c[0]}")
def test_prefill_split_context_matches_reference(case):
    # context split over programs + merge kernel (the path short prefills take on the GPU)
    seed, new_lens, docs, hq, hkv, d, bs, splits = case
    p, q, kn, vn, cu = make_prefill(seed, new_lens, docs, hq, hkv, d, bs, torch.float32, "cpu",
                                    reuse_first_doc=seed == 31)
    cos, sin = make_rope(d, "cpu")
    scale = d ** -0.5
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, scale)
    for fused in (False, True):  # merged by a second kernel, or by the last split program of each query tile
        out = run_prefill(p, q, kn, vn, cu, cos, sin, scale, num_splits=splits, fused_merge=fused)
        assert rel_err(out, ref) < 1e-4
    assert not split_counters(q.device, 1).any()
    pre = prerotated(p, cos, sin)
    off = run_prefill(pre, q, kn, vn, cu, cos, sin, scale, apply_rotation=False, num_splits=splits)
    assert rel_err(off, ref) < 1e-4
    for mode in (1, 2, 5, 7):  # the query-rotation schedules
        out = run_prefill(p, q, kn, vn, cu, cos, sin, scale, num_splits=splits, rotation_mode=mode)
        assert rel_err(out, ref) < 1e-4


def test_prefill_rotation_off_in_the_lazy_layout():
    # the benchmark's fair baseline: the same shuffled blocks and metas, K re-rotated in place
    p, q, kn, vn, cu = make_prefill(35, [3, 2], [[18, 7], [25]], 4, 2, 64, 16, torch.float32, "cpu")
    cos, sin = make_rope(64, "cpu")
    pre = rotated_in_place(p, cos, sin)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    qd = torch.randn(2, 4, 64)
    refd = lazy_decode_reference(qd, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 0.125)
    for mode in (2, 3, 5, 7):  # each schedule's rotation-off counterpart (ROT 4, 0, 6 and 8)
        off = run_prefill(pre, q, kn, vn, cu, cos, sin, 0.125, apply_rotation=False, rotation_mode=mode)
        assert rel_err(off, ref) < 1e-4
        offd = run_decode(pre, qd, cos, sin, 0.125, apply_rotation=False, num_splits=2, rotation_mode=mode)
        assert rel_err(offd, refd) < 1e-4


def _tile_table_layout(seed, bs):
    """Block tables for the tile-table tests: short and long documents, an empty row, a row of one 400-token
    document, and a last row whose second document shares the first one's delta (one delta, a partly filled block
    inside). The first document of row 0 is reused at another offset. Returns (paged, ids, deltas, valid,
    the last row's first-document block count)."""
    gen = torch.Generator().manual_seed(seed)
    p = make_paged(gen, [[5, 16, 3, 300, 2, 9], [], [400], [17, 17, 17, 40]], 1, 64, bs, torch.float32, "cpu",
                   reuse_first_doc=True)
    ids, deltas, valid = unpack_block_meta(p.meta)
    nb0 = (17 + bs - 1) // bs
    p.meta[3, nb0: 2 * nb0] = pack_block_meta(ids[3, nb0: 2 * nb0], deltas[3, :nb0], valid[3, nb0: 2 * nb0])
    return (p, *unpack_block_meta(p.meta), nb0)


@pytest.mark.parametrize("pages", [1, 2, 4])
def test_tile_table(pages):
    # segment-aligned tiles: each tile lies in one segment (blocks of one delta, ended by a partly filled
    # block), holds <= pages blocks, and together they cover every block once in order; the sentinel is the
    # block count; each row also holds the tile's valid keys and delta. Chunk of 16 blocks in the interpreter,
    # so rows of 40 blocks cross chunk boundaries inside a segment. The first document is reused with the same
    # delta in the last row, so one segment there holds a partly filled block before its end.
    bs = 16
    p, ids, deltas, valid, nb0 = _tile_table_layout(40 + pages, bs)
    tiles, n_tiles = tile_table(p.meta, p.nblocks, pages, bs)
    assert tiles.shape[-1] == 4
    for b in range(p.meta.shape[0]):
        nb, n = int(p.nblocks[b]), int(n_tiles[b])
        starts = tiles[b, : n + 1, 0].tolist()
        assert starts[-1] == nb and (n == 0) == (nb == 0)
        seg_starts = {0} | {j for j in range(1, nb)
                            if deltas[b, j] != deltas[b, j - 1] or valid[b, j - 1] < bs}
        if b == 3:
            assert deltas[b, nb0] == deltas[b, 0] and nb0 in seg_starts  # a segment ended by a partial block
        want, j = [], 0
        while j < nb:  # expected: restart at every segment start, else every `pages` blocks
            want.append(j)
            j += 1
            while j < nb and j not in seg_starts and (j - want[-1]) < pages:
                j += 1
        assert starts[:-1] == want
        # link to the first tile of the next segment (n after the last segment)
        seg_tiles = [i for i in range(n) if starts[i] in seg_starts]
        assert tiles[b, :n, 1].tolist() == [min([i2 for i2 in seg_tiles if i2 > i] + [n]) for i in range(n)]
        # valid keys: a prefix of the tile (only its last block partly filled); the tile's delta
        for i in range(n):
            blocks = range(starts[i], starts[i + 1])
            assert all(int(valid[b, j]) == bs for j in blocks[:-1])
            assert int(tiles[b, i, 2]) == sum(int(valid[b, j]) for j in blocks)
            assert int(tiles[b, i, 3]) == int(deltas[b, starts[i]])


@pytest.mark.parametrize("pages", [1, 4, 8])
def test_packed_tile_table(pages):
    # packed tiles (the Hopper prefill's table): tile u is blocks [u * pages, (u + 1) * pages) across documents;
    # keys = the valid-key count where they are a prefix and one delta serves the tile, else -(keys spanned);
    # segments = runs of tiles whose first blocks share a delta, ended by a mixed tile. The last row's second
    # document shares the first one's delta, so a tile there has one delta and a partly filled block inside it:
    # mixed all the same. More than 16 tiles in a row (the interpreter's chunk) at pages=1.
    bs = 16
    p, ids, deltas, valid, _ = _tile_table_layout(70 + pages, bs)
    tiles, n_tiles = tile_table(p.meta, p.nblocks, pages, bs, packed=True)
    saw_mixed = saw_prefix = False
    for b in range(p.meta.shape[0]):
        nb, n = int(p.nblocks[b]), int(n_tiles[b])
        assert n == -(-nb // pages) and int(tiles[b, n, 0]) == nb
        starts = [u * pages for u in range(n)]
        assert tiles[b, :n, 0].tolist() == starts
        first_delta = [int(deltas[b, j]) for j in starts]
        assert tiles[b, :n, 3].tolist() == first_delta
        mixed = []
        for u in range(n):
            blocks = range(starts[u], min(starts[u] + pages, nb))
            one_delta = all(int(deltas[b, j]) == first_delta[u] for j in blocks)
            prefix = all(int(valid[b, j]) == bs for j in blocks[:-1])
            keys = int(tiles[b, u, 2])
            if one_delta and prefix:
                saw_prefix = True
                assert keys == sum(int(valid[b, j]) for j in blocks)
            else:
                saw_mixed = True
                assert keys == -len(blocks) * bs
            mixed.append(keys < 0)
        seg = [u for u in range(n) if u == 0 or first_delta[u] != first_delta[u - 1] or mixed[u - 1]]
        assert tiles[b, :n, 1].tolist() == [min([s for s in seg if s > u] + [n]) for u in range(n)]
    assert saw_prefix and saw_mixed == (pages > 1)  # a one-block tile is never mixed


# (seed, documents per sequence (tokens), Hq, Hkv, D, block_size, num_splits)
DECODE_CASES = [
    (21, [[20, 9]], 2, 2, 64, 16, 1),  # MHA, single split (direct write)
    (22, [[17, 40], [70], [5]], 6, 2, 64, 16, 3),  # GQA 3, unequal lengths, splits
    (23, [[33, 12, 50]], 4, 1, 64, 16, None),  # GQA 4 (MQA), automatic splits
    (24, [[12, 20], [7]], 8, 1, 128, 32, 2),  # GQA 8, head dim 128, block 32
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"seed{c[0]}")
def test_decode_matches_reference(case):
    seed, docs, hq, hkv, d, bs, splits = case
    gen = torch.Generator().manual_seed(seed)
    p = make_paged(gen, docs, hkv, d, bs, torch.float32, "cpu", reuse_first_doc=seed == 21)
    q = torch.randn(len(docs), hq, d, generator=gen)
    cos, sin = make_rope(d, "cpu")
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, d ** -0.5)
    for fused in (False, True):  # split partials merged by a second kernel, or by the last split program
        out = run_decode(p, q, cos, sin, d ** -0.5, num_splits=splits, fused_merge=fused)
        assert rel_err(out, ref) < 1e-4
    assert not split_counters(q.device, 1).any()  # the arrival counters are left at zero


def test_documents_sharing_a_delta_after_a_partial_block():
    # two neighbouring documents with one delta: the first one's partly filled last block sits inside the
    # run of equal deltas, so it must end its tile (ROT 5 masks a tile's keys as one prefix)
    p, q, kn, vn, cu = make_prefill(27, [5], [[17, 40, 9]], 4, 2, 64, 16, torch.float32, "cpu")
    ids, deltas, valid = unpack_block_meta(p.meta)
    deltas[0, 2:5] = deltas[0, 0]  # blocks 0-1: 17 tokens (block 1 holds 1), blocks 2-4: 40 tokens
    p.meta.copy_(pack_block_meta(ids, deltas, valid))
    cos, sin = make_rope(64, "cpu")
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    qd = torch.randn(1, 4, 64)
    refd = lazy_decode_reference(qd, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 0.125)
    for mode in (1, 2, 3, 5, 7):
        for splits in (1, 2):
            out = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125, num_splits=splits, rotation_mode=mode,
                              config=(16, 64, 1, 1))
            assert rel_err(out, ref) < 1e-4
            outd = run_decode(p, qd, cos, sin, 0.125, num_splits=splits, config=(64, 1, 1), rotation_mode=mode)
            assert rel_err(outd, refd) < 1e-4


def test_decode_tile_spans_several_documents_and_wrong_rotation():
    gen = torch.Generator().manual_seed(25)
    p = make_paged(gen, [[5, 16, 3, 30, 2, 9]], 2, 64, 16, torch.float32, "cpu", reuse_first_doc=True)
    q = torch.randn(1, 4, 64, generator=gen)
    cos, sin = make_rope(64, "cpu")
    out = run_decode(p, q, cos, sin, 0.125, num_splits=2, config=(64, 1, 1))
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 0.125)
    assert rel_err(out, ref) < 1e-4
    for mode in (2, 3, 5, 7):  # the other query-rotation schedules
        out = run_decode(p, q, cos, sin, 0.125, num_splits=3, config=(32, 1, 1), rotation_mode=mode)
        assert rel_err(out, ref) < 1e-4
    ids, deltas, valid = unpack_block_meta(p.meta)
    wrong = pack_block_meta(ids, (deltas + 1) % MAX_POS, valid)
    bad = lazy_decode_reference(q, p.k_cache, p.v_cache, wrong, p.nblocks, cos, sin, 0.125)
    assert rel_err(out, bad) > 1e-2


def test_decode_no_rotation_on_prerotated_keys():
    gen = torch.Generator().manual_seed(26)
    p = make_paged(gen, [[18, 7], [25]], 2, 64, 16, torch.float32, "cpu")
    q = torch.randn(2, 4, 64, generator=gen)
    cos, sin = make_rope(64, "cpu")
    pre = prerotated(p, cos, sin)
    out = run_decode(pre, q, cos, sin, 0.125, apply_rotation=False, num_splits=2)
    ref = lazy_decode_reference(q, pre.k_cache, pre.v_cache, pre.meta, pre.nblocks, cos, sin, 0.125)
    assert rel_err(out, ref) < 1e-4
    assert rel_err(run_decode(p, q, cos, sin, 0.125, num_splits=2), out) < 1e-4


def test_choose_splits_fills_whole_waves():
    # 132 SMs: 4 programs/SM -> B=64 x 8 KV heads (512 programs) is one wave unsplit;
    # 3 programs/SM (396 slots) would run 1.29 waves unsplit, 3 splits fill 3.9 of 4
    assert choose_splits(512, 128, 132 * 4) == 1
    assert choose_splits(512, 128, 132 * 3) == 3
    s = choose_splits(8, 512, 132 * 4)  # batch 1: split until a wave is (nearly) full
    assert 8 * s <= 528 and 8 * s >= 0.9 * 528
    assert choose_splits(8, 8, 528) == 2  # too few tiles: at least 4 per split


def _split_partials(r0, hq, splits, device):
    """Random partials as a split kernel leaves them: acc [R0, Hq, S, D], (base-2 max m, sum l) [R0, Hq, S, 2]."""
    acc = torch.randn(r0, hq, splits, 128, device=device)
    ml = torch.stack((4 * torch.randn(r0, hq, splits, device=device), torch.rand(r0, hq, splits, device=device) + 0.5), -1)
    m, l = ml[..., 0].double(), ml[..., 1].double()
    w = torch.exp2(m - m.max(-1, keepdim=True).values)
    ref = (acc.double() * w[..., None]).sum(-2) / (l * w).sum(-1)[..., None]
    return acc, ml, ref


@pytest.mark.parametrize("rows,warps", [(1, 4), (4, 4), (8, 8)])
@pytest.mark.parametrize("r0,hq,splits", [(3, 8, 5), (5, 12, 1), (2, 32, 8)])  # rows not a multiple of `rows`
def test_merge_splits_rows_per_program(rows, warps, r0, hq, splits):
    acc, ml, ref = _split_partials(r0, hq, splits, "cpu")
    out = torch.full((r0, hq, 128), float("nan"))
    merge_splits(acc, ml, out, splits, rows=rows, num_warps=warps)
    assert rel_err(out, ref) < 1e-5


# ---------------------------------------------------------------- GPU, bf16/fp16


def _gpu_docs(gen, n_seqs, n_docs, max_doc):
    return [[int(x) for x in torch.randint(1, max_doc, (n_docs,), generator=gen)] for _ in range(n_seqs)]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (12, 4, 64), (8, 8, 128), (24, 3, 64)])
@pytest.mark.parametrize("kernel,cfg", [(None, None), ("triton", None)] + [
    pytest.param("wgmma", cfg, marks=needs_hopper, id="wgmma-{}x{}-w{}-s{}".format(*cfg))
    for cfg in [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3),
                (128, 128, 12, 3), (128, 64, 12, 4)]])
def test_prefill_gpu(dtype, hq, hkv, d, kernel, cfg):
    # the default kernel (Hopper: the wgmma one), the Triton one, and the wgmma one in each config (12 warps: the
    # warp-specialized build), against the reference: documents reused at other offsets, partial blocks, a
    # sequence without context, G not dividing the tile's rows (hq=12, hkv=4; with 12 warps a token's heads then
    # straddle the two consumers), rotation on and off
    gen = torch.Generator().manual_seed(100 + hq + d)
    docs = _gpu_docs(gen, 3, 4, 700) + [[]]
    new_lens = [130, 7, 64, 300]
    p, q, kn, vn, cu = make_prefill(hq * 7 + d, new_lens, docs, hq, hkv, d, 16, dtype, "cuda",
                                    reuse_first_doc=True)
    cos, sin = make_rope(d, "cuda", base=500000.0)
    scale = d ** -0.5
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, scale)
    out = run_prefill(p, q, kn, vn, cu, cos, sin, scale, kernel=kernel, config=cfg)
    assert rel_err(out, ref) < 1e-2
    pre = prerotated(p, cos, sin)
    off = run_prefill(pre, q, kn, vn, cu, cos, sin, scale, apply_rotation=False, kernel=kernel, config=cfg)
    assert rel_err(off, ref_prefill(pre, q, kn, vn, cu, cos, sin, scale)) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (24, 3, 64), (8, 8, 128)])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_prefill_gpu_split_context(hq, hkv, d, splits):
    # short prefill (few query tiles): the automatic split over the context, forced splits too
    gen = torch.Generator().manual_seed(600 + hq + d)
    docs = _gpu_docs(gen, 2, 6, 900)
    p, q, kn, vn, cu = make_prefill(hq + d, [64, 9], docs, hq, hkv, d, 16, torch.bfloat16, "cuda",
                                    reuse_first_doc=True)
    cos, sin = make_rope(d, "cuda", base=500000.0)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, d ** -0.5)
    assert rel_err(run_prefill(p, q, kn, vn, cu, cos, sin, d ** -0.5, num_splits=splits), ref) < 1e-2
    pre = prerotated(p, cos, sin)
    ref0 = ref_prefill(pre, q, kn, vn, cu, cos, sin, d ** -0.5)
    off = run_prefill(pre, q, kn, vn, cu, cos, sin, d ** -0.5, apply_rotation=False, num_splits=splits)
    assert rel_err(off, ref0) < 1e-2
    for mode in (1, 2, 3, 5, 7):
        out = run_prefill(p, q, kn, vn, cu, cos, sin, d ** -0.5, num_splits=splits, rotation_mode=mode)
        assert rel_err(out, ref) < 1e-2
    for mode in (3, 5, 7):  # rotation off, each schedule's own loop
        off = run_prefill(pre, q, kn, vn, cu, cos, sin, d ** -0.5, apply_rotation=False, num_splits=splits,
                          rotation_mode=mode)
        assert rel_err(off, ref0) < 1e-2


@gpu
@needs_hopper
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_prefill_wgmma_gpu_many_short_documents(bs, monkeypatch):
    # many documents shorter than a tile, block sizes up to a 64-key tile: packed tiles (mixed ones hold keys of
    # several documents, rotated in shared memory) and segment-aligned ones (one rotation per tile); then every
    # document at one offset, so that mixed tiles (valid keys not a prefix) have nothing to rotate
    from lazyrag.kernels import prefill_wgmma
    gen = torch.Generator().manual_seed(950 + bs)
    docs = [[int(x) for x in torch.randint(1, 200, (12,), generator=gen)] for _ in range(2)]
    p, q, kn, vn, cu = make_prefill(bs, [512, 333], docs, 32, 8, 128, bs, torch.bfloat16, "cuda")
    cos, sin = make_rope(128, "cuda", base=500000.0)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 128 ** -0.5)
    ids, deltas, valid = unpack_block_meta(p.meta)
    one_offset = Paged(p.k_cache, p.v_cache, pack_block_meta(ids, torch.full_like(deltas, 77), valid), p.nblocks,
                       p.docs)
    ref_one = ref_prefill(one_offset, q, kn, vn, cu, cos, sin, 128 ** -0.5)
    for packed in (True, False):
        monkeypatch.setattr(prefill_wgmma, "PACKED_TILES", packed)
        for cfg in ((128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 12, 3), (128, 64, 12, 6)):
            out = run_prefill(p, q, kn, vn, cu, cos, sin, 128 ** -0.5, kernel="wgmma", config=cfg)
            assert rel_err(out, ref) < 1e-2, (packed, cfg)
            out = run_prefill(one_offset, q, kn, vn, cu, cos, sin, 128 ** -0.5, kernel="wgmma", config=cfg)
            assert rel_err(out, ref_one) < 1e-2, (packed, cfg)


def test_prefill_wgmma_disable_warns_once(monkeypatch):
    # what lazy_prefill calls when the Gluon kernel fails to build: one warning that says what happens and what to
    # do, then the kernel is no longer chosen by default
    from lazyrag.kernels import prefill_wgmma
    monkeypatch.setattr(prefill_wgmma, "disabled_because", None)
    with pytest.warns(RuntimeWarning, match="Triton kernel from now on.*kernel='wgmma'"):
        prefill_wgmma.disable("CompilationError: at 1:2")
    assert prefill_wgmma.disabled_because == "CompilationError: at 1:2"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prefill_wgmma.disable("a second failure")  # no second warning


@gpu
@needs_hopper
def test_prefill_wgmma_build_failure_falls_back(monkeypatch):
    # a Triton whose Gluon API moved: the default prefill warns once and runs the Triton kernel from then on;
    # asking for the wgmma kernel by name shows the error
    from lazyrag.kernels import prefill_wgmma
    p, q, kn, vn, cu = make_prefill(77, [512, 300], [[900, 300], [1200]], 32, 8, 128, 16, torch.bfloat16, "cuda")
    cos, sin = make_rope(128, "cuda", base=500000.0)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 128 ** -0.5)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated Gluon API change")

    monkeypatch.setattr(prefill_wgmma, "lazy_prefill_wgmma", broken)
    monkeypatch.setattr(prefill_wgmma, "disabled_because", None)
    with pytest.warns(RuntimeWarning, match="Triton kernel"):
        out = run_prefill(p, q, kn, vn, cu, cos, sin, 128 ** -0.5)
    assert rel_err(out, ref) < 1e-2
    assert "simulated" in prefill_wgmma.disabled_because
    assert rel_err(run_prefill(p, q, kn, vn, cu, cos, sin, 128 ** -0.5), ref) < 1e-2  # no second warning needed
    with pytest.raises(RuntimeError, match="simulated"):
        run_prefill(p, q, kn, vn, cu, cos, sin, 128 ** -0.5, kernel="wgmma")


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", PREFILL_CONFIGS)
def test_prefill_gpu_every_config(cfg):
    # the autotuner may pick any of these: each must be right, block size 32 too
    p, q, kn, vn, cu = make_prefill(300, [77, 200], [[300, 45, 500], [1000]], 32, 8, 128, 32, torch.bfloat16,
                                    "cuda", reuse_first_doc=True)
    cos, sin = make_rope(128, "cuda")
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 128 ** -0.5)
    for splits in (1, 3):
        out = run_prefill(p, q, kn, vn, cu, cos, sin, 128 ** -0.5, config=cfg, num_splits=splits)
        assert rel_err(out, ref) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (12, 4, 64), (8, 8, 128), (24, 3, 64)])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_decode_gpu(dtype, hq, hkv, d, splits):
    gen = torch.Generator().manual_seed(200 + hq + d)
    docs = _gpu_docs(gen, 5, 5, 900) + [[3]]
    p = make_paged(gen, docs, hkv, d, 16, dtype, "cuda", reuse_first_doc=True)
    q = torch.randn(len(docs), hq, d, generator=gen).to(dtype).cuda()
    cos, sin = make_rope(d, "cuda", base=500000.0)
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, d ** -0.5)
    out = run_decode(p, q, cos, sin, d ** -0.5, num_splits=splits)
    assert rel_err(out, ref) < 1e-2
    pre = prerotated(p, cos, sin)
    off = run_decode(pre, q, cos, sin, d ** -0.5, num_splits=splits, apply_rotation=False)
    ref0 = lazy_decode_reference(q, pre.k_cache, pre.v_cache, pre.meta, pre.nblocks, cos, sin, d ** -0.5)
    assert rel_err(off, ref0) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", DECODE_CONFIGS)
def test_decode_gpu_every_config(cfg):
    gen = torch.Generator().manual_seed(400)
    p = make_paged(gen, [[300, 45, 500], [1000], [17, 17, 17]], 8, 128, 32, torch.bfloat16, "cuda",
                   reuse_first_doc=True)
    q = torch.randn(3, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    cos, sin = make_rope(128, "cuda")
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 128 ** -0.5)
    for splits in (1, 3):
        out = run_decode(p, q, cos, sin, 128 ** -0.5, num_splits=splits, config=cfg)
        assert rel_err(out, ref) < 1e-2


def _check_fused_merge(run, launch_into, ref):
    """The in-kernel split merge (kvloop.last_split_merges: an arrival counter per group, the last split program
    merges). ``run(fused)`` returns a fresh output; ``launch_into(out)`` launches the fused kernel into ``out``.
    Right against the reference and the two-kernel merge; bit-identical over repeated launches (a race would
    move it); the counters reset between launches, also replayed from a CUDA graph of back-to-back calls (as
    one per layer)."""
    first = run(True)
    assert rel_err(first, ref) < 1e-2
    assert rel_err(first, run(False)) < 2e-3  # the same fp32 partials merged in another order, rounded to bf16
    for _ in range(10):
        assert torch.equal(run(True), first)
    outs = [torch.full_like(first, float("nan")) for _ in range(4)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for o in outs:
            launch_into(o)
    for _ in range(5):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, first) for o in outs)
    assert not split_counters(first.device, 1).any()


@gpu
@needs_cuda
@pytest.mark.parametrize("rows,warps", [(1, 4), (2, 4), (4, 4), (8, 8), (16, 8)])
@pytest.mark.parametrize("r0,hq,splits", [(64, 32, 8), (1, 32, 48), (7, 24, 3)])
def test_merge_splits_gpu(rows, warps, r0, hq, splits):
    acc, ml, ref = _split_partials(r0, hq, splits, "cuda")
    out = torch.full((r0, hq, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    merge_splits(acc, ml, out, splits, rows=rows, num_warps=warps)
    assert rel_err(out, ref) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("batch,splits", [(1, 16), (1, 32), (8, 5), (3, 2)])
def test_decode_gpu_fused_merge(batch, splits):
    gen = torch.Generator().manual_seed(450 + batch)
    p = make_paged(gen, _gpu_docs(gen, batch, 5, 600), 8, 128, 16, torch.bfloat16, "cuda", reuse_first_doc=True)
    q = torch.randn(batch, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    cos, sin = make_rope(128, "cuda", base=500000.0)
    scale = 128 ** -0.5
    _check_fused_merge(
        lambda fused: run_decode(p, q, cos, sin, scale, num_splits=splits, fused_merge=fused),
        lambda o: lazy_decode(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, scale, out=o, num_splits=splits,
                              fused_merge=True),
        lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, scale))


@gpu
@needs_cuda
@pytest.mark.parametrize("new,splits", [([64], 8), ([64], 3), ([40, 7, 64], 4)])
def test_prefill_gpu_fused_merge(new, splits):
    # the TTFT shape: 64 new tokens over 5 documents of 512
    p, q, kn, vn, cu = make_prefill(470 + splits, new, [[512] * 5 for _ in new], 32, 8, 128, 16, torch.bfloat16, "cuda")
    cos, sin = make_rope(128, "cuda", base=500000.0)
    scale = 128 ** -0.5
    _check_fused_merge(
        lambda fused: run_prefill(p, q, kn, vn, cu, cos, sin, scale, num_splits=splits, fused_merge=fused),
        lambda o: lazy_prefill(q, kn, vn, cu, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, scale, out=o,
                               max_seqlen_q=max(new), num_splits=splits, fused_merge=True),  # no host sync in a capture
        ref_prefill(p, q, kn, vn, cu, cos, sin, scale))


@gpu
@needs_cuda
def test_fp32_gpu():
    p, q, kn, vn, cu = make_prefill(500, [40, 9], [[100, 37], [64]], 8, 2, 64, 16, torch.float32, "cuda",
                                    reuse_first_doc=True)
    cos, sin = make_rope(64, "cuda")
    out = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    assert rel_err(out, ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)) < 1e-4
    qd = torch.randn(2, 8, 64, device="cuda")
    outd = run_decode(p, qd, cos, sin, 0.125)
    refd = lazy_decode_reference(qd, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 0.125)
    assert rel_err(outd, refd) < 1e-4


# -- the elementwise kernels (kernels/elementwise.py) against the model's torch functions


def _check_elementwise(device, dtype, T, H, inter):
    from lazyrag.kernels import elementwise as E
    from lazyrag.model import llama

    torch.manual_seed(T + H)
    x, r = torch.randn(T, H, device=device, dtype=dtype), torch.randn(T, H, device=device, dtype=dtype)
    w = (1 + 0.3 * torch.randn(H, device=device)).to(dtype)
    gate_up = (2 * torch.randn(T, 2 * inter, device=device)).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the model dtype apart at most
    h, y = E.add_rms_norm(x, r, w, 1e-5)
    rh, ry = llama.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, rh) and rel_err(y, ry) < tol
    assert rel_err(E.rms_norm(x, w, 1e-5), llama.rms_norm(x, w, 1e-5)) < tol
    ref = llama.silu_mul(gate_up.float(), inter)
    assert rel_err(E.silu_mul(gate_up, inter), ref) < tol
    # a strided view (a slice of a wider row), as the engine may hand the kernels
    wide = torch.randn(T, 2 * inter + 8, device=device, dtype=dtype)[:, 8:]
    assert rel_err(E.silu_mul(wide, inter), llama.silu_mul(wide.float(), inter)) < tol


@pytest.mark.parametrize("T,H,inter", [(1, 48, 40), (5, 64, 72)])  # not powers of two: masked tails
def test_elementwise_kernels_match_torch(T, H, inter):
    _check_elementwise("cpu", torch.float32, T, H, inter)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 64, 300])
def test_elementwise_kernels_gpu(dtype, T):
    _check_elementwise("cuda", dtype, T, 4096, 14336)


def _check_greedy_tokens(device, B, V):
    from lazyrag.kernels.elementwise import greedy_tokens

    torch.manual_seed(V)
    logits = torch.randn(B, V, device=device)
    logits[0, V // 3] = logits[0, V - 1] = logits[0].max() + 1  # a tie across chunks: the first one wins
    if B > 1:
        logits[1, 5] = logits[1, 6] = logits[1].max() + 1  # a tie inside a chunk
    if B > 2:
        logits[2, V - 2] = logits[2].max() + 1  # the maximum in the last (partial) chunk
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert got.tolist() == logits.argmax(-1).tolist()
    assert greedy_tokens(logits[:, : V - 3]).tolist() == logits[:, : V - 3].argmax(-1).tolist()  # a strided view, masked tail


@pytest.mark.parametrize("B,V", [(1, 50), (3, 9000)])
def test_greedy_tokens_match_torch(B, V):
    _check_greedy_tokens("cpu", B, V)


@gpu
@needs_cuda
@pytest.mark.parametrize("B", [1, 8])
def test_greedy_tokens_gpu(B):
    _check_greedy_tokens("cuda", B, 128256)


# -- the fused q/k rotation + K/V pool store (kernels/qkv.py) against rotate_qk + BlockPool.write


def _check_rotate_qk_store(device, dtype, hq, hkv, d, T, scaling):
    from lazyrag.kernels.qkv import rotate_qk_store
    from lazyrag.model.llama import rope_at, rotate_qk

    torch.manual_seed(T + hq)
    bs = 16
    nb = T // bs + 4
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=device, dtype=dtype)
    cos_t, sin_t = make_rope(d, device)
    positions = torch.randint(0, 4000, (T,), device=device)
    cos, sin = rope_at(cos_t, sin_t, positions, dtype)
    slots = torch.randperm(nb * bs, device=device)[:T]
    k_cache = torch.full((nb, bs, hkv, d), float("nan"), device=device, dtype=dtype)
    v_cache = k_cache.clone()
    q, k, v = rotate_qk_store(qkv, cos, sin, scaling, hq, hkv, k_cache, v_cache, slots)
    rq, rk, rv = rotate_qk(qkv.float(), cos.float(), sin.float(), scaling, hq, hkv)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(q, rq) < tol and rel_err(k, rk) < tol and torch.equal(v, qkv[:, (hq + hkv) * d:].view(T, hkv, d))
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_rotate_qk_store_matches_rotate_and_write(scaling):
    _check_rotate_qk_store("cpu", torch.float32, 4, 2, 16, 5, scaling)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 64, 300])
def test_rotate_qk_store_gpu(dtype, T):
    _check_rotate_qk_store("cuda", dtype, 32, 8, 128, T, 1.0)


# ---------------------------------------------------------------- one-token projections (kernels/gemv.py)


def _check_gemv(device, dtype, n, k, prologue, bias, config=None):
    """The fused GEMV against the unfused path: the elementwise step in the model dtype, then the product
    in float64. Fresh random inputs; the output poisoned with NaN."""
    import torch.nn.functional as F

    from lazyrag.kernels import gemv as G
    from lazyrag.model.llama import add_rms_norm, rms_norm, silu_mul

    eps = 1e-5
    rnd = lambda *s, scale=1.0: (torch.randn(*s) * scale).to(device=device, dtype=dtype)  # noqa: E731
    x = rnd(1, 2 * k if prologue == G.SILU else k)
    r, nw, w = rnd(1, k), (1 + 0.2 * torch.randn(k)).to(device=device, dtype=dtype), rnd(n, k, scale=k ** -0.5)
    b = rnd(n) if bias else None
    h_ref = None
    if prologue == G.PLAIN:
        xin = x
    elif prologue == G.NORM:
        xin = rms_norm(x, nw, eps)
    elif prologue == G.ADD_NORM:
        h_ref, xin = add_rms_norm(x, r, nw, eps)
    else:
        xin = silu_mul(x, k)
    ref = F.linear(xin.double(), w.double(), None if b is None else b.double())
    out = torch.full((1, n), float("nan"), device=device, dtype=dtype)
    got = G.gemv(x, w, b, prologue=prologue, residual=r, norm_weight=nw, eps=eps, config=config, out=out)
    if prologue == G.ADD_NORM:
        h, got = got
        assert torch.equal(h, h_ref)  # the residual stream, rounded as the unfused add rounds it
    assert got is out
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("prologue", [0, 1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [(8, 128, 4, 1), (8, 32, 4, 3), (8, 32, 4)], ids=["one-shot", "pipelined", "plain"])
def test_gemv_matches_unfused(prologue, bias, config):
    # N=37, K=80 not multiples of the blocks: masked N and K tails (one-shot: K padded to 128; the loop: a partial
    # last tile); the old 3-tuple config is the plain loop
    _check_gemv("cpu", torch.float32, 37, 80, prologue, bias, config=config)


def test_gemv_resolve():
    from lazyrag.kernels.gemv import resolve

    assert resolve((2, 4096, 4), 4096) == (2, 4096, 4, 1)  # one-shot, old 3-tuple
    assert resolve((1, 16384, 8, 1), 4096) == (1, 4096, 8, 1) == resolve((1, 4096, 8, 1), 4096)  # the same launch
    assert resolve((1, 16384, 8, 1), 14336) == (1, 16384, 8, 1)
    assert resolve((4, 1024, 4, 3), 14336) == (4, 1024, 4, 3) and resolve((4, 1024, 4, 3), 1000) == (4, 1024, 4, 1)


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k,prologue", [(6144, 4096, 1), (6144, 4096, 2), (4096, 4096, 0), (28672, 4096, 2),
                                          (4096, 14336, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_gpu(n, k, prologue, dtype):
    _check_gemv("cuda", dtype, n, k, prologue, False)


@gpu
@needs_cuda
@pytest.mark.parametrize("config", GEMV_CANDIDATES)
def test_gemv_gpu_every_candidate(config):
    for prologue in range(4):
        _check_gemv("cuda", torch.bfloat16, 1000, 1500, prologue, prologue == 0, config=config)


# ---- skinny GEMM (kernels/gemm.py)


def _check_skinny(device, dtype, m, n, k, bias, config=None):
    """skinny_linear against F.linear in float64 on fresh random inputs; the output poisoned with NaN."""
    import torch.nn.functional as F

    from lazyrag.kernels.gemm import skinny_linear

    rnd = lambda *s, scale=1.0: (torch.randn(*s) * scale).to(device=device, dtype=dtype)  # noqa: E731
    x, w = rnd(m, k), rnd(n, k, scale=k ** -0.5)
    b = rnd(n) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
    got = skinny_linear(x, w, b, config=config, out=out)
    assert got is out
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2), (m, n, k, bias, config)


@pytest.mark.parametrize("m", [2, 7, 33, 64])  # token tiles 16, 16, 64, 64: masked rows but at 64
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_linear(m, split, bias):
    # N = 37 and K = 100 are not multiples of BLOCK_N / BLOCK_K: the masked tails (and, at split 4, a split
    # whose last slice is partial)
    _check_skinny("cpu", torch.float32, m, 37, 100, bias, config=(16, 32, 4, 3, split))


@gpu
@needs_cuda
@pytest.mark.parametrize("config", SKINNY_CANDIDATES)
def test_skinny_gpu_every_candidate(config):
    """Each candidate on Llama-3.1-8B's projections (wqkv, wo, gate_up, down) in bf16, a full and a partial token tile."""
    for i, (n, k) in enumerate([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]):
        for m in (64, 7):
            _check_skinny("cuda", torch.bfloat16, m, n, k, bias=i == 0, config=config)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [2, 40])
def test_skinny_gpu_dtypes_and_tails(dtype, m):
    # K = 1000: a partial last BLOCK_K slice; N = 1000: a partial last program
    for config in (None, (64, 128, 4, 4, 2)):
        _check_skinny("cuda", dtype, m, 1000, 1000, True, config=config)
