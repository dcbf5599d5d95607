"""What the prefill and decode kernels share besides the meta layout (``common.py``): the
segment-aligned tile table, one online-softmax KV loop, the split merge, and launch helpers
(default/tuned configs, occupancy, reused workspaces).

Tile table: the KV loops walk *segment-aligned* tiles. A tile is up to ``PAGES`` consecutive
blocks of one segment (a segment = consecutive blocks sharing delta, ended by a partly filled
block), so one rotation of the query serves a whole tile, its valid keys are a prefix, and the loop
is one flat ``for`` that Triton can software-pipeline (a per-segment ``while`` around the tile loop was
slower even for one document: NOTES §Kernels, round 2). ``_tile_table_kernel`` writes, per sequence, one row
per tile (first block, first tile of the next segment, valid keys, delta) followed by a row starting
with the sequence's block count as a sentinel (so tile ``t`` spans blocks ``[tiles[t, 0], tiles[t + 1, 0])``),
and the number of tiles. It depends on the block table only, so one table serves every layer of a
forward pass (the attention backend caches it per batch metadata). The Hopper prefill kernel
(prefill_wgmma.py) walks *packed* tiles instead (``tile_table(packed=True)``, ``_packed_tile_table_kernel``):
``PAGES`` blocks a tile across document boundaries; it rotates the keys of a mixed tile itself.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from .common import meta_delta, meta_phys, meta_valid
from .tuned import tuned

# ---------------------------------------------------------------- tile table
TILE_FIELDS = tl.constexpr(4)  # int32 per tile-table row


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _next_segment_pass(tiles_row, n_tiles, CHUNK: tl.constexpr):
    """Backward over a table's tiles: field 1 of each row, a flag "this tile starts a segment" on entry, becomes
    the first segment-starting tile after it (else n_tiles)."""
    offs = tl.arange(0, CHUNK)
    BIG: tl.constexpr = 1 << 30
    carry = n_tiles  # first segment-starting tile at or after the chunk already done
    n_chunks = tl.cdiv(n_tiles, CHUNK)
    for c in range(0, n_chunks):
        c0 = (n_chunks - 1 - c) * CHUNK
        i = c0 + offs
        ok = i < n_tiles
        flag = tl.load(tiles_row + TILE_FIELDS * i + 1, mask=ok, other=0)
        nxt_ok = (i + 1 < c0 + CHUNK) & (i + 1 < n_tiles)
        flag_next = tl.load(tiles_row + TILE_FIELDS * (i + 1) + 1, mask=nxt_ok, other=0)
        cand_next = tl.where(nxt_ok & (flag_next != 0), i + 1, BIG)
        nxt = tl.minimum(tl.associative_scan(cand_next, 0, _min_combine, reverse=True), carry)
        tl.debug_barrier()  # every flag of this chunk is read before any is overwritten
        tl.store(tiles_row + TILE_FIELDS * i + 1, nxt, mask=ok)
        carry = tl.minimum(carry, tl.min(tl.where(ok & (flag != 0), i, BIG), 0))


@triton.jit
def _tile_table_kernel(
    META,
    NUM_BLOCKS,
    TILES,
    NUM_TILES,
    stride_mb,
    stride_tb,
    PAGES: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per sequence. TILES[b] holds one row of TILE_FIELDS int32 per tile: (first block,
    first tile of the next segment, valid keys, delta); the row after the last tile starts with the
    number of blocks (sentinel). NUM_TILES[b] = n. A segment here is a run of blocks with one delta
    that ends at a partly filled block, so a tile's valid keys are a prefix of it."""
    b = tl.program_id(0)
    nb = tl.load(NUM_BLOCKS + b).to(tl.int32)
    meta_row = META + b.to(tl.int64) * stride_mb
    tiles_row = TILES + b.to(tl.int64) * stride_tb
    n_tiles = nb * 0
    seg_start = nb * 0  # start of the segment open at the end of the previous chunk
    offs = tl.arange(0, CHUNK)
    # pass 1, forward over blocks: tile starts, and (temporarily) whether a tile starts a segment
    for c0 in range(0, nb, CHUNK):
        j = c0 + offs
        ok = j < nb
        d = meta_delta(tl.load(meta_row + j, mask=ok, other=0))
        prev = tl.load(meta_row + j - 1, mask=ok & (j > 0), other=0)
        starts_seg = ok & ((j == 0) | (d != meta_delta(prev)) | (meta_valid(prev) < BLOCK_SIZE))
        # start of the segment holding block j: running max of the segment starts so far
        ss = tl.maximum(tl.associative_scan(tl.where(starts_seg, j, -1), 0, _max_combine), seg_start)
        starts_tile = ok & ((j - ss) % PAGES == 0)
        idx = n_tiles + tl.cumsum(starts_tile.to(tl.int32), 0) - 1
        tl.store(tiles_row + TILE_FIELDS * idx, j, mask=starts_tile)
        tl.store(tiles_row + TILE_FIELDS * idx + 1, starts_seg.to(tl.int32), mask=starts_tile)
        n_tiles += tl.sum(starts_tile.to(tl.int32), 0)
        seg_start = tl.max(tl.where(ok, ss, 0), 0)
    tl.store(tiles_row + TILE_FIELDS * n_tiles, nb)
    tl.store(tiles_row + TILE_FIELDS * n_tiles + 1, n_tiles)
    tl.store(tiles_row + TILE_FIELDS * n_tiles + 2, 0)
    tl.store(tiles_row + TILE_FIELDS * n_tiles + 3, 0)
    tl.store(NUM_TILES + b, n_tiles)
    _next_segment_pass(tiles_row, n_tiles, CHUNK)
    # pass 3, over tiles: valid keys (only a tile's last block may be partly filled) and delta
    for c0 in range(0, n_tiles, CHUNK):
        i = c0 + offs
        ok = i < n_tiles
        first = tl.load(tiles_row + TILE_FIELDS * i, mask=ok, other=0)
        end = tl.load(tiles_row + TILE_FIELDS * (i + 1), mask=ok, other=1)
        last = tl.load(meta_row + end - 1, mask=ok, other=0)
        tl.store(tiles_row + TILE_FIELDS * i + 2, (end - 1 - first) * BLOCK_SIZE + meta_valid(last), mask=ok)
        tl.store(tiles_row + TILE_FIELDS * i + 3, meta_delta(tl.load(meta_row + first, mask=ok, other=0)), mask=ok)


