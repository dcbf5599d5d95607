"""What the prefill and decode kernels share (kernels/kvloop.py): the tile tables and the split merge."""

from __future__ import annotations

import pytest
import torch

from lazyrag.kernels.common import pack_block_meta, unpack_block_meta
from lazyrag.kernels.kvloop import merge_splits, tile_table
from tests.kernels.helpers import gpu, make_paged, needs_cuda, rel_err


def _tile_table_layout(seed, bs):
    """Block tables for the tile-table tests: short and long documents, an empty row, a row of one 400-token
    document, and a last row whose second document shares the first one's delta (one delta, a partly filled block
    inside). The first document of row 0 is reused at another offset. Returns (paged, ids, deltas, valid,
    the last row's first-document block count)."""
    gen = torch.Generator().manual_seed(seed)
    p = make_paged(
        gen, [[5, 16, 3, 300, 2, 9], [], [400], [17, 17, 17, 40]], 1, 64, bs, torch.float32, "cpu", reuse_first_doc=True
    )
    ids, deltas, valid = unpack_block_meta(p.meta)
    nb0 = (17 + bs - 1) // bs
    p.meta[3, nb0 : 2 * nb0] = pack_block_meta(ids[3, nb0 : 2 * nb0], deltas[3, :nb0], valid[3, nb0 : 2 * nb0])
    return (p, *unpack_block_meta(p.meta), nb0)


@pytest.mark.parametrize("pages", [1, 2, 4], ids=lambda n: f"{n}-pages")
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
        seg_starts = {0} | {j for j in range(1, nb) if deltas[b, j] != deltas[b, j - 1] or valid[b, j - 1] < bs}
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


@pytest.mark.parametrize("pages", [1, 4, 8], ids=lambda n: f"{n}-pages")
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


def test_tile_table_cache_serves_the_forward():
    # a forward's tile_cache keeps one table per (pages, block size, packed); outside a capture it is reused
    p, *_ = _tile_table_layout(5, 16)
    cache = {}
    first, _ = tile_table(p.meta, p.nblocks, 2, 16, cache)
    assert tile_table(p.meta, p.nblocks, 2, 16, cache)[0] is first
    assert tile_table(p.meta, p.nblocks, 2, 16, cache, packed=True)[0] is not first


def _split_partials(r0, hq, splits, device):
    """Random partials as a split kernel leaves them: acc [R0, Hq, S, D], (base-2 max m, sum l) [R0, Hq, S, 2]."""
    acc = torch.randn(r0, hq, splits, 128, device=device)
    ml = torch.stack(
        (4 * torch.randn(r0, hq, splits, device=device), torch.rand(r0, hq, splits, device=device) + 0.5), -1
    )
    m, l = ml[..., 0].double(), ml[..., 1].double()  # noqa: E741  l: the softmax sum, as the kernels name it
    w = torch.exp2(m - m.max(-1, keepdim=True).values)
    ref = (acc.double() * w[..., None]).sum(-2) / (l * w).sum(-1)[..., None]
    return acc, ml, ref


MERGE_SHAPES = [(3, 8, 5), (5, 12, 1), (2, 32, 8)]  # rows not a multiple of `rows`


@pytest.mark.parametrize(
    "rows,warps",
    [(1, 4), (4, 4), (8, 8), (None, None)],
    ids=["1-row-4-warps", "4-rows-4-warps", "8-rows-8-warps", "tuned"],
)
@pytest.mark.parametrize("r0,hq,splits", MERGE_SHAPES, ids=[f"r{a}-hq{b}-s{c}" for a, b, c in MERGE_SHAPES])
def test_merge_splits_rows_per_program(rows, warps, r0, hq, splits):
    acc, ml, ref = _split_partials(r0, hq, splits, "cpu")
    out = torch.full((r0, hq, 128), float("nan"))
    merge_splits(acc, ml, out, splits, rows=rows, num_warps=warps)
    assert rel_err(out, ref) < 1e-5


GPU_MERGE_SHAPES = [(64, 32, 8), (1, 32, 48), (7, 24, 3)]


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "rows,warps",
    [(1, 4), (2, 4), (4, 4), (8, 8), (16, 8), (None, None)],
    ids=["1-4", "2-4", "4-4", "8-8", "16-8", "tuned"],
)
@pytest.mark.parametrize("r0,hq,splits", GPU_MERGE_SHAPES, ids=[f"r{a}-hq{b}-s{c}" for a, b, c in GPU_MERGE_SHAPES])
def test_merge_splits_gpu(rows, warps, r0, hq, splits):
    acc, ml, ref = _split_partials(r0, hq, splits, "cuda")
    out = torch.full((r0, hq, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    merge_splits(acc, ml, out, splits, rows=rows, num_warps=warps)
    assert rel_err(out, ref) < 1e-2
