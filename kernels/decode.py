"""LazyAttention decode: split-K flash-decoding over paged, position-free KV blocks.

Layout and semantics: see :mod:`lazyrag.kernels.reference` (``lazy_decode_reference``).

Grid (sequence, KV head, split). A program takes the ``G`` query heads that share one KV
head (so K/V is read once per group) over a contiguous range of the sequence's
segment-aligned KV tiles (:func:`lazyrag.kernels.kvloop.tile_table`). By default
(``rotation_mode=5``) it walks the tiles in one flat loop and rotates the G query rows again only
on a tile whose delta differs from the previous one's, so a document costs one rotation; no scratch
memory, scan or barrier; the tile indices are read as inline PTX so that the K/V copies run two tiles
ahead (``kvloop.load_index``). The kernel reads what plain paged decode reads: K, V, one int64 meta
per block, plus four int32 per tile. Splits write partial (m, l, acc); a small second kernel merges
them. The split count fills whole waves of the SMs at the kernel's real occupancy (its compiled
registers), and the default config caps registers at 128 so that 4 programs fit on an SM.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .kvloop import (
    OFF_TWIN, TABLE_MODES, blocks_per_sm, interpreting, kv_tile_loop, last_split_merges, merge_splits, num_sms,
    pick_config, programs_per_sm, record_launch, split_counters, split_tile_range, tile_table, workspace,
)


@triton.jit
def _lazy_decode_kernel(
    Q, K_CACHE, V_CACHE, META, NUM_BLOCKS, TILES, NUM_TILES, COS, SIN, OUT, PART_ACC, PART_ML, COUNTERS,
    qk_scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_mb, stride_tb, stride_ob, stride_oh,
    Hq, NUM_SPLITS,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ROT: tl.constexpr, IEEE: tl.constexpr, MERGE: tl.constexpr,
    ASM_INDEX: tl.constexpr,
):
    PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # -- this split's share of the sequence's KV tiles
    nb = tl.load(NUM_BLOCKS + b).to(tl.int32)
    tiles_row = TILES + b.to(tl.int64) * stride_tb
    t_lo, t_hi = split_tile_range(NUM_TILES, b, nb, split, NUM_SPLITS, PAGES, ROT)

    # -- the G query heads of this KV head, padded to BLOCK_G rows for tl.dot
    offs_g = tl.arange(0, BLOCK_G)
    row_ok = offs_g < G
    head = kvh * G + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    row_off = b.to(tl.int64) * stride_qb + head * stride_qh
    q_ptrs = Q + row_off[:, None] + offs_d[None, :]
    q_mask = row_ok[:, None]

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    meta_row = META + b.to(tl.int64) * stride_mb
    m_i, l_i, acc = kv_tile_loop(Q + row_off, row_ok, COS, SIN, qk_scale, m_i, l_i, acc, K_CACHE, V_CACHE, meta_row,
                                 tiles_row, t_lo, t_hi, nb, kvh,
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                 BLOCK_G, BLOCK_SIZE, BLOCK_N, HEAD_DIM, PREC, ROT, ASM_INDEX)

    o_ptrs = OUT + (b.to(tl.int64) * stride_ob + head * stride_oh)[:, None] + offs_d[None, :]
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
    else:
        # partials [B, Hq, NUM_SPLITS, (D | 2)] in fp32, merged by merge_splits_kernel, or (MERGE) by the
        # last split program of this (sequence, KV head) to finish
        part = (b.to(tl.int64) * Hq + head) * NUM_SPLITS + split
        tl.store(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(PART_ML + part * 2, m_i, mask=row_ok)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=row_ok)
        if MERGE:
            last_split_merges(COUNTERS + b * tl.num_programs(1) + kvh, PART_ACC, PART_ML, part - split, row_ok,
                              o_ptrs, NUM_SPLITS, HEAD_DIM, BLOCK_G)


# (BLOCK_N, num_warps, num_stages, maxnreg) tried by the autotuner; BLOCK_N is raised to the page size.
# maxnreg caps registers so that more programs fit on an SM (spills, if any, sit outside the loop).
CONFIGS = [
    (64, 4, 3, 128),
    (64, 4, 4, 128),
    (64, 4, 3, None),
    (32, 4, 3, None),
]
# defaults from the H200 sweeps (benchmarks/NOTES.md, rounds 3, 8 and 9): 4 programs per SM under the
# 128-register cap; the flat loop that re-rotates q only where the delta changes, its indices read as PTX so
# the K/V copies run two tiles ahead (ROT 5). Round 9 (paired rounds, 10 documents unless noted): against the
# plain rotation-off loop (ROT 0) ROT 5 is -2.8% (B=8, 32k), -2.1 / -0.4% (B=8, 8k, 10 / 1 docs), +0.1% (B=32)
# and +1.1% (B=64); round 8's ROT 2 +1.9-2.5% at B=8 and +0.7-1.1% at B >= 32.
DEFAULT_CONFIG = (64, 4, 3, 128)
DEFAULT_ROTATION_MODE = 5
# One or two sequences (B * Hkv programs before splitting at most SMALL_GRID_PROGRAMS) are latency-bound: each
# split holds ~2-3 tiles, so 64-key tiles cost more than they save. H200 sweep at the e2e shape (B=1, 2.6k
# context, 6 segments; round 6): 32-key tiles, ROT 2 and 32 splits 11.8 µs against 13.6 with the default config.
SMALL_GRID_PROGRAMS = 16
SMALL_GRID_CONFIG = (32, 4, 3, None)
SMALL_GRID_ROTATION_MODE = 2
# split partials merged by the last split program (kvloop.last_split_merges) instead of a second launch
DEFAULT_FUSED_MERGE = False


def _assumed_occupancy(cfg) -> int:
    bn, warps, stages, maxnreg = cfg
    return blocks_per_sm(maxnreg or 168, warps, 0)


@functools.lru_cache(maxsize=1024)  # called on every eager launch: keep the host path short
def choose_splits(n_programs: int, max_tiles: int, slots: int, min_tiles: int = 4, max_splits: int = 64) -> int:
    """Fewest splits whose programs fill the SMs' ``slots`` (resident programs) in whole waves.

    Each candidate's efficiency is programs / (waves * slots); the smallest split count within
    3% (relative) of the best wins (fewer splits, fewer partials to merge). Every split keeps at least
    ``min_tiles`` KV tiles so that the loop has something to pipeline."""
    cands = []
    for s in range(1, max_splits + 1):
        if s > 1 and max_tiles < s * min_tiles:
            break
        p = n_programs * s
        cands.append((p / (triton.cdiv(p, slots) * slots), s))
    best = max(e for e, _ in cands)
    return min(s for e, s in cands if e >= 0.97 * best)


def lazy_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_meta: torch.Tensor,
    num_blocks: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    sm_scale: float,
    apply_rotation: bool = True,
    num_splits: int | None = None,
    config: tuple | None = None,
    out: torch.Tensor | None = None,
    tile_cache: dict | None = None,
    rotation_mode: int | None = None,
    fused_merge: bool | None = None,
) -> torch.Tensor:
    """Triton version of :func:`lazyrag.kernels.reference.lazy_decode_reference`.

    ``apply_rotation=False`` skips the deferred rotation (for measuring its cost on pre-rotated
    KV in the same layout); ``num_splits=None`` fills whole waves of the SMs;
    ``config`` = (BLOCK_N, num_warps, num_stages[, maxnreg]). ``tile_cache``: a dict that lives
    as long as ``block_meta``/``num_blocks`` (one forward pass), so the tile table is built once
    for all layers. ``rotation_mode`` (``kvloop.kv_tile_loop``'s ROT): 1 rotates the G query rows
    on every tile, 2 in a flat loop when the delta changes, 3 once per segment ahead of a plain tile loop;
    ``None``: ``DEFAULT_ROTATION_MODE`` (``SMALL_GRID_ROTATION_MODE`` for one or two sequences, which also
    take ``SMALL_GRID_CONFIG``).
    """
    B, Hq, D = q.shape
    nb_total, block_size, Hkv, Dc = k_cache.shape
    assert Hq % Hkv == 0 and Dc == D and D in (64, 128)
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    G = Hq // Hkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    if block_meta.dtype != torch.int64:
        block_meta = block_meta.to(torch.int64)
    if rope_cos.dtype != torch.float32 or not rope_cos.is_contiguous():
        rope_cos, rope_sin = rope_cos.float().contiguous(), rope_sin.float().contiguous()
    if num_blocks.dtype != torch.int32 or num_blocks.device != q.device:
        num_blocks = num_blocks.to(device=q.device, dtype=torch.int32)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0:
        return out
    qk_scale = float(sm_scale) * 1.4426950408889634
    on_gpu = q.is_cuda and not interpreting()
    small_grid = on_gpu and B * Hkv <= SMALL_GRID_PROGRAMS
    if rotation_mode is None:
        rotation_mode = SMALL_GRID_ROTATION_MODE if small_grid else DEFAULT_ROTATION_MODE
    fused_merge = DEFAULT_FUSED_MERGE if fused_merge is None else fused_merge
    assert rotation_mode in OFF_TWIN, f"rotation_mode: one of {tuple(OFF_TWIN)} (see kvloop.kv_tile_loop)"
    rot = rotation_mode if apply_rotation else OFF_TWIN[rotation_mode]  # same loop, no rotation
    block_g = max(16, triton.next_power_of_2(G))
    W = block_meta.shape[1]

    def launch(cfg, splits=None):
        bn, warps, stages = cfg[:3]
        maxnreg = cfg[3] if len(cfg) > 3 else None
        bn = max(bn, block_size)
        pages = bn // block_size
        tiles, n_tiles = (tile_table(block_meta, num_blocks, pages, block_size, tile_cache) if rot in TABLE_MODES
                          else (block_meta, num_blocks))
        variant = ("decode", bn, warps, stages, maxnreg, rot, D, G, q.dtype)
        if splits is None:
            if not on_gpu:
                splits = max(1, min(4, triton.cdiv(W, pages)))
            else:
                slots = num_sms(q.device) * programs_per_sm(variant, _assumed_occupancy((bn, warps, stages, maxnreg)))
                splits = choose_splits(B * Hkv, triton.cdiv(W, pages), slots)
        splits = max(1, int(splits))
        if splits > 1:
            part_acc = workspace.get("decode_acc", (B, Hq, splits, D), torch.float32, q.device)
            part_ml = workspace.get("decode_ml", (B, Hq, splits, 2), torch.float32, q.device)
        else:
            part_acc = part_ml = out  # unused
        merge_here = fused_merge and splits > 1
        counters = split_counters(q.device, B * Hkv) if merge_here else num_blocks  # unused without the merge
        extra = {"maxnreg": maxnreg} if (on_gpu and maxnreg) else {}
        grid = (B, Hkv, splits)
        compiled = _lazy_decode_kernel[grid](
            q, k_cache, v_cache, block_meta, num_blocks, tiles, n_tiles, rope_cos, rope_sin, out, part_acc, part_ml,
            counters, qk_scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_meta.stride(0), tiles.stride(0), out.stride(0), out.stride(1),
            Hq, splits,
            G=G, BLOCK_G=block_g, HEAD_DIM=D, BLOCK_SIZE=block_size,
            BLOCK_N=bn, SPLIT=splits > 1, ROT=rot, IEEE=q.dtype == torch.float32, MERGE=merge_here,
            ASM_INDEX=on_gpu, num_warps=warps, num_stages=stages, **extra,
        )
        record_launch("decode", f"decode rot={rot} bn={bn} w={warps} s={stages} maxnreg={maxnreg} "
                      f"split={splits > 1} merge={merge_here}", compiled, warps, grid, splits, variant)
        if splits > 1 and not merge_here:
            merge_splits(part_acc, part_ml, out, splits)
        return splits

    if config is None:
        if not on_gpu:
            config = (16, 1, 1)
        else:
            key = ("decode", D, G, block_size, q.dtype, rot, num_splits, fused_merge,
                   triton.next_power_of_2(B * Hkv), triton.next_power_of_2(W))
            config = pick_config(key, lambda c: launch(c, num_splits), CONFIGS,
                                 SMALL_GRID_CONFIG if small_grid else DEFAULT_CONFIG)
    launch(config, num_splits)
    return out