@triton.jit
def _packed_tile(meta_row, u, nb, ok, PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Packed tiles u (a vector; ``ok``: which exist): (delta of the first block, keys), keys as in
    _packed_tile_table_kernel (negative: a mixed tile)."""
    page = tl.arange(0, PAGES)[None, :]
    first = u * PAGES
    n_in = tl.minimum(nb - first, PAGES)  # blocks in the tile
    inb = ok[:, None] & (page < n_in[:, None])
    m = tl.load(meta_row + first[:, None] + page, mask=inb, other=0)  # [tiles, PAGES]
    d, v = meta_delta(m), meta_valid(m)
    d0 = tl.sum(tl.where(page == 0, d, 0), 1)
    v_last = tl.sum(tl.where(page == n_in[:, None] - 1, v, 0), 1)
    odd = inb & ((d != d0[:, None]) | ((page < n_in[:, None] - 1) & (v < BLOCK_SIZE)))
    mixed = tl.max(odd.to(tl.int32), 1) > 0
    return d0, tl.where(mixed, -n_in * BLOCK_SIZE, (n_in - 1) * BLOCK_SIZE + v_last)


@triton.jit
def _packed_tile_table_kernel(
    META,
    NUM_BLOCKS,
    TILES,
    NUM_TILES,
    stride_mb,
    stride_tb,
    PAGES: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per sequence, CHUNK tiles at a time. Packed tiles: tile u is blocks [u * PAGES, (u + 1) * PAGES)
    whatever documents they hold. Row u: (first block, first tile of the next segment, keys, delta of the first
    block), where keys is the tile's valid-key count if its blocks share one delta and its valid keys are a prefix,
    else minus the keys its blocks span (a mixed tile: the kernel reads each key's meta). A segment here is a run of
    tiles whose first blocks share a delta (one rotation of the query), ended by a mixed tile (so the kernel's loop
    over a segment's other tiles has no mixed one). Sentinel row and NUM_TILES as in _tile_table_kernel."""
    b = tl.program_id(0)
    nb = tl.load(NUM_BLOCKS + b).to(tl.int32)
    meta_row = META + b.to(tl.int64) * stride_mb
    tiles_row = TILES + b.to(tl.int64) * stride_tb
    n_tiles = tl.cdiv(nb, PAGES)
    offs = tl.arange(0, CHUNK)
    for c0 in range(0, n_tiles, CHUNK):
        u = c0 + offs
        ok = u < n_tiles
        d0, keys = _packed_tile(meta_row, u, nb, ok, PAGES, BLOCK_SIZE)
        d0_prev, keys_prev = _packed_tile(meta_row, u - 1, nb, ok & (u > 0), PAGES, BLOCK_SIZE)
        starts_seg = (u == 0) | (d0_prev != d0) | (keys_prev < 0)
        tl.store(tiles_row + TILE_FIELDS * u, u * PAGES, mask=ok)
        tl.store(tiles_row + TILE_FIELDS * u + 1, starts_seg.to(tl.int32), mask=ok)
        tl.store(tiles_row + TILE_FIELDS * u + 2, keys, mask=ok)
        tl.store(tiles_row + TILE_FIELDS * u + 3, d0, mask=ok)
    tl.store(tiles_row + TILE_FIELDS * n_tiles, nb)
    tl.store(tiles_row + TILE_FIELDS * n_tiles + 1, n_tiles)
    tl.store(tiles_row + TILE_FIELDS * n_tiles + 2, 0)
    tl.store(tiles_row + TILE_FIELDS * n_tiles + 3, 0)
    tl.store(NUM_TILES + b, n_tiles)
    tl.debug_barrier()  # every flag is stored before the backward pass reads them
    _next_segment_pass(tiles_row, n_tiles, CHUNK)


def tile_table(
    block_meta: torch.Tensor,
    num_blocks: torch.Tensor,
    pages: int,
    block_size: int,
    cache: dict | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment-aligned tiles of at most ``pages`` blocks: (tiles [B, W + 1, TILE_FIELDS] int32 of
    (first block, first tile of the next segment, valid keys, delta), n_tiles [B] int32); see
    _tile_table_kernel. ``packed``: tiles of ``pages`` blocks across document boundaries instead
    (_packed_tile_table_kernel; the Hopper prefill kernel's table, which rotates the keys of a mixed tile).

    ``cache`` (a dict living as long as the block table's contents, e.g. one forward pass) keeps
    the table for every later call with the same ``pages``. A CUDA-graph capture never reuses a
    table built outside it (the graph must rebuild it from its static inputs on every replay)."""
    capturing = block_meta.is_cuda and torch.cuda.is_current_stream_capturing()
    key = (pages, block_size, capturing, packed)
    if cache is not None and key in cache:
        return cache[key]
    B, W = block_meta.shape
    tiles = torch.empty(B, W + 1, TILE_FIELDS.value, device=block_meta.device, dtype=torch.int32)
    n_tiles = torch.empty(B, device=block_meta.device, dtype=torch.int32)
    if B:
        if packed:
            chunk = 16 if interpreting() else max(16, min(256, triton.next_power_of_2(triton.cdiv(W, pages))))
            _packed_tile_table_kernel[(B,)](
                block_meta,
                num_blocks,
                tiles,
                n_tiles,
                block_meta.stride(0),
                tiles.stride(0),
                PAGES=pages,
                BLOCK_SIZE=block_size,
                CHUNK=chunk,
                num_warps=4,
            )
        else:
            chunk = 16 if interpreting() else max(16, min(1024, triton.next_power_of_2(W)))
            _tile_table_kernel[(B,)](
                block_meta,
                num_blocks,
                tiles,
                n_tiles,
                block_meta.stride(0),
                tiles.stride(0),
                PAGES=pages,
                BLOCK_SIZE=block_size,
                CHUNK=chunk,
                num_warps=4,
            )
    if cache is not None:
        cache[key] = (tiles, n_tiles)
    return tiles, n_tiles


# ---------------------------------------------------------------- the KV loop
ROTATION_MODES = (2, 5, 7)  # kv_tile_loop's query-rotation schedules (ROT)


@triton.jit
def load_index(ptrs, mask, ASM: tl.constexpr):
    """``tl.load(ptrs, mask, other=0)`` of an int32 or int64 index tensor. ASM: as inline PTX (``ld.global.nc``),
    which the software pipeliner does not count as a load: K/V addresses computed from it then count as
    direct, and their copies run ``num_stages - 1`` tiles ahead as for a contiguous cache (after a real load
    of the index they stay one tile ahead at any stage count). The interpreter has no PTX: ASM=False there."""
    if ASM:
        if ptrs.dtype.element_ty == tl.int64:
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; @p ld.global.nc.b64 $0, [$1]; }",
                "=l,l,r",
                [ptrs, mask.to(tl.int32)],
                dtype=tl.int64,
                is_pure=True,
                pack=1,
            )
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.b32 $0, [$1]; }",
                "=r,l,r",
                [ptrs, mask.to(tl.int32)],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def load_index_scalar(ptr, mask, ASM: tl.constexpr):
    """One int32 index: :func:`load_index` of a scalar pointer. The pipeliner runs the ops feeding the K/V
    addresses of later tiles ahead of the loop's exit test and predicates only the loads it knows, so a
    pipelined PTX load must be masked with the loop condition itself."""
    if ASM:
        return tl.sum(load_index(ptr + tl.zeros([1], tl.int32), mask + tl.zeros([1], tl.int1), ASM), 0)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def softmax_step(q, k, v, keep, m_i, l_i, acc, PREC: tl.constexpr, MASKED: tl.constexpr = True):
    """One KV tile of online softmax in base 2 (the scale and log2(e) are folded into q);
    ``keep`` is ignored when not MASKED (tiles known to be entirely visible)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def rotated_q(q_rows, row_ok, COS, SIN, delta, scale, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """scale * R(-delta) q, [ROWS, HEAD_DIM] in fp32, from the original q (never un-rotate/re-rotate).

    HF rotate-half: R(-d) [q1, q2] = [q1 c + q2 s, q2 c - q1 s]. The two halves are loaded as
    two contiguous [ROWS, D/2] tiles and cos/sin as contiguous rows (16-byte loads; a partner
    index ``(d + D/2) % D`` defeated vectorisation), and joined back into one tile."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, HALF)
    ptrs = q_rows[:, None] + offs_h[None, :]
    x1 = tl.load(ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    c = (tl.load(COS + delta * HALF + offs_h) * scale)[None, :]
    sn = (tl.load(SIN + delta * HALF + offs_h) * scale)[None, :]
    r = tl.join(x1 * c + x2 * sn, x2 * c - x1 * sn)  # [ROWS, HALF, 2]
    return tl.reshape(tl.permute(r, (0, 2, 1)), (ROWS, HEAD_DIM))


@triton.jit
def _paged_tile(
    q,
    m_i,
    l_i,
    acc,
    K_CACHE,
    V_CACHE,
    phys,
    slot,
    kv_ok,
    kvh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    PREC: tl.constexpr,
):
    """Online softmax over one KV tile gathered from the paged cache: key n is slot ``slot[n]`` of physical
    block ``phys[n]``, read where ``kv_ok[n]``."""
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(
        K_CACHE + (phys * stride_kb + slot * stride_ks + kvh * stride_kh)[:, None] + offs_d[None, :],
        mask=kv_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V_CACHE + (phys * stride_vb + slot * stride_vs + kvh * stride_vh)[:, None] + offs_d[None, :],
        mask=kv_ok[:, None],
        other=0.0,
    )
    return softmax_step(q, k, v, kv_ok[None, :], m_i, l_i, acc, PREC)


@triton.jit
def _kv_tile(
    q,
    m_i,
    l_i,
    acc,
    K_CACHE,
    V_CACHE,
    meta_row,
    s0,
    s1,
    kvh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PREC: tl.constexpr,
):
    """Online softmax over the blocks [s0, s1) (at most BLOCK_N // BLOCK_SIZE of them)."""
    offs_n = tl.arange(0, BLOCK_N)
    slot = offs_n % BLOCK_SIZE
    page = s0 + offs_n // BLOCK_SIZE
    page_ok = page < s1
    # one int64 per page: physical id, delta and valid length in a single load
    meta = tl.load(meta_row + page, mask=page_ok, other=0)
    kv_ok = page_ok & (slot < meta_valid(meta))
    return _paged_tile(
        q,
        m_i,
        l_i,
        acc,
        K_CACHE,
        V_CACHE,
        meta_phys(meta),
        slot,
        kv_ok,
        kvh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        HEAD_DIM,
        PREC,
    )


@triton.jit
def _prefix_tile(
    q,
    m_i,
    l_i,
    acc,
    K_CACHE,
    V_CACHE,
    meta_row,
    s0,
    kv_ok,
    kvh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PREC: tl.constexpr,
    ASM_INDEX: tl.constexpr,
):
    """Online softmax over one tile-table tile: blocks from ``s0`` on, keys ``kv_ok`` (a prefix)."""
    offs_n = tl.arange(0, BLOCK_N)
    phys = meta_phys(load_index(meta_row + s0 + offs_n // BLOCK_SIZE, kv_ok, ASM_INDEX))
    return _paged_tile(
        q,
        m_i,
        l_i,
        acc,
        K_CACHE,
        V_CACHE,
        phys,
        offs_n % BLOCK_SIZE,
        kv_ok,
        kvh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        HEAD_DIM,
        PREC,
    )


@triton.jit
def split_tile_range(NUM_TILES, b, split, NUM_SPLITS):
    """[t_lo, t_hi): this split's share of sequence b's tile-table tiles."""
    n_t = tl.load(NUM_TILES + b)
    per_split = tl.cdiv(n_t, NUM_SPLITS)
    t_lo = split * per_split
    return t_lo, tl.minimum(t_lo + per_split, n_t)


@triton.jit
def kv_tile_loop(  # noqa: C901  (a JIT kernel: its branches on constexprs are resolved when it compiles)
    q_rows,
    row_ok,
    COS,
    SIN,
    qk_scale,
    m_i,
    l_i,
    acc,
    K_CACHE,
    V_CACHE,
    meta_row,
    tiles_row,
    t_lo,
    t_hi,
    nb,
    kvh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PREC: tl.constexpr,
    ROT: tl.constexpr,
    ROTATE: tl.constexpr,
    ASM_INDEX: tl.constexpr = False,
):
    """Online softmax of ``ROWS`` query rows (pointers ``q_rows`` to their first feature) over the tile-table
    tiles [t_lo, t_hi) of one sequence.

    ROT = 2: one flat loop over the tiles; q re-rotated only when the tile's delta differs from the previous
    tile's (q loop-carried in registers); each tile's blocks read from the block metas (decode of one or two
    sequences, whose splits hold few tiles).
    ROT = 5: ROT 2 with every per-tile index from the tile table's row (first block, valid keys, delta; the valid
    keys are a prefix of the tile, so the mask is one compare) and, with ASM_INDEX, read by :func:`load_index`'s
    inline PTX: nothing the pipeliner counts as a load lies between the loop counter and the K/V addresses, so
    with ``num_stages`` 3 the K/V copies run two tiles ahead instead of one.
    ROT = 7: per segment (the table's next-segment links) q rotated once, then ROT 5's loop over the segment's
    tiles: q is loop-invariant there, so Triton keeps it in shared memory for the MMA (a loop-carried q lives in
    registers and spills at 128-row tiles: NOTES §Kernels, round 9); the pipeline restarts at each segment.
    ROTATE = False: the same loops without the rotation (q only scaled, loaded inside the loop so that both
    compile alike): the rotation-off baseline that benchmarks/kernels.py times on K re-rotated in place. The
    engine always rotates.
    """
    dtype = q_rows.dtype.element_ty
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_rows[:, None] + offs_d[None, :]
    q_mask = row_ok[:, None]
    if ROT == 5:
        offs_n = tl.arange(0, BLOCK_N)
        q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
        d_prev = nb * 0 - 1
        for t in range(t_lo, t_hi):
            row = tiles_row + TILE_FIELDS * t
            live = t < t_hi  # see load_index_scalar
            s0 = load_index_scalar(row, live, ASM_INDEX)
            kv_ok = offs_n < load_index_scalar(row + 2, live, ASM_INDEX)  # a tile's valid keys are a prefix
            if ROTATE:
                d = load_index_scalar(row + 3, live, ASM_INDEX)
                if d != d_prev:
                    q = rotated_q(q_rows, row_ok, COS, SIN, d, qk_scale, ROWS, HEAD_DIM).to(dtype)
                    d_prev = d
            else:
                if t == t_lo:
                    q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
            m_i, l_i, acc = _prefix_tile(
                q,
                m_i,
                l_i,
                acc,
                K_CACHE,
                V_CACHE,
                meta_row,
                s0,
                kv_ok,
                kvh,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                BLOCK_SIZE,
                BLOCK_N,
                HEAD_DIM,
                PREC,
                ASM_INDEX,
            )
    elif ROT == 7:
        offs_n = tl.arange(0, BLOCK_N)
        t = t_lo
        while t < t_hi:
            seg = tiles_row + TILE_FIELDS * t
            t_next = tl.minimum(tl.load(seg + 1), t_hi)
            if ROTATE:
                q = rotated_q(q_rows, row_ok, COS, SIN, tl.load(seg + 3), qk_scale, ROWS, HEAD_DIM).to(dtype)
            else:
                q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
            for u in range(t, t_next):  # the segment's tiles: ROT 5's loop body, q loop-invariant
                row = tiles_row + TILE_FIELDS * u
                live = u < t_next  # see load_index_scalar
                s0 = load_index_scalar(row, live, ASM_INDEX)
                kv_ok = offs_n < load_index_scalar(row + 2, live, ASM_INDEX)
                m_i, l_i, acc = _prefix_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    K_CACHE,
                    V_CACHE,
                    meta_row,
                    s0,
                    kv_ok,
                    kvh,
                    stride_kb,
                    stride_ks,
                    stride_kh,
                    stride_vb,
                    stride_vs,
                    stride_vh,
                    BLOCK_SIZE,
                    BLOCK_N,
                    HEAD_DIM,
                    PREC,
                    ASM_INDEX,
                )
            t = t_next
    else:  # ROT == 2
        q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
        d_prev = nb * 0 - 1
        for t in range(t_lo, t_hi):
            s0 = tl.load(tiles_row + TILE_FIELDS * t)
            s1 = tl.load(tiles_row + TILE_FIELDS * (t + 1))
            if ROTATE:
                d = meta_delta(tl.load(meta_row + s0))
                if d != d_prev:
                    q = rotated_q(q_rows, row_ok, COS, SIN, d, qk_scale, ROWS, HEAD_DIM).to(dtype)
                    d_prev = d
            else:
                if t == t_lo:
                    q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
            m_i, l_i, acc = _kv_tile(
                q,
                m_i,
                l_i,
                acc,
                K_CACHE,
                V_CACHE,
                meta_row,
                s0,
                s1,
                kvh,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                BLOCK_SIZE,
                BLOCK_N,
                HEAD_DIM,
                PREC,
            )
    return m_i, l_i, acc


@triton.jit
def merge_splits_kernel(
    PART_ACC,
    PART_ML,
    OUT,
    stride_ob,
    stride_oh,
    Hq,
    n_rows,
    NUM_SPLITS,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Combine split partials [R0, Hq, NUM_SPLITS, (D | 2)] (unnormalised acc, base-2 max m,
    sum l) into OUT[r0, h]. Used by split decode (r0 = sequence) and split prefill (r0 = token).
    A program merges ``ROWS`` consecutive (r0, h) rows: their partials are one contiguous run."""
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    r_ok = offs_r < n_rows
    ok = r_ok[:, None] & (offs_s < NUM_SPLITS)[None, :]
    part = offs_r.to(tl.int64)[:, None] * NUM_SPLITS + offs_s[None, :]  # [ROWS, BLOCK_S]
    m = tl.load(PART_ML + part * 2, mask=ok, other=-1.0e30)
    l_part = tl.load(PART_ML + part * 2 + 1, mask=ok, other=0.0)
    acc = tl.load(PART_ACC + part[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
    # rescale each split to the row's common max (base-2 logits, as in the main kernels)
    w = tl.where(ok, tl.math.exp2(m - tl.max(m, 1)[:, None]), 0.0)
    l_sum = tl.sum(l_part * w, 1)
    out = tl.sum(acc * w[:, :, None], 1) / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # [ROWS, D]
    o_off = (offs_r // Hq).to(tl.int64) * stride_ob + (offs_r % Hq) * stride_oh
    tl.store(OUT + o_off[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=r_ok[:, None])


def merge_splits(part_acc, part_ml, out, splits: int, rows: int | None = None, num_warps: int | None = None) -> None:
    """Merge split partials into ``out`` (second launch); ``rows`` per program and ``num_warps`` default to the
    device's tuned ``merge`` entry (warps halved below head dim 128)."""
    R, Hq, D = out.shape
    if rows is None or num_warps is None:
        m = tuned(out.device)["merge"]
        rows = m["rows"] if rows is None else rows
        num_warps = num_warps or (m["warps"] if D >= 128 else max(1, m["warps"] // 2))
    n_rows = R * Hq
    merge_splits_kernel[(triton.cdiv(n_rows, rows),)](
        part_acc,
        part_ml,
        out,
        out.stride(0),
        out.stride(1),
        Hq,
        n_rows,
        splits,
        HEAD_DIM=D,
        BLOCK_S=triton.next_power_of_2(splits),
        ROWS=rows,
        num_warps=num_warps,
    )


# ---------------------------------------------------------------- launch helpers
@dataclass(frozen=True)
class KernelOptions:
    """Overrides of the attention kernels' tuned choices (``None``: the device's entry in tuned_configs.json),
    carried by the attention backend (``TritonAttention(options)``) into every plan. The engine runs the defaults;
    benchmarks and tests set these.

    ``prefill_kernel``: "wgmma" (kernels/prefill_wgmma.py, Hopper) or "triton"; ``None`` picks the wgmma kernel
    for an unsplit prefill on Hopper unless a Triton-kernel option below is set. ``*_config``: the kernel's config
    tuple; ``*_rotation_mode``: kv_tile_loop's schedule (2, 5 or 7); ``*_splits``: the context split count.
    ``merge``: (rows a program, warps) of the split merge. ``apply_rotation=False``: the rotation-off baseline
    (every delta treated as 0, for K re-rotated in place). ``tuned``: merged over the device's tuned table (same
    layout), e.g. a sweep's adopted defaults."""

    prefill_kernel: str | None = None
    prefill_config: tuple | None = None
    prefill_rotation_mode: int | None = None
    prefill_splits: int | None = None
    decode_config: tuple | None = None
    decode_rotation_mode: int | None = None
    decode_splits: int | None = None
    merge: tuple[int, int] | None = None
    apply_rotation: bool = True
    tuned: dict | None = field(default=None, hash=False, compare=False)


def merge_split_partials(plan, part_acc, part_ml, out) -> None:
    """A plan's split merge: its ``merge`` option, else the device's tuned one."""
    rows, warps = plan.merge if plan.merge is not None else (None, None)
    merge_splits(part_acc, part_ml, out, plan.splits, rows=rows, num_warps=warps)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_enabled() -> bool:
    """Timing every config costs tens of seconds of compiles per new shape, so it is opt-in
    (``LAZYRAG_KERNEL_AUTOTUNE=1``); by default each kernel takes its measured default config."""
    return os.environ.get("LAZYRAG_KERNEL_AUTOTUNE", "0") == "1"


_best_config: dict[tuple, tuple] = {}


def known_config(key, default):
    """The config :func:`pick_config` answers for ``key`` without timing anything: the one tuned for it, else
    ``default``; ``None`` when autotuning is on and ``key`` is not tuned yet (the first run times the candidates)."""
    if key in _best_config:
        return _best_config[key]
    return None if autotune_enabled() else default


def pick_config(key, launch, configs, default):
    """``default`` unless autotuning is on; then time each config once per key (do_bench), keep the fastest."""
    if key in _best_config:
        return _best_config[key]
    if not autotune_enabled():
        return default
    best, best_ms = None, float("inf")
    for cfg in configs:
        try:
            ms = triton.testing.do_bench(functools.partial(launch, cfg), warmup=5, rep=20, return_mode="median")
        except Exception:  # e.g. out of shared memory for this tile shape
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError("no kernel config could run")
    _best_config[key] = best
    return best


_sm_count: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


# compiled-kernel resources by launch name (registers, spills, shared memory, warps, programs per SM),
# recorded once per name; and the last launch of each kind (name, grid, splits), for the benchmark log
kernel_resources: dict[str, dict] = {}
last_launch: dict[str, tuple] = {}
# resident programs per SM by compiled variant (a key that excludes the split count, which depends on it),
# learned from the first launch of the variant; see programs_per_sm
_occupancy: dict[tuple, int] = {}


def blocks_per_sm(n_regs: int, num_warps: int, shared: int) -> int:
    """Resident programs per SM on Hopper from the compiled kernel's resources (65536 registers,
    allocated per warp in units of 256; 227 KB shared memory, 1 KB reserved per block; 64 warps)."""
    regs_per_warp = ((max(n_regs, 1) * 32 + 255) // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_smem = (227 * 1024) // (shared + 1024) if shared else 32
    return max(1, min(by_regs, by_smem, 64 // num_warps, 32))


def programs_per_sm(variant: tuple, assumed: int) -> int:
    """Resident programs per SM of a compiled ``variant`` (see record_launch), ``assumed`` before its first launch."""
    return _occupancy.get(variant, assumed)


def record_launch(kind: str, name: str, compiled, num_warps: int, grid, splits: int, variant: tuple | None = None):
    """Note a launch (cheap after the first of a name): the compiled kernel's resources once per name, and under
    ``variant`` the programs per SM that :func:`programs_per_sm` answers for this kernel from now on."""
    last_launch[kind] = (name, grid, splits)
    entry = kernel_resources.get(name)
    if entry is None and getattr(compiled, "n_regs", None):
        regs = compiled.n_regs
        shared = int(getattr(compiled.metadata, "shared", 0) or 0)
        entry = kernel_resources[name] = dict(
            regs=regs,
            spills=getattr(compiled, "n_spills", 0) or 0,
            shared=shared,
            num_warps=num_warps,
            blocks_per_sm=blocks_per_sm(regs, num_warps, shared),
        )
    if entry is not None and variant is not None:
        _occupancy.setdefault(variant, entry["blocks_per_sm"])


class Workspace:
    """Scratch memory reused across calls (split partials), so an eager call allocates nothing.
    One growing flat buffer per name; safe because kernels on one stream run in order. While a
    CUDA graph is being captured it allocates fresh tensors instead (the graph owns those; a
    shared buffer that later grew would hand freed graph-pool memory to another capture)."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, dtype, device) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.empty(shape, dtype=dtype, device=device)
        key = (name, dtype, str(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(max(n, 1), dtype=dtype, device=device)
        return buf[:n].view(shape)

    def split_partials(self, name: str, rows: int, heads: int, splits: int, head_dim: int, device, out: torch.Tensor):
        """A split kernel's per-split partials: the accumulators ``[rows, heads, splits, D]`` and (max, sum)
        pairs ``[rows, heads, splits, 2]`` that the merge reads. One split writes ``out`` itself: both are
        ``out`` then (passed, never read)."""
        if splits == 1:
            return out, out
        return (
            self.get(f"{name}_acc", (rows, heads, splits, head_dim), torch.float32, device),
            self.get(f"{name}_ml", (rows, heads, splits, 2), torch.float32, device),
        )


workspace = Workspace()
