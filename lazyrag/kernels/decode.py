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

Plan / run as in :mod:`lazyrag.kernels.prefill`: :func:`plan_decode` once per forward, :func:`run_decode` per
layer, :func:`lazy_decode` both in one call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kvloop import (
    ROTATION_MODES,
    KernelOptions,
    blocks_per_sm,
    interpreting,
    known_config,
    kv_tile_loop,
    merge_split_partials,
    num_sms,
    pick_config,
    programs_per_sm,
    record_launch,
    split_tile_range,
    tile_table,
    workspace,
)
from .tuned import tuned as tuned_table


@triton.jit
def _lazy_decode_kernel(
    Q,
    K_CACHE,
    V_CACHE,
    META,
    NUM_BLOCKS,
    TILES,
    NUM_TILES,
    COS,
    SIN,
    OUT,
    PART_ACC,
    PART_ML,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_mb,
    stride_tb,
    stride_ob,
    stride_oh,
    Hq,
    NUM_SPLITS,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    ROT: tl.constexpr,
    ROTATE: tl.constexpr,
    IEEE: tl.constexpr,
    ASM_INDEX: tl.constexpr,
):
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # -- this split's share of the sequence's KV tiles
    nb = tl.load(NUM_BLOCKS + b).to(tl.int32)
    tiles_row = TILES + b.to(tl.int64) * stride_tb
    t_lo, t_hi = split_tile_range(NUM_TILES, b, split, NUM_SPLITS)

    # -- the G query heads of this KV head, padded to BLOCK_G rows for tl.dot
    offs_g = tl.arange(0, BLOCK_G)
    row_ok = offs_g < G
    head = kvh * G + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    row_off = b.to(tl.int64) * stride_qb + head * stride_qh
    q_mask = row_ok[:, None]

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    meta_row = META + b.to(tl.int64) * stride_mb
    m_i, l_i, acc = kv_tile_loop(
        Q + row_off,
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
        BLOCK_G,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        PREC,
        ROT,
        ROTATE,
        ASM_INDEX,
    )

    o_ptrs = OUT + (b.to(tl.int64) * stride_ob + head * stride_oh)[:, None] + offs_d[None, :]
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
    else:
        # partials [B, Hq, NUM_SPLITS, (D | 2)] in fp32, merged by merge_splits_kernel
        part = (b.to(tl.int64) * Hq + head) * NUM_SPLITS + split
        tl.store(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(PART_ML + part * 2, m_i, mask=row_ok)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=row_ok)


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


@dataclass
class DecodePlan:
    """One decode forward's choices, shared by all its layers (:func:`plan_decode`)."""

    config: tuple | None  # (BLOCK_N, num_warps, num_stages, maxnreg); None: autotuned at the first run
    rot: int  # kv_tile_loop's rotation schedule
    rotate: bool
    splits: int
    tiles: torch.Tensor | None
    n_tiles: torch.Tensor | None
    grid: tuple
    block_meta: torch.Tensor
    num_blocks: torch.Tensor
    G: int
    Hkv: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    on_gpu: bool
    requested_splits: int | None
    tile_cache: dict | None
    merge: tuple | None
    candidates: list
    key: tuple | None = None
    variant: tuple | None = None


def plan_decode(
    block_meta: torch.Tensor,
    num_blocks: torch.Tensor,
    *,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    options: KernelOptions = KernelOptions(),
    tile_cache: dict | None = None,
) -> DecodePlan:
    """Every choice of a decode forward that depends on its batch only, made once for all layers: config
    (tuned_configs.json; one or two sequences, ``B * Hkv <= small_grid_programs``, are latency-bound and take
    ``small_grid_config`` and ``small_grid_rotation_mode``), rotation schedule, splits (whole waves of the SMs at the
    kernel's occupancy) and the tile table (built into ``tile_cache``)."""
    assert num_heads % num_kv_heads == 0 and head_dim in (64, 128)
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    on_gpu = device.type == "cuda" and not interpreting()
    dt = tuned_table(device, options.tuned)["decode"]
    small_grid = on_gpu and batch * num_kv_heads <= dt["small_grid_programs"]
    rot = options.decode_rotation_mode
    if rot is None:
        rot = dt["small_grid_rotation_mode"] if small_grid else dt["rotation_mode"]
    assert rot in ROTATION_MODES, f"rotation_mode: one of {ROTATION_MODES} (see kvloop.kv_tile_loop)"
    if block_meta.dtype != torch.int64:
        block_meta = block_meta.to(torch.int64)
    if num_blocks.dtype != torch.int32 or num_blocks.device != device:
        num_blocks = num_blocks.to(device=device, dtype=torch.int32)
    plan = DecodePlan(
        None,
        rot,
        options.apply_rotation,
        1,
        None,
        None,
        (batch, num_kv_heads, 1),
        block_meta,
        num_blocks,
        num_heads // num_kv_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        on_gpu,
        options.decode_splits,
        tile_cache,
        options.merge,
        [tuple(c) for c in dt["candidates"]],
    )
    if batch == 0:
        return plan
    config = options.decode_config
    if config is None:
        if not on_gpu:
            config = (16, 1, 1)
        else:
            plan.key = (
                "decode",
                head_dim,
                plan.G,
                block_size,
                dtype,
                rot,
                plan.rotate,
                options.decode_splits,
                triton.next_power_of_2(batch * num_kv_heads),
                triton.next_power_of_2(block_meta.shape[1]),
            )
            config = known_config(plan.key, tuple(dt["small_grid_config"] if small_grid else dt["config"]))
    if config is not None:
        _layout(plan, tuple(config), device)
    return plan


