"""LazyAttention decode: split-K flash-decoding over paged, position-free KV blocks.

Layout and semantics: see :mod:`lazyrag.kernels.reference` (``lazy_decode_reference``).

Grid (sequence, KV head, split). A program takes the ``G`` query heads that share one KV
head (so K/V is read once per group) over a contiguous range of the sequence's blocks and
walks it segment by segment (as prefill): the query is rotated by ``-delta`` once per
segment, staged through a per-program scratch tile and reloaded, so the tile loop is the
rotation-free loop (23.5 KB shared memory on triton 3.6 instead of 79 KB for the old flat
loop with its unrolled boundary path). The packed meta is one int64 per block, so the kernel reads what plain
paged decode reads: K, V and one word per block. Splits write partial (m, l, acc); a
small second kernel merges them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .prefill import (
    _context_attention, _interpreting, _merge_splits_kernel, _num_sms, _pick_config,
)


@triton.jit
def _lazy_decode_kernel(
    Q, K_CACHE, V_CACHE, META, NUM_BLOCKS, COS, SIN, OUT, PART_ACC, PART_ML, SCR,
    qk_scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_mb, stride_ob, stride_oh,
    Hq, NUM_SPLITS,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    APPLY_ROT: tl.constexpr, IEEE: tl.constexpr, SCAN: tl.constexpr, STAGE_Q: tl.constexpr,
):
    PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
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

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    meta_row = META + b.to(tl.int64) * stride_mb
    pid_lin = (b * tl.num_programs(1) + kvh).to(tl.int64) * tl.num_programs(2) + split
    scr = SCR + pid_lin * (BLOCK_G * HEAD_DIM)  # this program's scratch tile (staged q)
    m_i, l_i, acc = _context_attention(q_ptrs, q_mask, scr, COS, SIN, qk_scale, m_i, l_i, acc, K_CACHE, V_CACHE,
                                       meta_row, lo, hi, kvh,
                                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                       BLOCK_G, BLOCK_SIZE, BLOCK_N, HEAD_DIM, PREC, APPLY_ROT, STAGE_Q, SCAN)

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


# (BLOCK_N, num_warps, num_stages) tried on the GPU; BLOCK_N is raised to the page size.
_GPU_CONFIGS = [
    (64, 4, 3),
    (64, 4, 4),
    (32, 4, 4),
]
def _auto_splits(batch: int, hkv: int, max_blocks: int, pages: int, device: torch.device) -> int:
    """Enough programs for ~2 waves over the SMs, but at least 4 KV tiles per split."""
    if device.type != "cuda":
        return max(1, min(4, triton.cdiv(max_blocks, pages)))
    want = triton.cdiv(2 * _num_sms(device), max(1, batch * hkv))
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
    stage_q: bool = False,
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

    block_g = max(16, triton.next_power_of_2(G))
    # per-program scratch tile for the staged rotated query (tiny, L2-resident)
    stage = bool(stage_q) and not apply_rotation
    scr = (torch.empty(B * Hkv * num_splits * block_g * D, device=q.device, dtype=q.dtype)
           if apply_rotation or stage else out)

    def launch(cfg):
        bn, warps, stages = cfg
        bn = max(bn, block_size)
        _lazy_decode_kernel[(B, Hkv, num_splits)](
            q, k_cache, v_cache, block_meta, nblk, rope_cos, rope_sin, out, part_acc, part_ml, scr,
            qk_scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_meta.stride(0), out.stride(0), out.stride(1),
            Hq, num_splits,
            G=G, BLOCK_G=block_g, HEAD_DIM=D, BLOCK_SIZE=block_size,
            BLOCK_N=bn, SPLIT=num_splits > 1,
            APPLY_ROT=bool(apply_rotation), IEEE=q.dtype == torch.float32, SCAN=128, STAGE_Q=stage,
            num_warps=warps, num_stages=stages,
        )
        if num_splits > 1:
            _merge_splits_kernel[(B, Hq)](
                part_acc, part_ml, out, out.stride(0), out.stride(1), Hq, num_splits,
                HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(num_splits),
                num_warps=4 if D >= 128 else 2,
            )

    if config is None:
        key = ("decode", D, G, block_size, q.dtype, bool(apply_rotation), stage, num_splits > 1,
               triton.next_power_of_2(B * Hkv * num_splits), triton.next_power_of_2(block_meta.shape[1]))
        config = _pick_config(key, launch, _GPU_CONFIGS)
    launch(config)
    return out
