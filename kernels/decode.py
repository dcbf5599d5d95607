"""LazyAttention decode: split-K flash-decoding over paged, position-free KV blocks.

Layout and semantics: see :mod:`lazyrag.kernels.reference` (``lazy_decode_reference``).

Grid (sequence, KV head, split). A program takes the ``G`` query heads that share one KV
head (so K/V is read once per group) over a contiguous range of the sequence's blocks,
keeps the query rotated by ``-delta`` of the current segment and re-rotates only where
``delta`` changes. The packed meta is one int64 per block, so the kernel reads what plain
paged decode reads: K, V and one word per block. Splits write partial (m, l, acc); a
small second kernel merges them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .prefill import (
    DELTA_MASK, DELTA_SHIFT, PHYS_MASK, VALID_MASK, VALID_SHIFT,  # noqa: F401 (used in kernels)
    _block_delta, _interpreting, _pick_config, _rotated_q, _run_end,
)


@triton.jit
def _lazy_decode_kernel(
    Q, K_CACHE, V_CACHE, META, NUM_BLOCKS, COS, SIN, OUT, PART_ACC, PART_ML,
    qk_scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_mb, stride_ob, stride_oh,
    Hq, NUM_SPLITS,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    APPLY_ROT: tl.constexpr, IEEE: tl.constexpr, SCAN: tl.constexpr,
):
    PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
    HALF: tl.constexpr = HEAD_DIM // 2
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # -- this split's block range: whole KV tiles, so only the last tile of a sequence is partial
    nb = tl.load(NUM_BLOCKS + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(nb, NUM_SPLITS), PAGES) * PAGES
    lo = split * per_split
    hi = tl.minimum(lo + per_split, nb)

    # -- the G query heads of this KV head, padded to BLOCK_G rows for tl.dot
    offs_g = tl.arange(0, BLOCK_G)
    row_ok = offs_g < G
    head = kvh * G + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    row_off = b.to(tl.int64) * stride_qb + head * stride_qh
    q_ptrs = Q + row_off[:, None] + offs_d[None, :]
    q_mask = row_ok[:, None]
    dtype = Q.dtype.element_ty

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    meta_row = META + b.to(tl.int64) * stride_mb
    offs_n = tl.arange(0, BLOCK_N)
    page_in_tile = offs_n // BLOCK_SIZE
    slot = offs_n % BLOCK_SIZE
    if APPLY_ROT:
        # q rotated for the segment holding block lo; run_end = where that segment ends
        q = _rotated_q(q_ptrs, q_mask, COS, SIN, _block_delta(meta_row, lo, hi), qk_scale,
                       HEAD_DIM, IEEE).to(dtype)
        run_end = _run_end(meta_row, lo, hi, SCAN)
    else:
        q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
        run_end = hi
    for t in range(lo, hi, PAGES):
        page = t + page_in_tile
        page_ok = page < hi
        # one int64 per page: physical id, delta and valid length in a single load
        meta = tl.load(meta_row + page, mask=page_ok, other=0)
        phys = (meta & PHYS_MASK).to(tl.int64)
        valid = ((meta >> VALID_SHIFT) & VALID_MASK).to(tl.int32)
        kv_ok = page_ok & (slot < valid)
        k = tl.load(K_CACHE + (phys * stride_kb + slot * stride_ks + kvh * stride_kh)[:, None] + offs_d[None, :],
                    mask=kv_ok[:, None], other=0.0)
        v = tl.load(V_CACHE + (phys * stride_vb + slot * stride_vs + kvh * stride_vh)[:, None] + offs_d[None, :],
                    mask=kv_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if APPLY_ROT:
            # rare (scalar test): a new segment (document) starts inside this tile; score its
            # pages with q rotated for it (same K tile) and keep that q for the following tiles.
            # At most PAGES segments fit in a tile: unrolled, so the loop stays pipelinable.
            tile_end = tl.minimum(t + PAGES, hi)
            if run_end < tile_end:
                for _i in tl.static_range(PAGES):
                    if run_end < tile_end:
                        seg = run_end
                        q = _rotated_q(q_ptrs, q_mask, COS, SIN, _block_delta(meta_row, seg, hi), qk_scale,
                                       HEAD_DIM, IEEE).to(dtype)
                        run_end = _run_end(meta_row, seg, hi, SCAN)
                        s2 = tl.dot(q, tl.trans(k), input_precision=PREC)
                        in_seg = (page >= seg) & (page < run_end)
                        s = tl.where(in_seg[None, :], s2, s)
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        # -- online softmax in base 2 (scale and log2(e) are folded into q)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = OUT + (b.to(tl.int64) * stride_ob + head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
    else:
        # partials [B, Hq, NUM_SPLITS, (D | 2)] in fp32, merged by _merge_splits_kernel
        part = (b.to(tl.int64) * Hq + head) * NUM_SPLITS + split
        tl.store(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(PART_ML + part * 2, m_i, mask=row_ok)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    PART_ACC, PART_ML, OUT, stride_ob, stride_oh, Hq, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    part = (b.to(tl.int64) * Hq + h) * NUM_SPLITS + offs_s
    m = tl.load(PART_ML + part * 2, mask=s_ok, other=-1.0e30)
    l = tl.load(PART_ML + part * 2 + 1, mask=s_ok, other=0.0)
    # rescale each split to the common max (base-2 logits, as in the main kernel)
    m_max = tl.max(m, 0)
    w = tl.where(s_ok, tl.math.exp2(m - m_max), 0.0)
    l_sum = tl.sum(l * w, 0)
    acc = tl.load(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


# (BLOCK_N, num_warps, num_stages) tried on the GPU; BLOCK_N is raised to the page size.
_GPU_CONFIGS = [
    (64, 4, 3),
    (64, 4, 4),
    (32, 4, 4),
]
_sm_count: dict[int, int] = {}


def _auto_splits(batch: int, hkv: int, max_blocks: int, pages: int, device: torch.device) -> int:
    """Enough programs for ~2 waves over the SMs, but at least 4 KV tiles per split."""
    if device.type != "cuda":
        return max(1, min(4, triton.cdiv(max_blocks, pages)))
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    want = triton.cdiv(2 * _sm_count[idx], max(1, batch * hkv))
    return max(1, min(want, triton.cdiv(max_blocks, 4 * pages), 64))


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
    config: tuple[int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`lazyrag.kernels.reference.lazy_decode_reference`.

    ``apply_rotation=False`` skips the deferred rotation (for measuring its cost against
    pre-rotated KV); ``num_splits=None`` picks the split count from the batch, the block
    table width and the SM count; ``config`` = (BLOCK_N, num_warps, num_stages).
    """
    B, Hq, D = q.shape
    nb_total, block_size, Hkv, Dc = k_cache.shape
    assert Hq % Hkv == 0 and Dc == D and D in (64, 128)
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    G = Hq // Hkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_meta = block_meta.to(torch.int64)
    rope_cos = rope_cos.float().contiguous()
    rope_sin = rope_sin.float().contiguous()
    nblk = num_blocks.to(device=q.device, dtype=torch.int32)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0:
        return out
    qk_scale = float(sm_scale) * 1.4426950408889634
    on_gpu = q.is_cuda and not _interpreting()
    if config is None and not on_gpu:
        config = (16, 1, 1)
    pages_hint = max(config[0] if config else 64, block_size) // block_size
    if num_splits is None:
        num_splits = _auto_splits(B, Hkv, block_meta.shape[1], pages_hint, q.device)
    num_splits = max(1, int(num_splits))
    if num_splits > 1:
        part_acc = torch.empty(B, Hq, num_splits, D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(B, Hq, num_splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused

    def launch(cfg):
        bn, warps, stages = cfg
        bn = max(bn, block_size)
        _lazy_decode_kernel[(B, Hkv, num_splits)](
            q, k_cache, v_cache, block_meta, nblk, rope_cos, rope_sin, out, part_acc, part_ml,
            qk_scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_meta.stride(0), out.stride(0), out.stride(1),
            Hq, num_splits,
            G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), HEAD_DIM=D, BLOCK_SIZE=block_size,
            BLOCK_N=bn, SPLIT=num_splits > 1,
            APPLY_ROT=bool(apply_rotation), IEEE=q.dtype == torch.float32, SCAN=128,
            num_warps=warps, num_stages=stages,
        )
        if num_splits > 1:
            _merge_splits_kernel[(B, Hq)](
                part_acc, part_ml, out, out.stride(0), out.stride(1), Hq, num_splits,
                HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(num_splits),
                num_warps=4 if D >= 128 else 2,
            )

    if config is None:
        key = ("decode", D, G, block_size, q.dtype, bool(apply_rotation), num_splits > 1,
               triton.next_power_of_2(B * Hkv * num_splits), triton.next_power_of_2(block_meta.shape[1]))
        config = _pick_config(key, launch, _GPU_CONFIGS)
    launch(config)
    return out