def _layout(plan: DecodePlan, cfg: tuple, device: torch.device) -> None:
    """Tiles, splits and grid under ``cfg``."""
    bn, warps, stages = cfg[:3]
    maxnreg = cfg[3] if len(cfg) > 3 else None
    bn = max(bn, plan.block_size)
    pages = bn // plan.block_size
    B, W = plan.grid[0], plan.block_meta.shape[1]
    plan.tiles, plan.n_tiles = tile_table(plan.block_meta, plan.num_blocks, pages, plan.block_size, plan.tile_cache)
    plan.variant = ("decode", bn, warps, stages, maxnreg, plan.rot, plan.rotate, plan.head_dim, plan.G, plan.dtype)
    splits = plan.requested_splits
    if splits is None:
        if not plan.on_gpu:
            splits = max(1, min(4, triton.cdiv(W, pages)))
        else:
            slots = num_sms(device) * programs_per_sm(plan.variant, _assumed_occupancy((bn, warps, stages, maxnreg)))
            splits = choose_splits(B * plan.Hkv, triton.cdiv(W, pages), slots)
    plan.config = (bn, warps, stages, maxnreg)
    plan.splits = max(1, int(splits))
    plan.grid = (B, plan.Hkv, plan.splits)


def run_decode(
    plan: DecodePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's decode attention under ``plan`` (see :func:`lazy_decode` for the arguments)."""
    B, Hq, D = q.shape
    assert B == plan.grid[0] and Hq == plan.G * plan.Hkv and D == plan.head_dim
    assert tuple(k_cache.shape[1:]) == (plan.block_size, plan.Hkv, D)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    if rope_cos.dtype != torch.float32 or not rope_cos.is_contiguous():
        rope_cos, rope_sin = rope_cos.float().contiguous(), rope_sin.float().contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0:
        return out
    qk_scale = float(sm_scale) * 1.4426950408889634
    args = (q, k_cache, v_cache, rope_cos, rope_sin, qk_scale, out)
    if plan.config is None:  # autotuning (LAZYRAG_KERNEL_AUTOTUNE=1): each candidate timed on this layer's tensors

        def trial(cfg):
            _layout(plan, tuple(cfg), q.device)
            _launch(plan, *args)

        _layout(plan, tuple(pick_config(plan.key, trial, plan.candidates, None)), q.device)
    _launch(plan, *args)
    return out


def _launch(plan: DecodePlan, q, k_cache, v_cache, rope_cos, rope_sin, qk_scale, out) -> None:
    B, Hq, D = q.shape
    assert plan.config is not None and plan.tiles is not None, "a launch follows _layout"
    bn, warps, stages, maxnreg = plan.config
    splits = plan.splits
    part_acc, part_ml = workspace.split_partials("decode", B, Hq, splits, D, q.device, out)
    extra = {"maxnreg": maxnreg} if (plan.on_gpu and maxnreg) else {}
    compiled = _lazy_decode_kernel[plan.grid](
        q,
        k_cache,
        v_cache,
        plan.block_meta,
        plan.num_blocks,
        plan.tiles,
        plan.n_tiles,
        rope_cos,
        rope_sin,
        out,
        part_acc,
        part_ml,
        qk_scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        plan.block_meta.stride(0),
        plan.tiles.stride(0),
        out.stride(0),
        out.stride(1),
        Hq,
        splits,
        G=plan.G,
        BLOCK_G=max(16, triton.next_power_of_2(plan.G)),
        HEAD_DIM=D,
        BLOCK_SIZE=plan.block_size,
        BLOCK_N=bn,
        SPLIT=splits > 1,
        ROT=plan.rot,
        ROTATE=plan.rotate,
        IEEE=q.dtype == torch.float32,
        ASM_INDEX=plan.on_gpu,
        num_warps=warps,
        num_stages=stages,
        **extra,
    )
    record_launch(
        "decode",
        f"decode rot={plan.rot} rotate={plan.rotate} bn={bn} w={warps} s={stages} maxnreg={maxnreg} split={splits > 1}",
        compiled,
        warps,
        plan.grid,
        splits,
        plan.variant,
    )
    if splits > 1:
        merge_split_partials(plan, part_acc, part_ml, out)


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
    tuned: dict | None = None,
) -> torch.Tensor:
    """Triton version of :func:`lazyrag.kernels.reference.lazy_decode_reference`: :func:`plan_decode` and
    :func:`run_decode` in one call (tests, benchmarks; the engine plans once per forward).

    ``apply_rotation=False`` skips the deferred rotation (for measuring its cost on K re-rotated in place);
    ``num_splits=None`` fills whole waves of the SMs; ``config`` = (BLOCK_N, num_warps, num_stages[, maxnreg]);
    ``rotation_mode``: 2, 5 or 7 (``kvloop.kv_tile_loop``'s ROT); ``tuned``: merged over the device's tuned table
    (these are :class:`kvloop.KernelOptions`' ``decode_*`` fields). ``tile_cache``: a dict that lives as long as
    ``block_meta``/``num_blocks`` (one forward pass), so the tile table is built once for all layers."""
    options = KernelOptions(
        decode_config=config,
        decode_rotation_mode=rotation_mode,
        decode_splits=num_splits,
        apply_rotation=apply_rotation,
        tuned=tuned,
    )
    plan = plan_decode(
        block_meta,
        num_blocks,
        batch=q.shape[0],
        num_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        block_size=k_cache.shape[1],
        dtype=q.dtype,
        device=q.device,
        options=options,
        tile_cache=tile_cache,
    )
    return run_decode(plan, q, k_cache, v_cache, rope_cos, rope_sin, sm_scale, out=out)
